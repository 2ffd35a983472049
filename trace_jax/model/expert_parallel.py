"""Expert parallelism for the MoE block: experts sharded over the mesh's `expert` axis.

Without it, XLA partitions the MoE's grouped matmuls as its SPMD partitioner sees fit (how it
does so for the sorted, data-dependent dispatch was not worked out). Here the block runs under
`jax.shard_map` with an explicit plan in which the weights never move along `expert`: each
device of an expert group (the devices along `expert`, for one position on the other axes)

1. gathers the group's tokens (their MoE inputs, routed ids and combine weights; the tokens
   are sharded over the batch axes, `expert` among them) with one all-gather along `expert`;
2. runs its own E / ep experts on the rows routed to them: all rows sorted by expert as on one
   device, the local experts' rows are one contiguous range of them, rolled to the front, so
   the grouped matmuls see local group sizes; weights sharded over `fsdp` / `tensor` are
   gathered along those axes first (FSDP);
3. puts each row's output back in (token, slot) order (zeros for rows of other devices'
   experts), weights and sums the slots, and reduce-scatters the sums along `expert` back to
   the token shards (the sum over devices adds each slot's one nonzero contribution: the same
   terms as on one device, summed in another order).

The experts' computation is the caller's (`Experts.local`): the params' weights, quantized per
expert as `Precision.expert_weights` / `grouped` do (training), or the rollout engine's
prepared weights (`expert_weights`: BF16, FP8 or packed NVFP4, stacked per run of layers and
split along E over `expert`; read by XLA or by the decode kernel), so the one-device block and
this one run the same local code.

The TRACE expert_mid site runs per row on the device that owns the row's expert, so its
quantization, guidance matching and record are those of the single-device forward; the
record is put in (token, slot) order with zeros elsewhere and reduce-scattered as raw bits
(integers of the same width, so adding zeros is exact, signed zeros and NaN payloads
included): the gathered record equals the one-device record bit for bit.

Enabled by `mesh_context.use_mesh(mesh)` around the tracing of a forward (the training steps
enter it for their state's mesh, `train.step.ShardedStep`; the rollout engine for its mesh,
`InProcessEngine(mesh=)`) when the mesh's `expert` axis is > 1 and divides the expert count;
with an `expert` axis of 1 the same block runs data-parallel wherever the tokens split over
the mesh (each device every expert and its own tokens: no all-gather, and the sums over the
axis of one are the local ones).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from trace_jax.model import mesh_context, sharding
from trace_jax.model.grouped import inverse_permutation

AXIS = "expert"

Fn = Callable[[jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class Experts:
  """An MoE block's routed experts as its dispatch runs them, on one device or here.

  arrays: a pytree of the experts' arrays; count: the number of experts E; local(arrays,
  group_sizes) -> (hidden, down): the experts' computation for rows sorted by expert, given
  the arrays (on a mesh: a device's blocks of them) and the group sizes of the experts they
  hold: hidden(rows [M, D]) -> h [M, F] (gate, up, SwiGLU), down(h) -> [M, D]; specs: on a
  mesh, the arrays' PartitionSpecs (a matching tree; each splits its expert axis over
  `expert`, other mesh axes are gathered in the block), else None.
  """
  arrays: Any
  count: int
  local: Callable[[Any, jax.Array], tuple[Fn, Fn]]
  specs: Any = None


def active_mesh(num_experts: int, tokens: int | None = None) -> Mesh | None:
  """The mesh to run an MoE block of `num_experts` over, or None: the entered mesh when its
  `expert` axis is > 1 (it must divide the experts), or, with `expert` of 1, when the block's
  `tokens` split over the mesh's batch axes (data-parallel: each device all the experts and its
  own tokens; the experts' kernels are Pallas calls, which XLA's partitioner would run on every
  token on every device). None outside `mesh_context.use_mesh` and inside a shard_map body."""
  entered = mesh_context.entered()
  if entered is None or mesh_context.in_manual_body() or AXIS not in entered[0].shape:
    return None
  mesh, rules = entered
  if mesh.shape[AXIS] == 1:
    if tokens is None or sharding.batch_axes(tokens, mesh, rules) is None:
      return None
    return mesh
  if num_experts % mesh.shape[AXIS]:
    raise ValueError(f"expert parallelism: {num_experts} experts do not split over the mesh's "
                     f"expert axis of {mesh.shape[AXIS]}")
  return mesh


def param_specs(gate: jax.Array, up: jax.Array, down: jax.Array,
                mesh: Mesh) -> tuple[PartitionSpec, PartitionSpec, PartitionSpec]:
  """The params' expert weights' PartitionSpecs on `mesh` by the entered rules."""
  return tuple(sharding.logical_to_spec(sharding.PARAM_AXES[("moe", n)], w.shape, mesh,
                                        mesh_context.active_rules())
               for n, w in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)))


def _axes_of(spec_entry: Any) -> tuple[str, ...]:
  if spec_entry is None:
    return ()
  return (spec_entry,) if isinstance(spec_entry, str) else tuple(spec_entry)


def _gather_weight(w: jax.Array, spec: PartitionSpec) -> jax.Array:
  """The local block of a weight with every non-`expert` axis gathered (FSDP / tensor)."""
  for dim, entry in enumerate(spec):
    for ax in reversed(_axes_of(entry)):
      if ax != AXIS:
        w = jax.lax.all_gather(w, ax, axis=dim, tiled=True)
  return w


def _as_bits(a: jax.Array) -> jax.Array:
  """Same-width unsigned integers of a record field (reductions over them are exact)."""
  if jnp.issubdtype(a.dtype, jnp.unsignedinteger):
    return a
  return jax.lax.bitcast_convert_type(a, jnp.dtype(f"uint{8 * a.dtype.itemsize}"))


@dataclasses.dataclass(frozen=True)
class _Block:
  """What one device's part of an expert-parallel MoE block needs besides its arrays."""
  prec: Any  # the forward's `precision.Precision`
  layer: int
  experts: Experts
  e_local: int  # experts per device along `expert`
  gathered: bool  # the tokens are split along `expert` too: gathered in, scattered back


def _local_block(blk: _Block, rec_dtypes: list[Any], xq, ids, wts, arrays, rids, g):
  """One device's part (inside the shard_map): its experts' rows of the group's tokens, their
  outputs and expert_mid record in (token, slot) order, summed over the devices along
  `expert` (module docstring)."""
  prec, layer, e = blk.prec, blk.layer, blk.experts.count
  is_spec = lambda s: isinstance(s, PartitionSpec)
  arrays = jax.tree.map(lambda s, w: _gather_weight(w, s), blk.experts.specs, arrays,
                        is_leaf=is_spec)
  if blk.gathered:  # this expert group's tokens
    xq, ids, wts, rids, g = jax.tree.map(
        lambda a: jax.lax.all_gather(a, AXIS, axis=0, tiled=True), (xq, ids, wts, rids, g))
  (tg, d), k = xq.shape, ids.shape[1]
  me = jax.lax.axis_index(AXIS)
  flat = ids.reshape(-1)
  sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
  start = jnp.sum(jnp.where(jnp.arange(e) < me * blk.e_local, sizes, 0))
  local_sizes = jax.lax.dynamic_slice(sizes, (me * blk.e_local,), (blk.e_local,))
  # this device's rows first, in expert order
  local_order = jnp.roll(jnp.argsort(flat, stable=True), -start)
  local_inverse = inverse_permutation(local_order)
  live = jnp.arange(tg * k) < jnp.sum(local_sizes)  # [M]: rows of this device's experts
  hidden, down = blk.experts.local(arrays, local_sizes)
  h = hidden(xq[local_order // k])
  h = jnp.where(live[:, None], h, 0).astype(h.dtype)
  if g is not None:  # the tap layout [tokens, 1, K, ...]
    g = jax.tree.map(lambda a: a.reshape((tg, 1) + a.shape[1:]), g)
  view = prec.view(layer, None if g is None else {"expert_mid": g})
  h = view.site(layer, "expert_mid", h, row_order=local_order, row_inverse=local_inverse,
                tap_shape=(tg, 1, k), experts=ids.reshape(tg, 1, k),
                rollout_experts=None if rids is None else rids.reshape(tg, 1, k))
  y = jnp.where(live[:, None], down(h), 0).astype(xq.dtype)  # [M, D]
  out = jnp.sum(y[local_inverse].reshape(tg, k, d) * wts[..., None], axis=1)
  rec = view.taps.get(layer, {}).get("expert_mid")
  if rec is not None:  # (token, slot) rows of this device's experts; zeros elsewhere
    rec_dtypes.append(jax.tree.map(lambda a: a.dtype, rec))
    mine = live[local_inverse].reshape(tg, 1, k)
    rec = jax.tree.map(lambda a: jnp.where(
        mine.reshape(mine.shape + (1,) * (a.ndim - 3)), _as_bits(a), 0), rec)
  if blk.gathered:
    reduce = lambda a: jax.lax.psum_scatter(a, AXIS, scatter_dimension=0, tiled=True)
  else:
    reduce = lambda a: jax.lax.psum(a, AXIS)
  return reduce(out), jax.tree.map(reduce, rec)


def moe(prec: Any, layer: int, xq: jax.Array, ids: jax.Array, weights: jax.Array,
        experts: Experts, rollout_ids: jax.Array | None, mesh: Mesh,
        tap_shape: tuple[int, int, int]) -> jax.Array:
  """The routed experts of one MoE block, expert-parallel (module docstring).

  xq [T, D]: the block's (moe_in-quantized) token inputs; ids, weights [T, K]: routed experts
  and combine weights; experts: their arrays laid out on `mesh` by `experts.specs`, and their
  computation; rollout_ids [T, K] or None (the rollout's experts, for expert_mid guidance);
  tap_shape (B, S, K) with B * S = T: the layout of the expert_mid record. Returns [T, D];
  records expert_mid in `prec` (the forward's `precision.Precision`).
  """
  t, d = xq.shape
  tok_spec = sharding.logical_to_spec(("batch", None), (t, d), mesh,
                                      mesh_context.active_rules())
  blk = _Block(prec=prec, layer=layer, experts=experts,
               e_local=experts.count // mesh.shape[AXIS],
               gathered=AXIS in _axes_of(tok_spec[0]))
  g = prec.site_guidance(layer, "expert_mid")
  row_spec = PartitionSpec(tok_spec[0])
  rec_dtypes: list[Any] = []  # the record's field dtypes, found while tracing the body

  def body(*args):
    with mesh_context.manual_body():
      return _local_block(blk, rec_dtypes, *args)

  g_in = None if g is None else jax.tree.map(lambda a: a.reshape((t,) + a.shape[2:]), g)
  in_specs = (row_spec, row_spec, row_spec, experts.specs, row_spec, row_spec)
  out, rec = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=(row_spec, row_spec),
                           check_vma=False)(xq, ids, weights, experts.arrays, rollout_ids, g_in)
  if rec is not None:  # back from raw bits; [T, 1, K, ...] -> the forward's tap layout
    rec = jax.tree.map(lambda a, dt: jax.lax.bitcast_convert_type(a, dt).reshape(
        tap_shape + a.shape[3:]), rec, rec_dtypes[0])
    prec.taps.setdefault(layer, {})["expert_mid"] = rec
  return out
