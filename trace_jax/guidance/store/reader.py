"""Reads guidance batches for the trainer: validated, checksummed, with optional prefetch.

The reader validates the manifest against its schema (`schema.manifest_problem`), the
trainer's expected config hash and the stored arrays (shapes, dtypes, per-sequence CRC-32s),
and either raises GuidanceError or flags sequences for RTN fallback (`on_missing`); each
problem is counted in `ReaderStats.reasons` under its own reason (docs/reliability.md).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import logging
import os
import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from trace_jax.guidance.record import (
    ROUTING,
    ROUTING_FIELD,
    SCALE_DTYPES,
    SITES,
    STORED_DTYPES,
    Guidance,
    field_dtype,
    mode_fields,
    numpy_dtype,
)
from trace_jax.guidance.schema import (
    FORMAT,
    MANIFEST,
    SCHEMA_VERSION,
    GuidanceError,
    SeqId,
    array_path,
    batch_id_problem,
    manifest_format,
    manifest_problem,
    norm_seq_id,
    seq_checksums,
)
from trace_jax.guidance.store.arrays import spec

log = logging.getLogger(__name__)

ON_MISSING = ("error", "fallback")


@dataclasses.dataclass
class GuidanceBatch:
  """Guidance for a selection of sequences, rows ragged in selection order.

  valid[s] False: sequence s falls back to RTN (it has no rows: seq_offsets[s] == [s + 1]).
  guidance[layer][site] and routing[layer] hold host (numpy) arrays.
  """
  batch_id: str
  seq_ids: list[SeqId]
  seq_offsets: np.ndarray
  valid: np.ndarray
  guidance: dict[int, dict[str, Guidance]]
  routing: dict[int, np.ndarray]
  manifest: dict[str, Any] | None
  problems: list[str]


@dataclasses.dataclass
class ReaderStats:
  """Counters of what the reader did (updated from the prefetch thread too).

  reasons counts problems (one per problem found, whatever the number of sequences) by kind:
  bad_batch_id, missing_root, missing_manifest, bad_manifest (unparsable, wrong format or
  schema), schema_version, config_hash, unknown_sequence, missing_array, corrupt_array (bad
  dtype/shape, undecodable chunk, seq_offsets that disagree), truncated_array,
  checksum_mismatch (rows whose CRC-32 differs from the manifest's), bad_batch (anything else
  that made reading fail).
  """
  batches_read: int = 0
  fallback_batches: int = 0
  fallback_sequences: int = 0
  reasons: Counter = dataclasses.field(default_factory=Counter)


class _Selection:
  """Tracks which selected sequences are still usable; raises or flags on each problem."""

  def __init__(self, reader: GuidanceReader, batch_id: str, seq_ids: list[SeqId]):
    self.reader, self.batch_id, self.seq_ids = reader, batch_id, seq_ids
    self.valid = np.ones(len(seq_ids), bool)
    self.problems: list[str] = []

  def fail(self, reason: str, idx: Sequence[int] | None = None, layer: int | None = None,
           site: str | None = None, kind: str = "invalid") -> None:
    idx = list(range(len(self.seq_ids))) if idx is None else list(idx)
    err = GuidanceError(reason, self.batch_id, layer, site, [self.seq_ids[i] for i in idx])
    if self.reader.on_missing == "error":
      raise err
    self.valid[idx] = False
    self.problems.append(str(err))
    with self.reader._stats_lock:
      self.reader.stats.reasons[kind] += 1
    log.warning("RTN fallback: %s", err)


class GuidanceReader:
  """Reads and validates guidance batches for the trainer, with optional prefetch.

  expected_config_hash: the trainer's `config_hash(...)`; guidance from another policy is bad.
  on_missing: "error" raises GuidanceError; "fallback" flags the affected sequences (RTN),
    logs a warning and counts them in `stats.fallback_sequences` (and the problem in
    `stats.reasons`). Bad data raises nothing else in either mode.
  layers / sites / routing_layers: what the trainer needs (None: whatever the manifest lists).
  """

  def __init__(self, root: str | os.PathLike, expected_config_hash: str,
               on_missing: str = "error", layers: Sequence[int] | None = None,
               sites: Sequence[str] | None = None,
               routing_layers: Sequence[int] | None = None):
    if on_missing not in ON_MISSING:
      raise ValueError(f"on_missing must be one of {ON_MISSING}, got {on_missing!r}")
    bad = [s for s in sites or () if s not in SITES]
    if bad:
      raise ValueError(f"unknown sites {bad}; sites are {SITES}")
    self.root = os.fspath(root)
    self.expected_config_hash = expected_config_hash
    self.on_missing = on_missing
    self.layers = None if layers is None else [int(i) for i in layers]
    self.sites = None if sites is None else list(sites)
    self.routing_layers = None if routing_layers is None else [int(i) for i in routing_layers]
    self.stats = ReaderStats()
    self._stats_lock = threading.Lock()
    self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="guidance-prefetch")
    self._prefetched: dict[tuple, cf.Future] = {}
    self._ctx = ts.Context()

  def complete_batches(self) -> list[str]:
    """Batch ids under root that have a manifest (only these are readable)."""
    if not os.path.isdir(self.root):
      return []
    return sorted(d for d in os.listdir(self.root) if batch_id_problem(d) is None
                  and os.path.isfile(os.path.join(self.root, d, MANIFEST)))

  def prefetch(self, batch_id: str | int, seq_ids: Sequence[SeqId] | None = None) -> cf.Future:
    """Starts reading a batch on the background thread; `get` (or the future) returns it."""
    key = self._key(batch_id, seq_ids)
    if key not in self._prefetched:
      self._prefetched[key] = self._pool.submit(self.read, batch_id, seq_ids)
    return self._prefetched[key]

  def get(self, batch_id: str | int, seq_ids: Sequence[SeqId] | None = None,
          timeout: float | None = None) -> GuidanceBatch:
    """The prefetched batch when there is one for this selection, else a fresh read."""
    fut = self._prefetched.pop(self._key(batch_id, seq_ids), None)
    return fut.result(timeout) if fut is not None else self.read(batch_id, seq_ids)

  def close(self) -> None:
    self._pool.shutdown(wait=True, cancel_futures=True)

  @staticmethod
  def _key(batch_id: str | int, seq_ids: Sequence[SeqId] | None) -> tuple:
    return (str(batch_id), None if seq_ids is None else tuple(norm_seq_id(s) for s in seq_ids))

  def read(self, batch_id: str | int, seq_ids: Sequence[SeqId] | None = None) -> GuidanceBatch:
    """Validates and reads a batch for `seq_ids` (None: all sequences, in stored order).

    Bad data never raises anything but GuidanceError (on_missing="error"); under "fallback"
    it flags sequences (RTN) and counts them, and read returns.
    """
    bid = str(batch_id)
    requested = None if seq_ids is None else [norm_seq_id(s) for s in seq_ids]
    try:
      return self._read(bid, requested)
    except GuidanceError:
      raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError) as e:
      # A safety net: the schema check should leave nothing to fail here.
      log.warning("guidance batch %r: unexpected %s while reading", bid, type(e).__name__,
                  exc_info=True)
      sel = _Selection(self, bid, requested or [])
      try:
        return self._unusable(sel, f"unreadable batch ({type(e).__name__}: {e})", "bad_batch")
      except GuidanceError as err:
        raise err from e

  def _read(self, bid: str, requested: list[SeqId] | None) -> GuidanceBatch:
    manifest = self._manifest(bid, requested)
    if isinstance(manifest, GuidanceBatch):
      return manifest
    stored_ids = list(manifest["seq_ids"])
    sel_ids = stored_ids if requested is None else requested
    sel = _Selection(self, bid, sel_ids)
    where = {s: i for i, s in enumerate(stored_ids)}
    unknown = [j for j, s in enumerate(sel_ids) if s not in where]
    if unknown:
      sel.fail(f"sequence ids not in this batch (it holds {len(stored_ids)})", unknown,
               kind="unknown_sequence")
    idx = np.array([where.get(s, -1) for s in sel_ids], np.int64)
    counts = np.asarray(manifest["token_counts"], np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    self._check_offsets(bid, manifest, offsets, sel)
    paths = self._wanted_arrays(manifest, sel)
    stores = self._open_arrays(bid, manifest, paths, offsets, idx, sel)
    data = self._read_rows(manifest, stores, offsets, idx, sel)
    return self._assemble(bid, manifest, data, offsets, idx, sel)

  def _manifest(self, bid: str, requested: list[SeqId] | None) -> dict | GuidanceBatch:
    """The validated manifest, or (fallback) an all-RTN batch when the batch is unusable."""
    sel = _Selection(self, bid, requested or [])
    problem = batch_id_problem(bid)
    if problem:  # never joined to the root: "../x" must not reach the file system
      return self._unusable(sel, problem, "bad_batch_id")
    if not os.path.isdir(self.root):
      return self._unusable(sel, f"guidance root {self.root} does not exist (no batch was "
                            "written there, or it was deleted or is not mounted)", "missing_root")
    path = os.path.join(self.root, bid, MANIFEST)
    try:
      with open(path) as f:
        manifest = json.load(f)
    except FileNotFoundError:
      return self._unusable(sel, "incomplete batch: no manifest.json (writer crashed or still "
                            f"writing); refusing to read {os.path.dirname(path)}",
                            "missing_manifest")
    except (OSError, ValueError, RecursionError) as e:
      return self._unusable(sel, f"unreadable manifest.json: {e}", "bad_manifest")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
      return self._unusable(sel, f"manifest.json is not a {FORMAT} manifest", "bad_manifest")
    if manifest.get("schema_version") != SCHEMA_VERSION:
      return self._unusable(sel, f"schema version {manifest.get('schema_version')!r}, this "
                            f"reader reads {SCHEMA_VERSION}", "schema_version")
    if manifest.get("config_hash") != self.expected_config_hash:
      return self._unusable(sel, f"config hash {manifest.get('config_hash')!r} of the writing "
                            f"policy != trainer's expected {self.expected_config_hash!r} "
                            "(guidance from another precision policy or model config)",
                            "config_hash")
    problem = manifest_problem(manifest)
    if problem:
      return self._unusable(sel, f"bad manifest.json: {problem}", "bad_manifest")
    return manifest

  def _unusable(self, sel: _Selection, reason: str, kind: str) -> GuidanceBatch:
    sel.fail(reason, kind=kind)
    self._count(sel, batch_failed=True)
    n = len(sel.seq_ids)
    return GuidanceBatch(sel.batch_id, sel.seq_ids, np.zeros(n + 1, np.int64),
                         np.zeros(n, bool), {}, {}, None, sel.problems)

  def _count(self, sel: _Selection, batch_failed: bool = False) -> None:
    with self._stats_lock:
      self.stats.batches_read += 1
      self.stats.fallback_sequences += int((~sel.valid).sum())
      self.stats.fallback_batches += int(batch_failed or not sel.valid.all())

  def _check_offsets(self, bid: str, manifest: dict, offsets: np.ndarray,
                     sel: _Selection) -> None:
    try:
      t = ts.open(spec(os.path.join(self.root, bid, "seq_offsets")), open=True,
                  context=self._ctx).result()
      stored = t.read().result()
    except Exception as e:  # TensorStore reports I/O and decode errors as ValueError
      sel.fail(f"seq_offsets array unreadable: {e}", kind="missing_array")
      return
    if stored.dtype != np.int64 or not np.array_equal(stored, offsets):
      sel.fail("seq_offsets array disagrees with the manifest's token counts",
               kind="corrupt_array")

  def _wanted_arrays(self, manifest: dict, sel: _Selection) -> dict[str, tuple[int, str]]:
    """Array paths the trainer needs -> (layer, site); flags (layer, site)s the batch lacks."""
    fields = mode_fields(manifest["mode"], manifest_format(manifest))
    layers = manifest["layers"] if self.layers is None else self.layers
    sites = manifest["sites"] if self.sites is None else self.sites
    rlayers = manifest["routing_layers"] if self.routing_layers is None else self.routing_layers
    wanted = [(layer, site, f) for layer in layers for site in sites for f in fields]
    wanted += [(layer, ROUTING, ROUTING_FIELD) for layer in rlayers]
    out = {}
    for layer, site, field in wanted:
      path = array_path(layer, site, field)
      if path not in manifest["arrays"]:
        sel.fail(f"{field} not recorded in this batch", layer=layer, site=site,
                 kind="missing_array")
      else:
        out[path] = (layer, site)
    return out

  def _open_arrays(self, bid: str, manifest: dict, paths: dict[str, tuple[int, str]],
                   offsets: np.ndarray, idx: np.ndarray, sel: _Selection) -> dict[str, Any]:
    """Opens arrays concurrently; checks dtype and shape against the manifest and schema."""
    futs = {p: ts.open(spec(os.path.join(self.root, bid, p)), open=True, context=self._ctx)
            for p in paths}
    stores = {}
    for path, fut in futs.items():
      layer, site = paths[path]
      field = path.rsplit("/", 1)[1]
      entry = manifest["arrays"][path]
      try:
        t = fut.result()
      except Exception as e:  # TensorStore reports I/O and decode errors as ValueError
        sel.fail(f"array {path} missing or unopenable: {e}", layer=layer, site=site,
                 kind="missing_array")
        continue
      want_shape = tuple(entry["shape"])
      logical = field_dtype(field, manifest_format(manifest))
      if (entry.get("dtype") != logical or t.dtype.name != STORED_DTYPES[field]
          or want_shape[0] != manifest["num_tokens"]):
        sel.fail(f"array {path} has dtype {t.dtype.name} (manifest {entry.get('dtype')}/"
                 f"{entry.get('stored_dtype')}, schema {logical})", layer=layer,
                 site=site, kind="corrupt_array")
        continue
      if tuple(t.shape) != want_shape:
        if tuple(t.shape[1:]) == want_shape[1:] and t.shape[0] < want_shape[0]:
          cut = [j for j, i in enumerate(idx)
                 if i >= 0 and offsets[i + 1] > max(t.shape[0], offsets[i])]
          if cut:
            sel.fail(f"array {path} truncated to {t.shape[0]} of {want_shape[0]} token rows",
                     cut, layer=layer, site=site, kind="truncated_array")
        else:
          sel.fail(f"array {path} has shape {tuple(t.shape)}, manifest says {want_shape}",
                   layer=layer, site=site, kind="corrupt_array")
          continue
      stores[path] = (t, layer, site)
    return stores

  def _read_rows(self, manifest: dict, stores: dict[str, Any], offsets: np.ndarray,
                 idx: np.ndarray, sel: _Selection
                 ) -> dict[str, list[tuple[list[int], np.ndarray]]]:
    """Reads the token ranges of still-valid sequences, merging adjacent ones into runs, and
    checks each sequence's rows against its CRC-32 in the manifest."""
    runs: list[list] = []  # [selection positions, start row, stop row]
    for j in np.flatnonzero(sel.valid):
      lo, hi = int(offsets[idx[j]]), int(offsets[idx[j] + 1])
      if runs and runs[-1][2] == lo:
        runs[-1][0].append(int(j))
        runs[-1][2] = hi
      else:
        runs.append([[int(j)], lo, hi])
    futs = {p: [(js, lo, hi, t[lo:hi].read()) for js, lo, hi in runs]
            for p, (t, _, _) in stores.items()}
    data: dict[str, list[tuple[list[int], np.ndarray]]] = {}
    for path, parts in futs.items():
      t, layer, site = stores[path]
      want = np.frombuffer(bytes.fromhex(manifest["arrays"][path]["seq_crc32"]), ">u4")
      data[path] = []

      def verify(js: list[int], a: np.ndarray, path=path, want=want, layer=layer,
                 site=site) -> None:
        bounds = [offsets[idx[js[0]]]] + [offsets[idx[j] + 1] for j in js]
        got = seq_checksums(a, bounds, start=int(bounds[0]))
        bad = [j for j, c in zip(js, got, strict=True) if c != want[idx[j]]]
        if bad:
          sel.fail(f"array {path}: rows differ from what was written (CRC-32 mismatch: a "
                   "chunk from another batch, or data changed after the manifest)", bad,
                   layer=layer, site=site, kind="checksum_mismatch")

      for js, lo, hi, fut in parts:
        try:
          a = fut.result()
        except Exception:  # TensorStore reports I/O and decode errors as ValueError
          pass
        else:
          verify(js, a)
          data[path].append((js, a))
          continue
        for j in js:  # narrow a failed run down to the sequences whose rows are bad
          lo, hi = int(offsets[idx[j]]), int(offsets[idx[j] + 1])
          try:
            a = t[lo:hi].read().result()
          except Exception as e:
            sel.fail(f"array {path} rows [{lo}, {hi}) unreadable (corrupt or lost chunk): {e}",
                     [j], layer=layer, site=site, kind="corrupt_array")
            continue
          verify([j], a)
          data[path].append(([j], a))
    return data

  def _assemble(self, bid: str, manifest: dict, data: dict, offsets: np.ndarray,
                idx: np.ndarray, sel: _Selection) -> GuidanceBatch:
    """Concatenates the valid sequences' rows into Guidance records and routing ids."""
    lengths = np.where(sel.valid, offsets[idx + 1] - offsets[idx], 0)
    out_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    fmt = manifest_format(manifest)
    arrays: dict[str, np.ndarray] = {}
    for path, parts in data.items():
      pieces = []
      for js, a in parts:
        starts = np.concatenate([[0], np.cumsum([offsets[idx[j] + 1] - offsets[idx[j]]
                                                 for j in js])])
        pieces += [a[starts[n]:starts[n + 1]] for n, j in enumerate(js) if sel.valid[j]]
      a = np.concatenate(pieces) if pieces else None
      if a is None:
        shape = (0,) + tuple(manifest["arrays"][path]["shape"][1:])
        a = np.zeros(shape, STORED_DTYPES[path.rsplit("/", 1)[1]])
      arrays[path] = a
    guidance, routing = records_by_path(arrays, manifest["mode"], fmt)
    self._count(sel)
    return GuidanceBatch(bid, sel.seq_ids, out_offsets, sel.valid.copy(), guidance, routing,
                         manifest, sel.problems)


def records_by_path(arrays: dict[str, np.ndarray], mode: str, fmt: str
                    ) -> tuple[dict[int, dict[str, Guidance]], dict[int, np.ndarray]]:
  """A batch's arrays by store path (`array_path`) as Guidance records (block scales viewed as
  the format's float8; a site whose mode fields are not all there is left out) and routing
  ids."""
  scale_dtype = numpy_dtype(SCALE_DTYPES[fmt])
  arrays = {p: a.view(scale_dtype) if p.endswith("/block_scale") else a
            for p, a in arrays.items()}
  guidance: dict[int, dict[str, Guidance]] = {}
  routing: dict[int, np.ndarray] = {}
  names = mode_fields(mode, fmt)
  for path, a in arrays.items():
    layer_s, site, field = path.split("/")
    layer = int(layer_s.removeprefix("layer_"))
    if site == ROUTING:
      routing[layer] = a
    elif field == names[0]:
      fields = {f: arrays.get(array_path(layer, site, f)) for f in names}
      if all(v is not None for v in fields.values()):
        guidance.setdefault(layer, {})[site] = Guidance(**fields)
  return guidance, routing
