"""A trainer's rollout engine over HTTP: weights synced by writing HF safetensors that the server
loads with `/update_weights_from_disk` (docs/design.md §6, weight sync).

`http_engine_factory(url, weights_dir)` is what `experiments/train_rl.py --rollout_url` hands
the learner in place of the in-process engine; the server (ours or SGLang) must see
`weights_dir` at the same path.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from rollout_bridge.client import HttpRolloutEngine
from trace_jax.io import hf
from trace_jax.model.config import ModelConfig


class HttpWeightSync:
  """RolloutEngine over HTTP whose update_weights(params) writes HF safetensors first."""

  def __init__(self, url: str, config: ModelConfig, weights_dir: str, api_key: str | None):
    self.client = HttpRolloutEngine(url, api_key=api_key)
    self.config, self.dir, self.version = config, weights_dir, 0

  def generate(self, prompts, sampling):
    return self.client.generate(prompts, sampling)

  def update_weights(self, params: Any) -> None:
    self.version += 1
    path = os.path.join(self.dir, f"v{self.version:06d}")
    hf.save_hf_checkpoint(path, self.config, params)
    self.client.update_weights(os.path.abspath(path))

  def close(self) -> None:
    self.client.close()


def http_engine_factory(url: str, weights_dir: str, api_key: str | None = None
                        ) -> Callable[[Any, ModelConfig, Any], HttpWeightSync]:
  """A learner's engine factory: the server at `url`, loaded with the learner's weights. The
  server writes guidance to its own `--guidance_dir`, which must be the run's store root."""
  def factory(params: Any, config: ModelConfig, store: Any) -> HttpWeightSync:
    del store  # the server owns its guidance store
    engine = HttpWeightSync(url, config, weights_dir, api_key)
    engine.update_weights(params)
    return engine
  return factory
