"""GRPO losses and rollout/trainer mismatch metrics (docs/design.md §8), pure jnp over [B, T].

Three log-probs of the sampled tokens meet here:
- logp_new: the trainer's current policy (carries the gradient);
- logp_old: the trainer's policy that the batch is attributed to (no gradient). None means
  stop_gradient(logp_new): one update per batch, so the PPO ratio is 1 with gradient 1;
- logp_rollout: what the rollout engine (another kernel, another precision) reported when it
  sampled. The sampling policy really was pi_rollout, so each token's objective is weighted by
  an importance weight pi_old / pi_rollout (stop-gradient), truncated at a cap (TIS) or zeroed
  above it (MIS): per token (`is_level="token"`), or one weight per sequence, the product of
  its tokens' ratios (`is_level="sequence"`, sequence-level TIS/MIS).

Per token the objective is PPO-clip's; the loss aggregates the tokens as `loss_agg` says
(`aggregate`, the modes verl's `agg_loss` names): by default the mean over all unmasked tokens
of the batch (every token counts equally, whatever its sequence's length). An optional
kl_coef times the k3 estimate of KL(pi_new || pi_ref) aggregates the same way.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

IS_MODES = ("none", "truncate", "mask")
IS_LEVELS = ("token", "sequence")
LOSS_AGGS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean",
             "seq_mean_token_sum_norm")
# exp() of larger log-ratios would overflow float32; weights at the clamp are truncated or
# masked anyway.
_MAX_LOG_RATIO = 30.0
# `ratio_extreme_frac` counts the tokens whose pi_train / pi_rollout leaves [1/2, 2].
_LOG_EXTREME_RATIO = math.log(2.0)

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


def _real_rows(mask: jax.Array) -> jax.Array:
  """float32 [B]: 1 for the rows with at least one loss token, 0 for padding rows."""
  return (jnp.sum(mask.astype(jnp.float32), axis=-1) > 0).astype(jnp.float32)


def aggregate(x: jax.Array, mask: jax.Array, mode: str = "token_mean",
              norm: float | jax.Array | None = None) -> jax.Array:
  """A scalar from per-token values x [B, T] over mask == 1 (x must be finite where mask is 0).

  token_mean: sum of all tokens / number of tokens (every token weighs the same).
  seq_mean_token_sum: each sequence's token sum, averaged over the sequences.
  seq_mean_token_mean: each sequence's token mean, averaged over the sequences.
  seq_mean_token_sum_norm: sum of all tokens / `norm`, a constant (Dr. GRPO's normaliser, such
    as the longest possible response); no average over the sequences, as in verl.

  The sequence means count only the rows with at least one loss token. A batch marks its
  padding rows (filler sequences that bring it to a fixed shape) by an all-zero `loss_mask`
  (`train/batch.py`); counting them, as a plain mean over rows would, would make the loss
  depend on how much filler a batch carries, so splitting a batch into mini-batches or padding
  it for a mesh would change the gradient of the same data. verl's `agg_loss` leaves fully
  masked rows out of these means too. An empty batch gives 0.
  """
  if mode not in LOSS_AGGS:
    raise ValueError(f"unknown loss_agg {mode!r}; expected one of {LOSS_AGGS}")
  if mode == "token_mean":
    return masked_mean(x, mask)
  m = mask.astype(jnp.float32)
  row_sum = jnp.sum(x * m, axis=-1)
  if mode == "seq_mean_token_sum_norm":
    if norm is None:
      raise ValueError("loss_agg 'seq_mean_token_sum_norm' needs loss_norm (a constant such as "
                       "the longest possible response)")
    if _concrete(norm) and not norm > 0:
      raise ValueError(f"loss_norm must be positive, got {norm}")
    return jnp.sum(row_sum) / norm
  if mode == "seq_mean_token_mean":
    row_sum = row_sum / jnp.maximum(jnp.sum(m, axis=-1), 1.0)
  real = _real_rows(m)
  return jnp.sum(row_sum * real) / jnp.maximum(jnp.sum(real), 1.0)


def mismatch_metrics(logp_train: jax.Array, logp_rollout: jax.Array, mask: jax.Array) -> Metrics:
  """How far the trainer's log-probs are from the rollout's on the unmasked tokens.

  mean_abs_dlogp: mean |logp_train - logp_rollout|. k3_kl: the k3 estimate of
  KL(rollout || train) from rollout samples, mean of r - 1 - log r with r = pi_train/pi_rollout
  (non-negative per token, unbiased). max_abs_dp: max |pi_train - pi_rollout|.
  ratio_extreme_frac: the share of tokens whose r leaves [0.5, 2] (the bounds count as inside).
  max_seq_log_ratio: over the sequences, the largest |sum of log r over a sequence's tokens|
  (the log of the sequence-level importance ratio, before any cap). All 0 without mismatch.
  """
  on = mask.astype(bool)
  lt = jax.lax.stop_gradient(_clean(logp_train, on))
  lr = jax.lax.stop_gradient(_clean(logp_rollout, on))
  d = lt - lr
  return {
      "mean_abs_dlogp": masked_mean(jnp.abs(d), mask),
      "k3_kl": masked_mean(jnp.expm1(d) - d, mask),
      "max_abs_dp": jnp.max(jnp.where(on, jnp.abs(jnp.exp(lt) - jnp.exp(lr)), 0.0)),
      "ratio_extreme_frac": masked_mean(
          (jnp.abs(d) > _LOG_EXTREME_RATIO).astype(jnp.float32), mask),
      "max_seq_log_ratio": jnp.max(jnp.abs(jnp.sum(d, axis=-1))),
  }


def importance_weights(logp_train: jax.Array, logp_rollout: jax.Array, mask: jax.Array, *,
                       mode: str = "truncate", cap: float = 5.0, level: str = "token"
                       ) -> tuple[jax.Array, Metrics]:
  """Stop-gradient weights [B, T] correcting for sampling from pi_rollout, and metrics.

  r = pi_train / pi_rollout per token (level "token"), or per sequence the product of its
  tokens' ratios, exp(sum of their log-ratios) (level "sequence": every token of a sequence
  gets its sequence's weight). truncate: min(r, cap); mask: r where r <= cap, else 0; none: 1.
  Log-ratios are clamped before exp, so a long sequence's product cannot overflow.
  Metrics, over the unmasked tokens (level "token") or over the sequences with at least one
  unmasked token (level "sequence"): is_weight_mean, and is_capped_frac, the share with r > cap.
  """
  if mode not in IS_MODES:
    raise ValueError(f"unknown importance-weight mode {mode!r}; expected one of {IS_MODES}")
  if level not in IS_LEVELS:
    raise ValueError(f"unknown importance-weight level {level!r}; expected one of {IS_LEVELS}")
  if _concrete(cap) and not cap > 0:
    raise ValueError(f"cap must be positive, got {cap}")
  on = mask.astype(bool)
  log_r = jax.lax.stop_gradient(_clean(logp_train, on) - _clean(logp_rollout, on))
  count = mask
  if level == "sequence":
    log_r = jnp.sum(log_r, axis=-1, keepdims=True)  # [B, 1]
    count = _real_rows(mask)[:, None]
  ratio = jnp.exp(jnp.minimum(log_r, _MAX_LOG_RATIO))
  capped = ratio > cap
  if mode == "truncate":
    w = jnp.minimum(ratio, cap)
  elif mode == "mask":
    w = jnp.where(capped, 0.0, ratio)
  else:
    w = jnp.ones_like(ratio)
  metrics = {"is_weight_mean": masked_mean(w, count),
             "is_capped_frac": masked_mean(capped.astype(jnp.float32), count)}
  return jnp.broadcast_to(w, mask.shape), metrics


def k3_kl(logp: jax.Array, logp_ref: jax.Array) -> jax.Array:
  """Per-token k3 estimate of KL(pi || pi_ref) from samples of pi: e^(ref-logp) - (ref-logp) - 1.

  Differentiable in logp; its gradient is 1 - pi_ref / pi.
  """
  d = logp_ref - logp
  return jnp.expm1(d) - d


def _check_hyperparameters(shape: tuple[int, ...], clip_eps_low, clip_eps_high, logp_ref,
                           kl_coef, is_level: str) -> None:
  """Argument checks before any array work (loss_agg, is_mode and is_cap: where they are used)."""
  if len(shape) != 2:
    raise ValueError(f"logp_new must be [B, T], got shape {shape}")
  if any(_concrete(e) and e < 0 for e in (clip_eps_low, clip_eps_high)):
    raise ValueError(f"clip epsilons must be >= 0, got {clip_eps_low}, {clip_eps_high}")
  if logp_ref is None and (not _concrete(kl_coef) or kl_coef != 0):
    raise ValueError("a nonzero (or traced) kl_coef needs logp_ref")
  if is_level not in IS_LEVELS:
    raise ValueError(f"unknown is_level {is_level!r}; expected one of {IS_LEVELS}")


def _clipped_objective(new: jax.Array, old: jax.Array, adv: jax.Array, clip_eps_low,
                       clip_eps_high) -> tuple[jax.Array, ...]:
  """Per-token min(ratio * A, clip(ratio, 1 - low, 1 + high) * A), ratio = exp(new - old);
  returns (objective, ratio, clip_high, clip_low), the masks where the clipped term wins."""
  ratio = jnp.exp(new - old)
  hi, lo = 1.0 + clip_eps_high, 1.0 - clip_eps_low
  clip_high = (adv > 0) & (ratio > hi)  # here min(...) picks the clipped term: no gradient
  clip_low = (adv < 0) & (ratio < lo)
  bound = jnp.where(clip_high, hi, lo)
  objective = jnp.where(clip_high | clip_low, bound * adv, ratio * adv)
  return objective, ratio, clip_high, clip_low


def ppo_clip_loss(logp_new: jax.Array, logp_old: jax.Array | None, advantages: jax.Array,
                  mask: jax.Array, *, logp_rollout: jax.Array | None = None,
                  clip_eps_low: float = 0.2, clip_eps_high: float = 0.2,
                  is_mode: str = "truncate", is_cap: float = 5.0, is_level: str = "token",
                  logp_ref: jax.Array | None = None, kl_coef: float = 0.0,
                  loss_agg: str = "token_mean", loss_norm: float | None = None
                  ) -> tuple[jax.Array, Metrics]:
  """PPO-clip loss with rollout importance weights; returns (loss, metrics).

  logp_*: [B, T] log-probs of the sampled tokens; advantages: [B] (per sequence) or [B, T];
  mask: [B, T], 1 on tokens the policy generated. Per token, with ratio = exp(new - old),
  objective = min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A); the loss is
  -aggregate(w * objective) (+ kl_coef * aggregate(k3 KL to logp_ref)), aggregated by
  `loss_agg` (`aggregate`; loss_norm: the constant of "seq_mean_token_sum_norm", ignored by
  the other modes), with w the importance weight of `is_mode` at `is_level`
  (`importance_weights`) when logp_rollout is given, else 1. The defaults give the token mean
  -sum(w * objective * mask) / sum(mask) with per-token truncated weights.
  Metrics: loss, pg_loss, kl_ref (with logp_ref), the clip fractions and ratio_mean over the
  tokens, and with logp_rollout the importance and `mismatch_metrics` of pi_old vs pi_rollout.
  """
  shape = logp_new.shape
  _check_hyperparameters(shape, clip_eps_low, clip_eps_high, logp_ref, kl_coef, is_level)
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
  objective, ratio, clip_high, clip_low = _clipped_objective(new, old, adv, clip_eps_low,
                                                             clip_eps_high)

  metrics: Metrics = {}
  weight = jnp.ones_like(new)
  if logp_rollout is not None:
    rollout = _check("logp_rollout", logp_rollout, shape)
    weight, is_metrics = importance_weights(old, rollout, m, mode=is_mode, cap=is_cap,
                                            level=is_level)
    metrics.update(is_metrics)
    metrics.update(mismatch_metrics(old, rollout, m))

  pg_loss = -aggregate(weight * objective, m, loss_agg, loss_norm)
  loss = pg_loss
  if logp_ref is not None:
    kl = aggregate(k3_kl(new, _clean(_check("logp_ref", logp_ref, shape), on)), m, loss_agg,
                   loss_norm)
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
