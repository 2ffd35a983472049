"""Per-row token sampling: temperature, top-k, top-p, greedy at temperature 0.

Pure functions of float32 logits [B, V] and per-row settings, so one jitted program serves a
batch of requests with different settings. The returned log-probability is that of the chosen
token under the unmodified policy (log_softmax of the logits, temperature 1), which is what
the trainer recomputes. (SGLang reports log_softmax(logits / T) unless started with
SGLANG_RETURN_ORIGINAL_LOGPROB=1; at temperature 1 the two agree.)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from trace_jax.kernels import invariant


def _scaled(logits: jax.Array, temps: jax.Array) -> jax.Array:
  return logits / jnp.maximum(temps, 1e-6)[:, None]


def filter_logits(logits: jax.Array, temps: jax.Array, top_ps: jax.Array,
                  top_ks: jax.Array) -> jax.Array:
  """Temperature-scaled logits with everything outside top-k / the top-p nucleus at -inf.

  top_ps >= 1 keeps the whole vocabulary (also where float32 rounding of the cumulative
  mass would reach 1 before the last token), as `sample` does without sorting."""
  v = logits.shape[-1]
  scaled = _scaled(logits, temps)
  order = jnp.argsort(-scaled, axis=-1)
  sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
  rank = jnp.arange(v)[None, :]
  k = jnp.where(top_ks <= 0, v, jnp.minimum(top_ks, v))[:, None]
  keep_sorted = rank < k
  probs = jax.nn.softmax(jnp.where(keep_sorted, sorted_logits, -jnp.inf), axis=-1)
  before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly better tokens
  keep_sorted &= (before < top_ps[:, None]) | (top_ps[:, None] >= 1)
  keep_sorted = keep_sorted.at[:, 0].set(True)
  keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(
      keep_sorted)
  return jnp.where(keep, scaled, -jnp.inf)


def truncating(temps: Any, top_ps: Any, top_ks: Any, vocab: int) -> Any:
  """Per row (numpy or jax arrays): sampled (temperature > 0) with a top-k or a top-p that cuts
  the vocabulary, i.e. a row `filter_logits` changes."""
  return (temps > 0) & (((top_ks > 0) & (top_ks < vocab)) | (top_ps < 1))


def sample(logits: jax.Array, keys: jax.Array, temps: jax.Array, top_ps: jax.Array,
           top_ks: jax.Array, *, truncate: bool, fixed_order: bool = False
           ) -> tuple[jax.Array, jax.Array]:
  """One token per row and its log-probability under log_softmax(logits).

  keys: one typed PRNG key per row (so a row's draw never depends on the other rows).
  truncate: whether any row is `truncating`, decided by the caller from its settings on the
  host: the vocabulary sort runs only then, and a branch on a traced flag would cost the GPU a
  device-to-host sync per decode step. Rows that do not truncate draw the same either way.
  fixed_order: the log-softmax's sum in index order (the invariant plan's,
  `kernels.invariant`: the bits the trainer's `token_logprobs` computes from the same logits).
  """
  filtered = (filter_logits(logits, temps, top_ps, top_ks) if truncate
              else _scaled(logits, temps))
  drawn = jax.vmap(jax.random.categorical)(keys, filtered)
  tokens = jnp.where(temps <= 0, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)
  logp = invariant.log_softmax(logits) if fixed_order else jax.nn.log_softmax(logits, axis=-1)
  return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
