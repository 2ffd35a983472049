"""One H200, minutes: a model large enough that FP4 flips and routing flips matter
(6 layers, 32 experts top-4, hidden 512; layers 3-5 guided), GRPO on two-step arithmetic from
one short SFT start, 3 RL seeds per policy: bf16, fp4_rollout (FP4 rollout, BF16 training),
fp4_rtn, fp4_trace and fp4_trace with routing replay. As in the quickstart, 60% of the SFT
demonstrations report the starting amount instead of the result, so the warm start is wrong
in one systematic way that RL can fix (a clean start left greedy eval flat on the H200)."""

import ml_collections

from configs import model_section, quickstart


def get_config() -> ml_collections.ConfigDict:
  c = quickstart.get_config()
  c.model = model_section(
      "tiny", vocab_size=100, hidden_size=512, num_hidden_layers=6, num_attention_heads=8,
      num_key_value_heads=4, head_dim=64, num_experts=32, num_experts_per_tok=4,
      moe_intermediate_size=256, dtype="bfloat16", max_position_embeddings=1024,
      guidance_mode="compact", moe_impl="kernel")
  c.policies = ("bf16", "fp4_rollout", "fp4_rtn", "fp4_trace", "fp4_trace+r3")
  c.task.kwargs = dict(difficulty=1, sloppy_demos=0.6)
  c.max_prompt_len = 144  # the run's prompts are 60-134 tokens (checked at start)
  c.seq_len = 176
  c.sft.steps = 150
  c.sft.batch_size = 64
  c.sft.lr = 1e-3
  # Steps are cheap on the H200 (~0.7 s for FP4; compiles take minutes). At 16 x 8 samples a
  # policy process held ~15 GB with moe_impl="tiled" (60-83 GB with ragged_dot, where 32 x 8
  # ran out with three processes sharing the GPU); "kernel" (the Pallas grouped GEMMs: the
  # Qwen3-width train step 1.61x faster than tiled, docs/benchmarks.md) holds no more
  # temporaries than tiled. The RL results of docs/results.md ran tiled.
  c.rl.steps = 30
  c.rl.prompts_per_step = 16
  c.rl.group_size = 8
  c.rl.max_new_tokens = 32
  # 1e-4: the sloppy start gives a strong, consistent signal to fix in 30 steps (with a clean
  # start, 1e-4 over 30 steps let the sampled reward drift down and 5e-5 was used).
  c.rl.lr = 1e-4
  c.rl.seeds = (0, 1, 2)
  c.rl.audit_fraction = 0.25  # full codes of 32 of the 128 sequences per step
  c.eval.num_prompts = 128  # the same engine bucket as the 16 x 8 training samples
  c.eval.every = 10
  return c
