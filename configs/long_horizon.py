"""Multi-turn GRPO on CPU: the number-guessing game (`long_horizon`), reward only at the end.

Each turn the policy writes one "guess N" line and the environment answers; the environment's
tokens stay out of the loss (`trace_jax/train/episodes.py`). The quickstart's model and
policies; turns make rollouts longer, so fewer steps.
"""

import ml_collections

from configs import quickstart


def get_config() -> ml_collections.ConfigDict:
  c = quickstart.get_config()
  c.model.moe_impl = "tiled"
  c.task = ml_collections.ConfigDict(dict(name="long_horizon", tokenizer="char",
                                          kwargs=dict(max_number=15)))
  c.max_prompt_len = 80  # the prompt is 67-68 tokens (checked at start)
  c.rl.max_new_tokens = 10  # per turn: "guess 15" + newline fits
  c.seq_len = 224  # prompt + 5 turns x (action + observation) + EOS (checked at start)
  c.sft.steps = 25  # 100 steps learn binary search outright (eval 1.0): no room for RL
  c.rl.steps = 20
  c.rl.seeds = (0,)  # a demonstration of the multi-turn path; the quickstart measures spread
  c.eval.num_prompts = 32
  c.eval.every = 10
  return c
