"""A run's config, seeds and SFT warm start, and `run_rl` (docs/design.md §8).

`validate` checks a run's config before anything compiles; `Seeds` names every random stream
once; `run_sft` is the supervised warm start; `run_rl` runs one GRPO run
(`trace_jax.train.learner.GRPOLearner`: rollout, guidance, update, mismatch, evals,
checkpoints). Every random choice is a function of (seed, step), so a run killed at any point
resumes from its last checkpoint exactly.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from tqdm.auto import tqdm

from trace_jax import model as model_lib
from trace_jax.model import config as config_lib
from trace_jax.model import policies, sharding
from trace_jax.model.config import ModelConfig
from trace_jax.rl import advantages as adv_lib
from trace_jax.rollout.protocol import RolloutEngine, Sample
from trace_jax.train import batch as batch_lib
from trace_jax.train import checkpoints, mismatch
from trace_jax.train import step as step_lib
from trace_jax.train.task_io import TaskIO, make_task_io

log = logging.getLogger(__name__)

# ------------------------------------------------------------------------------ config

def model_config(cfg: ml_collections.ConfigDict, policy: str | None = None) -> ModelConfig:
  """The ModelConfig of `cfg.model` (`trace_jax.model.config.resolve`: a preset name plus
  field overrides). policy: a forward policy (`ModelConfig.policy`); default the section's."""
  return config_lib.resolve(cfg.model, **({} if policy is None else {"policy": policy}))


def validate(cfg: ml_collections.ConfigDict) -> None:
  """Fails early, with the offending field named, before anything is compiled."""
  for section in ("model", "task", "sft", "rl", "eval"):
    if section not in cfg:
      raise ValueError(f"config has no `{section}` section")
  check_ranges(cfg)
  mc = model_config(cfg)
  tok = make_task_io(cfg).tok  # raises on a missing tokenizer directory
  if mc.vocab_size < tok.vocab_size:
    raise ValueError(f"model.vocab_size={mc.vocab_size} is smaller than the tokenizer's "
                     f"{tok.vocab_size} (task.tokenizer={cfg.task.get('tokenizer', None)!r})")
  for p in cfg.policies:
    spec = policies.parse(p)  # raises on unknown policies and options
    for forward in (spec.policy.rollout, spec.policy.train):
      model_config(cfg, forward.name)  # raises on sizes the policy cannot quantize
  seeds = rl_seeds(cfg)
  if not seeds or len(set(seeds)) != len(seeds):
    raise ValueError(f"rl.seeds must be distinct ints, got {seeds}")
  check_lengths(cfg)


def _is_int(v: Any) -> bool:
  return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
  return (isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
          and math.isfinite(v))


def _int_at_least(lo: int) -> tuple[str, Callable[[Any], bool]]:
  return f"an int >= {lo}", lambda v: _is_int(v) and v >= lo


_POSITIVE = ("a finite number > 0", lambda v: _is_num(v) and v > 0)
_NON_NEGATIVE = ("a finite number >= 0", lambda v: _is_num(v) and v >= 0)
# Every numeric or enumerated field of a run and what it must be (`validate` reports all
# fields out of range in one message). Optional fields (`cfg.x.get`) are checked when present.
RANGES: tuple[tuple[str, tuple[str, Callable[[Any], bool]]], ...] = (
    ("seq_len", _int_at_least(1)),
    ("max_prompt_len", _int_at_least(1)),
    ("checkpoint_every", _int_at_least(1)),
    ("sft.steps", _int_at_least(0)),  # 0: RL from the initial weights (or --sft_checkpoint)
    ("sft.batch_size", _int_at_least(1)),
    ("sft.lr", _POSITIVE),
    ("sft.warmup_steps", _int_at_least(0)),
    ("sft.weight_decay", _NON_NEGATIVE),
    ("rl.steps", _int_at_least(1)),
    ("rl.prompts_per_step", _int_at_least(1)),
    ("rl.group_size", ("an int >= 2 (group-normalised advantages)",
                       lambda v: _is_int(v) and v >= 2)),
    ("rl.max_new_tokens", _int_at_least(1)),
    # 0 would be greedy: every sample of a group alike, no advantage to learn from.
    ("rl.temperature", _POSITIVE),
    ("rl.top_p", ("a number in (0, 1]", lambda v: _is_num(v) and 0 < v <= 1)),
    ("rl.lr", _POSITIVE),
    ("rl.warmup_steps", _int_at_least(0)),
    ("rl.weight_decay", _NON_NEGATIVE),
    ("rl.clip_eps", _POSITIVE),  # the clip range's low side, and its high side by default
    ("rl.clip_eps_high", ("a finite number > 0, or None (= rl.clip_eps)",
                          lambda v: v is None or (_is_num(v) and v > 0))),
    ("rl.kl_coef", _NON_NEGATIVE),  # k3 KL to the run's starting weights (0: no KL term)
    ("rl.advantage", ("|".join(adv_lib.ADVANTAGE_FNS), lambda v: v in adv_lib.ADVANTAGE_FNS)),
    ("rl.is_cap", _POSITIVE),
    ("rl.aux_loss_coef", _NON_NEGATIVE),
    ("rl.is_mode", ("truncate|mask|none", lambda v: v in ("truncate", "mask", "none"))),
    ("rl.on_missing_guidance", ("error|fallback", lambda v: v in ("error", "fallback"))),
    ("rl.audit_fraction", ("a number in [0, 1]", lambda v: _is_num(v) and 0 <= v <= 1)),
    ("eval.num_prompts", _int_at_least(1)),
    ("eval.every", _int_at_least(1)),
)
OPTIONAL = ("rl.audit_fraction", "rl.clip_eps_high", "rl.kl_coef", "rl.advantage")
_MISSING = object()


def check_ranges(cfg: ml_collections.ConfigDict) -> None:
  """Every field of `RANGES` present (unless optional) and in range; one message for all."""
  errors = []
  for path, (what, ok) in RANGES:
    node: Any = cfg
    for part in path.split("."):
      node = node.get(part, _MISSING) if hasattr(node, "get") else _MISSING
    if node is _MISSING:
      if path not in OPTIONAL:
        errors.append(f"config has no `{path}`")
    elif not ok(node):
      errors.append(f"{path} must be {what}, got {node!r}")
  if errors:
    raise ValueError("; ".join(errors))


def check_lengths(cfg: ml_collections.ConfigDict) -> None:
  """Every prompt the run will see fits `max_prompt_len`, and every sequence `seq_len`.

  The prompts are a function of the seed, so this enumerates them (SFT, every RL step, the
  eval set): a run then never stops at step 57 on one long prompt, and the rollout engine,
  padded to `max_prompt_len`, compiles one program for the whole run.
  """
  r = cfg.rl
  io = make_task_io(cfg)
  after_prompt = io.tokens_after_prompt(r.max_new_tokens)  # a completion, or an episode
  if cfg.max_prompt_len + after_prompt - 1 > cfg.seq_len:
    raise ValueError(f"seq_len={cfg.seq_len} cannot hold max_prompt_len={cfg.max_prompt_len} "
                     f"+ {after_prompt} tokens after the prompt (rl.max_new_tokens="
                     f"{r.max_new_tokens}) - 1 rows")
  sets = [(f"rl step {i}" + (f" (seed {s})" if s != cfg.seed else ""),
           Seeds(cfg.seed, s).rl_prompts(i), r.prompts_per_step)
          for s in rl_seeds(cfg) for i in range(r.steps)]
  sets.append(("the eval set", Seeds(cfg.seed, cfg.seed).eval_prompts(), cfg.eval.num_prompts))
  for where, seed, n in sets:
    longest = max(map(len, io.prompts(seed, n)[1]))
    if longest > cfg.max_prompt_len:
      need = longest + after_prompt - 1
      raise ValueError(f"{where} has a prompt of {longest} tokens > max_prompt_len="
                       f"{cfg.max_prompt_len}; raise max_prompt_len" +
                       (f" and seq_len to at least {need}" if need > cfg.seq_len else ""))
  for i in range(cfg.sft.steps):
    problems, prompts = io.prompts(Seeds(cfg.seed, cfg.seed).sft_prompts(i), cfg.sft.batch_size)
    demos, _ = io.demonstrations(problems, prompts)
    longest = max(len(pr) + len(d) for pr, d in zip(prompts, demos))
    if longest - 1 > cfg.seq_len:
      raise ValueError(f"sft step {i} has a prompt + demonstration + EOS of {longest} tokens "
                       f"({longest - 1} training rows) > seq_len={cfg.seq_len}")


def place_params(params: Any, cfg: ml_collections.ConfigDict) -> Any:
  """Shards params over `cfg.mesh` ({data, fsdp, expert, tensor} sizes) when the config has
  one (`trace_jax.model.sharding` rules); otherwise returns them as they are."""
  if not cfg.get("mesh"):
    return params
  return sharding.shard_params(params, sharding.make_mesh(dict(cfg.mesh)))


def _seed(*parts: int) -> int:
  """A 31-bit seed from integers (deterministic, order-sensitive)."""
  return int(np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(1)[0]
             & 0x7FFFFFFF)


def rl_seeds(cfg: ml_collections.ConfigDict) -> tuple[int, ...]:
  """The RL seeds of a run (`rl.seeds`; default the config's one `seed`)."""
  return tuple(int(s) for s in cfg.rl.get("seeds", None) or (cfg.seed,))


@dataclasses.dataclass(frozen=True)
class Seeds:
  """Every random stream of a run, named once.

  base (`cfg.seed`) fixes the initial weights, the SFT data and the eval prompts, which all RL
  seeds share; rl (one of `rl.seeds`) fixes the RL prompts and the sampling. With rl == base
  the streams are those of a one-seed run.
  """
  base: int
  rl: int

  def init_key(self) -> jax.Array:
    return jax.random.fold_in(jax.random.key(self.base), 0)

  def sft_prompts(self, step: int) -> int:
    return _seed(self.base, 1, step)

  def eval_prompts(self) -> int:
    return _seed(self.base, 2)

  def rl_prompts(self, step: int) -> int:
    return _seed(self.rl, 3, step)

  def rl_sampling(self, step: int, i: int) -> int:
    return _seed(self.rl, 4, step, i)


# ------------------------------------------------------------------------------ SFT

def run_sft(cfg: ml_collections.ConfigDict, workdir: str, progress: bool = True
            ) -> tuple[Any, list[dict[str, float]]]:
  """Supervised warm start on task demonstrations; returns (params, loss history)."""
  mc = model_config(cfg, "bf16")
  io = make_task_io(cfg)
  s = cfg.sft
  tx = step_lib.make_optimizer(step_lib.OptimConfig(
      lr=s.lr, warmup_steps=s.warmup_steps, total_steps=s.steps, weight_decay=s.weight_decay))
  seeds = Seeds(cfg.seed, cfg.seed)
  params = model_lib.init_params(mc, seeds.init_key(), param_dtype=jnp.float32)
  state = step_lib.init_state(place_params(params, cfg), tx)
  history = []
  bar = tqdm(range(s.steps), desc="sft", disable=not progress, dynamic_ncols=True)
  for i in bar:
    problems, prompts = io.prompts(seeds.sft_prompts(i), s.batch_size)
    demos, masks = io.demonstrations(problems, prompts)
    b = batch_lib.sequence_batch(prompts, demos, cfg.seq_len, masks)
    state, m = step_lib.sft_step(state, {k: jnp.asarray(v) for k, v in b.items()}, config=mc,
                                 tx=tx)
    checkpoints.check_state(state, m["nonfinite"], f"sft step {i}")
    if i % 10 == 0 or i == s.steps - 1:
      loss = float(m["loss"])
      history.append({"step": i, "loss": loss})
      bar.set_postfix(loss=f"{loss:.3f}")
  return state.params, history


# ------------------------------------------------------------------------------ evaluation

def eval_rollout(engine: RolloutEngine, io: TaskIO, cfg: ml_collections.ConfigDict
                 ) -> tuple[list[Any], list[Sample]]:
  """(problems, greedy samples) of the fixed eval prompt set (the same for every policy)."""
  problems, prompts = io.prompts(Seeds(cfg.seed, cfg.seed).eval_prompts(), cfg.eval.num_prompts)
  sp = io.sampling(max_new_tokens=cfg.rl.max_new_tokens, temperature=0.0, seed=0)
  return problems, io.generate(engine, problems, prompts, [sp] * len(prompts))


def evaluate(engine: RolloutEngine, io: TaskIO, cfg: ml_collections.ConfigDict) -> float:
  """Mean reward of greedy completions on the fixed eval prompt set."""
  problems, samples = eval_rollout(engine, io, cfg)
  return float(np.mean(io.rewards(problems, samples)))


# ------------------------------------------------------------------------------ RL

def run_rl(cfg: ml_collections.ConfigDict, workdir: str, policy: str, init_params: Any, *,
           seed: int | None = None, engine_factory: Any = None,
           max_steps: int | None = None, progress: bool = True) -> dict[str, Any]:
  """GRPO under run `policy` from `init_params`: `trace_jax.train.learner.GRPOLearner` run to
  its end (or `max_steps`, to simulate a kill in tests), then closed.

  Returns the run's summary (final/best eval reward, mean mismatch, throughput), history,
  evals, final params and state; writes metrics.csv, evals.csv, flips.csv (per layer and
  site), TensorBoard summaries and history.json under `workdir`.
  """
  from trace_jax.train.learner import GRPOLearner
  with GRPOLearner(cfg, workdir, policy, init_params, seed=seed, engine_factory=engine_factory,
                   progress=progress) as learner:
    return learner.run(max_steps)


def summarize(history: list[dict[str, Any]], evals: list[dict[str, float]]) -> dict[str, Any]:
  """Final/best eval reward and run means of the mismatch and throughput metrics."""
  def mean(k):
    vals = [h[k] for h in history if h.get(k) is not None]
    return float(np.mean(vals)) if vals else None
  rewards = [e["reward"] for e in evals]
  return {
      "start_reward": rewards[0] if rewards else None,
      "final_reward": rewards[-1] if rewards else None,
      "best_reward": max(rewards) if rewards else None,
      "train_reward_first": history[0]["reward"] if history else None,
      "train_reward_last": history[-1]["reward"] if history else None,
      "train_reward_slope": reward_slope(history),
      **{k: mean(k) for k in ("mean_abs_dlogp", "k3_kl", "max_abs_dp", *mismatch.METRICS,
                              "guidance_bytes_per_token", "rollout_tokens_per_s",
                              "train_tokens_per_s")},
  }


def reward_slope(history: list[dict[str, Any]]) -> float | None:
  """Least-squares slope of the sampled train reward per RL step (the trend of a run)."""
  if len(history) < 2:
    return None
  x = np.asarray([h["step"] for h in history], np.float64)
  y = np.asarray([h["reward"] for h in history], np.float64)
  return float(np.polyfit(x, y, 1)[0])
