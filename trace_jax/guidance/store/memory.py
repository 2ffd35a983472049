"""`MemoryGuidanceStore`: a rollout's records handed to a trainer in the same process.

It answers the calls the engine and the RL loop make of `GuidanceStore` (`write_rollout`,
`read`, `delete`, `flush`, `close`) with the same checks on what is written (the writer's
`_check_request` and `_collect`) and the same `GuidanceBatch`es read back, without the disk
round trip: no zarr chunks, no zstd, no per-sequence CRC-32 (nothing leaves the process, so
nothing can be corrupted between write and read). Device arrays are copied to the host on one
worker thread, as the disk writer does, so the engine's next batch decodes meanwhile.

A run whose records must outlive the step (`rl.keep_guidance`), or whose rollout is another
process (an HTTP server writing to `--guidance_dir`), uses the disk store.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import itertools
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from trace_jax.guidance.handle import GuidanceHandle
from trace_jax.guidance.record import Guidance
from trace_jax.guidance.schema import GuidanceError, SeqId
from trace_jax.guidance.store.reader import GuidanceBatch, ReaderStats, records_by_path
from trace_jax.guidance.store.store import AUDIT_SUFFIX, batch_name, read_handles, rollout_handles
from trace_jax.guidance.store.writer import _check_request, _collect


@dataclasses.dataclass
class _Batch:
  """One written batch: its sequences and, once copied, its arrays by store path."""
  seq_ids: list[SeqId]
  offsets: np.ndarray
  mode: str
  fp4_format: str
  arrays: cf.Future  # -> {path: host array, rows cut to the batch's tokens}


class MemoryGuidanceStore:
  """`GuidanceStore`'s calls over host memory (module docstring). `root` is None: handles
  name no store directory."""

  root = None

  def __init__(self, config_hash: str):
    self.config_hash = config_hash
    self.stats = ReaderStats()
    self._batches: dict[str, _Batch] = {}
    self._ids = itertools.count()
    self._lock = threading.Lock()
    self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="guidance-memory")

  def write_rollout(self, counts: Sequence[int], guidance: Mapping[int, Mapping[str, Guidance]],
                    routing: Mapping[int, Any], audit: Mapping[int, Mapping[str, Guidance]]
                    | None = None, n_audit: int = 0) -> list[GuidanceHandle]:
    """Keeps one rollout batch (and the full codes of its first n_audit sequences) and returns
    their handles, as `GuidanceStore.write_rollout` does."""
    with self._lock:
      bid = batch_name(next(self._ids))
    handles = rollout_handles(bid, len(counts), n_audit)
    seq_ids = [h.seq_id for h in handles]
    stats = self._put(bid, seq_ids, counts, guidance, routing)
    if n_audit:
      self._put(handles[0].audit_batch_id, seq_ids[:n_audit], list(counts)[:n_audit],
                audit or {}, {})
    per_token = stats.get("guidance_bytes_per_token")
    return [dataclasses.replace(h, guidance_bytes_per_token=per_token) for h in handles]

  def _put(self, bid: str, seq_ids: Sequence[SeqId], counts: Sequence[int],
           guidance: Mapping[int, Mapping[str, Guidance]], routing: Mapping[int, Any]
           ) -> dict[str, Any]:
    seq_ids, counts = _check_request(bid, seq_ids, counts, guidance, routing)
    tokens = sum(counts)
    arrays, _, stats = _collect(bid, tokens, guidance, routing)
    # NumPy inputs are copied now (the caller may reuse them); device arrays on the worker.
    arrays = {p: (a.copy() if isinstance(a, np.ndarray) else a) for p, a in arrays.items()}
    host = lambda: {p: _read_only(np.asarray(jax.device_get(a))[:tokens])
                    for p, a in arrays.items()}
    offsets = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)
    with self._lock:
      self._batches[bid] = _Batch(seq_ids, offsets, stats["mode"], stats["fp4_format"],
                                  self._pool.submit(host))
    return stats

  def read(self, handles: Sequence[GuidanceHandle], audit: bool = False) -> GuidanceBatch:
    """The records of `handles`' sequences, rows in their order (audit=True: their full
    codes); waits for their copies to the host. A whole batch read in its order shares the
    store's arrays, which are read-only."""
    return read_handles(handles, audit, self._read)

  def _read(self, bid: str, seq_ids: list[SeqId]) -> GuidanceBatch:
    with self._lock:
      batch = self._batches.get(bid)
    if batch is None:
      raise GuidanceError("not in memory (deleted, or written by another store)", bid,
                          seq_ids=seq_ids)
    where = {s: i for i, s in enumerate(batch.seq_ids)}
    unknown = [s for s in seq_ids if s not in where]
    if unknown:
      raise GuidanceError("no such sequences in this batch", bid, seq_ids=unknown)
    idx = np.array([where[s] for s in seq_ids], np.int64)
    lo, hi = batch.offsets[idx], batch.offsets[idx + 1]
    whole = len(idx) == len(batch.seq_ids) and np.array_equal(idx, np.arange(len(idx)))
    rows = None if whole else np.concatenate(
        [np.arange(a, b) for a, b in zip(lo, hi)] + [np.zeros(0, np.int64)])
    arrays = {p: (a if rows is None else a[rows]) for p, a in batch.arrays.result().items()}
    offsets = np.concatenate([[0], np.cumsum(hi - lo)]).astype(np.int64)
    with self._lock:
      self.stats.batches_read += 1
    return GuidanceBatch(bid, list(seq_ids), offsets, np.ones(len(idx), bool),
                         *records_by_path(arrays, batch.mode, batch.fp4_format), None, [])

  def delete(self, batch_ids: Sequence[str]) -> None:
    """Drops rollout batches and their audit batches."""
    with self._lock:
      for bid in batch_ids:
        self._batches.pop(bid, None)
        self._batches.pop(f"{bid}{AUDIT_SUFFIX}", None)

  def batches(self) -> list[str]:
    """Rollout batch ids held (audit batches not listed)."""
    with self._lock:
      return sorted(b for b in self._batches if not b.endswith(AUDIT_SUFFIX))

  def remove_incomplete(self) -> list[str]:
    """Nothing is ever half-written in memory."""
    return []

  def flush(self) -> None:
    """Waits for every batch's copy to the host."""
    with self._lock:
      futures = [b.arrays for b in self._batches.values()]
    cf.wait(futures)

  def close(self) -> None:
    self.flush()
    self._pool.shutdown(wait=True)


def _read_only(a: np.ndarray) -> np.ndarray:
  a.flags.writeable = False
  return a
