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

Enabled by `use_mesh(mesh)` around the tracing of a forward (the training steps enter it for
their state's mesh, `train.step.ShardedStep`; the rollout engine for its mesh,
`InProcessEngine(mesh=)`) when the mesh's `expert` axis is > 1 and divides the expert count;
with an `expert` axis of 1 the same block runs data-parallel wherever the tokens split over
the mesh (each device every expert and its own tokens: no all-gather, and the sums over the
axis of one are the local ones).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from trace_jax.model import sharding
from trace_jax.model.grouped import inverse_permutation

if TYPE_CHECKING:  # precision runs its site kernels through `batch_local`, which imports this
  from trace_jax.model.precision import Precision

AXIS = "expert"
_MESH: contextvars.ContextVar[tuple[Mesh, Mapping[str, tuple[str, ...]]] | None] = (
    contextvars.ContextVar("expert_mesh", default=None))
# True while a shard_map body over the entered mesh is traced (its arrays are local): the MoE
# block's here, `batch_local`'s; nothing in it starts another shard_map.
_MANUAL: contextvars.ContextVar[bool] = contextvars.ContextVar("manual_body", default=False)

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


@contextlib.contextmanager
def use_mesh(mesh: Mesh | None,
             rules: Mapping[str, tuple[str, ...]] = sharding.DEFAULT_RULES) -> Iterator[None]:
  """Forwards traced inside run their MoE blocks expert-parallel over `mesh` (None: off).

  rules: the logical-axis rules the weights and tokens are laid out by (`sharding`): the
  block's `shard_map` takes them in that layout, so nothing is resharded on the way in."""
  token = _MESH.set(None if mesh is None else (mesh, rules))
  try:
    yield
  finally:
    _MESH.reset(token)


def entered() -> tuple[Mesh, Mapping[str, tuple[str, ...]]] | None:
  """(mesh, rules) entered with `use_mesh`, or None."""
  return _MESH.get()


@contextlib.contextmanager
def manual_body() -> Iterator[None]:
  """Marks the tracing of a shard_map body over the entered mesh (`in_manual_body`)."""
  token = _MANUAL.set(True)
  try:
    yield
  finally:
    _MANUAL.reset(token)


def in_manual_body() -> bool:
  """Whether a shard_map body over the entered mesh is being traced."""
  return _MANUAL.get()


def active_mesh(num_experts: int, tokens: int | None = None) -> Mesh | None:
  """The mesh to run an MoE block of `num_experts` over, or None: the entered mesh when its
  `expert` axis is > 1 (it must divide the experts), or, with `expert` of 1, when the block's
  `tokens` split over the mesh's batch axes (data-parallel: each device all the experts and its
  own tokens; the experts' kernels are Pallas calls, which XLA's partitioner would run on every
  token on every device). None outside `use_mesh` and inside a shard_map body."""
  entered = _MESH.get()
  if entered is None or _MANUAL.get() or AXIS not in entered[0].shape:
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


def active_rules() -> Mapping[str, tuple[str, ...]]:
  """The sharding rules entered with the mesh (`sharding.DEFAULT_RULES` outside)."""
  entered = _MESH.get()
  return sharding.DEFAULT_RULES if entered is None else entered[1]


def param_specs(gate: jax.Array, up: jax.Array, down: jax.Array,
                mesh: Mesh) -> tuple[PartitionSpec, PartitionSpec, PartitionSpec]:
  """The params' expert weights' PartitionSpecs on `mesh` by the entered rules."""
  return tuple(sharding.logical_to_spec(sharding.PARAM_AXES[("moe", n)], w.shape, mesh,
                                        active_rules())
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


def moe(prec: Precision, layer: int, xq: jax.Array, ids: jax.Array, weights: jax.Array,
        experts: Experts, rollout_ids: jax.Array | None, mesh: Mesh,
        tap_shape: tuple[int, int, int]) -> jax.Array:
  """The routed experts of one MoE block, expert-parallel (module docstring).

  xq [T, D]: the block's (moe_in-quantized) token inputs; ids, weights [T, K]: routed experts
  and combine weights; experts: their arrays laid out on `mesh` by `experts.specs`, and their
  computation; rollout_ids [T, K] or None (the rollout's experts, for expert_mid guidance);
  tap_shape (B, S, K) with B * S = T: the layout of the expert_mid record. Returns [T, D];
  records expert_mid in `prec`.
  """
  t, d = xq.shape
  k = ids.shape[1]
  e, specs = experts.count, experts.specs
  ep = mesh.shape[AXIS]
  e_local = e // ep
  tok_spec = sharding.logical_to_spec(("batch", None), (t, d), mesh, active_rules())
  tok_axes = _axes_of(tok_spec[0])
  gathered = AXIS in tok_axes
  g = prec._guidance(layer, "expert_mid")
  row_spec = PartitionSpec(tok_spec[0])
  is_spec = lambda s: isinstance(s, PartitionSpec)
  rec_dtypes: list[Any] = []  # the record's field dtypes, found while tracing the body

  def body(*args):
    with manual_body():
      return local_block(*args)

  def local_block(xq, ids, wts, arrays, rids, g):
    arrays = jax.tree.map(lambda s, w: _gather_weight(w, s), specs, arrays, is_leaf=is_spec)
    if gathered:  # this expert group's tokens
      xq, ids, wts, rids, g = jax.tree.map(
          lambda a: jax.lax.all_gather(a, AXIS, axis=0, tiled=True), (xq, ids, wts, rids, g))
    tg = xq.shape[0]
    me = jax.lax.axis_index(AXIS)
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    start = jnp.sum(jnp.where(jnp.arange(e) < me * e_local, sizes, 0))
    local_sizes = jax.lax.dynamic_slice(sizes, (me * e_local,), (e_local,))
    n_local = jnp.sum(local_sizes)
    m = tg * k
    local_order = jnp.roll(order, -start)          # this device's rows first, in expert order
    local_inverse = inverse_permutation(local_order)
    live = jnp.arange(m) < n_local                 # [M]: rows of this device's experts
    rows = xq[local_order // k]
    hidden, down = experts.local(arrays, local_sizes)
    h = hidden(rows)
    h = jnp.where(live[:, None], h, 0).astype(h.dtype)
    if g is not None:  # the tap layout [tokens, 1, K, ...]
      g = jax.tree.map(lambda a: a.reshape((tg, 1) + a.shape[1:]), g)
    view = prec.view(layer, None if g is None else {"expert_mid": g})
    h = view.site(layer, "expert_mid", h, row_order=local_order, row_inverse=local_inverse,
                  tap_shape=(tg, 1, k),
                  experts=ids.reshape(tg, 1, k),
                  rollout_experts=None if rids is None else rids.reshape(tg, 1, k))
    y = jnp.where(live[:, None], down(h), 0).astype(xq.dtype)                    # [M, D]
    y = y[local_inverse].reshape(tg, k, d)
    out = jnp.sum(y * wts[..., None], axis=1)
    rec = view.taps.get(layer, {}).get("expert_mid")
    if rec is not None:  # (token, slot) rows of this device's experts; zeros elsewhere
      rec_dtypes.append(jax.tree.map(lambda a: a.dtype, rec))
      mine = live[local_inverse].reshape(tg, 1, k)
      rec = jax.tree.map(lambda a: jnp.where(
          mine.reshape(mine.shape + (1,) * (a.ndim - 3)), _as_bits(a), 0), rec)
    if gathered:
      out = jax.lax.psum_scatter(out, AXIS, scatter_dimension=0, tiled=True)
      rec = jax.tree.map(lambda a: jax.lax.psum_scatter(a, AXIS, scatter_dimension=0,
                                                        tiled=True), rec)
    else:
      out = jax.lax.psum(out, AXIS)
      rec = jax.tree.map(lambda a: jax.lax.psum(a, AXIS), rec)
    return out, rec

  g_in = None if g is None else jax.tree.map(lambda a: a.reshape((t,) + a.shape[2:]), g)
  in_specs = (row_spec, row_spec, row_spec, specs, row_spec, row_spec)
  out, rec = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=(row_spec, row_spec),
                           check_vma=False)(xq, ids, weights, experts.arrays, rollout_ids, g_in)
  if rec is not None:  # back from raw bits; [T, 1, K, ...] -> the forward's tap layout
    rec = jax.tree.map(lambda a, dt: jax.lax.bitcast_convert_type(a, dt).reshape(
        tap_shape + a.shape[3:]), rec, rec_dtypes[0])
    prec.taps.setdefault(layer, {})["expert_mid"] = rec
  return out
