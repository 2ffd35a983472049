"""Guidance rows between the rollout's ragged layout and the trainer's padded batch.

The rollout engine and the guidance store hold a batch's guidance as ragged rows: the tokens
of every sequence, one sequence after another (`counts[i]` rows for sequence i, the positions
its training forward will see: prompt + completion[:-1]). The training forward wants
[B, S, ...] with padding. Padding rows get benign values (scale 1, code 0, routing 0..K-1), so
they never produce NaN that attention could carry into real rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.guidance.record import SCALE_DTYPES, SCALE_ONE, Guidance, numpy_dtype


def _pad(a: np.ndarray, counts: Sequence[int], seq_len: int, fill: Any) -> np.ndarray:
  out = np.empty((len(counts), seq_len) + a.shape[1:], a.dtype)
  out[...] = fill
  start = 0
  for i, c in enumerate(counts):
    if c > seq_len:
      raise ValueError(f"sequence {i} has {c} guidance rows, more than the padded length "
                       f"{seq_len}")
    out[i, :c] = a[start:start + c]
    start += c
  if start != a.shape[0]:
    raise ValueError(f"guidance has {a.shape[0]} rows, but the counts add up to {start}")
  return out


def pad_guidance(g: Guidance, counts: Sequence[int], seq_len: int) -> Guidance:
  """Ragged Guidance rows [T, ...] -> padded [B, seq_len, ...]."""
  fmt = g.format
  bs = np.asarray(g.block_scale).view(np.uint8)
  fields = {
      "block_scale": _pad(bs, counts, seq_len, np.uint8(SCALE_ONE[fmt])).view(
          numpy_dtype(SCALE_DTYPES[fmt])),
      "row_scale": None if g.row_scale is None else _pad(np.asarray(g.row_scale), counts,
                                                         seq_len, np.float32(1.0)),
      "mantissa": None if g.mantissa is None else _pad(np.asarray(g.mantissa), counts,
                                                       seq_len, 0),
      "codes": None if g.codes is None else _pad(np.asarray(g.codes), counts, seq_len, 0),
  }
  return Guidance(**{k: None if v is None else jnp.asarray(v) for k, v in fields.items()})


def pad_routing(ids: np.ndarray, counts: Sequence[int], seq_len: int) -> jnp.ndarray:
  """Ragged routing ids [T, K] -> [B, seq_len, K]; padding rows route to experts 0..K-1."""
  ids = np.asarray(ids)
  out = _pad(ids, counts, seq_len, 0)
  for i, c in enumerate(counts):
    out[i, c:] = np.arange(ids.shape[-1])
  return jnp.asarray(out, jnp.int32)


def pad_tree(guidance: Mapping[int, Mapping[str, Guidance]], counts: Sequence[int],
             seq_len: int) -> dict[int, dict[str, Guidance]]:
  return {int(layer): {site: pad_guidance(g, counts, seq_len) for site, g in sites.items()}
          for layer, sites in guidance.items()}


def pad_records(guidance: Mapping[int, Mapping[str, Guidance]] | None,
                routing: Mapping[int, Any] | None, counts: Sequence[int], seq_len: int
                ) -> tuple[dict[int, dict[str, Guidance]] | None, dict[int, jax.Array] | None]:
  """A batch's ragged guidance and routing trees padded to [B, seq_len, ...] (None or empty:
  None)."""
  return (pad_tree(guidance, counts, seq_len) if guidance else None,
          {int(k): pad_routing(v, counts, seq_len) for k, v in routing.items()}
          if routing else None)


def unpad(tree: Any, counts: Sequence[int]) -> Any:
  """Padded [B, S, ...] -> ragged rows [sum(counts), ...] (numpy), for an array or a pytree
  of them (a Guidance record); the first len(counts) sequences."""
  def one(a):
    a = np.asarray(a)
    return np.concatenate([a[i, :c] for i, c in enumerate(counts)], axis=0)
  return jax.tree.map(one, tree)


@jax.jit
def ragged_rows(tree: Any, counts: jax.Array) -> Any:
  """`unpad` on the device, for the whole batch at once: padded [B, S, ...] leaves ->
  [B * S, ...] whose first sum(counts) rows are sequence 0's first counts[0] rows, then
  sequence 1's, ... (the rows after them: padding). counts: int32 [B] (0 for unused rows).

  The host then takes each record's leading rows as they are, instead of concatenating B
  slices of every record (at batch 64 that cost the H200's host more time per call than
  fp4_trace's recording on the GPU; the git history of docs/benchmarks.md)."""
  b, s = jax.tree.leaves(tree)[0].shape[:2]
  ends = jnp.cumsum(counts)
  j = jnp.arange(b * s, dtype=ends.dtype)
  seq = jnp.minimum(jnp.searchsorted(ends, j, side="right"), b - 1)
  within = jnp.clip(j - (ends[seq] - counts[seq]), 0, s - 1)
  return jax.tree.map(lambda a: a[seq, within], tree)


def start_host_copy(tree: Any) -> Any:
  """The tree's device arrays moved to pinned host memory, returned at once: the copy runs on
  the device's streams after the computation that makes them, and no Python thread holds the
  GIL for it. `np.asarray` of a result waits for its copy (GIL released) and aliases it. Arrays
  on a device without pinned host memory stay where they are.

  Why not `jax.device_get` on a background thread: it copies into pageable NumPy memory
  through a staging buffer and holds the GIL for each array's `copy_to_host_async`; on the
  H200 a batch's 0.09 GB of fp4_trace records held the engine's caller back 15-18 ms after
  every generate call, the whole of that thread's transfer. The call is not free either (on
  the H200, 8-10 ms of the caller's time for 0.12 GB of records, 115 ms for 0.37 GB at 24
  layers), but made on the records thread it held the caller's next generate call back
  further (fp4_trace 0.783x fp4_rtn against 0.938x at batch 64; the git history of
  docs/benchmarks.md)."""
  def target(a: jax.Array) -> Any:
    kinds = {m.kind for d in a.sharding.device_set for m in d.addressable_memories()}
    return a.sharding.with_memory_kind("pinned_host") if "pinned_host" in kinds else a.sharding
  return jax.device_put(tree, jax.tree.map(target, tree))
