"""Jet-RL's RL comparison on one H200: the small_h200 model and task under the FP8 policies.

bf16; fp8_rollout (FP8 rollout, BF16 training: the off-policy baseline Jet-RL argues against);
fp8_unified (the same FP8 GEMMs in rollout and training, Jet-RL); fp8_unified+fp8bwd (its
backward GEMMs in FP8 too). Every size is a multiple of 128 (FP8 blocks). The FP8 GEMMs run
as the Pallas kernel (`model.fp8_gemm="kernel"`; "xla" is the float32 reference, slow on the
GPU). Same SFT start and seeds as small_h200.
"""

import ml_collections

from configs import small_h200


def get_config() -> ml_collections.ConfigDict:
  c = small_h200.get_config()
  c.model.fp8_gemm = "kernel"
  c.policies = ("bf16", "fp8_rollout", "fp8_unified", "fp8_unified+fp8bwd")
  return c
