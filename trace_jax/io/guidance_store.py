"""Rollout guidance store: TensorStore zarr3, one group per rollout batch (docs/design.md §5).

Layout of a batch `<root>/<batch_id>/` (a zarr3 group):
  seq_offsets                      int64 [num_seqs + 1]; sequence s owns token rows
                                   [seq_offsets[s], seq_offsets[s + 1]) of every array
  layer_{i:03d}/{site}/{field}     site in SITES, field mantissa|codes, block_scale, row_scale
                                   (NVFP4 only; the manifest's `fp4_format` says which);
                                   rows = all sequences' tokens concatenated (ragged), e.g.
                                   moe_in [T, K/8], expert_mid [T, top_k, I/8], k [T, kv, hd/8]
  layer_{i:03d}/routing/ids        int32 [T, top_k] routed expert ids
  manifest.json                    written last, atomically (tmp + rename)

Every array uses the `sharding_indexed` codec (outer chunk = a shard of `shard_tokens` rows,
inner chunks of `chunk_tokens` rows, each `bytes` + `zstd`; index `bytes` + `crc32c`).
Float8 block scales are stored as their uint8 bytes; the manifest records the logical dtype.
A batch without a manifest is incomplete (writer crashed or still writing) and is never read.

Content checksums (schema 2): for every array the manifest holds `seq_crc32`, the CRC-32
(`zlib.crc32`, the gzip/PNG polynomial) of each sequence's rows, i.e. of the C-order,
little-endian stored bytes of rows [seq_offsets[s], seq_offsets[s + 1]), as 8 hex digits per
sequence. Per sequence, not per array or per chunk, because the trainer reads row ranges of a
subset of sequences: a per-array digest could only be checked by reading the whole array, and a
per-chunk digest by reading (and blaming) every sequence that shares the chunk. Per sequence,
the reader checks exactly the bytes it read (CRC-32 runs at 1.5-3 GB/s per core, several times
TensorStore's zstd decoding), and a mismatch (e.g. a valid chunk file copied in from another
batch of the same shape, which TensorStore's own zstd and index checksums accept) flags exactly
the sequences whose rows changed.

Batch ids are one path component: `[A-Za-z0-9][A-Za-z0-9._-]*` (at most 128 characters) without
'..' (e.g. "b000012", "b000012.audit"); the writer rejects others, the reader treats them as an
unusable batch without touching the file system.

Writes run on a background thread (TensorStore futures inside), so rollout generation only pays
for shape checks and a host snapshot. The reader validates the manifest against its schema
(`manifest_problem`), the trainer's expected config hash and the stored arrays (shapes, dtypes,
checksums), and either raises GuidanceError or flags sequences for RTN fallback
(`on_missing`); each problem is counted in `ReaderStats.reasons` under its own reason.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import datetime
import hashlib
import itertools
import json
import logging
import os
import re
import shutil
import threading
import time
import zlib
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import ml_dtypes
import numpy as np
import tensorstore as ts

from trace_jax.model.config import SITES
from trace_jax.quant.formats import FP4_BLOCKS, FP4_FORMATS
from trace_jax.quant.guided import Guidance, bytes_per_row
from trace_jax.rollout.protocol import GuidanceHandle

log = logging.getLogger(__name__)

SCHEMA_VERSION = 2  # 2: per-sequence CRC-32 of every array (`seq_crc32`)
FORMAT = "trace_jax.guidance"
MANIFEST = "manifest.json"
ROUTING = "routing"
ON_MISSING = ("error", "fallback")
# Logical dtype of each field (block scales: per FP4 format), and the dtype its bytes are
# stored as. A manifest without `fp4_format` (written before MXFP4 guidance) is NVFP4.
FIELD_DTYPES = {"mantissa": "uint8", "codes": "uint8", "block_scale": "float8_e4m3fn",
                "row_scale": "float32", "ids": "int32"}
SCALE_DTYPES = {"nvfp4": "float8_e4m3fn", "mxfp4": "float8_e8m0fnu"}
STORED_DTYPES = {**FIELD_DTYPES, "block_scale": "uint8"}
MODE_FIELDS = {"compact": ("mantissa", "block_scale", "row_scale"),
               "full": ("codes", "block_scale", "row_scale")}
DEFAULT_FORMAT = "nvfp4"


def mode_fields(mode: str, fmt: str) -> tuple[str, ...]:
  """The arrays a site's record holds in `mode` and FP4 format `fmt` (MXFP4: no row scale)."""
  return tuple(f for f in MODE_FIELDS[mode] if fmt == "nvfp4" or f != "row_scale")


def field_dtype(field: str, fmt: str) -> str:
  """Logical dtype of a field's array in FP4 format `fmt`."""
  return SCALE_DTYPES[fmt] if field == "block_scale" else FIELD_DTYPES[field]


def manifest_format(manifest: Mapping[str, Any]) -> str:
  return manifest.get("fp4_format", DEFAULT_FORMAT)
_NOT_BYTES = ("batch_id", "num_seqs", "num_tokens", "mode")
_BATCH_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_ARRAY_PATH = re.compile(r"layer_(\d{3,})/([a-z_]+)/([a-z_]+)")
_HEX = re.compile(r"[0-9a-f]*")
CHECKSUM = {"algorithm": "crc32", "per": "sequence", "field": "seq_crc32"}

SeqId = int | str


@dataclasses.dataclass(frozen=True)
class StoreOptions:
  """Chunking and compression of every array (rows = tokens along axis 0)."""
  shard_tokens: int = 4096
  chunk_tokens: int = 256
  zstd_level: int = 3
  zstd_checksum: bool = True  # a flipped byte in a chunk fails the read instead of passing
  chunk_key_separator: str = "."  # "c.1.0" files: no directory per shard (fewer inodes)
  # fsync shards and manifest before a batch counts as written. Without it, a machine crash can
  # leave a manifest over lost chunks: the reader then reports them (missing chunks and
  # checksums are errors), it never reads zeros.
  fsync: bool = True

  def __post_init__(self):
    if self.chunk_key_separator not in ("/", "."):
      raise ValueError(f"StoreOptions: chunk_key_separator must be '/' or '.', got "
                       f"{self.chunk_key_separator!r}")
    if self.chunk_tokens <= 0 or self.shard_tokens <= 0:
      raise ValueError(f"StoreOptions: chunk sizes must be positive, got {self}")
    if self.shard_tokens % self.chunk_tokens:
      raise ValueError(f"StoreOptions: shard_tokens ({self.shard_tokens}) must be a multiple of "
                       f"chunk_tokens ({self.chunk_tokens})")


class GuidanceError(RuntimeError):
  """Guidance that cannot be used, naming the batch, layer, site and sequences involved."""

  def __init__(self, reason: str, batch_id: str, layer: int | None = None,
               site: str | None = None, seq_ids: Sequence[SeqId] = ()):
    self.reason, self.batch_id, self.layer, self.site = reason, batch_id, layer, site
    self.seq_ids = list(seq_ids)
    where = [f"guidance batch {batch_id!r}"]
    if layer is not None:
      where.append(f"layer {layer}")
    if site is not None:
      where.append(f"site {site!r}")
    if self.seq_ids:
      shown = ", ".join(repr(s) for s in self.seq_ids[:8])
      more = f", ... ({len(self.seq_ids)} in all)" if len(self.seq_ids) > 8 else ""
      where.append(f"sequences [{shown}{more}]")
    super().__init__(f"{', '.join(where)}: {reason}")


def batch_id_problem(batch_id: str) -> str | None:
  """Why `batch_id` is not a valid batch id (one path component, no '..'), or None."""
  if not isinstance(batch_id, str) or not _BATCH_ID.fullmatch(batch_id) or ".." in batch_id:
    return (f"batch id {batch_id!r} is invalid: it must match {_BATCH_ID.pattern} (one path "
            "component) and hold no '..'")
  return None


def _is_int(x: Any) -> bool:
  """A true integer: Python or NumPy int, not bool (JSON ints parse as int)."""
  return isinstance(x, int | np.integer) and not isinstance(x, bool | np.bool_)


def seq_checksums(a: np.ndarray, offsets: Sequence[int], start: int = 0) -> list[int]:
  """CRC-32 (`zlib.crc32`) of the stored bytes of each sequence's rows of `a`.

  a: host array in its stored dtype whose row 0 is token row `start`; offsets: the sequences'
  row bounds (seq_offsets, absolute), consecutive pairs covering rows of `a`. The bytes are C
  order, little-endian (the zarr `bytes` codec's order), so any reader can recompute them.
  """
  a = np.ascontiguousarray(a)
  if a.dtype.byteorder == ">":
    a = a.astype(a.dtype.newbyteorder("<"))
  row = a.dtype.itemsize * int(np.prod(a.shape[1:], dtype=np.int64))
  buf = memoryview(a.reshape(-1).view(np.uint8))
  return [zlib.crc32(buf[(int(lo) - start) * row:(int(hi) - start) * row])
          for lo, hi in zip(offsets[:-1], offsets[1:], strict=True)]


def _crc_hex(crcs: Sequence[int]) -> str:
  return "".join(f"{c:08x}" for c in crcs)


def manifest_problem(manifest: Any) -> str | None:
  """What is wrong with a manifest's schema (field presence, types, consistency), or None.

  Everything the reader indexes or converts is checked here, so a malformed manifest is a bad
  batch (fallback or GuidanceError), never a KeyError/TypeError/ValueError from deeper down.
  """
  if not isinstance(manifest, dict):
    return f"manifest is a JSON {type(manifest).__name__}, not an object"
  for key, kind in (("batch_id", str), ("config_hash", str), ("mode", str), ("seq_ids", list),
                    ("token_counts", list), ("layers", list), ("sites", list),
                    ("routing_layers", list), ("arrays", dict), ("checksum", dict)):
    if not isinstance(manifest.get(key), kind):
      return (f"field {key!r} is {type(manifest.get(key)).__name__}, expected "
              f"{kind.__name__}" if key in manifest else f"field {key!r} is missing")
  if manifest["mode"] not in MODE_FIELDS:
    return f"mode {manifest['mode']!r} is not one of {sorted(MODE_FIELDS)}"
  if manifest_format(manifest) not in FP4_FORMATS:
    return f"fp4_format {manifest_format(manifest)!r} is not one of {list(FP4_FORMATS)}"
  if manifest["checksum"].get("algorithm") != CHECKSUM["algorithm"]:
    return f"checksum algorithm {manifest['checksum'].get('algorithm')!r} is not crc32"
  ids, counts = manifest["seq_ids"], manifest["token_counts"]
  if not all(_is_int(s) or isinstance(s, str) for s in ids) or len(set(ids)) != len(ids):
    return "seq_ids must be unique ints or strings"
  if len(counts) != len(ids) or not all(_is_int(c) and c >= 0 for c in counts):
    return f"token_counts must be {len(ids)} non-negative ints (one per sequence)"
  if not _is_int(manifest.get("num_tokens")) or manifest["num_tokens"] != sum(counts):
    return f"num_tokens {manifest.get('num_tokens')!r} is not the sum of token_counts"
  for key in ("layers", "routing_layers"):
    vals = manifest[key]
    if not all(_is_int(v) and v >= 0 for v in vals) or len(set(vals)) != len(vals):
      return f"{key} must be unique non-negative ints"
  if not all(isinstance(v, str) and v in SITES for v in manifest["sites"]):
    return f"sites must be names in {SITES}"
  for path, entry in manifest["arrays"].items():
    m = _ARRAY_PATH.fullmatch(path) if isinstance(path, str) else None
    if path != "seq_offsets" and (m is None or m[2] not in SITES + (ROUTING,)
                                  or m[3] not in FIELD_DTYPES):
      return f"unknown array path {path!r}"
    if not isinstance(entry, dict) or not all(isinstance(entry.get(k), str)
                                              for k in ("dtype", "stored_dtype")):
      return f"array {path}: entry must hold dtype and stored_dtype strings"
    shape = entry.get("shape")
    if (not isinstance(shape, list) or not shape
        or not all(_is_int(d) and d >= 0 for d in shape)):
      return f"array {path}: shape {shape!r} must be a non-empty list of non-negative ints"
    if path == "seq_offsets":
      continue
    if shape[0] != manifest["num_tokens"]:
      return f"array {path}: {shape[0]} rows, num_tokens is {manifest['num_tokens']}"
    crc = entry.get("seq_crc32")
    if not isinstance(crc, str) or len(crc) != 8 * len(ids) or not _HEX.fullmatch(crc):
      return f"array {path}: seq_crc32 must be {len(ids)} CRC-32s as 8 lowercase hex digits each"
  return None


def array_path(layer: int, site: str, field: str) -> str:
  """Path of one (layer, site, field) array inside a batch group."""
  return f"layer_{layer:03d}/{site}/{field}"


def config_hash(config: Any) -> str:
  """Stable hash of the precision-policy config (dataclass, mapping, ConfigDict or str).

  Rollout and trainer hash the same object; the reader refuses guidance from another policy.
  """
  if isinstance(config, str):
    return config
  if dataclasses.is_dataclass(config) and not isinstance(config, type):
    config = dataclasses.asdict(config)
  elif hasattr(config, "to_dict"):
    config = config.to_dict()
  blob = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
  return "sha256:" + hashlib.sha256(blob.encode()).hexdigest()[:32]


def ragged_rows(x: np.ndarray, lengths: Sequence[int], starts: Sequence[int] | None = None
                ) -> np.ndarray:
  """Concatenates x[b, starts[b]:starts[b] + lengths[b]] over b: padded [B, S, ...] -> [T, ...]."""
  starts = [0] * len(lengths) if starts is None else starts
  x = np.asarray(x)
  return np.concatenate([x[b, s:s + n] for b, (s, n) in enumerate(zip(starts, lengths))], axis=0)


def _norm_id(s: Any) -> SeqId:
  if isinstance(s, np.integer | int) and not isinstance(s, bool):
    return int(s)
  if isinstance(s, str):
    return s
  raise TypeError(f"sequence ids must be int or str, got {type(s).__name__}: {s!r}")


def _zarr_metadata(shape: Sequence[int], dtype: str, outer: int, inner: int,
                   opts: StoreOptions) -> dict[str, Any]:
  """zarr3 metadata: regular grid of `outer`-row shards, each `inner`-row zstd sub-chunks."""
  trailing = [int(d) for d in shape[1:]]
  return {
      "shape": [int(d) for d in shape], "data_type": dtype,
      "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [outer] + trailing}},
      "chunk_key_encoding": {"name": "default",
                             "configuration": {"separator": opts.chunk_key_separator}},
      "codecs": [{"name": "sharding_indexed", "configuration": {
          "chunk_shape": [inner] + trailing,
          "codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                     {"name": "zstd", "configuration": {"level": opts.zstd_level,
                                                        "checksum": opts.zstd_checksum}}],
          "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                           {"name": "crc32c"}],
          "index_location": "end"}}],
  }


def _spec(path: str, metadata: dict[str, Any] | None = None) -> dict[str, Any]:
  spec: dict[str, Any] = {"driver": "zarr3", "kvstore": {"driver": "file", "path": path + "/"}}
  if metadata is None:
    spec["fill_missing_data_reads"] = False  # a lost chunk is an error, never zeros
  else:
    spec["metadata"] = metadata
    spec["store_data_equal_to_fill_value"] = True  # every chunk exists, so the above holds
  return spec


def _write_json_atomic(path: str, obj: Any, fsync: bool = True) -> None:
  """Writes JSON to a temporary file (fsynced) and renames it over `path`."""
  tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=1, sort_keys=True)
    f.flush()
    if fsync:
      os.fsync(f.fileno())
  os.replace(tmp, path)
  if fsync:
    dfd = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
      os.fsync(dfd)
    finally:
      os.close(dfd)


def _write_group(path: str, attributes: dict[str, Any] | None = None) -> None:
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "zarr.json"), "w") as f:
    json.dump({"zarr_format": 3, "node_type": "group", "attributes": attributes or {}}, f)


def _chunk_bytes(path: str) -> int:
  """Bytes of the compressed shard files under path (metadata and manifest excluded)."""
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs
             if not f.endswith(".json") and ".json.tmp" not in f)


def _to_host(a: Any) -> np.ndarray:
  """Host copy of a (jax or numpy) array, in its stored dtype (float8 -> its uint8 bytes)."""
  h = np.ascontiguousarray(np.asarray(a))
  return h.view(np.uint8) if h.dtype in (ml_dtypes.float8_e4m3fn,
                                         ml_dtypes.float8_e8m0fnu) else h


def _rows_of(a: Any, tokens: int) -> tuple[int]:
  """a's leading (row) extent as the batch sees it: a device array's rows past `tokens` are
  padding (`GuidanceWriter.write_batch`)."""
  n = int(a.shape[0]) if a.ndim else 0
  return (tokens,) if isinstance(a, jax.Array) and n >= tokens else (n,)


def _per_token(n: float, tokens: int) -> float | None:
  return n / tokens if tokens else None


# ------------------------------------------------------------------------------------ writer


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
  config_hash: `config_hash(...)` of the precision policy that produced the guidance.
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
    (`ragged_rows` builds that from padded [B, S, ...]); routing[layer]: int32 [T, top_k].
    NumPy inputs are copied here; jax arrays are copied to host on the writer thread, so do not
    donate them to a jitted call before `result()`/`flush()`. A jax array may hold more rows
    than the batch's tokens: the rows past them are padding, dropped after the copy (one
    device program then makes every batch's rows, whatever its token count).
    """
    if self._closed:
      raise RuntimeError("GuidanceWriter is closed")
    bid = str(batch_id)
    problem = batch_id_problem(bid)
    if problem:
      raise ValueError(problem)
    seq_ids = [_norm_id(s) for s in seq_ids]
    token_counts = list(token_counts)
    bad = [c for c in token_counts if not _is_int(c)]
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
    for what, layers in (("guidance", guidance), ("routing", routing or {})):
      bad = [layer for layer in layers if not _is_int(layer) or layer < 0]
      if bad:
        raise ValueError(f"batch {bid!r}: {what} layers must be non-negative integers, got "
                         f"{bad!r}")
    arrays, info, stats = self._collect(bid, sum(counts), guidance, routing or {})
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
    manifest = {
        "format": FORMAT, "schema_version": SCHEMA_VERSION, "batch_id": bid,
        "config_hash": self.config_hash, "mode": stats["mode"],
        "fp4_format": stats["fp4_format"], "seq_ids": seq_ids,
        "token_counts": counts, "num_tokens": sum(counts),
        "layers": sorted({int(layer) for layer in guidance}),
        "sites": sorted({s for sites in guidance.values() for s in sites}, key=SITES.index),
        "routing_layers": sorted(int(layer) for layer in (routing or {})),
        "arrays": info, "storage": dataclasses.asdict(self.options), "checksum": dict(CHECKSUM),
    }
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

  def _collect(self, bid: str, tokens: int, guidance: Mapping[int, Mapping[str, Guidance]],
               routing: Mapping[int, Any]) -> tuple[dict, dict, dict]:
    """Checks shapes/dtypes (no data movement); returns arrays, manifest entries, byte stats."""
    arrays: dict[str, Any] = {}
    info: dict[str, dict[str, Any]] = {}
    modes = {g.mode for sites in guidance.values() for g in sites.values()}
    if len(modes) > 1:
      raise ValueError(f"batch {bid!r}: mixed guidance modes {sorted(modes)}")
    mode = modes.pop() if modes else "compact"
    fmts = {g.format for sites in guidance.values() for g in sites.values()}
    if len(fmts) > 1:
      raise ValueError(f"batch {bid!r}: mixed FP4 formats {sorted(fmts)}")
    fmt = fmts.pop() if fmts else DEFAULT_FORMAT
    b = Counter()
    for layer, sites in guidance.items():
      for site, g in sites.items():
        where = f"batch {bid!r} layer {layer} site {site!r}"
        if site not in SITES:
          raise ValueError(f"{where}: unknown site; sites are {SITES}")
        if (g.mantissa is None) == (g.codes is None):
          raise ValueError(f"{where}: exactly one of mantissa or codes must be set")
        lead = _rows_of(g.block_scale, tokens) + tuple(g.block_scale.shape[1:-1])
        k = g.k
        want = {"block_scale": lead + (k // FP4_BLOCKS[fmt],), "row_scale": lead + (1,),
                "mantissa": lead + (k // 8,), "codes": lead + (k // 2,)}
        if not lead or lead[0] != tokens:
          raise ValueError(f"{where}: rows {lead} must start with the batch's {tokens} tokens")
        if fmt == "mxfp4" and g.row_scale is not None:
          raise ValueError(f"{where}: MXFP4 guidance has no row_scale")
        for field in mode_fields(mode, fmt):
          a = getattr(g, field)
          if a is None:
            raise ValueError(f"{where}: {fmt} {mode} guidance needs {field}")
          if tuple(_rows_of(a, tokens) + a.shape[1:]) != want[field]:
            raise ValueError(f"{where}: {field} shape {tuple(a.shape)}, expected {want[field]}")
          if np.dtype(a.dtype).name != field_dtype(field, fmt):
            raise ValueError(f"{where}: {field} dtype {np.dtype(a.dtype).name}, expected "
                             f"{field_dtype(field, fmt)}")
          path = array_path(int(layer), site, field)
          arrays[path] = a
          info[path] = {"dtype": field_dtype(field, fmt), "stored_dtype": STORED_DTYPES[field],
                        "shape": list(want[field])}
        rows = int(np.prod(lead))
        b["guidance_bytes"] += g.nbytes * tokens // max(int(g.block_scale.shape[0]), 1)
        b["compact_bytes"] += int(rows * bytes_per_row(k, "compact", fmt))
        b["full_bytes"] += int(rows * bytes_per_row(k, "full", fmt))
    for layer, ids in routing.items():
      path = array_path(int(layer), ROUTING, "ids")
      if ids.ndim != 2 or _rows_of(ids, tokens)[0] != tokens or np.dtype(ids.dtype) != np.int32:
        raise ValueError(f"batch {bid!r} layer {layer} routing: ids must be int32 "
                         f"[{tokens}, top_k], got {np.dtype(ids.dtype).name} {tuple(ids.shape)}")
      arrays[path] = ids
      info[path] = {"dtype": "int32", "stored_dtype": "int32", "shape": [tokens, ids.shape[1]]}
      b["routing_bytes"] += tokens * int(ids.shape[1]) * 4
    stats: dict[str, Any] = {"mode": mode, "fp4_format": fmt, "num_tokens": tokens}
    for key in ("guidance_bytes", "compact_bytes", "full_bytes", "routing_bytes"):
      stats[key] = int(b[key])
      stats[key + "_per_token"] = _per_token(b[key], tokens)
    stats["full_over_compact"] = (b["full_bytes"] / b["compact_bytes"]
                                  if b["compact_bytes"] else None)
    return arrays, info, stats

  def _write_job(self, bdir: str, arrays: dict[str, Any], manifest: dict[str, Any],
                 stats: dict[str, Any]) -> dict[str, Any]:
    """Background: all arrays (TensorStore futures, awaited jointly), then the manifest."""
    if os.path.exists(bdir):
      shutil.rmtree(bdir)
    _write_group(bdir, {"format": FORMAT, "schema_version": SCHEMA_VERSION})
    for layer in set(manifest["layers"]) | set(manifest["routing_layers"]):
      _write_group(os.path.join(bdir, f"layer_{layer:03d}"))
    for path in arrays:
      if path.count("/") == 2:
        _write_group(os.path.join(bdir, os.path.dirname(path)))
    opts = self.options
    tokens = int(manifest["num_tokens"])  # device arrays' padding rows are cut here
    host = {p: _to_host(a) if p == "seq_offsets" else _to_host(a)[:tokens]
            for p, a in arrays.items()}
    opens = {}
    for path, h in host.items():
      if path == "seq_offsets":
        n = max(1, h.shape[0])
        md = _zarr_metadata(h.shape, "int64", n, n, opts)
      else:
        md = _zarr_metadata(h.shape, h.dtype.name, opts.shard_tokens, opts.chunk_tokens, opts)
      opens[path] = ts.open(_spec(os.path.join(bdir, path), md), create=True,
                            context=self._ctx)
    writes = [opens[p].result().write(h) for p, h in host.items() if h.size]
    manifest = dict(manifest)
    manifest["arrays"] = {p: dict(e) for p, e in manifest["arrays"].items()}
    offsets = host["seq_offsets"]
    for path, h in host.items():  # checksums while TensorStore writes
      if path != "seq_offsets":
        manifest["arrays"][path]["seq_crc32"] = _crc_hex(seq_checksums(h, offsets))
    for w in writes:
      w.commit.result()
    stored = _chunk_bytes(bdir)
    manifest["bytes"] = {k: v for k, v in stats.items() if k not in _NOT_BYTES}
    manifest["bytes"].update(stored_chunk_bytes=stored,
                             stored_chunk_bytes_per_token=_per_token(stored, stats["num_tokens"]))
    now = time.time()
    manifest["created_unix"] = now
    manifest["created_utc"] = datetime.datetime.fromtimestamp(now, datetime.UTC).isoformat()
    _write_json_atomic(os.path.join(bdir, MANIFEST), manifest, opts.fsync)
    return manifest

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


# ------------------------------------------------------------------------------------ reader


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
    return (str(batch_id), None if seq_ids is None else tuple(_norm_id(s) for s in seq_ids))

  def read(self, batch_id: str | int, seq_ids: Sequence[SeqId] | None = None) -> GuidanceBatch:
    """Validates and reads a batch for `seq_ids` (None: all sequences, in stored order).

    Bad data never raises anything but GuidanceError (on_missing="error"); under "fallback"
    it flags sequences (RTN) and counts them, and read returns.
    """
    bid = str(batch_id)
    requested = None if seq_ids is None else [_norm_id(s) for s in seq_ids]
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
      t = ts.open(_spec(os.path.join(self.root, bid, "seq_offsets")), open=True,
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
    wanted += [(layer, ROUTING, "ids") for layer in rlayers]
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
    futs = {p: ts.open(_spec(os.path.join(self.root, bid, p)), open=True, context=self._ctx)
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
    scale_dtype = getattr(ml_dtypes, SCALE_DTYPES[fmt])
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
      arrays[path] = a.view(scale_dtype) if path.endswith("/block_scale") else a
    guidance: dict[int, dict[str, Guidance]] = {}
    routing: dict[int, np.ndarray] = {}
    names = mode_fields(manifest["mode"], fmt)
    for path, a in arrays.items():
      layer_s, site, field = path.split("/")
      layer = int(layer_s.removeprefix("layer_"))
      if site == ROUTING:
        routing[layer] = a
      elif field == names[0]:
        fields = {f: arrays.get(array_path(layer, site, f)) for f in names}
        if all(v is not None for v in fields.values()):
          guidance.setdefault(layer, {})[site] = Guidance(**fields)
    self._count(sel)
    return GuidanceBatch(bid, sel.seq_ids, out_offsets, sel.valid.copy(), guidance, routing,
                         manifest, sel.problems)


# ------------------------------------------------------------------------------------ store

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
    write = self.writer.write_batch(bid, seq_ids, counts, guidance, routing)
    if n_audit:
      self.writer.write_batch(handles[0].audit_batch_id, seq_ids[:n_audit], counts[:n_audit],
                              audit or {})
    per_token = write.stats.get("guidance_bytes_per_token")
    return [dataclasses.replace(h, guidance_bytes_per_token=per_token) for h in handles]

  def read(self, handles: Sequence[GuidanceHandle], audit: bool = False) -> GuidanceBatch:
    """The records of `handles`' sequences, rows in their order, from however many batches
    hold them; audit=True reads their full codes (every handle must be audited). Waits for
    pending writes first."""
    self.writer.flush()
    groups: dict[str, list[SeqId]] = {}
    for h in handles:
      bid = h.audit_batch_id if audit else h.batch_id
      if bid is None:
        raise ValueError(f"sequence {h.seq_id!r} has no audit record")
      groups.setdefault(bid, []).append(h.seq_id)
    return _merge([self.reader.read(bid, ids) for bid, ids in groups.items()])

  def delete(self, batch_ids: Sequence[str]) -> None:
    """Removes rollout batches and their audit batches (records read, or never needed)."""
    self.writer.flush()
    for bid in dict.fromkeys(batch_ids):
      problem = batch_id_problem(bid)
      if problem:
        raise ValueError(problem)
      for name in (bid, f"{bid}{AUDIT_SUFFIX}"):
        shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)

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
