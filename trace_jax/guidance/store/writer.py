"""Writes rollout batches' guidance to the store asynchronously (manifest last).

Writes run on a background thread (TensorStore futures inside), so rollout generation only pays
for shape checks and a host snapshot. A batch's arrays are written first, then its manifest,
atomically (tmp + rename): a batch without a manifest is incomplete (writer crashed or still
writing) and is never read.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import datetime
import logging
import os
import shutil
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from trace_jax.guidance.record import (
    DEFAULT_FORMAT,
    ROUTING,
    ROUTING_FIELD,
    SITES,
    STORED_DTYPES,
    Guidance,
    bytes_per_row,
    field_dtype,
    field_shapes,
    mode_fields,
)
from trace_jax.guidance.schema import (
    CHECKSUM,
    FORMAT,
    MANIFEST,
    SCHEMA_VERSION,
    GuidanceError,
    SeqId,
    array_path,
    batch_id_problem,
    crc_hex,
    is_int,
    norm_seq_id,
    seq_checksums,
)
from trace_jax.guidance.store.arrays import (
    StoreOptions,
    chunk_bytes,
    spec,
    to_host,
    write_group,
    write_json_atomic,
    zarr_metadata,
)

log = logging.getLogger(__name__)

# Byte stats that are not byte counts (left out of the manifest's `bytes`).
NOT_BYTES = ("batch_id", "num_seqs", "num_tokens", "mode")


def _rows_of(a: Any, tokens: int) -> tuple[int]:
  """a's leading (row) extent as the batch sees it: a device array's rows past `tokens` are
  padding (`GuidanceWriter.write_batch`)."""
  n = int(a.shape[0]) if a.ndim else 0
  return (tokens,) if isinstance(a, jax.Array) and n >= tokens else (n,)


def _per_token(n: float, tokens: int) -> float | None:
  return n / tokens if tokens else None


def _check_request(bid: str, seq_ids: Sequence[SeqId], token_counts: Sequence[int],
                   guidance: Mapping[int, Any], routing: Mapping[int, Any]
                   ) -> tuple[list[SeqId], list[int]]:
  """The batch's sequence ids and token counts, checked (ValueError naming the problem)."""
  problem = batch_id_problem(bid)
  if problem:
    raise ValueError(problem)
  seq_ids = [norm_seq_id(s) for s in seq_ids]
  token_counts = list(token_counts)
  bad = [c for c in token_counts if not is_int(c)]
  if bad:
    raise ValueError(f"batch {bid!r}: token counts must be integers, got {bad[:4]!r}")
  counts = [int(c) for c in token_counts]
  if len(seq_ids) != len(counts):
    raise ValueError(f"batch {bid!r}: {len(seq_ids)} seq ids but {len(counts)} token counts")
  if len(set(seq_ids)) != len(seq_ids):
    dup = sorted({str(s) for s, n in Counter(seq_ids).items() if n > 1})
    raise ValueError(f"batch {bid!r}: duplicate sequence ids {dup}")
  if any(c < 0 for c in counts):
    raise ValueError(f"batch {bid!r}: negative token counts {counts}")
  for what, layers in (("guidance", guidance), ("routing", routing)):
    bad = [layer for layer in layers if not is_int(layer) or layer < 0]
    if bad:
      raise ValueError(f"batch {bid!r}: {what} layers must be non-negative integers, got "
                       f"{bad!r}")
  return seq_ids, counts


def _one_of(bid: str, what: str, values: set[str], default: str) -> str:
  """The one mode (or FP4 format) every record of a batch has."""
  if len(values) > 1:
    raise ValueError(f"batch {bid!r}: mixed {what} {sorted(values)}")
  return values.pop() if values else default


def _site_arrays(where: str, g: Guidance, tokens: int, mode: str, fmt: str,
                 arrays: dict[str, Any], info: dict[str, dict[str, Any]], layer: int,
                 site: str) -> tuple[int, int]:
  """Checks one site's record and adds its arrays and manifest entries; returns (rows, k)."""
  if site not in SITES:
    raise ValueError(f"{where}: unknown site; sites are {SITES}")
  if (g.mantissa is None) == (g.codes is None):
    raise ValueError(f"{where}: exactly one of mantissa or codes must be set")
  lead = _rows_of(g.block_scale, tokens) + tuple(g.block_scale.shape[1:-1])
  if not lead or lead[0] != tokens:
    raise ValueError(f"{where}: rows {lead} must start with the batch's {tokens} tokens")
  if fmt == "mxfp4" and g.row_scale is not None:
    raise ValueError(f"{where}: MXFP4 guidance has no row_scale")
  k = g.k
  want = field_shapes(lead, k, mode, fmt)
  for field in mode_fields(mode, fmt):
    a = getattr(g, field)
    if a is None:
      raise ValueError(f"{where}: {fmt} {mode} guidance needs {field}")
    if tuple(_rows_of(a, tokens) + a.shape[1:]) != want[field]:
      raise ValueError(f"{where}: {field} shape {tuple(a.shape)}, expected {want[field]}")
    if np.dtype(a.dtype).name != field_dtype(field, fmt):
      raise ValueError(f"{where}: {field} dtype {np.dtype(a.dtype).name}, expected "
                       f"{field_dtype(field, fmt)}")
    path = array_path(layer, site, field)
    arrays[path] = a
    info[path] = {"dtype": field_dtype(field, fmt), "stored_dtype": STORED_DTYPES[field],
                  "shape": list(want[field])}
  return int(np.prod(lead)), k


def _collect(bid: str, tokens: int, guidance: Mapping[int, Mapping[str, Guidance]],
             routing: Mapping[int, Any]) -> tuple[dict, dict, dict]:
  """Checks shapes/dtypes (no data movement); returns arrays, manifest entries, byte stats."""
  arrays: dict[str, Any] = {}
  info: dict[str, dict[str, Any]] = {}
  records = [g for sites in guidance.values() for g in sites.values()]
  mode = _one_of(bid, "guidance modes", {g.mode for g in records}, "compact")
  fmt = _one_of(bid, "FP4 formats", {g.format for g in records}, DEFAULT_FORMAT)
  b = Counter()
  for layer, sites in guidance.items():
    for site, g in sites.items():
      where = f"batch {bid!r} layer {layer} site {site!r}"
      rows, k = _site_arrays(where, g, tokens, mode, fmt, arrays, info, int(layer), site)
      b["guidance_bytes"] += g.nbytes * tokens // max(int(g.block_scale.shape[0]), 1)
      b["compact_bytes"] += int(rows * bytes_per_row(k, "compact", fmt))
      b["full_bytes"] += int(rows * bytes_per_row(k, "full", fmt))
  for layer, ids in routing.items():
    path = array_path(int(layer), ROUTING, ROUTING_FIELD)
    if ids.ndim != 2 or _rows_of(ids, tokens)[0] != tokens or np.dtype(ids.dtype) != np.int32:
      raise ValueError(f"batch {bid!r} layer {layer} routing: ids must be int32 "
                       f"[{tokens}, top_k], got {np.dtype(ids.dtype).name} {tuple(ids.shape)}")
    arrays[path] = ids
    info[path] = {"dtype": STORED_DTYPES[ROUTING_FIELD],
                  "stored_dtype": STORED_DTYPES[ROUTING_FIELD], "shape": [tokens, ids.shape[1]]}
    b["routing_bytes"] += tokens * int(ids.shape[1]) * ids.dtype.itemsize
  stats: dict[str, Any] = {"mode": mode, "fp4_format": fmt, "num_tokens": tokens}
  for key in ("guidance_bytes", "compact_bytes", "full_bytes", "routing_bytes"):
    stats[key] = int(b[key])
    stats[key + "_per_token"] = _per_token(b[key], tokens)
  stats["full_over_compact"] = (b["full_bytes"] / b["compact_bytes"]
                                if b["compact_bytes"] else None)
  return arrays, info, stats


@dataclasses.dataclass
class BatchWrite:
  """A batch write in flight: `stats` now, `result()` (the manifest) once durable."""
  batch_id: str
  stats: dict[str, Any]
  future: cf.Future

  def done(self) -> bool:
    return self.future.done()

  def result(self, timeout: float | None = None) -> dict[str, Any]:
    return self.future.result(timeout)


class GuidanceWriter:
  """Writes rollout batches' guidance asynchronously; `flush()` waits for all of them.

  root: local directory holding one subdirectory (zarr3 group) per batch.
  config_hash: `schema.config_hash(...)` of the precision policy that produced the guidance.
  max_pending: batches in flight before `write_batch` blocks (bounds host memory).
  """

  def __init__(self, root: str | os.PathLike, config_hash: str,
               options: StoreOptions | None = None, max_pending: int = 4,
               overwrite: bool = False):
    self.root = os.fspath(root)
    self.config_hash = config_hash
    self.options = options or StoreOptions()
    self.overwrite = overwrite
    os.makedirs(self.root, exist_ok=True)
    self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="guidance-writer")
    self._slots = threading.BoundedSemaphore(max_pending)
    self._pending: list[BatchWrite] = []
    self._lock = threading.Lock()
    self._ctx = ts.Context({"file_io_sync": self.options.fsync})
    self._closed = False

  def write_batch(self, batch_id: str | int, seq_ids: Sequence[SeqId],
                  token_counts: Sequence[int], guidance: Mapping[int, Mapping[str, Guidance]],
                  routing: Mapping[int, Any] | None = None) -> BatchWrite:
    """Queues one rollout batch; returns at once with its byte stats.

    guidance[layer][site]: Guidance whose rows are the batch's tokens, sequence after sequence
    (`layout.ragged_rows` / `layout.unpad` build that from padded [B, S, ...]);
    routing[layer]: int32 [T, top_k]. NumPy inputs are copied here; jax arrays are copied to
    host on the writer thread, so do not donate them to a jitted call before
    `result()`/`flush()`. A jax array may hold more rows than the batch's tokens: the rows past
    them are padding, dropped after the copy (one device program then makes every batch's rows,
    whatever its token count).
    """
    if self._closed:
      raise RuntimeError("GuidanceWriter is closed")
    bid = str(batch_id)
    routing = routing or {}
    seq_ids, counts = _check_request(bid, seq_ids, token_counts, guidance, routing)
    arrays, info, stats = _collect(bid, sum(counts), guidance, routing)
    stats.update(batch_id=bid, num_seqs=len(seq_ids))
    bdir = os.path.join(self.root, bid)
    with self._lock:
      if any(p.batch_id == bid and not p.done() for p in self._pending):
        raise ValueError(f"batch {bid!r} is already being written")
    if os.path.exists(bdir):
      if not self.overwrite:
        raise FileExistsError(f"guidance batch directory {bdir} exists (overwrite=False)")
      if os.path.exists(os.path.join(bdir, MANIFEST)):
        os.remove(os.path.join(bdir, MANIFEST))  # incomplete from now on, for every reader
    offsets = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)
    arrays["seq_offsets"] = offsets
    info["seq_offsets"] = {"dtype": "int64", "stored_dtype": "int64", "shape": [len(offsets)]}
    # Device arrays are copied to the host on the writer thread only: on the H200 a copy to
    # the host holds its caller for the transfer (`copy_to_host_async` too), and the caller
    # is the rollout engine, whose next batch should decode meanwhile.
    arrays = {p: (a.copy() if isinstance(a, np.ndarray) else a) for p, a in arrays.items()}
    manifest = self._manifest(bid, seq_ids, counts, guidance, routing, info, stats)
    return self._submit(bid, bdir, arrays, manifest, stats)

  def _manifest(self, bid: str, seq_ids: list[SeqId], counts: list[int],
                guidance: Mapping[int, Any], routing: Mapping[int, Any],
                info: dict[str, dict[str, Any]], stats: dict[str, Any]) -> dict[str, Any]:
    """The manifest's fields known before the write (checksums and sizes come after)."""
    return {
        "format": FORMAT, "schema_version": SCHEMA_VERSION, "batch_id": bid,
        "config_hash": self.config_hash, "mode": stats["mode"],
        "fp4_format": stats["fp4_format"], "seq_ids": seq_ids,
        "token_counts": counts, "num_tokens": sum(counts),
        "layers": sorted({int(layer) for layer in guidance}),
        "sites": sorted({s for sites in guidance.values() for s in sites}, key=SITES.index),
        "routing_layers": sorted(int(layer) for layer in routing),
        "arrays": info, "storage": dataclasses.asdict(self.options), "checksum": dict(CHECKSUM),
    }

  def _submit(self, bid: str, bdir: str, arrays: dict[str, Any], manifest: dict[str, Any],
              stats: dict[str, Any]) -> BatchWrite:
    self._slots.acquire()
    try:
      fut = self._pool.submit(self._write_job, bdir, arrays, manifest, stats)
    except BaseException:
      self._slots.release()
      raise
    fut.add_done_callback(lambda _: self._slots.release())
    handle = BatchWrite(bid, stats, fut)
    with self._lock:
      self._pending.append(handle)
    log.info("guidance batch %s queued: %d tokens, %.1f B/token (%s; full codes %.1f B/token)",
             bid, stats["num_tokens"], stats["guidance_bytes_per_token"] or 0.0, stats["mode"],
             stats["full_bytes_per_token"] or 0.0)
    return handle

  def _write_job(self, bdir: str, arrays: dict[str, Any], manifest: dict[str, Any],
                 stats: dict[str, Any]) -> dict[str, Any]:
    """Background: all arrays (TensorStore futures, awaited jointly), then the manifest."""
    if os.path.exists(bdir):
      shutil.rmtree(bdir)
    write_group(bdir, {"format": FORMAT, "schema_version": SCHEMA_VERSION})
    for layer in set(manifest["layers"]) | set(manifest["routing_layers"]):
      write_group(os.path.join(bdir, f"layer_{layer:03d}"))
    for path in arrays:
      if path.count("/") == 2:
        write_group(os.path.join(bdir, os.path.dirname(path)))
    opts = self.options
    tokens = int(manifest["num_tokens"])  # device arrays' padding rows are cut here
    host = {p: to_host(a) if p == "seq_offsets" else to_host(a)[:tokens]
            for p, a in arrays.items()}
    opens = {}
    for path, h in host.items():
      if path == "seq_offsets":
        n = max(1, h.shape[0])
        md = zarr_metadata(h.shape, "int64", n, n, opts)
      else:
        md = zarr_metadata(h.shape, h.dtype.name, opts.shard_tokens, opts.chunk_tokens, opts)
      opens[path] = ts.open(spec(os.path.join(bdir, path), md), create=True, context=self._ctx)
    writes = [opens[p].result().write(h) for p, h in host.items() if h.size]
    manifest = dict(manifest)
    manifest["arrays"] = {p: dict(e) for p, e in manifest["arrays"].items()}
    offsets = host["seq_offsets"]
    for path, h in host.items():  # checksums while TensorStore writes
      if path != "seq_offsets":
        manifest["arrays"][path]["seq_crc32"] = crc_hex(seq_checksums(h, offsets))
    for w in writes:
      w.commit.result()
    stored = chunk_bytes(bdir)
    manifest["bytes"] = {k: v for k, v in stats.items() if k not in NOT_BYTES}
    manifest["bytes"].update(stored_chunk_bytes=stored,
                             stored_chunk_bytes_per_token=_per_token(stored, stats["num_tokens"]))
    now = time.time()
    manifest["created_unix"] = now
    manifest["created_utc"] = datetime.datetime.fromtimestamp(now, datetime.UTC).isoformat()
    write_json_atomic(os.path.join(bdir, MANIFEST), manifest, opts.fsync)
    return manifest

  def in_flight(self) -> set[str]:
    """Ids of the batches queued or being written now."""
    with self._lock:
      return {p.batch_id for p in self._pending if not p.done()}

  def flush(self) -> list[dict[str, Any]]:
    """Waits for every queued batch; raises GuidanceError naming the batches that failed."""
    with self._lock:
      pending, self._pending = self._pending, []
    cf.wait([p.future for p in pending])
    failed = [(p.batch_id, p.future.exception()) for p in pending if p.future.exception()]
    if failed:
      bid, err = failed[0]
      names = [b for b, _ in failed]
      raise GuidanceError(f"write failed ({type(err).__name__}: {err}); failed batches {names} "
                          "have no manifest and will not be read", bid) from err
    return [p.future.result() for p in pending]

  def close(self) -> None:
    """Flushes, then stops the writer thread."""
    if self._closed:
      return
    try:
      self.flush()
    finally:
      self._closed = True
      self._pool.shutdown(wait=True)

  def __enter__(self) -> GuidanceWriter:
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()
