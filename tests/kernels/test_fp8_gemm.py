"""Block-scaled FP8 GEMMs (`trace_jax.kernels.fp8_gemm`): kernel against a float64 product.

On CPU the kernel runs in the Pallas interpreter, on the GPU as the Triton kernel itself
(`interpret=None`). The reference is the float64 product of `formats.fp8_dequantize`'s
values (what the GEMM consumes, by construction the quantizer's codes and scales). Tolerance:
every E4M3 x E4M3 product is exact in float32; the errors are float32 summation within and
across the 128-wide groups, the two scale products, and the final rounding. Any order of
round-to-nearest summation is within K * 2**-24 * S (S = sum_k |a_k b_k| of the dequantized
values); the GPU's FP8 MMA may add in fewer bits inside a group, so the bound allows
K * 2**-20 * S, plus half an ulp of the output dtype. A wrong scale or code is off by far more
(the broken cases below). The experts' WGrad (`grouped_wgrad`) is checked the same way, with
the padded rows P as the contraction length, against a float64 product per expert built here
from the group sizes (each expert's rows padded to whole 128-row tiles, in numpy).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax.kernels import fp8_gemm
from trace_jax.quant import formats

E, N, K = 4, 256, 512
M = 100  # not a multiple of any row block

GROUPS = [
    ("mixed_with_empty", (30, 0, 50, 20)),
    ("one_expert_all_rows", (0, M, 0, 0)),
    ("trailing_rows", (10, 0, 25, 0)),
    ("all_empty", (0, 0, 0, 0)),
]
VARIANTS = [
    ("defaults", {}),
    ("small_rows_swap_ab", dict(block_m=16, swap_ab=True, reps=3)),
    ("small_rows_no_swap", dict(block_m=16, swap_ab=False)),
    ("block_n_64", dict(block_n=64, block_m=32)),
    ("two_groups_per_step", dict(group_k=2, block_m=64)),
    ("four_groups_per_step_swap_ab", dict(group_k=4, block_m=16, swap_ab=True)),
]


def _operands(seed: int, e: int = E, b_groups: bool = False):
  rng = np.random.default_rng(seed)
  # Rows of very different magnitudes: the per-group scales matter.
  x = rng.standard_normal((M, K)) * np.exp(rng.uniform(-8, 8, (M, 1)))
  w = rng.standard_normal((e, N, K)) * np.exp(rng.uniform(-6, 6, (e, 1, K // 128))
                                              ).repeat(128, axis=-1)
  qa = formats.fp8_quantize_act(jnp.asarray(x, jnp.bfloat16))
  wq = jnp.asarray(w, jnp.bfloat16)
  qb = formats.fp8_quantize_act(wq) if b_groups else formats.fp8_quantize_weight(wq)
  return qa, qb


def _exact(qa, qb, group_sizes):
  """float64 product of the dequantized values, and S = sum |a b| per output."""
  a = np.asarray(formats.fp8_dequantize(qa), np.float64)
  b = np.asarray(formats.fp8_dequantize(qb), np.float64)
  out, mag = np.zeros((M, N)), np.zeros((M, N))
  start = 0
  for g, size in enumerate(np.asarray(group_sizes)):
    rows = slice(start, start + size)
    out[rows], mag[rows] = a[rows] @ b[g].T, np.abs(a[rows]) @ np.abs(b[g]).T
    start += size
  return out, mag


def _assert_close(y, exact, mag, dtype, length=K):
  """|y - exact| within the bound above for sums of `length` products."""
  ulp = 2.0**-8 if dtype == jnp.bfloat16 else 2.0**-24
  bound = length * 2.0**-20 * mag + ulp * np.abs(exact) + 1e-30
  err = np.abs(np.asarray(y, np.float64) - exact)
  assert np.all(err <= bound), f"max err/bound {np.max(err / bound):.3g}"


@pytest.mark.parametrize("groups", [g for _, g in GROUPS], ids=[n for n, _ in GROUPS])
@pytest.mark.parametrize("opts", [o for _, o in VARIANTS], ids=[n for n, _ in VARIANTS])
def test_grouped_matches_float64(groups, opts):
  qa, qb = _operands(0)
  gs = jnp.asarray(groups, jnp.int32)
  y = fp8_gemm.grouped_matmul(qa, qb, gs, out_dtype=jnp.float32, **opts)
  exact, mag = _exact(qa, qb, gs)
  _assert_close(y, exact, mag, jnp.float32)


@pytest.mark.parametrize("b_groups", [False, True], ids=["weight_blocks", "act_groups"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16_out", "f32_out"])
def test_dense_matches_float64_and_reference(b_groups, dtype):
  qa, qb = _operands(1, e=1, b_groups=b_groups)
  qb = formats.FP8Tensor(values=qb.values[0], scale=qb.scale[0], block_rows=qb.block_rows)
  y = fp8_gemm.matmul(qa, qb, out_dtype=dtype)
  a = np.asarray(formats.fp8_dequantize(qa), np.float64)
  b = np.asarray(formats.fp8_dequantize(qb), np.float64)
  _assert_close(y.astype(jnp.float32), a @ b.T, np.abs(a) @ np.abs(b).T, dtype)
  ref = fp8_gemm.reference(qa, qb, out_dtype=jnp.float32)
  ulp = 2.0**-8 if dtype == jnp.bfloat16 else 0.0
  err = jnp.abs(y.astype(jnp.float32) - ref) - ulp * jnp.abs(ref)
  assert float(jnp.max(err) / jnp.max(jnp.abs(ref))) < 1e-5


def test_nan_block_propagates_and_zeros_stay_zero():
  """A NaN input group has scale NaN: its rows come out NaN; an all-zero row gives zeros."""
  x = np.random.default_rng(2).standard_normal((M, K)).astype(np.float32)
  x[3, 5] = np.nan
  x[7] = 0.0
  qa = jax.jit(formats.fp8_quantize_act)(jnp.asarray(x))  # eagerly, NaN input raises
  qb = formats.fp8_quantize_weight(jnp.ones((N, K), jnp.float32))
  y = np.asarray(fp8_gemm.matmul(qa, qb, out_dtype=jnp.float32))
  assert np.all(np.isnan(y[3])) and np.all(y[7] == 0.0)
  assert np.all(np.isfinite(np.delete(y, 3, axis=0)))


@pytest.mark.parametrize("broken", ["scale_a", "scale_b", "code"])
def test_broken_operand_is_detected(broken):
  """The tolerance catches a scale off by 2x or one code with a wrong exponent bit (the checks
  can fail; one wrong mantissa bit among K products is within it)."""
  qa, qb = _operands(3)
  gs = jnp.asarray((M, 0, 0, 0), jnp.int32)
  exact, mag = _exact(qa, qb, gs)
  if broken == "scale_a":
    qa = qa.replace(scale=qa.scale.at[5, 1].multiply(2.0))
  elif broken == "scale_b":
    qb = qb.replace(scale=qb.scale.at[0, 1, 2].multiply(2.0))
  else:
    # The largest product term of row 5, with its top exponent bit flipped.
    weight = np.abs(np.asarray(formats.fp8_dequantize(qb), np.float64)).mean(axis=(0, 1))
    col = int(np.argmax(np.abs(np.asarray(formats.fp8_dequantize(qa)[5], np.float64)) * weight))
    bits = jax.lax.bitcast_convert_type(qa.values, jnp.uint8)
    bits = bits.at[5, col].set(bits[5, col] ^ 0x40)
    qa = qa.replace(values=jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn))
  y = fp8_gemm.grouped_matmul(qa, qb, gs, out_dtype=jnp.float32)
  with pytest.raises(AssertionError):
    _assert_close(y, exact, mag, jnp.float32)


def test_transpose_weight_is_the_quantization_of_the_transpose():
  w = jnp.asarray(np.random.default_rng(4).standard_normal((256, 384)), jnp.bfloat16)
  t, q = fp8_gemm.transpose_weight(formats.fp8_quantize_weight(w)), formats.fp8_quantize_weight(w.T)
  np.testing.assert_array_equal(np.asarray(t.scale), np.asarray(q.scale))
  np.testing.assert_array_equal(np.asarray(t.values.astype(jnp.float32)),
                                np.asarray(q.values.astype(jnp.float32)))


@pytest.mark.parametrize("case", ["not_fp8", "bad_scale_shape", "k_mismatch", "block_n"])
def test_bad_input_raises(case):
  qa, qb = _operands(5)
  gs = jnp.asarray((M, 0, 0, 0), jnp.int32)
  kw = {}
  if case == "not_fp8":
    qa = qa.replace(values=qa.values.astype(jnp.bfloat16))
  elif case == "bad_scale_shape":
    qb = qb.replace(scale=qb.scale[:, :1])
  elif case == "k_mismatch":
    qa = formats.fp8_quantize_act(jnp.ones((M, 128), jnp.float32))
  else:
    kw = dict(block_n=256)
  with pytest.raises((TypeError, ValueError)):
    fp8_gemm.grouped_matmul(qa, qb, gs, **kw)


# ----------------------------------------------------------------------------- WGrad (experts)

MW = 300  # rows of dy [MW, N] and x [MW, K]: experts of several tiles, none a multiple of 128
PW = (-(-MW // 128) + E) * 128  # padded rows: the most any group sizes need
WGRAD_GROUPS = [
    ("mixed_with_empty", (130, 0, 150, 20)),
    ("one_expert_all_rows", (0, MW, 0, 0)),
    ("trailing_rows", (10, 0, 200, 0)),  # the last 90 rows belong to no expert
    ("all_empty", (0, 0, 0, 0)),
]
WGRAD_IMPLS = [
    ("kernel_defaults", functools.partial(fp8_gemm.grouped_wgrad, out_dtype=jnp.float32)),
    ("kernel_block_32x128", functools.partial(fp8_gemm.grouped_wgrad, out_dtype=jnp.float32,
                                              block_n=32, block_k=128)),
    ("reference", functools.partial(fp8_gemm.wgrad_reference, out_dtype=jnp.float32)),
]


def _wgrad_operands(seed: int, groups):
  """dyt [N, PW], xt [K, PW] quantized in the padded layout, and each expert's padded rows."""
  rng = np.random.default_rng(seed)
  # Magnitudes vary along the rows and the columns: every tile's per-column scales matter.
  dy = rng.standard_normal((MW, N)) * np.exp(rng.uniform(-6, 6, (MW, 1)) +
                                             rng.uniform(-3, 3, (1, N)))
  x = rng.standard_normal((MW, K)) * np.exp(rng.uniform(-6, 6, (MW, 1)) +
                                            rng.uniform(-3, 3, (1, K)))
  dyp, xp, spans, row, tile = np.zeros((PW, N)), np.zeros((PW, K)), [], 0, 0
  for size in groups:
    p0 = tile * 128
    dyp[p0:p0 + size], xp[p0:p0 + size] = dy[row:row + size], x[row:row + size]
    tile += -(-size // 128)
    spans.append(slice(p0, tile * 128))
    row += size
  quant = lambda a: formats.fp8_quantize_act(jnp.asarray(a.T, jnp.bfloat16))
  return quant(dyp), quant(xp), spans


def _wgrad_exact(dyt, xt, spans):
  """float64 dW [E, N, K] of the dequantized values, and S = sum |dy x|, per expert."""
  d = np.asarray(formats.fp8_dequantize(dyt), np.float64)
  x = np.asarray(formats.fp8_dequantize(xt), np.float64)
  out = np.stack([d[:, s] @ x[:, s].T for s in spans])
  mag = np.stack([np.abs(d[:, s]) @ np.abs(x[:, s]).T for s in spans])
  return out, mag


@pytest.mark.parametrize("groups", [g for _, g in WGRAD_GROUPS], ids=[n for n, _ in WGRAD_GROUPS])
@pytest.mark.parametrize("impl", [f for _, f in WGRAD_IMPLS], ids=[n for n, _ in WGRAD_IMPLS])
def test_wgrad_matches_float64(groups, impl):
  dyt, xt, spans = _wgrad_operands(6, groups)
  dw = impl(dyt, xt, jnp.asarray(groups, jnp.int32))
  assert dw.shape == (E, N, K) and dw.dtype == jnp.float32
  exact, mag = _wgrad_exact(dyt, xt, spans)
  _assert_close(dw, exact, mag, jnp.float32, length=PW)
  for g, size in enumerate(groups):
    if size == 0:  # experts with no rows: zeros
      assert not np.any(np.asarray(dw[g]))


@pytest.mark.parametrize("broken", ["scale_dy", "scale_x", "code"])
def test_wgrad_broken_operand_is_detected(broken):
  """The bound catches one tile's column scale off by 2x or one code with a wrong exponent bit."""
  groups = WGRAD_GROUPS[0][1]
  dyt, xt, spans = _wgrad_operands(7, groups)
  exact, mag = _wgrad_exact(dyt, xt, spans)
  if broken == "scale_dy":
    dyt = dyt.replace(scale=dyt.scale.at[5, 3].multiply(2.0))  # expert 2's second tile
  elif broken == "scale_x":
    xt = xt.replace(scale=xt.scale.at[7, 0].multiply(2.0))
  else:
    # The largest product term of dyt's column 5 in expert 0's rows, top exponent bit flipped.
    d = np.abs(np.asarray(formats.fp8_dequantize(dyt), np.float64))
    x = np.abs(np.asarray(formats.fp8_dequantize(xt), np.float64)).mean(axis=0)
    col = int(np.argmax((d[5] * x)[spans[0]]))
    bits = jax.lax.bitcast_convert_type(dyt.values, jnp.uint8)
    bits = bits.at[5, col].set(bits[5, col] ^ 0x40)
    dyt = dyt.replace(values=jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn))
  dw = fp8_gemm.grouped_wgrad(dyt, xt, jnp.asarray(groups, jnp.int32), out_dtype=jnp.float32)
  with pytest.raises(AssertionError):
    _assert_close(dw, exact, mag, jnp.float32, length=PW)


@pytest.mark.parametrize("case", ["not_fp8", "weight_blocks", "rows_mismatch", "group_sizes",
                                  "block_k"])
def test_wgrad_bad_input_raises(case):
  dyt, xt, _ = _wgrad_operands(8, WGRAD_GROUPS[0][1])
  gs, kw = jnp.asarray(WGRAD_GROUPS[0][1], jnp.int32), {}
  if case == "not_fp8":
    dyt = dyt.replace(values=dyt.values.astype(jnp.bfloat16))
  elif case == "weight_blocks":
    dyt = formats.FP8Tensor(values=dyt.values, scale=jnp.ones((N // 128, PW // 128)),
                            block_rows=128)
  elif case == "rows_mismatch":
    xt = xt.replace(values=xt.values[:, :-128], scale=xt.scale[:, :-1])
  elif case == "group_sizes":
    gs = gs[None]
  else:
    kw = dict(block_k=1024)
  with pytest.raises((TypeError, ValueError)):
    fp8_gemm.grouped_wgrad(dyt, xt, gs, **kw)


@pytest.mark.parametrize("dense", [False, True], ids=["grouped", "dense"])
def test_stacked_layer_is_read_in_place(dense):
  """`layer=` on a stack of 2 layers' weights (a traced index, as inside a scan over layers):
  bit for bit the call on that layer's weights alone."""
  rng = np.random.default_rng(7)
  e = 1 if dense else 2
  ws = [formats.fp8_quantize_weight(jnp.asarray(rng.standard_normal((e, 128, 256)),
                                                jnp.bfloat16)) for _ in range(2)]
  if dense:
    ws = [jax.tree.map(lambda v: v[0], w) for w in ws]
  stack = jax.tree.map(lambda *v: jnp.stack(v), *ws)
  a = formats.fp8_quantize_act(jnp.asarray(rng.standard_normal((24, 256)), jnp.bfloat16))
  gs = jnp.asarray([10, 14] if not dense else [24], jnp.int32)
  call = ((lambda w, i: fp8_gemm.matmul(a, w, layer=i)) if dense else
          (lambda w, i: fp8_gemm.grouped_matmul(a, w, gs, layer=i)))
  alone = ((lambda w: fp8_gemm.matmul(a, w)) if dense else
           (lambda w: fp8_gemm.grouped_matmul(a, w, gs)))
  outs = [np.asarray(jax.jit(call)(stack, jnp.int32(i))) for i in range(2)]
  for i, w in enumerate(ws):
    np.testing.assert_array_equal(outs[i], np.asarray(alone(w)))
  assert not np.array_equal(outs[0], outs[1])
