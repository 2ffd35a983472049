"""Grouped matmul for MoE experts: rows sorted by expert times that expert's weight matrix.

Implementations of one contract, x [M, in] (rows sorted by group, `group_sizes` [E]
summing to M) times w [E, out, in] -> [M, out]:

- "ragged_dot": `jax.lax.ragged_dot_general`. XLA (CPU and, per the H200 runs, GPU) expands
  it densely over the groups, so its temporaries grow like E x M: the GRPO step of
  `configs/small_h200.py` held ~49 GB on the H200 and its CPU buffer plan asks 74 GiB.
- "tiled": every group padded to whole tiles of `tile` rows (static bound: ceil(M / tile) + E
  tiles), then batched matmuls of chunks of 64 tiles against their groups' weights, one chunk
  at a time. Temporaries grow like M + E x tile plus one chunk's gathered weights. Each output
  row is the same dot product as ragged_dot's, summed in float32 in the kernel's own order
  (equal up to rounding); the weight gradient sums in float32 over a group's tiles and rounds
  once. The default (`ModelConfig.moe_impl`): on the H200 it ran the small_h200 train step
  3.0-3.2x faster than ragged_dot with 4.7x less temporary memory (docs/benchmarks.md).
- "invariant" (the invariant plan's, not a `moe_impl` choice): the tiled layout with
  `kernels.invariant.batched_matmul` per tile, so each row's sums run in K order whatever
  the group sizes, tiles or M.
- "kernel": Pallas grouped GEMMs (`trace_jax.kernels.grouped_gemm`) for the forward, DGrad
  and WGrad that index the stacked weights in place (no per-tile weight copies, no segment
  sums); the Pallas interpreter off the GPU, so slow on CPU. Same sums up to float32 order.
- "mgpu" (Hopper GPUs only; Hopper's default where the widths allow): JAX's Mosaic GPU
  grouped GEMM (`jax.experimental.pallas.ops.gpu.ragged_dot_mgpu`: a persistent kernel of
  TMA-pipelined wgmma tiles) for the forward and DGrad of bf16/f16 rows (other rows take
  "kernel"), "kernel"'s WGrad (float32 sums rounded once to the weights' dtype). On the H100
  at Qwen3-30B-A3B width its forward and DGrad ran 1.8x faster than "kernel"'s (outputs equal
  to the tiled path's on the benchmark's rows) and the BF16 training step took 0.81-0.86x the
  time (docs/benchmarks.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from trace_jax.kernels import grouped_gemm, invariant
from trace_jax.model.config import MOE_IMPLS


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, impl: str
                   ) -> jax.Array:
  """Rows x [M, in] sorted by group, weights w [E, out, in] -> [M, out] in x.dtype."""
  if impl == "ragged_dot":
    return grouped_gemm.ragged_dot(x, w, group_sizes)
  if impl == "tiled":
    return _tiled(x, w, group_sizes, tile_rows(x.shape[0], w.shape[0]))
  if impl in ("kernel", "mgpu"):  # wgmma takes bf16/f16: other rows take "kernel"
    return _gemms(x, w, group_sizes, impl == "mgpu" and x.dtype in (jnp.bfloat16, jnp.float16))
  if impl == "invariant":
    return _invariant(x, w, group_sizes, tile_rows(x.shape[0], w.shape[0]))
  raise ValueError(f"grouped matmul impl must be one of {(*MOE_IMPLS, 'invariant')}, got "
                   f"{impl!r}")


def tile_rows(m: int, groups: int) -> int:
  """Rows per tile: the mean group size rounded up to a power of two, within [8, 128].

  Small M (decode) gets small tiles, so padding every group to a tile costs little.
  """
  mean = max(1, -(-m // groups))
  return min(128, max(8, 1 << (mean - 1).bit_length()))


_CHUNK_TILES = 64  # tiles per batched matmul: bounds the gathered weights and their gradient


def _layout(group_sizes: jax.Array, m: int, groups: int, tile: int
            ) -> tuple[jax.Array, jax.Array]:
  """(padded row of each input row [M], group of each tile [chunks, tiles per chunk]).

  The tile count, ceil(M / tile) + groups, is the most any group sizes can need, rounded up to
  whole chunks.
  """
  gs = group_sizes.astype(jnp.int32)
  padded = (gs + tile - 1) // tile * tile
  padded_end = jnp.cumsum(padded)
  row_group = jnp.repeat(jnp.arange(groups, dtype=jnp.int32), gs, total_repeat_length=m)
  first_row = jnp.cumsum(gs) - gs
  dest = (padded_end - padded)[row_group] + jnp.arange(m, dtype=jnp.int32) - first_row[row_group]
  tiles = -(-m // tile) + groups
  chunk = min(tiles, _CHUNK_TILES)
  tiles = -(-tiles // chunk) * chunk
  starts = jnp.arange(tiles, dtype=jnp.int32) * tile
  # Tiles past the last group hold only zeros; any valid group index will do for them.
  tile_group = jnp.minimum(jnp.searchsorted(padded_end, starts, side="right"), groups - 1)
  return dest, tile_group.astype(jnp.int32).reshape(-1, chunk)


def padded_sources(group_sizes: jax.Array, m: int, tile: int, rows: int) -> jax.Array:
  """The inverse of `_layout`'s dest as a gather map: for each of `rows` padded rows [rows]
  (each group's rows padded to whole tiles, groups in order; rows a multiple of tile), the
  input row it holds, or m for a padding row. `jnp.take(a, src, 0, mode="fill", fill_value=0)`
  lays rows [m, ...] out as the scatter `zeros.at[dest].set(a)` does (rows past sum(group_sizes)
  land nowhere), with no scatter of whole activations (as the dispatch's gathers,
  `inverse_permutation`)."""
  gs = group_sizes.astype(jnp.int32)
  groups = gs.shape[0]
  padded = (gs + tile - 1) // tile * tile
  padded_end = jnp.cumsum(padded)
  starts = jnp.arange(rows // tile, dtype=jnp.int32) * tile
  g = jnp.searchsorted(padded_end, starts, side="right")  # each tile's group (groups: none)
  gc = jnp.minimum(g, groups - 1)
  offset = jnp.arange(tile, dtype=jnp.int32) + (starts - (padded_end - padded)[gc])[:, None]
  held = (g < groups)[:, None] & (offset < gs[gc][:, None])
  return jnp.where(held, (jnp.cumsum(gs) - gs)[gc][:, None] + offset, m).reshape(rows)


def _to_chunks(a: jax.Array, dest: jax.Array, tile_group: jax.Array, tile: int) -> jax.Array:
  """Rows [M, ...] -> [chunks, tiles per chunk, tile, ...], zeros in the padding rows."""
  out = jnp.zeros((tile_group.size * tile,) + a.shape[1:], a.dtype)
  out = out.at[dest].set(a, unique_indices=True)
  return out.reshape(tile_group.shape + (tile,) + a.shape[1:])


def _from_chunks(y: jax.Array, dest: jax.Array) -> jax.Array:
  return y.reshape((-1,) + y.shape[3:])[dest]


def _per_chunk(fn, *xs):
  """fn over the leading (chunk) axis, one chunk at a time: its temporaries stay chunk-sized."""
  return jax.lax.map(lambda args: fn(*args), xs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _tiled(x: jax.Array, w: jax.Array, group_sizes: jax.Array, tile: int) -> jax.Array:
  return _tiled_fwd(x, w, group_sizes, tile)[0]


def _tiled_fwd(x, w, group_sizes, tile):
  dest, tg = _layout(group_sizes, x.shape[0], w.shape[0], tile)
  y = _per_chunk(lambda xc, g: jnp.einsum("tmk,tnk->tmn", xc, w[g],
                                          preferred_element_type=x.dtype),
                 _to_chunks(x, dest, tg, tile), tg)
  return _from_chunks(y, dest), (x, w, dest, tg)  # the layout is reused by the backward


def _tiled_bwd(tile, res, dy):
  x, w, dest, tg = res
  dy_c = _to_chunks(dy, dest, tg, tile)
  dx = _per_chunk(lambda dyc, g: jnp.einsum("tmn,tnk->tmk", dyc, w[g],
                                            preferred_element_type=x.dtype), dy_c, tg)

  def dw_step(acc, args):  # float32 sums over every tile of a group, one rounding at the end
    dyc, xc, g = args
    part = jnp.einsum("tmn,tmk->tnk", dyc, xc, preferred_element_type=jnp.float32)
    return acc + jax.ops.segment_sum(part, g, num_segments=w.shape[0]), None

  dw, _ = jax.lax.scan(dw_step, jnp.zeros(w.shape, jnp.float32),
                       (dy_c, _to_chunks(x, dest, tg, tile), tg))
  return _from_chunks(dx, dest), dw.astype(w.dtype), None


_tiled.defvjp(_tiled_fwd, _tiled_bwd)


def _invariant(x: jax.Array, w: jax.Array, group_sizes: jax.Array, tile: int) -> jax.Array:
  """The tiled layout, each tile's rows times its group's weights in `invariant` order."""
  dest, tg = _layout(group_sizes, x.shape[0], w.shape[0], tile)
  y = _per_chunk(lambda xc, g: invariant.batched_matmul(xc, w[g]),
                 _to_chunks(x, dest, tg, tile), tg)
  return _from_chunks(y, dest)


def _row_gemm(mgpu: bool):
  """The row products' kernel (forward and DGrad): JAX's Mosaic GPU one or ours."""
  return grouped_gemm.mgpu_matmul if mgpu else grouped_gemm.grouped_matmul


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gemms(x: jax.Array, w: jax.Array, group_sizes: jax.Array, mgpu: bool) -> jax.Array:
  """moe_impl "kernel" (mgpu False) or "mgpu": the row products by `_row_gemm`, the weight
  gradient by our WGrad kernel."""
  return _row_gemm(mgpu)(x, w.astype(x.dtype), group_sizes)


def _gemms_fwd(x, w, group_sizes, mgpu):
  return _gemms(x, w, group_sizes, mgpu), (x, w, group_sizes)


def _gemms_bwd(mgpu, res, dy):
  x, w, group_sizes = res
  dy = dy.astype(x.dtype)
  dx = _row_gemm(mgpu)(dy, w.astype(x.dtype), group_sizes, transpose_w=True)
  dw = grouped_gemm.grouped_wgrad(dy, x, group_sizes, out_dtype=w.dtype)
  return dx, dw, None


_gemms.defvjp(_gemms_fwd, _gemms_bwd)


def inverse_permutation(order: jax.Array) -> jax.Array:
  """inverse[order[i]] = i: rows put in `order` (sorted by expert) come back to their own order
  as `rows[inverse]`, a gather. The dispatch's way back: on the H200 a scatter by `order` into
  zeros took ~11 us per layer for 512 rows of 2048 bf16 at decode."""
  return jnp.zeros_like(order).at[order].set(
      jnp.arange(order.shape[0], dtype=order.dtype), unique_indices=True)


# ----------------------------------------------------------------------------- dispatch

@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def dispatch_rows(x: jax.Array, order: jax.Array, inverse: jax.Array, k: int) -> jax.Array:
  """The MoE dispatch: x [T, D], each token copied to its k (token, slot) rows, the rows
  taken in `order` (sorted by expert) -> [T * k, D], i.e. `x[order // k]`. The backward is a
  gather by `inverse` and a float32 sum over each token's k slots (rounded once), not the
  scatter-add of whole activations that autodiff makes of the gather."""
  return x[order // k]


def _dispatch_fwd(x, order, inverse, k):
  return x[order // k], inverse


def _dispatch_bwd(k, inverse, dy):
  rows = dy[inverse].astype(jnp.float32)  # back to (token, slot) order
  dx = jnp.sum(rows.reshape(-1, k, dy.shape[-1]), axis=1).astype(dy.dtype)
  return dx, None, None


dispatch_rows.defvjp(_dispatch_fwd, _dispatch_bwd)


@jax.custom_vjp
def permute_rows(y: jax.Array, perm: jax.Array, inverse: jax.Array) -> jax.Array:
  """y[perm] for a permutation `perm` of y's rows with `inverse` its inverse (the MoE combine:
  expert-sorted rows back to (token, slot) order). The backward is the gather dy[inverse],
  where autodiff would scatter-add into zeros."""
  return y[perm]


def _permute_fwd(y, perm, inverse):
  return y[perm], inverse


def _permute_bwd(inverse, dy):
  return dy[inverse], None, None


permute_rows.defvjp(_permute_fwd, _permute_bwd)
