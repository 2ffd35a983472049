"""One H200, minutes: a model large enough that FP4 flips and routing flips matter
(6 layers, 32 experts top-4, hidden 512; layers 3-5 guided), GRPO on two-step arithmetic
under bf16, fp4_rtn and fp4_trace from one short SFT start."""

import ml_collections

from configs import quickstart


def get_config() -> ml_collections.ConfigDict:
  c = quickstart.get_config()
  c.model = ml_collections.ConfigDict(dict(
      preset="tiny", vocab_size=100, hidden_size=512, num_hidden_layers=6,
      num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=32,
      num_experts_per_tok=4, moe_intermediate_size=256, dtype="bfloat16",
      max_position_embeddings=1024, guidance_mode="compact",
      moe_impl="tiled"))
  c.task.kwargs = dict(difficulty=1)
  c.max_prompt_len = 144  # the run's prompts are 60-134 tokens (checked at start)
  c.seq_len = 176
  c.sft.steps = 150
  c.sft.batch_size = 64
  c.sft.lr = 1e-3
  # Steps are cheap on the H200 (~0.7 s for FP4; compiles take minutes). At 16 x 8 samples a
  # policy process holds ~15 GB with moe_impl="tiled" (60-83 GB with ragged_dot, where 32 x 8
  # ran out with three processes sharing the GPU); 32 x 8 under tiled is untried.
  c.rl.steps = 80
  c.rl.prompts_per_step = 16
  c.rl.group_size = 8
  c.rl.max_new_tokens = 32
  c.rl.lr = 5e-5  # 1e-4 (30 steps of 16 x 8) let the sampled reward drift down
  c.eval.num_prompts = 128  # the same engine bucket as the 16 x 8 training samples
  c.eval.every = 10
  return c
