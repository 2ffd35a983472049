"""The Qwen3-MoE decoder: embedding, pre-norm blocks (attention + sparse MoE), final norm, lm_head.

Every layer is an MoE layer (as SGLang assumes) and lm_head is untied. Parameters are in
torch layout; compute happens in `config.dtype` (weights are cast at use, so master weights can
be float32 while the forward runs in bfloat16).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from trace_jax.model.attention import Attention, LayerCache
from trace_jax.model.config import ModelConfig
from trace_jax.model.layers import Embed, Linear, RMSNorm, rope_cos_sin
from trace_jax.model.moe import MoE
from trace_jax.model.precision import Precision


class DecoderLayer(nnx.Module):
  """x + attn(norm(x)), then h + moe(norm(h))."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, param_dtype: jnp.dtype):
    eps = config.rms_norm_eps
    self.input_norm = RMSNorm(config.hidden_size, eps, param_dtype=param_dtype)
    self.attn = Attention(config, rngs=rngs, param_dtype=param_dtype)
    self.post_attn_norm = RMSNorm(config.hidden_size, eps, param_dtype=param_dtype)
    self.moe = MoE(config, rngs=rngs, param_dtype=param_dtype)

  def __call__(self, x, cos, sin, positions, prec, layer, cache=None, decode=False,
               rollout_ids=None, replay=False, experts=None):
    a, cache = self.attn(self.input_norm(x), cos, sin, positions, prec, layer, cache, decode,
                         None if experts is None else experts.attention)
    x = x + a
    m, router_logits = self.moe(self.post_attn_norm(x), prec, layer, rollout_ids, replay,
                                experts, decode)
    return x + m, cache, router_logits


@dataclasses.dataclass
class ForwardOut:
  """logits [B, S, V] (compute dtype); cache: per-layer (k, v) or None; router_logits: per
  layer [B*S, E]; taps: {layer: {site: Guidance, "routing": ids [B, S, K]}}."""
  logits: jax.Array
  cache: list[LayerCache] | None
  router_logits: list[jax.Array]
  taps: dict[int, dict[str, Any]]


jax.tree_util.register_dataclass(
    ForwardOut, data_fields=["logits", "cache", "router_logits", "taps"], meta_fields=[])


class Transformer(nnx.Module):
  """Qwen3MoeForCausalLM."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs,
               param_dtype: jnp.dtype = jnp.float32):
    c = config
    self.config = c
    self.embed = Embed(c.vocab_size, c.hidden_size, rngs=rngs, param_dtype=param_dtype)
    self.layers = nnx.List([DecoderLayer(c, rngs=rngs, param_dtype=param_dtype)
                            for _ in range(c.num_hidden_layers)])
    self.final_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, param_dtype=param_dtype)
    self.lm_head = Linear(c.hidden_size, c.vocab_size, rngs=rngs, param_dtype=param_dtype)

  def __call__(self, tokens: jax.Array, positions: jax.Array, prec: Precision,
               cache: list[LayerCache] | None = None, decode: bool = False,
               routing: dict[int, jax.Array] | None = None, replay: bool = False,
               experts: list[Any] | None = None) -> ForwardOut:
    """tokens/positions [B, S]; see `trace_jax.model.forward`."""
    c = self.config
    dtype = jnp.dtype(c.dtype)
    x = self.embed(tokens, dtype)
    cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta, dtype)
    new_cache = [] if cache is not None else None
    router_logits = []
    for i, layer in enumerate(self.layers):
      x, lc, rl = layer(x, cos, sin, positions, prec, i,
                        None if cache is None else cache[i], decode,
                        None if routing is None else routing.get(i), replay,
                        None if experts is None else experts[i])
      router_logits.append(rl)
      if new_cache is not None:
        new_cache.append(lc)
    logits = self.lm_head(self.final_norm(x))
    return ForwardOut(logits=logits, cache=new_cache, router_logits=router_logits,
                      taps=prec.taps)
