"""Small building blocks: RMSNorm, rotary embeddings, token embedding, bias-free linear.

Numerics follow HF `Qwen3MoeForCausalLM` so that float32 logits agree to rounding: RMSNorm
normalizes in float32 and casts back before the weight multiply; RoPE frequencies are float32
`1 / theta ** (2i / H)` and the rotation is `x * cos + rotate_half(x) * sin` in the compute
dtype. Linear weights use the torch `[out, in]` layout (contraction axis last), so checkpoints
convert without transposes and FP4/FP8 blocks run along the last axis.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trace_jax.kernels.invariant import rms_norm as invariant_rms_norm

INIT_STD = 0.02  # HF initializer_range


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], dtype: jnp.dtype) -> jax.Array:
  return (jax.random.normal(rngs.params(), shape, jnp.float32) * INIT_STD).astype(dtype)


class RMSNorm(nnx.Module):
  """`scale * (x / sqrt(mean(x^2) + eps))`, normalized in float32."""

  def __init__(self, dim: int, eps: float, *, param_dtype: jnp.dtype = jnp.float32):
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
    self.eps = eps

  def __call__(self, x: jax.Array, fixed_order: bool = False) -> jax.Array:
    """fixed_order: the mean's sum in index order (the invariant plan's)."""
    if fixed_order:
      return invariant_rms_norm(x, self.scale[...], self.eps)
    xf = x.astype(jnp.float32)
    var = jnp.mean(xf * xf, axis=-1, keepdims=True)
    y = (xf * jax.lax.rsqrt(var + jnp.float32(self.eps))).astype(x.dtype)
    return self.scale[...].astype(x.dtype) * y


class Linear(nnx.Module):
  """Bias-free linear layer with a torch-layout `[out, in]` kernel."""

  def __init__(self, d_in: int, d_out: int, *, rngs: nnx.Rngs,
               param_dtype: jnp.dtype = jnp.float32):
    self.kernel = nnx.Param(_normal(rngs, (d_out, d_in), param_dtype))

  def __call__(self, x: jax.Array, matmul=None) -> jax.Array:
    """`x @ kernel.T` in x's dtype, or `matmul(x, kernel)` (e.g. `Precision.linear`, FP8)."""
    w = self.kernel[...].astype(x.dtype)
    if matmul is not None:
      return matmul(x, w)
    return jnp.einsum("...i,oi->...o", x, w)


class Embed(nnx.Module):
  """Token embedding table [V, D]."""

  def __init__(self, vocab: int, dim: int, *, rngs: nnx.Rngs,
               param_dtype: jnp.dtype = jnp.float32):
    self.embedding = nnx.Param(_normal(rngs, (vocab, dim), param_dtype))

  def __call__(self, tokens: jax.Array, dtype: jnp.dtype) -> jax.Array:
    return jnp.take(self.embedding[...], tokens, axis=0).astype(dtype)


def rope_cos_sin(positions: jax.Array, head_dim: int, theta: float, dtype: jnp.dtype,
                 table_len: int | None = None) -> tuple[jax.Array, jax.Array]:
  """cos, sin of shape positions.shape + (head_dim,), as HF computes them (float32, then cast).

  table_len: rows of a table of positions 0..table_len-1 computed on the host instead (the
  invariant plan's: XLA's cos and sin need not give the same bits at every shape)."""
  if table_len is not None:
    cos, sin = _rope_table(head_dim, float(theta), table_len)
    return (jnp.asarray(cos)[positions].astype(dtype), jnp.asarray(sin)[positions].astype(dtype))
  exps = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / jnp.float32(head_dim)
  inv_freq = jnp.float32(1.0) / (jnp.float32(theta) ** exps)
  freqs = positions.astype(jnp.float32)[..., None] * inv_freq
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


@functools.lru_cache(maxsize=8)
def _rope_table(head_dim: int, theta: float, n: int) -> tuple[np.ndarray, np.ndarray]:
  """float32 cos, sin [n, head_dim] of positions 0..n-1: float32 angles, float64 cos/sin."""
  exps = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
  inv_freq = np.float32(1.0) / (np.float32(theta) ** exps)
  freqs = np.arange(n, dtype=np.float32)[:, None] * inv_freq
  emb = np.concatenate([freqs, freqs], axis=-1).astype(np.float64)
  return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Rotates x [B, S, heads, H] by cos/sin [B, S, H] (rotate-half convention)."""
  half = x.shape[-1] // 2
  rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return x * cos[:, :, None, :] + rot * sin[:, :, None, :]
