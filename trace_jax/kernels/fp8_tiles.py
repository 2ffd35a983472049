"""The FP8 backward's operand layouts in one pass each: a grouped layout's tiles gathered,
transposed and quantized in 128x1 groups (the WGrad's), and E4M3 codes transposed (the DGrad's
weight).

The FP8 WGrad of the routed experts (Jet-RL's 128x1 groups along the tokens,
`model.fp8_linear`) reads x and dy with each expert's rows padded to whole 128-row tiles,
transposed to [C, tiles x 128] and quantized to E4M3 with one scale per 128 of them: every
tile is one expert's run of consecutive rows followed by zero rows, and one group. Left to XLA
the gather and the transpose become one loop fusion that writes the transposed layout while
reading across the rows' stride, and the quantizer reads that copy again: on the H100 at
Qwen3-30B-A3B width the operands' layouts took 20 ms of a 107 ms step and their codes 5 ms more
(docs/benchmarks.md). Here one program per (tile, column block) loads the tile's rows
[128, block_c] (consecutive rows of one expert: whole cache lines), transposes them in
registers and stores each column's group: the codes [block_c, 128] (whole rows of the output)
and its scale, with `formats.fp8_group_codes`, the bits of `formats.fp8_quantize_act` of the
gathered, transposed operand.

The DGrad of an FP8 linear multiplies dy by the forward's weight codes transposed, [..., K, N]
from [..., N, K] (`fp8_gemm.transpose_weight`; the tensor cores read both FP8 operands with
the contraction axis contiguous). In the training step XLA fused those byte transposes with
their neighbours into 9.7 ms a step on the H100 at Qwen3-30B-A3B width; `transpose_codes`
moves one [128, 128] block per program, loaded and stored along whole rows. Alone it reads at
about 30% of the copy rate where XLA's transpose of materialized codes reaches 80%, yet that
transpose (behind a barrier) made the step slower than the kernel does (docs/benchmarks.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from trace_jax.kernels import common
from trace_jax.quant import exact, formats

TILE = formats.FP8_GROUP  # a tile's rows are one 128x1 group
BLOCK_C = 64  # columns per program: a [128, 64] bf16 tile is 16 KB
NUM_WARPS = 4


def tile_runs(src: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
  """(starts, counts) int32 [rows / 128] of a padded layout's gather map `src` [rows] (as
  `grouped.padded_sources` makes it for 128-row tiles: each tile's rows are consecutive input
  rows, then rows of value m, which hold no input row): each tile's first input row and how
  many it holds."""
  runs = src.reshape(-1, TILE).astype(jnp.int32)
  counts = jnp.sum(runs < m, axis=1, dtype=jnp.int32)
  return jnp.where(counts > 0, runs[:, 0], 0), counts


def _kernel(starts_ref, counts_ref, x_ref, codes_ref, scale_ref, *, block_c: int,
            interpret: bool):
  t, j = pl.program_id(0), pl.program_id(1)
  held = jnp.arange(TILE, dtype=jnp.int32) < counts_ref[t]
  c0 = pl.multiple_of(j * block_c, block_c)
  rows = common.masked_load(x_ref, (pl.ds(starts_ref[t], TILE), pl.ds(c0, block_c)),
                            held[:, None], 0)
  groups = exact.flush_subnormal(rows.T.astype(jnp.float32))         # [block_c, 128]
  codes, scale = formats.fp8_group_codes(groups, straight_line=not interpret)
  codes_ref[pl.ds(c0, block_c), pl.ds(pl.multiple_of(t * TILE, TILE), TILE)] = codes
  scale_ref[pl.ds(c0, block_c), t] = scale


@functools.partial(jax.jit, static_argnames=("interpret", "block_c", "num_warps"))
def _quantize_tiles(x, starts, counts, *, interpret: bool, block_c: int, num_warps: int):
  c = x.shape[1]
  n_tiles = starts.shape[0]
  block_c = common.pow2_divisor(c, block_c)
  codes, scale = pl.pallas_call(
      functools.partial(_kernel, block_c=block_c, interpret=interpret),
      grid=(n_tiles, c // block_c),
      out_shape=(jax.ShapeDtypeStruct((c, n_tiles * TILE), jnp.uint8),
                 jax.ShapeDtypeStruct((c, n_tiles), jnp.float32)),
      interpret=interpret,
      compiler_params=None if interpret else common.compiler_params(num_warps, 1),
      name="fp8_wgrad_tiles",
  )(starts, counts, x)
  return formats.FP8Tensor(values=exact.bits_to_e4m3(codes), scale=scale)


def quantize_tiles(x: jax.Array, starts: jax.Array, counts: jax.Array, *,
                   interpret: bool | None = None, block_c: int = BLOCK_C,
                   num_warps: int = NUM_WARPS) -> formats.FP8Tensor:
  """x [M, C] -> E4M3 codes [C, T x 128] with one scale per 128 along the rows (scales
  [C, T]): column block i x 128 .. of the transposed operand holds rows starts[i] ..
  starts[i] + counts[i] - 1 of x, then zeros (counts[i] <= 128; a tile of count 0 is all
  zeros, scale AMAX_FLOOR / 448). Bit for bit `formats.fp8_quantize_act(jnp.take(x, src, 0,
  mode="fill", fill_value=0).T)` for the `src` that `tile_runs` read. interpret: None runs
  Triton on a GPU and the Pallas interpreter elsewhere; block_c (a power of two: columns per
  program) and num_warps are Triton's launch (the same bits for any)."""
  if x.ndim != 2 or starts.shape != counts.shape or starts.ndim != 1:
    raise ValueError(f"quantize_tiles: expected x [M, C] and starts, counts [T]; got "
                     f"{x.shape}, {starts.shape}, {counts.shape}")
  if x.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
    raise TypeError(f"quantize_tiles: x must be float32, bfloat16 or float16, got {x.dtype}")
  if x.shape[1] % 16:
    raise ValueError(f"quantize_tiles: C must be a multiple of 16, got {x.shape[1]}")
  interpret = common.default_interpret() if interpret is None else interpret
  return _quantize_tiles(x, starts.astype(jnp.int32), counts.astype(jnp.int32),
                         interpret=bool(interpret), block_c=block_c, num_warps=num_warps)


BLOCK_T = 128  # a transpose program's block: [128, 128] codes, 16 KB


def _transpose_kernel(x_ref, o_ref):
  o_ref[0] = x_ref[0].T


@functools.partial(jax.jit, static_argnames=("interpret", "block", "num_warps"))
def _transpose_codes(bits, *, interpret: bool, block: int, num_warps: int):
  lead, n, k = bits.shape[:-2], bits.shape[-2], bits.shape[-1]
  x = bits.reshape((-1, n, k))
  bn, bk = common.pow2_divisor(n, block), common.pow2_divisor(k, block)
  out = pl.pallas_call(
      _transpose_kernel,
      grid=(x.shape[0], n // bn, k // bk),
      in_specs=[pl.BlockSpec((1, bn, bk), lambda e, i, j: (e, i, j))],
      out_specs=pl.BlockSpec((1, bk, bn), lambda e, i, j: (e, j, i)),
      out_shape=jax.ShapeDtypeStruct((x.shape[0], k, n), jnp.uint8),
      interpret=interpret,
      compiler_params=None if interpret else common.compiler_params(num_warps, 1),
      name="fp8_transpose_codes",
  )(x)
  return out.reshape(lead + (k, n))


def transpose_codes(values: jax.Array, *, interpret: bool | None = None, block: int = BLOCK_T,
                    num_warps: int = NUM_WARPS) -> jax.Array:
  """E4M3 codes [..., N, K] -> [..., K, N] (a permutation: the same bytes), one [block, block]
  block per program at most (N and K multiples of 16). interpret: None runs Triton on a GPU
  and the Pallas interpreter elsewhere; block (a power of two) and num_warps are Triton's
  launch."""
  if values.dtype != jnp.float8_e4m3fn or values.ndim < 2:
    raise TypeError(f"transpose_codes: expected float8_e4m3fn codes [..., N, K], got "
                    f"{values.dtype} {values.shape}")
  if values.shape[-1] % 16 or values.shape[-2] % 16:
    raise ValueError(f"transpose_codes: N and K must be multiples of 16, got {values.shape}")
  interpret = common.default_interpret() if interpret is None else interpret
  bits = jax.lax.bitcast_convert_type(values, jnp.uint8)
  return exact.bits_to_e4m3(_transpose_codes(bits, interpret=bool(interpret), block=block,
                                             num_warps=num_warps))
