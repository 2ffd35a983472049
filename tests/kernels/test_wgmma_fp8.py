"""The wgmma FP8 GEMM (`trace_jax.kernels.wgmma_fp8`): its row tiles on CPU, its values on the GPU.

CPU: `tile_table` against a numpy walk over the groups: every row of every group lies in
exactly one used tile of that group, the rows past the groups in tiles of group -1, and no
used tile holds rows of two groups; `store_runs` over every row range of a tile; unsupported
operands refused. GPU (Hopper): the kernel against the float64 product and
the bound of tests/kernels/test_fp8_gemm.py (the same operands), bit for bit against itself
with the layer read in place, and NaN propagation. Its lowering: test_mosaic_lowering.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.kernels import test_fp8_gemm as cases
from trace_jax.kernels import fp8_gemm, wgmma_fp8
from trace_jax.quant import formats

ON_GPU = jax.default_backend() == "gpu"
_GPU_ONLY = ("wgmma_fp8 runs on a Hopper GPU only: Mosaic GPU, no interpret mode (its CPU "
             "coverage: tile_table, store_runs and lowering)")

TABLES = [
    ("mixed_with_empty", 200, (30, 0, 90, 20), 64),
    ("one_group_all_rows", 256, (0, 256, 0), 64),
    ("trailing_rows", 200, (10, 0, 25, 0), 64),
    ("all_empty", 128, (0, 0, 0), 64),
    ("boundaries_inside_blocks", 130, (1, 63, 1, 64, 1), 64),
    ("sizes_past_m_clipped", 100, (60, 80), 32),
]


def _rows_by_tile(table: np.ndarray, m: int, block_m: int) -> dict[int, list[int]]:
  """group -> the rows its used tiles hold, in tile order."""
  out: dict[int, list[int]] = {}
  for g, blk, lo, hi in table:
    assert 0 <= lo <= hi <= block_m, (g, blk, lo, hi)
    if hi > lo:
      rows = list(range(blk * block_m + lo, blk * block_m + hi))
      assert rows[-1] < m
      out.setdefault(int(g), []).extend(rows)
  return out


@pytest.mark.parametrize("m,sizes,block_m", [c[1:] for c in TABLES], ids=[c[0] for c in TABLES])
def test_tile_table_covers_each_row_once_in_its_group(m, sizes, block_m):
  table = np.asarray(wgmma_fp8.tile_table(jnp.asarray(sizes, jnp.int32), m, block_m))
  assert table.shape == (wgmma_fp8.num_tiles(m, len(sizes), block_m), 4)
  got = _rows_by_tile(table, m, block_m)
  start, want = 0, {}
  for g, size in enumerate(sizes):
    end = min(start + size, m)
    if end > start:
      want[g] = list(range(start, end))
    start = end
  if start < m:
    want[-1] = list(range(start, m))
  assert got == want


def test_tile_table_fails_on_a_dropped_boundary_tile():
  """The check above is not vacuous: a table missing the second group's share of a block two
  groups share does not cover that group's rows."""
  m, sizes = 130, (1, 63, 1, 64, 1)
  table = np.asarray(wgmma_fp8.tile_table(jnp.asarray(sizes, jnp.int32), m, 64))
  used = np.nonzero(table[:, 3] > table[:, 2])[0]
  broken = np.delete(table, used[1], axis=0)
  assert _rows_by_tile(broken, m, 64) != _rows_by_tile(table, m, 64)


@pytest.mark.parametrize("case", ["float16_values", "weights_of_1x128_groups", "k_not_whole"])
def test_unsupported_operands_are_refused(case):
  qa, qb = cases._operands(0)
  if case == "float16_values":
    qa = formats.FP8Tensor(values=qa.values.astype(jnp.float16), scale=qa.scale, block_rows=1)
  elif case == "weights_of_1x128_groups":
    qb = formats.fp8_quantize_act(jnp.ones((cases.E, cases.N, cases.K), jnp.bfloat16))
  else:
    qa = formats.FP8Tensor(values=qa.values[:, :200], scale=qa.scale[:, :2], block_rows=1)
  assert not wgmma_fp8.supported(qa, qb)
  with pytest.raises(ValueError, match="wgmma FP8 GEMM: unsupported"):
    wgmma_fp8.grouped_matmul(qa, qb, jnp.asarray((25,) * 4, jnp.int32))


@pytest.mark.parametrize("opts", [{}, dict(stages=2, group_k=2), dict(stages=1),
                                  dict(warpgroups=2)],
                         ids=["defaults", "two_k_groups_a_step", "one_slot",
                              "two_compute_warpgroups"])
@pytest.mark.parametrize("groups", [g for _, g in cases.GROUPS], ids=[n for n, _ in cases.GROUPS])
def test_grouped_matches_float64(groups, opts):
  if not ON_GPU:
    pytest.skip(_GPU_ONLY)
  qa, qb = cases._operands(1)
  gs = jnp.asarray(groups, jnp.int32)
  y = wgmma_fp8.grouped_matmul(qa, qb, gs, **opts)
  exact, mag = cases._exact(qa, qb, gs)
  assert y.shape == (cases.M, cases.N) and y.dtype == jnp.bfloat16
  cases._assert_close(y, exact, mag, jnp.bfloat16)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_dense_matches_float64_and_layer_in_place(dtype):
  if not ON_GPU:
    pytest.skip(_GPU_ONLY)
  qa, qb = cases._operands(2, e=2)
  y = wgmma_fp8.matmul(qa, formats.FP8Tensor(values=qb.values[1], scale=qb.scale[1],
                                             block_rows=128), out_dtype=dtype)
  exact, mag = cases._exact(qa, formats.FP8Tensor(values=qb.values[1:], scale=qb.scale[1:],
                                                  block_rows=128), jnp.asarray([cases.M]))
  cases._assert_close(y, exact, mag, jnp.dtype(dtype))
  stacked = wgmma_fp8.matmul(qa, qb, out_dtype=dtype, layer=jnp.int32(1))
  np.testing.assert_array_equal(np.asarray(stacked), np.asarray(y))
  two = wgmma_fp8.matmul(qa, qb, out_dtype=dtype, layer=jnp.int32(1), warpgroups=2)
  np.testing.assert_array_equal(np.asarray(two), np.asarray(y))  # the same sums per row


def test_nan_code_propagates_to_its_rows_only():
  if not ON_GPU:
    pytest.skip(_GPU_ONLY)
  qa, qb = cases._operands(3)
  gs = jnp.asarray((30, 0, 50, 20), jnp.int32)
  values = qa.values.at[5, 7].set(jnp.asarray(jnp.nan, jnp.float8_e4m3fn))
  y = np.asarray(wgmma_fp8.grouped_matmul(
      formats.FP8Tensor(values=values, scale=qa.scale, block_rows=1), qb, gs), np.float32)
  assert np.isnan(y[5]).all() and np.isfinite(np.delete(y, 5, axis=0)).all()
  ref = np.asarray(fp8_gemm.reference(qa, qb, gs), np.float32)
  assert np.isfinite(ref).all()


@pytest.mark.parametrize("rows", [64, 8], ids=["warpgroup_rows", "eight_rows"])
def test_store_runs_cover_exactly_the_tile_rows(rows):
  """Every [lo, hi) within a tile is stored once, by runs inside the tile."""
  for lo in range(rows + 1):
    for hi in range(lo, rows + 1):
      got = []
      for start, run, taken in wgmma_fp8.store_runs(lo, hi, rows):
        if taken:
          assert 0 <= start and start + run <= rows
          got.extend(range(start, start + run))
      assert got == list(range(lo, hi)), (lo, hi)
