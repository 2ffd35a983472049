"""The Qwen3-MoE decoder: embedding, pre-norm blocks (attention + sparse MoE), final norm, lm_head.

Every layer is an MoE layer (as SGLang assumes) and lm_head is untied. Parameters are in
torch layout; compute happens in `config.dtype` (weights are cast at use, so master weights can
be float32 while the forward runs in bfloat16).

The decoder layers run in "runs" (`layer_runs`): contiguous layers the forward treats alike
(with `config.scan_layers`, all layers of a policy without guidance, else the unguided prefix
and the guided suffix) run as one `jax.lax.scan` over their stacked parameters, so a program
traces each run's body once however deep the model is. The KV cache and the rollout
engine's prepared weights are held stacked per run; the params stay one subtree per layer
(checkpoints, HF export and sharding rules see the same tree), stacked inside the forward
unless the caller passes them stacked (`stack_layers`, once per weight update). Where the
plan's `layer_loop` is "unrolled" every forward unrolls each run's scan whole (the same body,
compiled once per layer: XLA then folds the stacking and slicing away; `model.plan`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from trace_jax.guidance import byte_rows
from trace_jax.kernels import fp4_moe, invariant
from trace_jax.model import batch_local, expert_weights
from trace_jax.model.attention import Attention, CacheSlot, LayerCache
from trace_jax.model.config import ModelConfig
from trace_jax.model.layer_runs import layer_runs, stack
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
    fixed = prec.plan.invariant
    a, cache = self.attn(self.input_norm(x, fixed), cos, sin, positions, prec, layer, cache, decode,
                         experts)
    x = x + a
    m, router_logits = self.moe(self.post_attn_norm(x, fixed), prec, layer, rollout_ids, replay,
                                experts, decode)
    return x + m, cache, router_logits


@dataclasses.dataclass
class ForwardOut:
  """logits [B, S, V] (compute dtype); cache: per run, stacked (k, v) [L, B, T, G, H], or
  None; router_logits: per layer [B*S, E]; taps: {layer: {site: Guidance, "routing": ids
  [B, S, K]}}; tap_rows: the same taps as the scans stacked them, one uint8 array
  [n, B, S, R] per tapped scan in layer order (`byte_rows`, each layer's R bytes laid out as
  `byte_rows.pack` lays out that layer's taps), so that
  `byte_rows.pack(taps, 2) == rows_of_layers(tap_rows)` bit for bit. A consumer that packs
  the taps anyway (the decode loop) takes these and the unpacking is never computed."""
  logits: jax.Array
  cache: list[LayerCache] | None
  router_logits: list[jax.Array]
  taps: dict[int, dict[str, Any]]
  tap_rows: list[jax.Array]


jax.tree_util.register_dataclass(
    ForwardOut, data_fields=["logits", "cache", "router_logits", "taps", "tap_rows"],
    meta_fields=[])


def rows_of_layers(tap_rows: list[jax.Array]) -> jax.Array:
  """`ForwardOut.tap_rows` as one byte row per (b, s): [B, S, sum of n * R], the layers in
  order: `byte_rows.pack(out.taps, lead=2)` without unpacking and repacking the scans' rows."""
  b, s = tap_rows[0].shape[1:3]
  return jnp.concatenate([jnp.moveaxis(r, 0, 2).reshape(b, s, -1) for r in tap_rows], axis=-1)


def _take(tree: Any, lo: int, hi: int, n: int) -> Any:
  """Layers lo..hi of a run's stacked tree of n layers (the tree itself when that is all)."""
  return tree if (lo, hi) == (0, n) else jax.tree.map(lambda a: a[lo:hi], tree)


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
               experts: list[Any] | None = None,
               layers: list[Any] | None = None) -> ForwardOut:
    """tokens/positions [B, S]; see `trace_jax.model.forward` (cache, experts and layers:
    one entry per `layer_runs` run, stacked along a leading layer axis)."""
    c = self.config
    dtype = jnp.dtype(c.dtype)
    x = self.embed(tokens, dtype)
    cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta, dtype,
                            c.max_position_embeddings if prec.plan.invariant else None)
    gdef = nnx.graphdef(self.layers[0])
    new_cache = [] if cache is not None else None
    router_logits = []
    tap_rows = []
    # The plan's layer loop: every scan unrolled whole, or `scan_unroll` layers per iteration.
    whole = prec.plan.layer_loop == "unrolled"
    for r, (a, b) in enumerate(layer_runs(c)):
      state = (stack([nnx.state(self.layers[i]) for i in range(a, b)]) if layers is None
               else layers[r])
      run_cache = None if cache is None else cache[r]
      # Within a run, the layers this call treats alike (taps, guidance, routing given).
      key = lambda i: (i in prec.tap_layers, prec.guided_sites(i),
                       routing is not None and i in routing)
      cuts = [a] + [i for i in range(a + 1, b) if key(i) != key(i - 1)] + [b]
      for lo, hi in zip(cuts[:-1], cuts[1:]):
        xs = dict(
            state=_take(state, lo - a, hi - a, b - a),
            routing=None if routing is None or lo not in routing else stack(
                [routing[i] for i in range(lo, hi)]),
            guidance=stack([prec.guidance[i] for i in range(lo, hi)])
            if prec.guided_sites(lo) else None)
        run_experts = None if experts is None else _take(experts[r], lo - a, hi - a, b - a)
        (x, run_cache), (rl, rows, layout) = self._scan(
            gdef, (x, run_cache), xs, run_experts, lo, lo - a, hi - lo, cos, sin, positions,
            prec, decode, replay, hi - lo if whole else prec.config.scan_unroll)
        router_logits += [rl[j] for j in range(hi - lo)]
        if rows is not None:
          tap_rows.append(rows)
          taps = byte_rows.unpack(rows, layout)
          for j in range(hi - lo):
            prec.taps[lo + j] = jax.tree.map(lambda t, j=j: t[j], taps)
      if new_cache is not None:
        new_cache.append(run_cache)
    h = self.final_norm(x, prec.plan.invariant)
    if c.logits_fp32 and prec.plan.invariant:  # float32 sums of the compute dtype's values
      logits = invariant.matmul(h, self.lm_head.kernel[...].astype(h.dtype), jnp.float32)
    elif c.logits_fp32:  # the weight rounded as the compute dtype's matmul would, then float32
      w = self.lm_head.kernel[...].astype(h.dtype).astype(jnp.float32)
      logits = jnp.einsum("...i,oi->...o", h.astype(jnp.float32), w,
                          precision=jax.lax.Precision.HIGHEST)
    elif (decode and tokens.shape[1] == 1 and prec.plan.decode_impl == "kernel"
          and c.vocab_size % 16 == 0 and c.hidden_size % 16 == 0):
      # One-token decode: lm_head as one "expert" of the decode kernel, whose grid spreads
      # the vocabulary over every SM (XLA's GEMM read it at ~1.4 TB/s on the H200).
      b = h.shape[0]
      logits = batch_local.on_batch_shards(fp4_moe.matmul_decode,
                                           (h.reshape(b, -1), self.lm_head.kernel[...]),
                                           (0, None), b).reshape(b, 1, -1)
    else:
      logits = self.lm_head(h, prec.matmul)
    return ForwardOut(logits=logits, cache=new_cache, router_logits=router_logits,
                      taps=prec.taps, tap_rows=tap_rows)

  @staticmethod
  def _scan(gdef: nnx.GraphDef, carry: tuple[jax.Array, LayerCache | None], xs: dict[str, Any],
            experts: Any, first: int, offset: int, n: int, cos, sin, positions,
            prec: Precision, decode: bool, replay: bool, unroll: int):
    """Layers first..first+n (alike) over carry (x, the run's cache stack or None; these
    layers sit at offset.. in the run): one scan body, `unroll` layers per iteration (n: the
    body traced once, the loop unrolled whole), or one call when n is 1. xs: the
    per-layer inputs, stacked; experts: the run's prepared weights, stacked, which the body
    indexes (the decode kernel reads them in place) rather than scan slicing them; likewise
    the cache is carried and written in place (`CacheSlot`). Returns ((x, cache), (router
    logits stacked per layer, the taps as byte rows [n, B, S, R] or None, their per-layer
    `byte_rows.Layout`))."""
    layouts = []  # the taps' byte layout, seen while tracing the body

    def body(carry, xs):
      x, cache = carry
      layer = nnx.merge(gdef, xs["state"])
      sub = prec.view(first, xs["guidance"])
      ew = None if experts is None else expert_weights.LayerOf(experts, xs["index"])
      slot = None if cache is None else CacheSlot(cache, offset + xs["index"])
      x, cache, rl = layer(x, cos, sin, positions, sub, first, slot, decode, xs["routing"],
                           replay, ew)
      taps = sub.taps.get(first, {})
      if not taps:
        return (x, cache), (rl, None)
      rows, layout = byte_rows.pack(taps, lead=2)  # one stacking update per layer, not ~12
      layouts[:] = [layout]
      return (x, cache), (rl, rows)

    xs = dict(xs, index=jnp.arange(n, dtype=jnp.int32))
    if n > 1:
      carry, (rl, rows) = jax.lax.scan(body, carry, xs, unroll=min(unroll, n))
    else:
      carry, ys = body(carry, jax.tree.map(lambda a: a[0], xs))
      rl, rows = jax.tree.map(lambda a: a[None], ys)
    return carry, (rl, rows, layouts[0] if rows is not None else None)
