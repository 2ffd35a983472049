"""A run's ConfigDict resolved into typed sections (`trace_jax.train.run_config`)."""

import dataclasses

import pytest

from configs import quickstart
from tests.config_files import CONFIG_FILES, parsed
from trace_jax.train import run_config


@pytest.mark.filterwarnings("ignore:the load_module:DeprecationWarning")  # ml_collections' loader
@pytest.mark.parametrize("name", CONFIG_FILES)
def test_every_config_file_exposes_every_optional_grpo_field(name):
  """Every optional GRPO field (mini-batches, epochs, the loss variants, ...) can be set from
  the command line of any config file, None-defaulted ones included, and reaches the typed
  config."""
  plain = parsed(name)
  for section in ("rl", "guidance"):
    assert {p.split(".", 1)[1] for p in run_config.OPTIONAL if p.startswith(f"{section}.")
            } <= set(plain[section])
  c = parsed(name, "--config.rl.epochs=2", "--config.rl.clip_eps_high=0.28",
              "--config.rl.adv_std=unbiased", "--config.rl.loss_agg=seq_mean_token_mean",
              "--config.rl.is_level=sequence", "--config.guidance.budget_bytes_per_token=54")
  rl = run_config.resolve(c).rl
  assert run_config.resolve(c).guidance.budget_bytes_per_token == 54.0
  assert (rl.epochs, rl.clip_eps_high, rl.adv_std, rl.loss_agg, rl.is_level) == (
      2, 0.28, "unbiased", "seq_mean_token_mean", "sequence")


def test_resolve_fills_the_optional_fields_and_keeps_the_source():
  c = quickstart.get_config()
  for key in ("clip_eps_high", "kl_coef", "advantage", "minibatches"):
    del c.rl[key]  # a file written before these fields existed
  run = run_config.resolve(c)
  assert (run.rl.clip_eps_high, run.rl.kl_coef, run.rl.advantage, run.rl.minibatches,
          run.rl.updates_per_step) == (c.rl.clip_eps, 0.0, "grpo", 1, 1)
  assert run.source["rl"]["lr"] == c.rl.lr and "minibatches" not in run.source["rl"]
  assert run.model_for("fp4_trace") == dataclasses.replace(run.model, policy="fp4_trace")
  assert run_config.resolve(run) is run


@pytest.mark.parametrize("field,value,match", [
    ("advantage", "dr_grpo", "adv_std 'unbiased' contradicts advantage 'dr_grpo'"),
    ("seeds", (1, 1), r"rl.seeds must be distinct ints, got \(1, 1\)"),
], ids=["dr_grpo_with_a_std", "repeated_seeds"])
def test_contradictions_are_refused(field, value, match):
  c = quickstart.get_config()
  c.rl.adv_std = "unbiased"
  c.rl[field] = value
  with pytest.raises(ValueError, match=match):
    run_config.resolve(c)
