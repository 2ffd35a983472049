"""`GuidanceStore`: the one owner of a guidance root's batches (docs/design.md §5).

It names batches (`b000123`, continuing after those on disk), writes a rollout batch with its
audit batch, returns one `GuidanceHandle` per sequence, reads the records of a list of handles
in their order, deletes batches, removes batches a killed write left without a manifest, and
closes its writer and reader.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import re
import shutil
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from trace_jax.guidance.handle import GuidanceHandle
from trace_jax.guidance.record import Guidance
from trace_jax.guidance.schema import MANIFEST, SeqId, batch_id_problem
from trace_jax.guidance.store.arrays import StoreOptions
from trace_jax.guidance.store.reader import GuidanceBatch, GuidanceReader, ReaderStats
from trace_jax.guidance.store.writer import GuidanceWriter

log = logging.getLogger(__name__)

AUDIT_SUFFIX = ".audit"
_ROLLOUT_BATCH = re.compile(r"b(\d{6,})")


def batch_name(index: int) -> str:
  """The id of a rollout's `index`-th batch ("b000123"); its audit batch adds AUDIT_SUFFIX."""
  return f"b{int(index):06d}"


def rollout_handles(batch_id: str, n: int, n_audit: int = 0, store: str | None = None,
                    guidance_bytes_per_token: float | None = None) -> list[GuidanceHandle]:
  """The handles of a rollout batch of n sequences, the first n_audit of them audited."""
  audit = f"{batch_id}{AUDIT_SUFFIX}" if n_audit else None
  return [GuidanceHandle(batch_id=batch_id, seq_id=f"{batch_id}-{i}", store=store,
                         audit_batch_id=audit if i < n_audit else None,
                         guidance_bytes_per_token=guidance_bytes_per_token) for i in range(n)]


def _merge(parts: list[GuidanceBatch]) -> GuidanceBatch:
  """Batches read for consecutive groups of samples, as one batch in sample order."""
  if len(parts) == 1:
    return parts[0]
  cat = lambda *a: np.concatenate(a, axis=0)
  first = parts[0]
  return dataclasses.replace(
      first, batch_id="+".join(p.batch_id for p in parts),
      seq_ids=[i for p in parts for i in p.seq_ids],
      seq_offsets=np.concatenate([[0], np.cumsum(np.concatenate(
          [np.diff(p.seq_offsets) for p in parts]))]).astype(np.int64),
      valid=np.concatenate([p.valid for p in parts]),
      guidance={layer: {site: jax.tree.map(cat, *[p.guidance[layer][site] for p in parts])
                        for site in first.guidance[layer]} for layer in first.guidance},
      routing={layer: cat(*[p.routing[layer] for p in parts]) for layer in first.routing},
      problems=[q for p in parts for q in p.problems])


def read_handles(handles: Sequence[GuidanceHandle], audit: bool,
                 read: Callable[[str, list[SeqId]], GuidanceBatch]) -> GuidanceBatch:
  """The records of `handles`' sequences in their order: `read(batch_id, seq_ids)` of each
  batch holding some, merged; audit=True: their audit batches (every handle must have one)."""
  groups: dict[str, list[SeqId]] = {}
  for h in handles:
    bid = h.audit_batch_id if audit else h.batch_id
    if bid is None:
      raise ValueError(f"sequence {h.seq_id!r} has no audit record")
    groups.setdefault(bid, []).append(h.seq_id)
  return _merge([read(bid, ids) for bid, ids in groups.items()])


class GuidanceStore:
  """The one owner of a guidance root's batch lifecycle: batch ids, a rollout batch's writes,
  reads for samples, deletion, close.

  A rollout batch is one store batch holding the training record (the policy's guidance mode,
  its guided layers) and every recorded layer's routing for all sequences, plus an audit batch
  `<id>.audit` with full codes of its first audited sequences. Ids continue after the highest
  one under the root, so a restarted engine or server never overwrites a batch it did not
  write in this process (unless `overwrite`, for a run that owns its root).
  """

  def __init__(self, root: str | os.PathLike, config_hash: str, *,
               options: StoreOptions | None = None, on_missing: str = "error",
               overwrite: bool = False):
    self.root = os.path.abspath(os.fspath(root))
    self.config_hash = config_hash
    self.writer = GuidanceWriter(self.root, config_hash, options, overwrite=overwrite)
    self.reader = GuidanceReader(self.root, config_hash, on_missing=on_missing)
    known = [int(n[1:]) for n in self.batches()]
    self._ids = itertools.count(max(known) + 1 if known else 0)
    self._lock = threading.Lock()
    self._writing = threading.Lock()  # held while a rollout queues its writes

  @property
  def stats(self) -> ReaderStats:
    return self.reader.stats

  def batches(self) -> list[str]:
    """Rollout batch ids under the root once pending writes finish (audit batches not
    listed)."""
    self.writer.flush()
    if not os.path.isdir(self.root):
      return []
    return sorted(n for n in os.listdir(self.root) if _ROLLOUT_BATCH.fullmatch(n)
                  and os.path.isdir(os.path.join(self.root, n)))

  def new_batch_id(self) -> str:
    with self._lock:
      return batch_name(next(self._ids))

  def write_rollout(self, counts: Sequence[int], guidance: Mapping[int, Mapping[str, Guidance]],
                    routing: Mapping[int, Any], audit: Mapping[int, Mapping[str, Guidance]]
                    | None = None, n_audit: int = 0) -> list[GuidanceHandle]:
    """Queues one rollout batch of len(counts) sequences (records: ragged rows, sequence after
    sequence) and returns their handles; `audit` holds the full codes of the first n_audit."""
    bid = self.new_batch_id()
    handles = rollout_handles(bid, len(counts), n_audit, self.root)
    seq_ids = [h.seq_id for h in handles]
    with self._writing:
      write = self.writer.write_batch(bid, seq_ids, counts, guidance, routing)
      if n_audit:
        self.writer.write_batch(handles[0].audit_batch_id, seq_ids[:n_audit],
                                counts[:n_audit], audit or {})
    per_token = write.stats.get("guidance_bytes_per_token")
    return [dataclasses.replace(h, guidance_bytes_per_token=per_token) for h in handles]

  def read(self, handles: Sequence[GuidanceHandle], audit: bool = False) -> GuidanceBatch:
    """The records of `handles`' sequences, rows in their order, from however many batches
    hold them; audit=True reads their full codes (every handle must be audited). Waits for
    pending writes first."""
    self.writer.flush()
    return read_handles(handles, audit, self.reader.read)

  def delete(self, batch_ids: Sequence[str]) -> None:
    """Removes rollout batches and their audit batches (records read, or never needed)."""
    self.writer.flush()
    for bid in dict.fromkeys(batch_ids):
      problem = batch_id_problem(bid)
      if problem:
        raise ValueError(problem)
      for name in (bid, f"{bid}{AUDIT_SUFFIX}"):
        shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)

  def remove_incomplete(self) -> list[str]:
    """Deletes every batch directory under the root that has no manifest and returns their
    ids, sorted: batches whose write was killed before its manifest (docs/reliability.md,
    "Guidance store": manifest last), which no reader reads. Left alone: batches with a
    manifest, batches this store is writing now, files, symlinks, and directories whose name
    is not a batch id (`schema.batch_id_problem`). Logs one line when it removed any.

    Writes through `self.writer` directly (not `write_rollout`) must not start meanwhile."""
    removed = []
    with self._writing:
      busy = self.writer.in_flight()
      names = sorted(os.listdir(self.root)) if os.path.isdir(self.root) else []
      for name in names:
        path = os.path.join(self.root, name)
        if (batch_id_problem(name) is None and name not in busy and not os.path.islink(path)
            and os.path.isdir(path) and not os.path.lexists(os.path.join(path, MANIFEST))):
          shutil.rmtree(path)
          removed.append(name)
    if removed:
      log.warning("removed %d incomplete guidance batches (no %s) under %s: %s", len(removed),
                  MANIFEST, self.root, ", ".join(removed))
    return removed

  def flush(self) -> None:
    self.writer.flush()

  def close(self) -> None:
    """Waits for pending writes, then stops the writer and reader threads."""
    try:
      self.writer.close()
    finally:
      self.reader.close()

  def __enter__(self) -> GuidanceStore:
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()
