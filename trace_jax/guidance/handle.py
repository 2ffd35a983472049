"""Where one sequence's rollout records are: the `GuidanceHandle` a `Sample` carries.

JAX-free (standard library only): it travels as JSON in HTTP responses
(`meta_info.trace_guidance`) and clients read it without the trainer's stack.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class GuidanceHandle:
  """Where one sequence's rollout records are (docs/design.md §5).

  Its rows are in the guidance store's batch `batch_id` (the training record and every
  layer's routing) and, for an audited sequence, in `audit_batch_id` (full codes of every
  layer); `store` is the store's root directory, None when the engine kept the records in
  memory. `trace_jax.guidance.store.GuidanceStore` makes and reads them.
  """
  batch_id: str
  seq_id: str | int
  store: str | None = None
  audit_batch_id: str | None = None
  guidance_bytes_per_token: float | None = None

  def to_json(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, d: Any) -> GuidanceHandle:
    """From `to_json`'s dict (e.g. a response's `meta_info.trace_guidance`); bad input raises
    ValueError."""
    if not isinstance(d, dict) or not isinstance(d.get("batch_id"), str) or \
        not isinstance(d.get("seq_id"), (str, int)):
      raise ValueError(f"a guidance handle needs batch_id (str) and seq_id, got {d!r}")
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in names})
