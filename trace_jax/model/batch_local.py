"""Pallas kernels on a mesh: each device runs a kernel on its own rows of the batch.

XLA's SPMD partitioner cannot split a custom call, and on the GPU a Pallas kernel is one (Triton
or Mosaic GPU): it gathers the call's operands to every device and runs the whole call on
each. Traced on a mesh without help, the engine's decode-attention kernel would all-gather the
batch-sharded KV cache at every step and every device would attend for every sequence. The
Pallas interpreter (CPU) hides this: its kernels are plain HLO, which XLA partitions.

`on_batch_shards` runs a kernel whose work is independent per batch row (decode attention per
sequence; the decode projections, lm_head, NVFP4 sites and dense FP8 GEMMs per token row;
`summed_over_batch_shards` one that contracts over the rows, the FP8 WGrad) under `jax.shard_map`
over the mesh entered with `mesh_context.use_mesh`: its batch-indexed operands split as the
entered rules split the batch (the `batch` logical axis), every other operand replicated (the
engine's dense weights are: `sharding.ENGINE_RULES`), each output split along its first axis.
Outside a mesh, where the batch does not split, or inside another `shard_map` body (the
expert-parallel MoE block's: its arrays are already local), it calls the kernel as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec

from trace_jax.model import mesh_context, sharding


def batch_axes(size: int) -> Any:
  """The mesh axes a batch of `size` rows splits over on the entered mesh (a PartitionSpec
  entry: None, one axis name or a tuple of them); None outside a mesh or a shard_map body."""
  entered = mesh_context.entered()
  if entered is None or mesh_context.in_manual_body():
    return None
  return sharding.batch_axes(size, *entered)


def on_batch_shards(fn: Callable[..., Any], args: Sequence[Any],
                    batch_dims: Sequence[int | None], size: int, out_dim: int = 0) -> Any:
  """fn(*args), on the entered mesh per shard of a batch of `size` rows (module docstring).

  batch_dims: per argument, the axis that indexes the batch in every leaf of it, or None (the
  argument replicated: weights, a layer index); arguments are arrays or pytrees of them
  (static ones go in fn's closure). fn's outputs are indexed by the batch on axis `out_dim`
  (the first; 1 for a stack of layers' caches)."""
  return _shard_map(fn, args, batch_dims, size, summed=False, out_dim=out_dim)


def summed_over_batch_shards(fn: Callable[..., Any], args: Sequence[Any],
                             batch_dims: Sequence[int | None], size: int) -> Any:
  """The sum over the entered mesh's batch shards of fn(*local args): for a kernel that
  contracts over the batch (a weight gradient), each device its own rows' partial, summed over
  the batch axes (`psum`; return float32 partials for a float32 sum). size: the extent along
  batch_dims that must split evenly (e.g. a count of row groups). Off a mesh: fn(*args)."""
  return _shard_map(fn, args, batch_dims, size, summed=True)


def _shard_map(fn: Callable[..., Any], args: Sequence[Any], batch_dims: Sequence[int | None],
               size: int, summed: bool, out_dim: int = 0) -> Any:
  axes = batch_axes(size)
  if axes is None:
    return fn(*args)
  mesh, _ = mesh_context.entered()
  in_specs = tuple(PartitionSpec() if d is None else PartitionSpec(*([None] * d), axes)
                   for d in batch_dims)

  def body(*local: Any) -> Any:
    with mesh_context.manual_body():
      out = fn(*local)
    return jax.tree.map(lambda a: jax.lax.psum(a, axes), out) if summed else out

  return jax.shard_map(body, mesh=mesh, in_specs=in_specs,
                       out_specs=PartitionSpec() if summed
                       else PartitionSpec(*([None] * out_dim), axes),
                       check_vma=False)(*args)
