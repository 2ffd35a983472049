"""GRPO advantages (each estimator and adv_std) against hand-computed numbers and a float64
numpy reference."""

import jax
import numpy as np
import pytest

from trace_jax.rl import advantages
from trace_jax.rl.advantages import get_advantage_fn

# Jitted once per signature: much faster on CPU than op-by-op dispatch.
group_advantages = jax.jit(advantages.group_advantages,
                           static_argnames=("group_size", "normalize_std", "eps", "ddof"))
group_stats = jax.jit(advantages.group_stats, static_argnames="group_size")


def test_grpo_hand_computed():
  # Group 1: [1, 0, 0, 1], mean 0.5, std 0.5 -> +-1.
  # Group 2: [1, 1, 1, 0], mean 0.75, std sqrt(0.1875) = 0.4330127
  #   -> 0.25 / 0.4330127 = 0.5773503, -0.75 / 0.4330127 = -1.7320508.
  rewards = np.array([1, 0, 0, 1, 1, 1, 1, 0], np.float32)
  expected = [1.0, -1.0, -1.0, 1.0, 0.5773503, 0.5773503, 0.5773503, -1.7320508]
  np.testing.assert_allclose(group_advantages(rewards, 4), expected, rtol=1e-5)


def test_grpo_hand_computed_non_binary():
  # Group [0.2, 0.5, 0.8]: mean 0.5, deviations -0.3, 0, 0.3, std sqrt(0.06) = 0.2449490.
  # Group [3, 1]: mean 2, std 1 -> +1, -1 (ddof 0); sample std sqrt(2) -> +-0.7071068 (ddof 1).
  np.testing.assert_allclose(group_advantages(np.array([0.2, 0.5, 0.8]), 3),
                             [-1.2247449, 0.0, 1.2247449], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(group_advantages(np.array([3.0, 1.0]), 2), [1.0, -1.0], rtol=1e-5)
  np.testing.assert_allclose(group_advantages(np.array([3.0, 1.0]), 2, ddof=1),
                             [0.7071068, -0.7071068], rtol=1e-5)


def test_dr_grpo_does_not_divide_by_std():
  rewards = np.array([1, 0, 0, 1, 1, 1, 1, 0], np.float32)
  expected = [0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75]
  np.testing.assert_allclose(group_advantages(rewards, 4, normalize_std=False), expected,
                             atol=1e-7)
  np.testing.assert_allclose(get_advantage_fn("dr_grpo")(rewards, 4), expected, atol=1e-7)
  np.testing.assert_allclose(get_advantage_fn("grpo")(rewards, 4), group_advantages(rewards, 4))


def test_uniform_group_gets_zero_advantage():
  adv = group_advantages(np.array([1, 1, 1, 0, 0, 0, 0.5, 0.5, 0.5]), 3)
  np.testing.assert_array_equal(adv, np.zeros(9, np.float32))


def test_matches_float64_reference():
  rng = np.random.default_rng(0)
  r = rng.normal(size=(6, 8))
  ref = (r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-6)
  out = group_advantages(r.reshape(-1).astype(np.float32), 8)
  np.testing.assert_allclose(out, ref.reshape(-1), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(out).reshape(6, 8).sum(1), 0.0, atol=1e-5)


def test_group_stats():
  s = group_stats(np.array([1, 0, 1, 1, 0, 0], np.float32), 2)
  np.testing.assert_allclose(s["reward_mean"], 0.5)
  np.testing.assert_allclose(s["frac_uniform_groups"], 2 / 3, rtol=1e-6)
  # Group means 0.5, 1, 0: std sqrt(1/6) = 0.4082483.
  np.testing.assert_allclose(s["reward_group_mean_std"], 0.4082483, rtol=1e-5)


def test_bad_inputs():
  with pytest.raises(ValueError, match="groups of 3"):
    group_advantages(np.zeros(4), 3)
  with pytest.raises(ValueError, match="flat"):
    group_advantages(np.zeros((2, 2)), 2)
  with pytest.raises(ValueError, match="ddof"):
    group_advantages(np.zeros(4), 1, ddof=1)
  with pytest.raises(ValueError, match="unknown advantage"):
    get_advantage_fn("ppo")


def _reference(rewards, group_size, adv_std, eps=1e-6):
  """float64 advantages, group by group in plain python/numpy."""
  out = []
  for g in np.asarray(rewards, np.float64).reshape(-1, group_size):
    centred = g - g.sum() / g.size
    if adv_std == "none":
      out.extend(centred)
      continue
    ddof = {"population": 0, "unbiased": 1}[adv_std]
    std = np.sqrt(np.sum(centred ** 2) / (g.size - ddof))
    out.extend(centred / (std + eps))
  return np.array(out)


@pytest.mark.parametrize("name,adv_std", [
    pytest.param("grpo", "population", id="grpo-population"),
    pytest.param("grpo", "unbiased", id="grpo-unbiased"),
    pytest.param("grpo", "none", id="grpo-none"),
    pytest.param("dr_grpo", "none", id="dr_grpo-none"),
])
def test_adv_std_matches_float64_reference(name, adv_std):
  rng = np.random.default_rng(3)
  # Groups of 5: continuous rewards, binary rewards, and one uniform group (advantage 0).
  rewards = np.concatenate([rng.normal(size=15), rng.integers(0, 2, 10), np.full(5, 0.7)])
  fn = jax.jit(get_advantage_fn(name, adv_std), static_argnums=1)
  got = fn(rewards.astype(np.float32), 5)
  np.testing.assert_allclose(got, _reference(rewards, 5, adv_std), rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(got)[-5:], np.zeros(5, np.float32))


def test_adv_std_hand_computed():
  # Group [3, 1]: mean 2; population std 1 -> +-1; unbiased std sqrt(2) -> +-0.7071068;
  # none -> +-1 (centred only). Group [0, 0, 3]: mean 1, deviations [-1, -1, 2];
  # population std sqrt(2) -> [-0.7071068, -0.7071068, 1.4142136]; unbiased std sqrt(3) ->
  # [-0.5773503, -0.5773503, 1.1547005].
  r2, r3 = np.array([3.0, 1.0], np.float32), np.array([0.0, 0.0, 3.0], np.float32)
  np.testing.assert_allclose(get_advantage_fn("grpo", "population")(r2, 2), [1, -1], rtol=1e-5)
  np.testing.assert_allclose(get_advantage_fn("grpo", "unbiased")(r2, 2),
                             [0.7071068, -0.7071068], rtol=1e-5)
  np.testing.assert_allclose(get_advantage_fn("grpo", "none")(r2, 2), [1, -1], rtol=1e-6)
  np.testing.assert_allclose(get_advantage_fn("grpo", "population")(r3, 3),
                             [-0.7071068, -0.7071068, 1.4142136], rtol=1e-5)
  np.testing.assert_allclose(get_advantage_fn("grpo", "unbiased")(r3, 3),
                             [-0.5773503, -0.5773503, 1.1547005], rtol=1e-5)
  np.testing.assert_allclose(get_advantage_fn("dr_grpo", "none")(r3, 3), [-1, -1, 2],
                             rtol=1e-6)


def test_estimator_defaults_are_unchanged():
  # No adv_std: each estimator as registered (grpo: population std; dr_grpo: centred).
  rewards = np.array([1, 0, 0, 1, 1, 1, 1, 0], np.float32)
  assert get_advantage_fn("grpo") is advantages.ADVANTAGE_FNS["grpo"]
  assert get_advantage_fn("dr_grpo") is advantages.ADVANTAGE_FNS["dr_grpo"]
  np.testing.assert_array_equal(get_advantage_fn("grpo", "population")(rewards, 4),
                                group_advantages(rewards, 4))
  np.testing.assert_array_equal(get_advantage_fn("dr_grpo", "none")(rewards, 4),
                                group_advantages(rewards, 4, normalize_std=False))


@pytest.mark.parametrize("name,adv_std,match", [
    pytest.param("dr_grpo", "population", "contradicts", id="dr_grpo-population"),
    pytest.param("dr_grpo", "unbiased", "contradicts", id="dr_grpo-unbiased"),
    pytest.param("grpo", "sample", "unknown adv_std", id="unknown-std"),
    pytest.param("ppo", "none", "unknown advantage", id="unknown-estimator"),
])
def test_bad_advantage_and_std_pairs(name, adv_std, match):
  with pytest.raises(ValueError, match=match):
    get_advantage_fn(name, adv_std)
