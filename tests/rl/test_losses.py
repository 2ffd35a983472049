"""PPO-clip loss, importance weights, KL and mismatch metrics against hand-computed cases and,
for each loss aggregation and importance level x mode, a float64 numpy reference (values and
gradients)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax.rl import losses

LOG_HALF = np.log(0.5)
# Jitted once per signature: much faster on CPU than op-by-op dispatch.
ppo_clip_loss = jax.jit(losses.ppo_clip_loss, static_argnames=(
    "clip_eps_low", "clip_eps_high", "is_mode", "is_cap", "kl_coef"))
importance_weights = jax.jit(losses.importance_weights, static_argnames=("mode", "cap"))
mismatch_metrics = jax.jit(losses.mismatch_metrics)
k3_kl = jax.jit(losses.k3_kl)


def _logp_new(ratios, logp_old=LOG_HALF):
  return jnp.asarray(logp_old + np.log(np.asarray(ratios, np.float64)), jnp.float32)


def test_ppo_clip_hand_computed():
  # ratios [1.1, 1.5, 0.5, 0.9], advantages [1, 1, -1, -1], eps 0.2, last token masked:
  #   t0: min(1.1, 1.1) = 1.1; t1: min(1.5, 1.2) = 1.2 (clipped high);
  #   t2: min(-0.5, -0.8) = -0.8 (clipped low); t3 masked.  loss = -(1.1 + 1.2 - 0.8) / 3 = -0.5.
  old = jnp.full((1, 4), LOG_HALF, jnp.float32)
  new = _logp_new([[1.1, 1.5, 0.5, 0.9]])
  adv = jnp.array([[1.0, 1.0, -1.0, -1.0]])
  mask = jnp.array([[1, 1, 1, 0]])
  loss, m = ppo_clip_loss(new, old, adv, mask)
  np.testing.assert_allclose(loss, -0.5, rtol=1e-5)
  np.testing.assert_allclose(m["pg_loss"], -0.5, rtol=1e-5)
  np.testing.assert_allclose(m["clip_frac"], 2 / 3, rtol=1e-6)
  np.testing.assert_allclose(m["clip_frac_high"], 1 / 3, rtol=1e-6)
  np.testing.assert_allclose(m["clip_frac_low"], 1 / 3, rtol=1e-6)
  np.testing.assert_allclose(m["ratio_mean"], (1.1 + 1.5 + 0.5) / 3, rtol=1e-5)
  assert float(m["num_tokens"]) == 3


def test_ppo_clip_sequence_advantages_token_mean():
  # Row 0: A = 2, ratios [1.0, 1.3, 0.9] -> 2, 2.4 (clipped), 1.8.
  # Row 1: A = -1, ratios [0.7, 1.1, 2.0], last masked -> -0.8 (clipped), -1.1.
  # Token mean over the 5 tokens: loss = -(2 + 2.4 + 1.8 - 0.8 - 1.1) / 5 = -0.86.
  old = jnp.full((2, 3), LOG_HALF, jnp.float32)
  new = _logp_new([[1.0, 1.3, 0.9], [0.7, 1.1, 2.0]])
  mask = jnp.array([[1, 1, 1], [1, 1, 0]], jnp.float32)
  loss, _ = ppo_clip_loss(new, old, jnp.array([2.0, -1.0]), mask)
  np.testing.assert_allclose(loss, -0.86, rtol=1e-5)


def test_asymmetric_clip():
  # eps_low 0.1, eps_high 0.3: ratio 1.25 with A=1 is inside (1.25); ratio 0.85 with A=-1
  # is below 0.9 -> -0.9. loss = -(1.25 - 0.9) / 2 = -0.175.
  old = jnp.full((1, 2), LOG_HALF, jnp.float32)
  loss, m = ppo_clip_loss(_logp_new([[1.25, 0.85]]), old, jnp.array([[1.0, -1.0]]),
                          jnp.ones((1, 2)), clip_eps_low=0.1, clip_eps_high=0.3)
  np.testing.assert_allclose(loss, -0.175, rtol=1e-5)
  np.testing.assert_allclose(m["clip_frac_low"], 0.5)
  np.testing.assert_allclose(m["clip_frac_high"], 0.0)


def test_gradient_equals_analytic_hand_case():
  # d loss / d logp_new_t = -w_t * r_t * A_t * m_t / N on unclipped tokens, 0 on clipped ones.
  # ratios [1.1, 1.5, 0.5, 0.9, 0.95], A [1, 1, -1, -1, 2], mask [1, 1, 1, 1, 0], N = 4:
  #   t0: -1.1 / 4 = -0.275; t1 clipped: 0; t2 clipped: 0; t3: 0.9 / 4 = 0.225; t4 masked: 0.
  old = jnp.full((1, 5), LOG_HALF, jnp.float32)
  adv = jnp.array([[1.0, 1.0, -1.0, -1.0, 2.0]])
  mask = jnp.array([[1, 1, 1, 1, 0]])
  grad = jax.grad(lambda n: ppo_clip_loss(n, old, adv, mask)[0])(
      _logp_new([[1.1, 1.5, 0.5, 0.9, 0.95]]))
  np.testing.assert_allclose(grad, [[-0.275, 0.0, 0.0, 0.225, 0.0]], atol=1e-6)


def _reference_loss(new, old, rollout, ref, adv, mask, el, eh, cap, kl_coef, mode):
  """float64 numpy PPO-clip loss in the min(...) form, and its analytic gradient."""
  r = np.exp(new - old)
  obj = np.minimum(r * adv, np.clip(r, 1 - el, 1 + eh) * adv)
  w_raw = np.exp(old - rollout)
  w = np.minimum(w_raw, cap) if mode == "truncate" else np.where(w_raw > cap, 0.0, w_raw)
  n = mask.sum()
  kl = np.exp(ref - new) - (ref - new) - 1
  loss = -(w * obj * mask).sum() / n + kl_coef * (kl * mask).sum() / n
  active = ~(((adv > 0) & (r > 1 + eh)) | ((adv < 0) & (r < 1 - el)))
  grad = (-w * r * adv * active + kl_coef * (1 - np.exp(ref - new))) * mask / n
  return loss, grad


@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_loss_and_gradient_match_float64_reference(mode):
  rng = np.random.default_rng(1)
  shape = (3, 7)
  old = np.log(rng.uniform(0.05, 0.95, shape))
  new = old + rng.normal(0, 0.3, shape)
  rollout = old + rng.normal(0, 1.0, shape)  # some ratios above the cap
  ref = old + rng.normal(0, 0.2, shape)
  adv = rng.normal(size=(3, 1)) * np.ones(shape)
  mask = (rng.uniform(size=shape) < 0.8).astype(np.float64)
  args = dict(el=0.2, eh=0.28, cap=2.0, kl_coef=0.1, mode=mode)
  want_loss, want_grad = _reference_loss(new, old, rollout, ref, adv, mask, **args)
  f32 = functools.partial(jnp.asarray, dtype=jnp.float32)

  def loss_fn(n):
    return ppo_clip_loss(n, f32(old), f32(adv[:, 0]), f32(mask), logp_rollout=f32(rollout),
                         clip_eps_low=0.2, clip_eps_high=0.28, is_mode=mode, is_cap=2.0,
                         logp_ref=f32(ref), kl_coef=0.1)

  (loss, m), grad = jax.value_and_grad(loss_fn, has_aux=True)(f32(new))
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-6)
  assert 0 < float(m["is_capped_frac"]) < 1


def test_on_policy_when_logp_old_is_none():
  # ratio == 1, gradient -A * m / N: A [[1, -2, 3]], mask [1, 1, 0] -> loss -(1 - 2) / 2 = 0.5,
  # grad [-0.5, 1.0, 0].
  new = jnp.log(jnp.array([[0.3, 0.6, 0.9]]))
  adv, mask = jnp.array([[1.0, -2.0, 3.0]]), jnp.array([[1, 1, 0]])
  (loss, m), grad = jax.value_and_grad(
      lambda n: ppo_clip_loss(n, None, adv, mask), has_aux=True)(new)
  np.testing.assert_allclose(loss, 0.5, rtol=1e-6)
  np.testing.assert_allclose(grad, [[-0.5, 1.0, 0.0]], atol=1e-6)
  assert float(m["clip_frac"]) == 0.0


def test_importance_weights_truncate_and_mask():
  # pi_train / pi_rollout = [0.5, 1, 2, 6, 10], cap 5.
  ratios = np.array([[0.5, 1.0, 2.0, 6.0, 10.0]])
  train = jnp.full((1, 5), np.log(0.05), jnp.float32)
  rollout = jnp.asarray(np.log(0.05) - np.log(ratios), jnp.float32)
  mask = jnp.ones((1, 5))
  w, m = importance_weights(train, rollout, mask, mode="truncate", cap=5.0)
  np.testing.assert_allclose(w, [[0.5, 1.0, 2.0, 5.0, 5.0]], rtol=1e-5)
  np.testing.assert_allclose(m["is_weight_mean"], 13.5 / 5, rtol=1e-5)
  np.testing.assert_allclose(m["is_capped_frac"], 0.4, rtol=1e-6)
  w, m = importance_weights(train, rollout, mask, mode="mask", cap=5.0)
  np.testing.assert_allclose(w, [[0.5, 1.0, 2.0, 0.0, 0.0]], rtol=1e-5)
  np.testing.assert_allclose(m["is_weight_mean"], 3.5 / 5, rtol=1e-5)
  w, _ = importance_weights(train, rollout, mask, mode="none")
  np.testing.assert_array_equal(w, np.ones((1, 5)))
  # The weight is a constant for the gradient.
  g = jax.grad(lambda t: jnp.sum(importance_weights(t, rollout, mask)[0]))(train)
  np.testing.assert_array_equal(g, np.zeros((1, 5)))
  # Overflowing log-ratios stay finite.
  w, m = importance_weights(jnp.zeros((1, 1)), jnp.full((1, 1), -200.0), jnp.ones((1, 1)))
  assert float(w[0, 0]) == 5.0 and np.isfinite(float(m["is_weight_mean"]))


def test_importance_weight_in_loss_truncated_vs_masked():
  # Hand case of test_ppo_clip_hand_computed with pi_old / pi_rollout = [2, 8, 0.5, 1]:
  #   truncate: w = [2, 5, 0.5, 1] -> loss = -(2 * 1.1 + 5 * 1.2 + 0.5 * -0.8) / 3 = -2.6
  #   mask:     w = [2, 0, 0.5, 1] -> loss = -(2 * 1.1 + 0 + 0.5 * -0.8) / 3 = -0.6
  old = jnp.full((1, 4), LOG_HALF, jnp.float32)
  rollout = jnp.asarray(LOG_HALF - np.log([[2.0, 8.0, 0.5, 1.0]]), jnp.float32)
  new = _logp_new([[1.1, 1.5, 0.5, 0.9]])
  adv, mask = jnp.array([[1.0, 1.0, -1.0, -1.0]]), jnp.array([[1, 1, 1, 0]])
  loss_t, m_t = ppo_clip_loss(new, old, adv, mask, logp_rollout=rollout, is_mode="truncate")
  loss_m, m_m = ppo_clip_loss(new, old, adv, mask, logp_rollout=rollout, is_mode="mask")
  loss_n, _ = ppo_clip_loss(new, old, adv, mask, logp_rollout=rollout, is_mode="none")
  np.testing.assert_allclose(loss_t, -2.6, rtol=1e-5)
  np.testing.assert_allclose(loss_m, -0.6, rtol=1e-5)
  np.testing.assert_allclose(loss_n, -0.5, rtol=1e-5)
  np.testing.assert_allclose(m_t["is_capped_frac"], 1 / 3, rtol=1e-6)
  np.testing.assert_allclose(m_m["is_weight_mean"], 2.5 / 3, rtol=1e-5)


def test_mismatch_metrics_hand_computed():
  # pi_train [0.5, 0.2, 0.9], pi_rollout [0.4, 0.25, 0.1], last token masked.
  #   |dlogp| = |log 1.25| = |log 0.8| = 0.2231436 -> mean 0.2231436.
  #   k3 = r - 1 - log r: r = 1.25 -> 0.0268564, r = 0.8 -> 0.0231436; mean 0.025.
  #   max |dp| = max(0.1, 0.05) = 0.1 (the masked token's 0.8 is ignored).
  train = jnp.log(jnp.array([[0.5, 0.2, 0.9]]))
  rollout = jnp.log(jnp.array([[0.4, 0.25, 0.1]]))
  m = mismatch_metrics(train, rollout, jnp.array([[1, 1, 0]]))
  np.testing.assert_allclose(m["mean_abs_dlogp"], 0.2231436, rtol=1e-5)
  np.testing.assert_allclose(m["k3_kl"], 0.025, rtol=1e-4)
  np.testing.assert_allclose(m["max_abs_dp"], 0.1, rtol=1e-5)
  same = mismatch_metrics(train, train, jnp.ones((1, 3)))
  assert all(float(v) == 0.0 for v in same.values())


def test_loss_reports_mismatch_between_old_and_rollout():
  old = jnp.log(jnp.array([[0.5, 0.2]]))
  rollout = jnp.log(jnp.array([[0.4, 0.25]]))
  _, m = ppo_clip_loss(old, old, jnp.zeros((1,)), jnp.ones((1, 2)), logp_rollout=rollout)
  np.testing.assert_allclose(m["mean_abs_dlogp"], 0.2231436, rtol=1e-5)
  np.testing.assert_allclose(m["k3_kl"], 0.025, rtol=1e-4)


def test_k3_kl_to_reference():
  # p = 0.5, p_ref = 0.25: k3 = 0.5 - 1 - log 0.5 = 0.1931472; d/dlogp = 1 - 0.5 = 0.5.
  new, ref = jnp.log(jnp.array([[0.5]])), jnp.log(jnp.array([[0.25]]))
  np.testing.assert_allclose(k3_kl(new, ref), [[0.1931472]], rtol=1e-5)
  np.testing.assert_allclose(jax.grad(lambda n: k3_kl(n, ref).sum())(new), [[0.5]], rtol=1e-5)
  # In the loss with zero advantages: loss = kl_coef * k3.
  loss, m = ppo_clip_loss(new, None, jnp.zeros((1,)), jnp.ones((1, 1)), logp_ref=ref,
                          kl_coef=0.1)
  np.testing.assert_allclose(loss, 0.01931472, rtol=1e-5)
  np.testing.assert_allclose(m["kl_ref"], 0.1931472, rtol=1e-5)


def test_empty_mask_gives_zero_loss():
  loss, m = ppo_clip_loss(jnp.zeros((2, 3)), None, jnp.ones((2,)), jnp.zeros((2, 3)))
  assert float(loss) == 0.0 and float(m["num_tokens"]) == 0.0


def test_bad_arguments():
  x = jnp.zeros((2, 3))
  with pytest.raises(ValueError, match="expected"):
    ppo_clip_loss(x, jnp.zeros((2, 4)), jnp.ones(2), jnp.ones((2, 3)))
  with pytest.raises(ValueError, match="advantages"):
    ppo_clip_loss(x, None, jnp.ones(3), jnp.ones((2, 3)))
  with pytest.raises(ValueError, match="logp_ref"):
    ppo_clip_loss(x, None, jnp.ones(2), jnp.ones((2, 3)), kl_coef=0.1)
  with pytest.raises(ValueError, match="mode"):
    ppo_clip_loss(x, None, jnp.ones(2), jnp.ones((2, 3)), logp_rollout=x, is_mode="clip")


def test_hyperparameters_may_be_traced():
  # Inside a jitted train step the coefficients may arrive as arrays (e.g. from a schedule).
  @jax.jit
  def f(new, eps, cap, kl_coef):
    return losses.ppo_clip_loss(new, None, jnp.ones((1,)), jnp.ones((1, 2)),
                                logp_rollout=new - 0.1, clip_eps_low=eps, clip_eps_high=eps,
                                is_cap=cap, logp_ref=new, kl_coef=kl_coef)[0]

  # On-policy ratio 1, A = 1, w = min(e^0.1, 5), KL to itself 0: loss = -e^0.1.
  np.testing.assert_allclose(f(jnp.full((1, 2), -1.0), 0.2, 5.0, 0.1), -np.exp(0.1), rtol=1e-5)


def test_garbage_in_padding_does_not_leak():
  # Padded positions may carry -inf / NaN log-probs; loss, metrics and gradient ignore them.
  new = jnp.array([[-0.5, -1.0, -jnp.inf], [-0.2, jnp.nan, -jnp.inf]])
  clean = jnp.where(jnp.isfinite(new), new, -1.0)
  mask = jnp.array([[1, 1, 0], [1, 0, 0]])
  old, rollout = clean - 0.05, jnp.where(jnp.isfinite(new), clean - 0.1, jnp.nan)

  def run(n, r):
    return jax.value_and_grad(lambda x: ppo_clip_loss(
        x, old, jnp.array([1.0, -1.0]), mask, logp_rollout=r, logp_ref=x - 0.2,
        kl_coef=0.1), has_aux=True)(n)

  (loss, m), grad = run(new, rollout)
  (want, want_m), want_grad = run(clean, clean - 0.1)
  assert np.isfinite(float(loss)) and np.all(np.isfinite(grad))
  np.testing.assert_allclose(loss, want, rtol=1e-6)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-6)
  for k in want_m:
    np.testing.assert_allclose(m[k], want_m[k], rtol=1e-6, err_msg=k)


# ---------------------------------------------------------------------------- loss variants

ppo_variant_loss = jax.jit(losses.ppo_clip_loss, static_argnames=(
    "clip_eps_low", "clip_eps_high", "is_mode", "is_cap", "is_level", "kl_coef", "loss_agg",
    "loss_norm"))
importance_weights_seq = jax.jit(functools.partial(losses.importance_weights, level="sequence"),
                                 static_argnames=("mode", "cap"))

# Ragged loss masks [6, 10]: a completion after a prompt, a short one inside the row, a
# multi-turn row with holes, a padding row (no loss token), a one-token row and a full row.
RAGGED_MASK = np.array([
    [0, 0, 1, 1, 1, 1, 1, 1, 1, 1],
    [0, 0, 0, 0, 1, 1, 1, 0, 0, 0],
    [0, 1, 1, 0, 0, 1, 1, 1, 0, 0],
    [0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    [0, 0, 0, 0, 0, 0, 0, 1, 0, 0],
    [1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
], np.float64)
SEQ_CAP = 2.0


def _ragged_batch(seed):
  """float64 log-probs with garbage (-inf, NaN) where the mask is 0, and advantages [B]."""
  rng = np.random.default_rng(seed)
  shape = RAGGED_MASK.shape
  old = np.log(rng.uniform(0.05, 0.95, shape))
  new = old + rng.normal(0, 0.3, shape)  # some ratios outside [0.8, 1.28]: clipping fires
  rollout = old + rng.normal(0, 0.5, shape)  # some tokens and sequences above the cap
  ref = old + rng.normal(0, 0.2, shape)
  adv = rng.normal(size=shape[0])
  off = RAGGED_MASK == 0
  new[off], old[off], rollout[off], ref[off] = -np.inf, np.nan, np.nan, -np.inf
  return {"new": new, "old": old, "rollout": rollout, "ref": ref, "adv": adv}


def _reference_token_losses(b, mask, *, level, mode, cap, el, eh, kl_coef):
  """Per row, (token losses, d loss / d logp_new) over its loss tokens, in float64 numpy.

  token loss = -w * min(r A, clip(r) A) + kl_coef * k3; w per token, or the product of the
  row's token ratios pi_old / pi_rollout (level "sequence"), truncated or masked at cap.
  """
  out = []
  for i in range(mask.shape[0]):
    idx = np.flatnonzero(mask[i])
    new, old, ref = b["new"][i, idx], b["old"][i, idx], b["ref"][i, idx]
    raw = np.exp(old - b["rollout"][i, idx])
    if level == "sequence":
      raw = np.full(idx.size, np.prod(raw))
    w = {"truncate": np.minimum(raw, cap), "mask": np.where(raw > cap, 0.0, raw),
         "none": np.ones_like(raw)}[mode]
    r, a = np.exp(new - old), b["adv"][i]
    obj = np.minimum(r * a, np.clip(r, 1 - el, 1 + eh) * a)
    kl = np.exp(ref - new) - (ref - new) - 1
    active = ~(((a > 0) & (r > 1 + eh)) | ((a < 0) & (r < 1 - el)))
    grad = -w * r * a * active + kl_coef * (1 - np.exp(ref - new))
    out.append((-w * obj + kl_coef * kl, grad))
  return out


def _reference_aggregate(per_row, agg, norm):
  """(loss, per-row gradient scale) of per-row token values, as verl's agg_loss aggregates
  them; rows without a loss token are left out of the sequence means."""
  rows = [v for v in per_row if v.size]
  n_tok = sum(v.size for v in rows)
  if agg == "token_mean":
    return sum(v.sum() for v in rows) / n_tok, [1 / n_tok] * len(per_row)
  if agg == "seq_mean_token_sum":
    return np.mean([v.sum() for v in rows]), [1 / len(rows)] * len(per_row)
  if agg == "seq_mean_token_mean":
    return (np.mean([v.mean() for v in rows]),
            [1 / (len(rows) * max(v.size, 1)) for v in per_row])
  return sum(v.sum() for v in rows) / norm, [1 / norm] * len(per_row)


def _reference(b, mask, agg, norm, **kw):
  """float64 loss and analytic gradient [B, T] (0 off the mask)."""
  per_row = _reference_token_losses(b, mask, **kw)
  loss, scale = _reference_aggregate([v for v, _ in per_row], agg, norm)
  grad = np.zeros(mask.shape)
  for i, (_, g) in enumerate(per_row):
    grad[i, np.flatnonzero(mask[i])] = g * scale[i]
  return loss, grad


def _finite_difference(b, mask, agg, norm, h=1e-6, **kw):
  """Central differences of the float64 reference loss in each loss token's logp_new."""
  grad = np.zeros(mask.shape)
  for i, t in zip(*np.nonzero(mask)):
    hi, lo = dict(b, new=b["new"].copy()), dict(b, new=b["new"].copy())
    hi["new"][i, t] += h
    lo["new"][i, t] -= h
    grad[i, t] = (_reference(hi, mask, agg, norm, **kw)[0] -
                  _reference(lo, mask, agg, norm, **kw)[0]) / (2 * h)
  return grad


def _run_variant(b, mask, *, agg, norm, level, mode, cap, el=0.2, eh=0.28, kl_coef=0.1):
  f32 = functools.partial(jnp.asarray, dtype=jnp.float32)

  def loss_fn(n):
    return ppo_variant_loss(n, f32(b["old"]), f32(b["adv"]), f32(mask),
                            logp_rollout=f32(b["rollout"]), clip_eps_low=el, clip_eps_high=eh,
                            is_mode=mode, is_cap=cap, is_level=level, logp_ref=f32(b["ref"]),
                            kl_coef=kl_coef, loss_agg=agg, loss_norm=norm)

  return jax.value_and_grad(loss_fn, has_aux=True)(f32(b["new"]))


def _check_against_reference(b, mask, *, agg, norm, level, mode, cap):
  kw = dict(level=level, mode=mode, cap=cap, el=0.2, eh=0.28, kl_coef=0.1)
  want_loss, want_grad = _reference(b, mask, agg, norm, **kw)
  # The analytic reference gradient is itself checked against finite differences.
  np.testing.assert_allclose(want_grad, _finite_difference(b, mask, agg, norm, **kw),
                             rtol=1e-5, atol=1e-8)
  (loss, m), grad = _run_variant(b, mask, agg=agg, norm=norm, level=level, mode=mode, cap=cap)
  assert np.all(np.isfinite(grad))
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-6)
  return m


@pytest.mark.parametrize("agg,norm", [
    pytest.param("token_mean", None, id="token_mean"),
    pytest.param("seq_mean_token_sum", None, id="seq_mean_token_sum"),
    pytest.param("seq_mean_token_mean", None, id="seq_mean_token_mean"),
    pytest.param("seq_mean_token_sum_norm", 12.0, id="seq_mean_token_sum_norm"),
])
def test_loss_agg_matches_float64_reference(agg, norm):
  b = _ragged_batch(3)
  m = _check_against_reference(b, RAGGED_MASK, agg=agg, norm=norm, level="token",
                               mode="truncate", cap=SEQ_CAP)
  assert 0 < float(m["clip_frac"]) < 1  # both sides of the clip are exercised
  # The padding row changes nothing: the same batch without it gives the same loss.
  keep = RAGGED_MASK.sum(1) > 0
  (loss, _), grad = _run_variant(b, RAGGED_MASK, agg=agg, norm=norm, level="token",
                                 mode="truncate", cap=SEQ_CAP)
  (loss_kept, _), grad_kept = _run_variant(
      {k: v[keep] for k, v in b.items()}, RAGGED_MASK[keep], agg=agg, norm=norm,
      level="token", mode="truncate", cap=SEQ_CAP)
  np.testing.assert_allclose(loss, loss_kept, rtol=1e-6)
  np.testing.assert_allclose(grad[keep], grad_kept, rtol=1e-6)


@pytest.mark.parametrize("level,mode", [
    pytest.param(level, mode, id=f"{level}-{mode}")
    for level in ("token", "sequence") for mode in ("truncate", "mask", "none")])
def test_importance_variant_matches_float64_reference(level, mode):
  b = _ragged_batch(3)
  m = _check_against_reference(b, RAGGED_MASK, agg="token_mean", norm=None, level=level,
                               mode=mode, cap=SEQ_CAP)
  # is_capped_frac: the share of loss tokens (token) or of real sequences (sequence) whose
  # pi_old / pi_rollout exceeds the cap; this batch has some on each side.
  on = RAGGED_MASK > 0
  log_r = np.where(on, b["old"] - b["rollout"], 0.0)
  if level == "token":
    want = np.sum((np.exp(log_r) > SEQ_CAP) & on) / on.sum()
  else:
    real = on.any(1)
    want = np.sum(np.exp(log_r.sum(1))[real] > SEQ_CAP) / real.sum()
  assert 0 < want < 1
  np.testing.assert_allclose(m["is_capped_frac"], want, rtol=1e-6)


def test_sequence_masked_weights_with_sequence_mean_match_reference():
  b = _ragged_batch(4)
  _check_against_reference(b, RAGGED_MASK, agg="seq_mean_token_mean", norm=None,
                           level="sequence", mode="mask", cap=SEQ_CAP)


@pytest.mark.parametrize("agg,norm,want", [
    # Row 0: A = 2, ratios [1.0, 1.3, 0.9] -> objectives 2, 2.4 (clipped), 1.8: sum 6.2.
    # Row 1: A = -1, ratios [0.7, 1.1, (masked)] -> -0.8 (clipped), -1.1: sum -1.9.
    # Row 2: padding (no loss token).
    pytest.param("token_mean", None, -(6.2 - 1.9) / 5, id="token_mean"),
    pytest.param("seq_mean_token_sum", None, -(6.2 - 1.9) / 2, id="seq_mean_token_sum"),
    pytest.param("seq_mean_token_mean", None, -(6.2 / 3 - 1.9 / 2) / 2,
                 id="seq_mean_token_mean"),
    pytest.param("seq_mean_token_sum_norm", 4.0, -(6.2 - 1.9) / 4,
                 id="seq_mean_token_sum_norm"),
])
def test_loss_agg_hand_computed(agg, norm, want):
  old = jnp.full((3, 3), LOG_HALF, jnp.float32)
  new = _logp_new([[1.0, 1.3, 0.9], [0.7, 1.1, 2.0], [1.0, 1.0, 1.0]])
  mask = jnp.array([[1, 1, 1], [1, 1, 0], [0, 0, 0]], jnp.float32)
  loss, _ = ppo_variant_loss(new, old, jnp.array([2.0, -1.0, 5.0]), mask, loss_agg=agg,
                             loss_norm=norm)
  np.testing.assert_allclose(loss, want, rtol=1e-5)


@pytest.mark.parametrize("agg", list(losses.LOSS_AGGS))
def test_kl_term_aggregates_like_the_policy_loss(agg):
  # Zero advantages: the loss is kl_coef times the KL aggregated the same way. Row 0: k3 of
  # p/p_ref = 2 on two tokens (0.3068528 each); row 1: p/p_ref = 0.5 on one (0.1931472).
  k_a, k_b = 0.5 - 1 - np.log(0.5), 2.0 - 1 - np.log(2.0)
  want = {"token_mean": (2 * k_a + k_b) / 3, "seq_mean_token_sum": (2 * k_a + k_b) / 2,
          "seq_mean_token_mean": (k_a + k_b) / 2,
          "seq_mean_token_sum_norm": (2 * k_a + k_b) / 8}[agg]
  new = jnp.log(jnp.array([[0.4, 0.4, 0.3], [0.2, 0.3, 0.3]]))
  ref = jnp.log(jnp.array([[0.2, 0.2, 0.9], [0.4, 0.9, 0.9]]))
  mask = jnp.array([[1, 1, 0], [1, 0, 0]])
  loss, m = ppo_variant_loss(new, None, jnp.zeros((2,)), mask, logp_ref=ref, kl_coef=0.5,
                             loss_agg=agg, loss_norm=8.0)
  np.testing.assert_allclose(m["kl_ref"], want, rtol=1e-5)
  np.testing.assert_allclose(loss, 0.5 * want, rtol=1e-5)


@pytest.mark.parametrize("mode,want_loss,want_weight_mean", [
    # pi_old / pi_rollout per token: row 0 [2, 1.5] -> sequence 3 (> cap 2.5); row 1 [0.5, 3]
    # -> 1.5 (its token 3 alone would be capped); row 2 padding. On-policy, A = 1: the loss is
    # -(mean over the 4 tokens of the sequence weight).
    pytest.param("truncate", -(2 * 2.5 + 2 * 1.5) / 4, (2.5 + 1.5) / 2, id="truncate"),
    pytest.param("mask", -(2 * 0.0 + 2 * 1.5) / 4, (0.0 + 1.5) / 2, id="mask"),
    pytest.param("none", -1.0, 1.0, id="none"),
])
def test_sequence_importance_weights_hand_computed(mode, want_loss, want_weight_mean):
  old = jnp.full((3, 2), np.log(0.1), jnp.float32)
  rollout = jnp.asarray(np.log(0.1) - np.log([[2.0, 1.5], [0.5, 3.0], [1.0, 1.0]]),
                        jnp.float32)
  mask = jnp.array([[1, 1], [1, 1], [0, 0]])
  loss, m = ppo_variant_loss(old, None, jnp.ones((3,)), mask, logp_rollout=rollout,
                             is_mode=mode, is_cap=2.5, is_level="sequence")
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  np.testing.assert_allclose(m["is_weight_mean"], want_weight_mean, rtol=1e-5)
  np.testing.assert_allclose(m["is_capped_frac"], 0.5)  # one of the two real sequences
  w, _ = importance_weights_seq(old, rollout, mask, mode=mode, cap=2.5)
  want_w = {"truncate": [2.5, 1.5], "mask": [0.0, 1.5], "none": [1.0, 1.0]}[mode]
  np.testing.assert_allclose(w[:2], np.repeat(np.array(want_w)[:, None], 2, 1), rtol=1e-5)



def test_sequence_weights_stay_finite_when_the_product_overflows():
  # 64 tokens of ratio e each: the product e^64 overflows float32; the weight is the cap
  # (truncate) or 0 (mask), and the gradient of the weight is 0.
  train, rollout, mask = jnp.zeros((1, 64)), jnp.full((1, 64), -1.0), jnp.ones((1, 64))
  w, m = importance_weights_seq(train, rollout, mask, mode="truncate", cap=5.0)
  assert float(w[0, 0]) == 5.0 and float(m["is_capped_frac"]) == 1.0
  w, m = importance_weights_seq(train, rollout, mask, mode="mask", cap=5.0)
  assert float(w[0, 0]) == 0.0 and np.isfinite(float(m["is_weight_mean"]))
  g = jax.grad(lambda t: jnp.sum(importance_weights_seq(t, rollout, mask, mode="truncate",
                                                        cap=5.0)[0]))(train)
  np.testing.assert_array_equal(g, np.zeros((1, 64)))


def test_new_mismatch_metrics_report_known_extremes():
  # pi_train / pi_rollout: row 0 [3, 2.5, 1]; row 1 [0.1, 1.2, (masked 50)]; row 2 padding
  # with garbage; row 3 exactly [2, 0.5] (the bounds: inside) and 1.
  # Extreme tokens: 3, 2.5, 0.1 -> 3 of the 8 loss tokens = 0.375.
  # Per-sequence |sum log r|: log 7.5 = 2.0149030, |log 0.12| = 2.1202635, 0 -> 2.1202635.
  rollout = np.log(np.array([[0.01, 0.01, 0.01], [0.01, 0.01, 0.01], [0.5, 0.5, 0.5],
                             [0.25, 0.5, 0.5]]))
  train = rollout + np.log(np.array([[3, 2.5, 1], [0.1, 1.2, 50], [1, 1, 1], [1, 1, 1]]))
  train[3, :2] = np.log([0.5, 0.25])  # float32 log(0.5) - log(0.25) is float32 log(2)
  mask = jnp.array([[1, 1, 1], [1, 1, 0], [0, 0, 0], [1, 1, 1]])
  train, rollout = jnp.asarray(train, jnp.float32), jnp.asarray(rollout, jnp.float32)
  rollout = rollout.at[2].set(jnp.nan)
  m = mismatch_metrics(train, rollout, mask)
  assert float(m["ratio_extreme_frac"]) == 0.375
  np.testing.assert_allclose(m["max_seq_log_ratio"], 2.1202635, rtol=1e-5)
  # The loss reports them for pi_old against pi_rollout.
  _, m = ppo_clip_loss(train, train, jnp.zeros((4,)), mask, logp_rollout=rollout)
  assert float(m["ratio_extreme_frac"]) == 0.375
  np.testing.assert_allclose(m["max_seq_log_ratio"], 2.1202635, rtol=1e-5)
  # No mismatch: both are 0.
  m = mismatch_metrics(train, train, mask)
  assert float(m["ratio_extreme_frac"]) == 0.0 and float(m["max_seq_log_ratio"]) == 0.0


def test_bad_variant_arguments():
  x, mask = jnp.zeros((2, 3)), jnp.ones((2, 3))
  with pytest.raises(ValueError, match="loss_agg"):
    losses.ppo_clip_loss(x, None, jnp.ones(2), mask, loss_agg="seq_mean")
  with pytest.raises(ValueError, match="loss_norm"):
    losses.ppo_clip_loss(x, None, jnp.ones(2), mask, loss_agg="seq_mean_token_sum_norm")
  with pytest.raises(ValueError, match="loss_norm"):
    losses.ppo_clip_loss(x, None, jnp.ones(2), mask, loss_agg="seq_mean_token_sum_norm",
                        loss_norm=0.0)
  with pytest.raises(ValueError, match="is_level"):
    losses.ppo_clip_loss(x, None, jnp.ones(2), mask, logp_rollout=x, is_level="batch")

