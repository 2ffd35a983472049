"""Log-probabilities of sampled tokens under the training forward, with guidance and taps.

The trainer scores prompt + completion with one full-sequence forward over tokens[:-1]; its
rows line up with the rollout's guidance rows (prompt + completion[:-1]). Used by the GRPO
step's old-policy pass and by the mismatch measurement.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from trace_jax.guidance import layout as guidance_layout
from trace_jax.model.config import ModelConfig
from trace_jax.rollout.engine import bucket
from trace_jax.train import batch as batch_lib
from trace_jax.train import step as step_lib

_MIN_SEQ_BUCKET = 16


def _score_fn(params, inputs, targets, guidance, routing, *, config: ModelConfig,
              tap_layers: tuple[int, ...], tap_mode: str | None, replay: bool):
  logp, out = step_lib.token_logprobs(params, config, inputs, targets, guidance, routing,
                                      tap_layers, tap_mode, replay)
  return logp, out.taps


_score = step_lib.OnParamsMesh(_score_fn)  # on sharded params: expert-parallel on their mesh


def score(params: Any, config: ModelConfig, sequences: Sequence[Sequence[int]], *,
          guidance: Mapping[int, Mapping[str, Any]] | None = None,
          routing: Mapping[int, Any] | None = None, replay: bool = False,
          tap_layers: Sequence[int] = (), tap_mode: str | None = None) -> dict[str, Any]:
  """Per-token log-probs of tokens[1:] of each sequence, and ragged taps.

  guidance / routing: ragged rows (as the engine and the store hold them) for the sequences in
  order; they are padded here. routing is the rollout's expert ids (matching expert_mid
  guidance to experts; replayed when `replay`). Returns {"logprobs": list of np arrays
  (len(seq) - 1 each), "taps": {layer: {site: ragged rows}}, "counts": rows per sequence}.
  """
  counts = [len(seq) - 1 for seq in sequences]
  if min(counts) < 1:
    raise ValueError("every sequence needs at least 2 tokens to be scored")
  s = bucket(max(counts), _MIN_SEQ_BUCKET)
  b = batch_lib.sequence_batch(sequences, [[]] * len(sequences), s)
  inputs, targets = b["inputs"], b["targets"]
  g = guidance_layout.pad_tree(guidance, counts, s) if guidance else {}
  r = ({int(k): guidance_layout.pad_routing(v, counts, s) for k, v in routing.items()}
       if routing else {})
  logp, taps = _score(params, jnp.asarray(inputs), jnp.asarray(targets), g, r, config=config,
                      tap_layers=tuple(tap_layers), tap_mode=tap_mode, replay=replay)
  logp = np.asarray(logp)
  ragged_taps = {
      layer: {site: guidance_layout.unpad(v, counts) for site, v in sites.items()}
      for layer, sites in taps.items()}
  return {"logprobs": [logp[i, :c] for i, c in enumerate(counts)], "taps": ragged_taps,
          "counts": counts}
