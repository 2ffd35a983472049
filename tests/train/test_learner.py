"""GRPOLearner pieces beyond one plain step: the KL term to the starting weights, clip-higher,
Dr. GRPO advantages, and guidance written where the run does not read."""

import csv

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_rl_loop import tiny_cfg  # tests/train is on sys.path (pytest's prepend mode)

from trace_jax.guidance.handle import GuidanceHandle
from trace_jax.rl import advantages as adv_lib
from trace_jax.rollout.protocol import Sample
from trace_jax.train import rl_loop, run_config
from trace_jax.train.learner import GRPOLearner


@pytest.fixture(scope="module")
def start_params():
  return rl_loop.run_sft(tiny_cfg(), "unused", progress=False)[0]


def test_kl_term_is_to_the_starting_weights(start_params, tmp_path):
  """kl_coef > 0: step 0 runs on the reference weights themselves (KL ~0: the reference
  forward is another XLA program, so not bitwise 0), step 1 on updated weights (KL hundreds of
  times larger). A KL to the current weights would stay ~0."""
  cfg = tiny_cfg()
  cfg.rl.steps, cfg.rl.kl_coef = 2, 0.5
  rl_loop.validate(cfg)
  out = rl_loop.run_rl(cfg, str(tmp_path), "bf16", start_params, progress=False)
  kl = [row["kl_ref"] for row in out["history"]]
  assert 0.0 <= kl[0] < 1e-5 and kl[1] > 100 * max(kl[0], 1e-7) and np.isfinite(kl[1]), kl


def test_loss_settings_reach_the_step(start_params, tmp_path):
  cfg = tiny_cfg()
  cfg.rl.clip_eps_high, cfg.rl.advantage = 0.28, "dr_grpo"
  run = rl_loop.validate(cfg)
  with GRPOLearner(run, str(tmp_path), "bf16", start_params, progress=False) as learner:
    assert (learner.loss_cfg.clip_eps_low, learner.loss_cfg.clip_eps_high) == (0.2, 0.28)
    rewards = jnp.asarray([1.0, 0.0, 1.0, 1.0])
    got = np.asarray(learner.advantage_fn(rewards, 2))
  np.testing.assert_allclose(got, [0.5, -0.5, 0.0, 0.0])  # centred, not divided by the std
  assert not np.allclose(got, np.asarray(adv_lib.group_advantages(rewards, 2)))


@pytest.mark.parametrize("field,value,match", [
    ("rl.clip_eps_high", 0.0, "rl.clip_eps_high must be a finite number > 0, or None"),
    ("rl.kl_coef", -0.1, "rl.kl_coef must be a finite number >= 0"),
    ("rl.advantage", "ppo", "rl.advantage must be grpo|dr_grpo, got 'ppo'"),
], ids=["clip_high_zero", "kl_negative", "unknown_advantage"])
def test_optional_loss_fields_are_validated(field, value, match):
  cfg = tiny_cfg()
  cfg.rl[field.split(".")[1]] = value
  with pytest.raises(ValueError, match=match):
    rl_loop.validate(cfg)


def test_guidance_written_elsewhere_is_a_clear_error(start_params, tmp_path):
  """An HTTP server writing guidance to another directory than the run's store: refused,
  naming both (the run would otherwise read nothing, or another run's batches)."""
  with GRPOLearner(run_config.resolve(tiny_cfg()), str(tmp_path), "fp4_trace", start_params,
                   progress=False) as learner:
    samples = [Sample([1, 2], [3], [-0.1], "stop",
                      guidance=GuidanceHandle(batch_id="b000000", seq_id="b000000-0",
                                              store="/srv/guidance"))]
    with pytest.raises(ValueError, match=r"wrote guidance to \['/srv/guidance'\].*"
                       r"--guidance_dir="):
      learner.guidance(samples)


# ------------------------------------------------------------------------------ mini-batches

def _state_copy(state):
  return jax.tree.map(lambda a: jnp.array(a, copy=True), state)


def test_minibatches_equal_sequential_updates_on_the_parts(start_params, tmp_path):
  """rl.minibatches=2: the learner's updates of one rollout batch equal two one-update steps
  (`step.grpo_step`) on its halves in order, each clipping against the trainer's log-probs
  before the first (`step.policy_logprobs`), bit for bit; under fp4_trace, so the guidance and
  routing follow their rows into each part."""
  from trace_jax.train import batch as batch_lib
  from trace_jax.train import step as step_lib
  cfg = tiny_cfg()
  cfg.rl.minibatches = 2
  run = rl_loop.validate(cfg)
  with GRPOLearner(run, str(tmp_path), "fp4_trace", start_params, progress=False) as learner:
    ro = learner.rollout(0)
    batch = learner.batch(ro, learner.guidance(ro.samples), 0)
    assert batch.guidance is not None and batch.routing is not None
    state0 = _state_copy(learner.state)
    m, _, rows = learner.update(batch)
    got = learner.state
    # The learner's static arguments (no taps): the programs it compiled run again.
    old, _ = step_lib.policy_logprobs(state0.params, learner.model_cfg, learner.loss_cfg, batch,
                                      tap_layers=(), tap_rows=0)
    want = state0
    for half in (np.arange(0, 2), np.arange(2, 4)):
      part = batch_lib.take_rows(batch.replace(logp_old=old), half)
      want, _, _ = step_lib.grpo_step(want, part, config=learner.model_cfg, tx=learner.tx,
                                      rl=learner.loss_cfg, tap_layers=(), tap_rows=0)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert [(r["update"], r["epoch"], r["minibatch"]) for r in rows] == [(0, 0, 0), (1, 0, 1)]
  assert m["grad_norm"] == pytest.approx(np.mean([r["grad_norm"] for r in rows]))


def test_clipping_acts_on_later_epochs(start_params, tmp_path, monkeypatch):
  """rl.epochs=2, rl.minibatches=2, a large learning rate: the first epoch's first update
  starts at ratio ~1 (nothing to clip; not exactly 1 in bf16: the pre-update forward is
  another XLA program than the update's); later updates see the policy moved and clip.
  updates.csv holds one row per optimizer step and metrics.csv the step's mean. (The barely
  trained tiny model
  earns reward 0 everywhere, so every advantage would be 0 and nothing could clip: the
  advantages are set to +-1 here.)"""
  from trace_jax.train import run_log
  monkeypatch.setattr(adv_lib, "get_advantage_fn", lambda name, *a: lambda rewards, group: (
      jnp.where(jnp.arange(rewards.shape[0]) % 2 == 0, 1.0, -1.0)))
  cfg = tiny_cfg()
  cfg.rl.steps, cfg.rl.epochs, cfg.rl.minibatches, cfg.rl.clip_eps = 1, 2, 2, 0.05
  cfg.rl.lr = 3e-2
  out = rl_loop.run_rl(cfg, str(tmp_path), "bf16", start_params, progress=False)
  with open(tmp_path / "updates.csv") as f:
    ups = list(csv.DictReader(f))
  assert [(u["epoch"], u["minibatch"]) for u in ups] == [("0", "0"), ("0", "1"), ("1", "0"),
                                                          ("1", "1")]
  frac = [float(u["clip_frac"]) for u in ups]
  assert frac[0] == 0.0 and max(frac[2:]) > 0.0, frac
  rows, _ = run_log.read_curves(str(tmp_path))
  assert rows[0]["clip_frac"] == pytest.approx(np.mean(frac))
  assert out["history"][0]["clip_frac"] == pytest.approx(np.mean(frac))


@pytest.mark.parametrize("field,value,match", [
    ("minibatches", 3, "rl.minibatches=3 does not divide a step's 4 samples"),
    ("epochs", 0, "rl.epochs must be an int >= 1, got 0"),
    ("loss_agg", "seq_sum", "rl.loss_agg must be "),
    ("adv_std", "sample", "rl.adv_std must be "),
    ("is_level", "batch", "rl.is_level must be "),
], ids=["minibatches_not_dividing", "epochs_zero", "unknown_loss_agg", "unknown_adv_std",
        "unknown_is_level"])
def test_update_fields_are_validated(field, value, match):
  cfg = tiny_cfg()
  cfg.rl[field] = value
  with pytest.raises(ValueError, match=match):
    rl_loop.validate(cfg)
