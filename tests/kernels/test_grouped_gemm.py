"""Grouped GEMMs of MoE training (`trace_jax.kernels.grouped_gemm`) against float64 products.

On CPU the kernels run in the Pallas interpreter, on the GPU as the Triton kernels
(`interpret=None`). The reference is the float64 product of the same (bf16 or f32) operands per
expert, built here in numpy from the group sizes. Tolerance: float32 sums in any order are
within C * 2**-24 * S (C products, S = sum |a b|); the GPU's MMA may add in fewer bits, so the
bound allows C * 2**-20 * S, plus half an ulp of the output dtype. A row matched to the wrong
expert, a missed or extra row, or a transposed weight is off by far more (the cases below).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax.kernels import grouped_gemm as gg

E, N, K = 4, 96, 64  # N = 3 x 32: tiles smaller than N that are not its largest power of two
M = 100  # not a multiple of any row block

GROUPS = [
    ("mixed_with_empty", (30, 0, 50, 20)),
    ("one_expert_all_rows", (0, M, 0, 0)),
    ("trailing_rows", (10, 0, 25, 0)),  # rows 35..99 belong to no expert
    ("all_empty", (0, 0, 0, 0)),
]
VARIANTS = [
    ("defaults", {}),
    ("small_blocks_reps", dict(block_m=16, block_n=32, block_k=16, reps=3)),
]
OPS = ("fprop", "dgrad", "wgrad")


def _operands(seed: int, dtype):
  rng = np.random.default_rng(seed)
  # Rows of very different magnitudes: a row paired with the wrong expert or lost shows.
  x = rng.standard_normal((M, K)) * np.exp(rng.uniform(-4, 4, (M, 1)))
  dy = rng.standard_normal((M, N)) * np.exp(rng.uniform(-4, 4, (M, 1)))
  w = rng.standard_normal((E, N, K)) * np.exp(rng.uniform(-3, 3, (E, 1, 1)))
  return (jnp.asarray(x, dtype), jnp.asarray(dy, dtype), jnp.asarray(w, dtype))


def _spans(sizes):
  ends = np.cumsum(sizes)
  return [slice(int(end - size), int(end)) for size, end in zip(sizes, ends)]


def _exact(op, x, dy, w, sizes):
  """float64 result and S = sum |a b| per output element."""
  x, dy, w = (np.asarray(a, np.float64) for a in (x, dy, w))
  if op == "wgrad":
    out, mag = np.zeros((E, N, K)), np.zeros((E, N, K))
    for g, rows in enumerate(_spans(sizes)):
      out[g], mag[g] = dy[rows].T @ x[rows], np.abs(dy[rows]).T @ np.abs(x[rows])
    return out, mag
  a, cols = (x, N) if op == "fprop" else (dy, K)
  out, mag = np.zeros((M, cols)), np.zeros((M, cols))
  for g, rows in enumerate(_spans(sizes)):
    wg = w[g].T if op == "fprop" else w[g]
    out[rows], mag[rows] = a[rows] @ wg, np.abs(a[rows]) @ np.abs(wg)
  return out, mag


def _run(op, x, dy, w, gs, **kw):
  if op == "fprop":
    return gg.grouped_matmul(x, w, gs, **kw)
  if op == "dgrad":
    return gg.grouped_matmul(dy, w, gs, transpose_w=True, **kw)
  kw.pop("reps", None)  # wgrad: one program per (expert, output tile)
  return gg.grouped_wgrad(dy, x, gs, **kw)


def _assert_close(y, exact, mag, length):
  ulp = 2.0**-8 if y.dtype == jnp.bfloat16 else 2.0**-24
  bound = length * 2.0**-20 * mag + ulp * np.abs(exact) + 1e-30
  err = np.abs(np.asarray(y, np.float64) - exact)
  assert np.all(err <= bound), f"max err/bound {np.max(err / bound):.3g}"


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("groups", [g for _, g in GROUPS], ids=[n for n, _ in GROUPS])
def test_matches_float64(groups, op):
  x, dy, w = _operands(0, jnp.bfloat16)
  gs = jnp.asarray(groups, jnp.int32)
  y = _run(op, x, dy, w, gs)
  assert y.dtype == jnp.bfloat16
  exact, mag = _exact(op, x, dy, w, groups)
  _assert_close(y, exact, mag, {"fprop": K, "dgrad": N, "wgrad": M}[op])


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("opts", [o for _, o in VARIANTS[1:]], ids=[n for n, _ in VARIANTS[1:]])
def test_tile_variants_and_float32(opts, op):
  x, dy, w = _operands(1, jnp.float32)
  groups = GROUPS[0][1]
  y = _run(op, x, dy, w, jnp.asarray(groups, jnp.int32), **opts)
  assert y.dtype == jnp.float32
  exact, mag = _exact(op, x, dy, w, groups)
  _assert_close(y, exact, mag, {"fprop": K, "dgrad": N, "wgrad": M}[op])


def test_matches_plain_jax_references():
  x, dy, w = _operands(2, jnp.bfloat16)
  gs = jnp.asarray((7, 41, 0, 33), jnp.int32)
  for got, ref in ((gg.grouped_matmul(x, w, gs), gg.reference(x, w, gs)),
                   (gg.grouped_matmul(dy, w, gs, transpose_w=True),
                    gg.reference(dy, w, gs, transpose_w=True)),
                   (gg.grouped_wgrad(dy, x, gs), gg.wgrad_reference(dy, x, gs))):
    ref = np.asarray(ref, np.float32)
    np.testing.assert_allclose(np.asarray(got, np.float32), ref, rtol=2**-7,
                               atol=1e-3 * float(np.abs(ref).max()))


def test_nonfinite_rows_stay_in_their_expert():
  """inf/NaN in expert 0's rows (and in rows no expert holds) reach no other expert's output
  or weight gradient: each kernel masks rows to their expert."""
  x, dy, w = _operands(3, jnp.float32)
  groups = (30, 0, 50, 10)  # rows 90..99 belong to no expert
  x = x.at[3, 5].set(jnp.inf).at[95].set(jnp.nan)
  dy = dy.at[4, 7].set(jnp.nan).at[92].set(jnp.inf)
  gs = jnp.asarray(groups, jnp.int32)
  y = np.asarray(_run("fprop", x, dy, w, gs))
  assert not np.isfinite(y[3]).all() and np.isfinite(np.delete(y, [3], axis=0)).all()
  assert not y[90:].any()  # rows past the groups: zeros
  dx = np.asarray(_run("dgrad", x, dy, w, gs))
  assert not np.isfinite(dx[4]).all() and np.isfinite(np.delete(dx, [4], axis=0)).all()
  dw = np.asarray(_run("wgrad", x, dy, w, gs))
  assert not np.isfinite(dw[0]).all()
  assert np.isfinite(dw[1:]).all() and not dw[1].any()  # empty expert: exact zeros


@pytest.mark.parametrize("case", ["n_not_16", "group_sizes_shape", "k_mismatch", "int_rows",
                                  "block_not_pow2", "wgrad_rows"])
def test_bad_input_raises(case):
  x, dy, w = _operands(4, jnp.bfloat16)
  gs = jnp.asarray(GROUPS[0][1], jnp.int32)
  if case == "n_not_16":
    with pytest.raises(ValueError, match="multiple of 16"):
      gg.grouped_matmul(x, w[:, :40], gs)
  elif case == "group_sizes_shape":
    with pytest.raises(ValueError, match="group_sizes"):
      gg.grouped_matmul(x, w, gs[:3])
  elif case == "k_mismatch":
    with pytest.raises(ValueError, match="disagree on K"):
      gg.grouped_matmul(x[:, :32], w, gs)
  elif case == "int_rows":
    with pytest.raises(TypeError, match="dtype"):
      gg.grouped_matmul(x.astype(jnp.int32), w, gs)
  elif case == "block_not_pow2":
    with pytest.raises(ValueError, match="power of two"):
      gg.grouped_matmul(x, w, gs, block_m=48)
  else:
    with pytest.raises(ValueError, match="dy's M rows"):
      gg.grouped_wgrad(dy, x[:50], gs)
