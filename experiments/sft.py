"""Supervised warm start on task demonstrations, saved as an orbax checkpoint.

  python -m experiments.sft --config=configs/quickstart.py --workdir=runs/sft

RL (`experiments.train_rl --sft_checkpoint=runs/sft/params`) then starts from a policy that
already produces the answer format, so there is a reward signal to improve.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from absl import app, flags
from ml_collections import config_flags

from trace_jax.io import orbax_ckpt
from trace_jax.train import rl_loop

_CONFIG = config_flags.DEFINE_config_file("config", "configs/quickstart.py",
                                          "Experiment config (.py with get_config()).")
_WORKDIR = flags.DEFINE_string("workdir", "runs/sft", "Output directory.")


def main(argv: Sequence[str]) -> None:
  del argv
  cfg = _CONFIG.value
  rl_loop.validate(cfg)
  params, history = rl_loop.run_sft(cfg, _WORKDIR.value)
  path = os.path.join(_WORKDIR.value, "params")
  orbax_ckpt.save_orbax(path, rl_loop.model_config(cfg, "bf16"), params, wait=True)
  with open(os.path.join(_WORKDIR.value, "sft_history.json"), "w") as f:
    json.dump(history, f, indent=1)
  print(f"SFT: loss {history[0]['loss']:.3f} -> {history[-1]['loss']:.3f}; saved {path}")


if __name__ == "__main__":
  app.run(main)
