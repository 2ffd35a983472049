"""The rollout interface every engine implements (docs/design.md §6).

`RolloutEngine.generate(prompts, sampling)` returns one `Sample` per prompt. The in-process JAX
engine, the HTTP client (speaking SGLang's native API to our embedded server or to a real
SGLang server) and test doubles all implement it, so the trainer does not know which one runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from trace_jax.guidance.handle import GuidanceHandle


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Per-request sampling settings (SGLang `sampling_params` names).

  temperature 0 means greedy. top_k <= 0 and top_p >= 1 disable those filters. `seed` makes a
  request reproducible: the same seed, prompt and weights give the same tokens, whatever else
  shares the batch (SGLang calls it `sampling_seed`).
  """
  max_new_tokens: int = 32
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = -1
  stop_token_ids: tuple[int, ...] = ()
  seed: int | None = None

  def __post_init__(self):
    if self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
    object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

  @classmethod
  def from_sglang(cls, d: dict[str, Any]) -> SamplingParams:
    """From an SGLang `sampling_params` dict; unknown keys raise (they would be ignored)."""
    known = {"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids",
             "sampling_seed", "seed"}
    unknown = set(d) - known
    if unknown:
      raise ValueError(f"unsupported sampling_params keys: {sorted(unknown)}; supported: "
                       f"{sorted(known)}")
    kw = {k: d[k] for k in ("max_new_tokens", "temperature", "top_p", "top_k") if k in d}
    if "stop_token_ids" in d:
      kw["stop_token_ids"] = tuple(d["stop_token_ids"] or ())
    seed = d.get("sampling_seed", d.get("seed"))
    if seed is not None:
      kw["seed"] = int(seed)
    return cls(**kw)

  def to_sglang(self) -> dict[str, Any]:
    d: dict[str, Any] = {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
                         "top_p": self.top_p, "top_k": self.top_k}
    if self.stop_token_ids:
      d["stop_token_ids"] = list(self.stop_token_ids)
    if self.seed is not None:
      d["sampling_seed"] = self.seed
    return d


@dataclasses.dataclass
class Sample:
  """One completed request.

  prompt: the prompt's token ids; tokens: the generated ids (stop token included when hit);
  logprobs: log-probability of each generated token under the rollout policy (the sampling
  distribution before temperature/top-k/top-p, as SGLang reports it); finish_reason: "stop"
  or "length"; guidance: where this request's rollout records are, or None; meta: engine
  extras.
  """
  prompt: list[int]
  tokens: list[int]
  logprobs: list[float]
  finish_reason: str
  guidance: GuidanceHandle | None = None
  meta: dict[str, Any] = dataclasses.field(default_factory=dict)

  @property
  def num_rows(self) -> int:
    """Rows of the trainer's forward over prompt + tokens[:-1] (row t predicts token t+1),
    which are also the rows of the sample's guidance record."""
    return len(self.prompt) + len(self.tokens) - 1


def normalize_request(prompts: Sequence[Sequence[int]],
                      sampling: SamplingParams | Sequence[SamplingParams]
                      ) -> tuple[list[list[int]], list[SamplingParams]]:
  """Prompts as int lists and one SamplingParams per prompt (a single one is shared)."""
  prompts = [[int(t) for t in p] for p in prompts]
  if isinstance(sampling, SamplingParams):
    sampling = [sampling] * len(prompts)
  sampling = list(sampling)
  if len(sampling) != len(prompts):
    raise ValueError(f"{len(prompts)} prompts but {len(sampling)} sampling params")
  return prompts, sampling


@runtime_checkable
class RolloutEngine(Protocol):
  """What the trainer needs from a rollout server."""

  def generate(self, prompts: Sequence[Sequence[int]],
               sampling: SamplingParams | Sequence[SamplingParams]) -> list[Sample]:
    ...

  def update_weights(self, path_or_params: Any) -> None:
    ...

  def close(self) -> None:
    ...
