"""A tree of per-row records of mixed dtypes as one byte row per row, and back, bit for bit.

A decode step records a few dozen small arrays per token (each tapped site's block scales,
row scales and mantissa bits, every layer's expert ids). Written apart, every one is a kernel
of its own in each step (a scan's stacking update, the decode loop's write by position): on
the H200 the fp4_trace step ran 695 kernels against fp4_rtn's 494 and idled 28% of its wall
time waiting for the host to launch them (the git history of docs/benchmarks.md). Packed, a
tree moves as one array: one update, one scatter. The layout (`Layout`) is static and hashable,
so jitted programs pack and unpack with it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where each leaf of a packed tree sits in the row: static, hashable."""
  treedef: Any
  tails: tuple[tuple[int, ...], ...]  # each leaf's shape after the leading (row) axes
  dtypes: tuple[str, ...]
  offsets: tuple[int, ...]  # byte offset of each leaf in the row; last entry: the row's width

  @property
  def width(self) -> int:
    return self.offsets[-1]


def _as_bytes(a: jax.Array, lead: tuple[int, ...]) -> jax.Array:
  if a.dtype == jnp.bool_:
    u = a.astype(jnp.uint8)
  else:
    u = jax.lax.bitcast_convert_type(a, jnp.uint8) if a.dtype != jnp.uint8 else a
  return u.reshape(lead + (-1,))


def layout_of(tree: Any, lead: int) -> Layout:
  """The layout `pack(tree, lead)` uses (shapes only: arrays or ShapeDtypeStructs)."""
  leaves, treedef = jax.tree.flatten(tree)
  if not leaves:
    raise ValueError("byte_rows: nothing to pack (empty tree)")
  rows = leaves[0].shape[:lead]
  offsets = [0]
  for a in leaves:
    if a.shape[:lead] != rows:
      raise ValueError(f"byte_rows: leaves disagree on the {lead} leading axes: "
                       f"{[x.shape for x in leaves]}")
    offsets.append(offsets[-1] + math.prod(a.shape[lead:]) * jnp.dtype(a.dtype).itemsize)
  return Layout(treedef, tuple(tuple(a.shape[lead:]) for a in leaves),
                tuple(jnp.dtype(a.dtype).name for a in leaves), tuple(offsets))


def pack(tree: Any, lead: int) -> tuple[jax.Array, Layout]:
  """uint8 [*lead_shape, width]: every leaf's bytes per row (leaves share `lead` leading axes)."""
  layout = layout_of(tree, lead)
  leaves = jax.tree.leaves(tree)
  rows = leaves[0].shape[:lead]
  return jnp.concatenate([_as_bytes(a, rows) for a in leaves], axis=-1), layout


def _check_rows(rows: Any, layout: Layout, name: str) -> None:
  if rows.dtype != np.uint8 or rows.shape[-1] != layout.width:
    raise ValueError(f"byte_rows.{name}: expected uint8 rows of width {layout.width}, got "
                     f"{rows.dtype} {rows.shape}")


def _unpack_with(rows: Any, layout: Layout, as_dtype: Any) -> Any:
  """The tree of `layout` from rows [..., width]: each leaf's bytes rows[..., lo:hi] through
  as_dtype(part, dtype, lead + tail) (booleans: != 0)."""
  lead = rows.shape[:-1]
  leaves = []
  for tail, name, lo, hi in zip(layout.tails, layout.dtypes, layout.offsets,
                                layout.offsets[1:]):
    dt = jnp.dtype(name)
    part = rows[..., lo:hi]
    leaves.append(part.reshape(lead + tail) != 0 if dt == jnp.bool_
                  else as_dtype(part, dt, lead + tail))
  return jax.tree.unflatten(layout.treedef, leaves)


def _bitcast(part: jax.Array, dt: Any, shape: tuple[int, ...]) -> jax.Array:
  if dt == jnp.uint8:
    return part.reshape(shape)
  if dt.itemsize == 1:
    return jax.lax.bitcast_convert_type(part.reshape(shape), dt)
  return jax.lax.bitcast_convert_type(part.reshape(shape + (dt.itemsize,)), dt)


def unpack(rows: jax.Array, layout: Layout) -> Any:
  """The tree `pack` made, from rows uint8 [..., width] (any leading shape)."""
  _check_rows(rows, layout, "unpack")
  return _unpack_with(rows, layout, _bitcast)


def unpack_host(rows: np.ndarray, layout: Layout) -> Any:
  """`unpack` on the host: NumPy rows uint8 [..., width] -> the tree of NumPy arrays `pack`
  made: views of rows' bytes (strided, no copy: a session's records can be tens of GB),
  reinterpreted as each leaf's dtype; booleans copied."""
  rows = np.ascontiguousarray(rows)
  _check_rows(rows, layout, "unpack_host")
  # Each leaf's bytes have a contiguous last axis, which NumPy views as another dtype.
  return _unpack_with(rows, layout, lambda part, dt, shape: part.view(dt).reshape(shape))
