"""Greedy evals on a run's fixed prompt set, and a run's summary of its logged metrics."""

from __future__ import annotations

from typing import Any

import numpy as np

from trace_jax.rollout.protocol import RolloutEngine, Sample
from trace_jax.train import mismatch, run_log
from trace_jax.train.run_config import RunConfig, Seeds
from trace_jax.train.task_io import TaskIO


def eval_rollout(engine: RolloutEngine, io: TaskIO, run: RunConfig
                 ) -> tuple[list[Any], list[Sample]]:
  """(problems, greedy samples) of the fixed eval prompt set (the same for every policy)."""
  problems, prompts = io.prompts(Seeds(run.seed, run.seed).eval_prompts(), run.eval.num_prompts)
  sp = io.sampling(max_new_tokens=run.rl.max_new_tokens, temperature=0.0, seed=0)
  return problems, io.generate(engine, problems, prompts, [sp] * len(prompts))


def evaluate(engine: RolloutEngine, io: TaskIO, run: RunConfig) -> float:
  """Mean reward of greedy completions on the fixed eval prompt set."""
  problems, samples = eval_rollout(engine, io, run)
  return float(np.mean(io.rewards(problems, samples)))


def summarize(history: list[dict[str, Any]], evals: list[dict[str, float]]) -> dict[str, Any]:
  """Final/best eval reward, run means of the mismatch metrics and medians over steps of the
  wall-clock ones (`run_log.TIMING_KEYS`: a step that compiled weighs no more than any other)."""
  def over_steps(k, stat=np.mean):
    vals = [h[k] for h in history if h.get(k) is not None]
    return float(stat(vals)) if vals else None
  rewards = [e["reward"] for e in evals]
  return {
      "start_reward": rewards[0] if rewards else None,
      "final_reward": rewards[-1] if rewards else None,
      "best_reward": max(rewards) if rewards else None,
      "train_reward_first": history[0]["reward"] if history else None,
      "train_reward_last": history[-1]["reward"] if history else None,
      "train_reward_slope": reward_slope(history),
      **{k: over_steps(k) for k in ("mean_abs_dlogp", "k3_kl", "max_abs_dp", *mismatch.METRICS,
                                    "guidance_bytes_per_token", *run_log.DASHBOARD_KEYS)},
      **{k: over_steps(k, np.median) for k in run_log.TIMING_KEYS},
  }


def reward_slope(history: list[dict[str, Any]]) -> float | None:
  """Least-squares slope of the sampled train reward per RL step (the trend of a run)."""
  if len(history) < 2:
    return None
  x = np.asarray([h["step"] for h in history], np.float64)
  y = np.asarray([h["reward"] for h in history], np.float64)
  return float(np.polyfit(x, y, 1)[0])
