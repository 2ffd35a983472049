"""A session's records kept on the host, turn by turn, and laid out as one rollout batch.

Each session turn's program returns the records of what it fed (the chunk: the pending token,
then e.g. an environment's observation) and of its decode steps as byte rows (`byte_rows`);
the engine moves them to pinned host memory as the turn ends (`guidance.layout.
start_host_copy`), so the device holds one turn's records at a time, not buffers of the whole
session's length beside its KV cache. When the session closes, `ragged` lays every row's
records out in transcript order, sequence after sequence, as `guidance.layout.ragged_rows`
does for one generate call, and unpacks them on the host, bit for bit.

Row r's records of one turn: its chunk's rows chunk[r, :fed[r]] (the tokens fed at lens[r],
lens[r] + 1, ...), then the decode steps' rows steps[r, 1:n_gen[r]] (step s fed the token
sampled at step s - 1; the last sampled token waits for the next turn's chunk).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from trace_jax.guidance import byte_rows


@dataclasses.dataclass(frozen=True)
class Turn:
  """One turn's records as the program returned them (device arrays, or their host copies):
  chunk uint8 [B, C, W], steps uint8 [B, S, W] or None (a closing feed); fed int [B]: tokens
  each row fed; n_gen int [B]: tokens each row sampled (None: none)."""
  chunk: Any
  steps: Any
  fed: np.ndarray
  n_gen: np.ndarray | None = None


def ragged(turns: Sequence[Turn], counts: Sequence[int], layout: byte_rows.Layout) -> Any:
  """The records of rows 0..len(counts)-1 over `turns`, sequence after sequence, each in
  transcript order: a tree of host arrays with sum(counts) leading rows (`layout`'s tree).
  counts[r]: row r's record rows, checked against what the turns hold."""
  host = [(np.asarray(t.chunk), None if t.steps is None else np.asarray(t.steps))
          for t in turns]
  parts = []
  for r, want in enumerate(counts):
    mine = []
    for t, (chunk, steps) in zip(turns, host):
      mine.append(chunk[r, :int(t.fed[r])])
      if steps is not None and t.n_gen is not None:
        mine.append(steps[r, 1:int(t.n_gen[r])])
    parts += mine
    got = sum(len(p) for p in mine)  # the rows the arrays hold, not what the counts claim
    if got != want:
      raise AssertionError(f"session records: row {r} holds {got} rows, its length is {want}")
  rows = (np.concatenate(parts, axis=0) if parts
          else np.zeros((0, layout.width), np.uint8))
  return byte_rows.unpack_host(rows, layout)
