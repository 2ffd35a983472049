"""Guidance recorder for the SGLang plugin: preallocated device buffers, filled during forwards,
flushed to the TensorStore guidance store (`trace_jax.guidance.store`, docs/design.md §5).

Recording never leaves the device: each (layer, site) owns buffers of `capacity` token rows
(plus one spill row) and a device-side cursor; a forward writes its T rows at
`cursor + arange(T)` with `index_copy_` and advances the cursor in place. No host
synchronisation and no Python-side state that changes per call, so the copies are also replayed
by CUDA graphs (measured on an H200: a captured `record` + `record_routing_ids`, replayed three
times, appended three batches of rows; the plugin's quantization itself is not capturable yet,
see `numerics`). Rows beyond capacity go to the spill row and `flush_to_store` reports the
overflow. Rows are kept in forward order: row r of (layer, site) is the r-th token row that
layer processed since the last reset. `flush_to_store` maps them to sequences: by default the
rows are taken to be the batch's tokens sequence after sequence (one prefill or scoring pass
per batch); for decode-interleaved or CUDA-graph-padded forwards the caller passes `row_index`,
the recorder row of each stored token. Every token must go through the forward: serve without
SGLang's radix (prefix) cache while recording (`launch_sglang.py` adds --disable-radix-cache).

The record's format is `trace_jax.guidance.record`'s (JAX-free, so this module imports no JAX):
per site the NVFP4 fields of the mode (`field_shapes`: packed mantissa bits or 4-bit codes, E4M3
block scales kept as their bytes, the FP32 row scale) in their stored dtypes, and per layer the
routing ids, int32 [rows, top_k]. `torch_quant.guidance_record` computes the fields.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from rollout_bridge import torch_quant as tq
from trace_jax.guidance.record import (
    FP4_BLOCKS,
    MODES,
    ROUTING,
    ROUTING_FIELD,
    SCALE_DTYPES,
    STORED_DTYPES,
    Guidance,
    field_shapes,
    numpy_dtype,
)

FP4_FORMAT = "nvfp4"  # the plugin's FP4 format (`torch_quant`'s NVFP4)
_TORCH_DTYPES = {"uint8": torch.uint8, "int32": torch.int32, "float32": torch.float32}


class _SiteBuffer:
  """Buffers of one (layer, site): field -> [capacity + 1, *row_shape, width], plus a cursor."""

  def __init__(self, capacity: int, fields: dict[str, tuple[tuple[int, ...], torch.dtype]],
               device: torch.device):
    self.capacity = capacity
    self.fields = {name: torch.zeros((capacity + 1, *shape), dtype=dt, device=device)
                   for name, (shape, dt) in fields.items()}
    self.cursor = torch.zeros((1,), dtype=torch.int64, device=device)
    self.row_shape = {name: shape for name, (shape, _) in fields.items()}

  def write(self, rows: dict[str, torch.Tensor]) -> None:
    n = next(iter(rows.values())).shape[0]
    idx = self.cursor + torch.arange(n, device=self.cursor.device)
    idx = torch.where(idx < self.capacity, idx, torch.full_like(idx, self.capacity))
    for name, buf in self.fields.items():
      buf.index_copy_(0, idx, rows[name].reshape(n, *self.row_shape[name]).to(buf.dtype))
    self.cursor.add_(n)


class GuidanceRecorder:
  """Per-layer guidance of the guided layers of one model replica (one SGLang TP/EP rank).

  capacity: token rows preallocated per (layer, site) (and for routing ids per layer).
  mode: "compact" or "full" guidance records.
  layers: the guided layers (others are ignored by `record`).
  record_routing: also keep routed expert ids of the guided layers.
  """

  def __init__(self, capacity: int, mode: str = "compact", layers: Sequence[int] = (),
               record_routing: bool = True):
    if capacity <= 0:
      raise ValueError(f"GuidanceRecorder: capacity must be positive, got {capacity}")
    if mode not in MODES:
      raise ValueError(f"GuidanceRecorder: mode must be one of {MODES}, got {mode!r}")
    self.capacity = capacity
    self.mode = mode
    self.layers = frozenset(int(i) for i in layers)
    self.record_routing = record_routing
    self._sites: dict[tuple[int, str], _SiteBuffer] = {}
    self._lock = threading.Lock()

  def guided(self, layer: int | None) -> bool:
    return layer is not None and layer in self.layers

  # ------------------------------------------------------------------------------ allocation

  def allocate_site(self, layer: int, site: str, rows: tuple[int, ...], width: int,
                    device: torch.device | str) -> None:
    """Preallocates the buffers of a site whose records have rows [T, *rows] over `width`
    elements (e.g. moe_in: rows (), width H; expert_mid: rows (top_k,), width I). Idempotent;
    call it at weight-creation time so the memory is taken before SGLang sizes its KV cache."""
    if not self.guided(layer) or (layer, site) in self._sites:
      return
    if width % FP4_BLOCKS[FP4_FORMAT]:
      raise ValueError(f"GuidanceRecorder: site {site!r} width {width} is not a multiple of "
                       f"{FP4_BLOCKS[FP4_FORMAT]}")
    fields = {f: (shape, _TORCH_DTYPES[STORED_DTYPES[f]])
              for f, shape in field_shapes(rows, width, self.mode, FP4_FORMAT).items()}
    with self._lock:
      self._sites.setdefault((layer, site), _SiteBuffer(self.capacity, fields,
                                                        torch.device(device)))

  def allocate_routing(self, layer: int, top_k: int, device: torch.device | str) -> None:
    if not (self.guided(layer) and self.record_routing) or (layer, ROUTING) in self._sites:
      return
    with self._lock:
      self._sites.setdefault((layer, ROUTING), _SiteBuffer(
          self.capacity, {ROUTING_FIELD: ((top_k,), _TORCH_DTYPES[STORED_DTYPES[ROUTING_FIELD]])},
          torch.device(device)))

  # ------------------------------------------------------------------------------ recording

  def record(self, layer: int | None, site: str, q: tq.NVFP4Tensor) -> None:
    """Appends the guidance record of quantization q (rows [T, *site rows]) for a guided layer."""
    if not self.guided(layer):
      return
    rec = tq.guidance_record(q, self.mode)
    rec["block_scale"] = rec["block_scale"].view(torch.uint8)
    lead, width = tuple(q.codes.shape[1:-1]), q.codes.shape[-1]
    if (layer, site) not in self._sites:   # first eager call (e.g. K/V, whose shapes SGLang
      self.allocate_site(layer, site, lead, width, q.codes.device)  # gives only at forward)
    self._sites[(layer, site)].write(rec)

  def record_routing_ids(self, layer: int | None, ids: torch.Tensor) -> None:
    """Appends routed expert ids [T, top_k] of a guided layer."""
    if not (self.guided(layer) and self.record_routing):
      return
    if (layer, ROUTING) not in self._sites:
      self.allocate_routing(layer, ids.shape[1], ids.device)
    self._sites[(layer, ROUTING)].write({ROUTING_FIELD: ids})

  def reset(self) -> None:
    """Starts a new batch (cursors to zero; the buffers are reused)."""
    for buf in self._sites.values():
      buf.cursor.zero_()

  def rows_recorded(self) -> dict[tuple[int, str], int]:
    """Rows written per (layer, site) since the last reset (reads the cursors: host sync)."""
    return {key: int(buf.cursor.item()) for key, buf in self._sites.items()}

  # ------------------------------------------------------------------------------ flush

  def snapshot(self, num_rows: int, row_index: Sequence[int] | np.ndarray | None = None
               ) -> tuple[dict[int, dict[str, Any]], dict[int, np.ndarray]]:
    """Host copies of the recorded rows as (guidance {layer: {site: Guidance}}, routing
    {layer: int32 [rows, top_k]}), rows ordered by row_index (default 0..num_rows-1)."""
    index = np.arange(num_rows) if row_index is None else np.asarray(row_index, np.int64)
    if index.shape != (num_rows,):
      raise ValueError(f"row_index has shape {index.shape}, expected ({num_rows},)")
    guidance: dict[int, dict[str, Any]] = {}
    routing: dict[int, np.ndarray] = {}
    for (layer, site), buf in sorted(self._sites.items()):
      have = int(buf.cursor.item())
      if have > self.capacity:
        raise RuntimeError(f"guidance recorder overflow: layer {layer} site {site!r} saw {have} "
                           f"rows since the last reset, capacity is {self.capacity} (raise "
                           "record_capacity or flush more often)")
      if num_rows and (index.min() < 0 or index.max() >= have):
        raise ValueError(f"layer {layer} site {site!r}: row_index reaches row "
                         f"{int(index.max())}, only {have} rows were recorded")
      idx = torch.as_tensor(index, device=buf.cursor.device)
      host = {name: t.index_select(0, idx).cpu().numpy() for name, t in buf.fields.items()}
      if site == ROUTING:
        routing[layer] = host[ROUTING_FIELD]
        continue
      host["block_scale"] = host["block_scale"].view(numpy_dtype(SCALE_DTYPES[FP4_FORMAT]))
      guidance.setdefault(layer, {})[site] = Guidance(**host)
    return guidance, routing

  def flush_to_store(self, writer: Any, batch_id: str | int, seq_ids: Sequence[int | str],
                     token_counts: Sequence[int],
                     row_index: Sequence[int] | np.ndarray | None = None,
                     reset: bool = True) -> Any:
    """Writes the recorded rows as one guidance batch through a `GuidanceWriter`.

    seq_ids / token_counts: the batch's sequences and their token counts (the stored rows are
    these tokens, sequence after sequence). row_index: recorder row of each stored token
    (default: rows 0..sum(token_counts)-1, i.e. the forwards already ran in that order).
    Returns the writer's `BatchWrite` (asynchronous; `.result()` waits for the manifest).
    """
    n = int(sum(int(c) for c in token_counts))
    guidance, routing = self.snapshot(n, row_index)
    handle = writer.write_batch(batch_id, seq_ids, token_counts, guidance, routing)
    if reset:
      self.reset()
    return handle

  def nbytes(self) -> int:
    """Device memory held by the buffers."""
    return sum(t.numel() * t.element_size() for b in self._sites.values()
               for t in b.fields.values())
