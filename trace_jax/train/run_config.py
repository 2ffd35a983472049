"""A run's config as typed values: the ConfigDict of a config file, resolved once at the entry.

`resolve(cfg)` checks every numeric and enumerated field of an `ml_collections.ConfigDict`
(`RANGES`, all bad fields in one message), the model section and the policies, and returns a
frozen `RunConfig` of typed sections (model, task, SFT, GRPO, eval) that everything below the
launchers takes; `RunConfig.source` keeps the config as plain JSON values for the workdir's
fingerprint and the summary. `Seeds` names every random stream of a run once.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from trace_jax.model import config as config_lib
from trace_jax.model import policies
from trace_jax.model.config import ModelConfig
from trace_jax.rl import advantages as adv_lib
from trace_jax.rl import losses
from trace_jax.train import run_guard


@dataclasses.dataclass(frozen=True)
class TaskConfig:
  """The task (`trace_jax.rl.tasks`: name and constructor kwargs) and its tokenizer ("char",
  a local HF tokenizer directory, or None for the task's own)."""
  name: str
  kwargs: tuple[tuple[str, Any], ...] = ()
  tokenizer: str | None = None


@dataclasses.dataclass(frozen=True)
class SFTConfig:
  """The supervised warm start (0 steps: RL from the initial weights)."""
  steps: int
  batch_size: int
  lr: float
  warmup_steps: int
  weight_decay: float


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
  """GRPO (docs/design.md §8): sampling, optimizer, loss and guidance settings of each run.

  clip_eps_high: the clip range's high side (DAPO's clip-higher; None in the file: clip_eps).
  seeds: the RL seeds, one run each per policy (None in the file: the config's `seed`).
  audit_fraction: share of each batch whose full FP4 codes are recorded to count flips.
  minibatches / epochs: optimizer steps per rollout batch, as verl, OpenRLHF and TRL run
  them: `epochs` passes over the batch, each split into `minibatches` parts (contiguous rows,
  so whole groups stay together when `minibatches` divides `prompts_per_step`); every update
  clips against the log-probs of the trainer's policy before the batch's first update. 1 and 1:
  one on-policy update per batch (the PPO ratio is 1, clipping never acts).
  loss_agg, adv_std, is_level: the loss aggregation, the advantage's std normalisation (None:
  the estimator's own, population for "grpo", none for "dr_grpo") and the importance weights'
  level (`trace_jax.rl.losses`, `trace_jax.rl.advantages`).
  """
  steps: int
  prompts_per_step: int
  group_size: int
  max_new_tokens: int
  temperature: float
  top_p: float
  lr: float
  warmup_steps: int
  weight_decay: float
  clip_eps: float
  clip_eps_high: float
  is_mode: str
  is_cap: float
  kl_coef: float
  advantage: str
  aux_loss_coef: float
  on_missing_guidance: str
  keep_guidance: bool
  seeds: tuple[int, ...]
  audit_fraction: float
  minibatches: int = 1
  epochs: int = 1
  loss_agg: str = "token_mean"
  adv_std: str | None = None
  is_level: str = "token"

  @property
  def updates_per_step(self) -> int:
    """Optimizer steps per RL step."""
    return self.minibatches * self.epochs


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """Greedy evals on a fixed prompt set every `every` steps; posthoc_fp4: the bf16 runs'
  final weights also evaluated through the FP4 engine."""
  num_prompts: int
  every: int
  posthoc_fp4: bool


@dataclasses.dataclass(frozen=True)
class GuidanceConfig:
  """Guidance under a budget (`trace_jax.train.guidance_budget`): with
  `budget_bytes_per_token`, the guided layers are chosen by greedy selection of measured
  mismatch on a calibration rollout of `calibration_prompts` prompts (a seed stream of its own)
  from the warm start, instead of `model.guided_layers`; None: `model.guided_layers`."""
  budget_bytes_per_token: float | None = None
  calibration_prompts: int = 16


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """A whole run: `model` is the model section's ModelConfig (its own policy); `model_for`
  gives a forward policy's. mesh: ((axis, size), ...) to shard over, or None."""
  seed: int
  policies: tuple[str, ...]
  model: ModelConfig
  task: TaskConfig
  sft: SFTConfig
  rl: GRPOConfig
  eval: EvalConfig
  seq_len: int
  max_prompt_len: int
  checkpoint_every: int
  mesh: tuple[tuple[str, int], ...] | None
  source: Mapping[str, Any] = dataclasses.field(compare=False, hash=False, repr=False)
  guidance: GuidanceConfig = GuidanceConfig()

  def model_for(self, policy: str) -> ModelConfig:
    """The ModelConfig of a forward policy (`ModelConfig.policy`)."""
    return self.model.replace(policy=policy)


# ------------------------------------------------------------------------------ checks

def _is_int(v: Any) -> bool:
  return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
  return (isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
          and math.isfinite(v))


def _int_at_least(lo: int) -> tuple[str, Callable[[Any], bool]]:
  return f"an int >= {lo}", lambda v: _is_int(v) and v >= lo


_POSITIVE = ("a finite number > 0", lambda v: _is_num(v) and v > 0)
_NON_NEGATIVE = ("a finite number >= 0", lambda v: _is_num(v) and v >= 0)
# Every numeric or enumerated field of a run and what it must be (`check_ranges` reports all
# fields out of range in one message). Optional fields (`OPTIONAL`) are checked when present.
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
    ("rl.keep_guidance", ("a bool", lambda v: isinstance(v, (bool, np.bool_)))),
    ("rl.minibatches", _int_at_least(1)),
    ("rl.epochs", _int_at_least(1)),
    ("rl.loss_agg", ("|".join(losses.LOSS_AGGS), lambda v: v in losses.LOSS_AGGS)),
    ("rl.adv_std", ("|".join(adv_lib.ADV_STDS) + ", or None (the estimator's own)",
                    lambda v: v is None or v in adv_lib.ADV_STDS)),
    ("rl.is_level", ("|".join(losses.IS_LEVELS), lambda v: v in losses.IS_LEVELS)),
    ("eval.num_prompts", _int_at_least(1)),
    ("eval.every", _int_at_least(1)),
    ("guidance.budget_bytes_per_token", ("a finite number > 0, or None (model.guided_layers)",
                                         lambda v: v is None or (_is_num(v) and v > 0))),
    ("guidance.calibration_prompts", _int_at_least(1)),
)
OPTIONAL = {"rl.audit_fraction": 1.0, "rl.clip_eps_high": None, "rl.kl_coef": 0.0,
            "rl.advantage": "grpo", "rl.keep_guidance": False, "rl.minibatches": 1,
            "rl.epochs": 1, "rl.loss_agg": "token_mean", "rl.adv_std": None,
            "rl.is_level": "token", "guidance.budget_bytes_per_token": None,
            "guidance.calibration_prompts": 16}
_MISSING = object()
SECTIONS = ("model", "task", "sft", "rl", "eval")


def _get(cfg: Any, path: str) -> Any:
  node = cfg
  for part in path.split("."):
    node = node.get(part, _MISSING) if hasattr(node, "get") else _MISSING
  return node


def check_ranges(cfg: Any) -> None:
  """Every field of `RANGES` present (unless optional) and in range; one message for all."""
  errors = []
  for path, (what, ok) in RANGES:
    value = _get(cfg, path)
    if value is _MISSING:
      if path not in OPTIONAL:
        errors.append(f"config has no `{path}`")
    elif not ok(value):
      errors.append(f"{path} must be {what}, got {value!r}")
  if errors:
    raise ValueError("; ".join(errors))


# ------------------------------------------------------------------------------ resolve

def resolve(cfg: Any) -> RunConfig:
  """The typed, checked RunConfig of a config file's ConfigDict; ValueError naming the fields
  out of range, an unknown model field or policy, or repeated RL seeds."""
  if isinstance(cfg, RunConfig):
    return cfg
  for section in SECTIONS:
    if section not in cfg:
      raise ValueError(f"config has no `{section}` section")
  check_ranges(cfg)
  model = config_lib.resolve(cfg.model)
  for p in cfg.policies:
    spec = policies.parse(p)  # raises on unknown policies and options
    for forward in (spec.policy.rollout, spec.policy.train):
      model.replace(policy=forward.name)  # raises on sizes the policy cannot quantize
  opt = {path: (v if (v := _get(cfg, path)) is not _MISSING else default)
         for path, default in OPTIONAL.items()}
  r = cfg.rl
  seeds = tuple(int(s) for s in (r.get("seeds", None) or (cfg.seed,)))
  if len(set(seeds)) != len(seeds):
    raise ValueError(f"rl.seeds must be distinct ints, got {seeds}")
  rows, parts = r.prompts_per_step * r.group_size, opt["rl.minibatches"]
  if rows % parts:
    raise ValueError(f"rl.minibatches={parts} does not divide a step's {rows} samples "
                     f"(rl.prompts_per_step * rl.group_size)")
  adv_lib.get_advantage_fn(opt["rl.advantage"], opt["rl.adv_std"])  # a contradictory pair
  task = cfg.task
  mesh = cfg.get("mesh", None)
  return RunConfig(
      seed=int(cfg.seed), policies=tuple(cfg.policies), model=model,
      task=TaskConfig(name=task.name, kwargs=tuple(sorted(dict(task.get("kwargs", {})).items())),
                      tokenizer=task.get("tokenizer", None)),
      sft=SFTConfig(**{f.name: cfg.sft[f.name] for f in dataclasses.fields(SFTConfig)}),
      rl=GRPOConfig(
          **{f.name: r[f.name] for f in dataclasses.fields(GRPOConfig)
             if f"rl.{f.name}" not in OPTIONAL and f.name != "seeds"},
          clip_eps_high=opt["rl.clip_eps_high"] or r.clip_eps, kl_coef=float(opt["rl.kl_coef"]),
          advantage=opt["rl.advantage"], audit_fraction=float(opt["rl.audit_fraction"]),
          keep_guidance=bool(opt["rl.keep_guidance"]), seeds=seeds,
          **{k: opt[f"rl.{k}"] for k in ("minibatches", "epochs", "loss_agg", "adv_std",
                                          "is_level")}),
      eval=EvalConfig(num_prompts=cfg.eval.num_prompts, every=cfg.eval.every,
                      posthoc_fp4=bool(cfg.eval.get("posthoc_fp4", True))),
      seq_len=cfg.seq_len, max_prompt_len=cfg.max_prompt_len,
      checkpoint_every=cfg.checkpoint_every,
      mesh=tuple((str(k), int(v)) for k, v in dict(mesh).items()) if mesh else None,
      source=run_guard.config_dict(cfg),
      guidance=GuidanceConfig(budget_bytes_per_token=opt["guidance.budget_bytes_per_token"],
                              calibration_prompts=opt["guidance.calibration_prompts"]))


# ------------------------------------------------------------------------------ seeds

def _seed(*parts: int) -> int:
  """A 31-bit seed from integers (deterministic, order-sensitive)."""
  return int(np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(1)[0]
             & 0x7FFFFFFF)


@dataclasses.dataclass(frozen=True)
class Seeds:
  """Every random stream of a run, named once.

  base (the config's `seed`) fixes the initial weights, the SFT data and the eval prompts,
  which all RL seeds share; rl (one of `rl.seeds`) fixes the RL prompts and the sampling. With
  rl == base the streams are those of a one-seed run.
  """
  base: int
  rl: int

  def calibration_prompts(self) -> int:
    """The guidance budget's calibration prompts (no RL step or eval draws them)."""
    return _seed(self.base, 5)

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
