"""GRPOLearner pieces beyond one plain step: the KL term to the starting weights, clip-higher,
Dr. GRPO advantages, and guidance written where the run does not read."""

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
