"""FP4/FP8 formats (`trace_jax.quant.formats`) against ml_dtypes and an independent reference.

The reference (`numpy_ref`) is written from docs/design.md §3.2-3.4 with numpy's IEEE float32
arithmetic, ml_dtypes' float8_e4m3fn / float4_e2m1fn casts and float64 products: the third
implementation next to the JAX quantizers and the torch twin. JAX runs jitted on its default
backend.
"""

from __future__ import annotations

import cases
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import numpy_ref
import pytest
from numpy_ref import GRID16, ref_fp8, ref_mxfp4, ref_nvfp4, ref_tensor_scale

import trace_jax.quant as quant
from trace_jax.quant import formats

F32 = cases.F32
E4M3 = cases.E4M3
E2M1 = cases.E2M1


# ----------------------------------------------------------------------------- reference

def _as_experts(x: np.ndarray) -> np.ndarray:
  return x.reshape((cases.EXPERTS, x.shape[-2] // cases.EXPERTS) + x.shape[-1:])


REFERENCE = {
    "nvfp4": lambda x: ref_nvfp4(x),
    "nvfp4_row": lambda x: ref_nvfp4(x, ref_tensor_scale(x, (-1,))),
    "nvfp4_tensor": lambda x: ref_nvfp4(x, ref_tensor_scale(x, None)),
    "nvfp4_expert": lambda x: ref_nvfp4(_as_experts(x), ref_tensor_scale(_as_experts(x), (1, 2))),
    "mxfp4": ref_mxfp4,
    "fp8_act": lambda x: ref_fp8(x, 1),
    "fp8_weight": lambda x: ref_fp8(x, 128),
}
assert set(REFERENCE) == set(cases.FORMATS)


def reference(fmt: str, chunks: np.ndarray) -> dict[str, np.ndarray]:
  """REFERENCE[fmt] applied to each [ROWS, K] chunk (as the vmapped JAX op), stacked."""
  outs = [REFERENCE[fmt](c) for c in chunks]
  return {k: np.stack([o[k] for o in outs]) for k in outs[0]}


@pytest.mark.parametrize("dtype", cases.DTYPES)
@pytest.mark.parametrize("data", cases.DATA)
@pytest.mark.parametrize("fmt", list(cases.FORMATS))
def test_matches_reference(fmt: str, data: str, dtype: str) -> None:
  """Codes, block scales, second-level scales and dequantized values, bit for bit."""
  arr, index = cases.stacked()
  xf = cases.input_as_f32(arr[index[data]], dtype)
  got = {k: v[index[data]] for k, v in cases.jax_results(fmt, dtype).items()}
  want = reference(fmt, xf)
  shown = np.stack([_as_experts(c) for c in xf]) if fmt == "nvfp4_expert" else xf
  cases.assert_fields_equal(got, want, f"{fmt} on {data} ({dtype})", shown,
                            cases.FORMATS[fmt][1])
  if "values" in got:  # FP8 values never hold -0
    assert not np.any(got["values"] == 0x80)


# ----------------------------------------------------------------------------- E2M1 element

encode = jax.jit(quant.e2m1_encode)
decode = jax.jit(quant.e2m1_decode)


def test_e2m1_encode_every_bf16_pattern() -> None:
  """All 65536 bf16 bit patterns, inside jit: ml_dtypes' float4_e2m1fn codes; NaN -> code 0."""
  x = np.arange(1 << 16, dtype=np.uint16).view(ml_dtypes.bfloat16)
  got = np.asarray(encode(jnp.asarray(x)))
  assert got.dtype == np.uint8
  with np.errstate(invalid="ignore"):
    nan = np.isnan(x)
    want = np.where(nan, 0, x.astype(E2M1).view(np.uint8) & 0xF).astype(np.uint8)
  assert nan.sum() == 254
  cases.assert_bits_equal(got, want, "e2m1_encode(bf16)", {"x": x})


def _e2m1_ties_and_neighbours() -> np.ndarray:
  """float32: grid points, midpoints and 1..3 ulps around them, both signs, inf, tiny."""
  base = np.concatenate([cases.E2M1_GRID, cases.E2M1_MIDPOINTS, [6.5, 7.0, 8.0, 1e30]]).astype(F32)
  vals, up, down = [base], base, base
  for _ in range(3):
    up, down = cases.nudge(up, True), cases.nudge(down, False)
    vals += [up, down]
  x = np.concatenate(vals + [np.array([np.inf, 1e-45, 2.0**-126, 0.2499], F32)])
  return np.concatenate([x, -x]).astype(F32)


def test_e2m1_encode_float32_ties_and_neighbours() -> None:
  """float32 input: grid points, midpoints and 1..3 ulps around them, both signs, inf, tiny."""
  x = _e2m1_ties_and_neighbours()
  got = np.asarray(encode(x))
  want = x.astype(E2M1).view(np.uint8) & 0xF
  cases.assert_bits_equal(got, want, "e2m1_encode(float32)", {"x": x})


def test_e2m1_decode_all_codes() -> None:
  codes = np.arange(16, dtype=np.uint8)
  got = np.asarray(decode(codes))
  want = codes.view(E2M1).astype(F32)
  cases.assert_bits_equal(got, want, "e2m1_decode", {"code": codes})
  np.testing.assert_array_equal(np.abs(got[:8]), [0, 0.5, 1, 1.5, 2, 3, 4, 6])
  assert np.signbit(got[8]) and not np.signbit(got[0])


def test_e2m1_round_is_encode_then_decode() -> None:
  """e2m1_round gives e2m1_decode(e2m1_encode(x))'s bits (ml_dtypes' values) without codes:
  every bf16 pattern, float32 ties and 1..3 ulps around them, past 6, inf; NaN stays NaN."""
  bf = np.arange(1 << 16, dtype=np.uint16).view(ml_dtypes.bfloat16).astype(F32)
  x = np.concatenate([bf, _e2m1_ties_and_neighbours()]).astype(F32)
  got = np.asarray(jax.jit(quant.formats.e2m1_round)(x))
  with np.errstate(invalid="ignore"):
    nan = np.isnan(x)
  assert np.all(np.isnan(got[nan]))
  want = np.asarray(decode(encode(x)))
  cases.assert_bits_equal(got[~nan], want[~nan], "e2m1_round", {"x": x[~nan]})
  ml = np.clip(x[~nan], -6, 6).astype(E2M1).astype(F32)
  normal = np.abs(x[~nan]) >= 2.0**-126  # ml_dtypes keeps subnormals' signs as the grid's zero
  cases.assert_bits_equal(got[~nan][normal], ml[normal], "e2m1_round vs ml_dtypes")


def test_pack_nibble_order_hand_example() -> None:
  """Element 2i goes to the low nibble, element 2i+1 to the high nibble (NVFP4 checkpoints)."""
  codes = np.array([[0x1, 0x2, 0x3, 0x4, 0xF, 0x0, 0x8, 0x7]], np.uint8)
  packed = np.asarray(jax.jit(quant.pack_fp4)(codes))
  np.testing.assert_array_equal(packed, np.array([[0x21, 0x43, 0x0F, 0x78]], np.uint8))
  np.testing.assert_array_equal(np.asarray(jax.jit(quant.unpack_fp4)(packed)), codes)


def test_pack_unpack_round_trip() -> None:
  codes = np.random.default_rng(0).integers(0, 16, (2, 3, 64), dtype=np.uint8)
  packed = jax.jit(quant.pack_fp4)(codes)
  assert packed.shape == (2, 3, 32) and packed.dtype == jnp.uint8
  np.testing.assert_array_equal(np.asarray(jax.jit(quant.unpack_fp4)(packed)), codes)


# ----------------------------------------------------------------------------- explicit values

def _e4m3_byte(v: float) -> int:
  return int(np.array([v], F32).astype(E4M3).view(np.uint8)[0])


def _chunk(fmt: str, data: str, dtype: str = "float32") -> tuple[np.ndarray, dict]:
  arr, index = cases.stacked()
  i = index[data].start
  return arr[i], {k: v[i] for k, v in cases.jax_results(fmt, dtype).items()}


def test_e2m1_ties_round_to_even() -> None:
  """Blocks 6*s plus every midpoint times s (s = 2**-6..2**8): the block scale is s exactly
  (NVFP4 and MXFP4) and each tie rounds to the even code: 0.25->0, 0.75->1, 1.25->1, 1.75->2,
  2.5->2, 3.5->4, 5->4 (a zero keeps its sign: -0.25 and -0 are code 8)."""
  rows = slice(0, 60)
  want_mag = {6.0: 7, 0.25: 0, 0.75: 2, 1.25: 2, 1.75: 4, 2.5: 4, 3.5: 6, 5.0: 6, 0.0: 0}
  x, nv = _chunk("nvfp4", "e2m1_ties")
  _, mx = _chunk("mxfp4", "e2m1_ties")
  xb = x[rows].reshape(60, 16, 16).astype(np.float64)
  s = np.abs(xb).max(-1) / 6
  np.testing.assert_array_equal(nv["block_scale"][rows], np.vectorize(_e4m3_byte)(s))
  mx_bytes = (np.log2(s[:, ::2]) + 127).astype(np.uint8)
  np.testing.assert_array_equal(mx["block_scale"][rows], mx_bytes)
  rel = xb / s[..., None]

  def code(r: float) -> int:
    mag = want_mag[abs(r)]
    return mag | (8 if np.signbit(r) else 0)

  want = np.vectorize(code)(rel).astype(np.uint8).reshape(60, 256)
  ctx = {"x/s": rel.astype(F32).reshape(60, 256)}
  cases.assert_bits_equal(nv["codes"][rows], want, "nvfp4 tie codes", ctx)
  cases.assert_bits_equal(mx["codes"][rows], want, "mxfp4 tie codes", ctx)


def test_saturation_codes() -> None:
  """Every element beyond 5.5 times the effective scale gets code 7 (6 * scale), whatever its
  size (saturation), and at exactly 5 times a power-of-two scale the 4|6 tie goes to code 6 (4):
  NVFP4 (both levels) and MXFP4, over all data."""
  arr, _ = cases.stacked()
  for fmt, block in (("nvfp4", 16), ("nvfp4_row", 16), ("mxfp4", 32)):
    r = cases.jax_results(fmt, "float32")
    if fmt == "mxfp4":
      eff = np.exp2(r["block_scale"].astype(np.float64) - 127)
    else:
      eff = r["block_scale"].view(E4M3).astype(np.float64)
      if "tensor_scale" in r:
        eff = eff * r["tensor_scale"].astype(np.float64)
    eff = np.repeat(eff, block, axis=-1)
    y = np.abs(arr.astype(np.float64)) / eff
    mag = r["codes"] & 7
    assert np.all(mag[y > 5.5] == 7), fmt
    assert (y > 6.01).sum() > 100, fmt  # the data does reach past saturation
    pow2 = np.frexp(eff)[0] == 0.5
    assert np.all(mag[(y == 5) & pow2] == 6), fmt
    assert fmt == "nvfp4_row" or ((y == 5) & pow2).sum() > 100, fmt  # ties are in the data


def test_hand_built_saturation_edge() -> None:
  """amax one ulp above 6 (scale 1, y just above 6), amax/6 at E4M3 ties 1.0625 and 0.96875
  (both round to 1.0), and 7 (scale E4M3(7/6) = 1.125, y = 6.22): all saturate to code 7."""
  x = np.zeros(cases.stacked()[0].shape, F32)  # the shape of the cached compile
  x[0, 0, 0] = cases.nudge(F32(6.0), True)
  x[0, 0, 16] = 6.0 * (1 + 2.0**-4)
  x[0, 0, 32] = 6.0 * (1 - 2.0**-5)
  x[0, 0, 33] = 5.0 * (1 - 2.0**-5)  # y just below 5: rounds to 4
  x[0, 0, 48] = 7.0
  q = cases.jax_op("nvfp4")(jnp.asarray(x))
  codes = np.asarray(q["codes"])[0, 0]
  assert list(cases.to_numpy(q["block_scale"])[0, 0, :4]) == [
      _e4m3_byte(1.0), _e4m3_byte(1.0), _e4m3_byte(1.0), _e4m3_byte(1.125)]
  assert [int(codes[i]) for i in (0, 16, 32, 33, 48)] == [7, 7, 7, 6, 7]


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_mxfp4_dequantize_smallest_scales(jit: bool) -> None:
  """Scale bytes 0 (2**-127) and 1 (2**-126): code_value * scale, exact where the result is a
  normal float32 (e.g. 4 * 2**-127 = 2**-125), zero where it is subnormal (documented)."""
  codes = np.tile(np.arange(16, dtype=np.uint8), (2, 2))
  scale = np.array([[0], [1]], np.uint8).view(ml_dtypes.float8_e8m0fnu)
  q = quant.MXFP4Tensor(codes=jnp.asarray(codes), block_scale=jnp.asarray(scale))
  got = np.asarray((jax.jit(quant.mxfp4_dequantize) if jit else quant.mxfp4_dequantize)(q))
  want = numpy_ref.flush((GRID16[codes] * np.exp2(np.array([[-127.0], [-126.0]]))).astype(F32))
  cases.assert_bits_equal(got, want, f"mxfp4_dequantize ({'jit' if jit else 'eager'})",
                          {"code": codes})


def test_all_zero_blocks() -> None:
  """All-zero blocks (+0 or -0): NVFP4 scale 2**-6 (one- and two-level), MXFP4 byte 0
  (2**-127), FP8 scale 2**-100/448; E2M1 codes 0 for +0 and 8 for -0 (dequantized to a zero of
  the same sign), FP8 values +0; an all-zero row has ts = 2**-100/2688."""
  x, nv = _chunk("nvfp4", "all_zero_blocks")
  zero16 = np.all(x.reshape(128, 16, 16) == 0, axis=-1)
  assert zero16.sum() > 500
  assert np.all(nv["block_scale"][zero16] == 0x08)
  _, row = _chunk("nvfp4_row", "all_zero_blocks")
  zero_rows = np.all(x == 0, axis=-1)
  assert zero_rows.sum() == 64
  zero_ts = F32(2.0**-100) / F32(2688)
  assert np.all(cases.bits(row["tensor_scale"][zero_rows]) == cases.bits(zero_ts))
  assert np.all(row["block_scale"][zero_rows] == 0x08)
  _, mx = _chunk("mxfp4", "all_zero_blocks")
  zero32 = np.all(x.reshape(128, 8, 32) == 0, axis=-1)
  assert np.all(mx["block_scale"][zero32] == 0) and np.all(mx["block_scale"][~zero32] > 0)
  _, fp = _chunk("fp8_act", "all_zero_blocks")
  zero128 = np.all(x.reshape(128, 2, 128) == 0, axis=-1)
  assert np.all(cases.bits(fp["scale"][zero128]) == cases.bits(F32(2.0**-100) / F32(448)))
  neg = np.signbit(x)
  assert (neg & (x == 0)).sum() > 1000 and (~neg & (x == 0)).sum() > 1000
  for q in (nv, row, mx):
    np.testing.assert_array_equal(q["codes"][x == 0], np.where(neg, 8, 0)[x == 0])
    np.testing.assert_array_equal(cases.bits(q["dequant"][x == 0]),
                                  cases.bits(x[x == 0]))  # +0.0 or -0.0, as the input
  assert np.all(fp["values"][x == 0] == 0)
  assert np.all(cases.bits(fp["dequant"][x == 0]) == 0)  # +0.0


def test_e4m3_scale_ties_round_to_even() -> None:
  """Blocks whose amax / 6 (/ ts) is exactly an E4M3 tie get the even neighbour (the
  reference test checks every block; this one names the ties)."""
  for name, fmt in (("e4m3_scale_ties", "nvfp4"), ("e4m3_scale_ties_two_level", "nvfp4_row")):
    x, q = _chunk(fmt, name)
    bs = q["block_scale"]
    amax = np.abs(x.reshape(128, 16, 16).astype(np.float64)).max(-1)
    ts = np.abs(x.astype(np.float64)).max(-1, keepdims=True) / 2688 if fmt == "nvfp4_row" else 1.0
    t = amax / 6 / ts
    mids = cases.e4m3_midpoints(normal_only=True).astype(np.float64)
    is_tie = np.isin(t, mids[mids < 448])
    assert is_tie.sum() > 100, (name, is_tie.sum())
    assert np.all(bs[is_tie] % 2 == 0), f"{name}: a tie rounded to an odd E4M3 mantissa"
    lower = np.vectorize(lambda v: _e4m3_byte(np.nextafter(F32(v), F32(0))))(t[is_tie])
    assert np.all((bs[is_tie] == lower) | (bs[is_tie] == lower + 1))


E2M1_FORMATS = [f for f in cases.FORMATS if not f.startswith("fp8")]


@pytest.mark.parametrize("dtype", cases.DTYPES)
@pytest.mark.parametrize("fmt", E2M1_FORMATS)
def test_e2m1_codes_keep_sign_of_zero(fmt: str, dtype: str) -> None:
  """Over all data: where the magnitude rounds to zero, the code is 8 exactly where the
  (flushed) input is negative or -0, and 0 where it is +0 or positive (docs/numerics.md), as
  ModelOpt, torchao and ml_dtypes write it; codes 0 and 8 are equal values. The data holds many
  of both (negative ties at 0.25, -0 blocks, negative subnormals)."""
  arr, index = cases.stacked()
  x = numpy_ref.flush(cases.input_as_f32(arr, dtype))
  if fmt == "nvfp4_expert":
    x = np.stack([_as_experts(c) for c in x])
  codes = cases.jax_results(fmt, dtype)["codes"]
  zero = (codes & 7) == 0
  cases.assert_bits_equal(codes[zero], np.where(np.signbit(x[zero]), 8, 0).astype(np.uint8),
                          f"{fmt} ({dtype}): sign of zero codes", {"x": x[zero]})
  neg_zero = int(np.sum(codes == 8))
  assert neg_zero > 10_000 and int(np.sum(codes == 0)) > 10_000, neg_zero
  sl = index["negative_zero"]
  assert np.sum(codes[sl] == 8) > 5_000  # the adversarial case is mostly negative zeros
  assert np.all(formats.e2m1_values_equal(np.uint8(0), np.uint8(8)))


def test_fp8_values_never_negative_zero() -> None:
  """FP8 (E4M3 values, not E2M1 codes) stays as it was: a value that rounds to zero is byte 0
  (never 0x80)."""
  for fmt in ("fp8_act", "fp8_weight"):
    for dtype in cases.DTYPES:
      assert not np.any(cases.jax_results(fmt, dtype)["values"] == 0x80), (fmt, dtype)


def test_e2m1_values_equal() -> None:
  """The flip-metric helper: codes are equal values iff equal codes or both zeros (0, 8), on
  numpy arrays, JAX arrays under jit and Python ints."""
  a, b = np.meshgrid(np.arange(16, dtype=np.uint8), np.arange(16, dtype=np.uint8))
  want = cases.bits(numpy_ref.value(a)) == cases.bits(numpy_ref.value(b))
  want |= (numpy_ref.value(a) == 0) & (numpy_ref.value(b) == 0)
  np.testing.assert_array_equal(formats.e2m1_values_equal(a, b), want)
  np.testing.assert_array_equal(
      np.asarray(jax.jit(formats.e2m1_values_equal)(jnp.asarray(a), jnp.asarray(b))), want)
  assert want.sum() == 16 + 2 and want[0, 8] and want[8, 0] and not want[1, 9]
  assert formats.e2m1_values_equal(0, 8) and not formats.e2m1_values_equal(1, 9)


# ----------------------------------------------------------------------------- API, shapes

def test_public_api_names_dtypes_shapes() -> None:
  """docs/design.md §10: nvfp4/mxfp4 quantize/dequantize, documented fields, dtypes, shapes."""
  for name in ("nvfp4_quantize", "nvfp4_dequantize", "mxfp4_quantize", "mxfp4_dequantize"):
    assert callable(getattr(quant, name)), name
  x = jax.ShapeDtypeStruct((2, 3, 4, 64), jnp.float32)
  q = jax.eval_shape(quant.nvfp4_quantize, x)
  assert q.codes.dtype == jnp.uint8 and q.codes.shape == x.shape
  assert q.block_scale.dtype == jnp.float8_e4m3fn and q.block_scale.shape == (2, 3, 4, 4)
  assert q.tensor_scale is None
  d = jax.eval_shape(quant.nvfp4_dequantize, q)
  assert d.dtype == jnp.float32 and d.shape == x.shape
  q2 = jax.eval_shape(lambda v: quant.nvfp4_quantize(v, quant.nvfp4_row_scale(v)), x)
  assert q2.tensor_scale.dtype == jnp.float32 and q2.tensor_scale.shape == (2, 3, 4, 1)
  q3 = jax.eval_shape(lambda v: quant.nvfp4_quantize(v, quant.nvfp4_tensor_scale(v)), x)
  assert q3.tensor_scale.shape == (1, 1, 1, 1)
  m = jax.eval_shape(quant.mxfp4_quantize, jax.ShapeDtypeStruct((2, 3, 4, 64), jnp.bfloat16))
  assert m.codes.dtype == jnp.uint8 and m.codes.shape == x.shape
  assert m.block_scale.dtype == jnp.float8_e8m0fnu and m.block_scale.shape == (2, 3, 4, 2)
  assert m.tensor_scale is None
  assert jax.eval_shape(quant.mxfp4_dequantize, m).dtype == jnp.float32
  w = jax.ShapeDtypeStruct((2, 128, 256), jnp.bfloat16)
  ts = jax.eval_shape(lambda v: quant.nvfp4_tensor_scale(v, axes=(1, 2)), w)
  assert ts.shape == (2, 1, 1) and ts.dtype == jnp.float32
  f = jax.eval_shape(quant.fp8_quantize_weight, w)
  assert f.values.dtype == jnp.float8_e4m3fn and f.values.shape == w.shape
  assert f.scale.shape == (2, 1, 2) and f.scale.dtype == jnp.float32
  a = jax.eval_shape(quant.fp8_quantize_act, jax.ShapeDtypeStruct((3, 256), jnp.float32))
  assert a.scale.shape == (3, 2) and a.values.shape == (3, 256)


def test_batch_dims_equal_chunked_results() -> None:
  """Leading dims are batch dims: a 4-D [2, 2, ROWS, K] call equals the per-chunk results."""
  arr, _ = cases.stacked()
  x = jnp.asarray(arr[:4].reshape(2, 2, cases.ROWS, cases.K))
  for fmt in ("nvfp4_row", "fp8_weight"):
    got = jax.jit(cases.FORMATS[fmt][0])(x)
    for field, want in cases.jax_results(fmt, "float32").items():
      g = cases.to_numpy(got[field])
      cases.assert_bits_equal(g.reshape((4,) + g.shape[2:]), want[:4], f"{fmt} {field} 4-D")


@pytest.mark.parametrize("fmt", ["nvfp4", "nvfp4_row", "mxfp4", "fp8_act"])
def test_rows_are_batch_invariant(fmt: str) -> None:
  """A token row's quantization does not depend on the other rows: permuting the rows of every
  chunk (same jitted call) permutes the results."""
  arr, _ = cases.stacked()
  perm = np.random.default_rng(9).permutation(cases.ROWS)
  got = cases.jax_op(fmt)(jnp.asarray(arr[:, perm]))
  for field, want in cases.jax_results(fmt, "float32").items():
    cases.assert_bits_equal(got[field], want[:, perm], f"{fmt} {field} with permuted rows")


def test_stacked_experts_quantize_as_if_alone() -> None:
  """[E, N, K] weights with nvfp4_tensor_scale(w, axes=(1, 2)): each expert quantizes exactly
  as it would alone with its own per-tensor scale (compared with the reference, per expert)."""
  arr, _ = cases.stacked()
  r = cases.jax_results("nvfp4_expert", "float32")
  for c in (0, 5, cases.RANDOM_CHUNKS + 3):
    experts = _as_experts(arr[c])
    for e in range(cases.EXPERTS):
      alone = REFERENCE["nvfp4_tensor"](experts[e])
      for field, want in alone.items():
        cases.assert_bits_equal(r[field][c, e], want.reshape(r[field][c, e].shape),
                                f"chunk {c} expert {e} {field}")


SCALE_AXES = {"tensor": None, "row": (-1,), "expert": (1, 2), "cols": (0,)}


def test_tensor_scale_matches_reference() -> None:
  """nvfp4_tensor_scale over several axes sets, including all-zero parts (amax 2**-100)."""
  x = cases.stacked()[0][:4].copy()
  x[1] = 0.0
  x[3, :, 5] = 0.0
  x[2, 7] = 0.0
  got = jax.jit(lambda v: {n: quant.nvfp4_tensor_scale(v, a) for n, a in SCALE_AXES.items()})(
      jnp.asarray(x))
  for name, axes in SCALE_AXES.items():
    cases.assert_bits_equal(got[name], ref_tensor_scale(x, axes), f"tensor scale {name}")


def test_shared_tensor_scale_is_the_joined_arrays_scale() -> None:
  """nvfp4_shared_tensor_scale of arrays equals the reference scale of them joined along a
  kept axis: the largest value in either part sets it, an all-zero expert floors it, a NaN in
  one part poisons its expert only."""
  x = cases.stacked()[0][:4].copy()
  a, b = x[:, :5], x[:, 5:]
  a[1], b[1] = 0.0, 0.0
  b[2, 0, 3] = np.nan
  b[3, 1, 1] = 2.0 * np.abs(x[3]).max()
  got = jax.jit(lambda u, v: formats.nvfp4_shared_tensor_scale((u, v), axes=(1, 2)))(
      jnp.asarray(a), jnp.asarray(b))
  want = ref_tensor_scale(np.concatenate([a, b], axis=1), (1, 2))
  cases.assert_bits_equal(got, want, "shared scale")
  assert np.isnan(np.asarray(got)[2]).all() and np.isfinite(np.asarray(got)[[0, 1, 3]]).all()
  with pytest.raises(ValueError, match="no arrays"):
    formats.nvfp4_shared_tensor_scale((), axes=(1, 2))


def test_dequantize_error_bounds() -> None:
  """Dequantized values are close to the input: within half the largest E2M1 step times the
  effective scale (NVFP4, MXFP4) or 2**-4 relative (FP8), plus any saturation excess."""
  arr, index = cases.stacked()
  x = arr[index["random_1M"]].astype(np.float64)
  nv = {k: v[index["random_1M"]] for k, v in cases.jax_results("nvfp4_row", "float32").items()}
  eff = nv["block_scale"].view(E4M3).astype(np.float64) * nv["tensor_scale"]
  eff = np.repeat(eff, 16, axis=-1)
  err = np.abs(nv["dequant"] - x)
  assert np.all(err <= eff + np.maximum(np.abs(x) - 6 * eff, 0) * (1 + 1e-6))
  mx = {k: v[index["random_1M"]] for k, v in cases.jax_results("mxfp4", "float32").items()}
  s = np.repeat(np.exp2(mx["block_scale"].astype(np.float64) - 127), 32, axis=-1)
  err = np.abs(mx["dequant"] - x)
  assert np.all(err <= s + np.maximum(np.abs(x) - 6 * s, 0))
  fp = {k: v[index["random_1M"]] for k, v in cases.jax_results("fp8_act", "float32").items()}
  sc = np.repeat(fp["scale"].astype(np.float64), 128, axis=-1)
  err = np.abs(fp["dequant"] - x)
  assert np.all(err <= np.maximum(np.abs(x) * 2.0**-4, sc * 2.0**-10) * (1 + 1e-6))


@pytest.mark.parametrize("axis", [-1, (-3, -1)], ids=["row_blocks", "weight_blocks"])
def test_block_amax_and_nonfinite_flags(axis) -> None:
  """The quantizers' block amax (one integer max over the magnitudes' bits) against NumPy: the
  largest |x| of a finite block, bit for bit, and 0 with the flag set for a block holding NaN
  or +-Inf; -0, subnormals (flushed first, as the quantizers do) and huge values included."""
  rng = np.random.default_rng(7)
  x = (rng.standard_normal((8, 4, 6, 16)) * np.exp(rng.uniform(-80, 80, (8, 4, 1, 1)))
       ).astype(F32)
  x[0] = 0.0
  x[1, 0, 0, 0], x[2, 1, 3, 7], x[3, 2, 5, 15] = np.nan, np.inf, -np.inf
  x[4, :, :, ::2] = -0.0
  x[5, 0, 0, :] = F32(3.4e38)
  x[6, 1, :, :] = F32(1e-40)
  xf = np.where(np.abs(x) < np.finfo(F32).tiny, F32(0), x)  # flush_subnormal's result
  amax, bad = jax.jit(lambda a: formats._amax(a, axis))(jnp.asarray(xf))
  with np.errstate(invalid="ignore"):
    want_bad = ~np.all(np.isfinite(xf), axis=axis)
    want = np.where(want_bad, F32(0), np.max(np.abs(np.where(np.isfinite(xf), xf, 0)), axis=axis))
  np.testing.assert_array_equal(np.asarray(bad), want_bad)
  cases.assert_bits_equal(np.asarray(amax), want.astype(F32), f"amax over {axis}")
  assert want_bad.sum() == 3 and np.asarray(amax)[0].max() == 0
