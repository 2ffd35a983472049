"""Decode MoE grouped matmul (`trace_jax.kernels.fp4_moe`): packing and kernel.

Packing: `pack_nvfp4` / `dequantize` against `qat.fake_quant_weight` (bit for bit) and the
nibble order of `formats.pack_fp4`. Kernel: on CPU through the Pallas interpreter, on GPU the
Triton kernel itself (`interpret=None`) and the wgmma kernel (`impl="wgmma"`, GPU only),
against a float64 numpy product of the same weights
and against `grouped_matmul_reference` (dequantize + ragged_dot); in-kernel dequantization
bit for bit through one-hot rows; lowering to Triton IR checked on CPU.

Tolerance of a matmul output y against the exact float64 product r of the same (dequantized,
x.dtype) weights: every product of two bf16 values is exact in float32, so the only errors
are the float32 summation and the final rounding to x.dtype (half an ulp: 2**-8 |r| for bf16,
2**-24 |r| for float32). Round-to-nearest summation in any order is within
K * 2**-24 * S (S = sum_k |x_k w_k|); tensor cores may truncate and add in blocks, so the
bound allows K * 2**-22 * S. Kernel against ragged_dot: two such results, so twice the
summation term and one ulp (2**-7 |r|). A wrong weight is off by far more (the
deliberately broken cases below).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import numpy_ref
import pytest
from cases import adversarial_cases, assert_bits_equal

from trace_jax.kernels import common, fp4_moe
from trace_jax.kernels.fp4_moe import DecodeConfig
from trace_jax.quant import exact, formats, qat

E, N, K = 8, 64, 128
K_WGMMA = 256  # the wgmma kernel's K: a multiple of 256
M = 40  # not a multiple of the 16-row block
BLOCKS = dict(block_m=16, block_n=32, block_k=64)  # 2 N tiles, 2 K steps, several row blocks

# (name, group sizes over E experts): zeros, one expert with all rows, a group over one row
# block, the last expert holding rows, rows past sum(group_sizes) (zeros, as ragged_dot).
GROUPS = [
    ("mixed_with_empty", (3, 0, 9, 5, 0, 12, 7, 4)),
    ("one_expert_all_rows", (0, 0, 0, M, 0, 0, 0, 0)),
    ("group_over_one_block", (1, 33, 0, 0, 2, 0, 0, 4)),
    ("last_expert_only", (0, 0, 0, 0, 0, 0, 0, M)),
    ("trailing_rows", (2, 0, 5, 0, 0, 3, 0, 0)),
    ("all_empty", (0,) * E),
]
# (name, weight kind, DecodeConfig fields): the kernel per weight kind and table choices.
VARIANTS = [
    ("bf16", "bf16", {}),
    ("fp4", "fp4", {}),  # codes as bytes: the float16 decoder
    ("fp4_words", "fp4_words", {}),  # codes as words: one table per block, MMA order
    ("fp4_words_exact", "fp4_words", {"table": "exact"}),
    ("fp4_words_k32", "fp4_words", {"block_k": 32}),  # K tiles below 64: natural order
]
# The wgmma kernel (`wgmma_moe`: Mosaic GPU, inline PTX) runs on a Hopper GPU only; its CPU
# coverage is tests/kernels/test_wgmma_moe.py (every thread's registers from its PTX text).
WGMMA_VARIANTS = [
    ("fp4_wgmma", "fp4_words_k256", {"impl": "wgmma"}),  # the exact table
    ("fp4_wgmma_fast", "fp4_words_k256", {"impl": "wgmma", "table": "fast"}),
    ("fp4_wgmma_rows_8", "fp4_words_k256", {"impl": "wgmma", "block_m": 8}),  # passes of 8
]
ON_GPU = jax.default_backend() == "gpu"
_NO_WGMMA = ("wgmma_moe runs on a Hopper GPU only (its CPU coverage: "
             "tests/kernels/test_wgmma_moe.py)")


_pack = jax.jit(fp4_moe.pack_nvfp4)
_fake_quant = jax.jit(qat.fake_quant_weight)
_dequantize = jax.jit(fp4_moe.dequantize, static_argnums=1)
_quantize = jax.jit(lambda w: formats.nvfp4_quantize(w, formats.nvfp4_tensor_scale(w, (1, 2))))


@functools.cache
def _weights(dtype: str = "bfloat16", seed: int = 0, k: int = K) -> jax.Array:
  """[E, N, k] weights with per-expert and per-row magnitudes spread over 2**-8..2**4."""
  rng = np.random.default_rng(seed)
  w = rng.standard_normal((E, N, k)) * np.exp2(rng.integers(-8, 4, (E, N, 1)))
  return jnp.asarray(w, dtype)


@functools.cache
def _packed(dtype: str = "bfloat16", k: int = K) -> fp4_moe.PackedNVFP4Weights:
  return _pack(_weights(dtype, k=k))


def _x(m: int, dtype=jnp.bfloat16, seed: int = 1, k: int = K) -> jax.Array:
  return jnp.asarray(np.random.default_rng(seed).standard_normal((m, k)), dtype)


def _check_close(y, x, wd, sizes, what: str) -> None:
  """y against the float64 product of x and the (already dequantized) weights wd."""
  half_ulp = 2.0**-24 if y.dtype == jnp.float32 else 2.0**-8  # final rounding to y.dtype
  y, x, wd = (np.asarray(a, np.float64) for a in (y, x, wd))
  sizes = np.asarray(sizes)
  rows = int(sizes.sum())
  expert = np.repeat(np.arange(len(sizes)), sizes)
  r = np.zeros(y.shape)
  s = np.zeros(y.shape)
  r[:rows] = np.einsum("mk,mnk->mn", x[:rows], wd[expert])
  s[:rows] = np.einsum("mk,mnk->mn", np.abs(x[:rows]), np.abs(wd[expert]))
  bound = half_ulp * np.abs(r) + x.shape[1] * 2.0**-22 * s
  bad = np.abs(y - r) > bound
  assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.size} outputs off; first at "
                         f"{np.argwhere(bad)[0]}: got {y[bad][0]!r}, want {r[bad][0]!r}")


def _weights_of(kind: str):
  return {"fp4": _packed, "fp4_words": lambda: _packed().as_words(), "bf16": _weights,
          "fp4_words_k256": lambda: _packed(k=K_WGMMA).as_words()}[kind]()


def _run(kind: str, sizes, opts: dict, x=None):
  w = _weights_of(kind)
  x = _x(M, k=w.shape[-1]) if x is None else x
  gs = jnp.asarray(sizes, jnp.int32)
  return x, w, gs, fp4_moe.grouped_matmul_decode(x, w, gs, config=DecodeConfig(**opts))


def _kind(w) -> str:
  return "fp4" if isinstance(w, fp4_moe.PackedNVFP4Weights) else "bf16"


def _dequantized(w) -> jax.Array:
  return _dequantize(w, jnp.bfloat16) if _kind(w) == "fp4" else w


# ----------------------------------------------------------------------------- packing

def _random(rng):
  return rng.standard_normal((E, N, K)) * 0.02


def _zeros(rng):
  return np.zeros((E, N, K))


def _saturating(rng):
  """Each expert's largest block hits E4M3 448 and codes +-6; neighbours in their blocks."""
  w = rng.uniform(-1, 1, (E, N, K))
  w[:, ::3, ::16] = 37.0 * np.sign(rng.standard_normal((E, N // 3 + 1, K // 16)))
  return w


def _clamped_block_scales(rng):
  """Blocks far below their expert's amax: amax / 6 / ts < 2**-6, scales clamp to 2**-6."""
  w = rng.standard_normal((E, N, K)) * 1e-4
  w[:, 0, :16] = 100.0
  return w


def _zero_expert(rng):
  w = rng.standard_normal((E, N, K))
  w[2] = 0.0
  w[5, :, ::2] = -0.0
  return w


PACK_CASES = [("random", _random), ("zeros", _zeros), ("saturating", _saturating),
              ("clamped_block_scales", _clamped_block_scales), ("zero_expert", _zero_expert)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("name,make", PACK_CASES, ids=[c[0] for c in PACK_CASES])
def test_pack_matches_fake_quant(name, make, dtype):
  w = jnp.asarray(make(np.random.default_rng(3)), dtype)
  p = _pack(w)
  fp4_moe.check_packed(p)
  assert p.codes.shape == (E, N, K // 2) and p.block_scale.shape == (E, N, K // 16)
  assert p.tensor_scale.shape == (E,)
  assert_bits_equal(_dequantize(p, w.dtype), _fake_quant(w),
                    f"{name}: dequantize(pack) vs fake_quant_weight")
  # Nibble order of formats.pack_fp4: element 2i in the low nibble.
  q = _quantize(w)
  codes = np.asarray(q.codes)
  assert_bits_equal(p.codes, (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8),
                    f"{name}: packed codes")
  assert_bits_equal(p.block_scale, q.block_scale, f"{name}: block scales")
  bs = np.asarray(jax.lax.bitcast_convert_type(p.block_scale, jnp.uint8))
  if name == "saturating":
    assert (bs == 0x7E).any() and ((codes & 7) == 7).any()  # scale 448 and codes +-6 present
  if name == "clamped_block_scales":
    assert (bs == 0x08).mean() > 0.9  # 2**-6, E4M3's smallest normal
  if name == "zero_expert":
    assert (bs[2] == 0x08).all() and np.isin(codes[2], (0, 8)).all()


@pytest.mark.parametrize("name", ["e2m1_ties", "saturation_edge", "all_zero_blocks",
                                  "negative_zero"])
def test_pack_matches_fake_quant_adversarial(name):
  """The quantizer test suite's edge cases, stacked as 4 experts of [32, 256]."""
  w = jnp.asarray(adversarial_cases()[name].reshape(4, -1, 256), jnp.bfloat16)
  p = _pack(w)
  assert_bits_equal(_dequantize(p, w.dtype), _fake_quant(w),
                    f"{name}: dequantize(pack) vs fake_quant_weight")


def test_gate_up_pair_shares_the_tensor_scale():
  rng = np.random.default_rng(4)
  gate = jnp.asarray(rng.standard_normal((E, 32, K)), jnp.bfloat16)
  up = jnp.asarray(rng.standard_normal((E, 32, K)) * 8.0, jnp.bfloat16)  # a larger amax
  pg, pu = jax.jit(fp4_moe.pack_nvfp4_gate_up)(gate, up)
  both = _fake_quant(jnp.concatenate([gate, up], axis=1))
  assert_bits_equal(_dequantize(pg, jnp.bfloat16), both[:, :32], "gate")
  assert_bits_equal(_dequantize(pu, jnp.bfloat16), both[:, 32:], "up")
  assert_bits_equal(pg.tensor_scale, pu.tensor_scale, "shared tensor scale")
  alone = _pack(gate)  # packed on its own, gate gets a smaller scale
  assert (np.asarray(alone.tensor_scale) < np.asarray(pg.tensor_scale)).all()


def test_wrong_packing_is_detected():
  """Swapped nibbles (or a wrong tensor scale) must fail the bit-for-bit check."""
  w = _weights()
  p = _packed()
  want = _fake_quant(w)
  swapped = p.replace(codes=(p.codes >> 4) | (p.codes << 4))
  with pytest.raises(AssertionError, match="differ"):
    assert_bits_equal(_dequantize(swapped, w.dtype), want, "swapped nibbles")
  scaled = p.replace(tensor_scale=p.tensor_scale * np.float32(1.0 + 2.0**-20))
  with pytest.raises(AssertionError, match="differ"):
    assert_bits_equal(_dequantize(scaled, w.dtype), want, "tensor scale off")


def test_check_packed_rejects_bad_fields():
  p = _packed()
  with pytest.raises(ValueError, match="block_scale"):
    fp4_moe.check_packed(p.replace(block_scale=p.block_scale[:, :, :-1]))
  with pytest.raises(ValueError, match="tensor_scale"):
    fp4_moe.check_packed(p.replace(tensor_scale=p.tensor_scale.reshape(E, 1, 1)))
  with pytest.raises(TypeError, match="codes"):
    fp4_moe.check_packed(p.replace(codes=p.codes.astype(jnp.int32)))


# ----------------------------------------------------------------------------- decoding

@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_decode_helpers_are_exact(jit):
  """The kernel's E2M1 (all 256 bytes) and E4M3 (all 256 bytes, subnormals and NaN
  included) decoders against `formats` / `exact`, bit for bit."""
  byte = jnp.arange(256, dtype=jnp.uint8)
  pair = jax.jit(fp4_moe.e2m1_pair_scaled) if jit else fp4_moe.e2m1_pair_scaled
  lo, hi = pair(byte)
  want = formats.e2m1_decode(formats.unpack_fp4(byte[:, None])) * np.float32(2.0**-14)
  assert_bits_equal(lo, want[:, 0], "low nibble")
  assert_bits_equal(hi, want[:, 1], "high nibble")
  scale = jax.lax.bitcast_convert_type(byte, jnp.float8_e4m3fn)
  dec = jax.jit(fp4_moe.e4m3_value_scaled) if jit else fp4_moe.e4m3_value_scaled
  assert_bits_equal(dec(scale), exact.e4m3_value(scale) * np.float32(2.0**14), "e4m3")


# (name, DecodeConfig fields, block_n, block_k): codes as bytes (the float16 decoder) or as
# words (the name's prefix; the table decoder); both run the Triton kernel on the GPU.
DEQUANT_CASES = [
    ("bytes", {}, 16, 32),
    ("words", {}, 32, 64),
    ("words_exact", {"table": "exact"}, 32, 64),
]


@pytest.mark.parametrize("name,opts,block_n,block_k", DEQUANT_CASES,
                         ids=[c[0] for c in DEQUANT_CASES])
def test_kernel_dequantizes_bit_exactly(name, opts, block_n, block_k):
  """One-hot rows make every output one weight times 1 (exact): the kernel's in-register
  weights equal `dequantize` for random packed bytes (every code, every finite E4M3 scale
  byte, subnormal ones included) — up to the sign of zero, which a sum does not keep. The
  last expert's tensor scale (2**-118) lies outside the words decoder's fast table range, so
  its program takes the exact table (its scale bytes are >= 1, so no weight is subnormal)."""
  e, n, k = 4, 32, 64
  rng = np.random.default_rng(5)
  scale_bytes = rng.integers(0, 0x7F, (e, n, k // 16)) | (rng.integers(0, 2, (e, n, k // 16))
                                                           << 7)
  scale_bytes[-1] = rng.integers(0x38, 0x7F, (n, k // 16))
  ts = np.exp2(rng.uniform(-12, 4, e))
  ts[-1] = 2.0**-118
  p = fp4_moe.PackedNVFP4Weights(
      codes=jnp.asarray(rng.integers(0, 256, (e, n, k // 2)), jnp.uint8),
      block_scale=jax.lax.bitcast_convert_type(jnp.asarray(scale_bytes, jnp.uint8),
                                               jnp.float8_e4m3fn),
      tensor_scale=jnp.asarray(ts, jnp.float32))
  if name.startswith("words"):
    p = p.as_words()
  x = jnp.tile(jnp.eye(k, dtype=jnp.bfloat16), (e, 1))  # expert i gets the k one-hot rows
  y = fp4_moe.grouped_matmul_decode(x, p, jnp.full((e,), k, jnp.int32), config=DecodeConfig(
      block_m=16, block_n=block_n, block_k=block_k, **opts))
  want = np.asarray(_dequantize(p, jnp.bfloat16), np.float32).transpose(0, 2, 1)
  got = np.asarray(y, np.float32).reshape(e, k, n)
  assert np.array_equal(got, want), f"{name}: {int((got != want).sum())} weights differ"
  assert (np.asarray(scale_bytes) & 0x78 == 0).any()  # subnormal E4M3 scales were covered


# (name, table, rows per pass).
WGMMA_DEQUANT_CASES = [("exact", "exact", 128), ("exact_rows_16", "exact", 16),
                       ("fast", "fast", 128)]


@pytest.mark.parametrize("name,table,rows", WGMMA_DEQUANT_CASES,
                         ids=[c[0] for c in WGMMA_DEQUANT_CASES])
def test_wgmma_kernel_dequantizes_bit_exactly(name, table, rows):
  """The wgmma kernel's weights through one-hot rows (as above), over 6 K chunks (its x ring
  of 4 and its codes' ring of 4 refilled) and 2 feature tiles: random code and scale bytes
  under tensor scales across the exact table's branches (2**-130 and 1.5 * 2**126 scaled by
  powers of two, 2**-118 below the fast range) for the exact table; for the fast one, scales
  inside its range. The reference is numpy's IEEE float32 (`_dequantized_ieee`), which the
  GPU's XLA agrees with (no flushing)."""
  if not ON_GPU:
    pytest.skip(_NO_WGMMA)
  e, n, k = 4, 128, 768
  rng = np.random.default_rng(7)
  # (tensor scale, E4M3 scale byte range): every weight normal and finite (a one-hot row
  # multiplies all of its weight row, so one NaN or inf would hide the others); any sign.
  experts = [(2.0**-130, 0x60, 0x7E), (2.0**-118, 0x08, 0x7E), (1.5 * 2.0**126, 0x01, 0x2C),
             (0.37, 0x00, 0x7E)] if table == "exact" else \
      [(2.0**-12, 0x00, 0x7E), (2.0**-7, 0x00, 0x7E), (0.37, 0x00, 0x7E), (3.0, 0x00, 0x7E)]
  scale_bytes = np.stack([rng.integers(lo, hi + 1, (n, k // 16)) for _, lo, hi in experts])
  scale_bytes |= rng.integers(0, 2, scale_bytes.shape) << 7
  p = fp4_moe.PackedNVFP4Weights(
      codes=jnp.asarray(rng.integers(0, 256, (e, n, k // 2)), jnp.uint8),
      block_scale=jax.lax.bitcast_convert_type(jnp.asarray(scale_bytes, jnp.uint8),
                                               jnp.float8_e4m3fn),
      tensor_scale=jnp.asarray([t for t, _, _ in experts], jnp.float32)).as_words()
  x = jnp.tile(jnp.eye(k, dtype=jnp.bfloat16), (e, 1))
  y = fp4_moe.grouped_matmul_decode(x, p, jnp.full((e,), k, jnp.int32),
                                    config=DecodeConfig(impl="wgmma", block_m=rows, table=table))
  want = _dequantized_ieee(p).astype(np.float32).transpose(0, 2, 1)
  assert np.isfinite(want).all() and not (np.abs(want) < 2.0**-126)[want != 0].any()
  got = np.asarray(y, np.float32).reshape(e, k, n)
  bad = got != want
  assert not bad.any(), f"{name}: {int(bad.sum())} weights differ, first {np.argwhere(bad)[0]}"


def _dequantized_ieee(p: fp4_moe.PackedNVFP4Weights) -> np.ndarray:
  """`numpy_ref.dequantize_packed_nvfp4` of packed weights (IEEE float32, subnormals kept)."""
  return numpy_ref.dequantize_packed_nvfp4(
      np.asarray(p.as_bytes().codes),
      np.asarray(jax.lax.bitcast_convert_type(p.block_scale, jnp.uint8)), p.tensor_scale)


# ----------------------------------------------------------------------------- matmul

@pytest.mark.parametrize("variant,kind,opts", VARIANTS + WGMMA_VARIANTS,
                         ids=[v[0] for v in VARIANTS + WGMMA_VARIANTS])
@pytest.mark.parametrize("group,sizes", GROUPS, ids=[g[0] for g in GROUPS])
def test_matches_reference(group, sizes, variant, kind, opts):
  if opts.get("impl") == "wgmma" and not ON_GPU:
    pytest.skip(_NO_WGMMA)
  x, w, gs, y = _run(kind, sizes, {**BLOCKS, **opts})
  assert y.shape == (M, N) and y.dtype == x.dtype
  wd = _dequantized(w)
  _check_close(y, x, wd, sizes, f"{variant}/{group} vs float64")
  r = fp4_moe.grouped_matmul_reference(x, w, gs)
  y64, r64 = np.asarray(y, np.float64), np.asarray(r, np.float64)
  s = np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(wd, np.float64)).max(0).T
  k = x.shape[1]
  assert np.all(np.abs(y64 - r64) <= 2.0**-7 * np.abs(r64) + 2 * k * 2.0**-22 * s), \
      f"{variant}/{group}: max |kernel - ragged_dot| {np.abs(y64 - r64).max()}"
  rows = int(np.sum(sizes))
  assert not np.asarray(y[rows:]).any(), "rows past sum(group_sizes) must be zero"


def test_float32_rows_and_weights():
  sizes = GROUPS[0][1]
  x = _x(M, jnp.float32)
  gs = jnp.asarray(sizes, jnp.int32)
  for w in (_weights("float32"), _packed("float32")):
    y = fp4_moe.grouped_matmul_decode(x, w, gs, config=DecodeConfig(**BLOCKS))
    assert y.dtype == jnp.float32
    wd = _dequantize(w, jnp.float32) if _kind(w) == "fp4" else w
    _check_close(y, x, wd, sizes, f"float32 {_kind(w)}")


def test_words_hold_the_same_bytes():
  """`as_words` keeps every code byte (little-endian words per block) and the logical shape;
  `as_bytes` inverts it; codes held as words decode to bf16/f16 rows only."""
  p = _packed()
  w = p.as_words()
  assert w.words and not p.words and w.shape == p.shape and w.codes.shape == (E, N, K // 16, 2)
  assert_bits_equal(w.as_bytes().codes, p.codes, "as_bytes(as_words)")
  assert w.as_words() is w and p.as_bytes() is p
  first = int(np.asarray(p.codes[0, 0, :4]).view("<u4")[0])
  assert int(w.codes[0, 0, 0, 0]) == first
  assert_bits_equal(fp4_moe.dequantize(w, jnp.bfloat16), fp4_moe.dequantize(p, jnp.bfloat16),
                    "dequantize(words)")
  x, gs = _x(M), jnp.asarray(GROUPS[0][1], jnp.int32)
  with pytest.raises(ValueError, match="bf16"):
    fp4_moe.grouped_matmul_decode(x.astype(jnp.float32), w, gs, config=DecodeConfig(**BLOCKS))


def test_wrong_weights_fail_the_comparison():
  """The matmul check can fail: the kernel on nibble-swapped codes is far from the truth."""
  sizes = GROUPS[0][1]
  p = _packed()
  swapped = p.replace(codes=(p.codes >> 4) | (p.codes << 4))
  x = _x(M)
  y = fp4_moe.grouped_matmul_decode(x, swapped, jnp.asarray(sizes, jnp.int32),
                                    config=DecodeConfig(**BLOCKS))
  with pytest.raises(AssertionError, match="outputs off"):
    _check_close(y, x, _dequantize(p, jnp.bfloat16), sizes, "swapped")


def test_bad_arguments():
  x, w = _x(M), _weights()
  gs = jnp.asarray(GROUPS[0][1], jnp.int32)
  with pytest.raises(ValueError, match="disagree on K"):
    fp4_moe.grouped_matmul_decode(x[:, :64], w, gs)
  with pytest.raises(ValueError, match="group_sizes"):
    fp4_moe.grouped_matmul_decode(x, w, gs[:4])
  with pytest.raises(ValueError, match="power of two"):
    fp4_moe.grouped_matmul_decode(x, w, gs, config=DecodeConfig(block_m=24))
  with pytest.raises(ValueError, match="block_n must be a power of two"):
    DecodeConfig(block_n=48)
  with pytest.raises(ValueError, match="table must be one of"):
    DecodeConfig(table="quick")
  with pytest.raises(TypeError, match="dtype"):
    fp4_moe.grouped_matmul_decode(x.astype(jnp.int32), w, gs)


# ----------------------------------------------------------------------------- Triton IR

@pytest.mark.parametrize("variant,kind,opts", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_lowers_to_triton(variant, kind, opts):
  """The kernel passes Pallas' Triton lowering (power-of-two values, supported primitives)
  for the CUDA platform, on any host; Triton's own compilation needs the GPU run."""
  w = _weights_of(kind)
  f = functools.partial(fp4_moe.grouped_matmul_decode,
                        config=DecodeConfig(interpret=False, **opts))
  text = jax.jit(f).trace(_x(M), w, jnp.zeros((E,), jnp.int32)).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "triton" in text


@pytest.mark.parametrize("kind", ["bf16", "fp4", "fp4_words"])
def test_stacked_layer_is_read_in_place(kind):
  """`layer=` on a stack of 3 layers' weights (a traced index, as inside a scan over layers):
  bit for bit the call on that layer's weights alone, for every layer; a wrong stack shape is
  refused."""
  per_layer = [_weights(seed=s) for s in (0, 5, 6)]
  if kind != "bf16":
    per_layer = [_pack(w) for w in per_layer]
    per_layer = [p.as_words() for p in per_layer] if kind == "fp4_words" else per_layer
  stack = jax.tree.map(lambda *a: jnp.stack(a), *per_layer)
  x, gs = _x(M), jnp.asarray(GROUPS[0][1], jnp.int32)
  config = DecodeConfig(**BLOCKS)
  run = jax.jit(lambda x, w, gs, i: fp4_moe.grouped_matmul_decode(x, w, gs, layer=i,
                                                                  config=config))
  outs = [np.asarray(run(x, stack, gs, jnp.int32(i))) for i in range(3)]
  for i, w in enumerate(per_layer):
    alone = fp4_moe.grouped_matmul_decode(x, w, gs, config=config)
    assert_bits_equal(outs[i], alone, f"{kind}: layer {i} of the stack vs alone")
  assert not np.array_equal(outs[0], outs[1])  # the index does select another layer
  with pytest.raises((ValueError, TypeError), match=r"\[L, E, N, K"):
    fp4_moe.grouped_matmul_decode(x, per_layer[0], gs, layer=jnp.int32(0))


@pytest.mark.parametrize("n, experts, want", [
    pytest.param(4096, 1, 16, id="q_proj_one_expert"),    # 64 programs at 64 rows -> 256
    pytest.param(2048, 1, 16, id="o_proj_one_expert"),    # stops at the floor: 128 programs
    pytest.param(1536, 64, 64, id="gate_up_64_experts"),  # 1536 programs: unchanged
    pytest.param(48, 1, 16, id="odd_width"),              # largest power of two dividing 48
])
def test_default_block_n_fills_the_gpu_for_few_experts(n, experts, want):
  bn = common.default_block_n(n, experts)
  assert bn == want and n % bn == 0
  assert experts * (n // bn) >= common.MIN_PROGRAMS or bn == 16 or n % (bn // 2)
