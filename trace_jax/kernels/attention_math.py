"""Attention's numerics as plain JAX: the model's attention (`attend`) and the pieces the
decode-attention kernels share with it (`score_scale`, `attention_probs`), so a kernel's
probabilities are `attend`'s from the same float32 scores (`kernels.decode_attention`) and
the model and the kernels read one definition.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def attend(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array,
           k_pos: jax.Array) -> jax.Array:
  """Causal GQA: q [B, S, N, H], k/v [B, T, G, H], positions [B, S] / [B, T] -> [B, S, N, H].

  Scores are float32 (the dot's float32 sum times float32 H**-0.5, never rounded to the
  compute dtype: a rounding XLA may or may not elide under jit, differently on CPU and GPU),
  soft-maxed in float32, and the probabilities rounded once to the compute dtype for the PV
  product; query head n reads kv head n // (N / G). The decode-attention kernel
  (`trace_jax.kernels.decode_attention`) computes the same scores and takes its probabilities
  from `attention_probs`, so both normalize and round alike.
  """
  b, s, n, h = q.shape
  g = k.shape[2]
  qg = q.reshape(b, s, g, n // g, h)
  scores = jnp.einsum("bsgrh,btgh->bgrst", qg, k, preferred_element_type=jnp.float32)
  scores = scores * score_scale(h)
  mask = k_pos[:, None, None, None, :] <= q_pos[:, None, None, :, None]
  probs = attention_probs(scores, mask, q.dtype)
  out = jnp.einsum("bgrst,btgh->bsgrh", probs, v)
  return out.reshape(b, s, n, h)


def score_scale(head_dim: int) -> np.float32:
  """The float32 factor of the attention scores, head_dim**-0.5."""
  return np.float32(head_dim ** -0.5)


def attention_probs(scores: jax.Array, mask: jax.Array, dtype: Any) -> jax.Array:
  """Probabilities in `dtype` of float32 scores [B, G, R, S, T] over T: masked (mask
  broadcast to scores; False -> excluded), soft-maxed in float32, rounded once."""
  masked = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
  return jax.nn.softmax(masked, axis=-1).astype(dtype)


def fused_attend(q: jax.Array, k: jax.Array, v: jax.Array, implementation: str = "cudnn"
                 ) -> jax.Array:
  """`attend` over positions 0..S-1 (causal by index) in one fused kernel: q [B, S, N, H],
  k/v [B, S, G, H] -> [B, S, N, H] (`jax.nn.dot_product_attention`; "cudnn": cuDNN's flash
  attention, forward and backward, float32 softmax statistics, no [S, S] scores in memory).
  Query head n reads kv head n // (N / G), as in `attend`; the scale is `score_scale`'s."""
  return jax.nn.dot_product_attention(q, k, v, scale=float(score_scale(q.shape[-1])),
                                      is_causal=True, implementation=implementation)
