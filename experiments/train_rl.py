"""GRPO with low-precision rollout: SFT warm start, then one run per precision policy.

  python -m experiments.train_rl --config=configs/quickstart.py --workdir=runs/quickstart

Runs the config's SFT warm start (or loads --sft_checkpoint), then GRPO under every policy in
`config.policies` from that same start, and writes per policy metrics.csv, TensorBoard
summaries and checkpoints (a killed run resumes where it stopped), and for the whole run a
comparison table, `summary.json` and `reward_mismatch.png`. Rollout goes through the
in-process engine by default, or an HTTP server (ours or SGLang) with --rollout_url.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from trace_jax.io import hf, orbax_ckpt
from trace_jax.model.config import ModelConfig
from trace_jax.train import rl_loop

_CONFIG = config_flags.DEFINE_config_file("config", "configs/quickstart.py",
                                          "Experiment config (.py with get_config()).")
_WORKDIR = flags.DEFINE_string("workdir", "runs/quickstart", "Output directory.")
_POLICIES = flags.DEFINE_list("policies", None, "Override config.policies.")
_SFT_CKPT = flags.DEFINE_string("sft_checkpoint", None,
                                "Orbax checkpoint (experiments.sft) to start from.")
_ROLLOUT_URL = flags.DEFINE_string("rollout_url", None,
                                   "Roll out through this HTTP server (ours or SGLang).")
_API_KEY = flags.DEFINE_string("api_key", None, "Bearer token for --rollout_url.")
_NO_PROGRESS = flags.DEFINE_bool("no_progress", False, "Disable progress bars.")

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
  os.makedirs(workdir, exist_ok=True)
  if sft_checkpoint:
    _, params = orbax_ckpt.load_orbax(sft_checkpoint)
    sft_history = []
  else:
    sft_dir = os.path.join(workdir, "sft")
    if os.path.isdir(sft_dir):
      _, params = orbax_ckpt.load_orbax(sft_dir)
      sft_history = []
      logging.info("loaded SFT warm start from %s", sft_dir)
    else:
      params, sft_history = rl_loop.run_sft(cfg, workdir, progress=progress)
      orbax_ckpt.save_orbax(sft_dir, rl_loop.model_config(cfg, "bf16"), params, wait=True)
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
  """Reward (eval and train) and rollout/trainer mismatch per step, one line per policy."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
  for p in policies:
    with open(os.path.join(workdir, p, "history.json")) as f:
      h = json.load(f)
    steps = [r["step"] for r in h["history"]]
    axes[0].plot([e["step"] for e in h["evals"]], [e["reward"] for e in h["evals"]], "o-",
                 label=p)
    axes[1].plot(steps, [r["reward"] for r in h["history"]], alpha=0.8, label=p)
    axes[2].plot(steps, [r["mean_abs_dlogp"] for r in h["history"]], label=p)
  axes[0].set_title("eval reward (greedy, fixed prompts)")
  axes[1].set_title("train reward (sampled)")
  axes[2].set_title("rollout/trainer mean |dlogp|")
  axes[2].set_yscale("symlog", linthresh=1e-4)
  for ax in axes:
    ax.set_xlabel("RL step")
    ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, "reward_mismatch.png"), dpi=110)
  plt.close(fig)


def main(argv: Sequence[str]) -> None:
  del argv
  cfg = _CONFIG.value
  policies = _POLICIES.value or list(cfg.policies)
  run(cfg, _WORKDIR.value, policies, _SFT_CKPT.value, _ROLLOUT_URL.value, _API_KEY.value,
      progress=not _NO_PROGRESS.value)


if __name__ == "__main__":
  app.run(main)
