"""The real Qwen3-30B-A3B shape, for users with clusters: load the HF checkpoint with
`python -m experiments.convert_checkpoint --direction=hf_to_orbax`, pass it with
--sft_checkpoint, and shard over a mesh (`trace_jax.model.sharding`). The tokenizer is the
checkpoint's: `--config=configs/qwen3_30b_a3b.py:/path/to/Qwen3-30B-A3B` (the HF directory),
or `--config.task.tokenizer=...`. Not run on CI."""

import ml_collections

from configs import model_section, quickstart


def get_config(hf_dir: str | None = None) -> ml_collections.ConfigDict:
  """hf_dir: the local HF checkpoint directory whose tokenizer the run uses."""
  c = quickstart.get_config()
  c.model = model_section("qwen3_30b_a3b", dtype="bfloat16", guidance_mode="compact",
                          moe_impl="tiled")
  c.task = ml_collections.ConfigDict(dict(
      name="gsm8k", kwargs=dict(),
      tokenizer=hf_dir or ml_collections.config_dict.placeholder(str)))
  c.max_prompt_len = 512
  c.seq_len = 2048
  c.sft.steps = 0
  c.rl.steps = 400
  c.rl.prompts_per_step = 64
  c.rl.group_size = 16
  c.rl.max_new_tokens = 1536
  c.rl.lr = 1e-6
  c.policies = ("fp4_trace+r3",)  # TRACE with rollout routing replay
  c.rl.seeds = (0,)
  c.rl.audit_fraction = 1 / 64  # full codes of 16 of the 1,024 sequences per step
  c.eval.num_prompts = 256
  c.eval.every = 50
  c.checkpoint_every = 25
  # Mesh for `trace_jax.model.sharding`: data x fsdp x expert x tensor.
  c.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=4, expert=8, tensor=1))
  return c
