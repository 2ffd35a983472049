"""Pure, jitted training steps: GRPO with rollout-guided QAT, and SFT.

State is a `TrainState` pytree (FP32 master params, optax state, step). The forward runs in
`config.dtype` under `config.policy`; fake quantizers return BF16-rounded cotangents, so the
gradients flowing between operators are BF16 and only the optimizer sees FP32 (Jet-RL).

Each step is jitted with the state's shardings declared as its input and output shardings and
the state donated (`ShardedStep`, as flax's gemma `train.py` declares them): on a mesh the
state leaves a step sharded exactly as it came in, so a run compiles each step once.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from trace_jax import model as model_lib
from trace_jax.io import integrity
from trace_jax.kernels import invariant
from trace_jax.model import mesh_context, sharding
from trace_jax.model.config import ModelConfig
from trace_jax.rl import losses
from trace_jax.train.batch import RLBatch


@struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """AdamW with linear warmup and cosine decay, global-norm clipping."""
  lr: float = 1e-3
  warmup_steps: int = 10
  total_steps: int = 1000
  weight_decay: float = 0.0
  b1: float = 0.9
  b2: float = 0.95
  clip_norm: float = 1.0
  min_lr_ratio: float = 0.1


@functools.lru_cache(maxsize=32)
def make_optimizer(c: OptimConfig) -> optax.GradientTransformation:
  """One transformation per config: jitted steps take it as a static argument (hashed by
  identity), so runs of one config in one process (RL seeds) share the compiled step."""
  warmup = max(1, min(c.warmup_steps, c.total_steps - 1))
  # Warmup starts at lr / warmup (not 0), so the very first update already moves the weights.
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=c.lr / warmup, peak_value=c.lr, warmup_steps=warmup,
      decay_steps=max(c.total_steps, warmup + 1), end_value=c.lr * c.min_lr_ratio)
  return optax.chain(optax.clip_by_global_norm(c.clip_norm),
                     optax.adamw(schedule, b1=c.b1, b2=c.b2, weight_decay=c.weight_decay))


def init_state(params: Any, tx: optax.GradientTransformation) -> TrainState:
  """FP32 master copy of params (callers keep theirs: the steps donate the state) + optimizer,
  every leaf committed to a device (jit keys its cache on committed-ness, and the steps'
  outputs are committed: an uncommitted first state would compile each step twice).

  Leaves go where the params are: sharded params keep their shardings, and the counters and
  any other leaf made here are replicated over the params' mesh (or put on their device).
  """
  params = jax.tree.map(lambda a: jnp.array(a, jnp.float32, copy=True), params)
  state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))
  leaves = jax.tree.leaves(params)
  if any(isinstance(a, jax.core.Tracer) for a in leaves):  # under eval_shape
    return state
  placed = [a for a in leaves if a.committed]
  s = placed[0].sharding if placed else jax.sharding.SingleDeviceSharding(jax.devices()[0])
  if isinstance(s, jax.sharding.NamedSharding):
    s = jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec())
  return jax.tree.map(lambda a: a if a.committed else jax.device_put(a, s), state)


def place_params(params: Any, mesh: tuple[tuple[str, int], ...] | None) -> Any:
  """Shards params over a run's mesh ((axis, size), ...; `trace_jax.model.sharding` rules),
  or returns them as they are without one."""
  if not mesh:
    return params
  return sharding.shard_params(params, sharding.make_mesh(dict(mesh)))


class ShardedStep:
  """`fn(state, batch, **static) -> (state, *outputs)` under `jax.jit`, with the state's
  shardings as the declared input and output shardings of the state and the state donated.

  Without declared output shardings XLA's propagation gives some outputs (norm scales,
  counters) other shardings than their inputs on a mesh, and the next call would compile
  again. One jit per (state sharding layout, static arguments), the static arguments bound
  (jit takes no keyword arguments with declared shardings). On a mesh the batch goes in split
  along its first axis as the rules split the batch (`sharding.activation_sharding`: data
  parallel over data x fsdp x expert, as the MoE blocks take their tokens), not replicated;
  the other outputs are XLA's choice. `_cache_size()` counts the compiled programs of all.
  """

  def __init__(self, fn: Any, num_outputs: int):
    self._fn, self._n = fn, num_outputs
    self._jits: dict[Any, Any] = {}
    functools.update_wrapper(self, fn)

  def __call__(self, state: TrainState, batch: Any, **static: Any) -> Any:
    shardings = jax.tree.map(lambda a: a.sharding, state)
    key = (jax.tree.structure(shardings), tuple(jax.tree.leaves(shardings)),
           tuple(sorted(static.items())))
    if key not in self._jits:
      self._jits[key] = jax.jit(
          functools.partial(self._fn, **static), in_shardings=(shardings, None),
          out_shardings=(shardings,) + (None,) * (self._n - 1), donate_argnums=0)
    # On a mesh the MoE blocks run expert-parallel, the kernels per shard (traced here).
    mesh = _mesh_of(shardings)
    if mesh is not None:
      batch = jax.tree.map(lambda a: jax.device_put(a, sharding.activation_sharding(
          mesh, np.shape(a))) if np.ndim(a) else a, batch)
    with mesh_context.use_mesh(mesh):
      return self._jits[key](state, batch)

  def _cache_size(self) -> int:
    return sum(j._cache_size() for j in self._jits.values())


def _mesh_of(tree: Any) -> jax.sharding.Mesh | None:
  """The mesh of the first NamedSharding in a tree of shardings or of arrays (their
  `.sharding`), None when there is none (not on a mesh)."""
  return next((s.mesh for s in (getattr(x, "sharding", x) for x in jax.tree.leaves(tree))
               if isinstance(s, jax.sharding.NamedSharding)), None)


class OnParamsMesh:
  """`fn(params, *args, **static)` under `jax.jit`, traced inside `mesh_context.use_mesh`
  for the mesh the params lie on (none off a mesh): one jit per (mesh, static arguments), as
  jit's trace cache does not see `use_mesh`. Off the mesh's context a forward would leave its
  MoE blocks and kernels to XLA's partitioner (expert weights gathered, kernels replicated)."""

  def __init__(self, fn: Any):
    self._fn = fn
    self._jits: dict[Any, Any] = {}
    functools.update_wrapper(self, fn)

  def __call__(self, params: Any, *args: Any, **static: Any) -> Any:
    mesh = _mesh_of(params)
    key = (mesh, tuple(sorted(static.items())))
    if key not in self._jits:
      self._jits[key] = jax.jit(functools.partial(self._fn, **static))
    with mesh_context.use_mesh(mesh):
      return self._jits[key](params, *args)


@dataclasses.dataclass(frozen=True)
class RLConfig:
  """GRPO loss settings (docs/design.md §8).

  clip_eps_low / clip_eps_high: the PPO ratio clip range [1 - low, 1 + high] (high > low is
  DAPO's clip-higher). kl_coef: weight of the k3 KL to the reference policy (the batch's
  `logp_ref`). routing_replay: R3, route by the rollout's expert ids (`batch.routing`).
  loss_agg / is_level / loss_norm: `trace_jax.rl.losses.ppo_clip_loss`'s.
  """
  clip_eps_low: float = 0.2
  clip_eps_high: float = 0.2
  is_mode: str = "truncate"
  is_cap: float = 5.0
  kl_coef: float = 0.0
  aux_loss_coef: float = 0.001
  routing_replay: bool = False
  loss_agg: str = "token_mean"
  is_level: str = "token"
  loss_norm: float | None = None


def token_logprobs(params: Any, config: ModelConfig, inputs: jax.Array, targets: jax.Array,
                   guidance: Any = None, routing: Any = None, tap_layers: tuple[int, ...] = (),
                   tap_mode: str | None = None, replay: bool = False) -> tuple[jax.Array, Any]:
  """log pi(targets | inputs) [B, S] in float32 and the forward's output.

  routing: the rollout's expert ids per layer (match expert_mid guidance; replayed if `replay`).
  """
  out = model_lib.forward(params, config, inputs, guidance=guidance or None,
                          routing=routing or None, replay=replay, tap_layers=tap_layers,
                          tap_mode=tap_mode)
  logits = out.logits.astype(jnp.float32)
  logp = (invariant.log_softmax(logits) if model_lib.resolve_plan(config).invariant
          else jax.nn.log_softmax(logits, axis=-1))
  return jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0], out


def _grpo_loss(params, config: ModelConfig, rl: RLConfig, batch: RLBatch,
               tap_layers: tuple[int, ...]):
  logp, out = token_logprobs(params, config, batch.inputs, batch.targets, batch.guidance,
                             batch.routing, tap_layers, "full", rl.routing_replay)
  if rl.kl_coef and batch.logp_ref is None:
    raise ValueError(f"kl_coef={rl.kl_coef} needs the batch's logp_ref (reference log-probs)")
  loss, metrics = losses.ppo_clip_loss(
      logp, batch.logp_old, batch.advantages, batch.loss_mask, logp_rollout=batch.logp_rollout,
      clip_eps_low=rl.clip_eps_low, clip_eps_high=rl.clip_eps_high, is_mode=rl.is_mode,
      is_cap=rl.is_cap, logp_ref=batch.logp_ref if rl.kl_coef else None,
      kl_coef=rl.kl_coef, loss_agg=rl.loss_agg, is_level=rl.is_level, loss_norm=rl.loss_norm)
  aux = model_lib.aux_loss(out, config, batch.valid.reshape(-1))
  loss = loss + rl.aux_loss_coef * aux
  metrics = dict(metrics, aux_loss=aux)
  return loss, (metrics, out.taps)


def _grpo_step(state: TrainState, batch: RLBatch, *, config: ModelConfig,
               tx: optax.GradientTransformation, rl: RLConfig, tap_layers: tuple[int, ...] = (),
               tap_rows: int | None = None) -> tuple[TrainState, dict[str, jax.Array], Any]:
  """One on-policy GRPO update. Returns (state, metrics, taps of the training forward).

  metrics["nonfinite"]: the finite-values guard, bool per leaf of the new state (True: NaN or
  Inf); `checkpoints.check_state` names the first such leaf.

  taps: full-mode records of `tap_layers`' sites for the first `tap_rows` sequences (all if
  None), and every layer's routing for all sequences (when tap_layers is set).
  """
  (loss, (metrics, taps)), grads = jax.value_and_grad(_grpo_loss, has_aux=True)(
      state.params, config, rl, batch, tap_layers)
  taps = _trim_taps(taps, tap_rows)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  new = TrainState(step=state.step + 1, params=params, opt_state=opt_state)
  metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads),
                 nonfinite=integrity.nonfinite_flags(new))
  return new, metrics, taps


grpo_step = ShardedStep(_grpo_step, 3)


def _trim_taps(taps: Any, tap_rows: int | None) -> Any:
  """The taps of the first `tap_rows` sequences (all if None); routing stays whole."""
  if tap_rows is None:
    return taps
  return {layer: {site: v if site == "routing" else jax.tree.map(lambda a: a[:tap_rows], v)
                  for site, v in sites.items()} for layer, sites in taps.items()}


def policy_logprobs(params: Any, config: ModelConfig, rl: RLConfig, batch: RLBatch,
                    tap_layers: tuple[int, ...] = (), tap_rows: int | None = None
                    ) -> tuple[jax.Array, Any]:
  """(log pi(targets) [B, S], taps) of the training forward on `batch` without an update: the
  log-probs a batch's later updates clip against (`RLBatch.logp_old`), with the same guidance,
  routing and taps as an update's forward. On the params' mesh (`OnParamsMesh`)."""
  return _policy_logprobs(params, batch, config=config, rl=rl, tap_layers=tap_layers,
                          tap_rows=tap_rows)


def _policy_logprobs_fn(params, batch, config, rl, tap_layers, tap_rows):
  logp, out = token_logprobs(params, config, batch.inputs, batch.targets, batch.guidance,
                             batch.routing, tap_layers, "full", rl.routing_replay)
  return jax.lax.stop_gradient(logp), _trim_taps(out.taps, tap_rows)


_policy_logprobs = OnParamsMesh(_policy_logprobs_fn)


def reference_logprobs(params: Any, config: ModelConfig, inputs: jax.Array,
                       targets: jax.Array) -> jax.Array:
  """log pi_ref(targets | inputs) [B, S] of the reference policy's params (the KL term's); on
  the params' mesh, expert-parallel (`OnParamsMesh`)."""
  return _reference_logprobs(params, inputs, targets, config=config)


_reference_logprobs = OnParamsMesh(
    lambda params, inputs, targets, config: token_logprobs(params, config, inputs, targets)[0])


def _sft_loss(params, config: ModelConfig, batch: dict[str, Any]):
  logp, _ = token_logprobs(params, config, batch["inputs"], batch["targets"])
  mask = batch["loss_mask"].astype(jnp.float32)
  return -jnp.sum(logp * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def _sft_step(state: TrainState, batch: dict[str, Any], *, config: ModelConfig,
              tx: optax.GradientTransformation) -> tuple[TrainState, dict[str, jax.Array]]:
  """One supervised step: mean NLL of the demonstration tokens (metrics as `_grpo_step`'s:
  loss, grad_norm, nonfinite)."""
  loss, grads = jax.value_and_grad(_sft_loss)(state.params, config, batch)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  new = TrainState(step=state.step + 1, params=params, opt_state=opt_state)
  return new, {"loss": loss, "grad_norm": optax.tree.norm(grads),
               "nonfinite": integrity.nonfinite_flags(new)}


sft_step = ShardedStep(_sft_step, 2)
