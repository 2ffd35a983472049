"""Grouped-query attention with q/k RMSNorm, RoPE, causal mask and a per-layer KV cache.

One implementation serves both forward modes. Full sequence (training, prefill): queries
attend to the keys of the same call, masked causally by position (over positions 0..S-1, the
plan's `seq_attention` may run one fused kernel instead). Decode: the new K/V are
written into the cache at each sequence's own position and the queries attend to the whole
cache, masked by `key position <= query position`. K and V are quantized (FP4 policies)
before they enter the cache, so prefill, decode and training see the same cached values.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct

from trace_jax.kernels import attention_math, decode_attention, fp4_moe, invariant, kv_cache
from trace_jax.kernels.attention_math import attend
from trace_jax.kernels.kv_cache import PackedKVCache
from trace_jax.model import batch_local
from trace_jax.model.config import ModelConfig
from trace_jax.model.layers import Linear, RMSNorm, apply_rope
from trace_jax.model.plan import KernelPlan
from trace_jax.model.precision import Precision

# A run's cache: (k, v), each [L, B, T, G, H] (the run's L layers) in the compute dtype, or a
# `PackedKVCache` whose arrays carry the L layers first (the plan's `kv_cache`).
LayerCache = tuple[jax.Array, jax.Array]


@struct.dataclass
class CacheSlot:
  """Layer `index` (int32, may be traced) of a run's cache stack `run` ((k, v) [L, B, T, G,
  H]). Attention writes its K/V into the stack and reads its layer where they lie, so a scan
  over layers carries the stack and updates one token per layer in place, instead of slicing
  each layer's cache out and writing every layer's whole cache back each step."""
  run: LayerCache
  index: jax.Array


class Attention(nnx.Module):
  """Qwen3 attention: q/k/v/o projections without bias, RMSNorm on q and k per head."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, param_dtype: jnp.dtype):
    c = config
    d, n, g, h = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    self.q_proj = Linear(d, n * h, rngs=rngs, param_dtype=param_dtype)
    self.k_proj = Linear(d, g * h, rngs=rngs, param_dtype=param_dtype)
    self.v_proj = Linear(d, g * h, rngs=rngs, param_dtype=param_dtype)
    self.o_proj = Linear(n * h, d, rngs=rngs, param_dtype=param_dtype)
    self.q_norm = RMSNorm(h, c.rms_norm_eps, param_dtype=param_dtype)
    self.k_norm = RMSNorm(h, c.rms_norm_eps, param_dtype=param_dtype)
    self.num_heads, self.num_kv_heads, self.head_dim = n, g, h

  def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, positions: jax.Array,
               prec: Precision, layer: int, cache: CacheSlot | None = None,
               decode: bool = False, quantized: dict[str, Any] | None = None
               ) -> tuple[jax.Array, LayerCache | None]:
    """x [B, S, D], positions [B, S] -> (out [B, S, D], the run's updated cache stack or None).

    decode=False: attend within x (cache, if given, is filled and returned).
    decode=True: attend over the layer's whole cache after writing this call's K/V into it.
    quantized: this layer of the rollout engine's weights (`expert_weights.LayerOf`; the
    projections in the compute dtype or FP8), used instead of the params' kernels.
    """
    b, s, _ = x.shape
    n, g, h = self.num_heads, self.num_kv_heads, self.head_dim
    kernel = decode and s == 1 and prec.plan.decode_impl == "kernel"  # a one-token step
    (q, k, v), o_proj = self._projections(x, prec, kernel, quantized)
    q, k, v = q.reshape(b, s, n, h), k.reshape(b, s, g, h), v.reshape(b, s, g, h)
    fixed = prec.plan.invariant
    q = apply_rope(self.q_norm(q, fixed), cos, sin)
    k = apply_rope(self.k_norm(k, fixed), cos, sin)
    k, v, new_cache = _write_cache(prec, layer, k, v, cache, positions, kernel)
    if decode and new_cache is None:
      raise ValueError("decode=True needs a KV cache")
    i = None if cache is None else cache.index
    if kernel:
      out = _decode_kernel_attention(prec.plan, q, new_cache, positions, i)
    elif not decode and prec.index_positions and prec.plan.seq_attention == "cudnn":
      out = attention_math.fused_attend(q, k, v)
    else:
      if decode:
        if isinstance(new_cache, PackedKVCache):  # the XLA path: the layer's cache dequantized
          keys, values = kv_cache.dequantize(jax.tree.map(lambda a: a[i], new_cache), x.dtype)
        else:
          keys, values = (a[i].astype(x.dtype) for a in new_cache)
        key_pos = jnp.broadcast_to(jnp.arange(keys.shape[1]), (b, keys.shape[1]))
      else:
        keys, values, key_pos = k, v, positions
      out = (invariant.attend if fixed else attend)(q, keys, values, positions, key_pos)
    return o_proj(out.reshape(b, s, n * h)), new_cache

  def _projections(self, x: jax.Array, prec: Precision, kernel: bool, quantized: Any
                   ) -> tuple[list[jax.Array], Any]:
    """([q, k, v] [B, S, heads * H], o_proj): the params' projections, or the engine's
    (`quantized`: FP8 read in place; on a one-token kernel step each of qkv and o one "expert"
    of the decode kernel, reading the layer's weights in place in the run's stack; else the
    layer's projections sliced out of the stack)."""
    b, s, _ = x.shape
    n, g, h = self.num_heads, self.num_kv_heads, self.head_dim
    if quantized is None:
      names = ("q_proj", "k_proj", "v_proj")
      qkv = prec.linears(x, [getattr(self, p).kernel[...].astype(x.dtype) for p in names])
      return qkv, lambda a: self.o_proj(a, prec.linear)
    if quantized.fp8:  # the engine's FP8 weights, read in place at this layer
      proj = lambda a, name: prec.linear(a, quantized.run.attention[name],
                                         layer=quantized.index)
    elif kernel:
      def proj(a, name):
        mm = lambda rows, w, i: fp4_moe.matmul_decode(rows, w, layer=i)
        out = batch_local.on_batch_shards(
            mm, (a.reshape(b, a.shape[-1]), quantized.run.attention[name], quantized.index),
            (0, None, None), b)
        return out.reshape(b, s, -1)
    else:  # prefill
      w = quantized.attention
      proj = lambda a, name: prec.linear(a, w[name])
    qkv = proj(x, "qkv")  # the engine's q, k and v stacked: one projection, split here
    return (jnp.split(qkv, [n * h, (n + g) * h], axis=-1),
            lambda a: proj(a, "o_proj"))


def _write_cache(prec: Precision, layer: int, k: jax.Array, v: jax.Array,
                 cache: CacheSlot | None, positions: jax.Array, kernel: bool = False
                 ) -> tuple[jax.Array | None, jax.Array | None,
                            LayerCache | PackedKVCache | None]:
  """The k/v sites' values and the run's cache stack with them written at `positions` in the
  slot's layer (None without a cache). A packed cache takes the NVFP4 codes and scales;
  attention uses their values. A one-token kernel step (`kernel`) may write the packed cache
  in one kernel (`Precision.kv_append`); its attention reads the cache, and the values come
  back None."""
  if cache is not None and isinstance(cache.run, PackedKVCache):
    if kernel:
      run = prec.kv_append(layer, k, v, cache.run, positions, cache.index)
      if run is not None:
        return None, None, run
    k, v, qk, qv = prec.kv_site(layer, k, v, codes=True)
    return k, v, kv_cache.write_quantized(cache.run, qk, qv, positions, layer=cache.index)
  k, v = prec.kv_site(layer, k, v)
  if cache is None:
    return k, v, None
  ck, cv = cache.run
  i, bidx = cache.index, jnp.arange(k.shape[0])[:, None]
  return k, v, (ck.at[i, bidx, positions].set(k.astype(ck.dtype)),
                cv.at[i, bidx, positions].set(v.astype(cv.dtype)))


def _decode_kernel_attention(plan: KernelPlan, q: jax.Array, cache: Any, positions: jax.Array,
                             i: jax.Array | None) -> jax.Array:
  """One-token decode: the decode-attention kernels (the plan's) read this layer's cache in
  place in the run's stack: "triton"/"wgmma" with `attend`'s scores and probabilities, "fused"
  in one pass (online softmax). On a mesh each device attends for its own sequences
  (`batch_local`)."""
  b = q.shape[0]

  def attn(q1, c, lens, j):
    impl = "triton"
    if plan.decode_attention in ("wgmma", "fused"):  # the wgmma kernels where they run
      impl = decode_attention.wgmma_impl(q1, c, layer=j,
                                         fused=plan.decode_attention == "fused")
    config = decode_attention.AttentionConfig(impl=impl, sm_count=plan.sm_count)
    return decode_attention.decode_attention(q1, c, lens, layer=j, config=config)

  return batch_local.on_batch_shards(attn, (q[:, 0], cache, positions[:, 0] + 1, i),
                                     (0, 0 if i is None else 1, 0, None), b)[:, None]
