"""Runs of decoder layers: contiguous layers a forward treats alike, run as one `lax.scan`.

With `ModelConfig.scan_layers` a policy without guidance has one run (every layer) and a
guided one two or more (the guided layers apart from the others), so a program compiles one
scan body per run however deep the model is. The KV cache, the rollout engine's prepared
weights and its stacked layer params are held per run, stacked along a leading layer axis.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from trace_jax.model.config import ModelConfig


def layer_runs(config: ModelConfig) -> tuple[tuple[int, int], ...]:
  """[start, stop) of each run of layers that one scan body runs; every layer its own run
  when `config.scan_layers` is False."""
  n = config.num_hidden_layers
  if not config.scan_layers:
    return tuple((i, i + 1) for i in range(n))
  kind = [config.forward.guided and i in config.guided_layers for i in range(n)]
  cuts = [0] + [i for i in range(1, n) if kind[i] != kind[i - 1]] + [n]
  return tuple(zip(cuts[:-1], cuts[1:]))


def stack(trees: Sequence[Any]) -> Any:
  """Pytrees of one structure stacked along a new leading (layer) axis."""
  return jax.tree.map(lambda *a: jnp.stack(a), *trees)


def at_layer(tree: Any, index: jax.Array) -> Any:
  """Layer `index` (int32 scalar, may be traced) of a tree stacked along its leading axis."""
  return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, index, keepdims=False), tree)


def stack_layers(params: Any, config: ModelConfig) -> list[Any]:
  """Each run's layer params (`params["layers"][i]`) stacked [n, ...], as the forward's
  `layers` argument takes them (made once per weight update by the rollout engine)."""
  return [stack([params["layers"][i] for i in range(a, b)]) for a, b in layer_runs(config)]
