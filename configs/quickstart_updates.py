"""The quickstart with several optimizer steps per rollout batch: 2 epochs of 4 mini-batches
(8 updates per RL step, each clipping against the trainer's log-probs before the batch's first
update), under FP4 rollout with BF16 training (fp4_rollout), vanilla FP4 QAT (fp4_rtn) and TRACE
(fp4_trace), 3 RL seeds each from one SFT start. Where one update per batch keeps the PPO ratio
at 1, here rollout/trainer mismatch has room to compound across the updates.

  python -m experiments.train_rl --config=configs/quickstart_updates.py \
      --workdir=runs/quickstart_updates
"""

import ml_collections

from configs import quickstart


def get_config() -> ml_collections.ConfigDict:
  c = quickstart.get_config()
  c.policies = ("fp4_rollout", "fp4_rtn", "fp4_trace")
  # 64 samples a step (8 prompts x 8): mini-batches of 16, two whole groups each.
  c.rl.epochs = 2
  c.rl.minibatches = 4
  return c
