"""SFT warm start and the GRPO loop with rollout-guided FP4 QAT (docs/design.md §8).

One RL step: sample prompts (seeded by (seed, step)), roll out G completions each through a
`RolloutEngine` (in-process by default) that records guidance into the TensorStore guidance
store under FP4 policies, score rewards, read the guidance back, take one on-policy GRPO step
(guided rounding at the guided sites under `fp4_trace`), measure the rollout/trainer mismatch,
sync the weights to the engine, log, and checkpoint. Every random choice is a function of
(seed, step), so a run killed at any point resumes from its last checkpoint exactly.
"""

from __future__ import annotations

import csv
import dataclasses
import logging
import math
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from tqdm.auto import tqdm

from trace_jax import model as model_lib
from trace_jax.io import guidance_store
from trace_jax.model import policies, sharding
from trace_jax.model.config import ModelConfig
from trace_jax.rl import advantages as adv_lib
from trace_jax.rollout import guidance_layout
from trace_jax.rollout.engine import InProcessEngine
from trace_jax.rollout.protocol import RolloutEngine, Sample
from trace_jax.train import batch as batch_lib
from trace_jax.train import episodes, mismatch, run_guard
from trace_jax.train import step as step_lib
from trace_jax.train.task_io import TaskIO, make_task_io

log = logging.getLogger(__name__)

METRIC_KEYS = ("reward", "mean_abs_dlogp", "k3_kl", "max_abs_dp", *mismatch.METRICS,
               "guidance_bytes_per_token", "loss", "grad_norm", "rollout_tokens_per_s",
               "train_tokens_per_s", "response_len", "guidance_s", "step_s")
FLIP_KEYS = ("layer", "site", "guided", "flips", "total", "one_apart", "scale_flips",
             "scale_total")
# Wall-clock figures: they differ between otherwise identical runs (resume tests skip them).
# guidance_s: store flush + read + padding into the batch; step_s: the whole step (rollout,
# guidance, train step, metrics; not the periodic eval and checkpoint).
TIMING_KEYS = ("rollout_tokens_per_s", "train_tokens_per_s", "guidance_s", "step_s")


# ------------------------------------------------------------------------------ config

def model_config(cfg: ml_collections.ConfigDict, policy: str | None = None) -> ModelConfig:
  """The ModelConfig of `cfg.model` (a preset name plus field overrides).

  policy: a forward policy (`ModelConfig.policy`); default the model section's own.
  """
  fields = dict(cfg.model)
  preset = fields.pop("preset", "tiny")
  if "guided_layers" in fields and fields["guided_layers"] is not None:
    fields["guided_layers"] = tuple(fields["guided_layers"])
  if policy is not None:
    fields["policy"] = policy
  return getattr(model_lib, preset)(**fields)


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
      model_config(cfg, forward)  # raises on sizes the policy cannot quantize
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
    ("rl.clip_eps", _POSITIVE),
    ("rl.is_cap", _POSITIVE),
    ("rl.aux_loss_coef", _NON_NEGATIVE),
    ("rl.is_mode", ("truncate|mask|none", lambda v: v in ("truncate", "mask", "none"))),
    ("rl.on_missing_guidance", ("error|fallback", lambda v: v in ("error", "fallback"))),
    ("rl.audit_fraction", ("a number in [0, 1]", lambda v: _is_num(v) and 0 <= v <= 1)),
    ("eval.num_prompts", _int_at_least(1)),
    ("eval.every", _int_at_least(1)),
)
OPTIONAL = ("rl.audit_fraction",)
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
  # A completion, or a whole episode (every turn's action and observation, then EOS).
  after_prompt = (episodes.max_episode_tokens(io.task, r.max_new_tokens)
                  if episodes.is_environment(io.task) else r.max_new_tokens)
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
  placed = step_lib.placements(state)
  history = []
  bar = tqdm(range(s.steps), desc="sft", disable=not progress, dynamic_ncols=True)
  for i in bar:
    problems, prompts = io.prompts(seeds.sft_prompts(i), s.batch_size)
    demos, masks = io.demonstrations(problems, prompts)
    b = batch_lib.sequence_batch(prompts, demos, cfg.seq_len, masks)
    state, m = step_lib.sft_step(state, {k: jnp.asarray(v) for k, v in b.items()}, config=mc,
                                 tx=tx)
    state = step_lib.keep_placement(state, placed)
    if i % 10 == 0 or i == s.steps - 1:
      loss = float(m["loss"])
      history.append({"step": i, "loss": loss})
      bar.set_postfix(loss=f"{loss:.3f}")
  return state.params, history


# ------------------------------------------------------------------------------ evaluation

def evaluate(engine: RolloutEngine, io: TaskIO, cfg: ml_collections.ConfigDict) -> float:
  """Mean reward of greedy completions on a fixed prompt set (the same for every policy)."""
  problems, prompts = io.prompts(Seeds(cfg.seed, cfg.seed).eval_prompts(), cfg.eval.num_prompts)
  sp = io.sampling(max_new_tokens=cfg.rl.max_new_tokens, temperature=0.0, seed=0)
  samples = io.generate(engine, problems, prompts, [sp] * len(prompts))
  return float(np.mean(io.rewards(problems, samples)))


# ------------------------------------------------------------------------------ RL

def _sampled_tokens(s: Sample) -> int:
  """Tokens the policy sampled (an episode's observations are the environment's)."""
  return int(sum(s.meta["loss_mask"])) if "loss_mask" in s.meta else len(s.tokens)


def read_guidance(reader: guidance_store.GuidanceReader, samples: list[Sample],
                  batch_key: str = "batch_id") -> guidance_store.GuidanceBatch:
  """The samples' records, rows in sample order, from however many store batches hold them.

  batch_key: "batch_id" (training record and routing) or "audit_batch_id" (full codes).
  """
  groups: dict[str, list[Any]] = {}
  for s in samples:
    groups.setdefault(s.guidance[batch_key], []).append(s.guidance["seq_id"])
  parts = [reader.read(bid, ids) for bid, ids in groups.items()]
  if len(parts) == 1:
    return parts[0]
  cat = lambda *a: np.concatenate(a, axis=0)
  first = parts[0]
  return dataclasses.replace(
      first, batch_id="+".join(p.batch_id for p in parts),
      seq_ids=[i for p in parts for i in p.seq_ids],
      valid=np.concatenate([p.valid for p in parts]),
      guidance={layer: {site: jax.tree.map(cat, *[p.guidance[layer][site] for p in parts])
                        for site in first.guidance[layer]} for layer in first.guidance},
      routing={layer: cat(*[p.routing[layer] for p in parts]) for layer in first.routing},
      problems=[q for p in parts for q in p.problems])


def _checkpointer(path: str, keep: int) -> ocp.CheckpointManager:
  return ocp.CheckpointManager(
      os.path.abspath(path),
      options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))


# Checkpoint steps that did not restore are moved here (under the run's workdir), so the run
# saves those steps afresh and a user can inspect them; their number is the run's
# `checkpoint_fallbacks` (history.json summary).
CORRUPT_DIR = "ckpt_corrupt"


class CheckpointRestoreError(run_guard.RunError):
  """No checkpoint step of a run restores."""


def restore_latest(ckpt: ocp.CheckpointManager, state: Any, corrupt_dir: str
                   ) -> tuple[int, Any, dict[str, Any]] | None:
  """(step, state, meta) of the newest checkpoint that restores; None without checkpoints.

  A step that fails to restore (truncated or garbled files) is logged with its error, and the
  next older one is tried; once one restores, the failed newer steps move to `corrupt_dir`.
  Raises CheckpointRestoreError, moving nothing, when none restores (a damaged run, or a
  config whose shapes differ from the checkpoints').
  """
  failed: list[tuple[int, str]] = []
  for step in sorted(ckpt.all_steps(), reverse=True):
    try:
      restored = ckpt.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(state), meta=ocp.args.JsonRestore()))
      _same_shapes(state, restored.state)
    except Exception as e:  # noqa: BLE001 - whatever broke in this step, an older one may do
      why = _one_line(e)
      log.warning("checkpoint step %d in %s does not restore (%s); trying an older step", step,
                  ckpt.directory, why)
      failed.append((step, why))
      continue
    if failed:
      os.makedirs(corrupt_dir, exist_ok=True)
      for bad, _ in failed:
        dest = os.path.join(corrupt_dir, f"{bad}-{time.strftime('%Y%m%d-%H%M%S')}")
        shutil.move(os.path.join(str(ckpt.directory), str(bad)), dest)
        log.warning("moved the unreadable checkpoint step %d to %s; resuming from step %d",
                    bad, dest, step)
      ckpt.reload()
    return int(step), restored.state, restored.meta
  if failed:
    raise CheckpointRestoreError(
        f"no checkpoint in {ckpt.directory} restores: " +
        "; ".join(f"step {s}: {why}" for s, why in failed) +
        " (a config whose shapes differ from the run's fails so too: use a new workdir)")
  return None


def _same_shapes(want: Any, got: Any) -> None:
  """Raises ValueError unless the restored tree has the template's structure and shapes
  (orbax restores the stored shapes whatever the template's)."""
  bad = [jax.tree_util.keystr(k) for (k, a), b in zip(jax.tree_util.tree_leaves_with_path(want),
                                                      jax.tree.leaves(got))
         if np.shape(a) != np.shape(b)]
  if jax.tree.structure(want) != jax.tree.structure(got) or bad:
    raise ValueError(f"stored shapes differ from the config's at {bad[:3] or 'the structure'}")


def checkpoint_fallbacks(workdir: str) -> int:
  """How many checkpoint steps of the run at `workdir` failed to restore (moved aside)."""
  path = os.path.join(workdir, CORRUPT_DIR)
  return len(os.listdir(path)) if os.path.isdir(path) else 0


def _one_line(e: BaseException, limit: int = 300) -> str:
  text = " ".join(f"{type(e).__name__}: {e}".split())
  return text if len(text) <= limit else f"{text[:limit]}..."


class CSVLog:
  """Appends one row per line; survives restarts (rows at or past `keep_below` are dropped)."""

  def __init__(self, path: str, fields: tuple[str, ...], keep_below: int):
    self.path, self.fields = path, ("step",) + tuple(fields)
    rows = []
    if os.path.exists(path):
      with open(path) as f:
        rows = [r for r in csv.DictReader(f) if int(r["step"]) < keep_below]
    with open(path, "w", newline="") as f:
      w = csv.DictWriter(f, fieldnames=self.fields, extrasaction="ignore")
      w.writeheader()
      w.writerows(rows)

  def write(self, row: dict[str, Any]) -> None:
    with open(self.path, "a", newline="") as f:
      csv.DictWriter(f, fieldnames=self.fields, extrasaction="ignore").writerow(row)


def read_curves(run_dir: str) -> tuple[list[dict[str, Any]], list[dict[str, float]]]:
  """(per-step metrics, evals) from a run's metrics.csv and evals.csv; empty if absent.

  Numbers come back as floats (step as int), empty cells as None.
  """
  def load(name: str) -> list[dict[str, Any]]:
    path = os.path.join(run_dir, name)
    if not os.path.exists(path):
      return []
    with open(path) as f:
      return [{k: int(v) if k == "step" else (float(v) if v != "" else None)
               for k, v in r.items()} for r in csv.DictReader(f)]
  return load("metrics.csv"), load("evals.csv")


def _tb_writer(logdir: str):
  try:
    from tensorboardX import SummaryWriter
  except ImportError:  # pragma: no cover - tensorboardX is a dependency
    log.warning("tensorboardX not installed: no TensorBoard summaries")
    return None
  return SummaryWriter(logdir)


def run_rl(cfg: ml_collections.ConfigDict, workdir: str, policy: str, init_params: Any, *,
           seed: int | None = None,
           engine_factory: Callable[[Any, ModelConfig, Any], RolloutEngine] | None = None,
           max_steps: int | None = None, progress: bool = True) -> dict[str, Any]:
  """GRPO under run `policy` (`policies.parse`: e.g. "fp4_trace+r3") from `init_params`.

  seed: the RL seed (`Seeds`; default cfg.seed). Resumes from `workdir`'s last checkpoint.
  engine_factory(params, rollout_config, guidance_writer) -> RolloutEngine (default: the
  in-process engine). max_steps stops early (to simulate a kill in tests). Returns the run's
  summary (final/best eval reward, mean mismatch, throughput) and writes metrics.csv,
  evals.csv, flips.csv (per layer and site), TensorBoard summaries and history.json.
  """
  r = cfg.rl
  spec = policies.parse(policy)
  pol = spec.policy
  seeds = Seeds(cfg.seed, cfg.seed if seed is None else int(seed))
  os.makedirs(workdir, exist_ok=True)
  mc = model_config(cfg, pol.train)
  io = make_task_io(cfg)
  all_layers = tuple(range(mc.num_hidden_layers))
  guided_layers = tuple(model_config(cfg, "fp4_trace").guided_layers)
  # Codes are audited only where the trainer has FP4 codes to compare; routing whenever the
  # rollout is FP4 (under fp4_rollout the trainer's BF16 routing still differs).
  audit = float(r.get("audit_fraction", 1.0)) if pol.fp4_train else 0.0
  tx = step_lib.make_optimizer(step_lib.OptimConfig(
      lr=r.lr, warmup_steps=r.warmup_steps, total_steps=r.steps, weight_decay=r.weight_decay))
  rl = step_lib.RLConfig(clip_eps_low=r.clip_eps, clip_eps_high=r.clip_eps, is_mode=r.is_mode,
                         is_cap=r.is_cap, kl_coef=0.0, aux_loss_coef=r.aux_loss_coef,
                         routing_replay=spec.replay)
  state = step_lib.init_state(place_params(init_params, cfg), tx)
  ckpt = _checkpointer(os.path.join(workdir, "ckpt"), keep=2)
  history: list[dict[str, Any]] = []
  evals: list[dict[str, float]] = []
  start = 0
  restored = restore_latest(ckpt, state, os.path.join(workdir, CORRUPT_DIR))
  if restored is not None:
    start, state, meta = restored
    history, evals = meta["history"], meta["evals"]
    log.info("resumed %s from step %d", workdir, start)
  placed = step_lib.placements(state)

  # An FP4 rollout records into the guidance store: fp4_trace's training record (compact
  # guidance of the guided layers), every layer's routing, and full codes of the audited rows.
  writer = reader = None
  rollout_cfg = model_config(cfg, pol.rollout)
  if pol.fp4_rollout:
    gdir = os.path.join(workdir, "guidance")
    writer = guidance_store.GuidanceWriter(gdir, guidance_store.config_hash(rollout_cfg),
                                           options=guidance_store.StoreOptions(fsync=False),
                                           overwrite=True)
    reader = guidance_store.GuidanceReader(gdir, guidance_store.config_hash(rollout_cfg),
                                           on_missing=r.on_missing_guidance)
  batch_rows = max(r.prompts_per_step * r.group_size, cfg.eval.num_prompts)
  factory = engine_factory or (lambda p, c, w: InProcessEngine(
      p, c, guidance_writer=w, record_guidance=pol.guided, record_routing=pol.fp4_rollout,
      audit_fraction=audit, max_batch=batch_rows, min_prompt_len=cfg.max_prompt_len))
  engine = factory(state.params, rollout_cfg, writer)
  tb = _tb_writer(os.path.join(workdir, "tb"))
  # The CSVs keep exactly the rows the restored checkpoint holds (row k of metrics.csv is
  # step k; a row of evals.csv is the greedy eval after `step` steps).
  csv_log = CSVLog(os.path.join(workdir, "metrics.csv"), METRIC_KEYS, keep_below=start)
  flip_log = CSVLog(os.path.join(workdir, "flips.csv"), FLIP_KEYS, keep_below=start)
  eval_log = CSVLog(os.path.join(workdir, "evals.csv"), ("reward",),
                    keep_below=max((e["step"] + 1 for e in evals), default=0))

  def store_batches() -> set[str]:
    if writer is None:
      return set()
    writer.flush()
    return {n for n in os.listdir(writer.root) if os.path.isdir(os.path.join(writer.root, n))}

  def drop(batch_ids) -> None:  # records read (or never needed): off the disk
    if writer is not None and not r.keep_guidance:
      for bid in batch_ids:
        for name in (bid, f"{bid}.audit"):
          shutil.rmtree(os.path.join(writer.root, name), ignore_errors=True)

  def run_eval(done: int) -> None:
    before = store_batches()
    evals.append({"step": done, "reward": evaluate(engine, io, cfg)})
    drop(store_batches() - before)  # the eval's records train nothing
    eval_log.write(evals[-1])
    if tb is not None:
      tb.add_scalar(f"{policy}/eval_reward", evals[-1]["reward"], done)

  if start == 0 and not evals:
    run_eval(0)

  fallback_batches = 0
  end = r.steps if max_steps is None else min(r.steps, max_steps)
  bar = tqdm(range(start, end), desc=f"{policy} seed {seeds.rl}", disable=not progress,
             dynamic_ncols=True, initial=start, total=r.steps)
  for step in bar:
    problems, prompts = io.prompts(seeds.rl_prompts(step), r.prompts_per_step)
    problems = [p for p in problems for _ in range(r.group_size)]
    prompts = [p for p in prompts for _ in range(r.group_size)]
    sampling = [io.sampling(max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                            top_p=r.top_p, seed=seeds.rl_sampling(step, i))
                for i in range(len(prompts))]
    t_step = t0 = time.perf_counter()
    samples = io.generate(engine, problems, prompts, sampling, record=pol.fp4_rollout)
    rollout_s = time.perf_counter() - t0
    rewards = io.rewards(problems, samples)
    advantages = np.asarray(adv_lib.group_advantages(jnp.asarray(rewards), r.group_size))
    counts = [len(s.prompt) + len(s.tokens) - 1 for s in samples]

    t_g = time.perf_counter()
    rec = _RolloutRecords.read(reader, writer, samples) if pol.fp4_rollout else None
    guidance = routing = None
    if rec is not None and not rec.complete:  # on_missing="fallback": counted by the reader
      log.warning("step %d: rollout records incomplete (%s); RTN, no replay for this batch",
                  step, rec.problems)
      fallback_batches += 1
    elif rec is not None:
      if pol.guided:
        guidance = rec.main.guidance
      # expert_mid guidance is matched to experts by the rollout's ids; R3 replays them all.
      used = all_layers if spec.replay else guided_layers if pol.guided else ()
      routing = {layer: rec.main.routing[layer] for layer in used} or None
    if rec is not None:
      drop(dict.fromkeys([s.guidance["batch_id"] for s in samples] + [
          b for s in samples for b in s.meta.get("turn_guidance_batches", ())]))
    batch = batch_lib.rl_batch(samples, advantages, cfg.seq_len, guidance, routing)
    guidance_s = time.perf_counter() - t_g
    n_audit = rec.n_audit if rec is not None and rec.complete else 0
    t1 = time.perf_counter()
    state, m, taps = step_lib.grpo_step(
        state, batch, config=mc, tx=tx, rl=rl,
        tap_layers=all_layers if rec is not None and rec.complete else (), tap_rows=n_audit)
    state = step_lib.keep_placement(state, placed)
    m = jax.device_get(m)
    train_s = time.perf_counter() - t1
    engine.update_weights(state.params)

    row = {"step": step, "reward": float(np.mean(rewards)),
           "mean_abs_dlogp": float(m["mean_abs_dlogp"]), "k3_kl": float(m["k3_kl"]),
           "max_abs_dp": float(m["max_abs_dp"]), "loss": float(m["loss"]),
           "grad_norm": float(m["grad_norm"]),
           "rollout_tokens_per_s": sum(map(_sampled_tokens, samples)) / rollout_s,
           "train_tokens_per_s": float(np.sum(batch["valid"])) / train_s,
           "response_len": float(np.mean([len(s.tokens) for s in samples])),
           "guidance_s": guidance_s}
    if rec is not None and rec.complete:
      report = rec.compare(jax.device_get(taps), counts, guided_layers)
      row.update(report.metrics())
      for f in report.rows():
        flip_log.write({"step": step, **f})
      # What fp4_trace ships per token: its compact record and the routing it consumes.
      row["guidance_bytes_per_token"] = (
          (sum(g.nbytes for sites in guidance.values() for g in sites.values()) +
           sum(np.asarray(a).nbytes for a in routing.values())) / max(sum(counts), 1)
          if guidance is not None else 0.0)
    row["step_s"] = time.perf_counter() - t_step
    history.append(row)
    csv_log.write(row)
    if tb is not None:
      for k, v in row.items():
        if k != "step" and v is not None:
          tb.add_scalar(f"{policy}/{k}", v, step)
    bar.set_postfix(reward=f"{row['reward']:.2f}", dlogp=f"{row['mean_abs_dlogp']:.4f}")
    done = step + 1
    if done % cfg.eval.every == 0 or done == r.steps:
      run_eval(done)
    if done % cfg.checkpoint_every == 0 or done == end:
      ckpt.save(done, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state),
          meta=ocp.args.JsonSave({"history": history, "evals": evals})))
      ckpt.wait_until_finished()
  ckpt.close()
  engine.close()
  if reader is not None:
    reader.close()
  if writer is not None:
    writer.close()
  if tb is not None:
    tb.close()
  summary = summarize(history, evals)
  summary["guidance_fallback_batches"] = fallback_batches
  summary["checkpoint_fallbacks"] = checkpoint_fallbacks(workdir)
  # Whole or not at all: a summary process may read it while this run writes it.
  run_guard.write_json(os.path.join(workdir, "history.json"),
                       {"history": history, "evals": evals, "summary": summary})
  return {"summary": summary, "history": history, "evals": evals, "params": state.params,
          "state": state}


@dataclasses.dataclass
class _RolloutRecords:
  """What an FP4 rollout recorded for one batch of samples, read back from the store.

  main: the training record (fp4_trace) and every layer's routing, all samples; audit: full
  codes of the audited samples, which lead the batch (`n_audit` of them).
  """
  main: guidance_store.GuidanceBatch
  audit: guidance_store.GuidanceBatch | None
  n_audit: int

  @classmethod
  def read(cls, reader: guidance_store.GuidanceReader, writer: guidance_store.GuidanceWriter,
           samples: list[Sample]) -> _RolloutRecords:
    writer.flush()
    main = read_guidance(reader, samples)
    n_audit = 0
    while n_audit < len(samples) and samples[n_audit].guidance.get("audit_batch_id"):
      n_audit += 1
    audit = (read_guidance(reader, samples[:n_audit], "audit_batch_id") if n_audit else None)
    return cls(main, audit, n_audit)

  @property
  def complete(self) -> bool:
    return bool(np.all(self.main.valid)) and (self.audit is None or bool(np.all(
        self.audit.valid)))

  @property
  def problems(self) -> list[str]:
    return self.main.problems + (self.audit.problems if self.audit is not None else [])

  def compare(self, taps: dict, counts: list[int], guided_layers: tuple[int, ...]
              ) -> mismatch.MismatchReport:
    """The trainer's taps (padded; sites for the audited rows) against these records."""
    train_routing = {layer: guidance_layout.unpad(t["routing"], counts)
                     for layer, t in taps.items() if "routing" in t}
    train_sites = {layer: {site: guidance_layout.unpad(g, counts[:self.n_audit])
                           for site, g in t.items() if site != "routing"}
                   for layer, t in taps.items()} if self.n_audit else {}
    audit = self.audit.guidance if self.audit is not None else {}
    return mismatch.compare(train_sites, audit, train_routing, self.main.routing,
                            guided_layers)


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
