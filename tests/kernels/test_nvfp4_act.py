"""One-kernel NVFP4 activation quantize-dequantize (`trace_jax.kernels.nvfp4_act`).

The kernel runs as `interpret=None` picks it: the Pallas interpreter on CPU, the Triton kernel
itself on the GPU. Every field bit for bit against `formats` (jitted: eager `formats` raises on
NaN/Inf) and against an independent numpy float32 / ml_dtypes reference (IEEE float32
division, ml_dtypes' E4M3 and E2M1 rounding), on random rows and hand-built adversarial rows;
controls that show the comparison can fail; the kernel-local helpers against `exact` and
ml_dtypes; lowering to Triton IR for CUDA, traced as on the GPU. Shapes stay tiny and shared
(one interpreter compile per shape and dtype).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from cases import assert_bits_equal, to_numpy

from tests.kernels.nvfp4_rows import (
  ADV_K,
  ADV_ROWS,
  ADVERSARIAL,
  DTYPES,
  F32,
  adversarial_input,
  ties_pow2,
)
from trace_jax.kernels import common, nvfp4_act
from trace_jax.quant import exact, formats, guided

E4M3 = ml_dtypes.float8_e4m3fn
E2M1 = ml_dtypes.float4_e2m1fn
ADV_BLOCK_M = 2  # adversarial cases: 3 programs, the last one partial

_reference = jax.jit(nvfp4_act.reference)


# ----------------------------------------------------------------------------- references

def _fields(y, q: formats.NVFP4Tensor, bits=None) -> dict[str, np.ndarray]:
  """The compared fields as numpy: scales first (they explain code mismatches); the mantissa
  bits (the compact record's payload) are the kernel's own or, for references, numpy's
  little-endian packing of the codes' low bits."""
  codes = to_numpy(q.codes)
  bits = _packbits(codes) if bits is None else np.asarray(bits)
  return {"tensor_scale": to_numpy(q.tensor_scale), "block_scale": to_numpy(q.block_scale),
          "codes": codes, "y": np.asarray(y).astype(F32), "mantissa": bits}  # y: exact widening


def _packbits(codes: np.ndarray) -> np.ndarray:
  """Element 8i + j of a row is bit j of byte i (`guided.pack_bits`'s order), by numpy."""
  return np.packbits(codes & 1, axis=-1, bitorder="little")


def _numpy_reference(x: np.ndarray, block: int = formats.NVFP4_BLOCK) -> dict[str, np.ndarray]:
  """Independent NVFP4 two-level reference for finite rows: numpy float32 arithmetic (IEEE
  division) and ml_dtypes rounding. Returns `_fields`' keys; y in float32 after a round trip
  through x's dtype."""
  dt = np.asarray(x).dtype
  xf = np.asarray(x).astype(F32)
  xf = np.where(np.abs(xf) < F32(2.0**-126), np.copysign(F32(0.0), xf), xf).astype(F32)
  m, k = xf.shape
  xb = xf.reshape(m, k // block, block)
  with np.errstate(all="ignore"):
    amax = np.abs(xb).max(axis=-1)
    ts = np.maximum(amax.max(axis=-1, keepdims=True), F32(2.0**-100)) / F32(2688.0)
    bs = np.clip((amax / F32(6.0)) / ts, F32(2.0**-6), F32(448.0)).astype(E4M3)
    bsf = bs.astype(F32)
    inv = (F32(1.0) / ts) / bsf
    codes = np.clip(xb * inv[..., None], F32(-6.0), F32(6.0)).astype(E2M1)
    y = (codes.astype(F32) * bsf[..., None]) * ts[..., None]
  codes = codes.view(np.uint8).reshape(m, k)
  return {"tensor_scale": ts.astype(F32), "block_scale": bs.view(np.uint8), "codes": codes,
          "y": y.reshape(m, k).astype(dt).astype(F32), "mantissa": _packbits(codes)}


def _assert_fields(got: dict, want: dict, what: str, x: np.ndarray,
                   rows: np.ndarray | None = None) -> None:
  """Every field of `want` bit for bit (NaNs canonical), on `rows` only if given."""
  xf = np.asarray(x).astype(F32)
  for name, w in want.items():
    g = got[name]
    if rows is not None:
      g, w = g[rows], w[rows]
    ctx_x = xf[rows] if rows is not None else xf
    ctx = {"x": ctx_x.reshape(g.shape + (-1,)) if name != "y" else ctx_x}
    assert_bits_equal(g, w, f"{what}: {name}", ctx)


def _run(x: jax.Array, **kw) -> dict[str, np.ndarray]:
  y, q, bits = nvfp4_act.quantize_rows(x, mantissa=True, **kw)
  assert y.dtype == x.dtype and y.shape == x.shape
  m, k = x.shape
  assert q.codes.dtype == jnp.uint8 and q.codes.shape == (m, k)
  assert q.block_scale.dtype == jnp.float8_e4m3fn and q.block_scale.shape == (m, k // 16)
  assert q.tensor_scale.dtype == jnp.float32 and q.tensor_scale.shape == (m, 1)
  assert bits.dtype == jnp.uint8 and bits.shape == (m, k // 8)
  return _fields(y, q, bits)


def _check_both(x: jax.Array, what: str, **kw) -> dict[str, np.ndarray]:
  """Kernel against formats (all rows) and the numpy reference (rows that are finite)."""
  got = _run(x, **kw)
  _assert_fields(got, _fields(*_reference(x)), f"{what} vs formats", x)
  xn = np.asarray(x)
  finite = np.isfinite(xn.astype(F32)).all(axis=1)
  if finite.any():
    _assert_fields(got, _numpy_reference(xn), f"{what} vs numpy", xn, rows=finite)
  return got


# ----------------------------------------------------------------------------- random rows

def _random_rows(m: int, k: int, dtype, seed: int = 0) -> jax.Array:
  """Gaussian rows with per-row (2**-6..2**6) and per-block (2**-17..2**0) magnitudes, so some
  blocks' scales clamp at 2**-6 and others reach 448."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((m, k // 16, 16))
  x *= np.exp2(rng.integers(-6, 7, (m, 1, 1))) * np.exp2(rng.integers(-17, 1, (m, k // 16, 1)))
  return jnp.asarray(x.reshape(m, k), dtype)


# (id, K, dtype, M, block_m): every K of the sites (128, 768, 2048), padded block axes (48, 80,
# 768), one block per row (16), M not a multiple of block_m; the last one runs the defaults.
RANDOM = [
    ("k16_bf16", 16, "bfloat16", 5, 2),
    ("k48_f32", 48, "float32", 7, 4),
    ("k80_f16", 80, "float16", 3, 2),
    ("k128_f16", 128, "float16", 9, 4),
    ("k128_f32", ADV_K, "float32", ADV_ROWS, ADV_BLOCK_M),
    ("k128_bf16", ADV_K, "bfloat16", ADV_ROWS, ADV_BLOCK_M),
    ("k768_bf16", 768, "bfloat16", 5, 2),
    ("k2048_f32", 2048, "float32", 3, 2),
    ("k4096_bf16", 4096, "bfloat16", 3, 2),
    ("k2048_bf16_defaults", 2048, "bfloat16", 3, None),
]


@pytest.mark.parametrize("name,k,dtype,m,block_m", RANDOM, ids=[c[0] for c in RANDOM])
def test_random_rows_bit_exact(name, k, dtype, m, block_m):
  x = _random_rows(m, k, DTYPES[dtype], seed=k)
  _check_both(x, name, **({} if block_m is None else {"block_m": block_m}))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("name,make,expect", ADVERSARIAL, ids=[c[0] for c in ADVERSARIAL])
def test_adversarial_rows_bit_exact(name, make, expect, dtype):
  x = adversarial_input(make, dtype)
  got = _check_both(x, f"{name}/{dtype}", block_m=ADV_BLOCK_M)
  if expect is not None and dtype != "float16":  # f16 cannot hold every case's values
    expect(got)


# ----------------------------------------------------------------------------- controls

def test_control_one_ulp_moves_a_tie():
  """The comparison can fail: one E2M1 tie nudged up by one float32 ulp rounds up, so the
  kernel's codes (and y) on the nudged input differ from formats' on the original."""
  x = ties_pow2().astype(F32).reshape(ADV_ROWS, ADV_K)
  pos = (0, 16 + 2)  # block 1, element 2: 0.25 * 2**-3, a tie that rounds down to code 0
  nudged = x.copy()
  nudged[pos] = np.nextafter(x[pos], F32(np.inf))
  got = _run(jnp.asarray(nudged), block_m=ADV_BLOCK_M)
  assert got["codes"][pos] == 1
  with pytest.raises(AssertionError, match="codes: 1 of"):
    _assert_fields(got, _fields(*_reference(jnp.asarray(x))), "nudged", x)


def test_control_block_size_matters():
  """The numpy reference with 32-element blocks (MXFP4's size) is not the kernel's result."""
  x = _random_rows(ADV_ROWS, ADV_K, jnp.float32, seed=ADV_K)
  got = _run(x, block_m=ADV_BLOCK_M)
  wrong = _numpy_reference(np.asarray(x), block=32)
  wrong["block_scale"] = np.repeat(wrong["block_scale"], 2, axis=1)  # same shape, other values
  with pytest.raises(AssertionError, match="differ"):
    _assert_fields(got, wrong, "block 32", np.asarray(x))


# ----------------------------------------------------------------------------- helpers

def test_ieee_div_matches_exact_and_numpy():
  """The kernel's straight-line division gives `exact.ieee_div`'s bits over its domain (a >= 0
  finite incl. zero/subnormal, b normal > 0), and numpy's float32 quotient where normal."""
  rng = np.random.default_rng(8)
  n = 1 << 14
  a = rng.integers(0, 0x7F800000, n, dtype=np.int64).astype(np.uint32).view(F32)
  b = rng.integers(0x00800000, 0x7F800000, n, dtype=np.int64).astype(np.uint32).view(F32)
  # near-exact quotients and the constants the kernel divides by
  c = rng.uniform(0.5, 2.0, n).astype(F32)
  a2 = (c * F32(6.0)).astype(F32)
  b2 = np.where(np.arange(n) % 2, F32(6.0), F32(2688.0)).astype(F32)
  a, b = np.concatenate([a, a2, np.ones(4, F32)]), np.concatenate([b, b2, [F32(3.0)] * 4])
  got = np.asarray(jax.jit(nvfp4_act.ieee_div)(a, b))
  want = np.asarray(jax.jit(exact.ieee_div)(a, b))
  assert_bits_equal(got, want, "ieee_div vs exact", {"a": a, "b": b})
  with np.errstate(all="ignore"):
    q = a / b
  normal = np.isfinite(q) & (np.abs(q) >= F32(2.0**-126)) & (np.abs(a) >= F32(2.0**-126))
  assert_bits_equal(got[normal], q[normal], "ieee_div vs numpy")


def test_e4m3_bits_and_e2m1_values():
  """Kernel-local E4M3 bytes of every scale value in [2**-6, 448] (and NaN) and signed E2M1
  values of codes 0..15 (code 8 is -0) against ml_dtypes."""
  scales = np.arange(256, dtype=np.uint8).view(E4M3).astype(F32)
  scales = np.unique(scales[np.isfinite(scales) & (scales >= 2.0**-6)])
  scales = np.append(scales, F32(np.nan))
  got = np.asarray(jax.jit(nvfp4_act._e4m3_bits)(scales))
  np.testing.assert_array_equal(got, scales.astype(E4M3).view(np.uint8))
  codes = np.arange(16, dtype=np.uint8)
  vals = np.asarray(jax.jit(nvfp4_act._e2m1_value)(codes))
  assert_bits_equal(vals, codes.view(E2M1).astype(F32), "e2m1 values")


def test_empty_rows():
  y, q = nvfp4_act.quantize_rows(jnp.zeros((0, 32), jnp.bfloat16))
  assert y.shape == (0, 32) and y.dtype == jnp.bfloat16
  assert q.codes.shape == (0, 32) and q.block_scale.shape == (0, 2)
  assert q.tensor_scale.shape == (0, 1)
  *_, bits = nvfp4_act.quantize_rows(jnp.zeros((0, 32), jnp.bfloat16), mantissa=True)
  assert bits.shape == (0, 4) and bits.dtype == jnp.uint8


def test_mantissa_is_an_extra_output():
  """mantissa=False returns (y, q) only, the same bits as mantissa=True's first two; the bits
  follow the codes: the same under negation (sign is the code's top bit), others for other
  rows."""
  x = _random_rows(6, 96, jnp.bfloat16, seed=5)
  y, q = nvfp4_act.quantize_rows(x, block_m=2)
  y2, q2, bits = nvfp4_act.quantize_rows(x, block_m=2, mantissa=True)
  _assert_fields(_fields(y2, q2), _fields(y, q), "mantissa=True vs False", x)
  np.testing.assert_array_equal(np.asarray(bits), _packbits(to_numpy(q.codes)))
  *_, bits_neg = nvfp4_act.quantize_rows(-x, block_m=2, mantissa=True)
  np.testing.assert_array_equal(np.asarray(bits_neg), np.asarray(bits))
  other = _random_rows(6, 96, jnp.bfloat16, seed=6)
  *_, bits_other = nvfp4_act.quantize_rows(other, block_m=2, mantissa=True)
  assert not np.array_equal(np.asarray(bits_other), np.asarray(bits))


@pytest.mark.parametrize("m,k,block_m,warps", [(64, 2048, 1, 4), (512, 768, 2, 4),
                                               (512, 128, 2, 1), (4, 48, 1, 1),
                                               (4096, 128, 16, 4), (65536, 128, 32, 8),
                                               (8, 65536, 1, 8)])
def test_default_tiles(m, k, block_m, warps):
  """Defaults: powers of two, tiles <= TILE_ELEMENTS elements (one row may exceed it), at least
  MIN_PROGRAMS programs where M allows."""
  assert nvfp4_act.default_block_m(m, k) == block_m
  assert nvfp4_act.default_num_warps(block_m, k) == warps


def test_bad_inputs():
  x = jnp.zeros((4, 32), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"must be \[M, K\]"):
    nvfp4_act.quantize_rows(x[0])
  with pytest.raises(ValueError, match=r"must be \[M, K\]"):
    nvfp4_act.quantize_rows(x[None])
  with pytest.raises(ValueError, match="multiple of the block size 16"):
    nvfp4_act.quantize_rows(x[:, :24])
  with pytest.raises(ValueError, match="multiple of the block size 16"):
    nvfp4_act.quantize_rows(x[:, :0])
  with pytest.raises(TypeError, match="dtype"):
    nvfp4_act.quantize_rows(x.astype(jnp.int32))
  with pytest.raises(TypeError, match="dtype"):
    nvfp4_act.quantize_rows(np.zeros((4, 32), np.float64))
  with pytest.raises(TypeError, match="expected an array"):
    nvfp4_act.quantize_rows([[0.0] * 16])
  with pytest.raises(ValueError, match="block_m must be a power of two"):
    nvfp4_act.quantize_rows(x, block_m=3)
  with pytest.raises(ValueError, match="num_warps must be a power of two"):
    nvfp4_act.quantize_rows(x, num_warps=6)


# ----------------------------------------------------------------------------- given scales

_qdq_reference = jax.jit(nvfp4_act.qdq_reference)


def _numpy_qdq(x: np.ndarray, ts: np.ndarray) -> np.ndarray:
  """Independent reference of `qdq_rows` for finite rows and scales: numpy float32 arithmetic
  (IEEE division) and ml_dtypes rounding under the given row scales ts [M]; float32 values
  after a round trip through x's dtype."""
  dt = np.asarray(x).dtype
  xf = np.asarray(x).astype(F32)
  xf = np.where(np.abs(xf) < F32(2.0**-126), np.copysign(F32(0.0), xf), xf).astype(F32)
  m, k = xf.shape
  xb = xf.reshape(m, k // 16, 16)
  t = ts.astype(F32)[:, None]
  with np.errstate(all="ignore"):
    bs = np.clip((np.abs(xb).max(axis=-1) / F32(6.0)) / t, F32(2.0**-6), F32(448.0))
    bsf = bs.astype(E4M3).astype(F32)
    codes = np.clip(xb * ((F32(1.0) / t) / bsf)[..., None], F32(-6.0), F32(6.0)).astype(E2M1)
    y = (codes.astype(F32) * bsf[..., None]) * t[..., None]
  return y.reshape(m, k).astype(dt).astype(F32)


def _check_qdq(x: jax.Array, ts: np.ndarray, what: str, **kw) -> np.ndarray:
  """qdq_rows against formats (every row) and numpy (rows finite, with finite scales)."""
  ts = np.asarray(ts, F32)
  y = nvfp4_act.qdq_rows(x, jnp.asarray(ts), **kw)
  assert y.dtype == x.dtype and y.shape == x.shape
  got = np.asarray(y).astype(F32)
  xn = np.asarray(x)
  assert_bits_equal(got, np.asarray(_qdq_reference(x, jnp.asarray(ts))).astype(F32),
                    f"{what} vs formats", {"x": xn.astype(F32)})
  ok = np.isfinite(xn.astype(F32)).all(axis=1) & np.isfinite(ts)
  assert_bits_equal(got[ok], _numpy_qdq(xn, ts)[ok], f"{what} vs numpy",
                    {"x": xn.astype(F32)[ok]})
  return got


def _expert_scales(x: np.ndarray, experts: int) -> np.ndarray:
  """A weight's second-level scales: rows split into `experts` equal runs, one
  `formats.nvfp4_tensor_scale` per run, repeated over its rows."""
  m, k = x.shape
  ts = jax.jit(lambda v: formats.nvfp4_tensor_scale(v, axes=(1, 2)))(
      jnp.asarray(x).reshape(experts, m // experts, k))
  return np.repeat(np.asarray(ts).reshape(experts), m // experts)


# (id, K, dtype, M, experts, block_m): the expert weights' K (gate/up 2048, down 768) and odd
# ones, M not a multiple of block_m, the defaults last.
QDQ = [
    ("k48_f32_3experts", 48, "float32", 9, 3, 4),
    ("k768_bf16_2experts", 768, "bfloat16", 6, 2, 4),
    ("k2048_bf16_2experts", 2048, "bfloat16", 4, 2, 2),
    ("k80_f16_1expert", 80, "float16", 5, 1, 2),
    ("k2048_bf16_defaults", 2048, "bfloat16", 6, 3, None),
]


@pytest.mark.parametrize("name,k,dtype,m,experts,block_m", QDQ, ids=[c[0] for c in QDQ])
def test_qdq_rows_under_expert_scales_bit_exact(name, k, dtype, m, experts, block_m):
  x = _random_rows(m, k, DTYPES[dtype], seed=k + m)
  _check_qdq(x, _expert_scales(np.asarray(x).astype(F32), experts), name,
             **({} if block_m is None else {"block_m": block_m}))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name,make,expect", ADVERSARIAL, ids=[c[0] for c in ADVERSARIAL])
def test_qdq_rows_adversarial_under_the_rows_own_scales(name, make, expect, dtype):
  """Under each row's own scale (`formats.nvfp4_row_scale`) the values are the site kernel's,
  so every adversarial case (ties, saturation, zeros, subnormals, tiny and huge scales,
  NaN/Inf) checks the given-scale path against both kernels and both references."""
  x = adversarial_input(make, dtype)
  ts = np.asarray(jax.jit(formats.nvfp4_row_scale)(x))[:, 0]
  got = _check_qdq(x, ts, f"{name}/{dtype}", block_m=ADV_BLOCK_M)
  assert_bits_equal(got, _run(x, block_m=ADV_BLOCK_M)["y"], f"{name}/{dtype} vs quantize_rows")
  own = np.asarray(nvfp4_act.qdq_rows(x, block_m=ADV_BLOCK_M)).astype(F32)
  assert_bits_equal(own, got, f"{name}/{dtype}: the rows' own scales (tensor_scale None)")


# (id, K, M, block_m): K = 768 splits rows in 3 parts (its scales made by XLA first), 2048 and
# 64 do not (made in the kernel).
QDQ_OWN = [("k768_split", 768, 5, 4), ("k2048_whole", 2048, 3, 2), ("k64_defaults", 64, 9, None)]


@pytest.mark.parametrize("name,k,m,block_m", QDQ_OWN, ids=[c[0] for c in QDQ_OWN])
def test_qdq_rows_under_the_rows_own_scales_bit_exact(name, k, m, block_m):
  """tensor_scale None (an unguided activation site): the site kernel's and XLA's values."""
  x = _random_rows(m, k, jnp.bfloat16, seed=k + 3)
  got = np.asarray(nvfp4_act.qdq_rows(x, **({} if block_m is None else {"block_m": block_m})))
  assert_bits_equal(got.astype(F32), np.asarray(_reference(x)[0]).astype(F32), f"{name} vs XLA")
  assert_bits_equal(got.astype(F32), _run(x, block_m=2)["y"], f"{name} vs quantize_rows")


def test_qdq_rows_scales_that_clamp_or_poison():
  """Rows 1 and 4 hold the same values: under 2**12 times their own scale most block scales
  clamp at 2**-6 and round their values to zero; 2**-12 times it saturates block scales at
  448; NaN poisons its row only."""
  x = _random_rows(6, 64, jnp.float32, seed=11)
  x = x.at[4].set(x[1])
  own = np.asarray(jax.jit(formats.nvfp4_row_scale)(x))[:, 0]
  ts = own * np.array([2.0**-12, 2.0**12, 1.0, np.nan, 1.0, 2.0**-3], F32)
  got = _check_qdq(x, ts, "clamped and poisoned", block_m=2)
  assert np.isnan(got[3]).all() and np.isfinite(np.delete(got, 3, axis=0)).all()
  assert np.abs(got[0]).max() == np.float32(6 * 448) * ts[0]  # saturated blocks: +-6 * 448 * ts
  assert (got[1] == 0).sum() > 2 * (got[4] == 0).sum()


def test_qdq_rows_control_scale_matters():
  """The comparison can fail: twice the scale is other values."""
  x = _random_rows(4, 64, jnp.float32, seed=12)
  ts = _expert_scales(np.asarray(x), 2)
  got = np.asarray(nvfp4_act.qdq_rows(x, jnp.asarray(ts), block_m=2))
  with pytest.raises(AssertionError, match="differ"):
    assert_bits_equal(got, np.asarray(_qdq_reference(x, jnp.asarray(2 * ts))), "2 ts")


ROW_PARTS = [("k768_three_rows_of_256", 768, 3), ("k2048_whole", 2048, 1), ("k48", 48, 3),
             ("k16", 16, 1), ("k80", 80, 5), ("k4096_whole", 4096, 1)]


@pytest.mark.parametrize("name,k,parts", ROW_PARTS, ids=[c[0] for c in ROW_PARTS])
def test_row_parts_leave_no_padded_blocks(name, k, parts):
  """The values-only kernels split rows so that each part's blocks are a power of two."""
  assert nvfp4_act.row_parts(k) == parts
  assert nvfp4_act.padded_blocks(k // parts) == k // parts // 16


def test_qdq_rows_bad_inputs():
  x = jnp.zeros((4, 32), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"tensor_scale must be float32 \[4\]"):
    nvfp4_act.qdq_rows(x, jnp.ones((4, 1), jnp.float32))
  with pytest.raises(ValueError, match="tensor_scale must be float32"):
    nvfp4_act.qdq_rows(x, jnp.ones((4,), jnp.bfloat16))
  with pytest.raises(ValueError, match="qdq_rows: K=24"):
    nvfp4_act.qdq_rows(x[:, :24], jnp.ones((4,), jnp.float32))
  assert nvfp4_act.qdq_rows(x[:0], jnp.ones((0,), jnp.float32)).shape == (0, 32)


# ----------------------------------------------------------------------------- guided rows

_guided_reference = jax.jit(nvfp4_act.guided_qdq_reference)
_record = jax.jit(lambda v: guided.record(formats.fp4_quantize_act(v, "nvfp4"), "compact"))


def _numpy_guided(x: np.ndarray, g) -> np.ndarray:
  """Independent reference of guided rounding for finite rows and scales: numpy float32 scale
  units, then of the two E2M1 grid points bracketing each |z| the one whose code's low bit is
  the record's (sign from z); float32 values after a round trip through x's dtype."""
  dt = np.asarray(x).dtype
  xf = np.asarray(x).astype(F32)
  xf = np.where(np.abs(xf) < F32(2.0**-126), np.copysign(F32(0.0), xf), xf).astype(F32)
  m, k = xf.shape
  bs = np.asarray(g.block_scale).view(np.uint8).view(E4M3).astype(F32)
  ts = np.asarray(g.row_scale, F32)
  with np.errstate(all="ignore"):
    inv = (F32(1.0) / ts) / bs
    z = np.clip(xf.reshape(m, k // 16, 16) * inv[..., None], F32(-6.0), F32(6.0))
  grid = formats.E2M1_GRID
  a = np.abs(z)
  lo = (a[..., None] >= grid[1:]).sum(-1)
  hi = np.where(grid[lo] == a, lo, np.minimum(lo + 1, 7))
  bit = np.unpackbits(np.asarray(g.mantissa), axis=-1, bitorder="little").reshape(lo.shape)
  mag = np.where((lo & 1) == bit, lo, hi)
  val = np.where(np.signbit(z), -grid[mag], grid[mag])
  y = (val * bs[..., None]) * ts[..., None]
  return y.reshape(m, k).astype(dt).astype(F32)


def _check_guided(x: jax.Array, g, rtn=None, what: str = "", **kw) -> np.ndarray:
  """guided_qdq_rows against the XLA reference (every row) and numpy (finite rows that take
  the guidance, with finite scales)."""
  y = nvfp4_act.guided_qdq_rows(x, g, rtn, **kw)
  assert y.dtype == x.dtype and y.shape == x.shape
  got = np.asarray(y).astype(F32)
  xn = np.asarray(x).astype(F32)
  assert_bits_equal(got, np.asarray(_guided_reference(x, g, rtn)).astype(F32),
                    f"{what} vs XLA", {"x": xn})
  ok = (np.isfinite(xn).all(axis=1) & np.isfinite(np.asarray(g.row_scale)[:, 0])
        & np.isfinite(to_numpy(g.block_scale).astype(F32)).all(axis=1))
  if rtn is not None:
    ok &= ~np.asarray(rtn)
  assert_bits_equal(got[ok], _numpy_guided(np.asarray(x), g)[ok], f"{what} vs numpy",
                    {"x": xn[ok]})
  return got


# (id, K, dtype, M, block_m, RTN rows): the sites' K (moe_in 2048, expert_mid 768, k/v 128).
GUIDED = [
    ("k128_f32", 128, "float32", 5, 2, False),
    ("k768_bf16_rtn_rows", 768, "bfloat16", 6, 4, True),
    ("k2048_bf16", 2048, "bfloat16", 3, 2, False),
    ("k48_f16_rtn_rows_defaults", 48, "float16", 7, None, True),
]


@pytest.mark.parametrize("name,k,dtype,m,block_m,rtn", GUIDED, ids=[c[0] for c in GUIDED])
def test_guided_rows_under_a_drifted_record_bit_exact(name, k, dtype, m, block_m, rtn):
  """The record is a rollout's of the input drifted by ~3%: codes move within one grid step
  and the record's bits choose among them."""
  x = _random_rows(m, k, DTYPES[dtype], seed=k + 1)
  rng = np.random.default_rng(k)
  drifted = (np.asarray(x).astype(F32) * (1 + 0.03 * rng.standard_normal(x.shape))).astype(F32)
  g = _record(jnp.asarray(drifted, x.dtype))
  rows = jnp.asarray(np.arange(m) % 3 == 1) if rtn else None
  got = _check_guided(x, g, rows, name, **({} if block_m is None else {"block_m": block_m}))
  if rtn:  # the RTN rows are the site kernel's values under the rows' own scales
    own = _run(x, block_m=2)["y"]
    assert_bits_equal(got[np.asarray(rows)], own[np.asarray(rows)], f"{name}: RTN rows")
  assert not np.array_equal(got, _run(x, block_m=2)["y"]), "control: the drift moved no code"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name,make,expect", ADVERSARIAL, ids=[c[0] for c in ADVERSARIAL])
def test_guided_rows_without_drift_are_round_to_nearest(name, make, expect, dtype):
  """Under the record of the input itself, guided rounding is RTN bit for bit: every
  adversarial case (ties, saturation, zeros, subnormals, tiny and huge scales, NaN/Inf)
  against the site kernel, the XLA reference and numpy."""
  x = adversarial_input(make, dtype)
  got = _check_guided(x, _record(x), None, f"{name}/{dtype}", block_m=ADV_BLOCK_M)
  assert_bits_equal(got, _run(x, block_m=ADV_BLOCK_M)["y"], f"{name}/{dtype} vs RTN")


def test_guided_rows_tiles_without_rtn_rows_skip_them():
  """Tiles holding no RTN row skip the RTN rounding: with no row RTN the output is the guided
  one, with one row RTN only that row changes (its tile takes the RTN branch)."""
  x = _random_rows(6, 768, jnp.bfloat16, seed=769)
  g = _record(jnp.asarray(np.asarray(x).astype(F32) * F32(1.03), x.dtype))
  none = np.asarray(nvfp4_act.guided_qdq_rows(x, g, jnp.zeros((6,), bool), block_m=4))
  guided_only = np.asarray(nvfp4_act.guided_qdq_rows(x, g, block_m=4))
  assert_bits_equal(none.astype(F32), guided_only.astype(F32), "no RTN rows")
  one = np.asarray(nvfp4_act.guided_qdq_rows(x, g, jnp.arange(6) == 4, block_m=4)).astype(F32)
  changed = np.any(one != guided_only.astype(F32), axis=1)
  assert changed.tolist() == [False] * 4 + [True, False]


def test_guided_rows_poisoned_record():
  """A NaN block scale or row scale in the record poisons that block or row only."""
  x = _random_rows(4, 64, jnp.float32, seed=13)
  g = _record(x)
  bits = np.asarray(g.block_scale).view(np.uint8).copy()
  bits[1, 2] = 0x7F
  g = g.replace(block_scale=jnp.asarray(bits).view(jnp.float8_e4m3fn),
                row_scale=g.row_scale.at[3, 0].set(jnp.nan))
  got = _check_guided(x, g, None, "poisoned", block_m=2)
  assert np.isnan(got[1, 32:48]).all() and np.isnan(got[3]).all()
  assert np.isfinite(np.delete(got, 3, axis=0)[:, :32]).all()


def test_guided_rows_bad_inputs():
  x = _random_rows(4, 32, jnp.bfloat16, seed=14)
  g = _record(x)
  full = guided.record(formats.fp4_quantize_act(x, "nvfp4"), "full")
  with pytest.raises(ValueError, match="compact NVFP4 records"):
    nvfp4_act.guided_qdq_rows(x, full)
  with pytest.raises(ValueError, match=r"rtn_rows must be bool \[4\]"):
    nvfp4_act.guided_qdq_rows(x, g, jnp.zeros((4,), jnp.int32))
  with pytest.raises(ValueError, match="block_scale has shape"):
    nvfp4_act.guided_qdq_rows(x[:, :16], g)


# ----------------------------------------------------------------------------- Triton IR

# (id, M, K, dtype, block_m, num_warps): the sites with the GPU's defaults, then variants.
LOWERINGS = [
    (f"k{k}_{dt}", m, k, dt, None, None)
    for m, k in ((64, 2048), (512, 768), (512, 128)) for dt in ("bfloat16", "float32")
] + [
    ("k2048_bf16_no_mantissa", 64, 2048, "bfloat16", None, None),
    ("k48_f16_block_m4_warps2", 7, 48, "float16", 4, 2),
    ("k16_block_m1", 3, 16, "bfloat16", 1, 1),
    ("k4096_bf16", 8, 4096, "bfloat16", None, None),
]


@pytest.fixture
def traced_as_on_gpu(monkeypatch):
  """Backend-dependent code traces its GPU branch (e.g. `exact._unroll`: fully unrolled
  `fori_loop`s, which Pallas' Triton lowering rejects) while this host lowers for CUDA."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")


@pytest.mark.parametrize("name,m,k,dtype,block_m,num_warps", LOWERINGS,
                         ids=[c[0] for c in LOWERINGS])
def test_lowers_to_triton(name, m, k, dtype, block_m, num_warps, traced_as_on_gpu):
  """The kernel passes Pallas' Triton lowering for CUDA (power-of-two tiles, supported
  primitives) on any host, traced as on the GPU; Triton's own compilation needs the GPU."""
  f = functools.partial(nvfp4_act.quantize_rows, interpret=False, block_m=block_m,
                        num_warps=num_warps, mantissa="no_mantissa" not in name)
  text = jax.jit(f).trace(jnp.zeros((m, k), DTYPES[dtype])).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "triton" in text


@pytest.mark.parametrize("m,k", [(3072, 2048), (3072, 768)], ids=["gate_up", "down"])
def test_qdq_rows_lowers_to_triton(m, k, traced_as_on_gpu):
  """The given-scale kernel at the expert weights' widths, with the GPU's default tiles."""
  f = functools.partial(nvfp4_act.qdq_rows, interpret=False)
  text = jax.jit(f).trace(jnp.zeros((m, k), jnp.bfloat16), jnp.ones((m,), jnp.float32)).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "triton" in text


@pytest.mark.parametrize("m,k,rtn", [(65536, 768, True), (8192, 2048, False)],
                         ids=["expert_mid", "moe_in"])
def test_guided_qdq_rows_lowers_to_triton(m, k, rtn, traced_as_on_gpu):
  """The guided kernel at the training sites' widths, with the GPU's default tiles."""
  g = guided.Guidance(block_scale=jnp.zeros((m, k // 16), jnp.float8_e4m3fn),
                      row_scale=jnp.ones((m, 1), jnp.float32),
                      mantissa=jnp.zeros((m, k // 8), jnp.uint8))
  f = functools.partial(nvfp4_act.guided_qdq_rows, interpret=False)
  rows = jnp.zeros((m,), jnp.bool_) if rtn else None
  text = jax.jit(f).trace(jnp.zeros((m, k), jnp.bfloat16), g, rows).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "triton" in text


def test_gpu_trace_rejects_exact_fori_loop(traced_as_on_gpu):
  """Control for the lowering test: traced as on the GPU, a kernel using `exact.ieee_div`'s
  loop form fails to lower (why the kernel takes `straight_line=True`)."""
  from jax.experimental import pallas as pl

  def kernel(x_ref, o_ref):
    o_ref[...] = exact.ieee_div(x_ref[...], np.float32(3.0))

  f = lambda x: pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16,), jnp.float32),
                               compiler_params=common.compiler_params(4, 1))(x)
  try:
    jax.jit(f).trace(jnp.ones((16,), jnp.float32)).lower(lowering_platforms=("cuda",))
  except NotImplementedError:
    return
  pytest.skip("this JAX lowers fori_loop(unroll=True) to Triton, so there is no failure for "
              "the control to show (the kernel would not need straight_line=True)")
