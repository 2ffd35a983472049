"""The files of a batch directory: TensorStore zarr3 arrays, zarr groups, the atomic manifest.

Every array uses the `sharding_indexed` codec (outer chunk = a shard of `shard_tokens` rows,
inner chunks of `chunk_tokens` rows, each `bytes` + `zstd`; index `bytes` + `crc32c`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np


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


def zarr_metadata(shape: Sequence[int], dtype: str, outer: int, inner: int,
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


def spec(path: str, metadata: dict[str, Any] | None = None) -> dict[str, Any]:
  """TensorStore spec of the array at `path`: to create (with metadata) or to open."""
  s: dict[str, Any] = {"driver": "zarr3", "kvstore": {"driver": "file", "path": path + "/"}}
  if metadata is None:
    s["fill_missing_data_reads"] = False  # a lost chunk is an error, never zeros
  else:
    s["metadata"] = metadata
    s["store_data_equal_to_fill_value"] = True  # every chunk exists, so the above holds
  return s


def write_json_atomic(path: str, obj: Any, fsync: bool = True) -> None:
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


def write_group(path: str, attributes: dict[str, Any] | None = None) -> None:
  """A zarr3 group's directory and `zarr.json`."""
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "zarr.json"), "w") as f:
    json.dump({"zarr_format": 3, "node_type": "group", "attributes": attributes or {}}, f)


def chunk_bytes(path: str) -> int:
  """Bytes of the compressed shard files under path (metadata and manifest excluded)."""
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs
             if not f.endswith(".json") and ".json.tmp" not in f)


def to_host(a: Any) -> np.ndarray:
  """Host copy of a (jax or numpy) array, in its stored dtype (float8 -> its uint8 bytes)."""
  h = np.ascontiguousarray(np.asarray(a))
  return h.view(np.uint8) if h.dtype in (ml_dtypes.float8_e4m3fn,
                                         ml_dtypes.float8_e8m0fnu) else h
