"""Block-scaled FP8 (E4M3) GEMMs on FP8 tensor cores, dense and grouped by expert (Jet-RL).

Contract: a [M, K] and b [N, K] (or stacked [E, N, K] with rows of a sorted by expert and
`group_sizes` [E]) as `formats.FP8Tensor`s, contraction axis last:

  out[m, n] = sum_kb (sum_{k in kb} a[m, k] * b[n, k]) * a.scale[m, kb] * b.scale[n', kb]

with kb the 128-wide K groups and n' = n // 128 for 128x128 weight blocks (`block_rows=128`)
or n for 1x128 groups (`block_rows=1`: activations as the right operand, the WGrad GEMM).
Products of the E4M3 values are summed in float32 within each K group (on the GPU by the
tensor cores' FP8 MMA), scaled, summed over groups in float32 and rounded once to the output
dtype. The values the GEMM consumes are the codes and scales `formats.fp8_quantize_act` /
`fp8_quantize_weight` make, unchanged, so `reference` (dequantize with `formats.fp8_dequantize`,
float32 matmul) is the same sum up to float32 accumulation order. Rows past sum(group_sizes)
come out zero, as with ragged_dot.

Kernel (`pl.pallas_call`, Triton lowering on GPU, `interpret=True` elsewhere): grid
(E, N // block_n, R). Program (e, j, r) takes expert e's row blocks r, r + R, ... (block_m
rows each; an expert with no rows returns at once) and for
each loops over K in groups of 128: load a [block_m, 128] tile of a and a [block_n, 128] tile
of b as float8_e4m3fn (a's rows padded by block_m, so the loads need no masks and feed the MMA
directly; only the stores are masked to the expert's rows), one FP8 dot into a fresh
float32 tile, scale it by the two scale vectors and add it to the accumulator (the per-group
promotion DeepSeek-V3 uses, since Hopper's FP8 MMA keeps few accumulator bits). Dense GEMMs
are the E = 1 case with R = M // block_m. `swap_ab` computes each tile transposed (b as the
MMA's M side), for decode where a has few rows.

The experts' WGrad (`grouped_wgrad`, reference `wgrad_reference`): dW[e] = sum over expert e's
rows r of dy[r]^T x[r] -> [E, N, K], with dy [M, N] and x [M, K] quantized in 128x1 groups
along the rows *within each expert*: each expert's rows padded with zero rows to whole 128-row
tiles (the padded layout of `model.grouped._layout(group_sizes, M, E, tile=128)`), transposed
to dyt [N, P] and xt [K, P] and quantized in 1x128 groups along P, so every tile has its own
scale per column and belongs to one expert. Grid (E, N // block_n, K // block_k): program
(e, j, l) loops over expert e's tiles, one FP8 dot of a [block_n, 128] tile of dyt and a
[block_k, 128] tile of xt into a fresh float32 tile per 128-row tile, scaled by the two
per-column scale vectors ([block_n, 1] x [1, block_k]) and accumulated in float32, then stored
once (zeros for an expert with no rows). P is whole tiles, so no load or store needs a mask.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from trace_jax.kernels import common, fp8_tiles
from trace_jax.quant import formats

GROUP = formats.FP8_GROUP  # 128: the K group of every scale (and the weight block's N side)


def _check(name: str, q: formats.FP8Tensor, ndim: int, block_rows: tuple[int, ...]) -> None:
  v, s = q.values, q.scale
  if v.dtype != jnp.float8_e4m3fn or v.ndim != ndim:
    raise TypeError(f"{name}: values must be float8_e4m3fn with {ndim} axes, got {v.dtype} "
                    f"{v.shape}")
  if q.block_rows not in block_rows:
    raise ValueError(f"{name}: block_rows must be one of {block_rows}, got {q.block_rows}")
  *lead, n, k = v.shape
  if k % GROUP or (q.block_rows == GROUP and n % GROUP):
    raise ValueError(f"{name}: shape {v.shape} is not in whole {q.block_rows}x{GROUP} blocks")
  want = tuple(lead) + ((n // GROUP,) if q.block_rows == GROUP else (n,)) + (k // GROUP,)
  if s.shape != want or s.dtype != jnp.float32:
    raise ValueError(f"{name}: scale must be float32 {want}, got {s.dtype} {s.shape}")


def transpose_weight(q: formats.FP8Tensor, kernel: bool = False) -> formats.FP8Tensor:
  """The 128x128-block quantization of w^T from that of w [..., N, K] (the same blocks): the
  codes transposed by XLA or (kernel) by `fp8_tiles.transpose_codes`, the same bytes."""
  if q.block_rows != GROUP:
    raise ValueError("transpose_weight needs 128x128 blocks (block_rows=128)")
  values = (fp8_tiles.transpose_codes(q.values) if kernel
            else jnp.swapaxes(q.values, -1, -2))
  return formats.FP8Tensor(values=values, scale=jnp.swapaxes(q.scale, -1, -2),
                           block_rows=GROUP)


# ----------------------------------------------------------------------------- reference

def reference(a: formats.FP8Tensor, b: formats.FP8Tensor, group_sizes: jax.Array | None = None,
              out_dtype: Any = jnp.bfloat16) -> jax.Array:
  """The contract in plain JAX: dequantized float32 operands, float32 matmul (HIGHEST)."""
  av, bv = formats.fp8_dequantize(a), formats.fp8_dequantize(b)
  hi = jax.lax.Precision.HIGHEST
  if group_sizes is None:
    return jnp.einsum("mk,nk->mn", av, bv, precision=hi).astype(out_dtype)
  dn = jax.lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0],
      rhs_group_dimensions=[0])
  return jax.lax.ragged_dot_general(av, bv, group_sizes.astype(jnp.int32), dn, precision=hi,
                                    preferred_element_type=jnp.float32).astype(out_dtype)


# ----------------------------------------------------------------------------- kernel

def _kernel(offs_ref, sizes_ref, layer_ref, a_ref, sa_ref, b_ref, sb_ref, o_ref, *, m: int,
            k: int, num_experts: int, bm: int, bn: int, b_block: bool, swap_ab: bool, reps: int,
            group_k: int, interpret: bool):
  # b carries a leading layer axis; layer_ref [1] names the layer read, in place.
  e = pl.program_id(0)
  lyr = layer_ref[0]
  n0 = pl.multiple_of(pl.program_id(1) * bn, bn)
  r = pl.program_id(2)
  start = offs_ref[e]
  size = sizes_ref[e]
  end = jnp.minimum(start + size, m)
  blocks = jax.lax.div(size + (bm - 1), bm)
  rows = jnp.arange(bm, dtype=jnp.int32)[:, None]
  # The interpreter (XLA on CPU) multiplies the same exact E4M3 values in float32.
  cast = (lambda v: v.astype(jnp.float32)) if interpret else (lambda v: v)

  def row_block(i, carry):
    row0 = start + (r + i * reps) * bm
    valid = (row0 + rows) < end                                             # [bm, 1]

    def k_step(t, acc):
      # Unmasked loads straight into the dot (a's rows are padded by block_m; rows of other
      # experts are read but never stored), so Triton pipelines them as plain tiles. With
      # group_k > 1 several groups' dots are issued before their partials are scaled.
      parts = []
      for j in range(group_k):
        g = t * group_k + j
        k0 = pl.multiple_of(g * GROUP, GROUP)
        a = cast(a_ref[pl.ds(row0, bm), pl.ds(k0, GROUP)])
        sa = sa_ref[pl.ds(row0, bm), pl.ds(g, 1)]                          # [bm, 1]
        b = cast(b_ref[lyr, e, pl.ds(n0, bn), pl.ds(k0, GROUP)])
        if b_block:  # one 128x128 block row covers the tile (bn <= 128)
          sb = sb_ref[lyr, e, pl.ds(jax.lax.div(n0, GROUP), 1), pl.ds(g, 1)]  # [1, 1]
        else:
          sb = sb_ref[lyr, e, pl.ds(n0, bn), pl.ds(g, 1)]                  # [bn, 1]
        if swap_ab:
          part = jax.lax.dot_general(b, a, (((1,), (1,)), ((), ())),
                                     preferred_element_type=jnp.float32)  # [bn, bm]
          parts.append((part, sb, sa.reshape(1, bm)))
        else:
          part = jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                                     preferred_element_type=jnp.float32)  # [bm, bn]
          parts.append((part, sa, sb.reshape(1, -1)))
      for part, s0, s1 in parts:
        acc = acc + part * s0 * s1
      return acc

    acc = jax.lax.fori_loop(0, k // (GROUP * group_k), k_step,
                            jnp.zeros((bn, bm) if swap_ab else (bm, bn), jnp.float32))
    acc = acc.T if swap_ab else acc
    common.masked_store(o_ref, (pl.ds(row0, bm), pl.ds(n0, bn)), acc.astype(o_ref.dtype),
                          jnp.broadcast_to(valid, (bm, bn)))
    return carry

  mine = jnp.maximum(jax.lax.div(blocks - r + (reps - 1), reps), 0)  # blocks r, r + R, ...
  jax.lax.fori_loop(0, mine, row_block, 0)

  total = offs_ref[num_experts - 1] + sizes_ref[num_experts - 1]

  # rows no group holds: zeros, as ragged_dot gives
  pl.when((e == num_experts - 1) & (r == 0) & (total < m))(
      lambda: common.zero_rows_past(o_ref, total, m, bm, n0, bn))


_STATIC = ("b_block", "out_dtype", "interpret", "block_m", "block_n", "reps", "swap_ab",
           "group_k", "num_warps", "num_stages")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _call(a_values, a_scale, b_values, b_scale, group_sizes, layer, *, b_block, out_dtype,
          interpret, block_m, block_n, reps, swap_ab, group_k, num_warps, num_stages):
  m, k = a_values.shape
  if layer is None:  # one layer: a leading axis of 1 (a free reshape)
    b_values, b_scale, layer = b_values[None], b_scale[None], jnp.zeros((), jnp.int32)
  e, n, _ = b_values.shape[1:]
  if m == 0:
    return jnp.zeros((0, n), out_dtype)
  gs = group_sizes.astype(jnp.int32)
  offs = jnp.cumsum(gs) - gs
  # A grouped row block that starts in the last rows reads up to block_m - 1 rows past M: pad
  # block_m zero rows. Dense GEMMs (one group from row 0) with M in whole blocks read none, so
  # they skip the copy.
  if e > 1 or m % block_m:
    pad = ((0, -m % block_m + block_m), (0, 0))
    a_values, a_scale = jnp.pad(a_values, pad), jnp.pad(a_scale, pad)
  kernel = functools.partial(_kernel, m=m, k=k, num_experts=e, bm=block_m, bn=block_n,
                             b_block=b_block, swap_ab=swap_ab, reps=reps, group_k=group_k,
                             interpret=interpret)
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((m, n), out_dtype), grid=(e, n // block_n, reps),
      interpret=interpret, name="fp8_grouped_gemm" if e > 1 else "fp8_gemm",
      compiler_params=None if interpret else common.compiler_params(num_warps, num_stages),
  )(offs, gs, jnp.reshape(layer, (1,)).astype(jnp.int32), a_values, a_scale, b_values, b_scale)


def grouped_matmul(a: formats.FP8Tensor, b: formats.FP8Tensor, group_sizes: jax.Array, *,
                   out_dtype: Any = jnp.bfloat16, interpret: bool | None = None,
                   block_m: int | None = None, block_n: int | None = None,
                   reps: int | None = None, swap_ab: bool | None = None,
                   group_k: int | None = None, num_warps: int | None = None,
                   num_stages: int = 4, layer: jax.Array | None = None) -> jax.Array:
  """FP8 rows a [M, K] (1x128 groups, sorted by expert) times b [E, N, K] -> [M, N].

  layer: with it, b is a stack of layers [L, E, N, K] and the kernel reads layer `layer`
  (int32 scalar, may be traced) in place (slicing it out first would copy it per call).
  b: 128x128 blocks (weights) or 1x128 groups. group_sizes [E] sums to at most M.
  interpret: None runs the Triton kernel on GPU and the Pallas interpreter elsewhere.
  block_m / block_n: tile rows / columns (powers of two; block_n <= 128 with 128x128 blocks;
    None: 64, on the GPU halved down to 16 while the grid has < `common.MIN_PROGRAMS`).
  reps: programs per (expert, N tile); None: enough for M / E rows per expert in 2 blocks.
  swap_ab: tiles computed transposed (b the MMA's M side); None: when block_m < 64.
  group_k: 128-wide K groups per loop step (their dots issued before any is scaled); None: 1
    (2 and 4 ran no faster on the H200; the git history of docs/benchmarks.md).
  """
  _check("grouped_matmul a", a, 2, (1,))
  _check("grouped_matmul b", b, 3 + (layer is not None), (1, GROUP))
  m, k = a.values.shape
  e, n, kb = b.values.shape[-3:]
  if kb != k:
    raise ValueError(f"grouped_matmul: a {a.values.shape} and b {b.values.shape} disagree on K")
  if group_sizes.shape != (e,):
    raise ValueError(f"grouped_matmul: group_sizes must be [{e}], got {group_sizes.shape}")
  if block_m is None:
    block_m = min(128, max(16, common.next_pow2(-(-m // e))))
  common.check_block("block_m", block_m, 16)
  if block_m > 256:
    raise ValueError(f"grouped_matmul: block_m={block_m} > 256")
  if reps is None:
    reps = max(1, -(-m // (e * block_m * 2)))
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  if block_n is None:  # 64 (with block_m 128, 4 warps): the H200 sweep's best at M 8192;
    # on the GPU smaller where the grid (E x reps x N / block_n) is too small (decode)
    block_n = (common.pow2_divisor(n, 64) if interpret
               else common.default_block_n(n, e * reps))
  common.check_block("block_m", block_m, 16)
  common.check_block("block_n", block_n, 16)
  if n % block_n or (b.block_rows == GROUP and block_n > GROUP):
    raise ValueError(f"grouped_matmul: block_n={block_n} must divide N={n} (and be <= 128 "
                     "with 128x128 blocks)")
  if group_k is None:
    group_k = 1
  if group_k not in (1, 2, 4) or (k // GROUP) % group_k:
    raise ValueError(f"grouped_matmul: group_k={group_k} must be 1, 2 or 4 and divide "
                     f"K / 128 = {k // GROUP}")
  if swap_ab is None:
    swap_ab = block_m < 64
  if num_warps is None:
    num_warps = 8 if block_m * block_n > 128 * 64 else 4
  return _call(a.values, a.scale, b.values, b.scale, group_sizes, layer,
               b_block=b.block_rows == GROUP,
               out_dtype=jnp.dtype(out_dtype), interpret=bool(interpret), block_m=block_m,
               block_n=block_n, reps=int(reps), swap_ab=bool(swap_ab), group_k=group_k,
               num_warps=num_warps, num_stages=num_stages)


def matmul(a: formats.FP8Tensor, b: formats.FP8Tensor, *, out_dtype: Any = jnp.bfloat16,
           block_m: int | None = None, layer: jax.Array | None = None, **kw) -> jax.Array:
  """FP8 a [M, K] (1x128 groups) times b [N, K] (128x128 blocks or 1x128 groups) -> [M, N];
  with `layer`, b is a stack [L, N, K] read at that layer in place (`grouped_matmul`)."""
  _check("matmul a", a, 2, (1,))
  _check("matmul b", b, 2 + (layer is not None), (1, GROUP))
  m = a.values.shape[0]
  if block_m is None:
    block_m = min(128, max(16, common.next_pow2(m)))
  axis = 0 if layer is None else 1  # one "expert"
  stacked = formats.FP8Tensor(values=jnp.expand_dims(b.values, axis),
                              scale=jnp.expand_dims(b.scale, axis), block_rows=b.block_rows)
  return grouped_matmul(a, stacked, jnp.full((1,), m, jnp.int32), out_dtype=out_dtype,
                        block_m=block_m, reps=kw.pop("reps", max(1, -(-m // block_m))),
                        layer=layer, **kw)


# ----------------------------------------------------------------------------- WGrad (experts)

def _check_wgrad(name: str, dyt: formats.FP8Tensor, xt: formats.FP8Tensor,
                 group_sizes: jax.Array) -> None:
  _check(f"{name} dyt", dyt, 2, (1,))
  _check(f"{name} xt", xt, 2, (1,))
  if dyt.values.shape[1] != xt.values.shape[1]:
    raise ValueError(f"{name}: dyt {dyt.values.shape} and xt {xt.values.shape} disagree on the "
                     "padded rows P")
  if group_sizes.ndim != 1 or group_sizes.shape[0] < 1:
    raise ValueError(f"{name}: group_sizes must be [E] with E >= 1, got {group_sizes.shape}")


def _expert_tiles(group_sizes: jax.Array, tiles: int) -> tuple[jax.Array, jax.Array]:
  """(first tile [E], tile count [E]) of each expert in the padded layout (every expert's rows
  padded to whole 128-row tiles, experts in order), clipped to the `tiles` there are."""
  gs = jnp.maximum(group_sizes.astype(jnp.int32), 0)
  count = (gs + GROUP - 1) // GROUP
  first = jnp.minimum(jnp.cumsum(count) - count, tiles)
  return first, jnp.minimum(count, tiles - first)


def wgrad_reference(dyt: formats.FP8Tensor, xt: formats.FP8Tensor, group_sizes: jax.Array,
                    out_dtype: Any = jnp.bfloat16) -> jax.Array:
  """The WGrad contract in plain JAX: dequantized float32 tiles, one float32 product per 128-row
  tile (HIGHEST) added to its expert's sum -> [E, N, K] (a scan over tiles: [E, N, K] memory).
  """
  _check_wgrad("wgrad_reference", dyt, xt, group_sizes)
  dv, xv = formats.fp8_dequantize(dyt), formats.fp8_dequantize(xt)
  (n, p), k, e = dv.shape, xv.shape[0], group_sizes.shape[0]
  tiles = p // GROUP
  first, count = _expert_tiles(group_sizes, tiles)
  # The expert of each tile; e for tiles no expert holds (their sums are dropped).
  owner = jnp.searchsorted(first + count, jnp.arange(tiles, dtype=jnp.int32), side="right")

  def tile(acc, args):
    d, x, g = args
    part = jnp.einsum("nr,kr->nk", d, x, precision=jax.lax.Precision.HIGHEST)
    return acc.at[g].add(part, mode="drop"), None

  by_tile = lambda v: jnp.moveaxis(v.reshape(v.shape[0], tiles, GROUP), 1, 0)
  acc, _ = jax.lax.scan(tile, jnp.zeros((e, n, k), jnp.float32),
                        (by_tile(dv), by_tile(xv), owner.astype(jnp.int32)))
  return acc.astype(out_dtype)


def _wgrad_kernel(first_ref, count_ref, d_ref, sd_ref, x_ref, sx_ref, o_ref, *, bn: int, bk: int,
                  interpret: bool):
  e = pl.program_id(0)
  n0 = pl.multiple_of(pl.program_id(1) * bn, bn)
  k0 = pl.multiple_of(pl.program_id(2) * bk, bk)
  first = first_ref[e]
  cast = (lambda v: v.astype(jnp.float32)) if interpret else (lambda v: v)

  def tile(i, acc):
    # Unmasked FP8 loads straight into the dot: P is whole tiles, N and K whole blocks.
    t = first + i
    p0 = pl.multiple_of(t * GROUP, GROUP)
    d = cast(d_ref[pl.ds(n0, bn), pl.ds(p0, GROUP)])                       # [bn, 128]
    sd = sd_ref[pl.ds(n0, bn), pl.ds(t, 1)]                                # [bn, 1]
    x = cast(x_ref[pl.ds(k0, bk), pl.ds(p0, GROUP)])                       # [bk, 128]
    sx = sx_ref[pl.ds(k0, bk), pl.ds(t, 1)]                                # [bk, 1]
    part = jax.lax.dot_general(d, x, (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)        # [bn, bk]
    return acc + part * sd * sx.reshape(1, bk)

  acc = jax.lax.fori_loop(0, count_ref[e], tile, jnp.zeros((bn, bk), jnp.float32))
  o_ref[e, pl.ds(n0, bn), pl.ds(k0, bk)] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "block_n", "block_k",
                                             "num_warps", "num_stages"))
def _wgrad_call(d_values, d_scale, x_values, x_scale, group_sizes, *, out_dtype, interpret,
                block_n, block_k, num_warps, num_stages):
  (n, p), k, e = d_values.shape, x_values.shape[0], group_sizes.shape[0]
  if p == 0:
    return jnp.zeros((e, n, k), out_dtype)
  first, count = _expert_tiles(group_sizes, p // GROUP)
  kernel = functools.partial(_wgrad_kernel, bn=block_n, bk=block_k, interpret=interpret)
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((e, n, k), out_dtype),
      grid=(e, n // block_n, k // block_k), interpret=interpret, name="fp8_grouped_wgrad",
      compiler_params=None if interpret else common.compiler_params(num_warps, num_stages),
  )(first, count, d_values, d_scale, x_values, x_scale)


def grouped_wgrad(dyt: formats.FP8Tensor, xt: formats.FP8Tensor, group_sizes: jax.Array, *,
                  out_dtype: Any = jnp.bfloat16, interpret: bool | None = None,
                  block_n: int | None = None, block_k: int | None = None,
                  num_warps: int | None = None, num_stages: int = 4) -> jax.Array:
  """The experts' WGrad: dyt [N, P] and xt [K, P] (1x128 groups along P) -> dW [E, N, K].

  P: the rows in the padded layout (each expert's rows padded with zero rows to whole 128-row
  tiles, experts in order, as `model.grouped._layout(group_sizes, M, E, tile=128)` places
  them); dW[e] sums expert e's tiles only, tiles past the experts' are not read.
  interpret: None runs the Triton kernel on GPU and the Pallas interpreter elsewhere.
  block_n / block_k: output tile (powers of two >= 16 dividing N / K); None: up to 128 / 64.
  """
  _check_wgrad("grouped_wgrad", dyt, xt, group_sizes)
  n, k = dyt.values.shape[0], xt.values.shape[0]
  block_n = common.pow2_divisor(n, 128) if block_n is None else block_n
  block_k = common.pow2_divisor(k, 64) if block_k is None else block_k
  common.check_block("block_n", block_n, 16)
  common.check_block("block_k", block_k, 16)
  if n % block_n or k % block_k:
    raise ValueError(f"grouped_wgrad: block_n={block_n} and block_k={block_k} must divide "
                     f"N={n} and K={k}")
  if num_warps is None:
    num_warps = 8 if block_n * block_k > 128 * 64 else 4
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  return _wgrad_call(dyt.values, dyt.scale, xt.values, xt.scale, group_sizes,
                     out_dtype=jnp.dtype(out_dtype), interpret=bool(interpret), block_n=block_n,
                     block_k=block_k, num_warps=num_warps, num_stages=num_stages)
