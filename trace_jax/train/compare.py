"""The policy comparison: one SFT warm start, a GRPO run per precision policy, and a summary.

`run` is what `experiments/train_rl.py` runs. Each policy's run lives in `workdir/<policy>`
and resumes from its checkpoints, so policies may run as separate processes on one workdir
(after a warm-start-only call) and a last call writes the table, `summary.json` and the plot.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import jax
from absl import logging

from trace_jax.io import hf, orbax_ckpt
from trace_jax.model.config import ModelConfig
from trace_jax.train import rl_loop

SUMMARY_KEYS = ("sft_reward", "final_reward", "best_reward", "mean_abs_dlogp", "k3_kl",
                "flip_rate_guided", "routing_flip_rate", "guidance_bytes_per_token",
                "rollout_tokens_per_s", "train_tokens_per_s")


class HttpWeightSync:
  """RolloutEngine over HTTP whose update_weights(params) writes HF safetensors first."""

  def __init__(self, url: str, config: ModelConfig, weights_dir: str, api_key: str | None):
    from rollout_bridge.client import HttpRolloutEngine
    self.client = HttpRolloutEngine(url, api_key=api_key)
    self.config, self.dir, self.version = config, weights_dir, 0

  def generate(self, prompts, sampling):
    return self.client.generate(prompts, sampling)

  def update_weights(self, params: Any) -> None:
    self.version += 1
    path = os.path.join(self.dir, f"v{self.version:06d}")
    hf.save_hf_checkpoint(path, self.config, params)
    self.client.update_weights(os.path.abspath(path))

  def close(self) -> None:
    self.client.close()


def run(cfg, workdir: str, policies: Sequence[str], sft_checkpoint: str | None = None,
        rollout_url: str | None = None, api_key: str | None = None,
        progress: bool = True) -> dict[str, Any]:
  """The whole experiment; returns the summary dict also written to summary.json."""
  rl_loop.validate(cfg)
  for p in policies:
    rl_loop.model_config(cfg, p)  # unknown --policies fail here, before the warm start
  os.makedirs(workdir, exist_ok=True)
  sft_history_path = os.path.join(workdir, "sft_history.json")
  if sft_checkpoint:
    _, params = orbax_ckpt.load_orbax(sft_checkpoint)
    sft_history = []
  else:
    sft_dir = os.path.join(workdir, "sft")
    if os.path.isdir(sft_dir):
      _, params = orbax_ckpt.load_orbax(sft_dir)
      sft_history = []
      if os.path.exists(sft_history_path):
        with open(sft_history_path) as f:
          sft_history = json.load(f)
      logging.info("loaded SFT warm start from %s", sft_dir)
    else:
      params, sft_history = rl_loop.run_sft(cfg, workdir, progress=progress)
      orbax_ckpt.save_orbax(sft_dir, rl_loop.model_config(cfg, "bf16"), params, wait=True)
      with open(sft_history_path, "w") as f:
        json.dump(sft_history, f)
  if not policies:
    return {"policies": {}, "sft": {"history": sft_history}}
  factory = None
  if rollout_url:
    def factory(p, c, w):
      eng = HttpWeightSync(rollout_url, c, os.path.join(workdir, "weights"), api_key)
      eng.update_weights(p)
      return eng
  results = {}
  for policy in policies:
    out = rl_loop.run_rl(cfg, os.path.join(workdir, policy), policy, params,
                         engine_factory=factory, progress=progress)
    s = dict(out["summary"])
    s["sft_reward"] = s.pop("start_reward")
    results[policy] = s
  summary = {"policies": results, "sft": {"history": sft_history},
             "config": json.loads(cfg.to_json_best_effort()),
             "devices": [str(d) for d in jax.devices()]}
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
  plot(workdir, policies)
  print_table(results)
  print(f"wrote {os.path.join(workdir, 'summary.json')} and "
        f"{os.path.join(workdir, 'reward_mismatch.png')}; per policy: {workdir}/<policy>/")
  return summary


def print_table(results: dict[str, dict[str, Any]]) -> None:
  cols = [("policy", 10), ("sft_reward", 10), ("final_reward", 12), ("best_reward", 11),
          ("mean_abs_dlogp", 14), ("k3_kl", 9), ("flip_rate_guided", 16),
          ("routing_flip_rate", 17), ("guidance_bytes_per_token", 24),
          ("rollout_tokens_per_s", 20), ("train_tokens_per_s", 18)]
  print(" ".join(f"{n:>{w}}" for n, w in cols))
  for p, s in results.items():
    cells = [f"{p:>10}"]
    for n, w in cols[1:]:
      v = s.get(n)
      cells.append(f"{'-':>{w}}" if v is None else
                   f"{v:>{w}.3g}" if isinstance(v, float) else f"{v!s:>{w}}")
    print(" ".join(cells))


def plot(workdir: str, policies: Sequence[str]) -> None:
  """Eval and train reward, rollout/trainer |dlogp| and guided-site flips per step, per policy.

  Reads each policy's metrics.csv and evals.csv, so a run cut short plots as far as it got.
  """
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np

  fig, axes = plt.subplots(1, 4, figsize=(19, 3.8))
  for i, p in enumerate(policies):
    rows, evals = rl_loop.read_curves(os.path.join(workdir, p))
    c = f"C{i}"  # one colour per policy in every panel
    if evals:
      axes[0].plot([e["step"] for e in evals], [e["reward"] for e in evals], "o-", color=c,
                   label=p)
    if not rows:
      continue
    steps = np.array([r["step"] for r in rows])
    reward = np.array([r["reward"] for r in rows])
    axes[1].plot(steps, reward, color=c, alpha=0.3)
    if len(reward) >= 5:  # 5-step running mean over the noisy sampled reward
      axes[1].plot(steps[4:], np.convolve(reward, np.ones(5) / 5, "valid"), color=c, label=p)
    axes[2].plot(steps, [r["mean_abs_dlogp"] for r in rows], color=c, label=p)
    flips = [r.get("flip_rate_guided") for r in rows]
    if any(f is not None for f in flips):
      axes[3].plot(steps, [np.nan if f is None else f for f in flips], color=c, label=p)
  axes[0].set_title("eval reward (greedy, fixed prompts)")
  axes[1].set_title("train reward (sampled; line: 5-step mean)")
  axes[2].set_title("rollout/trainer mean |dlogp|")
  axes[3].set_title("FP4 code flips at guided sites")
  axes[2].set_yscale("symlog", linthresh=1e-4)
  axes[3].set_yscale("symlog", linthresh=1e-4)
  for ax in axes:
    ax.set_xlabel("RL step")
    if ax.get_legend_handles_labels()[0]:
      ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, "reward_mismatch.png"), dpi=110)
  plt.close(fig)
