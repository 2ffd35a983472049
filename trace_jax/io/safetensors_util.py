"""Minimal safetensors reader/writer on numpy (bf16, fp8 and uint8 included, no torch).

Format: 8-byte little-endian header length, a JSON header `{name: {dtype, shape,
data_offsets}}` (plus optional `__metadata__` of strings), then the raw little-endian bytes.
Reading memory-maps the file, so a tensor is read only when asked for. A checkpoint is one
`model.safetensors` or several files listed in `model.safetensors.index.json`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import ml_dtypes
import numpy as np

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def dtype_name(dtype: np.dtype) -> str:
  """safetensors dtype tag of a numpy dtype."""
  try:
    return _NAMES[np.dtype(dtype)]
  except KeyError:
    raise TypeError(f"safetensors: unsupported dtype {np.dtype(dtype)}") from None


@dataclass(frozen=True)
class TensorInfo:
  file: str
  dtype: np.dtype
  shape: tuple[int, ...]
  start: int  # absolute byte offset in file
  nbytes: int


def read_header(path: str) -> tuple[dict[str, TensorInfo], dict[str, str]]:
  """Tensor infos and `__metadata__` of one safetensors file (header only)."""
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    head = f.read(8)
    if len(head) < 8:
      raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
    n = int.from_bytes(head, "little")
    if n > size - 8:
      raise ValueError(f"{path}: header length {n} exceeds the file size {size}")
    header = json.loads(f.read(n))
  meta = header.pop("__metadata__", {}) or {}
  infos = {}
  for name, h in header.items():
    if h["dtype"] not in _DTYPES:
      raise ValueError(f"{path}: tensor {name} has unsupported dtype {h['dtype']}")
    dt = _DTYPES[h["dtype"]]
    shape = tuple(int(d) for d in h["shape"])
    begin, end = h["data_offsets"]
    want = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    if end - begin != want or 8 + n + end > size:
      raise ValueError(f"{path}: tensor {name} ({h['dtype']} {list(shape)}) has a corrupt byte "
                       f"range [{begin}, {end})")
    infos[name] = TensorInfo(path, dt, shape, 8 + n + begin, want)
  return infos, meta


class CheckpointReader:
  """All tensors of a checkpoint directory (single file or index) by name, read lazily."""

  def __init__(self, path: str):
    self.path = path
    index = os.path.join(path, INDEX_FILE)
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(index):
      with open(index) as f:
        weight_map = json.load(f)["weight_map"]
      files = sorted(set(weight_map.values()))
    elif os.path.isfile(single):
      weight_map, files = None, [SINGLE_FILE]
    else:
      raise FileNotFoundError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
    self.infos: dict[str, TensorInfo] = {}
    for fname in files:
      fpath = os.path.join(path, fname)
      if not os.path.isfile(fpath):
        raise FileNotFoundError(f"{path}: shard {fname} listed in {INDEX_FILE} is missing")
      infos, _ = read_header(fpath)
      self.infos.update(infos)
    if weight_map is not None:
      missing = sorted(set(weight_map) - set(self.infos))
      if missing:
        raise ValueError(f"{path}: {len(missing)} tensors listed in {INDEX_FILE} are not in "
                         f"their shards, e.g. {missing[:5]}")
    self._maps: dict[str, np.memmap] = {}

  def __contains__(self, name: str) -> bool:
    return name in self.infos

  def get(self, name: str) -> np.ndarray:
    """The tensor `name` as a numpy array (a copy, safe after the reader is gone)."""
    info = self.infos[name]
    if info.file not in self._maps:
      self._maps[info.file] = np.memmap(info.file, dtype=np.uint8, mode="r")
    raw = self._maps[info.file][info.start:info.start + info.nbytes]
    return np.array(raw).view(info.dtype).reshape(info.shape)


def _header_bytes(entries: list[tuple[str, np.dtype, tuple[int, ...]]],
                  metadata: dict[str, str] | None) -> tuple[bytes, list[int]]:
  header: dict = {"__metadata__": metadata} if metadata else {}
  offset = 0
  sizes = []
  for name, dt, shape in entries:
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize
    header[name] = {"dtype": dtype_name(dt), "shape": list(shape),
                    "data_offsets": [offset, offset + nbytes]}
    offset += nbytes
    sizes.append(nbytes)
  raw = json.dumps(header, separators=(",", ":")).encode()
  raw += b" " * (-len(raw) % 8)  # 8-byte alignment of the data section
  return len(raw).to_bytes(8, "little") + raw, sizes


# A tensor to write: name, dtype, shape, and a function producing its array when it is written.
LazyTensor = tuple[str, np.dtype, tuple[int, ...], Callable[[], np.ndarray]]


def write_file(path: str, tensors: list[LazyTensor], metadata: dict[str, str] | None = None,
               on_tensor: Callable[[int], None] | None = None) -> None:
  """Writes one safetensors file, producing each tensor only when it is written."""
  head, sizes = _header_bytes([(n, d, s) for n, d, s, _ in tensors], metadata)
  tmp = path + ".tmp"
  with open(tmp, "wb") as f:
    f.write(head)
    for (name, dt, shape, make), size in zip(tensors, sizes):
      a = np.asarray(make())  # (ascontiguousarray would make 0-d scalars 1-d)
      if not a.flags.c_contiguous:
        a = a.copy(order="C")
      if a.dtype != np.dtype(dt) or tuple(a.shape) != tuple(shape):
        raise ValueError(f"write_file: tensor {name} is {a.dtype} {a.shape}, declared "
                         f"{np.dtype(dt)} {tuple(shape)}")
      f.write(a.tobytes())
      if on_tensor is not None:
        on_tensor(size)
  os.replace(tmp, path)


def write_checkpoint(path: str, tensors: Iterable[LazyTensor], max_shard_bytes: int | None = None,
                     metadata: dict[str, str] | None = None,
                     on_tensor: Callable[[int], None] | None = None) -> list[str]:
  """Writes `model.safetensors`, or shards plus `model.safetensors.index.json` when the tensors
  exceed `max_shard_bytes`. Returns the file names written."""
  tensors = list(tensors)
  names = [t[0] for t in tensors]
  if len(set(names)) != len(names):
    raise ValueError("write_checkpoint: duplicate tensor names")
  os.makedirs(path, exist_ok=True)
  shards: list[list[LazyTensor]] = [[]]
  used = 0
  total = 0
  for t in tensors:
    nbytes = int(np.prod(t[2], dtype=np.int64)) * np.dtype(t[1]).itemsize
    total += nbytes
    if max_shard_bytes and shards[-1] and used + nbytes > max_shard_bytes:
      shards.append([])
      used = 0
    shards[-1].append(t)
    used += nbytes
  meta = {"format": "pt", **(metadata or {})}
  for stale in (SINGLE_FILE, INDEX_FILE):
    if os.path.exists(os.path.join(path, stale)):
      os.remove(os.path.join(path, stale))
  if len(shards) == 1:
    write_file(os.path.join(path, SINGLE_FILE), shards[0], meta, on_tensor)
    return [SINGLE_FILE]
  files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
  weight_map = {}
  for fname, shard in zip(files, shards):
    write_file(os.path.join(path, fname), shard, meta, on_tensor)
    weight_map.update({t[0]: fname for t in shard})
  with open(os.path.join(path, INDEX_FILE), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
  return files + [INDEX_FILE]
