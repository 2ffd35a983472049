"""The GRPO learner with rollout-guided FP4 QAT (docs/design.md §8): one object per run.

One RL step: `rollout(step)` samples the step's prompts (seeded by (seed, step)) and rolls out
G completions each through a `RolloutEngine` (in-process by default), which under FP4 rollout
records into the guidance store; `guidance(samples)` reads the records back; `update(batch)`
takes one on-policy GRPO step (guided rounding at the guided sites under a TRACE policy) and
syncs the weights to the engine; the rollout/trainer mismatch is measured on the same batch
(`trace_jax.train.mismatch`); `RunLog` writes the row. Every random choice is a function of
(seed, step), so a run killed at any point resumes from its last checkpoint exactly
(`save`/`restore`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.guidance import store as guidance_store
from trace_jax.model import policies
from trace_jax.model.config import ModelConfig
from trace_jax.rl import advantages as adv_lib
from trace_jax.rl import losses
from trace_jax.rollout.engine import InProcessEngine
from trace_jax.rollout.protocol import RolloutEngine, Sample
from trace_jax.train import batch as batch_lib
from trace_jax.train import checkpoints, evaluation, mismatch, run_guard, run_log
from trace_jax.train import step as step_lib
from trace_jax.train.run_config import RunConfig, Seeds
from trace_jax.train.run_log import DASHBOARD_KEYS, UPDATE_KEYS
from trace_jax.train.task_io import make_task_io

log = logging.getLogger(__name__)

EngineFactory = Callable[[Any, ModelConfig, "guidance_store.GuidanceStore | None"],
                         RolloutEngine]


@dataclasses.dataclass
class Rollout:
  """One step's samples (G per prompt, groups contiguous), their problems and rewards."""
  problems: list[Any]
  samples: list[Sample]
  rewards: np.ndarray
  seconds: float

  @property
  def counts(self) -> list[int]:
    """Rows of each sample's training forward (and of its guidance record)."""
    return [s.num_rows for s in self.samples]

  @property
  def sampled_tokens(self) -> int:
    """Tokens the policy sampled (an episode's observations are the environment's)."""
    return sum(int(sum(s.meta["loss_mask"])) if "loss_mask" in s.meta else len(s.tokens)
               for s in self.samples)


@dataclasses.dataclass
class RolloutRecords:
  """What an FP4 rollout recorded for one batch of samples, read back from the store.

  main: the training record (TRACE) and every recorded layer's routing, all samples; audit:
  full codes of the audited samples, which lead the batch (`n_audit` of them).
  """
  main: guidance_store.GuidanceBatch
  audit: guidance_store.GuidanceBatch | None
  n_audit: int

  @property
  def complete(self) -> bool:
    return bool(np.all(self.main.valid)) and (self.audit is None or bool(np.all(
        self.audit.valid)))

  @property
  def problems(self) -> list[str]:
    return self.main.problems + (self.audit.problems if self.audit is not None else [])


class GRPOLearner:
  """GRPO under run `policy` (`policies.parse`: e.g. "fp4_trace+r3") from `init_params`.

  run: the resolved config (`run_config.resolve`). seed: the RL seed (`run_config.Seeds`;
  default the config's `seed`). Restores `workdir`'s newest readable
  checkpoint. engine_factory(params, rollout_config, guidance_store) -> RolloutEngine (default:
  the in-process engine). Use as a context manager, or call `close()`.
  """

  def __init__(self, run: RunConfig, workdir: str, policy: str,
               init_params: Any, *, seed: int | None = None,
               engine_factory: EngineFactory | None = None, progress: bool = True):
    r = self.rl_cfg = run.rl
    self.run_cfg, self.workdir, self.name = run, workdir, policy
    self.spec = policies.parse(policy)
    pol = self.policy = self.spec.policy
    self.seeds = Seeds(run.seed, run.seed if seed is None else int(seed))
    os.makedirs(workdir, exist_ok=True)
    self.model_cfg = run.model_for(pol.train.name)
    if self.spec.fp8_backward:
      self.model_cfg = self.model_cfg.replace(fp8_backward=True)
    self.rollout_cfg = run.model_for(pol.rollout.name)
    self.io = make_task_io(run)
    self.all_layers = tuple(range(self.model_cfg.num_hidden_layers))
    self.guided_layers = tuple(self.rollout_cfg.guided_layers)
    # Codes are audited only where the trainer has FP4 codes to compare; routing whenever the
    # rollout is FP4 (under fp4_rollout the trainer's BF16 routing still differs).
    audit = r.audit_fraction if pol.fp4_train else 0.0
    # The schedule counts optimizer steps: `updates_per_step` of them per RL step.
    u = r.updates_per_step
    self.tx = step_lib.make_optimizer(step_lib.OptimConfig(
        lr=r.lr, warmup_steps=r.warmup_steps * u, total_steps=r.steps * u,
        weight_decay=r.weight_decay))
    self.loss_cfg = step_lib.RLConfig(
        clip_eps_low=r.clip_eps, clip_eps_high=r.clip_eps_high,
        is_mode=r.is_mode, is_cap=r.is_cap, kl_coef=r.kl_coef,
        aux_loss_coef=r.aux_loss_coef, routing_replay=self.spec.replay, loss_agg=r.loss_agg,
        is_level=r.is_level, loss_norm=float(self.io.tokens_after_prompt(r.max_new_tokens)))
    self.advantage_fn = adv_lib.get_advantage_fn(r.advantage, r.adv_std)
    placed = step_lib.place_params(init_params, run.mesh)
    # The KL term's reference policy: the run's starting weights, in the training forward.
    self.ref_params = placed if self.loss_cfg.kl_coef else None
    self.state = step_lib.init_state(placed, self.tx)
    self.ckpt = checkpoints.checkpointer(os.path.join(workdir, "ckpt"), keep=2)
    self.history: list[dict[str, Any]] = []
    self.evals: list[dict[str, float]] = []
    self.start = self.restore()
    # An FP4 rollout records into the guidance store: a TRACE policy's training record
    # (guidance of the guided layers), every layer's routing, and full codes of audited rows.
    # The in-process engine hands them over in memory unless the run keeps them; a server (an
    # engine_factory) writes them to the run's directory.
    self.store = None
    if pol.fp4_rollout and engine_factory is None and not r.keep_guidance:
      self.store = guidance_store.MemoryGuidanceStore(
          guidance_store.config_hash(self.rollout_cfg))
    elif pol.fp4_rollout:
      self.store = guidance_store.GuidanceStore(
          os.path.join(workdir, "guidance"), guidance_store.config_hash(self.rollout_cfg),
          options=guidance_store.StoreOptions(fsync=False), on_missing=r.on_missing_guidance,
          overwrite=True)
      # A killed run's half-written batches (no manifest): this launch holds the run's lock, so
      # nothing else writes here.
      self.store.remove_incomplete()
    batch_rows = max(r.prompts_per_step * r.group_size, run.eval.num_prompts)
    # On a config mesh the engine runs on it too: its MoE blocks expert-parallel.
    sh = jax.tree.leaves(placed)[0].sharding
    mesh = sh.mesh if run.mesh and isinstance(sh, jax.sharding.NamedSharding) else None
    factory = engine_factory or (lambda p, c, store: InProcessEngine(
        p, c, guidance_store=store, record_guidance=pol.guided, record_routing=pol.fp4_rollout,
        audit_fraction=audit, max_batch=batch_rows, min_prompt_len=run.max_prompt_len,
        mesh=mesh))
    self.engine = factory(self.state.params, self.rollout_cfg, self.store)
    # The logs keep exactly the rows the restored checkpoint holds (row k of metrics.csv is
    # step k; a row of evals.csv is the greedy eval after `step` steps).
    self.log = run_log.RunLog(
        workdir, policy, start=self.start, total=r.steps,
        evals_below=max((e["step"] + 1 for e in self.evals), default=0),
        desc=f"{policy} seed {self.seeds.rl}", progress=progress)
    self.fallback_batches = 0

  # ---------------------------------------------------------------------------- one step

  def rollout(self, step: int) -> Rollout:
    """The step's prompts, G samples each through the engine, and their rewards."""
    r = self.rl_cfg
    problems, prompts = self.io.prompts(self.seeds.rl_prompts(step), r.prompts_per_step)
    problems = [p for p in problems for _ in range(r.group_size)]
    prompts = [p for p in prompts for _ in range(r.group_size)]
    sampling = [self.io.sampling(max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                                 top_p=r.top_p, seed=self.seeds.rl_sampling(step, i))
                for i in range(len(prompts))]
    t0 = time.perf_counter()
    samples = self.io.generate(self.engine, problems, prompts, sampling,
                               record=self.policy.fp4_rollout)
    seconds = time.perf_counter() - t0
    return Rollout(problems, samples, self.io.rewards(problems, samples), seconds)

  def guidance(self, samples: list[Sample]) -> RolloutRecords | None:
    """The samples' rollout records from the store (None without an FP4 rollout); the store
    batches they came from are deleted afterwards unless `rl.keep_guidance`."""
    if self.store is None:
      return None
    handles = samples_handles(samples)
    elsewhere = {h.store for h in handles if h.store not in (None, self.store.root)}
    if elsewhere:
      raise ValueError(f"the rollout wrote guidance to {sorted(elsewhere)}, but this run reads "
                       f"{self.store.root} (serve with --guidance_dir={self.store.root})")
    main = self.store.read(handles)
    n_audit = 0
    while n_audit < len(samples) and samples[n_audit].guidance.audit_batch_id:
      n_audit += 1
    audit = (self.store.read(samples_handles(samples[:n_audit]), audit=True)
             if n_audit else None)
    self.drop(samples)
    return RolloutRecords(main, audit, n_audit)

  def batch(self, rollout: Rollout, records: RolloutRecords | None, step: int
            ) -> batch_lib.RLBatch:
    """The GRPO batch: advantages, and the records the training forward consumes (a guided
    policy's guidance and the expert ids that match it; every layer's ids under R3)."""
    r = self.rl_cfg
    adv = np.asarray(self.advantage_fn(jnp.asarray(rollout.rewards), r.group_size))
    guidance = routing = None
    if records is not None and not records.complete:  # on_missing="fallback": counted
      log.warning("step %d: rollout records incomplete (%s); RTN, no replay for this batch",
                  step, records.problems)
      self.fallback_batches += 1
    elif records is not None:
      if self.policy.guided:
        guidance = records.main.guidance
      used = (self.all_layers if self.spec.replay else
              self.guided_layers if self.policy.guided else ())
      routing = {layer: records.main.routing[layer] for layer in used} or None
    batch = batch_lib.rl_batch(rollout.samples, adv, self.run_cfg.seq_len, guidance, routing)
    if self.ref_params is not None:
      batch = batch.replace(logp_ref=step_lib.reference_logprobs(
          self.ref_params, self.model_cfg, batch.inputs, batch.targets))
    return batch

  def update(self, batch: batch_lib.RLBatch, tap_layers: tuple[int, ...] = (),
             tap_rows: int = 0) -> tuple[dict[str, float], Any, list[dict[str, float]]]:
    """The GRPO updates of one rollout batch, then the new weights to the engine.

    One update per batch (`rl.minibatches` = `rl.epochs` = 1): one step on the whole batch.
    Otherwise the trainer's log-probs before any update (`step.policy_logprobs`) become the
    batch's `logp_old`, and `epochs` passes over `minibatches` contiguous parts each take one
    step, every one clipping against them. Returns (the RL step's metrics: the updates' means,
    mismatch of the pre-update forward; the taps of `tap_layers` for the first `tap_rows`
    sequences of the pre-update forward; one metrics row per update). A state left
    non-finite by an update stops the run (`checkpoints.NonFiniteStateError`) before the
    engine or a checkpoint sees it.
    """
    r = self.rl_cfg
    if r.updates_per_step == 1:
      m, taps = self._step(batch, tap_layers, tap_rows)
      return m, taps, [self._update_row(m, 0, 0, 0)]
    logp_old, taps = step_lib.policy_logprobs(self.state.params, self.model_cfg, self.loss_cfg,
                                              batch, tap_layers, tap_rows)
    batch = batch.replace(logp_old=logp_old)
    parts = np.array_split(np.arange(batch.num_sequences), r.minibatches)
    rows = []
    for epoch in range(r.epochs):
      for i, part in enumerate(parts):
        m, _ = self._step(batch_lib.take_rows(batch, part))
        rows.append(self._update_row(m, len(rows), epoch, i))
    means = {k: float(np.mean([row[k] for row in rows])) for k in UPDATE_KEYS
             if all(row.get(k) is not None for row in rows)}
    before = jax.device_get(losses.mismatch_metrics(logp_old, batch.logp_rollout,
                                                    batch.loss_mask))
    return {**means, **before}, taps, rows

  def _step(self, batch: batch_lib.RLBatch, tap_layers: tuple[int, ...] = (),
            tap_rows: int | None = 0) -> tuple[dict[str, Any], Any]:
    """One optimizer step on `batch`, then the finite-values guard."""
    self.state, m, taps = step_lib.grpo_step(
        self.state, batch, config=self.model_cfg, tx=self.tx, rl=self.loss_cfg,
        tap_layers=tap_layers, tap_rows=tap_rows)
    m = jax.device_get(m)
    k, u = int(self.state.step) - 1, self.rl_cfg.updates_per_step  # u updates per RL step
    where = f"rl step {k // u}" + (f" (update {k % u + 1} of {u})" if u > 1 else "")
    checkpoints.check_state(self.state, m.pop("nonfinite"), f"{where} of {self.workdir}")
    return m, taps

  @staticmethod
  def _update_row(m: dict[str, Any], update: int, epoch: int, minibatch: int
                  ) -> dict[str, float]:
    return {"update": update, "epoch": epoch, "minibatch": minibatch,
            **{k: float(m[k]) for k in UPDATE_KEYS if k in m}}

  def train_step(self, step: int
                 ) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, float]]]:
    """Rollout, guidance, updates and mismatch of RL step `step`; returns its metrics row, its
    per-layer flip rows and one row per optimizer step."""
    t_step = time.perf_counter()
    ro = self.rollout(step)
    t_g = time.perf_counter()
    records = self.guidance(ro.samples)
    batch = self.batch(ro, records, step)
    guidance_s = time.perf_counter() - t_g
    complete = records is not None and records.complete
    t1 = time.perf_counter()
    m, taps, updates = self.update(batch, self.all_layers if complete else (),
                                   records.n_audit if complete else 0)
    t_w = time.perf_counter()
    self.engine.update_weights(self.state.params)
    t_audit = time.perf_counter()
    train_s = t_audit - t1
    row = {"step": step, "reward": float(np.mean(ro.rewards)),
           "mean_abs_dlogp": float(m["mean_abs_dlogp"]), "k3_kl": float(m["k3_kl"]),
           "max_abs_dp": float(m["max_abs_dp"]), "loss": float(m["loss"]),
           "grad_norm": float(m["grad_norm"]), "kl_ref": float(m["kl_ref"]) if "kl_ref" in m
           else None, "rollout_tokens_per_s": ro.sampled_tokens / ro.seconds,
           "train_tokens_per_s": float(np.sum(batch.valid)) / train_s,
           "response_len": float(np.mean([len(s.tokens) for s in ro.samples])),
           "rollout_s": ro.seconds, "guidance_s": guidance_s, "update_s": t_w - t1,
           "weights_s": t_audit - t_w,
           **{k: float(m[k]) for k in DASHBOARD_KEYS if k in m}}
    flips = []
    if complete:
      report = mismatch.compare_step_device(
          taps, ro.counts, records.n_audit,
          records.audit.guidance if records.audit is not None else {},
          records.main.routing, self.guided_layers)
      row.update(report.metrics())
      flips = report.rows()
      row["guidance_bytes_per_token"] = mismatch.guidance_bytes_per_token(
          batch.guidance and records.main.guidance,
          batch.routing and {k: records.main.routing[k] for k in batch.routing},
          sum(ro.counts))
    row["audit_s"] = time.perf_counter() - t_audit
    row["step_s"] = time.perf_counter() - t_step
    return row, flips, updates

  # ---------------------------------------------------------------------------- evals

  def evaluate(self, done: int) -> float:
    """Greedy eval reward on the fixed eval prompts after `done` steps (logged); its records
    train nothing and are deleted."""
    problems, samples = evaluation.eval_rollout(self.engine, self.io, self.run_cfg)
    self.drop(samples)
    reward = float(np.mean(self.io.rewards(problems, samples)))
    self.evals.append({"step": done, "reward": reward})
    self.log.eval(done, reward)
    return reward

  def drop(self, samples: list[Sample]) -> None:
    """Deletes the store batches `samples` (and their turns, for episodes) came from, unless
    `rl.keep_guidance`."""
    if self.store is None or self.rl_cfg.keep_guidance:
      return
    self.store.delete([s.guidance.batch_id for s in samples if s.guidance is not None] + [
        b for s in samples for b in s.meta.get("turn_guidance_batches", ())])

  # ---------------------------------------------------------------------------- checkpoints

  def save(self, done: int) -> None:
    checkpoints.save(self.ckpt, done, self.state, {"history": self.history,
                                                   "evals": self.evals})

  def restore(self) -> int:
    """Restores the newest readable checkpoint (state, history, evals); returns its step, 0
    without one."""
    restored = checkpoints.restore_latest(self.ckpt, self.state,
                                          os.path.join(self.workdir, checkpoints.CORRUPT_DIR))
    if restored is None:
      return 0
    step, self.state, meta = restored
    self.history, self.evals = meta["history"], meta["evals"]
    log.info("resumed %s from step %d", self.workdir, step)
    return step

  # ---------------------------------------------------------------------------- the run

  def run(self, max_steps: int | None = None) -> dict[str, Any]:
    """Runs from the restored step to `rl.steps` (or `max_steps`, to simulate a kill in
    tests); returns the summary, history, evals, final params and state, and writes
    history.json."""
    r = self.rl_cfg
    if self.start == 0 and not self.evals:
      self.evaluate(0)
    end = r.steps if max_steps is None else min(r.steps, max_steps)
    for step in range(self.start, end):
      row, flips, updates = self.train_step(step)
      self.history.append(row)
      self.log.step(row, flips, updates)
      done = step + 1
      if done % self.run_cfg.eval.every == 0 or done == r.steps:
        self.evaluate(done)
      if done % self.run_cfg.checkpoint_every == 0 or done == end:
        self.save(done)
    summary = evaluation.summarize(self.history, self.evals)
    summary["guidance_fallback_batches"] = self.fallback_batches
    summary["checkpoint_fallbacks"] = checkpoints.checkpoint_fallbacks(self.workdir)
    # Whole or not at all: a summary process may read it while this run writes it.
    run_guard.write_json(os.path.join(self.workdir, "history.json"),
                         {"history": self.history, "evals": self.evals, "summary": summary})
    return {"summary": summary, "history": self.history, "evals": self.evals,
            "params": self.state.params, "state": self.state}

  def close(self) -> None:
    self.ckpt.close()
    self.engine.close()
    if self.store is not None:
      self.store.close()
    self.log.close()

  def __enter__(self) -> GRPOLearner:
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()


def samples_handles(samples: list[Sample]) -> list[Any]:
  """The samples' guidance handles (every sample of an FP4 rollout has one)."""
  missing = [i for i, s in enumerate(samples) if s.guidance is None]
  if missing:
    raise ValueError(f"samples {missing[:5]} carry no guidance handle (the engine recorded "
                     "nothing for them)")
  return [s.guidance for s in samples]
