r"""The invariant kernel plan's cost: rollout and GRPO-step time under `model.plan="invariant"`
against the default plan, side by side in one process, on the quickstart's model and batch.

  python -m experiments.bench.invariant                          # configs/quickstart.py, CPU
  python -m experiments.bench.invariant --policies=bf16 --reps=2 --json_out=/tmp/inv.json

Per (policy, plan): an `InProcessEngine` generates `--new_tokens` tokens (temperature 1) for
`--prompts` random prompts of the quickstart's prompt lengths (its rollout batch: one program
of prompts padded to `max_prompt_len`); the first call's wall time is `rollout_first_s`
(compile + one call), then the median of `--reps` calls `rollout_s`. Its samples become the
GRPO batch (`seq_len` rows, advantages +-1; fp4_trace with the rollout's guidance and routing,
as the learner passes them), and `step.grpo_step` runs on it: `train_first_s` (compile + one
step), then the median of `--reps` steps `train_s`. The run also reports the step's mean
|dlogp| between the trainer and the rollout (0 under the invariant plan). Ratios: invariant
over default per policy.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import jax
import numpy as np
from absl import flags

from experiments import common

FLAGS = flags.FlagValues()
flags.DEFINE_list("policies", ["bf16", "fp4_rtn", "fp4_trace"], "Forward policies.",
                  flag_values=FLAGS)
flags.DEFINE_list("plans", ["auto", "invariant"], "Kernel plan presets, the first the "
                  "baseline of the ratios.", flag_values=FLAGS)
flags.DEFINE_integer("prompts", 64, "Rollout batch (the quickstart's: 8 prompts x 8).",
                     flag_values=FLAGS)
flags.DEFINE_integer("new_tokens", 16, "Tokens generated per prompt.", flag_values=FLAGS)
flags.DEFINE_integer("reps", 3, "Timed calls per case after the first.", flag_values=FLAGS)
flags.DEFINE_string("json_out", "", "JSON output path ('' = none).", flag_values=FLAGS)


def _case(params: Any, config: Any, seq_len: int, prompts: list[list[int]]
          ) -> dict[str, float]:
  """Times one (policy, plan): the rollout, then GRPO steps on its samples."""
  from trace_jax.rollout.engine import InProcessEngine
  from trace_jax.rollout.protocol import SamplingParams
  from trace_jax.train import batch as batch_lib
  from trace_jax.train import step as step_lib

  reps = FLAGS.reps
  eng = InProcessEngine(params, config, max_batch=len(prompts),
                        min_prompt_len=max(map(len, prompts)))
  sp = [SamplingParams(max_new_tokens=FLAGS.new_tokens, temperature=1.0, seed=i)
        for i in range(len(prompts))]
  t0 = time.perf_counter()
  samples = eng.generate(prompts, sp)
  first = time.perf_counter() - t0
  rollout_s, _ = common.median_seconds(lambda: eng.generate(prompts, sp), lambda _: None, 0,
                                       reps)
  rec = eng.last_guidance
  guided = config.forward.guided
  batch = batch_lib.rl_batch(
      samples, np.where(np.arange(len(samples)) % 2 == 0, 1.0, -1.0).astype(np.float32),
      seq_len, rec["guidance"] if guided else None,
      {layer: rec["routing"][layer] for layer in config.guided_layers} if guided else None)
  tx = step_lib.make_optimizer(step_lib.OptimConfig(lr=1e-6))
  state = step_lib.init_state(params, tx)
  rl = step_lib.RLConfig()

  def step():
    nonlocal state
    state, m, _ = step_lib.grpo_step(state, batch, config=config, tx=tx, rl=rl)
    return m

  t0 = time.perf_counter()
  m = jax.device_get(step())
  train_first = time.perf_counter() - t0
  train_s, _ = common.median_seconds(step, jax.block_until_ready, 0, reps)
  eng.close()
  tokens = sum(len(s.tokens) for s in samples)
  return {"rollout_first_s": first, "rollout_s": rollout_s,
          "rollout_tokens_per_s": tokens / rollout_s, "train_first_s": train_first,
          "train_s": train_s, "mean_abs_dlogp": float(m["mean_abs_dlogp"]),
          "k3_kl": float(m["k3_kl"])}


def main(argv: list[str]) -> dict[str, Any]:
  if not common.parse_flags(FLAGS, argv):
    return {}
  from configs import quickstart
  from trace_jax import model as model_lib
  from trace_jax.train import rl_loop

  cfg = quickstart.get_config()
  base = rl_loop.model_config(cfg)
  params = model_lib.init_params(base, 0, param_dtype="float32")
  rng = np.random.default_rng(0)
  prompts = [rng.integers(3, base.vocab_size, int(n)).tolist()
             for n in rng.integers(60, 98, FLAGS.prompts)]
  res: dict[str, Any] = {"device": common.device_description(), "cases": {}}
  rows = []
  for policy in FLAGS.policies:
    for plan in FLAGS.plans:
      config = base.replace(policy=policy, plan=plan)
      r = _case(params, config, cfg.seq_len, prompts)
      res["cases"][f"{policy}:{plan}"] = r
      ref = res["cases"][f"{policy}:{FLAGS.plans[0]}"]
      r["rollout_over_baseline"] = r["rollout_s"] / ref["rollout_s"]
      r["train_over_baseline"] = r["train_s"] / ref["train_s"]
      rows.append([policy, plan, f"{r['rollout_first_s']:.1f}", f"{r['rollout_s']:.2f}",
                   f"{r['rollout_over_baseline']:.2f}", f"{r['train_first_s']:.1f}",
                   f"{r['train_s']:.2f}", f"{r['train_over_baseline']:.2f}",
                   f"{r['mean_abs_dlogp']:.2e}"])
      print(" ".join(rows[-1]), flush=True)
  text = common.format_table(
      ["policy", "plan", "rollout first s", "rollout s", "x base", "train first s",
       "train s/step", "x base", "|dlogp|"], rows)
  return common.finish(res, FLAGS, text)


if __name__ == "__main__":
  main(sys.argv)
