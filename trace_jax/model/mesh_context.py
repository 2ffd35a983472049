"""The mesh a forward is traced on: one home for the context the model, the kernels' shard
wrappers (`batch_local`) and the training and rollout programs read.

`use_mesh(mesh, rules)` around the tracing of a forward makes its MoE blocks run under
`jax.shard_map` over `mesh` (`expert_parallel`) and its Pallas kernels per batch shard
(`batch_local`), with the arrays laid out by the logical-axis `rules` (`sharding`). Inside a
shard_map body over the entered mesh (`manual_body`) the arrays are local: nothing there
starts another shard_map.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping

from jax.sharding import Mesh

from trace_jax.model import sharding

Rules = Mapping[str, tuple[str, ...]]
_MESH: contextvars.ContextVar[tuple[Mesh, Rules] | None] = (
    contextvars.ContextVar("mesh_context", default=None))
# True while a shard_map body over the entered mesh is traced (its arrays are local): the MoE
# block's (`expert_parallel`), `batch_local`'s.
_MANUAL: contextvars.ContextVar[bool] = contextvars.ContextVar("manual_body", default=False)


@contextlib.contextmanager
def use_mesh(mesh: Mesh | None, rules: Rules = sharding.DEFAULT_RULES) -> Iterator[None]:
  """Forwards traced inside run on `mesh` (None: off): their MoE blocks expert-parallel (or
  data-parallel where `expert` is 1) and their kernels per batch shard.

  rules: the logical-axis rules the weights and tokens are laid out by (`sharding`): the
  shard_maps take them in that layout, so nothing is resharded on the way in."""
  token = _MESH.set(None if mesh is None else (mesh, rules))
  try:
    yield
  finally:
    _MESH.reset(token)


def entered() -> tuple[Mesh, Rules] | None:
  """(mesh, rules) entered with `use_mesh`, or None."""
  return _MESH.get()


def active_rules() -> Rules:
  """The sharding rules entered with the mesh (`sharding.DEFAULT_RULES` outside)."""
  e = _MESH.get()
  return sharding.DEFAULT_RULES if e is None else e[1]


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
