"""compare.run (what experiments/train_rl runs): the warm start alone, each policy on its own,
then one summary of all."""

import json
import os

from tests.train.test_rl_loop import tiny_cfg
from trace_jax.train import compare


def test_split_run_then_summary(tmp_path):
  cfg = tiny_cfg()
  cfg.rl.steps = 2
  cfg.policies = ("bf16",)
  work = str(tmp_path)
  out = compare.run(cfg, work, [], progress=False)  # --sft_only
  assert out["policies"] == {} and len(out["sft"]["history"]) > 0
  assert os.path.isdir(os.path.join(work, "sft")) and not os.path.exists(
      os.path.join(work, "summary.json"))
  compare.run(cfg, work, ["bf16"], progress=False)  # what each policy process runs
  first = json.loads((tmp_path / "summary.json").read_text())
  # A second call finds the finished run and the saved warm start: nothing is retrained.
  again = compare.run(cfg, work, ["bf16"], progress=False)
  assert again["policies"] == first["policies"]
  assert again["sft"]["history"] == out["sft"]["history"]
  assert set(first["policies"]["bf16"]) >= set(compare.SUMMARY_KEYS)
  assert (tmp_path / "reward_mismatch.png").stat().st_size > 10_000
  assert (tmp_path / "bf16" / "evals.csv").read_text().count("\n") == 1 + 2  # steps 0 and 2


def test_unknown_policy_fails_before_the_warm_start(tmp_path):
  import pytest
  with pytest.raises(ValueError, match="fp5"):
    compare.run(tiny_cfg(), str(tmp_path), ["fp5"], progress=False)
  assert not os.path.exists(tmp_path / "sft")
