"""Quickstart (CPU, ~15 minutes): SFT warm start, then GRPO on one-step arithmetic word problems
under bf16, fp4_rtn and fp4_trace from the same start, 3 RL seeds each. `make run` runs it.

The SFT data is deliberately imperfect: 60% of the demonstrations work the sum out correctly
but report the starting amount as the answer ("7+5=12 / #### 7", reward 0). The warm start
therefore mostly reports the wrong number, a systematic error the verifier's reward can teach
away in tens of steps; a clean warm start on this task learned nothing measurable in the CPU
budget (docs/results.md)."""

import ml_collections

from configs import guidance_section, model_section, rl_section


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.policies = ("bf16", "fp4_rtn", "fp4_trace")
  # A tiny Qwen3-MoE: 2 layers (layer 1 guided), 8 experts top-2, bf16 compute, fp32 master.
  # Every ModelConfig field is in the section (`model_section`): the kernel plan is "auto"
  # (the reference on CPU, the kernels on a Hopper GPU; `trace_jax.model.plan`).
  c.model = model_section(
      "tiny", vocab_size=100, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
      moe_intermediate_size=64, dtype="bfloat16", guidance_mode="compact")
  # tokenizer: "char" (the shipped tasks' character vocabulary) or a local HF tokenizer dir.
  c.task = ml_collections.ConfigDict(dict(
      name="reasoning", tokenizer="char",
      kwargs=dict(difficulty=1, min_steps=1, max_steps=1, max_start=9, max_operand=9,
                  multipliers=(2,), max_value=18, sloppy_demos=0.6)))
  c.max_prompt_len = 112  # characters + BOS; prompts are 60-97 (checked at start)
  c.seq_len = 128        # training rows: prompt + completion - 1, bucketed
  c.sft = ml_collections.ConfigDict(dict(steps=120, batch_size=32, lr=3e-3, warmup_steps=20,
                                         weight_decay=0.0))
  # seeds: one GRPO run per policy and seed from the one warm start (spread in the summary).
  # audit_fraction: share of each batch whose full FP4 codes are recorded to count flips.
  # `rl_section` adds every optional GRPO field at its default (`trace_jax.train.run_config`):
  # clip_eps_high (clip-higher; None: clip_eps), kl_coef (k3 KL to the run's starting weights),
  # advantage ("grpo", "dr_grpo"), adv_std, loss_agg, is_level, epochs and minibatches (one
  # update per batch), so the command line can set any of them.
  c.rl = rl_section(
      steps=30, prompts_per_step=8, group_size=8, max_new_tokens=16, temperature=1.0,
      top_p=1.0, lr=1e-4, warmup_steps=3, weight_decay=0.0, clip_eps=0.2, is_mode="truncate",
      is_cap=5.0, aux_loss_coef=0.001, on_missing_guidance="error", keep_guidance=False,
      seeds=(0, 1, 2), audit_fraction=1.0)
  # 64 prompts: the rollout batch size, so the engine compiles one program per policy.
  # posthoc_fp4: the bf16 runs' weights also evaluated through the FP4 engine.
  c.eval = ml_collections.ConfigDict(dict(num_prompts=64, every=10, posthoc_fp4=True))
  c.checkpoint_every = 10
  # budget_bytes_per_token: choose the guided layers by measured mismatch within this many
  # guidance bytes per token (None: model.guided_layers, the deeper half).
  c.guidance = guidance_section()
  return c
