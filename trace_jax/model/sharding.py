"""Dimension letters, logical axes and the rules that map them onto a device mesh.

Legend (used in every einsum string and shape comment of `trace_jax.model`):
  B batch            S query positions     T key/cache positions
  D model (hidden)   V vocabulary          N query heads
  G key/value heads  R query heads per kv head (N = G * R)
  H head dim         E experts             K experts per token (top-k)
  F expert ffn (moe_intermediate_size)     M routed rows (tokens * K, sorted by expert)

Parameters carry no sharding metadata: their logical axes come from `PARAM_AXES`, a table
keyed by the parameter's name, so the same rules apply to an NNX state, a pure dict, or an
abstract (`jax.eval_shape`) tree. A layout is data: `DEFAULT_RULES` maps logical axes to
mesh axes (`data`, `fsdp`, `expert`, `tensor`); a mesh axis that does not divide a dimension
is dropped for that dimension (replication), so one rule table serves every model size.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "expert", "tensor")

# Logical axis -> mesh axes. Experts are sharded over `expert`; heads, expert ffn and vocab over
# `tensor`; the model dim over `fsdp` and, for weights that have no expert axis, also over
# `expert` (a mesh axis is used once per array, so expert weights take `expert` for E first).
# Activations' batch is split over data x fsdp x expert.
DEFAULT_RULES: dict[str, tuple[str, ...]] = {
    "batch": ("data", "fsdp", "expert"),
    "embed": ("fsdp", "expert"),
    "vocab": ("tensor",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "exp": ("expert",),
    "mlp": ("tensor",),
    "norm": (),
    "router": (),
}

# The rollout engine's layout (`InProcessEngine(mesh=)`): the routed experts split over
# `expert` (the expert-parallel MoE block runs each device's own, in place), every other
# weight replicated (no weight moves at a decode step; the experts are what does not fit on
# one device); the activations' batch as in DEFAULT_RULES.
ENGINE_RULES: dict[str, tuple[str, ...]] = {
    **{name: () for name in DEFAULT_RULES}, "exp": ("expert",),
    "batch": DEFAULT_RULES["batch"]}

# Parameter name (last path entries) -> logical axes, torch [out, in] layout everywhere.
PARAM_AXES: dict[tuple[str, ...], tuple[str, ...]] = {
    ("embed", "embedding"): ("vocab", "embed"),          # [V, D]
    ("q_proj", "kernel"): ("heads", "embed"),            # [N*H, D]
    ("k_proj", "kernel"): ("kv_heads", "embed"),         # [G*H, D]
    ("v_proj", "kernel"): ("kv_heads", "embed"),         # [G*H, D]
    ("o_proj", "kernel"): ("embed", "heads"),            # [D, N*H]
    ("router", "kernel"): ("router", "embed"),           # [E, D]
    ("moe", "gate_proj"): ("exp", "mlp", "embed"),       # [E, F, D]
    ("moe", "up_proj"): ("exp", "mlp", "embed"),         # [E, F, D]
    ("moe", "down_proj"): ("exp", "embed", "mlp"),       # [E, D, F]
    ("lm_head", "kernel"): ("vocab", "embed"),           # [V, D]
    ("scale",): ("norm",),                               # RMSNorm weights [D] or [H]
}


def make_mesh(shape: Mapping[str, int], devices: Sequence[Any] | None = None) -> Mesh:
  """A mesh with axes (data, fsdp, expert, tensor); missing axes get size 1."""
  unknown = set(shape) - set(MESH_AXES)
  if unknown:
    raise ValueError(f"make_mesh: unknown mesh axes {sorted(unknown)}; expected {MESH_AXES}")
  sizes = tuple(int(shape.get(a, 1)) for a in MESH_AXES)
  devices = list(jax.devices() if devices is None else devices)
  n = int(np.prod(sizes))
  if n > len(devices):
    raise ValueError(f"make_mesh: mesh {dict(zip(MESH_AXES, sizes))} needs {n} devices, "
                     f"only {len(devices)} given")
  return Mesh(np.asarray(devices[:n], dtype=object).reshape(sizes), MESH_AXES)


def logical_to_spec(axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                    rules: Mapping[str, tuple[str, ...]] = DEFAULT_RULES) -> PartitionSpec:
  """PartitionSpec for `axes`; mesh axes that do not divide the dimension (or repeat) drop."""
  used: set[str] = set()
  spec = []
  for name, dim in zip(axes, shape):
    if name is not None and name not in rules:
      raise KeyError(f"logical axis {name!r} has no sharding rule; rules know {sorted(rules)}")
    kept = []
    size = 1
    for m in (() if name is None else rules[name]):
      if m in used or mesh.shape[m] == 1:
        continue
      if dim % (size * mesh.shape[m]) == 0:
        kept.append(m)
        size *= mesh.shape[m]
    used.update(kept)
    spec.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
  return PartitionSpec(*spec)


def _path_names(path: tuple[Any, ...]) -> tuple[str, ...]:
  names = []
  for p in path:
    key = getattr(p, "key", getattr(p, "name", getattr(p, "idx", None)))
    if key == "value":  # nnx.Variable's leaf
      continue
    names.append(str(key))
  return tuple(names)


def param_axes(path_names: tuple[str, ...]) -> tuple[str, ...]:
  """Logical axes of the parameter at `path_names` (longest matching suffix in PARAM_AXES)."""
  for n in (2, 1):
    if path_names[-n:] in PARAM_AXES:
      return PARAM_AXES[path_names[-n:]]
  raise KeyError(f"no logical axes for parameter {'.'.join(path_names)}; add it to PARAM_AXES")


def param_shardings(params: Any, mesh: Mesh,
                    rules: Mapping[str, tuple[str, ...]] = DEFAULT_RULES,
                    stacked: bool = False) -> Any:
  """A tree of NamedSharding matching `params` (arrays or ShapeDtypeStructs). stacked: layer
  params stacked along a leading layer axis (the rollout engine's `layers`,
  `layer_runs.stack_layers`), that axis replicated (an array the engine emptied, shape [0],
  replicated)."""
  lead = (None,) if stacked else ()

  def one(path, x):
    return NamedSharding(mesh, logical_to_spec(lead + param_axes(_path_names(path)), x.shape,
                                               mesh, rules))
  return jax.tree_util.tree_map_with_path(one, params)


def batch_axes(size: int, mesh: Mesh,
               rules: Mapping[str, tuple[str, ...]] = DEFAULT_RULES) -> Any:
  """The mesh axes a batch of `size` rows splits over by the `batch` rule (a PartitionSpec
  entry: None, one axis name or a tuple of them)."""
  return logical_to_spec(("batch",), (size,), mesh, rules)[0]


def activation_sharding(mesh: Mesh, shape: Sequence[int],
                        rules: Mapping[str, tuple[str, ...]] = DEFAULT_RULES) -> NamedSharding:
  """Sharding of a [B, ...] activation or token array: batch over the `batch` rule's axes
  (those that divide B)."""
  axes = ("batch",) + (None,) * (len(shape) - 1)
  return NamedSharding(mesh, logical_to_spec(axes, shape, mesh, rules))


def shard_params(params: Any, mesh: Mesh,
                 rules: Mapping[str, tuple[str, ...]] = DEFAULT_RULES) -> Any:
  """Places `params` on `mesh` by the rules."""
  return jax.device_put(params, param_shardings(params, mesh, rules))


_COLLECTIVE = re.compile(r"= (\([^=]*?\)|\w+\[[\d,]*\]\S*) (all-gather|all-reduce|all-to-all|"
                         r"collective-permute|reduce-scatter)(?:-start)?\(")


def collectives(hlo_text: str) -> list[tuple[str, tuple[int, ...]]]:
  """(op, result shape) of every collective in a compiled program's HLO text
  (`jit(f).lower(...).compile().as_text()`), one entry per array of a tuple result: what the
  program moves between devices (e.g. to check that expert weights never move)."""
  out = []
  for m in _COLLECTIVE.finditer(hlo_text):
    for shape in re.finditer(r"\w+\[([\d,]*)\]", m.group(1)):
      out.append((m.group(2), tuple(int(v) for v in shape.group(1).split(",") if v)))
  return out
