"""GRPO losses and rollout/trainer mismatch metrics (docs/design.md §8), pure jnp over [B, T].

Three log-probs of the sampled tokens meet here:
- logp_new: the trainer's current policy (carries the gradient);
- logp_old: the trainer's policy that the batch is attributed to (no gradient). None means
  stop_gradient(logp_new): one update per batch, so the PPO ratio is 1 with gradient 1;
- logp_rollout: what the rollout engine (another kernel, another precision) reported when it
  sampled. The sampling policy really was pi_rollout, so each token's objective is weighted by
  the truncated importance weight min(pi_old / pi_rollout, C) (stop-gradient), or, in the
  masked variant, by pi_old / pi_rollout where that is <= C and 0 where it exceeds C.

The loss is the token-level PPO-clip objective averaged over all unmasked tokens of the batch
(every token counts equally, whatever its sequence's length), optionally plus kl_coef times the
k3 estimate of KL(pi_new || pi_ref) over the same tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

IS_MODES = ("none", "truncate", "mask")
# exp() of larger log-ratios would overflow float32; weights at the clamp are truncated or
# masked anyway.
_MAX_LOG_RATIO = 30.0

Metrics = dict[str, jax.Array]


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
  """Mean of x over mask == 1 (0 when the mask is empty)."""
  mask = mask.astype(jnp.float32)
  return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def _concrete(x) -> bool:
  """Whether a hyperparameter is a Python number (checkable), not a traced array."""
  return isinstance(x, (int, float))


def _check(name: str, x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  if x.shape != shape:
    raise ValueError(f"{name} has shape {x.shape}, expected {shape} (that of logp_new)")
  return x.astype(jnp.float32)


def _clean(x: jax.Array, on: jax.Array) -> jax.Array:
  """x where on, else 0 (float32).

  Padding may hold -inf or NaN log-probs; they must not reach sums or gradients (0 * NaN).
  """
  return jnp.where(on, x.astype(jnp.float32), 0.0)


def mismatch_metrics(logp_train: jax.Array, logp_rollout: jax.Array, mask: jax.Array) -> Metrics:
  """How far the trainer's log-probs are from the rollout's on the unmasked tokens.

  mean_abs_dlogp: mean |logp_train - logp_rollout|. k3_kl: the k3 estimate of
  KL(rollout || train) from rollout samples, mean of r - 1 - log r with r = pi_train/pi_rollout
  (non-negative per token, unbiased). max_abs_dp: max |pi_train - pi_rollout|.
  """
  on = mask.astype(bool)
  lt = jax.lax.stop_gradient(_clean(logp_train, on))
  lr = jax.lax.stop_gradient(_clean(logp_rollout, on))
  d = lt - lr
  return {
      "mean_abs_dlogp": masked_mean(jnp.abs(d), mask),
      "k3_kl": masked_mean(jnp.expm1(d) - d, mask),
      "max_abs_dp": jnp.max(jnp.where(on, jnp.abs(jnp.exp(lt) - jnp.exp(lr)), 0.0)),
  }


def importance_weights(logp_train: jax.Array, logp_rollout: jax.Array, mask: jax.Array, *,
                       mode: str = "truncate", cap: float = 5.0) -> tuple[jax.Array, Metrics]:
  """Stop-gradient token weights [B, T] correcting for sampling from pi_rollout, and metrics.

  truncate: min(r, cap); mask: r where r <= cap, else 0; none: 1. r = pi_train / pi_rollout.
  Metrics: is_weight_mean and is_capped_frac (tokens with r > cap), over the unmasked tokens.
  """
  if mode not in IS_MODES:
    raise ValueError(f"unknown importance-weight mode {mode!r}; expected one of {IS_MODES}")
  if _concrete(cap) and not cap > 0:
    raise ValueError(f"cap must be positive, got {cap}")
  on = mask.astype(bool)
  log_r = jax.lax.stop_gradient(_clean(logp_train, on) - _clean(logp_rollout, on))
  ratio = jnp.exp(jnp.minimum(log_r, _MAX_LOG_RATIO))
  capped = ratio > cap
  if mode == "truncate":
    w = jnp.minimum(ratio, cap)
  elif mode == "mask":
    w = jnp.where(capped, 0.0, ratio)
  else:
    w = jnp.ones_like(ratio)
  metrics = {"is_weight_mean": masked_mean(w, mask),
             "is_capped_frac": masked_mean(capped.astype(jnp.float32), mask)}
  return w, metrics


def k3_kl(logp: jax.Array, logp_ref: jax.Array) -> jax.Array:
  """Per-token k3 estimate of KL(pi || pi_ref) from samples of pi: e^(ref-logp) - (ref-logp) - 1.

  Differentiable in logp; its gradient is 1 - pi_ref / pi.
  """
  d = logp_ref - logp
  return jnp.expm1(d) - d


def ppo_clip_loss(logp_new: jax.Array, logp_old: jax.Array | None, advantages: jax.Array,
                  mask: jax.Array, *, logp_rollout: jax.Array | None = None,
                  clip_eps_low: float = 0.2, clip_eps_high: float = 0.2,
                  is_mode: str = "truncate", is_cap: float = 5.0,
                  logp_ref: jax.Array | None = None, kl_coef: float = 0.0
                  ) -> tuple[jax.Array, Metrics]:
  """Token-level PPO-clip loss with rollout importance weights; returns (loss, metrics).

  logp_*: [B, T] log-probs of the sampled tokens; advantages: [B] (per sequence) or [B, T];
  mask: [B, T], 1 on tokens the policy generated. Per token, with ratio = exp(new - old),
  objective = min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A); the loss is
  -sum(w * objective * mask) / sum(mask) (+ kl_coef * mean k3 KL to logp_ref), with w the
  importance weight of `is_mode` when logp_rollout is given, else 1.
  """
  shape = logp_new.shape
  if len(shape) != 2:
    raise ValueError(f"logp_new must be [B, T], got shape {shape}")
  if any(_concrete(e) and e < 0 for e in (clip_eps_low, clip_eps_high)):
    raise ValueError(f"clip epsilons must be >= 0, got {clip_eps_low}, {clip_eps_high}")
  if logp_ref is None and (not _concrete(kl_coef) or kl_coef != 0):
    raise ValueError("a nonzero (or traced) kl_coef needs logp_ref")
  m = _check("mask", jnp.asarray(mask), shape)
  on = m > 0
  new = _clean(logp_new, on)
  old = jax.lax.stop_gradient(new if logp_old is None else
                              _clean(_check("logp_old", logp_old, shape), on))
  adv = jnp.asarray(advantages, jnp.float32)
  if adv.shape == shape[:1]:
    adv = adv[:, None]
  elif adv.shape != shape:
    raise ValueError(f"advantages have shape {adv.shape}, expected {shape[:1]} or {shape}")
  adv = jax.lax.stop_gradient(_clean(jnp.broadcast_to(adv, shape), on))

  ratio = jnp.exp(new - old)
  hi, lo = 1.0 + clip_eps_high, 1.0 - clip_eps_low
  clip_high = (adv > 0) & (ratio > hi)  # here min(...) picks the clipped term: no gradient
  clip_low = (adv < 0) & (ratio < lo)
  bound = jnp.where(clip_high, hi, lo)
  objective = jnp.where(clip_high | clip_low, bound * adv, ratio * adv)

  metrics: Metrics = {}
  weight = jnp.ones_like(new)
  if logp_rollout is not None:
    rollout = _check("logp_rollout", logp_rollout, shape)
    weight, is_metrics = importance_weights(old, rollout, m, mode=is_mode, cap=is_cap)
    metrics.update(is_metrics)
    metrics.update(mismatch_metrics(old, rollout, m))

  pg_loss = -masked_mean(weight * objective, m)
  loss = pg_loss
  if logp_ref is not None:
    kl = masked_mean(k3_kl(new, _clean(_check("logp_ref", logp_ref, shape), on)), m)
    loss = loss + kl_coef * kl
    metrics["kl_ref"] = kl
  metrics.update({
      "loss": loss,
      "pg_loss": pg_loss,
      "clip_frac": masked_mean((clip_high | clip_low).astype(jnp.float32), m),
      "clip_frac_high": masked_mean(clip_high.astype(jnp.float32), m),
      "clip_frac_low": masked_mean(clip_low.astype(jnp.float32), m),
      "ratio_mean": masked_mean(jax.lax.stop_gradient(ratio), m),
      "num_tokens": jnp.sum(m),
  })
  return loss, metrics
