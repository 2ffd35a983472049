"""Supervised warm start on task demonstrations, saved as an orbax checkpoint.

  python -m experiments.sft --config=configs/quickstart.py --workdir=runs/sft

RL (`experiments.train_rl --sft_checkpoint=runs/sft/params`) then starts from a policy that
already produces the answer format, so there is a reward signal to improve. The workdir keeps
the config it was made with (`run_config.json`, the fields a warm start depends on:
`run_guard.SFT_SCOPE`); another one is refused unless --allow_config_change. Mistakes in the
config, flags or workdir print one line, `error: ...`, and exit 2.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from absl import app, flags
from ml_collections import config_flags

from trace_jax.train import run_guard

_CONFIG = config_flags.DEFINE_config_file("config", "configs/quickstart.py",
                                          "Experiment config (.py with get_config()).")
_WORKDIR = flags.DEFINE_string("workdir", "runs/sft", "Output directory.")
_ALLOW_CHANGE = flags.DEFINE_bool(
    "allow_config_change", False, "Retrain a workdir made with another config (its "
    "run_config.json records the change) instead of refusing.")


def main(argv: Sequence[str]) -> None:
  del argv
  # Imported here: flag and config-file errors are reported before the training code loads.
  from trace_jax.io import orbax_ckpt
  from trace_jax.train import rl_loop
  cfg, workdir = _CONFIG.value, _WORKDIR.value
  with run_guard.exit_on_errors(log_dir=workdir):
    with run_guard.user_input():
      rl_loop.validate(cfg)
    run_guard.check_workdir(workdir, cfg, scope=run_guard.SFT_SCOPE,
                            allow_change=_ALLOW_CHANGE.value)
    with run_guard.holding(os.path.join(workdir, "sft.lock"), f"the warm start in {workdir}"):
      params, history = rl_loop.run_sft(cfg, workdir)
      path = os.path.join(workdir, "params")
      orbax_ckpt.save_orbax(path, rl_loop.model_config(cfg, "bf16"), params, wait=True)
      with open(os.path.join(workdir, "sft_history.json"), "w") as f:
        json.dump(history, f, indent=1)
  loss = (f"loss {history[0]['loss']:.3f} -> {history[-1]['loss']:.3f}" if history
          else "no steps (sft.steps=0)")
  print(f"SFT: {loss}; saved {path}")


if __name__ == "__main__":
  app.run(main, flags_parser=run_guard.flags_parser(_CONFIG))
