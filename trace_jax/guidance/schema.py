"""The guidance store's on-disk schema: batch ids, array paths, the manifest, content checksums.

A batch `<root>/<batch_id>/` (a zarr3 group) holds

  seq_offsets                      int64 [num_seqs + 1]; sequence s owns token rows
                                   [seq_offsets[s], seq_offsets[s + 1]) of every array
  layer_{i:03d}/{site}/{field}     a site's record fields (`record.mode_fields`), rows = all
                                   sequences' tokens concatenated (ragged), e.g. moe_in
                                   [T, K/8], expert_mid [T, top_k, I/8], k [T, kv, hd/8]
  layer_{i:03d}/routing/ids        int32 [T, top_k] routed expert ids
  manifest.json                    written last, atomically: a batch without one is incomplete

Batch ids are one path component: `[A-Za-z0-9][A-Za-z0-9._-]*` (at most 128 characters)
without '..' (e.g. "b000012", "b000012.audit").

Content checksums (schema 2): for every array the manifest holds `seq_crc32`, the CRC-32
(`zlib.crc32`, the gzip/PNG polynomial) of each sequence's rows, i.e. of the C-order,
little-endian stored bytes of rows [seq_offsets[s], seq_offsets[s + 1]), as 8 hex digits per
sequence. Per sequence, not per array or per chunk, because the trainer reads row ranges of a
subset of sequences: a per-array digest could only be checked by reading the whole array, and
a per-chunk digest by reading (and blaming) every sequence that shares the chunk. A mismatch
(e.g. a valid chunk file copied in from another batch of the same shape, which TensorStore's
own zstd and index checksums accept) flags exactly the sequences whose rows changed.

JAX-free (numpy and the standard library).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from trace_jax.guidance.record import (
    DEFAULT_FORMAT,
    FIELD_DTYPES,
    FP4_FORMATS,
    MODE_FIELDS,
    ROUTING,
    SITES,
)

SCHEMA_VERSION = 2  # 2: per-sequence CRC-32 of every array (`seq_crc32`)
FORMAT = "trace_jax.guidance"
MANIFEST = "manifest.json"
CHECKSUM = {"algorithm": "crc32", "per": "sequence", "field": "seq_crc32"}
_BATCH_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_ARRAY_PATH = re.compile(r"layer_(\d{3,})/([a-z_]+)/([a-z_]+)")
_HEX = re.compile(r"[0-9a-f]*")

SeqId = int | str


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


def array_path(layer: int, site: str, field: str) -> str:
  """Path of one (layer, site, field) array inside a batch group."""
  return f"layer_{layer:03d}/{site}/{field}"


def is_int(x: Any) -> bool:
  """A true integer: Python or NumPy int, not bool (JSON ints parse as int)."""
  return isinstance(x, int | np.integer) and not isinstance(x, bool | np.bool_)


def norm_seq_id(s: Any) -> SeqId:
  """A sequence id as the manifest keeps it: int (NumPy ints too) or str."""
  if isinstance(s, np.integer | int) and not isinstance(s, bool):
    return int(s)
  if isinstance(s, str):
    return s
  raise TypeError(f"sequence ids must be int or str, got {type(s).__name__}: {s!r}")


def manifest_format(manifest: Mapping[str, Any]) -> str:
  """The FP4 format of a manifest's records (one written before MXFP4 records: NVFP4)."""
  return manifest.get("fp4_format", DEFAULT_FORMAT)


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


def crc_hex(crcs: Sequence[int]) -> str:
  """CRC-32s as the manifest's `seq_crc32` string: 8 lowercase hex digits each."""
  return "".join(f"{c:08x}" for c in crcs)


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
  if not all(is_int(s) or isinstance(s, str) for s in ids) or len(set(ids)) != len(ids):
    return "seq_ids must be unique ints or strings"
  if len(counts) != len(ids) or not all(is_int(c) and c >= 0 for c in counts):
    return f"token_counts must be {len(ids)} non-negative ints (one per sequence)"
  if not is_int(manifest.get("num_tokens")) or manifest["num_tokens"] != sum(counts):
    return f"num_tokens {manifest.get('num_tokens')!r} is not the sum of token_counts"
  for key in ("layers", "routing_layers"):
    vals = manifest[key]
    if not all(is_int(v) and v >= 0 for v in vals) or len(set(vals)) != len(vals):
      return f"{key} must be unique non-negative ints"
  if not all(isinstance(v, str) and v in SITES for v in manifest["sites"]):
    return f"sites must be names in {SITES}"
  for path, entry in manifest["arrays"].items():
    problem = _array_entry_problem(path, entry, manifest["num_tokens"], len(ids))
    if problem:
      return problem
  return None


def _array_entry_problem(path: Any, entry: Any, num_tokens: int, num_seqs: int) -> str | None:
  """What is wrong with one entry of a manifest's `arrays`, or None."""
  m = _ARRAY_PATH.fullmatch(path) if isinstance(path, str) else None
  if path != "seq_offsets" and (m is None or m[2] not in SITES + (ROUTING,)
                                or m[3] not in FIELD_DTYPES):
    return f"unknown array path {path!r}"
  if not isinstance(entry, dict) or not all(isinstance(entry.get(k), str)
                                            for k in ("dtype", "stored_dtype")):
    return f"array {path}: entry must hold dtype and stored_dtype strings"
  shape = entry.get("shape")
  if (not isinstance(shape, list) or not shape
      or not all(is_int(d) and d >= 0 for d in shape)):
    return f"array {path}: shape {shape!r} must be a non-empty list of non-negative ints"
  if path == "seq_offsets":
    return None
  if shape[0] != num_tokens:
    return f"array {path}: {shape[0]} rows, num_tokens is {num_tokens}"
  crc = entry.get("seq_crc32")
  if not isinstance(crc, str) or len(crc) != 8 * num_seqs or not _HEX.fullmatch(crc):
    return f"array {path}: seq_crc32 must be {num_seqs} CRC-32s as 8 lowercase hex digits each"
  return None
