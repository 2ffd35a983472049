"""Grouped GEMMs of MoE training (forward, DGrad, WGrad), each expert's weights read in place.

Contract (`trace_jax.model.grouped.grouped_matmul`'s, `moe_impl="kernel"`): rows x [M, K]
sorted by expert, `group_sizes` [E] (int, summing to at most M), weights w [E, N, K] (torch
[out, in] order, contraction axis last):
- `grouped_matmul(x, w, gs)` -> [M, N], y[m] = x[m] @ w[e(m)]^T;
- `grouped_matmul(dy, w, gs, transpose_w=True)` -> [M, K], dx[m] = dy[m] @ w[e(m)] (DGrad: the
  same weights read transposed, no transposed copy);
- `grouped_wgrad(dy, x, gs)` -> [E, N, K], dW[e] = sum over expert e's rows of dy[m]^T x[m].
Products are summed in float32 (the MMA's accumulator) and rounded once to the output dtype,
so results equal ragged_dot's up to float32 summation order. Rows past sum(group_sizes) come
out zero in the row outputs and are never added to a weight gradient.

Why a kernel: the tiled XLA path (`grouped._tiled`) pads every expert to whole tiles and
gathers each tile's expert weights into a batch (`w[g]`: every expert's weights copied ~9 times
per pass at the Qwen3-30B-A3B training shape) and sums the weight gradient per chunk with a
float32 segment sum; on the H200 those copies and scatters took ~55 ms of a 184 ms BF16 step
whose GEMMs took ~30 ms (a profile in the git history of docs/benchmarks.md). Here the programs
index
the stacked weights directly and the weight gradient is one float32 tile per program.

Kernels (`pl.pallas_call`, Triton lowering on the GPU, `interpret=True` elsewhere):
- matmul: grid (E, N // block_n, R). Program (e, j, r) takes expert e's row blocks r, r + R,
  ... (block_m rows each; an expert with no rows returns at once) and for each loops over K in
  block_k tiles: an x tile [block_m, block_k] (loads masked only at the end of x: a block that
  runs past its expert reads the next expert's rows, which are never stored) and the weight
  tile [block_n, block_k] (or [block_k, block_n] transposed) into one float32 accumulator,
  stored once under the row mask.
- wgrad: grid (E, N // block_n, K // block_k). Program (e, j, l) loops over expert e's rows in
  blocks of block_m, both operand tiles loaded under the expert's row mask (zeros elsewhere: a
  row of another expert must add nothing, and a masked operand on one side only would turn a
  neighbour's inf into NaN), dot over the rows into a float32 tile, stored once (zeros for an
  expert with no rows).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from trace_jax.kernels import common

_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


# ----------------------------------------------------------------------------- JAX's kernel

# JAX's own Mosaic GPU grouped GEMM's tiles (`ragged_dot_mgpu.ragged_dot`, its sweep's names):
# the best of `experiments.bench.grouped_gemm --sweep` at the Qwen3-30B-A3B training shapes on
# the H100 (gate_up forward 1.17 ms, 0.51 of the BF16 rate, against 1.78 ms with 4 stages and
# grid_block_n 1; docs/benchmarks.md). K of every product must be a multiple of block_k.
MGPU_TILES = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=5, grid_block_n=4)


def mgpu_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *,
                transpose_w: bool = False) -> jax.Array:
  """`grouped_matmul`'s contract (x [M, K], w [E, N, K], or [E, K, N] with transpose_w) by
  JAX's Mosaic GPU kernel (`jax.experimental.pallas.ops.gpu.ragged_dot_mgpu`: a persistent
  kernel of TMA-pipelined wgmma tiles; Hopper, bf16/f16, K a multiple of
  `MGPU_TILES["block_k"]`), out in x.dtype. The kernel leaves rows past sum(group_sizes)
  unwritten; a select sets them to zero here, as the contract says (expert parallelism's local
  group sizes sum to fewer than M)."""
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu  # Hopper only: loaded on use

  y = ragged_dot_mgpu.ragged_dot(x, w, group_sizes=group_sizes, transpose_rhs=not transpose_w,
                                 **MGPU_TILES)
  live = jnp.arange(x.shape[0])[:, None] < jnp.sum(group_sizes)
  return jnp.where(live, y, jnp.zeros((), y.dtype))


# ----------------------------------------------------------------------------- references

# lhs [M, in] (ragged over M) x rhs [E, out, in] (group axis 0, contraction axis 2) -> [M, out].
_RAGGED_DN = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0])


def ragged_dot(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
  """Rows x [M, in] sorted by group times w [E, out, in] -> [M, out] in x.dtype, as XLA's
  `ragged_dot_general` computes it (the model's moe_impl="ragged_dot", and the decode
  kernels' reference)."""
  return jax.lax.ragged_dot_general(x, w, group_sizes, _RAGGED_DN,
                                    preferred_element_type=x.dtype)


def reference(x: jax.Array, w: jax.Array, group_sizes: jax.Array,
              transpose_w: bool = False) -> jax.Array:
  """`grouped_matmul`'s contract in plain JAX (ragged_dot, float32 sums, HIGHEST)."""
  dims = (([1], [1 if transpose_w else 2]), ([], []))
  dn = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=dims, lhs_ragged_dimensions=[0],
                                         rhs_group_dimensions=[0])
  return jax.lax.ragged_dot_general(x, w, group_sizes.astype(jnp.int32), dn,
                                    precision=jax.lax.Precision.HIGHEST,
                                    preferred_element_type=jnp.float32).astype(x.dtype)


def wgrad_reference(dy: jax.Array, x: jax.Array, group_sizes: jax.Array) -> jax.Array:
  """`grouped_wgrad`'s contract in plain JAX: per expert, a masked float32 product (HIGHEST);
  [E, M, ...] temporaries, for tests."""
  m = dy.shape[0]
  gs = group_sizes.astype(jnp.int32)
  ends = jnp.cumsum(gs)
  row = jnp.arange(m, dtype=jnp.int32)
  mine = ((row[None] >= (ends - gs)[:, None]) & (row[None] < ends[:, None]))   # [E, M]
  d = jnp.where(mine[:, :, None], dy.astype(jnp.float32)[None], 0.0)
  xm = jnp.where(mine[:, :, None], x.astype(jnp.float32)[None], 0.0)
  return jnp.einsum("emn,emk->enk", d, xm, precision=jax.lax.Precision.HIGHEST
                    ).astype(dy.dtype)


# ----------------------------------------------------------------------------- matmul

def _mm_kernel(offs_ref, sizes_ref, x_ref, w_ref, o_ref, *, transpose_w: bool, m: int, k: int,
               num_experts: int, bm: int, bn: int, bk: int, reps: int, precision: Any):
  e = pl.program_id(0)
  n0 = pl.multiple_of(pl.program_id(1) * bn, bn)
  r = pl.program_id(2)
  start = offs_ref[e]
  size = sizes_ref[e]
  end = jnp.minimum(start + size, m)
  rows = jnp.arange(bm, dtype=jnp.int32)[:, None]                           # [bm, 1]
  dims = (((1,), (0,)), ((), ())) if transpose_w else (((1,), (1,)), ((), ()))

  def row_block(i, carry):
    row0 = start + (r + i * reps) * bm
    in_x = jnp.broadcast_to((row0 + rows) < m, (bm, bk))

    def k_step(t, acc):
      k0 = pl.multiple_of(t * bk, bk)
      xt = common.masked_load(x_ref, (pl.ds(row0, bm), pl.ds(k0, bk)), in_x, 0)
      if transpose_w:
        wt = w_ref[e, pl.ds(k0, bk), pl.ds(n0, bn)]                         # [bk, bn]
      else:
        wt = w_ref[e, pl.ds(n0, bn), pl.ds(k0, bk)]                         # [bn, bk]
      return acc + jax.lax.dot_general(xt, wt, dims, precision=precision,
                                       preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, k // bk, k_step, jnp.zeros((bm, bn), jnp.float32))
    valid = jnp.broadcast_to((row0 + rows) < end, (bm, bn))
    common.masked_store(o_ref, (pl.ds(row0, bm), pl.ds(n0, bn)), acc.astype(o_ref.dtype),
                          valid)
    return carry

  blocks = jax.lax.div(size + (bm - 1), bm)
  mine = jnp.maximum(jax.lax.div(blocks - r + (reps - 1), reps), 0)         # blocks r, r+R, ...
  jax.lax.fori_loop(0, mine, row_block, 0)

  total = offs_ref[num_experts - 1] + sizes_ref[num_experts - 1]

  # rows no group holds: zeros, as ragged_dot gives
  pl.when((e == num_experts - 1) & (r == 0) & (total < m))(
      lambda: common.zero_rows_past(o_ref, total, m, bm, n0, bn))


_MM_STATIC = ("transpose_w", "interpret", "block_m", "block_n", "block_k", "reps", "num_warps",
              "num_stages")


@functools.partial(jax.jit, static_argnames=_MM_STATIC)
def _mm_call(x, w, group_sizes, *, transpose_w, interpret, block_m, block_n, block_k, reps,
             num_warps, num_stages):
  m, k = x.shape
  e = w.shape[0]
  n = w.shape[2] if transpose_w else w.shape[1]
  if m == 0:
    return jnp.zeros((0, n), x.dtype)
  gs = group_sizes.astype(jnp.int32)
  kernel = functools.partial(_mm_kernel, transpose_w=transpose_w, m=m, k=k, num_experts=e,
                             bm=block_m, bn=block_n, bk=block_k, reps=reps,
                             precision=common.dot_precision(x.dtype))
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((m, n), x.dtype), grid=(e, n // block_n, reps),
      interpret=interpret, name="grouped_dgrad" if transpose_w else "grouped_fprop",
      compiler_params=None if interpret else common.compiler_params(num_warps, num_stages),
  )(jnp.cumsum(gs) - gs, gs, x, w.astype(x.dtype))


def _check_operands(name: str, a: jax.Array, e: int, group_sizes: jax.Array) -> None:
  if a.ndim != 2:
    raise ValueError(f"{name}: rows must be [M, C], got {a.shape}")
  if a.dtype not in _DTYPES:
    raise TypeError(f"{name}: dtype must be bf16, f16 or f32, got {a.dtype}")
  if group_sizes.shape != (e,):
    raise ValueError(f"{name}: group_sizes must be [{e}], got {group_sizes.shape}")
  if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise TypeError(f"{name}: group_sizes must be integers, got {group_sizes.dtype}")


def _tile(name: str, dim: int, cap: int, value: int | None) -> int:
  """A power-of-two tile >= 16 dividing dim: `value` checked, or the largest <= cap."""
  if dim % 16:
    raise ValueError(f"{name}: dimension {dim} must be a multiple of 16")
  t = common.pow2_divisor(dim, cap) if value is None else value
  common.check_block(name, t, 16)
  if dim % t:
    raise ValueError(f"{name}={t} must divide {dim}")
  return t


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *,
                   transpose_w: bool = False, interpret: bool | None = None,
                   block_m: int | None = None, block_n: int | None = None,
                   block_k: int | None = None, reps: int | None = None,
                   num_warps: int | None = None, num_stages: int = 3) -> jax.Array:
  """Rows x [M, K] sorted by expert times w [E, N, K] -> [M, N] (transpose_w: w [E, K, N],
  contracted over its axis 1: the DGrad of the forward's weights, read in place).

  interpret: None runs the Triton kernel on the GPU and the Pallas interpreter elsewhere.
  block_m / block_n / block_k: tile rows / output columns / contraction (powers of two >= 16;
    None: 128 / up to 256 / up to 64: the best of the H200 sweep for the forward and the DGrad
    at the Qwen3-30B-A3B training shapes, docs/benchmarks.md).
  reps: programs per (expert, N tile), each taking every reps-th row block of its expert;
    None: enough for the mean expert's rows in about 2 blocks per program.
  num_warps: None: 8 for tiles of >= 128 x 128, else 4.
  """
  e = w.shape[0]
  if w.ndim != 3:
    raise ValueError(f"grouped_matmul: w must be [E, N, K], got {w.shape}")
  _check_operands("grouped_matmul", x, e, group_sizes)
  k_w, n = (w.shape[1], w.shape[2]) if transpose_w else (w.shape[2], w.shape[1])
  if x.shape[1] != k_w:
    raise ValueError(f"grouped_matmul: x {x.shape} and w {w.shape} disagree on K "
                     f"(transpose_w={transpose_w})")
  m, k = x.shape
  block_m = 128 if block_m is None else block_m
  common.check_block("block_m", block_m, 16)
  block_n = _tile("block_n", n, 256, block_n)
  block_k = _tile("block_k", k, 64, block_k)
  if reps is None:
    reps = max(1, -(-m // (e * block_m * 2)))
  if num_warps is None:
    num_warps = 8 if block_m * block_n >= 128 * 128 else 4
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  return _mm_call(x, w, group_sizes, transpose_w=bool(transpose_w), interpret=bool(interpret),
                  block_m=block_m, block_n=block_n, block_k=block_k, reps=int(reps),
                  num_warps=num_warps, num_stages=num_stages)


# ----------------------------------------------------------------------------- wgrad

def _wgrad_kernel(offs_ref, sizes_ref, d_ref, x_ref, o_ref, *, m: int, bm: int, bn: int,
                  bk: int, precision: Any):
  e = pl.program_id(0)
  n0 = pl.multiple_of(pl.program_id(1) * bn, bn)
  k0 = pl.multiple_of(pl.program_id(2) * bk, bk)
  start = offs_ref[e]
  end = jnp.minimum(start + sizes_ref[e], m)
  rows = jnp.arange(bm, dtype=jnp.int32)[:, None]

  def row_block(i, acc):
    row0 = start + i * bm
    mine = (row0 + rows) < end                                              # [bm, 1]
    d = common.masked_load(d_ref, (pl.ds(row0, bm), pl.ds(n0, bn)),
                             jnp.broadcast_to(mine, (bm, bn)), 0)
    xt = common.masked_load(x_ref, (pl.ds(row0, bm), pl.ds(k0, bk)),
                              jnp.broadcast_to(mine, (bm, bk)), 0)
    return acc + jax.lax.dot_general(d, xt, (((0,), (0,)), ((), ())), precision=precision,
                                     preferred_element_type=jnp.float32)   # [bn, bk]

  blocks = jax.lax.div(jnp.maximum(end - start, 0) + (bm - 1), bm)
  acc = jax.lax.fori_loop(0, blocks, row_block, jnp.zeros((bn, bk), jnp.float32))
  o_ref[e, pl.ds(n0, bn), pl.ds(k0, bk)] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "block_m", "block_n",
                                             "block_k", "num_warps", "num_stages"))
def _wgrad_call(dy, x, group_sizes, *, out_dtype, interpret, block_m, block_n, block_k,
                num_warps, num_stages):
  (m, n), k, e = dy.shape, x.shape[1], group_sizes.shape[0]
  if m == 0:
    return jnp.zeros((e, n, k), out_dtype)
  gs = group_sizes.astype(jnp.int32)
  kernel = functools.partial(_wgrad_kernel, m=m, bm=block_m, bn=block_n, bk=block_k,
                             precision=common.dot_precision(dy.dtype))
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((e, n, k), out_dtype),
      grid=(e, n // block_n, k // block_k), interpret=interpret, name="grouped_wgrad",
      compiler_params=None if interpret else common.compiler_params(num_warps, num_stages),
  )(jnp.cumsum(gs) - gs, gs, dy, x.astype(dy.dtype))


def grouped_wgrad(dy: jax.Array, x: jax.Array, group_sizes: jax.Array, *,
                  out_dtype: Any = None, interpret: bool | None = None,
                  block_m: int | None = None, block_n: int | None = None,
                  block_k: int | None = None, num_warps: int | None = None,
                  num_stages: int = 3) -> jax.Array:
  """The experts' weight gradient: dy [M, N] and x [M, K], rows sorted by expert ->
  dW [E, N, K], dW[e] = sum of dy[m]^T x[m] over expert e's rows, in float32, rounded once to
  out_dtype (None: dy's dtype).

  block_m: rows per step (None: 64); block_n / block_k: output tile (None: up to 256 / up to
  128, the best of the H200 sweep at the training shapes).
  """
  if group_sizes.ndim != 1:
    raise ValueError(f"grouped_wgrad: group_sizes must be [E], got {group_sizes.shape}")
  _check_operands("grouped_wgrad", dy, group_sizes.shape[0], group_sizes)
  if x.ndim != 2 or x.shape[0] != dy.shape[0]:
    raise ValueError(f"grouped_wgrad: x must be [M, K] with dy's M rows; dy {dy.shape}, "
                     f"x {x.shape}")
  n, k = dy.shape[1], x.shape[1]
  block_m = 64 if block_m is None else block_m
  common.check_block("block_m", block_m, 16)
  block_n = _tile("block_n", n, 256, block_n)
  block_k = _tile("block_k", k, 128, block_k)
  if num_warps is None:
    num_warps = 8 if block_n * block_k >= 128 * 128 else 4
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  return _wgrad_call(dy, x, group_sizes, out_dtype=jnp.dtype(out_dtype or dy.dtype),
                     interpret=bool(interpret), block_m=block_m, block_n=block_n,
                     block_k=block_k, num_warps=num_warps, num_stages=num_stages)
