"""The rows of a grouped layout's tiles, gathered and transposed in one pass.

The FP8 WGrad of the routed experts (Jet-RL's 128x1 groups along the tokens,
`model.fp8_linear`) reads x and dy with each expert's rows padded to whole 128-row tiles and
transposed: [C, tiles x 128], every tile one expert's run of consecutive rows followed by zero
rows. Left to XLA, the gather, the transpose and the operand's producer become one loop fusion
that writes the transposed layout while reading across the rows' stride: on the H100 at
Qwen3-30B-A3B width the four WGrad operands took about 5 ms a layer that way, the FP8
backward's largest fusions (docs/benchmarks.md). Here one program per (tile, column block)
loads the tile's rows [tile, block_c] (consecutive rows of one expert: whole cache lines) and
stores them transposed [block_c, tile] (whole rows of the output): both sides coalesced. The
values are copied, not changed; rows past a tile's count are zeros.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from trace_jax.kernels import common

BLOCK_C = 64  # columns per program: a [128, 64] bf16 tile is 16 KB


def tile_runs(src: jax.Array, m: int, tile: int) -> tuple[jax.Array, jax.Array]:
  """(starts, counts) int32 [rows / tile] of a padded layout's gather map `src` [rows] (as
  `grouped.padded_sources` makes it: each tile's rows are consecutive input rows, then rows
  of value m, which hold no input row): each tile's first input row and how many it holds."""
  runs = src.reshape(-1, tile).astype(jnp.int32)
  counts = jnp.sum(runs < m, axis=1, dtype=jnp.int32)
  return jnp.where(counts > 0, runs[:, 0], 0), counts


def _kernel(starts_ref, counts_ref, x_ref, o_ref, *, tile: int, block_c: int):
  t, j = pl.program_id(0), pl.program_id(1)
  held = jnp.arange(tile, dtype=jnp.int32) < counts_ref[t]
  c0 = pl.multiple_of(j * block_c, block_c)
  rows = common.masked_load(x_ref, (pl.ds(starts_ref[t], tile), pl.ds(c0, block_c)),
                            held[:, None], 0)
  o_ref[pl.ds(c0, block_c), pl.ds(pl.multiple_of(t * tile, tile), tile)] = rows.T


@functools.partial(jax.jit, static_argnames=("tile", "interpret"))
def _transpose_tiles(x, starts, counts, *, tile: int, interpret: bool):
  m, c = x.shape
  n_tiles = starts.shape[0]
  block_c = common.pow2_divisor(c, BLOCK_C)
  return pl.pallas_call(
      functools.partial(_kernel, tile=tile, block_c=block_c),
      grid=(n_tiles, c // block_c),
      out_shape=jax.ShapeDtypeStruct((c, n_tiles * tile), x.dtype), interpret=interpret,
      compiler_params=None if interpret else common.compiler_params(4, 1),
      name="tile_transpose",
  )(starts, counts, x)


def transpose_tiles(x: jax.Array, starts: jax.Array, counts: jax.Array, *, tile: int = 128,
                    interpret: bool | None = None) -> jax.Array:
  """x [M, C] -> [C, T x tile]: column block i x tile .. of the output holds rows starts[i] ..
  starts[i] + counts[i] - 1 of x, transposed, then zeros (counts[i] <= tile; a tile of count
  0 is all zeros). Equal to `jnp.take(x, src, 0, mode="fill", fill_value=0).T` for the `src`
  that `tile_runs` read (bit for bit: a copy). interpret: None runs Triton on a GPU and the
  Pallas interpreter elsewhere."""
  if x.ndim != 2 or starts.shape != counts.shape or starts.ndim != 1:
    raise ValueError(f"transpose_tiles: expected x [M, C] and starts, counts [T]; got "
                     f"{x.shape}, {starts.shape}, {counts.shape}")
  common.check_block("tile", tile, 16)
  if x.shape[1] % 16:
    raise ValueError(f"transpose_tiles: C must be a multiple of 16, got {x.shape[1]}")
  interpret = common.default_interpret() if interpret is None else interpret
  return _transpose_tiles(x, starts.astype(jnp.int32), counts.astype(jnp.int32), tile=tile,
                          interpret=bool(interpret))
