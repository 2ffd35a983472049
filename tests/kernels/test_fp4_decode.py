"""The table decoder of the FP4 kernels (`trace_jax.kernels.fp4_decode`), off the GPU.

`prmt_jnp` against the PTX definition of `prmt.b32` (a numpy model written from the ISA text);
the whole decoder (`decode_words`: E4M3 scale, per-block tables, byte-permute lookups of the
codes held as words; the same instruction programs the GPU runs as inline assembly, here
executed as jnp integer ops) against `formats.nvfp4_dequantize(...).astype(dtype)`, bit for
bit, for every code byte under every block-scale byte, both table branches, tensor scales at
and across the fast branch's bounds, per-row scales, eager and jitted. NaN results are
compared as NaN (payloads may differ). The PTX renderings are checked for their operand
numbering.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax.kernels import fp4_decode
from trace_jax.quant import formats

# Every code byte (rows of 256 bytes = 32 blocks) under every scale byte (one per row).
CODES = np.tile(np.arange(256, dtype=np.uint8), (256, 1))
SCALE_BITS = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 32, axis=1)

# name: tensor scale. "fast" ones take the bf16 fast table, the others the exact one.
TENSOR_SCALES = {
    "one": 1.0,
    "random_mantissa": 0.3700000047683716,
    "quantizer_floor": 2.0**-100 / 2688,  # nvfp4_tensor_scale of an all-zero tensor
    "fast_low_edge": 2.0**-116,
    "below_fast": 2.0**-116 * 0.99,
    "fast_high_edge": np.nextafter(np.float32(2.0**118), np.float32(0)),
    "above_fast": 2.0**118,
    "tiny_c24": 2.0**-125 * 0.75,
    "subnormal": 2.0**-130,
    "huge_c_minus2": 2.0**126 * 1.3,
    "near_max": 3e38,
    "zero": 0.0,
    "negative_zero": -0.0,
    "negative": -2.5,
    "inf": np.inf,
    "nan": np.nan,
}
FAST = {"one", "random_mantissa", "quantizer_floor", "fast_low_edge", "fast_high_edge", "zero",
        "negative_zero", "negative", "inf", "nan"}


def _bits(x) -> np.ndarray:
  x = np.asarray(x)
  return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def _assert_same(got, want, what: str) -> None:
  g, w = np.asarray(got).astype(np.float32), np.asarray(want).astype(np.float32)
  nan = np.isnan(w)
  np.testing.assert_array_equal(np.isnan(g), nan, err_msg=f"{what}: NaN positions")
  gb, wb = _bits(got)[~nan], _bits(want)[~nan]
  bad = gb != wb
  assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.size} values differ; first "
                         f"got {gb[bad][0]:#06x}, want {wb[bad][0]:#06x}")


def _decode(codes, bits, ts, dtype, table=None):
  """The words decoder on code bytes [R, C] (as words), block-scale bytes [R, C // 8] and a
  tensor scale (scalar, or [R] per row) -> [R, 2 C] in dtype, natural element order."""
  r = codes.shape[0]
  w = fp4_decode.to_words(jnp.asarray(codes))
  factors = fp4_decode.tensor_scale_factors(ts)
  if jnp.ndim(ts):  # per-row scales
    factors = tuple(f.reshape(r, 1) for f in factors)
  return fp4_decode.decode_words(w[..., 0], w[..., 1], jnp.asarray(bits), dtype, asm=False,
                                 factors=factors, table=table)


_decode_jit = jax.jit(_decode, static_argnames=("dtype", "table"))


@functools.partial(jax.jit, static_argnames=("dtype",))
def _reference(codes, bits, ts, *, dtype):
  """`formats.nvfp4_dequantize` of the same bytes in dtype: [R, 2 C]."""
  r, c = codes.shape
  q = formats.NVFP4Tensor(
      codes=formats.unpack_fp4(codes.astype(jnp.uint8)),
      block_scale=jax.lax.bitcast_convert_type(bits.astype(jnp.uint8), jnp.float8_e4m3fn),
      tensor_scale=(ts.reshape(r, 1) if jnp.ndim(ts) else ts))
  return formats.nvfp4_dequantize(q).astype(dtype).reshape(r, 2 * c)


# ----------------------------------------------------------------------------- prmt

def _prmt_ptx(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
  """prmt.b32 d, a, b, c from the PTX ISA: tmp64 = (b << 32) | a; byte i of d is byte
  ctl[i] & 7 of tmp64, or its sign bit replicated when ctl[i] & 8; ctl[i] = c >> 4i & 0xF."""
  tmp = (b.astype(np.uint64) << np.uint64(32)) | a.astype(np.uint64)
  out = np.zeros(a.shape, np.uint64)
  for i in range(4):
    ctl = (c.astype(np.uint64) >> np.uint64(4 * i)) & np.uint64(0xF)
    byte = (tmp >> ((ctl & np.uint64(7)) * np.uint64(8))) & np.uint64(0xFF)
    rep = np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0))
    byte = np.where(ctl & np.uint64(8), rep, byte)
    out |= byte << np.uint64(8 * i)
  return out.astype(np.uint32)


def test_prmt_matches_ptx_definition():
  rng = np.random.default_rng(0)
  a, b, c = (rng.integers(0, 2**32, 4096, dtype=np.uint64).astype(np.uint32) for _ in range(3))
  got = np.asarray(fp4_decode.prmt_jnp(jnp.asarray(a), jnp.asarray(b), jnp.asarray(c)))
  np.testing.assert_array_equal(got, _prmt_ptx(a, b, c))
  for sel in (0x6420, 0x7531, 0x6402, 0x7513, 0x1504, 0x3726, 0x6240, 0x7351):  # the constants
    got = np.asarray(fp4_decode.prmt_jnp(jnp.asarray(a), jnp.asarray(b), sel))
    np.testing.assert_array_equal(got, _prmt_ptx(a, b, np.full_like(a, sel)))


# ----------------------------------------------------------------------------- decoder

@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", list(TENSOR_SCALES))
def test_every_code_and_scale_byte(name, dtype):
  """All 256 code bytes under all 256 E4M3 scale bytes (subnormal, negative, zero, NaN
  scales), jitted, against `formats`; bf16 takes the branch `tensor_scale_factors` picks."""
  ts = jnp.float32(TENSOR_SCALES[name])
  fast = bool(fp4_decode.tensor_scale_factors(ts)[0])
  if name != "subnormal":  # XLA's CPU runtime reads subnormals as 0 (fast there)
    assert fast == (name in FAST), name
  dt = jnp.dtype(dtype)
  got = _decode_jit(CODES, SCALE_BITS, ts, dtype=dt)
  _assert_same(got, _reference(CODES, SCALE_BITS, ts, dtype=dt), f"{name}/{dtype}")


@pytest.mark.parametrize("name", sorted(FAST))
def test_fast_and_exact_tables_agree(name):
  """Where the fast bf16 table is allowed, both branches give the same bits."""
  ts = jnp.float32(TENSOR_SCALES[name])
  fast = _decode_jit(CODES, SCALE_BITS, ts, dtype=jnp.dtype(jnp.bfloat16), table="fast")
  exact = _decode_jit(CODES, SCALE_BITS, ts, dtype=jnp.dtype(jnp.bfloat16), table="exact")
  _assert_same(fast, exact, name)


def test_fast_table_is_not_exact_outside_its_range():
  """The fast branch's bound is needed: below it the fast table differs somewhere (a full
  mantissa, so subnormal entries lose bits whether or not the backend flushes them)."""
  ts = jnp.float32(0.7654321 * 2.0**-123)
  dt = jnp.dtype(jnp.bfloat16)
  fast = _decode_jit(CODES, SCALE_BITS, ts, dtype=dt, table="fast")
  want = _reference(CODES, SCALE_BITS, ts, dtype=dt)
  assert (_bits(fast) != _bits(want)).any()


@pytest.mark.parametrize("rows", ["all_fast", "mixed"])
def test_per_row_scales(rows):
  """Per-row second-level scales (the KV cache's): one table branch per tile, exact either
  way ("mixed" holds rows outside the fast range, so the tile takes the exact table)."""
  rng = np.random.default_rng(1)
  lo_e, hi_e = (-110, 110) if rows == "all_fast" else (-135, 127)
  ts = np.exp2(rng.uniform(lo_e, hi_e, 256)).astype(np.float32) * rng.choice([-1, 1], 256)
  ts[::17] = 0.0
  ts = jnp.asarray(ts, jnp.float32)
  assert bool(jnp.all(fp4_decode.tensor_scale_factors(ts)[0])) == (rows == "all_fast")
  dt = jnp.dtype(jnp.bfloat16)
  got = _decode_jit(CODES, SCALE_BITS, ts, dtype=dt)
  _assert_same(got, _reference(CODES, SCALE_BITS, ts, dtype=dt), rows)


@pytest.mark.parametrize("name", ["random_mantissa", "below_fast"])
def test_eager_equals_reference(name):
  """Eager (op by op) on a slice of the exhaustive tile: the same bits as under jit."""
  ts = jnp.float32(TENSOR_SCALES[name])
  codes, bits = CODES[::8], SCALE_BITS[::8]  # 32 scale bytes x all code bytes
  got = _decode(codes, bits, ts, jnp.bfloat16)
  _assert_same(got, _reference(codes, bits, ts, dtype=jnp.dtype(jnp.bfloat16)), f"eager {name}")


def test_e4m3_to_f32_every_byte():
  byte = jnp.arange(256, dtype=jnp.uint8)
  got = np.asarray(fp4_decode.e4m3_to_f32(byte, asm=False))
  want = np.asarray(jax.lax.bitcast_convert_type(byte, jnp.float8_e4m3fn).astype(jnp.float32))
  nan = np.isnan(want)
  np.testing.assert_array_equal(np.isnan(got), nan)
  np.testing.assert_array_equal(_bits(got)[~nan], _bits(want)[~nan])


def test_bad_table_name():
  with pytest.raises(ValueError, match="table"):
    _decode(CODES[:1], SCALE_BITS[:1], jnp.float32(1), jnp.bfloat16, table="quick")


@pytest.mark.parametrize("name", ["one", "random_mantissa", "below_fast", "tiny_c24", "negative",
                                  "nan"])
def test_exact_table_every_code_and_scale_byte(name):
  """The exact table forced (any tensor scale): every code byte under every scale byte, bit
  for bit the reference's."""
  ts = jnp.float32(TENSOR_SCALES[name])
  got = _decode_jit(CODES, SCALE_BITS, ts, dtype=jnp.dtype(jnp.bfloat16), table="exact")
  _assert_same(got, _reference(CODES, SCALE_BITS, ts, dtype=jnp.dtype(jnp.bfloat16)),
               f"{name}/exact")


def test_mma_order_permutes_tile_and_rows_alike():
  """`mma_order` (decoded blocks) and `mma_order_columns` (the rows they meet) apply one
  permutation of each 64 columns: block b's 16 elements land on columns 2b, 2b+1 (+8, +16 s),
  the columns lane b of a quad holds in the MMA fragments."""
  cols = jnp.arange(128, dtype=jnp.int32)[None]
  tiled = fp4_decode.mma_order(cols.reshape(1, 8, 16))
  np.testing.assert_array_equal(np.asarray(tiled), np.asarray(fp4_decode.mma_order_columns(cols)))
  pos = np.argsort(np.asarray(tiled)[0])  # where natural column c went
  for b in range(4):
    lanes = {(p % 8) // 2 for p in pos[16 * b:16 * b + 16]}
    assert lanes == {b}, (b, sorted(pos[16 * b:16 * b + 16]))
  # Leading axes and bf16 rows: each row permuted alike, values untouched.
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 128)), jnp.bfloat16)
  got = np.asarray(fp4_decode.mma_order_columns(x)).astype(np.float32)
  np.testing.assert_array_equal(got, np.asarray(x).astype(np.float32)[..., np.asarray(tiled)[0]])
  with pytest.raises(ValueError, match="multiple of 64"):
    fp4_decode.mma_order_columns(jnp.zeros((2, 96)))


def test_words_round_trip_and_order():
  """to_words packs each block's 8 bytes little-endian into 2 words; from_words inverts it;
  the stack tree's leaf order is the 4-bit reversal (an involution)."""
  codes = jnp.asarray(CODES[:3])
  w = fp4_decode.to_words(codes)
  assert w.shape == (3, 32, 2) and w.dtype == jnp.uint32
  assert int(w[0, 0, 0]) == 0x03020100 and int(w[0, 0, 1]) == 0x07060504
  np.testing.assert_array_equal(np.asarray(fp4_decode.from_words(w)), CODES[:3])
  assert sorted(fp4_decode.bitrev4(i) for i in range(16)) == list(range(16))
  assert all(fp4_decode.bitrev4(fp4_decode.bitrev4(i)) == i for i in range(16))
  with pytest.raises(ValueError, match="blocks"):
    fp4_decode.to_words(codes[:, :12])


# ----------------------------------------------------------------------------- PTX text

def _operands(text: str) -> set[int]:
  return {int(n) for n in re.findall(r"\$(\d+)", text)}


def test_ptx_programs_use_their_operands():
  """The rendered inline assembly names exactly the operands Triton passes: tables: 1 result
  and the float32 inputs; lookups of words: 1 result, the block's word and its 4 tables;
  results assigned once."""
  for dtype, cvt in ((jnp.bfloat16, "cvt.rn.bf16x2.f32"), (jnp.float16, "cvt.rn.f16x2.f32")):
    for which in range(4):
      text = fp4_decode._asm_table_text(fp4_decode.exact_table_program, 8, dtype, which)
      assert _operands(text) == set(range(9)) and text.count(cvt) == 4
  for j in range(16):  # words: result $0 (16 bits), the block's word, 4 tables
    text = fp4_decode._asm_word_text(j)
    assert _operands(text) == {0, 1 + j // 8, 3, 4, 5, 6} and text.count("mov.b16 $0,") == 1
  text = fp4_decode._asm_table_text(fp4_decode.fast_table_program, 2, jnp.bfloat16, 0)
  assert _operands(text) == {0, 1, 2} and text.count("mul.rn.bf16x2") == 3
