"""A run's entry points: `validate`, the SFT warm start `run_sft`, and `run_rl` (one GRPO run).

Each takes a config file's ConfigDict or an already resolved `run_config.RunConfig` and
resolves it once (`run_config.resolve`); below them everything takes the typed config. `run_rl`
runs `trace_jax.train.learner.GRPOLearner` (rollout, guidance, update, mismatch, evals,
checkpoints) to its end. Every random choice is a function of (seed, step), so a run killed at
any point resumes from its last checkpoint exactly.
"""

from __future__ import annotations

import logging
from typing import Any

import jax.numpy as jnp
from tqdm.auto import tqdm

from trace_jax import model as model_lib
from trace_jax.model.config import ModelConfig
from trace_jax.train import batch as batch_lib
from trace_jax.train import checkpoints
from trace_jax.train import step as step_lib
from trace_jax.train.learner import GRPOLearner
from trace_jax.train.run_config import RunConfig, Seeds, resolve
from trace_jax.train.task_io import make_task_io

log = logging.getLogger(__name__)

# ------------------------------------------------------------------------------ config

def model_config(cfg: Any, policy: str | None = None) -> ModelConfig:
  """The ModelConfig of a run's model section; policy: a forward policy (`ModelConfig.policy`),
  default the section's."""
  run = resolve(cfg)
  return run.model if policy is None else run.model_for(policy)


def rl_seeds(cfg: Any) -> tuple[int, ...]:
  """The RL seeds of a run (`rl.seeds`; default the config's one `seed`)."""
  return resolve(cfg).rl.seeds


def validate(cfg: Any) -> RunConfig:
  """Fails early, with the offending field named, before anything is compiled: the config's
  fields (`run_config.resolve`), the tokenizer against the vocabulary, and every prompt of the
  run against the lengths (`check_lengths`). Returns the resolved config."""
  run = resolve(cfg)
  tok = make_task_io(run).tok  # raises on a missing tokenizer directory
  if run.model.vocab_size < tok.vocab_size:
    raise ValueError(f"model.vocab_size={run.model.vocab_size} is smaller than the tokenizer's "
                     f"{tok.vocab_size} (task.tokenizer={run.task.tokenizer!r})")
  check_lengths(run)
  return run


def check_lengths(run: RunConfig) -> None:
  """Every prompt the run will see fits `max_prompt_len`, and every sequence `seq_len`.

  The prompts are a function of the seed, so this enumerates them (SFT, every RL step, the
  eval set): a run then never stops at step 57 on one long prompt, and the rollout engine,
  padded to `max_prompt_len`, compiles one program for the whole run.
  """
  r = run.rl
  io = make_task_io(run)
  after_prompt = io.tokens_after_prompt(r.max_new_tokens)  # a completion, or an episode
  if run.max_prompt_len + after_prompt - 1 > run.seq_len:
    raise ValueError(f"seq_len={run.seq_len} cannot hold max_prompt_len={run.max_prompt_len} "
                     f"+ {after_prompt} tokens after the prompt (rl.max_new_tokens="
                     f"{r.max_new_tokens}) - 1 rows")
  sets = [(f"rl step {i}" + (f" (seed {s})" if s != run.seed else ""),
           Seeds(run.seed, s).rl_prompts(i), r.prompts_per_step)
          for s in r.seeds for i in range(r.steps)]
  sets.append(("the eval set", Seeds(run.seed, run.seed).eval_prompts(), run.eval.num_prompts))
  for where, seed, n in sets:
    longest = max(map(len, io.prompts(seed, n)[1]))
    if longest > run.max_prompt_len:
      need = longest + after_prompt - 1
      raise ValueError(f"{where} has a prompt of {longest} tokens > max_prompt_len="
                       f"{run.max_prompt_len}; raise max_prompt_len" +
                       (f" and seq_len to at least {need}" if need > run.seq_len else ""))
  for i in range(run.sft.steps):
    problems, prompts = io.prompts(Seeds(run.seed, run.seed).sft_prompts(i), run.sft.batch_size)
    demos, _ = io.demonstrations(problems, prompts)
    longest = max(len(pr) + len(d) for pr, d in zip(prompts, demos))
    if longest - 1 > run.seq_len:
      raise ValueError(f"sft step {i} has a prompt + demonstration + EOS of {longest} tokens "
                       f"({longest - 1} training rows) > seq_len={run.seq_len}")


# ------------------------------------------------------------------------------ SFT

def run_sft(cfg: Any, workdir: str, progress: bool = True) -> tuple[Any, list[dict[str, float]]]:
  """Supervised warm start on task demonstrations; returns (params, loss history). A step that
  leaves the state non-finite stops it (`checkpoints.NonFiniteStateError`)."""
  del workdir  # the warm start is saved by the caller
  run = resolve(cfg)
  mc = run.model_for("bf16")
  io = make_task_io(run)
  s = run.sft
  tx = step_lib.make_optimizer(step_lib.OptimConfig(
      lr=s.lr, warmup_steps=s.warmup_steps, total_steps=s.steps, weight_decay=s.weight_decay))
  seeds = Seeds(run.seed, run.seed)
  params = model_lib.init_params(mc, seeds.init_key(), param_dtype=jnp.float32)
  state = step_lib.init_state(step_lib.place_params(params, run.mesh), tx)
  history = []
  bar = tqdm(range(s.steps), desc="sft", disable=not progress, dynamic_ncols=True)
  for i in bar:
    problems, prompts = io.prompts(seeds.sft_prompts(i), s.batch_size)
    demos, masks = io.demonstrations(problems, prompts)
    b = batch_lib.sequence_batch(prompts, demos, run.seq_len, masks)
    state, m = step_lib.sft_step(state, {k: jnp.asarray(v) for k, v in b.items()}, config=mc,
                                 tx=tx)
    checkpoints.check_state(state, m["nonfinite"], f"sft step {i}")
    if i % 10 == 0 or i == s.steps - 1:
      loss = float(m["loss"])
      history.append({"step": i, "loss": loss})
      bar.set_postfix(loss=f"{loss:.3f}")
  return state.params, history


def run_rl(cfg: Any, workdir: str, policy: str, init_params: Any, *, seed: int | None = None,
           engine_factory: Any = None, max_steps: int | None = None,
           progress: bool = True) -> dict[str, Any]:
  """GRPO under run `policy` from `init_params`: `GRPOLearner` run to its end (or
  `max_steps`, to simulate a kill in tests), then closed.

  Returns the run's summary (final/best eval reward, mean mismatch, throughput), history,
  evals, final params and state; writes metrics.csv, evals.csv, flips.csv (per layer and
  site), TensorBoard summaries and history.json under `workdir`.
  """
  with GRPOLearner(resolve(cfg), workdir, policy, init_params, seed=seed,
                   engine_factory=engine_factory, progress=progress) as learner:
    return learner.run(max_steps)
