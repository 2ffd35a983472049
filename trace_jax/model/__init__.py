"""Qwen3-MoE-compatible decoder in Flax NNX, used as pure functions of (params, config, ...).

`params` is the model's NNX state (`nnx.State` of `nnx.Param`, a pytree); the module graph is
rebuilt from the (hashable, static) config and merged with `params` inside each function, so
every function here can be wrapped in `jax.jit(..., static_argnames="config")`.

Entry points:
  init_params / abstract_params      build parameters (really or as ShapeDtypeStructs)
  forward                            full sequence or one decode step, with taps/guidance
  logits                             jitted float32 logits, `bf16` policy (docs/design.md §10)
  init_cache / prefill / decode_step KV-cache generation helpers
  layer_runs / stack_layers          the runs of layers one scan body runs, their params stacked
  aux_loss                           HF load-balancing loss from a forward's router logits
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from trace_jax.kernels import kv_cache
from trace_jax.kernels.kv_cache import PackedKVCache
from trace_jax.model import sharding
from trace_jax.model.attention import LayerCache
from trace_jax.model.config import MOE_IMPLS, ModelConfig, qwen3_30b_a3b, tiny
from trace_jax.model.layer_runs import layer_runs, stack_layers
from trace_jax.model.moe import load_balancing_loss
from trace_jax.model.plan import KernelPlan
from trace_jax.model.plan import resolve as resolve_plan
from trace_jax.model.precision import SITES, GuidanceTree, Precision
from trace_jax.model.transformer import ForwardOut, Transformer, rows_of_layers

__all__ = [
    "MOE_IMPLS",
    "SITES", "ForwardOut", "KernelPlan", "ModelConfig", "Transformer", "abstract_params",
    "aux_loss", "decode_step", "forward", "graphdef", "init_cache", "init_params", "layer_runs",
    "logits", "prefill", "qwen3_30b_a3b", "resolve_plan", "rows_of_layers", "sharding",
    "stack_layers", "tiny",
]


def _param_dtype(config: ModelConfig, param_dtype) -> jnp.dtype:
  return jnp.dtype(config.dtype if param_dtype is None else param_dtype)


@functools.lru_cache(maxsize=64)
def graphdef(config: ModelConfig) -> nnx.GraphDef:
  """The module graph of `config` (shapes only, nothing allocated)."""
  model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
  return nnx.split(model)[0]


def init_params(config: ModelConfig, key: jax.Array | int = 0,
                param_dtype: str | jnp.dtype | None = None) -> nnx.State:
  """Random parameters (normal, std 0.02; norms 1) in `param_dtype` (default config.dtype)."""
  if isinstance(key, int):
    key = jax.random.key(key)
  pdt = _param_dtype(config, param_dtype)
  return nnx.split(Transformer(config, rngs=nnx.Rngs(params=key), param_dtype=pdt))[1]


def abstract_params(config: ModelConfig, param_dtype: str | jnp.dtype | None = None) -> nnx.State:
  """Parameters as ShapeDtypeStructs (`jax.eval_shape`): any model size, no memory used."""
  pdt = _param_dtype(config, param_dtype)
  return jax.eval_shape(
      lambda: nnx.split(Transformer(config, rngs=nnx.Rngs(0), param_dtype=pdt))[1])


def forward(params: nnx.State, config: ModelConfig, tokens: jax.Array,
            positions: jax.Array | None = None, *, cache: list[LayerCache] | None = None,
            decode: bool = False, guidance: GuidanceTree | None = None,
            routing: dict[int, jax.Array] | None = None, replay: bool = False,
            tap_layers: tuple[int, ...] = (), tap_mode: str | None = None,
            tap_routing: bool | None = None, record: bool = False,
            experts: list[Any] | None = None, layers: list[Any] | None = None,
            plan: KernelPlan | None = None) -> ForwardOut:
  """One forward pass in `config.policy` and `config.dtype`.

  tokens, positions: int32 [B, S] (positions default to 0..S-1).
  cache: per run of `layer_runs(config)`, (k, v) [n, B, T, G, H] (`init_cache`);
    decode=False fills it (prefill), decode=True writes
    this call's K/V at `positions` and attends over the whole cache (one step per call, each
    sequence at its own position).
  guidance: fp4_trace training: {layer: {site: Guidance}} from rollout taps (same row layout).
  routing: {layer: expert ids [B, S, K]} the rollout routed each token to. They match each
    layer's expert_mid guidance rows to experts (required with it), and with `replay` (R3,
    every layer in `routing`) they replace the router's top-k.
  tap_layers / tap_mode: layers whose quantization outcomes are returned in `taps`, as
    Guidance records in `tap_mode` (default config.guidance_mode).
  tap_routing: also return every layer's expert ids in `taps[layer]["routing"]` (default:
    whenever tap_layers is set).
  record: rollout side (no gradient rules at the quantizers).
  experts: per run `expert_weights.ExpertWeights` stacked [n, ...] (the rollout engine's
    weights, packed once per update) used instead of the params' expert weights.
  layers: per run the layers' params stacked (`stack_layers`), used instead of
    params["layers"] (which may then be empty arrays): the engine stacks them once per update
    rather than at every step.
  plan: the kernel plan this forward runs (`trace_jax.model.plan`); None: resolved here from
    the config on the default backend (a program resolves its plan once, as it is traced).
  """
  tokens = jnp.asarray(tokens, jnp.int32)
  if tokens.ndim != 2:
    raise ValueError(f"forward: tokens must be [batch, seq], got shape {tokens.shape}")
  index_positions = positions is None
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
  positions = jnp.asarray(positions, jnp.int32)
  if positions.shape != tokens.shape:
    raise ValueError(f"forward: positions {positions.shape} must match tokens {tokens.shape}")
  runs = len(layer_runs(config))
  for name, per_run in (("cache", cache), ("experts", experts), ("layers", layers)):
    if per_run is not None and len(per_run) != runs:
      raise ValueError(f"forward: {name} for {len(per_run)} runs of layers, config has {runs} "
                       f"(`layer_runs`: {layer_runs(config)})")
  prec = Precision(config, guidance=guidance, tap_layers=tuple(tap_layers), tap_mode=tap_mode,
                   record=record, tap_routing=tap_routing,
                   plan=resolve_plan(config) if plan is None else plan,
                   index_positions=index_positions)
  if replay and not routing:
    raise ValueError("forward: replay=True needs `routing` (the rollout's expert ids)")
  model = nnx.merge(graphdef(config), params)
  return model(tokens, positions, prec, cache=cache, decode=decode, routing=routing,
               replay=replay, experts=experts, layers=layers)


@functools.partial(jax.jit, static_argnames="config")
def _logits(params: nnx.State, config: ModelConfig, tokens: jax.Array) -> jax.Array:
  return forward(params, config, tokens).logits.astype(jnp.float32)


def logits(params: nnx.State, config: ModelConfig, tokens: jax.Array) -> jax.Array:
  """float32 logits [B, S, V] of tokens [B, S] in the `bf16` policy, computed in config.dtype."""
  return _logits(params, config.replace(policy="bf16"), jnp.asarray(tokens, jnp.int32))


def init_cache(config: ModelConfig, batch: int, max_len: int,
               dtype: str | jnp.dtype | None = None,
               plan: KernelPlan | None = None) -> list[LayerCache | PackedKVCache]:
  """Zero KV cache: per run of `layer_runs` (k, v) [n, batch, max_len, G, H] in `dtype`
  (default config.dtype), or, where the plan's `kv_cache` is "packed" (None: the config's,
  resolved here), a `PackedKVCache` whose arrays carry the run's n layers first (NVFP4 codes
  in the plan's `fp4_codes` layout, block and row scales; all zero bytes decode to +0, as a
  zero cache holds)."""
  g, h = config.num_key_value_heads, config.head_dim
  plan = resolve_plan(config) if plan is None else plan
  if plan.kv_cache == "packed":
    one = jax.eval_shape(lambda: kv_cache.init_packed_cache(batch, max_len, g, h,
                                                            words=plan.words))
    return [jax.tree.map(lambda a, n=b - a: jnp.zeros((n,) + a.shape, a.dtype), one)
            for a, b in layer_runs(config)]
  dt = jnp.dtype(config.dtype if dtype is None else dtype)
  shape = (batch, max_len, g, h)
  return [(jnp.zeros((b - a,) + shape, dt), jnp.zeros((b - a,) + shape, dt))
          for a, b in layer_runs(config)]


def prefill(params: nnx.State, config: ModelConfig, tokens: jax.Array, max_len: int,
            **kwargs) -> ForwardOut:
  """Full-sequence forward over tokens [B, S] that also returns a filled KV cache of max_len."""
  if tokens.shape[1] > max_len:
    raise ValueError(f"prefill: {tokens.shape[1]} tokens exceed the cache length {max_len}")
  cache = init_cache(config, tokens.shape[0], max_len, plan=kwargs.get("plan"))
  return forward(params, config, tokens, cache=cache, decode=False, **kwargs)


def decode_step(params: nnx.State, config: ModelConfig, cache: list[LayerCache],
                tokens: jax.Array, positions: jax.Array, **kwargs) -> ForwardOut:
  """One token per sequence: tokens/positions [B] -> ForwardOut with logits [B, 1, V]."""
  return forward(params, config, jnp.asarray(tokens)[:, None], jnp.asarray(positions)[:, None],
                 cache=cache, decode=True, **kwargs)


def aux_loss(out: ForwardOut, config: ModelConfig, mask: jax.Array | None = None) -> jax.Array:
  """Load-balancing loss (unscaled; multiply by config.router_aux_loss_coef), as HF computes it."""
  return load_balancing_loss(out.router_logits, config.num_experts, config.num_experts_per_tok,
                             mask)
