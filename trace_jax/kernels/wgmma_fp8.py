"""Block-scaled FP8 GEMMs on Hopper's wgmma (Mosaic GPU): `fp8_gemm`'s contract, on TMA tiles.

Why: `fp8_gemm`'s Triton kernel reached 0.27 of the BF16 matmul rate on the experts' GEMM
(docs/benchmarks.md): every 128-wide K group's product leaves the tensor cores to be scaled
before the next is added, and Triton keeps each program's loads and MMAs in one stream. Here
the operand tiles arrive by TMA through a ring of `stages` shared-memory slots
(`plgpu.emit_pipeline`: the loads of later K groups in flight while the current one is
multiplied), and the row tiles are laid out as JAX's Mosaic GPU grouped GEMM lays them out.

Contract (`fp8_gemm.grouped_matmul`'s): a [M, K] float8_e4m3fn in 1x128 groups (rows sorted by
expert), b [L, E, N, K] in 128x128 blocks read at layer `layer` in place, group_sizes [E]:

  out[m, n] = sum_kb (sum_{k in kb} a[m, k] b[e(m), n, k]) * sa[m, kb] * sb[e(m), n // 128, kb]

Each K group's sum is one wgmma into a fresh float32 accumulator (the tensor cores' FP8 sum,
which keeps fewer bits than float32 while adding: on the H100 the float32 outputs were within
1.8-2.7e-4 of the reference's largest magnitude, Triton's kernel's within 2e-6), scaled by the
row's and the block's scales and added to the running float32 sum (the per-group promotion of
`fp8_gemm`); the total is rounded once to the output dtype. Rows past sum(group_sizes) come
out zero.

Grid (T, N / 128): T row tiles of BLOCK_M rows, each within one group (`tile_table`: a block
of rows that two experts share is two tiles, each storing its own expert's rows; the rows past
the groups are tiles of group -1 that store zeros). Program (t, j): its tile's K loop (one
warpgroup of 64 rows, or two sharing each B tile beside a third that issues the loads), then
the tile's rows [lo, hi) stored by TMA through shared memory (whole rows in power-of-two runs,
`store_runs`, as JAX's grouped GEMM stores them). GPU only: the CPU tests lower it
(tests/kernels/test_mosaic_lowering.py) and check `tile_table` and `store_runs`; its values
are tested on the GPU against a float64 product (tests/kernels/test_wgmma_fp8.py).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from trace_jax.quant import formats

GROUP = formats.FP8_GROUP  # 128: the K group of every scale and the weight block's N side
WG_ROWS = 64               # one warpgroup's wgmma rows
BLOCK_M = WG_ROWS          # the row tile with one compute warpgroup
BLOCK_N = GROUP            # one weight block row: one weight scale per K group
STAGES = 4                 # ring slots: 4 x (8 + 16) KB of operand tiles


def supported(a: formats.FP8Tensor, b: formats.FP8Tensor) -> bool:
  """Whether the kernel takes these operands: E4M3 values, b in 128x128 blocks, K and N in
  whole 128-wide groups, a 2-D."""
  k = a.values.shape[-1]
  n = b.values.shape[-2]
  return (a.values.dtype == jnp.float8_e4m3fn and b.values.dtype == jnp.float8_e4m3fn
          and a.values.ndim == 2 and b.block_rows == GROUP and a.block_rows == 1
          and k % GROUP == 0 and n % BLOCK_N == 0 and k == b.values.shape[-1])


def num_tiles(m: int, num_groups: int, block_m: int = BLOCK_M) -> int:
  """Row tiles the table has room for: every block once, plus one per group boundary (a block
  two groups share) and one for the rows past the groups."""
  return -(-m // block_m) + num_groups


def tile_table(group_sizes: jax.Array, m: int, block_m: int = BLOCK_M) -> jax.Array:
  """int32 [num_tiles, 4]: each row tile's (group, block, lo, hi): rows block * block_m + [lo,
  hi) belong to `group` (-1: rows past sum(group_sizes), stored as zeros); unused tiles have
  lo == hi. Tiles come group by group, blocks in order within each."""
  e = group_sizes.shape[0]
  gs = jnp.maximum(group_sizes.astype(jnp.int32), 0)
  ends = jnp.minimum(jnp.cumsum(gs), m)
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
  starts = jnp.concatenate([starts, ends[-1:]])          # the rows past the groups: group e
  ends = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])
  first_blk = starts // block_m
  count = jnp.where(ends > starts, (ends + block_m - 1) // block_m - first_blk, 0)
  cum = jnp.cumsum(count)
  first_tile = cum - count
  tid = jnp.arange(num_tiles(m, e, block_m), dtype=jnp.int32)
  g = jnp.minimum(jnp.searchsorted(cum, tid, side="right").astype(jnp.int32), e)
  blk = first_blk[g] + tid - first_tile[g]
  lo = jnp.maximum(starts[g], blk * block_m) - blk * block_m
  hi = jnp.minimum(ends[g], blk * block_m + block_m) - blk * block_m
  used = tid < cum[-1]
  return jnp.stack([jnp.where(g == e, -1, g), jnp.where(used, blk, 0),
                    jnp.where(used, lo, 0), jnp.where(used, hi, 0)], axis=1)


def store_runs(lo: Any, hi: Any, rows: int) -> list[tuple[Any, int, Any]]:
  """Rows [lo, hi) of a tile of `rows` (a power of two) as static-length runs: (start, length,
  taken) per power of two from `rows` down to 1, taken where that bit of hi - lo is set, each
  run starting where the taken ones before it end. Works on ints and traced scalars."""
  size, start, runs, run = hi - lo, lo, [], rows
  while run >= 1:
    runs.append((start, run, size & run != 0))
    start = start + (size & run)
    run //= 2
  return runs


def _store_rows(acc: jax.Array, o_smem: Any, o_gmem: Any, row0: Any, lo: Any, hi: Any,
                cols: Any) -> None:
  """Rows [lo, hi) of the tile (in shared memory) to o_gmem rows row0 + [lo, hi): one TMA
  store per taken run of `store_runs` (TMA boxes have static shapes)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # Hopper only: loaded on use

  o_smem[...] = acc.astype(o_smem.dtype)
  plgpu.commit_smem()
  for start, run, taken in store_runs(lo, hi, acc.shape[0]):
    def store(run=run, start=start):
      plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(start, run)],
                              o_gmem.at[pl.ds(row0 + start, run), cols])
    pl.when(taken)(store)
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _step(idx, a_smem, b_smem, s_smem, acc, *, sb_ref, lyr, ge, j, group_k: int,
          rows: Any = None):
  """One pipeline step: group_k K groups, each one wgmma into a fresh accumulator, all issued
  before the first is read back (wait_n: the later ones run while it is scaled), each scaled
  by its row scales times its block scale and added to acc. rows: this warpgroup's 64 rows of
  the tile (None: the tile is one warpgroup's)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # Hopper only: loaded on use

  (kb,) = idx
  row = plgpu.Layout.WGMMA.reduce(1)
  # The scales first: their loads are in flight while the wgmmas run.
  if rows is not None:
    a_smem, s_smem = a_smem.at[rows], s_smem.at[:, rows]
  scales = [plgpu.layout_cast(s_smem[i], row) * sb_ref[lyr, ge, j, kb * group_k + i]
            for i in range(group_k)]

  def mma(*parts):
    for i, part_ref in enumerate(parts):
      cols = pl.ds(i * GROUP, GROUP)
      plgpu.wgmma(part_ref, a_smem.at[:, cols], plgpu.transpose_ref(b_smem.at[:, cols], (1, 0)))
    total = acc
    for i, part_ref in enumerate(parts):
      part = plgpu.wgmma_accumulator_load(part_ref, wait_n=group_k - 1 - i)
      total = total + part * jax.lax.broadcast_in_dim(scales[i], part.shape, [0])
    return total

  return pl.run_scoped(mma, *[plgpu.ACC((WG_ROWS, BLOCK_N), jnp.float32)] * group_k)


def _body(tab_ref, layer_ref, a_ref, sat_ref, b_ref, sb_ref, o_ref, o_smem, *, k: int,
          stages: int, group_k: int, warpgroups: int):
  """Program (t, j): one warpgroup running the K loop (`plgpu.emit_pipeline`), or with
  warpgroups 2, two computing 64 rows each from the same B tiles while a third issues the
  TMA loads (`plgpu.emit_pipeline_warp_specialized`)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # Hopper only: loaded on use

  t, j = jax.lax.axis_index("t"), jax.lax.axis_index("j")
  g, blk, lo, hi = tab_ref[t, 0], tab_ref[t, 1], tab_ref[t, 2], tab_ref[t, 3]
  ge = jnp.maximum(g, 0)  # group -1's tiles run expert 0's loop and store zeros
  lyr = layer_ref[0]
  bm, width = WG_ROWS * warpgroups, GROUP * group_k
  fp8_tiles = (plgpu.TilingTransform((8, GROUP)), plgpu.SwizzleTransform(128))
  in_specs = [plgpu.BlockSpec((bm, width), lambda kb: (blk, kb), transforms=fp8_tiles),
              plgpu.BlockSpec((BLOCK_N, width), lambda kb: (j, kb), transforms=fp8_tiles),
              # One warpgroup: the scales' slot is refilled a step late (no wgmma wait orders
              # their reads); two: each slot is released when both compute warpgroups are done.
              plgpu.BlockSpec((group_k, bm), lambda kb: (kb, blk),
                              delay_release=int(stages > 1 and warpgroups == 1))]
  zero = lambda: plgpu.layout_cast(jnp.zeros((WG_ROWS, BLOCK_N), jnp.float32),
                                   plgpu.Layout.WGMMA)
  cols = pl.ds(j * BLOCK_N, BLOCK_N)

  def finish(acc, base):
    """Store the warpgroup's rows base + [0, 64) of the tile that lie in [lo, hi)."""
    acc = jnp.where(g >= 0, acc, jnp.zeros_like(acc))
    clip = lambda r: jnp.clip(r - base, 0, WG_ROWS)
    _store_rows(acc, o_smem.at[pl.ds(base, WG_ROWS)], o_ref, blk * bm + base, clip(lo),
                clip(hi), cols)

  step = functools.partial(_step, sb_ref=sb_ref, lyr=lyr, ge=ge, j=j, group_k=group_k)
  if warpgroups == 1:
    def run():
      finish(plgpu.emit_pipeline(step, grid=(k // width,), max_concurrent_steps=stages,
                                 init_carry=zero(), in_specs=in_specs)(
                                     a_ref, b_ref.at[lyr, ge], sat_ref), 0)
  else:
    wg = jax.lax.axis_index("wg")
    base = wg * WG_ROWS

    def compute(eval_pipeline):
      finish(eval_pipeline(zero()), base)

    pipe = plgpu.emit_pipeline_warp_specialized(
        functools.partial(step, rows=pl.ds(base, WG_ROWS)), grid=(k // width,),
        memory_registers=40, num_compute_wgs=warpgroups, wg_axis="wg",
        max_concurrent_steps=stages, compute_context=compute, in_specs=in_specs)
    run = lambda: pipe(a_ref, b_ref.at[lyr, ge], sat_ref)
  pl.when(hi > lo)(run)


@functools.partial(jax.jit, static_argnames=("out_dtype", "stages", "group_k", "warpgroups"))
def _call(a_values, a_scale, b_values, b_scale, group_sizes, layer, *, out_dtype, stages,
          group_k, warpgroups):
  from jax.experimental.pallas import mosaic_gpu as plgpu  # Hopper only: loaded on use

  m, k = a_values.shape
  num_layers, e, n, _ = b_values.shape
  if m == 0:
    return jnp.zeros((0, n), out_dtype)
  bm = WG_ROWS * warpgroups
  pad = -m % bm  # whole row blocks for every TMA window (no copy when M is whole)
  if pad:
    a_values = jnp.pad(a_values, ((0, pad), (0, 0)))
    a_scale = jnp.pad(a_scale, ((0, pad), (0, 0)))
  table = tile_table(group_sizes, m, bm)
  threads = dict(num_threads=warpgroups + 1, thread_name="wg") if warpgroups > 1 else {}
  kernel = plgpu.kernel(
      functools.partial(_body, k=k, stages=stages, group_k=group_k, warpgroups=warpgroups),
      out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
      grid=(table.shape[0], n // BLOCK_N), grid_names=("t", "j"),
      kernel_name="fp8_grouped_gemm_wgmma",
      scratch_types=[plgpu.SMEM((bm, BLOCK_N), out_dtype)], **threads,
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane))
  return kernel(table, jnp.reshape(layer, (1,)).astype(jnp.int32), a_values, a_scale.T,
                b_values, b_scale)


def grouped_matmul(a: formats.FP8Tensor, b: formats.FP8Tensor, group_sizes: jax.Array, *,
                   out_dtype: Any = jnp.bfloat16, layer: jax.Array | None = None,
                   stages: int = STAGES, group_k: int = 1, warpgroups: int = 1
                   ) -> jax.Array:
  """FP8 rows a [M, K] (1x128 groups, sorted by expert) times b [E, N, K] (128x128 blocks; with
  `layer`, a stack [L, E, N, K] read at that layer in place) -> [M, N] in out_dtype.

  stages: ring slots of the K loop; group_k: K groups per slot (1 or 2; with 2 the second
  group's wgmma runs while the first's sum is scaled, at 64 more registers a thread);
  warpgroups: compute warpgroups of 64 rows each sharing every B tile (1, or 2 with a third
  warpgroup issuing the loads; 2 takes group_k 1)."""
  if not supported(a, b):
    raise ValueError(f"wgmma FP8 GEMM: unsupported a {a.values.shape} {a.values.dtype} "
                     f"(block_rows {a.block_rows}), b {b.values.shape} (block_rows "
                     f"{b.block_rows}): E4M3, 128x128 weight blocks, K and N multiples of 128")
  bv, bs = b.values, b.scale
  if layer is None:
    bv, bs, layer = bv[None], bs[None], jnp.zeros((), jnp.int32)
  if bv.ndim != 4 or group_sizes.shape != (bv.shape[1],):
    raise ValueError(f"wgmma FP8 GEMM: b {b.values.shape} and group_sizes {group_sizes.shape} "
                     "disagree on the experts")
  steps = a.values.shape[1] // GROUP // max(group_k, 1)
  if stages < 1 or group_k not in (1, 2) or steps * group_k * GROUP != a.values.shape[1]:
    raise ValueError(f"wgmma FP8 GEMM: stages must be >= 1 and group_k 1 or 2 dividing "
                     f"K / 128, got stages={stages}, group_k={group_k}, K={a.values.shape[1]}")
  if warpgroups not in (1, 2) or (warpgroups == 2 and group_k != 1):
    raise ValueError(f"wgmma FP8 GEMM: warpgroups must be 1 or 2 (2 with group_k 1), got "
                     f"warpgroups={warpgroups}, group_k={group_k}")
  return _call(a.values, a.scale, bv, bs, group_sizes, layer, out_dtype=jnp.dtype(out_dtype),
               stages=min(stages, steps), group_k=group_k, warpgroups=warpgroups)


def matmul(a: formats.FP8Tensor, b: formats.FP8Tensor, *, out_dtype: Any = jnp.bfloat16,
           layer: jax.Array | None = None, **kw) -> jax.Array:
  """FP8 a [M, K] (1x128 groups) times b [N, K] (128x128 blocks; with `layer`, [L, N, K]) ->
  [M, N]: the grouped GEMM with one group."""
  axis = 0 if layer is None else 1
  stacked = formats.FP8Tensor(values=jnp.expand_dims(b.values, axis),
                              scale=jnp.expand_dims(b.scale, axis), block_rows=b.block_rows)
  return grouped_matmul(a, stacked, jnp.full((1,), a.values.shape[0], jnp.int32),
                        out_dtype=out_dtype, layer=layer, **kw)
