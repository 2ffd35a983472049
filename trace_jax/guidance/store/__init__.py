"""Rollout guidance store: TensorStore zarr3, one group per rollout batch (docs/design.md §5).

`GuidanceStore` (`store.py`) owns a root's batches; `GuidanceWriter` (`writer.py`) and
`GuidanceReader` (`reader.py`) are its parts, and `arrays.py` the TensorStore specs and files
they share. `MemoryGuidanceStore` (`memory.py`) answers the same calls in host memory, for a
trainer in the rollout's process. The on-disk layout, manifest and checksums are
`trace_jax.guidance.schema`'s; docs/reliability.md says what the store promises under faults.

This module gathers the store's public names, so callers import one module.
"""

from trace_jax.guidance.schema import GuidanceError, config_hash
from trace_jax.guidance.store.arrays import StoreOptions
from trace_jax.guidance.store.memory import MemoryGuidanceStore
from trace_jax.guidance.store.reader import GuidanceBatch, GuidanceReader, ReaderStats
from trace_jax.guidance.store.store import (
    AUDIT_SUFFIX,
    GuidanceStore,
    batch_name,
    rollout_handles,
)
from trace_jax.guidance.store.writer import BatchWrite, GuidanceWriter

__all__ = [
    "AUDIT_SUFFIX", "BatchWrite", "GuidanceBatch", "GuidanceError", "GuidanceReader",
    "GuidanceStore", "GuidanceWriter", "MemoryGuidanceStore", "ReaderStats", "StoreOptions",
    "batch_name", "config_hash", "rollout_handles",
]
