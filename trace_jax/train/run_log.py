"""A run's log: per-step metrics, FP4 flips and evals as CSV, TensorBoard scalars, a progress bar.

Files of a run directory (each row keyed by `step`):
  metrics.csv   one row per RL step (`METRIC_KEYS`)
  updates.csv   one row per optimizer step (`UPDATE_KEYS`, with its update, epoch and
                minibatch index within the RL step)
  flips.csv     one row per (step, layer, site) of the audited FP4 codes (`FLIP_KEYS`)
  evals.csv     one row per greedy eval, after `step` steps
  tb/           the same scalars for TensorBoard, under "<run name>/<key>"

The CSVs survive restarts: a resumed run keeps exactly the rows its restored checkpoint holds.
"""

from __future__ import annotations

import csv
import logging
import os
from collections.abc import Iterable, Mapping
from typing import Any

from tqdm.auto import tqdm

from trace_jax.train import mismatch

log = logging.getLogger(__name__)

# The rollout/trainer mismatch dashboard beside |dlogp| and K3 (`trace_jax.rl.losses`): the
# share of tokens whose probability ratio leaves [0.5, 2], the share capped by the importance
# weights, the largest per-sequence log-ratio; and how often the PPO clip acted.
DASHBOARD_KEYS = ("ratio_extreme_frac", "is_capped_frac", "max_seq_log_ratio", "clip_frac",
                  "clip_frac_high", "clip_frac_low")
# One RL step's wall time by phase (seconds): the rollout (generate and rewards), the records
# (store flush + read + padding into the batch), the optimizer steps, the new weights to the
# engine, and the audit (flip and routing comparison on the host); step_s is the whole step
# (not the periodic eval and checkpoint).
PHASE_KEYS = ("rollout_s", "guidance_s", "update_s", "weights_s", "audit_s")
METRIC_KEYS = ("reward", "mean_abs_dlogp", "k3_kl", "max_abs_dp", *mismatch.METRICS,
               "guidance_bytes_per_token", "loss", "grad_norm", "kl_ref",
               "rollout_tokens_per_s", "train_tokens_per_s", "response_len", *PHASE_KEYS,
               "step_s", *DASHBOARD_KEYS)
# One optimizer step's metrics (several per RL step with `rl.minibatches` / `rl.epochs`).
UPDATE_KEYS = ("loss", "pg_loss", "grad_norm", "clip_frac", "clip_frac_high", "clip_frac_low",
               "ratio_mean", "is_weight_mean", "is_capped_frac", "kl_ref")
FLIP_KEYS = ("layer", "site", "guided", "flips", "total", "one_apart", "scale_flips",
             "scale_total")
# Wall-clock figures: they differ between otherwise identical runs (resume tests skip them).
TIMING_KEYS = ("rollout_tokens_per_s", "train_tokens_per_s", *PHASE_KEYS, "step_s")


class CSVLog:
  """Appends one row per line; survives restarts (rows at or past `keep_below` are dropped)."""

  def __init__(self, path: str, fields: tuple[str, ...], keep_below: int):
    self.path, self.fields = path, ("step",) + tuple(fields)
    rows = []
    if os.path.exists(path):
      with open(path) as f:
        rows = [r for r in csv.DictReader(f) if int(r["step"]) < keep_below]
    with open(path, "w", newline="") as f:
      w = csv.DictWriter(f, fieldnames=self.fields, extrasaction="ignore")
      w.writeheader()
      w.writerows(rows)

  def write(self, row: dict[str, Any]) -> None:
    with open(self.path, "a", newline="") as f:
      csv.DictWriter(f, fieldnames=self.fields, extrasaction="ignore").writerow(row)


def read_curves(run_dir: str) -> tuple[list[dict[str, Any]], list[dict[str, float]]]:
  """(per-step metrics, evals) from a run's metrics.csv and evals.csv; empty if absent.

  Numbers come back as floats (step as int), empty cells as None.
  """
  def load(name: str) -> list[dict[str, Any]]:
    path = os.path.join(run_dir, name)
    if not os.path.exists(path):
      return []
    with open(path) as f:
      return [{k: int(v) if k == "step" else (float(v) if v != "" else None)
               for k, v in r.items()} for r in csv.DictReader(f)]
  return load("metrics.csv"), load("evals.csv")


def _tb_writer(logdir: str):
  try:
    from tensorboardX import SummaryWriter
  except ImportError:  # pragma: no cover - tensorboardX is a dependency
    log.warning("tensorboardX not installed: no TensorBoard summaries")
    return None
  return SummaryWriter(logdir)


class RunLog:
  """Everything a run reports, behind one object: CSVs, TensorBoard and the progress bar.

  name: the run's name in TensorBoard and on the bar (e.g. "fp4_trace"); start: the first
  step this launch runs (rows of steps >= start are dropped, as the checkpoint does);
  evals_below: the steps of the restored evals (evals.csv keeps rows before it).
  """

  def __init__(self, workdir: str, name: str, *, start: int, total: int, evals_below: int,
               desc: str | None = None, progress: bool = True):
    self.name = name
    self.metrics = CSVLog(os.path.join(workdir, "metrics.csv"), METRIC_KEYS, keep_below=start)
    self.flips = CSVLog(os.path.join(workdir, "flips.csv"), FLIP_KEYS, keep_below=start)
    self.updates = CSVLog(os.path.join(workdir, "updates.csv"),
                          ("update", "epoch", "minibatch", *UPDATE_KEYS), keep_below=start)
    self.evals = CSVLog(os.path.join(workdir, "evals.csv"), ("reward",),
                        keep_below=evals_below)
    self.tb = _tb_writer(os.path.join(workdir, "tb"))
    self.bar = tqdm(total=total, initial=start, desc=desc or name, disable=not progress,
                    dynamic_ncols=True)

  def step(self, row: Mapping[str, Any], flips: Iterable[Mapping[str, Any]] = (),
           updates: Iterable[Mapping[str, Any]] = ()) -> None:
    """One RL step's metrics row (with its `step`), its per-layer flip rows and its optimizer
    steps' rows."""
    self.metrics.write(dict(row))
    for f in flips:
      self.flips.write({"step": row["step"], **f})
    for u in updates:
      self.updates.write({"step": row["step"], **u})
    if self.tb is not None:
      for k, v in row.items():
        if k != "step" and v is not None:
          self.tb.add_scalar(f"{self.name}/{k}", v, row["step"])
    self.bar.update(1)
    self.bar.set_postfix(reward=f"{row['reward']:.2f}", dlogp=f"{row['mean_abs_dlogp']:.4f}")

  def eval(self, step: int, reward: float) -> None:
    """The greedy eval reward after `step` steps."""
    self.evals.write({"step": step, "reward": reward})
    if self.tb is not None:
      self.tb.add_scalar(f"{self.name}/eval_reward", reward, step)

  def close(self) -> None:
    self.bar.close()
    if self.tb is not None:
      self.tb.close()
