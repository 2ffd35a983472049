"""The quickstart's task and schedule under the FP8 policies, on CPU (Jet-RL's comparison at
the smallest size): bf16, fp8_rollout (FP8 rollout, BF16 training: off-policy), fp8_unified
(Jet-RL: the same FP8 GEMMs in rollout and training) and fp8_unified+fp8bwd (FP8 backward
GEMMs too), 3 RL seeds each from one SFT start. FP8 blocks need every linear size in
multiples of 128, so the model has 4 KV heads (128 wide) and experts 128 wide (the
quickstart's are 64): its bf16 row is this model's, not the quickstart's.

  python -m experiments.train_rl --config=configs/quickstart_fp8.py --workdir=runs/quickstart_fp8
"""

import ml_collections

from configs import quickstart


def get_config() -> ml_collections.ConfigDict:
  c = quickstart.get_config()
  c.model.num_key_value_heads = 4
  c.model.moe_intermediate_size = 128
  c.policies = ("bf16", "fp8_rollout", "fp8_unified", "fp8_unified+fp8bwd")
  return c
