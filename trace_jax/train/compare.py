"""The policy comparison: one SFT warm start, GRPO runs per policy and RL seed, a summary.

`run` is what `experiments/train_rl.py` runs. Each (policy, seed) run lives in
`workdir/<policy>/seed<s>` and resumes from its checkpoints, so policies may run as separate
processes on one workdir (after a warm-start-only call) and a last call writes the table,
`summary.json` and the plot. The workdir's `run_config.json` (`run_guard`) ties it to one
config: every launch is checked against it before anything runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from absl import logging

from trace_jax.io import orbax_ckpt
from trace_jax.model import config as config_lib
from trace_jax.model import plan as plan_lib
from trace_jax.model import policies as policies_lib
from trace_jax.train import (
  evaluation,
  guidance_budget,
  rl_loop,
  run_config,
  run_guard,
  run_log,
  task_io,
)
from trace_jax.train.run_config import RunConfig

SUMMARY_KEYS = ("sft_reward", "final_reward", "best_reward", "mean_abs_dlogp", "k3_kl",
                "flip_rate_guided", "flip_rate_unguided", "routing_flip_rate",
                "routing_order_swap_rate", "expert_unmatched_rate", "guidance_bytes_per_token",
                "train_reward_slope", *run_log.TIMING_KEYS, *run_log.DASHBOARD_KEYS)
REWARD_KEYS = ("sft_reward", "final_reward", "best_reward")
# The rollout/trainer mismatch metrics, |dlogp| first: the summary gives each its spread over
# seeds (`<key>_sd`) and the table prints it beside the mean.
MISMATCH_KEYS = ("mean_abs_dlogp", "k3_kl", "ratio_extreme_frac", "is_capped_frac",
                 "max_seq_log_ratio", "clip_frac")
SPREAD_KEYS = REWARD_KEYS + MISMATCH_KEYS
POSTHOC = "posthoc_fp4"  # the bf16 run's weights evaluated through the FP4 engine


def run(cfg, workdir: str, policies: Sequence[str], sft_checkpoint: str | None = None,
        engine_factory: Any = None, progress: bool = True,
        allow_config_change: bool = False) -> dict[str, Any]:
  """The whole experiment; returns the summary dict also written to summary.json.

  One SFT warm start (`cfg.seed`), then for every policy one GRPO run per RL seed
  (`rl.seeds`) in `workdir/<policy>/seed<s>`. The summary holds, per policy, the means over
  seeds of `SUMMARY_KEYS`, the spread of each reward (`<key>_sd`), the gain of the final
  eval over the SFT start with its standard error, and the per-seed summaries. With bf16 in
  the run (and `eval.posthoc_fp4`, default on), it adds `posthoc_fp4`: the SFT and final bf16
  weights evaluated greedily through the FP4 engine (FP4 after the fact, no QAT at all).
  engine_factory: the learners' rollout engine (`GRPOLearner`; default: in-process), e.g.
  `rollout_bridge.weight_sync.http_engine_factory` for a server. Launch mistakes raise
  `run_guard.UserError` before anything runs (`preflight`).
  """
  rc = preflight(cfg, workdir, policies, sft_checkpoint, allow_config_change)
  with contextlib.ExitStack() as locks:
    hold_locks(locks, rc, workdir, policies, sft_checkpoint)
    params, sft_history = warm_start(rc, workdir, sft_checkpoint, progress)
    rc = guided_by_budget(rc, workdir, params, policies, progress)
    if not policies:
      return {"policies": {}, "sft": {"history": sft_history}}
    finals: dict[int, Any] = {}  # bf16's final weights per seed, for the post-hoc FP4 eval
    for policy in policies:
      for seed in rc.rl.seeds:
        out = rl_loop.run_rl(rc, run_dir(workdir, policy, seed), policy, params, seed=seed,
                             engine_factory=engine_factory, progress=progress)
        if policy == "bf16":
          finals[seed] = out["params"]
    posthoc_path = os.path.join(workdir, f"{POSTHOC}.json")
    if finals and rc.eval.posthoc_fp4 and not _has_seeds(posthoc_path, finals):
      _write_json(posthoc_path, posthoc_fp4(rc, params, finals))
    return report(rc, workdir, policies, sft_history)


SELECTION = "guidance_selection.json"  # the guided layers a budget chose, in the workdir


def _guided_spec(policies: Sequence[str]) -> Any:
  """The first guided policy's parsed spec (its forwards calibrate a guidance budget)."""
  return next((spec for spec in map(policies_lib.parse, policies) if spec.policy.guided), None)


def check_guidance_budget(rc: RunConfig, policies: Sequence[str]) -> None:
  """Raises guidance_budget.BudgetError when `guidance.budget_bytes_per_token` is below one
  layer's guidance (it would guide nothing): before the warm start, from the record's layout."""
  spec = _guided_spec(policies or rc.policies)
  budget = rc.guidance.budget_bytes_per_token
  if budget is not None and spec is not None:
    guidance_budget.check_budget(
        budget, {0: guidance_budget.layer_bytes(rc.model_for(spec.policy.rollout.name))})


def guided_by_budget(rc: RunConfig, workdir: str, params: Any, policies: Sequence[str],
                     progress: bool = True) -> RunConfig:
  """`rc` guided at the layers `guidance.budget_bytes_per_token` buys (`guidance_budget`),
  chosen once per workdir on a calibration rollout from the warm start `params` and kept in
  `workdir/guidance_selection.json` (processes of one workdir, and resumed launches, read it);
  `rc` itself without a budget or a guided policy."""
  spec = _guided_spec(policies)
  budget = rc.guidance.budget_bytes_per_token
  if budget is None or spec is None:
    return rc
  path = os.path.join(workdir, SELECTION)
  with run_guard.locked(path + ".lock"):  # one process calibrates; the others wait and read
    saved = None
    if os.path.exists(path):
      with open(path) as f:
        saved = json.load(f)
    if saved is None or saved["budget_bytes_per_token"] != budget:
      saved = calibrate_guidance(rc, params, spec, progress)
      run_guard.write_json(path, saved)
  layers = tuple(saved["layers"])
  logging.info("guidance budget %g B/token: guided layers %s", budget, layers)
  return dataclasses.replace(rc, model=rc.model.replace(guided_layers=layers))


def calibrate_guidance(rc: RunConfig, params: Any, spec: Any, progress: bool) -> dict[str, Any]:
  """The greedy selection of guided layers within the budget, on `guidance.calibration_prompts`
  prompts of the run's task (their own seed stream) sampled from the warm start."""
  io = task_io.make_task_io(rc)
  seeds = run_config.Seeds(rc.seed, rc.seed)
  n = rc.guidance.calibration_prompts
  _, prompts = io.prompts(seeds.calibration_prompts(), n)
  sampling = [io.sampling(max_new_tokens=rc.rl.max_new_tokens, temperature=rc.rl.temperature,
                          top_p=rc.rl.top_p, seed=seeds.rl_sampling(-1, i)) for i in range(n)]
  ro = guidance_budget.calibration_rollout(params, rc.model_for(spec.policy.rollout.name),
                                           prompts, sampling)
  layers = tuple(range(rc.model.num_hidden_layers))
  unit_bytes = guidance_budget.layer_bytes_per_token(ro, layers)
  budget = rc.guidance.budget_bytes_per_token
  scorer = guidance_budget.LayerScorer(params, rc.model_for(spec.policy.train.name), ro)
  path = guidance_budget.greedy_path(scorer, unit_bytes, budget, progress)
  chosen = guidance_budget.select(path, budget)
  return {"budget_bytes_per_token": budget, "unit": "layer", "layers": list(chosen),
          "bytes_per_token": float(sum(unit_bytes[i] for i in chosen)),
          "unit_bytes_per_token": {str(k): v for k, v in unit_bytes.items()},
          "calibration_prompts": n, "calibration_policy": spec.name,
          "calibration_path": path}


RUN_LOCK = "run.lock"  # in each run's directory
SFT_LOCK = "sft.lock"  # in the workdir, while a launch trains the warm start


def hold_locks(stack: contextlib.ExitStack, rc: RunConfig, workdir: str, policies: Sequence[str],
               sft_checkpoint: str | None) -> None:
  """Locks, for the rest of the launch, everything it will write: the warm start when it
  trains one (`workdir/sft` absent), and each of its (policy, seed) runs, whose directory
  holds its checkpoints, logs and guidance store. A launch that would write something another
  live launch holds is refused (`run_guard.WorkdirInUseError`, naming that process) before it
  writes anything; launches of other policies share a workdir (README: `--sft_only`, then one
  `--policies` process each)."""
  wanted = []
  if not sft_checkpoint and not os.path.isdir(os.path.join(workdir, "sft")):
    wanted.append((os.path.join(workdir, SFT_LOCK), f"the warm start of {workdir}"))
  wanted += [(os.path.join(run_dir(workdir, p, s), RUN_LOCK), f"the run {run_dir(workdir, p, s)}")
             for p in policies for s in rc.rl.seeds]
  # The processes of one multi-host launch share its runs: each holds its own process's lock.
  suffix = f".p{jax.process_index()}" if jax.process_count() > 1 else ""
  for path, what in wanted:
    stack.enter_context(run_guard.holding(path + suffix, what))


def preflight(cfg, workdir: str, policies: Sequence[str], sft_checkpoint: str | None = None,
              allow_config_change: bool = False) -> RunConfig:
  """Every launch mistake, before the warm start: raises run_guard.UserError. Returns the
  resolved config (`cfg`: a config file's ConfigDict, or a RunConfig).

  The config (`rl_loop.validate`) and --policies; the workdir's fingerprint (a workdir holds
  one config's runs; --allow_config_change continues it under another); the saved warm start
  (workdir/sft, or --sft_checkpoint) has the config's parameter shapes.
  """
  with run_guard.user_input():
    rc = rl_loop.validate(cfg)
    for p in policies:
      policies_lib.parse(p)  # unknown --policies fail here, before the warm start
    check_guidance_budget(rc, policies)
  sft = os.path.abspath(sft_checkpoint) if sft_checkpoint else None
  check = lambda: run_guard.check_workdir(workdir, rc.source, launch={"sft_checkpoint": sft},
                                          allow_change=allow_config_change)
  if run_guard.read(workdir) is not None:
    check()  # names every field that differs from the workdir's config
  start = sft or os.path.join(workdir, "sft")
  if os.path.isdir(start):
    with run_guard.user_input():
      check_warm_start(rc, start)
  check()  # a first launch records its config only once nothing refused it
  return rc


def check_warm_start(rc: RunConfig | Any, path: str) -> None:
  """Raises ValueError when the orbax checkpoint at `path` is of another model than the
  config's: other parameter shapes (width, depth, vocabulary...) or another value of a field
  that changes the computation (`ModelConfig.compute_fields`: routing normalisation, norms,
  RoPE, dtype), naming the differing fields."""
  saved = orbax_ckpt.read_orbax_config(path)
  want = run_config.resolve(rc).model_for("bf16")
  fields = {f"model.{k}": v for k, v in config_lib.compute_differences(saved, want).items()}
  if fields:
    raise ValueError(f"the warm start {path} is of another model ({run_guard.describe(fields)})"
                     f"; use a new --workdir (or a matching --sft_checkpoint)")


def report(rc: RunConfig | Any, workdir: str, policies: Sequence[str],
           sft_history: list[dict[str, float]] | None = None) -> dict[str, Any]:
  """The table, summary.json and plot of whatever runs exist under workdir, from their CSVs.

  Runs cut short count with the steps they reached (`steps_done` per seed), so a device call
  that ran out of time still reports what it measured.
  """
  rc = run_config.resolve(rc)  # a config file's ConfigDict, or resolved already
  results: dict[str, Any] = {}
  for policy in policies:
    per_seed = []
    for seed in rc.rl.seeds:
      d = run_dir(workdir, policy, seed)
      rows, evals = run_log.read_curves(d)
      if not rows and not evals:
        continue
      s = dict(evaluation.summarize(rows, evals), seed=seed, steps_done=len(rows))
      s["sft_reward"] = s.pop("start_reward")
      done = os.path.join(d, "history.json")
      if os.path.exists(done):
        with open(done) as f:
          saved = json.load(f)["summary"]
        s["guidance_fallback_batches"] = saved["guidance_fallback_batches"]
        s["checkpoint_fallbacks"] = saved.get("checkpoint_fallbacks", 0)
      per_seed.append(s)
    if per_seed:
      results[policy] = aggregate(per_seed)
  posthoc_path = os.path.join(workdir, f"{POSTHOC}.json")
  if os.path.exists(posthoc_path):
    with open(posthoc_path) as f:
      results[POSTHOC] = json.load(f)
  record = run_guard.read(workdir) or {}
  summary = {"policies": results, "sft": {"history": sft_history or []},
             "config": rc.source,
             "fingerprint": record.get("fingerprint"),
             "config_changes": record.get("changes", []),
             "devices": [str(d) for d in jax.devices()],
             "kernel_plans": kernel_plans(rc, policies),
             "guidance_selection": _read_json(os.path.join(workdir, SELECTION))}
  _write_json(os.path.join(workdir, "summary.json"), summary)
  plot(workdir, [p for p in policies if p in results], rc.rl.seeds)
  print_table(results)
  print(f"wrote {os.path.join(workdir, 'summary.json')} and "
        f"{os.path.join(workdir, 'reward_mismatch.png')}; per run: "
        f"{workdir}/<policy>/seed<s>/")
  return summary


def report_existing(cfg, workdir: str, policies: Sequence[str]) -> dict[str, Any]:
  """`report` of the runs under an existing workdir as they stand, running and resuming
  nothing (a seed cut short counts with the steps it reached). Raises run_guard.UserError for a
  config or policy mistake, or a workdir that holds no run."""
  with run_guard.user_input():
    rc = rl_loop.validate(cfg)
    for p in policies:
      policies_lib.parse(p)
    if run_guard.read(workdir) is None:
      raise ValueError(f"--report_only: {workdir} holds no run of train_rl (no run record)")
  history = _read_json(os.path.join(workdir, "sft_history.json")) or []
  return report(rc, workdir, policies, history)


def kernel_plans(rc: RunConfig, policies: Sequence[str]) -> dict[str, dict[str, Any]]:
  """{policy: {"rollout": plan, "train": plan}}: the kernel plan (`trace_jax.model.plan`)
  each forward of each policy resolves to on this backend, what its runs ran."""
  out = {}
  for p in policies:
    spec = policies_lib.parse(p)
    out[p] = {role: plan_lib.resolve(rc.model_for(fwd.name)).as_dict()
              for role, fwd in (("rollout", spec.policy.rollout), ("train", spec.policy.train))}
  return out


def _read_json(path: str) -> Any:
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def _write_json(path: str, obj: Any) -> None:
  """Written whole or not at all: policy processes sharing a workdir read each other's files."""
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=1)
  os.replace(tmp, path)


def _has_seeds(path: str, finals: dict[int, Any]) -> bool:
  """Whether a saved post-hoc eval covers exactly these bf16 runs (seeds)."""
  if not os.path.exists(path):
    return False
  with open(path) as f:
    return sorted(s["seed"] for s in json.load(f)["per_seed"]) == sorted(finals)


def run_dir(workdir: str, policy: str, seed: int) -> str:
  """Where one (policy, RL seed) run lives."""
  return os.path.join(workdir, policy, f"seed{seed}")


def warm_start(rc: RunConfig | Any, workdir: str, sft_checkpoint: str | None, progress: bool
               ) -> tuple[Any, list[dict[str, float]]]:
  """(params, SFT loss history): from --sft_checkpoint, workdir/sft, or a new SFT run."""
  rc = run_config.resolve(rc)  # a config file's ConfigDict, or resolved already
  sft_history_path = os.path.join(workdir, "sft_history.json")
  if sft_checkpoint:
    return orbax_ckpt.load_orbax(sft_checkpoint)[1], []
  sft_dir = os.path.join(workdir, "sft")
  if os.path.isdir(sft_dir):
    params = orbax_ckpt.load_orbax(sft_dir)[1]
    history = []
    if os.path.exists(sft_history_path):
      with open(sft_history_path) as f:
        history = json.load(f)
    logging.info("loaded SFT warm start from %s", sft_dir)
    return params, history
  params, history = rl_loop.run_sft(rc, workdir, progress=progress)
  orbax_ckpt.save_orbax(sft_dir, rc.model_for("bf16"), params, wait=True)
  with open(sft_history_path, "w") as f:
    json.dump(history, f)
  return params, history


def aggregate(per_seed: list[dict[str, Any]]) -> dict[str, Any]:
  """Means over seeds of every numeric summary key, the spread of the rewards and of the
  mismatch metrics, and the gain.

  `<key>_sd` for `SPREAD_KEYS`: sample standard deviation over seeds (None for one seed).
  `gain`: mean of (final - SFT) eval reward per seed; `gain_se`: its standard error.
  """
  out: dict[str, Any] = {}
  for k in dict.fromkeys(k for s in per_seed for k in s if k != "seed"):
    vals = [s[k] for s in per_seed if isinstance(s.get(k), (int, float))]
    out[k] = float(np.mean(vals)) if vals else None
  n = len(per_seed)
  for k in SPREAD_KEYS:
    vals = [s[k] for s in per_seed if s.get(k) is not None]
    out[f"{k}_sd"] = float(np.std(vals, ddof=1)) if len(vals) > 1 else None
  gains = [s["final_reward"] - s["sft_reward"] for s in per_seed
           if s.get("final_reward") is not None and s.get("sft_reward") is not None]
  out["gain"] = float(np.mean(gains)) if gains else None
  out["gain_se"] = float(np.std(gains, ddof=1) / np.sqrt(len(gains))) if len(gains) > 1 else None
  out["num_seeds"] = n
  out["per_seed"] = per_seed
  return out


def posthoc_fp4(rc: RunConfig | Any, sft_params: Any, finals: dict[int, Any]
                ) -> dict[str, Any]:
  """SFT and final bf16 weights, quantized post hoc: greedy eval through the FP4 engine."""
  rc = run_config.resolve(rc)  # a config file's ConfigDict, or resolved already
  from trace_jax.rollout.engine import InProcessEngine
  io = task_io.make_task_io(rc)
  engine = InProcessEngine(sft_params, rc.model_for("fp4_rtn"),
                           record_guidance=False, max_batch=rc.eval.num_prompts,
                           min_prompt_len=rc.max_prompt_len)
  sft_reward = evaluation.evaluate(engine, io, rc)
  per_seed = []
  for seed, params in finals.items():
    engine.update_weights(params)
    per_seed.append({"seed": seed, "sft_reward": sft_reward,
                     "final_reward": evaluation.evaluate(engine, io, rc)})
  engine.close()
  out = aggregate(per_seed)
  for k in ("best_reward", "best_reward_sd"):
    out.pop(k, None)
  return out


def print_table(results: dict[str, dict[str, Any]]) -> None:
  """Means over seeds; rewards and mismatch metrics as mean +- sd with several seeds (the gain
  +- its standard error)."""
  cols = [("policy", 14), ("seeds", 5), ("sft_reward", 13), ("final_reward", 13),
          ("best_reward", 13), ("gain", 15), ("mean_abs_dlogp", 19), ("k3_kl", 19),
          ("ratio_extreme_frac", 19), ("is_capped_frac", 19), ("max_seq_log_ratio", 19),
          ("clip_frac", 19), ("flip_rate_guided", 16), ("flip_rate_unguided", 18),
          ("routing_flip_rate", 17), ("guidance_bytes_per_token", 24),
          ("rollout_tokens_per_s", 20), ("train_tokens_per_s", 18), ("step_s", 8)]
  print(" ".join(f"{n:>{w}}" for n, w in cols))
  for p, s in results.items():
    cells = [f"{p:>14}", f"{s.get('num_seeds', 1):>5}"]
    for n, w in cols[2:]:
      cells.append(f"{_cell(s, n):>{w}}")
    print(" ".join(cells))


def _cell(s: dict[str, Any], n: str) -> str:
  v = s.get(n)
  spread = s.get("gain_se") if n == "gain" else s.get(f"{n}_sd")
  if v is None:
    return "-"
  if spread is None:
    return f"{v:.3g}" if isinstance(v, float) else f"{v!s}"
  return f"{v:.3f}+-{spread:.3f}" if n in REWARD_KEYS or n == "gain" else f"{v:.3g}+-{spread:.2g}"


def plot(workdir: str, policies: Sequence[str], seeds: Sequence[int]) -> None:
  """Eval and train reward, rollout/trainer |dlogp| and guided-site flips per step.

  One colour per policy: the line is the mean over seeds, the band their min..max. Reads each
  run's metrics.csv and evals.csv, so runs cut short plot as far as they got.
  """
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 4, figsize=(19, 3.8))
  for i, p in enumerate(policies):
    c = f"C{i}"
    curves = [run_log.read_curves(run_dir(workdir, p, s)) for s in seeds]
    label = f"{p} ({len(seeds)} seeds)" if len(seeds) > 1 else p
    _band(axes[0], [[(e["step"], e["reward"]) for e in ev] for _, ev in curves], c, label, "o-")
    rows = [r for r, _ in curves]
    _band(axes[1], [_running_mean([(r["step"], r["reward"]) for r in rs], 5) for rs in rows],
          c, label)
    _band(axes[2], [[(r["step"], r["mean_abs_dlogp"]) for r in rs] for rs in rows], c, label)
    _band(axes[3], [[(r["step"], r["flip_rate_guided"]) for r in rs
                     if r.get("flip_rate_guided") is not None] for rs in rows], c, label)
  axes[0].set_title("eval reward (greedy, fixed prompts)")
  axes[1].set_title("train reward (sampled, 5-step mean)")
  axes[2].set_title("rollout/trainer mean |dlogp|")
  axes[3].set_title("FP4 code flips at guided sites (audited rows)")
  axes[2].set_yscale("symlog", linthresh=1e-4)
  axes[3].set_yscale("symlog", linthresh=1e-4)
  for ax in axes:
    ax.set_xlabel("RL step")
    if ax.get_legend_handles_labels()[0]:
      ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, "reward_mismatch.png"), dpi=110)
  plt.close(fig)


def _running_mean(points: list[tuple[int, float]], n: int) -> list[tuple[int, float]]:
  if len(points) < n:
    return points
  y = np.convolve([v for _, v in points], np.ones(n) / n, "valid")
  return [(points[j + n - 1][0], float(v)) for j, v in enumerate(y)]


def _band(ax, runs: list[list[tuple[int, float]]], color: str, label: str,
          style: str = "-") -> None:
  """Mean over runs at the steps all of them reached, shaded between their min and max."""
  runs = [r for r in runs if r]
  if not runs:
    return
  steps = sorted(set.intersection(*[{s for s, _ in r} for r in runs]))
  if not steps:
    return
  vals = np.array([[dict(r)[s] for s in steps] for r in runs], np.float64)
  ax.plot(steps, vals.mean(0), style, color=color, label=label, markersize=3)
  if len(runs) > 1:
    ax.fill_between(steps, vals.min(0), vals.max(0), color=color, alpha=0.2)
