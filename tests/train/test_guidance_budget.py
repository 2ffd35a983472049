"""Guided layers chosen from measured mismatch under a byte budget (`guidance_budget`)."""

import numpy as np
import pytest

from trace_jax import model as model_lib
from trace_jax.rollout.protocol import SamplingParams
from trace_jax.train import guidance_budget as gb


def _score(gains, pair_bonus=0.0):
  """A mismatch score with known structure: 1 - sum of the units' gains, plus a bonus that
  only the pair (0, 1) earns together (an interaction greedy sees once 0 is in)."""
  def score(layers):
    s = 1.0 - sum(gains[u] for u in layers)
    return s - (pair_bonus if {0, 1} <= set(layers) else 0.0)
  return score


def test_greedy_adds_the_best_unit_given_the_chosen_ones_within_the_budget():
  gains = {0: 0.30, 1: 0.05, 2: 0.10, 3: 0.10}
  path = gb.greedy_path(_score(gains, pair_bonus=0.2), {u: 10.0 for u in gains}, budget=30)
  assert [s["added"] for s in path] == [None, 0, 1, 3]  # 1 pays with 0 in; 3 over 2: deeper
  assert [s["bytes_per_token"] for s in path] == [0, 10, 20, 30]
  np.testing.assert_allclose([s["score"] for s in path], [1.0, 0.7, 0.45, 0.35])
  assert gb.select(path, 25) == (0, 1) and gb.select(path, 30) == (0, 1, 3)
  assert gb.select(path, 9.9) == ()
  again = gb.greedy_path(_score(gains, pair_bonus=0.2), {u: 10.0 for u in gains}, budget=30)
  assert again == path  # deterministic


@pytest.mark.parametrize("budget,match", [
    (5.0, r"budget 5 B/token is below the cheapest layer's guidance \(108 B/token\)"),
    (float("nan"), "must be a finite number"),
], ids=["below_one_layer", "nan"])
def test_a_budget_that_buys_nothing_is_refused(budget, match):
  with pytest.raises(gb.BudgetError, match=match):
    gb.check_budget(budget, {0: 108.0, 1: 108.0})


@pytest.fixture(scope="module")
def rollout():
  """A 2-layer bf16 model's fp4_trace rollout recording every layer, 4 prompts."""
  config = model_lib.tiny(dtype="bfloat16", policy="fp4_trace")
  params = model_lib.init_params(config, 0)
  rng = np.random.default_rng(0)
  prompts = rng.integers(0, config.vocab_size, (4, 12)).tolist()
  sampling = [SamplingParams(max_new_tokens=12, seed=i) for i in range(4)]
  return config, params, gb.calibration_rollout(params, config, prompts, sampling)


@pytest.mark.parametrize("mode", ["compact", "full"])
def test_the_layout_formula_is_the_recorded_bytes(rollout, mode):
  config, params, ro = rollout
  if mode == "full":
    config = config.replace(guidance_mode="full")
    ro = gb.calibration_rollout(params, config, [s.prompt for s in ro.samples],
                                [SamplingParams(max_new_tokens=12, seed=i) for i in range(4)])
  measured = gb.layer_bytes_per_token(ro, range(2))
  assert set(measured.values()) == {gb.layer_bytes(config)}
  if mode == "compact":  # moe_in 28 + 2 experts x (expert_mid 16 + id 4) + k, v 2 heads x 10
    assert gb.layer_bytes(config) == 108.0


def test_the_calibration_ranks_corrupted_guidance_as_worth_nothing(rollout):
  """Layer 1's records corrupted (every mantissa bit flipped: the trainer rounds every code to
  the other neighbour) score no better than no guidance, and greedy with room for one layer
  picks an intact one; intact guidance at that layer lowers |dlogp| below no guidance."""
  config, params, ro = rollout
  g = dict(ro.rec["guidance"])
  g[1] = {site: r.replace(mantissa=np.bitwise_not(np.asarray(r.mantissa)))
          for site, r in g[1].items()}
  bad = gb.Rollout(ro.samples, dict(ro.rec, guidance=g))
  scorer = gb.LayerScorer(params, config, bad)
  intact = gb.LayerScorer(params, config, ro)
  assert scorer((1,)) >= scorer(())
  assert intact((1,)) < intact(())
  unit_bytes = gb.layer_bytes_per_token(bad, range(2))
  path = gb.greedy_path(scorer, unit_bytes, budget=unit_bytes[0])
  assert len(path) == 2 and path[1]["added"] != 1
