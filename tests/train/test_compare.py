"""compare.run (what experiments/train_rl runs): the warm start alone, each policy on its own,
then one summary of all."""

import json
import os

import pytest

from tests.train.test_rl_loop import tiny_cfg
from trace_jax.train import compare, run_guard
from trace_jax.train import step as step_lib


def test_split_run_then_summary(tmp_path):
  cfg = tiny_cfg()
  cfg.rl.steps, cfg.rl.seeds = 2, (0,)  # several seeds: test_seeds_spread_and_posthoc_fp4
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
  assert (tmp_path / "bf16" / "seed0" / "evals.csv").read_text().count("\n") == 1 + 2  # 0, 2
  assert first["fingerprint"] and first["config_changes"] == []
  # The kernel plan each forward ran: the reference on this CPU.
  plans = first["kernel_plans"]["bf16"]
  assert plans["rollout"]["decode_impl"] == "xla" and plans["train"]["moe_impl"] == "tiled"
  _reports_a_cut_run_as_it_stands(cfg, tmp_path, first)
  _refuses_another_config(cfg, tmp_path)


def _reports_a_cut_run_as_it_stands(cfg, tmp_path, first) -> None:
  """A copy of the finished workdir whose run lost its last step's row (a run cut short):
  `report_existing` (train_rl --report_only) reports it with the one step it reached and the
  saved SFT history, and resumes nothing (its CSV unchanged); a workdir holding no run is
  refused by name."""
  import shutil

  import pytest
  cut = tmp_path.parent / f"{tmp_path.name}_cut"
  shutil.copytree(tmp_path, cut)
  metrics = cut / "bf16" / "seed0" / "metrics.csv"
  metrics.write_text("".join(metrics.read_text().splitlines(keepends=True)[:2]))  # header, step 0
  before = metrics.read_text()
  out = compare.report_existing(cfg, str(cut), ["bf16"])
  assert out["policies"]["bf16"]["per_seed"][0]["steps_done"] == 1
  assert first["policies"]["bf16"]["per_seed"][0]["steps_done"] == 2
  assert out["sft"]["history"] == first["sft"]["history"] and metrics.read_text() == before
  with pytest.raises(run_guard.UserError, match="holds no run"):
    compare.report_existing(cfg, str(tmp_path.parent / "nothing_here"), ["bf16"])


def _refuses_another_config(cfg, tmp_path) -> None:
  """The finished workdir of test_split_run_then_summary launched again with another config:
  refused before anything runs (the summary is not rewritten), unless allowed."""
  import pytest
  work, summary = str(tmp_path), (tmp_path / "summary.json").read_text()
  for field, value, shown in [("seed", 1, "seed: 0 -> 1"),
                              ("hidden_size", 256, "model.hidden_size: 128 -> 256")]:
    other = tiny_cfg()
    other.rl.steps, other.rl.seeds, other.policies = cfg.rl.steps, cfg.rl.seeds, cfg.policies
    (other.model if field == "hidden_size" else other)[field] = value
    with pytest.raises(run_guard.ConfigMismatchError, match=shown):
      compare.run(other, work, ["bf16"], progress=False)
  assert (tmp_path / "summary.json").read_text() == summary
  # A workdir from before run_config.json: the saved warm start's shapes still refuse.
  os.remove(tmp_path / run_guard.FILE)
  with pytest.raises(run_guard.UserError, match=r"warm start .*sft is of another model "
                     r"\(model.hidden_size: 128 -> 256\)"):
    compare.preflight(other, work, ["bf16"])
  assert not (tmp_path / run_guard.FILE).exists()  # a refused launch records nothing
  compare.preflight(cfg, work, ["bf16"])
  # Allowed: the run goes on, and the summary says the config changed.
  other = tiny_cfg()
  other.rl.steps, other.rl.seeds, other.policies = cfg.rl.steps, cfg.rl.seeds, cfg.policies
  other.rl.lr = 2 * cfg.rl.lr
  out = compare.run(other, work, ["bf16"], progress=False, allow_config_change=True)
  assert out["config_changes"][-1]["fields"] == {"rl.lr": [cfg.rl.lr, 2 * cfg.rl.lr]}


def test_unknown_policy_fails_before_the_warm_start(tmp_path):
  import pytest
  with pytest.raises(ValueError, match="fp5"):
    compare.run(tiny_cfg(), str(tmp_path), ["fp5"], progress=False)
  assert not os.path.exists(tmp_path / "sft")


def test_seeds_spread_and_posthoc_fp4(tmp_path):
  """Two RL seeds from one warm start: per-seed summaries, their spread and the gain's
  standard error; the bf16 weights evaluated through the FP4 engine (posthoc_fp4)."""
  import numpy as np
  cfg = tiny_cfg()
  cfg.rl.steps = 1
  cfg.rl.seeds = (0, 1)
  before = step_lib.grpo_step._cache_size()
  out = compare.run(cfg, str(tmp_path), ["bf16"], progress=False)
  assert step_lib.grpo_step._cache_size() - before <= 1  # the seeds share one compiled step
  bf16 = out["policies"]["bf16"]
  seeds = bf16["per_seed"]
  assert [s["seed"] for s in seeds] == [0, 1] and bf16["num_seeds"] == 2
  finals = [s["final_reward"] for s in seeds]
  assert bf16["final_reward"] == np.mean(finals)
  assert bf16["final_reward_sd"] == np.std(finals, ddof=1)
  gains = [s["final_reward"] - s["sft_reward"] for s in seeds]
  assert np.isclose(bf16["gain_se"], np.std(gains, ddof=1) / np.sqrt(2))
  # Different RL seeds sample differently: the runs' histories are not copies.
  assert seeds[0]["train_reward_first"] != seeds[1]["train_reward_first"] or \
      seeds[0]["mean_abs_dlogp"] != seeds[1]["mean_abs_dlogp"]
  post = out["policies"]["posthoc_fp4"]
  assert [s["seed"] for s in post["per_seed"]] == [0, 1]
  assert 0.0 <= post["final_reward"] <= 1.0 and post["sft_reward"] is not None
  for s in (0, 1):
    assert (tmp_path / "bf16" / f"seed{s}" / "metrics.csv").exists()


@pytest.mark.parametrize("field,value", [("norm_topk_prob", False), ("dtype", "float32"),
                                         ("rope_theta", 5e5), ("rms_norm_eps", 1e-5)],
                         ids=["norm_topk_prob", "dtype", "rope_theta", "rms_norm_eps"])
def test_a_warm_start_of_another_computation_is_refused(field, value, tmp_path):
  """--sft_checkpoint (or workdir/sft) of the same shapes but another value of a field that
  changes what the weights compute: refused before the warm start, naming the field."""
  from trace_jax import model as model_lib
  from trace_jax.io import orbax_ckpt
  from trace_jax.train import rl_loop
  cfg = tiny_cfg()
  saved = rl_loop.model_config(cfg, "bf16").replace(**{field: value})
  ckpt = str(tmp_path / "ckpt")
  orbax_ckpt.save_orbax(ckpt, saved, model_lib.init_params(saved, 0), wait=True)
  with pytest.raises(run_guard.UserError, match=rf"is of another model \(model.{field}: "):
    compare.preflight(cfg, str(tmp_path / "work"), ["bf16"], sft_checkpoint=ckpt)
  assert not (tmp_path / "work" / run_guard.FILE).exists()


def test_a_guidance_budget_chooses_the_layers_once_per_workdir(tmp_path, monkeypatch):
  """guidance.budget_bytes_per_token: the layers are chosen once, from the warm start, kept in
  workdir/guidance_selection.json and summary.json, the engine records only them (the store's
  manifests), and a relaunch (a resumed run, another policy process) reads them instead of
  calibrating again (no params needed); a budget below one layer's guidance is refused before
  the warm start."""
  from trace_jax.train import guidance_budget, run_config
  cfg = tiny_cfg()  # one layer: the greedy choice among several is test_guidance_budget's
  cfg.rl.steps, cfg.policies = 1, ("fp4_trace",)
  one = guidance_budget.layer_bytes(run_config.resolve(cfg).model_for("fp4_trace"))
  cfg.guidance.budget_bytes_per_token = 1.5 * one
  # The calibration rollout (4 prompts, padded to a power of two: 128) and the run's rollouts
  # (4 rows, padded to max_prompt_len) are then one generation program, compiled once.
  cfg.guidance.calibration_prompts = 4
  cfg.max_prompt_len, cfg.seq_len = 128, 136
  cfg.rl.seeds = (0,)
  cfg.rl.keep_guidance = True  # the store's batches stay, to read their manifests
  calls = []
  real = guidance_budget.greedy_path
  monkeypatch.setattr(guidance_budget, "greedy_path",
                      lambda *a, **k: calls.append(1) or real(*a, **k))
  out = compare.run(cfg, str(tmp_path), ["fp4_trace"], progress=False)
  sel = json.loads((tmp_path / compare.SELECTION).read_text())
  assert len(sel["layers"]) == 1 and sel["bytes_per_token"] == one and calls == [1]
  assert out["guidance_selection"]["layers"] == sel["layers"]
  assert out["policies"]["fp4_trace"]["guidance_bytes_per_token"] == one
  manifests = sorted((tmp_path / "fp4_trace" / "seed0" / "guidance").glob("*/manifest.json"))
  assert manifests and all(json.loads(m.read_text())["layers"] == sel["layers"]
                           for m in manifests if ".audit" not in m.parent.name)
  again = compare.guided_by_budget(run_config.resolve(cfg), str(tmp_path), None, ["fp4_trace"])
  assert calls == [1] and list(again.model.guided_layers) == sel["layers"]  # read back
  cfg.guidance.budget_bytes_per_token = 0.5 * one
  with pytest.raises(run_guard.UserError, match="below the cheapest layer's guidance"):
    compare.preflight(cfg, str(tmp_path / "other"), ["fp4_trace"])
