"""SFT warm start and the GRPO loop with rollout-guided FP4 QAT (DESIGN 8).

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
import json
import logging
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
from trace_jax.model import sharding
from trace_jax.model.config import FP4_POLICIES, ModelConfig
from trace_jax.quant import guided
from trace_jax.rl import advantages as adv_lib
from trace_jax.rl.tasks import get_task
from trace_jax.rl.tasks.long_horizon import demonstration_episode
from trace_jax.rl.tokenizer import BOS_ID, EOS_ID, CharTokenizer
from trace_jax.rollout import guidance_layout
from trace_jax.rollout.engine import InProcessEngine, batch_dirs
from trace_jax.rollout.protocol import RolloutEngine, Sample, SamplingParams
from trace_jax.train import batch as batch_lib
from trace_jax.train import episodes
from trace_jax.train import step as step_lib

log = logging.getLogger(__name__)

METRIC_KEYS = ("reward", "mean_abs_dlogp", "k3_kl", "max_abs_dp", "flip_rate_guided",
               "routing_flip_rate", "guidance_bytes_per_token", "loss", "grad_norm",
               "rollout_tokens_per_s", "train_tokens_per_s", "response_len", "guidance_s",
               "step_s")
# Wall-clock figures: they differ between otherwise identical runs (resume tests skip them).
# guidance_s: store flush + read + padding into the batch; step_s: the whole step (rollout,
# guidance, train step, metrics; not the periodic eval and checkpoint).
TIMING_KEYS = ("rollout_tokens_per_s", "train_tokens_per_s", "guidance_s", "step_s")


# ------------------------------------------------------------------------------ config

def model_config(cfg: ml_collections.ConfigDict, policy: str | None = None) -> ModelConfig:
  """The ModelConfig of `cfg.model` (a preset name plus field overrides)."""
  fields = dict(cfg.model)
  preset = fields.pop("preset", "tiny")
  if "guided_layers" in fields and fields["guided_layers"] is not None:
    fields["guided_layers"] = tuple(fields["guided_layers"])
  if policy is not None:
    fields["policy"] = policy
  return getattr(model_lib, preset)(**fields)


def validate(cfg: ml_collections.ConfigDict) -> None:
  """Fails early, with the offending field named, before anything is compiled."""
  for section in ("model", "task", "sft", "rl"):
    if section not in cfg:
      raise ValueError(f"config has no `{section}` section")
  mc = model_config(cfg)
  tok = CharTokenizer()
  if mc.vocab_size < tok.vocab_size:
    raise ValueError(f"model.vocab_size={mc.vocab_size} is smaller than the tokenizer's "
                     f"{tok.vocab_size}")
  for p in cfg.policies:
    model_config(cfg, p)  # raises on unknown policies / incompatible sizes
  if cfg.rl.group_size < 2:
    raise ValueError(f"rl.group_size must be >= 2 for group-normalised advantages, got "
                     f"{cfg.rl.group_size}")
  if cfg.rl.is_mode not in ("truncate", "mask", "none"):
    raise ValueError(f"rl.is_mode must be truncate|mask|none, got {cfg.rl.is_mode!r}")
  get_task(cfg.task.name, **dict(cfg.task.get("kwargs", {})))
  check_lengths(cfg)


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
  sets = [(f"rl step {i}", _seed(cfg.seed, 3, i), r.prompts_per_step) for i in range(r.steps)]
  sets.append(("the eval set", _seed(cfg.seed, 2), cfg.eval.num_prompts))
  for where, seed, n in sets:
    longest = max(map(len, io.prompts(seed, n)[1]))
    if longest > cfg.max_prompt_len:
      need = longest + after_prompt - 1
      raise ValueError(f"{where} has a prompt of {longest} tokens > max_prompt_len="
                       f"{cfg.max_prompt_len}; raise max_prompt_len" +
                       (f" and seq_len to at least {need}" if need > cfg.seq_len else ""))
  for i in range(cfg.sft.steps):
    problems, prompts = io.prompts(_seed(cfg.seed, 1, i), cfg.sft.batch_size)
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


# ------------------------------------------------------------------------------ task plumbing

@dataclasses.dataclass
class TaskIO:
  """A task with the tokenizer: prompts to ids, completions to text and rewards."""
  task: Any
  tok: CharTokenizer

  def prompts(self, seed: int, n: int) -> tuple[list[Any], list[list[int]]]:
    problems = self.task.sample(seed, n)
    return problems, [[BOS_ID] + list(self.tok.encode(p.prompt)) for p in problems]

  def text(self, tokens: list[int]) -> str:
    """Completion text; ids past the tokenizer's vocabulary (a larger model vocab) read '?'."""
    return "".join(self.tok.decode([t]) if t < self.tok.vocab_size else "?"
                   for t in tokens if t != EOS_ID)

  def rewards(self, problems: list[Any], samples: list[Sample]) -> np.ndarray:
    if episodes.is_environment(self.task):  # the environment scored the episode as it ran
      return np.asarray([s.meta["reward"] for s in samples], np.float32)
    return np.asarray([self.task.reward(p, self.text(s.tokens))
                       for p, s in zip(problems, samples)], np.float32)

  def generate(self, engine: RolloutEngine, problems: list[Any], prompts: list[list[int]],
               sampling: list[SamplingParams], record: bool = False) -> list[Sample]:
    """One completion per prompt, or one played episode for environment tasks (`episodes`)."""
    if episodes.is_environment(self.task):
      return episodes.play(engine, self.task, self.tok, problems, prompts, sampling,
                           record=record)
    return engine.generate(prompts, sampling)

  def demonstrations(self, problems: list[Any], prompts: list[list[int]]
                     ) -> tuple[list[list[int]], list[list[int]] | None]:
    """SFT targets after each prompt (+ EOS), and for environment tasks their loss masks."""
    if not episodes.is_environment(self.task):
      return [list(self.tok.encode(self.task.demonstration(p))) + [EOS_ID]
              for p in problems], None
    eps = [demonstration_episode(self.task, p, self.tok) for p in problems]
    return ([e.ids[len(pr):].tolist() for e, pr in zip(eps, prompts)],
            [e.loss_mask[len(pr):].tolist() for e, pr in zip(eps, prompts)])


def make_task_io(cfg: ml_collections.ConfigDict) -> TaskIO:
  return TaskIO(get_task(cfg.task.name, **dict(cfg.task.get("kwargs", {}))), CharTokenizer())


# ------------------------------------------------------------------------------ SFT

def run_sft(cfg: ml_collections.ConfigDict, workdir: str, progress: bool = True
            ) -> tuple[Any, list[dict[str, float]]]:
  """Supervised warm start on task demonstrations; returns (params, loss history)."""
  mc = model_config(cfg, "bf16")
  io = make_task_io(cfg)
  s = cfg.sft
  tx = step_lib.make_optimizer(step_lib.OptimConfig(
      lr=s.lr, warmup_steps=s.warmup_steps, total_steps=s.steps, weight_decay=s.weight_decay))
  params = model_lib.init_params(mc, jax.random.fold_in(jax.random.key(cfg.seed), 0),
                                 param_dtype=jnp.float32)
  state = step_lib.init_state(place_params(params, cfg), tx)
  placed = step_lib.placements(state)
  history = []
  bar = tqdm(range(s.steps), desc="sft", disable=not progress, dynamic_ncols=True)
  for i in bar:
    problems, prompts = io.prompts(_seed(cfg.seed, 1, i), s.batch_size)
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
  problems, prompts = io.prompts(_seed(cfg.seed, 2), cfg.eval.num_prompts)
  sp = SamplingParams(max_new_tokens=cfg.rl.max_new_tokens, temperature=0.0,
                      stop_token_ids=(EOS_ID,), seed=0)
  samples = io.generate(engine, problems, prompts, [sp] * len(prompts))
  return float(np.mean(io.rewards(problems, samples)))


# ------------------------------------------------------------------------------ RL

def _bits_mismatch(a: guided.Guidance, b: guided.Guidance, valid: np.ndarray) -> tuple[int, int]:
  """Elements whose mantissa bit (compact record) differs, over valid rows."""
  x = np.unpackbits(np.asarray(a.mantissa), axis=-1, bitorder="little")
  y = np.unpackbits(np.asarray(b.mantissa), axis=-1, bitorder="little")
  sel = valid.astype(bool)
  return int(np.sum(x[sel] != y[sel])), int(x[sel].size)


def _sampled_tokens(s: Sample) -> int:
  """Tokens the policy sampled (an episode's observations are the environment's)."""
  return int(sum(s.meta["loss_mask"])) if "loss_mask" in s.meta else len(s.tokens)


def read_guidance(reader: guidance_store.GuidanceReader, samples: list[Sample]
                  ) -> guidance_store.GuidanceBatch:
  """The samples' guidance, rows in sample order, from however many store batches hold it."""
  groups: dict[str, list[Any]] = {}
  for s in samples:
    groups.setdefault(s.guidance["batch_id"], []).append(s.guidance["seq_id"])
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
           engine_factory: Callable[[Any, ModelConfig, Any], RolloutEngine] | None = None,
           max_steps: int | None = None, progress: bool = True) -> dict[str, Any]:
  """GRPO under `policy` from `init_params`; resumes from `workdir`'s last checkpoint.

  engine_factory(params, rollout_config, guidance_writer) -> RolloutEngine (default: the
  in-process engine). max_steps stops early (to simulate a kill in tests). Returns the run's
  summary (final/best eval reward, mean mismatch, throughput) and writes metrics.csv,
  TensorBoard summaries and history.json under workdir.
  """
  r = cfg.rl
  os.makedirs(workdir, exist_ok=True)
  # posthoc_fp4 (the no-QAT baseline): NVFP4 rollout, BF16 training forward.
  mc = model_config(cfg, "bf16" if policy == "posthoc_fp4" else policy)
  fp4 = policy in FP4_POLICIES
  guided_layers: tuple[int, ...] = ()
  io = make_task_io(cfg)
  tx = step_lib.make_optimizer(step_lib.OptimConfig(
      lr=r.lr, warmup_steps=r.warmup_steps, total_steps=r.steps, weight_decay=r.weight_decay))
  rl = step_lib.RLConfig(clip_eps_low=r.clip_eps, clip_eps_high=r.clip_eps, is_mode=r.is_mode,
                         is_cap=r.is_cap, kl_coef=0.0, aux_loss_coef=r.aux_loss_coef)
  state = step_lib.init_state(place_params(init_params, cfg), tx)
  ckpt = _checkpointer(os.path.join(workdir, "ckpt"), keep=2)
  history: list[dict[str, Any]] = []
  evals: list[dict[str, float]] = []
  start = 0
  if ckpt.latest_step() is not None:
    start = int(ckpt.latest_step())
    restored = ckpt.restore(start, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(state), meta=ocp.args.JsonRestore()))
    state = restored.state
    history, evals = restored.meta["history"], restored.meta["evals"]
    log.info("resumed %s from step %d", workdir, start)
  placed = step_lib.placements(state)

  # Rollout precision: the policy's forward; under FP4 policies NVFP4 W/A/KV with guidance
  # (compact) recorded at the guided layers (fp4_rtn and posthoc_fp4 record it only to
  # measure flips; fp4_trace trains on it).
  writer = None
  if fp4:
    mc_guided = model_config(cfg, "fp4_trace")
    guided_layers = tuple(mc_guided.guided_layers)
    gdir = os.path.join(workdir, "guidance")
    writer = guidance_store.GuidanceWriter(gdir, guidance_store.config_hash(mc_guided),
                                           options=guidance_store.StoreOptions(fsync=False),
                                           overwrite=True)
    reader = guidance_store.GuidanceReader(gdir, guidance_store.config_hash(mc_guided),
                                           on_missing=r.on_missing_guidance)
  rollout_cfg = mc_guided if fp4 else mc
  batch_rows = max(r.prompts_per_step * r.group_size, cfg.eval.num_prompts)
  factory = engine_factory or (lambda p, c, w: InProcessEngine(
      p, c, guidance_writer=w, record_guidance=fp4, max_batch=batch_rows,
      min_prompt_len=cfg.max_prompt_len))
  engine = factory(state.params, rollout_cfg, writer)
  tb = _tb_writer(os.path.join(workdir, "tb"))
  # Both CSVs keep exactly the rows the restored checkpoint holds (row k of metrics.csv is
  # step k; a row of evals.csv is the greedy eval after `step` steps).
  csv_log = CSVLog(os.path.join(workdir, "metrics.csv"), METRIC_KEYS, keep_below=start)
  eval_log = CSVLog(os.path.join(workdir, "evals.csv"), ("reward",),
                    keep_below=max((e["step"] + 1 for e in evals), default=0))

  def store_batches() -> set[str]:
    if writer is None:
      return set()
    writer.flush()
    return batch_dirs(writer.root)

  def drop(batch_ids) -> None:  # guidance read (or never needed): off the disk
    if writer is not None and not r.keep_guidance:
      for bid in batch_ids:
        shutil.rmtree(os.path.join(writer.root, bid), ignore_errors=True)

  def run_eval(done: int) -> None:
    before = store_batches()
    evals.append({"step": done, "reward": evaluate(engine, io, cfg)})
    drop(store_batches() - before)  # the eval's guidance records train nothing
    eval_log.write(evals[-1])
    if tb is not None:
      tb.add_scalar(f"{policy}/eval_reward", evals[-1]["reward"], done)

  if start == 0 and not evals:
    run_eval(0)

  fallback_batches = 0
  end = r.steps if max_steps is None else min(r.steps, max_steps)
  bar = tqdm(range(start, end), desc=policy, disable=not progress, dynamic_ncols=True,
             initial=start, total=r.steps)
  for step in bar:
    problems, prompts = io.prompts(_seed(cfg.seed, 3, step), r.prompts_per_step)
    problems = [p for p in problems for _ in range(r.group_size)]
    prompts = [p for p in prompts for _ in range(r.group_size)]
    sampling = [SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                               top_p=r.top_p, stop_token_ids=(EOS_ID,),
                               seed=_seed(cfg.seed, 4, step, i)) for i in range(len(prompts))]
    t_step = t0 = time.perf_counter()
    samples = io.generate(engine, problems, prompts, sampling, record=fp4)
    rollout_s = time.perf_counter() - t0
    rewards = io.rewards(problems, samples)
    advantages = np.asarray(adv_lib.group_advantages(jnp.asarray(rewards), r.group_size))

    guidance, routing, record = None, None, None
    t_g = time.perf_counter()
    if fp4:
      writer.flush()
      gb = read_guidance(reader, samples)
      if np.all(gb.valid):
        record = gb.guidance
      else:  # on_missing="fallback": the reader logged and counted it; train this batch RTN
        log.warning("step %d: guidance incomplete (%s); RTN for this batch", step, gb.problems)
        fallback_batches += 1
      if policy == "fp4_trace":
        guidance = record
      if r.routing_replay and record is not None:
        routing = gb.routing
      drop(dict.fromkeys([s.guidance["batch_id"] for s in samples] + [
          b for s in samples for b in s.meta.get("turn_guidance_batches", ())]))
    batch = batch_lib.rl_batch(samples, advantages, cfg.seq_len, guidance, routing)
    guidance_s = time.perf_counter() - t_g
    t1 = time.perf_counter()
    state, m, taps = step_lib.grpo_step(state, batch, config=mc, tx=tx, rl=rl,
                                        tap_layers=guided_layers)
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
    if record is not None:
      counts = [len(s.prompt) + len(s.tokens) - 1 for s in samples]
      padded = batch.get("guidance") or guidance_layout.pad_tree(record, counts, cfg.seq_len)
      valid = np.asarray(batch["valid"])
      flips = tot = 0
      rflips = rtot = 0
      gbytes = 0
      train_fp4 = mc.policy in FP4_POLICIES  # posthoc_fp4 trains in BF16: no codes to flip
      for layer in guided_layers:
        for site, g in (padded[layer].items() if train_fp4 else ()):
          v = valid.reshape(valid.shape + (1,) * (np.asarray(g.row_scale).ndim - 3))
          v = np.broadcast_to(v, np.asarray(g.row_scale).shape[:-1])
          f, t = _bits_mismatch(taps[layer][site], g, v)
          flips, tot = flips + f, tot + t
        gbytes += sum(g.nbytes for g in record[layer].values())
        a = np.sort(np.asarray(taps[layer]["routing"]), -1)
        b = np.sort(np.asarray(guidance_layout.pad_routing(
            gb.routing[layer], counts, cfg.seq_len)), -1)
        diff = np.any(a != b, axis=-1)[valid.astype(bool)]
        rflips, rtot = rflips + int(diff.sum()), rtot + diff.size
      if train_fp4:
        row["flip_rate_guided"] = flips / max(tot, 1)
      row["routing_flip_rate"] = rflips / max(rtot, 1)
      # Only fp4_trace consumes guidance; the other FP4 policies record it just to measure.
      row["guidance_bytes_per_token"] = (gbytes / max(sum(counts), 1)
                                         if policy == "fp4_trace" else 0.0)
    row["step_s"] = time.perf_counter() - t_step
    history.append(row)
    csv_log.write(row)
    if tb is not None:
      for k, v in row.items():
        if k != "step":
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
  if writer is not None:
    writer.close()
  if tb is not None:
    tb.close()
  summary = summarize(history, evals)
  summary["guidance_fallback_batches"] = fallback_batches
  with open(os.path.join(workdir, "history.json"), "w") as f:
    json.dump({"history": history, "evals": evals, "summary": summary}, f, indent=1)
  return {"summary": summary, "history": history, "evals": evals, "params": state.params,
          "state": state}


def summarize(history: list[dict[str, Any]], evals: list[dict[str, float]]) -> dict[str, Any]:
  """Final/best eval reward and run means of the mismatch and throughput metrics."""
  def mean(k):
    vals = [h[k] for h in history if k in h]
    return float(np.mean(vals)) if vals else None
  rewards = [e["reward"] for e in evals]
  return {
      "start_reward": rewards[0] if rewards else None,
      "final_reward": rewards[-1] if rewards else None,
      "best_reward": max(rewards) if rewards else None,
      "train_reward_first": history[0]["reward"] if history else None,
      "train_reward_last": history[-1]["reward"] if history else None,
      **{k: mean(k) for k in ("mean_abs_dlogp", "k3_kl", "max_abs_dp", "flip_rate_guided",
                              "routing_flip_rate", "guidance_bytes_per_token",
                              "rollout_tokens_per_s", "train_tokens_per_s")},
  }
