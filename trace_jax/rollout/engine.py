"""The embedded JAX rollout engine: batched sampling with the model's decode mode.

One jitted program (`decode.generate`) per (batch, prompt-length, new-token) bucket runs prefill
and the whole decode loop on the device. Requests are padded into power-of-two buckets, so a
stream of requests of varying sizes compiles only a few programs (one, for prompts under the
engine's `min_prompt_len`). Under FP4 policies the program also records what the engine was
asked to record (guidance, routing, audit codes) for every position the trainer will later run
through its forward (prompt + completion[:-1]): the prefill's rows and one byte row per decode
step, a single copy on the device, gathered into ragged rows when the call returns.

Sessions (`open_session` / `extend` / `close_session`) serve multi-turn episodes: the KV cache
stays on the device between turns and each turn feeds only its new tokens; each turn's records
move to pinned host memory as it ends (`turn_records`), so the device holds the cache and one
turn's records, and the records hold exactly what the rollout computed for every token of the
transcript.

On a mesh (`InProcessEngine(mesh=)`) the routed experts are split over the mesh's `expert`
axis and every program runs its MoE blocks expert-parallel (`model.expert_parallel`);
every other weight is replicated (`sharding.ENGINE_RULES`), the batch split over the mesh, and
the decode kernels run on each device's own sequences (`model.batch_local`).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import functools
import itertools
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from trace_jax import model as model_lib
from trace_jax.guidance import layout as guidance_layout
from trace_jax.guidance import store as guidance_store
from trace_jax.guidance.handle import GuidanceHandle
from trace_jax.guidance.record import Guidance
from trace_jax.model import expert_parallel, expert_weights, mesh_context, sharding
from trace_jax.model.config import SITES, ModelConfig
from trace_jax.quant import guided
from trace_jax.rollout import decode, turn_records
from trace_jax.rollout import sampling as sampling_lib
from trace_jax.rollout.protocol import Sample, SamplingParams, normalize_request

log = logging.getLogger(__name__)

_MIN_LEN_BUCKET = 16
_MAX_STOP_IDS = 8
_SEED_MOD = 2**32


def bucket(n: int, minimum: int = 1) -> int:
  """Smallest power of two >= max(n, minimum)."""
  return max(minimum, 1 << max(0, int(n) - 1).bit_length())


def prompt_bucket(n: int, min_prompt_len: int = 0) -> int:
  """Padded prompt length for a batch whose longest prompt has n tokens.

  Up to `min_prompt_len` (rounded up to a multiple of 16) every batch gets that one length, so
  a run whose prompts are bounded compiles one generation program; longer batches, or an
  engine without a floor, use power-of-two buckets.
  """
  floor = -(-int(min_prompt_len) // _MIN_LEN_BUCKET) * _MIN_LEN_BUCKET
  return floor if n <= floor else bucket(n, _MIN_LEN_BUCKET)


def new_tokens_bucket(n: int) -> int:
  """The decode loop's length (a program's max_new) for a call whose longest request asks for
  n new tokens."""
  return bucket(n, _MIN_LEN_BUCKET)


class InProcessEngine:
  """`RolloutEngine` running the trainer's Flax model in this process.

  config.policy selects the rollout precision. What each call records (FP4 policies):
  - record_guidance (default: under `fp4_trace`): the training record, `config.guidance_mode`
    guidance of `config.guided_layers` (all four sites);
  - record_routing (default: whenever anything is recorded): every layer's expert ids, which
    match expert_mid guidance to experts and allow routing replay;
  - audit_fraction: full 4-bit codes of every layer and site for the first
    ceil(fraction * n) sequences of each batch, so flips can be counted exactly (batch
    "<batch_id>.audit" in the store, `Sample.guidance.audit_batch_id`).
  With a `guidance_store` (`trace_jax.guidance.store.GuidanceStore`, which names and writes
  the batches) each batch is written asynchronously and every Sample carries its
  `GuidanceHandle`; without one, the last batch's records stay in `self.last_guidance`
  (ragged rows, for notebooks and tests). `min_prompt_len` pads
  every batch's prompts to at least that length (see `prompt_bucket`): a trainer that knows
  its longest prompt passes it and compiles one program for the whole run.
  `mesh` (axes as `model.sharding.make_mesh` builds them, one process): the weights placed on
  it by `sharding.ENGINE_RULES` (the routed experts, params or prepared, split along E over
  `expert`; the rest replicated), the programs jitted for this engine and traced with the
  MoE blocks expert-parallel (`mesh_context.use_mesh`; on when `expert` > 1).
  The engine's kernel plan (`plan`, `trace_jax.model.plan`) is resolved once here from the
  config on the default backend; every program it builds runs that plan.
  """

  def __init__(self, params: Any, config: ModelConfig, *, guidance_store: Any = None,
               record_guidance: bool | None = None, record_routing: bool | None = None,
               audit_fraction: float = 0.0, max_batch: int = 64, seed: int = 0,
               min_prompt_len: int = 0, mesh: Mesh | None = None):
    if min_prompt_len < 0:
      raise ValueError(f"min_prompt_len must be >= 0, got {min_prompt_len}")
    if not 0.0 <= audit_fraction <= 1.0:
      raise ValueError(f"audit_fraction must be in [0, 1], got {audit_fraction}")
    self.config = config
    self.plan = model_lib.resolve_plan(config)
    self.mesh = mesh
    self._programs = _Programs(config, self.plan, mesh)
    self._set_params(params)
    self.store = guidance_store
    self.record = config.forward.guided if record_guidance is None else record_guidance
    self.audit_fraction = float(audit_fraction)
    self.record_routing = ((self.record or self.audit_fraction > 0) if record_routing is None
                           else record_routing)
    self.max_batch = max_batch
    self.min_prompt_len = min_prompt_len
    self._record_layout: tuple[Any] | None = None  # (`record_layout`,) once traced
    self._seed_counter = itertools.count((seed * 1_000_003) % _SEED_MOD)
    self._memory_batches = itertools.count()  # batch ids of records kept in memory
    self._lock = threading.Lock()
    self._last_guidance: dict[str, Any] | None = None  # see `last_guidance`
    self._pending_guidance: Callable[[], dict[str, Any]] | None = None
    self._records_thread = cf.ThreadPoolExecutor(max_workers=1,
                                                 thread_name_prefix="engine-records")
    # Wall seconds generation calls spent handing their records off (`_emit`: the device-side
    # gather and queuing the copy to the host, which runs on another thread; with full-mode
    # records to compact on the host, the copy too) and the bytes copied, summed over calls.
    self.emit_seconds = 0.0
    self.emit_bytes = 0
    self.weights_version = 0

  # ---------------------------------------------------------------------------- protocol

  def generate(self, prompts: Sequence[Sequence[int]],
               sampling: SamplingParams | Sequence[SamplingParams]) -> list[Sample]:
    prompts, sampling = normalize_request(prompts, sampling)
    if not prompts:
      return []
    for i, p in enumerate(prompts):
      if not p:
        raise ValueError(f"prompt {i} is empty")
      bad = [t for t in p if not 0 <= t < self.config.vocab_size]
      if bad:
        raise ValueError(f"prompt {i} has token ids outside [0, {self.config.vocab_size}): "
                         f"{bad[:5]}")
      if len(sampling[i].stop_token_ids) > _MAX_STOP_IDS:
        raise ValueError(f"request {i}: at most {_MAX_STOP_IDS} stop_token_ids, got "
                         f"{len(sampling[i].stop_token_ids)}")
      if len(p) + sampling[i].max_new_tokens > self.config.max_position_embeddings:
        raise ValueError(f"prompt {i}: {len(p)} + {sampling[i].max_new_tokens} new tokens "
                         f"exceed max_position_embeddings {self.config.max_position_embeddings}")
    with self._lock:
      out: list[Sample] = []
      for start in range(0, len(prompts), self.max_batch):
        out += self._generate_batch(prompts[start:start + self.max_batch],
                                    list(sampling[start:start + self.max_batch]))
      return out

  def update_weights(self, path_or_params: Any) -> None:
    """New weights from an HF checkpoint directory or a params pytree (same shapes).

    A directory is refused (ValueError; the old weights stay) when a tensor holds NaN/Inf or
    its config.json differs from the served model's in any field that changes the computation
    (`ModelConfig.compute_fields`: shapes, routing normalisation, norms, RoPE, dtype).
    """
    if isinstance(path_or_params, (str, os.PathLike)):
      from trace_jax.io import hf
      from trace_jax.model.config import compute_differences
      config, params = hf.load_hf_checkpoint(os.fspath(path_or_params))
      diff = compute_differences(self.config, config)
      if diff:
        raise ValueError("the checkpoint's config differs from the served model's in " + ", ".join(
            f"{k} (served {a!r}, checkpoint {b!r})" for k, (a, b) in diff.items()))
    else:
      params = path_or_params
    old = self._param_shapes
    new = jax.tree.map(lambda a: (a.shape, jnp.asarray(a).dtype), params)
    if jax.tree.structure(old) != jax.tree.structure(new) or jax.tree.leaves(old) != \
        jax.tree.leaves(new):
      raise ValueError("update_weights: new parameters differ in structure, shape or dtype")
    with self._lock:
      self._set_params(params)
      self.weights_version += 1

  def close(self) -> None:
    """Waits for the last batch's records (kept in memory, or written to the store)."""
    _ = self.last_guidance
    if self.store is not None:
      self.store.flush()

  # ---------------------------------------------------------------------------- internals

  def _set_params(self, params: Any) -> None:
    """The weights decode runs; with the plan's decode_impl "kernel" also the routed experts
    as the decode kernel reads them (packed NVFP4 under an NVFP4 forward) and, under FP8
    linears, every FP8 GEMM's weights quantized (`expert_weights.prepare`), made once here."""
    self._param_shapes = jax.tree.map(lambda a: (a.shape, jnp.asarray(a).dtype), params)
    self.experts = None
    if self.plan.decode_impl == "kernel":
      if not expert_weights.supported(self.config):
        raise ValueError(f"decode_impl='kernel' runs BF16, NVFP4 and FP8 weights; policy "
                         f"{self.config.policy!r} is none of them")
      self.experts = self._programs.prepare(params)
      # One copy of each weight: the prepared ones replace the params' (freed unless the
      # caller still holds them, as the in-process learner does its master weights).
      params = expert_weights.drop_prepared(params, self.config)
    # The layers' params stacked per run once here, not by every decode step's forward; the
    # params keep empty arrays in their place.
    self.layers = self._programs.stack(params)
    self.params = self._programs.replicate(_drop_layers(params))

  def trace_generate(self, prompts: Sequence[Sequence[int]],
                     sampling: SamplingParams | Sequence[SamplingParams]) -> Any:
    """The generation program of one batch (at most `max_batch` requests) traced as the engine
    runs it (`jax.stages.Traced`: `.jaxpr` its jaxpr), to inspect."""
    prompts, sampling = normalize_request(prompts, sampling)
    args, kw = self._generate_args(prompts, sampling)
    with self._programs.traced():
      return self._programs.generate.trace(*args, **kw)

  def lower_generate(self, prompts: Sequence[Sequence[int]],
                     sampling: SamplingParams | Sequence[SamplingParams]) -> Any:
    """`trace_generate`'s program lowered (`jax.stages.Lowered`: `.compile().as_text()` is its
    HLO)."""
    return self.trace_generate(prompts, sampling).lower()

  def _generate_args(self, prompts: list[list[int]], sampling: list[SamplingParams]
                     ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The generation program's positional and keyword arguments for one padded batch."""
    b = bucket(len(prompts))
    p = prompt_bucket(max(map(len, prompts)), self.min_prompt_len)
    max_new = new_tokens_bucket(max(s.max_new_tokens for s in sampling))
    tokens = np.zeros((b, p), np.int32)
    lens = np.ones(b, np.int32)
    for i, pr in enumerate(prompts):
      tokens[i, :len(pr)] = pr
      lens[i] = len(pr)
    tap_layers, tap_mode = self._tap_plan()
    args = (self.params, self.config, jnp.asarray(tokens), jnp.asarray(lens),
            *self._sampling_arrays(sampling, b))
    return args, dict(max_new=max_new, truncate=self._truncates(sampling),
                      tap_layers=tap_layers, tap_mode=tap_mode, tap_routing=self.record_routing,
                      experts=self.experts, layers=self.layers, plan=self.plan)

  def _generate_batch(self, prompts: list[list[int]],
                      sampling: list[SamplingParams]) -> list[Sample]:
    args, kw = self._generate_args(prompts, sampling)
    with self._programs.traced():
      gen, logps, n_gen, (prompt, steps) = self._programs.generate(*args, **kw)
    samples = self._samples(prompts, sampling, gen, logps, n_gen)
    if kw["tap_layers"] or self.record_routing:
      tokens, lens = args[2], args[3]
      gather = functools.partial(decode.ragged_records, prompt, steps, lens,
                                 total=tokens.shape[1] + kw["max_new"])
      for s, h in zip(samples, self._emit([s.num_rows for s in samples], gather)):
        s.guidance = h
    return samples

  def _truncates(self, sampling: list[SamplingParams]) -> bool:
    """Whether any request has a top-k / top-p that cuts the vocabulary: the programs' static
    `truncate` (the vocabulary sort, decided here rather than on the device at every step)."""
    return bool(np.any(sampling_lib.truncating(
        np.asarray([s.temperature for s in sampling]), np.asarray([s.top_p for s in sampling]),
        np.asarray([s.top_k for s in sampling]), self.config.vocab_size)))

  def _sampling_arrays(self, sampling: list[SamplingParams], b: int) -> list[Any]:
    """Per-row sampling inputs of the decode programs, padded to b rows."""
    sp = sampling + [SamplingParams(max_new_tokens=1)] * (b - len(sampling))
    seeds = [(s.seed if s.seed is not None else next(self._seed_counter)) % _SEED_MOD
             for s in sp]
    stop = np.full((b, _MAX_STOP_IDS), -1, np.int32)
    for i, s in enumerate(sp):
      stop[i, :len(s.stop_token_ids)] = s.stop_token_ids
    return [jnp.asarray([s.max_new_tokens for s in sp], jnp.int32),
            jnp.asarray([s.temperature for s in sp], jnp.float32),
            jnp.asarray([s.top_p for s in sp], jnp.float32),
            jnp.asarray([s.top_k for s in sp], jnp.int32),
            jax.vmap(jax.random.key)(jnp.asarray(seeds, jnp.uint32)), jnp.asarray(stop)]

  def _samples(self, prompts: list[list[int]], sampling: list[SamplingParams], gen: Any,
               logps: Any, n_gen: Any) -> list[Sample]:
    gen, logps, n_gen = np.asarray(gen), np.asarray(logps), np.asarray(n_gen)
    samples = []
    for i in range(len(prompts)):
      k = int(n_gen[i])
      toks = gen[i, :k].tolist()
      hit = bool(sampling[i].stop_token_ids) and toks[-1] in sampling[i].stop_token_ids
      samples.append(Sample(prompt=prompts[i], tokens=toks, logprobs=logps[i, :k].tolist(),
                            finish_reason="stop" if hit else "length",
                            meta={"weights_version": self.weights_version}))
    return samples

  # ---------------------------------------------------------------------------- sessions

  def open_session(self, n: int, max_len: int) -> Session:
    """A session of n episodes of at most max_len tokens each (prompt and every turn)."""
    if n < 1 or n > self.max_batch:
      raise ValueError(f"a session holds 1..{self.max_batch} episodes, got {n}")
    b, total = bucket(n), bucket(max_len + 1, _MIN_LEN_BUCKET)
    if total > self.config.max_position_embeddings:
      raise ValueError(f"session length {max_len} exceeds max_position_embeddings "
                       f"{self.config.max_position_embeddings}")
    cache = self._programs.place_cache(model_lib.init_cache(self.config, b, total,
                                                             plan=self.plan))
    return Session(n=n, batch=b, total=total, cache=cache, layout=self.record_layout(),
                   lens=np.zeros(b, np.int32), pending=[None] * b)

  def record_layout(self) -> Any:
    """The byte-row layout (`byte_rows.Layout`) of one token's records as this engine's
    programs tap them, or None when it records nothing (traced once per engine)."""
    if self._record_layout is None:
      tap_layers, tap_mode = self._tap_plan()
      with self._programs.traced():
        self._record_layout = (decode.record_layout(
            self.params, self.config, tap_layers=tap_layers, tap_mode=tap_mode,
            tap_routing=self.record_routing, experts=self.experts, layers=self.layers,
            plan=self.plan),)
    return self._record_layout[0]

  def extend(self, session: Session, rows: Sequence[int], chunks: Sequence[Sequence[int]],
             sampling: Sequence[SamplingParams]) -> list[Sample]:
    """One turn for `rows`: feed each row's pending token and its chunk, sample a continuation.

    A row's first chunk is its prompt; later chunks are what follows the continuation (an
    environment's observation). Returns one Sample per row (prompt = what was fed).
    """
    if len(rows) != len(chunks) or len(rows) != len(sampling):
      raise ValueError(f"{len(rows)} rows, {len(chunks)} chunks, {len(sampling)} sampling")
    fed = self._chunks(session, rows, chunks, [s.max_new_tokens for s in sampling])
    sp = [SamplingParams(max_new_tokens=1)] * session.batch
    for r, s in zip(rows, sampling):
      sp[r] = s
    longest = max(map(len, fed.values()))
    if longest == 1 and session.lens.any():
      c = 1  # only the pending tokens: a one-token decode step (the decode kernels)
    else:
      c = prompt_bucket(longest, self.min_prompt_len if not session.lens.any() else 0)
    chunk, chunk_lens = self._pack(session, fed, c)
    max_new = new_tokens_bucket(max(s.max_new_tokens for s in sampling))
    tap_layers, tap_mode = self._tap_plan()
    with self._lock, self._programs.traced():
      gen, logps, n_gen, session.cache, records = self._programs.extend(
          self.params, self.config, session.cache, jnp.asarray(session.lens),
          chunk, chunk_lens, *self._sampling_arrays(sp, session.batch), max_new=max_new,
          truncate=self._truncates(sp), tap_layers=tap_layers, tap_mode=tap_mode,
          tap_routing=self.record_routing, experts=self.experts, layers=self.layers,
          plan=self.plan)
    self._keep(session, records, chunk_lens, n_gen)
    n_gen = np.asarray(n_gen)
    gen_np = np.asarray(gen)
    for r in rows:
      session.lens[r] += len(fed[r]) + int(n_gen[r]) - 1
      session.pending[r] = int(gen_np[r, int(n_gen[r]) - 1])
    return self._samples([fed[r] for r in rows], [sp[r] for r in rows],
                         gen_np[list(rows)], np.asarray(logps)[list(rows)], n_gen[list(rows)])

  def close_session(self, session: Session, chunks: Sequence[Sequence[int]]
                    ) -> list[GuidanceHandle | None]:
    """Feeds each row's pending token and final chunk (recorded, nothing sampled) and writes
    the records of every row's whole transcript. Returns each row's guidance handle (None
    when nothing is recorded)."""
    rows = list(range(session.n))
    if len(chunks) != session.n:
      raise ValueError(f"close_session: {len(chunks)} chunks for {session.n} episodes")
    tap_layers, tap_mode = self._tap_plan()
    if not (tap_layers or self.record_routing):
      return [None] * session.n
    fed = self._chunks(session, rows, chunks, [0] * session.n)
    chunk, chunk_lens = self._pack(session, fed, bucket(max(map(len, fed.values())),
                                                        _MIN_LEN_BUCKET))
    with self._lock, self._programs.traced():
      session.cache, records = self._programs.feed(
          self.params, self.config, session.cache, jnp.asarray(session.lens),
          chunk, chunk_lens, tap_layers=tap_layers, tap_mode=tap_mode,
          tap_routing=self.record_routing, experts=self.experts, layers=self.layers,
          plan=self.plan)
    self._keep(session, (records, None), chunk_lens, None)
    session.cache = None  # closed: its records are on the host, the cache is no longer needed
    for r in rows:
      session.lens[r] += len(fed[r])
      session.pending[r] = None
    counts = [int(n) for n in session.lens[:session.n]]
    host = turn_records.ragged(session.turns, counts, session.layout)
    session.turns = []
    return self._emit(counts, lambda _: host)

  def _keep(self, session: Session, records: Any, chunk_lens: jax.Array,
            n_gen: jax.Array | None) -> None:
    """A turn's records (chunk rows, step rows; None: nothing recorded) queued for the
    session's host copies (`guidance_layout.start_host_copy`: the copy runs on the device's
    streams; the device buffers go when it is done)."""
    if records is None or records[0] is None:
      return
    if records[0].shape[-1] != session.layout.width:
      raise AssertionError(f"session turn: record rows of {records[0].shape[-1]} bytes, the "
                           f"session's layout has {session.layout.width}")
    chunk, steps = guidance_layout.start_host_copy(records)
    session.turns.append(turn_records.Turn(
        chunk=chunk, steps=steps, fed=np.asarray(chunk_lens),
        n_gen=None if n_gen is None else np.asarray(n_gen)))

  def _chunks(self, session: Session, rows: Sequence[int], chunks: Sequence[Sequence[int]],
              max_new: Sequence[int]) -> dict[int, list[int]]:
    """Each row's tokens to feed (pending token first), checked against the session."""
    fed = {}
    for r, ch, m in zip(rows, chunks, max_new):
      if not 0 <= r < session.n:
        raise ValueError(f"row {r} is not in this session of {session.n} episodes")
      toks = ([] if session.pending[r] is None else [session.pending[r]]) + [int(t) for t in ch]
      bad = [t for t in toks if not 0 <= t < self.config.vocab_size]
      if bad:
        raise ValueError(f"row {r}: token ids outside [0, {self.config.vocab_size}): {bad[:5]}")
      if session.lens[r] + len(toks) + m > session.total - 1:
        raise ValueError(f"row {r}: {session.lens[r]} + {len(toks)} tokens + {m} new exceed "
                         f"the session length {session.total - 1}")
      if not toks and m:
        raise ValueError(f"row {r}: nothing to feed (empty first chunk)")
      fed[r] = toks
    return fed

  def _pack(self, session: Session, fed: dict[int, list[int]], c: int
            ) -> tuple[jax.Array, jax.Array]:
    chunk = np.zeros((session.batch, c), np.int32)
    lens = np.zeros(session.batch, np.int32)
    for r, toks in fed.items():
      chunk[r, :len(toks)] = toks
      lens[r] = len(toks)
    return jnp.asarray(chunk), jnp.asarray(lens)

  def _tap_plan(self) -> tuple[tuple[int, ...], str]:
    """(layers whose sites the program taps, tap mode): every layer in full mode for audits,
    else the guided layers in the record's mode."""
    if self.audit_fraction > 0:
      return tuple(range(self.config.num_hidden_layers)), "full"
    if self.record:
      return tuple(self.config.guided_layers), self.config.guidance_mode
    return (), self.config.guidance_mode

  def _emit(self, counts: list[int], gather: Callable[[jax.Array], dict]
            ) -> list[GuidanceHandle]:
    """Ragged records (the first counts[i] rows of sequence i) to the store or memory; returns
    each sequence's guidance handle. gather: counts int32 [B] (0 past the batch's sequences) ->
    the records in `guidance_layout.ragged_rows`' layout (device arrays; a session's: host
    arrays of exactly sum(counts) rows). Its wall time adds to `emit_seconds`."""
    t0 = time.perf_counter()
    try:
      return self._emit_records(counts, gather)
    finally:
      self.emit_seconds += time.perf_counter() - t0

  def _emit_records(self, counts: list[int], gather: Callable[[jax.Array], dict]
                    ) -> list[GuidanceHandle]:
    n_audit = math.ceil(self.audit_fraction * len(counts))
    # The rows of every sequence in order, gathered on the device by one program per batch
    # shape (padded to b * S rows), then moved to pinned host memory by the device's streams
    # while the next batch decodes (`start_host_copy`: no thread holds the GIL for it); the
    # store's writer or this engine's `_records_thread` takes them from there. The rows past
    # sum(counts) are padding, cut where the records land. (Calling `start_host_copy` on the
    # records thread instead held the next generate call back further on the H200: fp4_trace /
    # fp4_rtn 0.783 against 0.938 at batch 64, in the git history of docs/benchmarks.md.)
    b = bucket(len(counts))  # the programs' batch
    ragged = gather(jnp.asarray(list(counts) + [0] * (b - len(counts)), jnp.int32))
    # Audited rollouts tap full codes: the guided layers' compact training records are made
    # from them on the device, before the copy (a host compaction waited for the copy and held
    # the caller).
    compact = None
    if self.record and self.config.guidance_mode == "compact" and any(
        ragged[layer][site].mantissa is None for layer in self.config.guided_layers
        for site in SITES):
      compact = _compact_records(
          {layer: {site: ragged[layer][site] for site in SITES}
           for layer in self.config.guided_layers})
    # A session's records come assembled on the host (`turn_records`); a call's, on the device.
    on_host = all(isinstance(a, np.ndarray) for a in jax.tree.leaves(ragged))
    rows = ragged if on_host else guidance_layout.start_host_copy(ragged)
    if compact is not None:
      compact = guidance_layout.start_host_copy(compact)
    self.emit_bytes += sum(a.nbytes for a in jax.tree.leaves((rows, compact)))
    if self.store is not None:
      # The store's writer takes device arrays with padding rows (cut after its copy).
      return self.store.write_rollout(
          counts, *self._record_trees(rows, counts, n_audit, compact), n_audit)
    handles = guidance_store.rollout_handles(
        guidance_store.batch_name(next(self._memory_batches)), len(counts), n_audit)
    seq_ids = [h.seq_id for h in handles]

    def host_record() -> dict[str, Any]:
      host_rows, host_compact = jax.device_get((rows, compact))
      guidance, routing, audit = self._record_trees(host_rows, counts, n_audit, host_compact,
                                                    cut=True)
      return {"batch_id": handles[0].batch_id, "seq_ids": seq_ids, "token_counts": counts,
              "guidance": guidance, "routing": routing,
              "audit": {"batch_id": handles[0].audit_batch_id, "seq_ids": seq_ids[:n_audit],
                        "token_counts": counts[:n_audit], "guidance": audit}
              if n_audit else None}

    self._last_guidance = None
    self._pending_guidance = self._records_thread.submit(host_record).result
    return handles

  def _record_trees(self, rows: dict, counts: list[int], n_audit: int,
                    compact: dict | None = None, cut: bool = False
                    ) -> tuple[dict, dict, dict]:
    """(guidance, routing, audit) trees of a batch's ragged rows; compact: the guided layers'
    compact records where the rows hold full codes; cut: host arrays, the padding rows
    dropped (each record's leading rows)."""
    first = ((lambda tree, n: jax.tree.map(lambda a: a[:n], tree)) if cut
             else (lambda tree, n: tree))
    taps = first(rows, sum(counts))
    routing = {int(layer): sites["routing"] for layer, sites in taps.items() if "routing" in sites}
    guidance = {}
    if self.record:
      records = taps if compact is None else first(compact, sum(counts))
      guidance = {int(layer): {site: records[layer][site] for site in SITES}
                  for layer in self.config.guided_layers}
    audit = {}
    if n_audit:
      audit = {int(layer): {site: first(rec, sum(counts[:n_audit]))
                            for site, rec in sites.items() if site != "routing"}
               for layer, sites in taps.items()}
    return guidance, routing, audit

  @property
  def last_guidance(self) -> dict[str, Any] | None:
    """The last batch's records kept in memory (engines without a store), as host arrays:
    {"batch_id", "seq_ids", "token_counts", "guidance", "routing", "audit"}. The first read
    after a batch waits for its transfer."""
    if self._pending_guidance is not None:
      self._last_guidance, self._pending_guidance = self._pending_guidance(), None
    return self._last_guidance


@dataclasses.dataclass
class Session:
  """Episodes whose KV cache stays on the device between turns, their records on the host.

  lens[r]: tokens of row r fed so far (its cache and record rows); pending[r]: the last token
  sampled for row r, fed at the start of its next chunk; layout: the byte-row layout of a
  token's records (None: nothing recorded); turns: each turn's records, copied to the host
  (`turn_records.Turn`).
  """
  n: int
  batch: int
  total: int
  cache: Any
  layout: Any
  lens: np.ndarray
  pending: list[int | None]
  turns: list[turn_records.Turn] = dataclasses.field(default_factory=list)


# Full-mode records -> compact (`guided.compact`), a tree at a time, on the device.
_compact_records = jax.jit(functools.partial(
    jax.tree.map, guided.compact, is_leaf=lambda x: isinstance(x, Guidance)))
_write_layer = jax.jit(expert_weights.write_layer, static_argnames=("config", "plan"),
                       donate_argnums=0)
_stack_layers = jax.jit(model_lib.stack_layers, static_argnums=1)


class _Programs:
  """An engine's jitted programs and how its weights are placed.

  Without a mesh: `decode`'s programs (shared by every such engine) and the weights where the
  jits put them. On a mesh: programs of this engine's own, traced inside
  `mesh_context.use_mesh` (`traced`), and the weights placed by `sharding.ENGINE_RULES` as
  the programs' MoE blocks read them; a session's KV cache and records are split along the
  batch between turns (`session_shardings`).
  Own programs because jit's trace cache does not see `use_mesh`: it is keyed by the function
  (not the jit object) and the arguments' types, and reuses a trace made without it or for
  another mesh on the same devices; a jit of a new function object (a `functools.partial`, a
  wrapper) has a cache of its own.
  """

  def __init__(self, config: ModelConfig, plan: model_lib.KernelPlan, mesh: Mesh | None):
    self.config, self.plan, self.mesh = config, plan, mesh
    if mesh is None:
      self.generate, self.extend, self.feed = decode.generate, decode.extend, decode.feed
      return
    unknown = set(mesh.axis_names) - set(sharding.MESH_AXES)
    if unknown:
      raise ValueError(f"engine mesh: unknown axes {sorted(unknown)}; expected "
                       f"{sharding.MESH_AXES}")
    with self.traced():
      expert_parallel.active_mesh(config.num_experts)  # raises if `expert` does not divide E
    donated = ("cache",)
    self.generate = jax.jit(functools.partial(decode.generate.__wrapped__),
                            static_argnames=decode._STATIC)
    self.extend = jax.jit(self._pinned(decode.extend), static_argnames=decode._STATIC,
                          donate_argnames=donated)
    self.feed = jax.jit(self._pinned(decode.feed), static_argnames=decode.FEED_STATIC,
                        donate_argnames=donated)
    self._write: Any = None
    self._stack: Any = None

  def _pinned(self, program: Any) -> Any:
    """A session program's function (a new one: its own trace cache) with the cache and the
    turn's records (its last two outputs) laid out as `open_session` places the cache
    (`session_shardings`): each turn's inputs then have the previous turn's shardings and the
    program compiles once."""
    fn = program.__wrapped__

    @functools.wraps(fn)
    def pinned(*args: Any, **kw: Any) -> Any:
      *out, cache, records = fn(*args, **kw)
      return (*out, *jax.lax.with_sharding_constraint(
          (cache, records), self.session_shardings(cache, records)))

    return pinned

  def session_shardings(self, cache: Any, records: Any = None) -> Any:
    """A session's (cache, records) shardings on the mesh: each split along the batch as the
    rules split the batch (the cache's stacked runs [L, B, ...], a turn's record rows
    [B, ...]), so a device holds its own sequences' cache between turns; replicated where the
    batch does not split."""
    b = jax.tree.leaves(cache)[0].shape[1]
    axes = sharding.batch_axes(b, self.mesh, sharding.ENGINE_RULES)
    along = lambda dim: NamedSharding(self.mesh, PartitionSpec(*([None] * dim), axes))
    return jax.tree.map(lambda _: along(1), cache), jax.tree.map(lambda _: along(0), records)

  def place_cache(self, cache: Any) -> Any:
    """A new session's KV cache placed by `session_shardings` (as it is without a mesh)."""
    if self.mesh is None:
      return cache
    return jax.device_put(cache, self.session_shardings(cache)[0])

  def traced(self) -> contextlib.AbstractContextManager[None]:
    """The context the programs are called (and traced) in."""
    if self.mesh is None:
      return contextlib.nullcontext()
    return mesh_context.use_mesh(self.mesh, sharding.ENGINE_RULES)

  def prepare(self, params: Any) -> list[expert_weights.ExpertWeights]:
    """`expert_weights.prepare`'s runs, written one layer at a time into each run's stacks by
    one program whatever the depth (`expert_weights.write_layer`); on a mesh the stacks lie
    where `expert_weights.shardings` puts them (experts split along E)."""
    structs = expert_weights.run_structs(params, self.config, self.plan)
    if self.mesh is None:
      write = functools.partial(_write_layer, config=self.config, plan=self.plan)
      zeros = lambda struct: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), struct)
    else:
      places = expert_weights.shardings(structs, self.mesh)
      if self._write is None:  # every run's stacks are placed alike
        self._write = jax.jit(functools.partial(expert_weights.write_layer, config=self.config,
                                                plan=self.plan),
                              out_shardings=places[0], donate_argnums=0)
      write = self._write
      zeros = lambda struct: jax.tree.map(lambda s, p: jnp.zeros(s.shape, s.dtype, device=p),
                                          struct, places[0])
    runs = []
    for (a, b), struct in zip(model_lib.layer_runs(self.config), structs):
      run = zeros(struct)
      for i in range(a, b):
        run = write(run, params["layers"][i], np.int32(i - a))
      runs.append(run)
    return runs

  def stack(self, params: Any) -> list[Any]:
    """`model.stack_layers`'s runs, on a mesh placed by `sharding.ENGINE_RULES`."""
    if self.mesh is None:
      return _stack_layers(params, self.config)
    if self._stack is None:
      fn = functools.partial(model_lib.stack_layers, config=self.config)
      out = sharding.param_shardings(jax.eval_shape(fn, params), self.mesh,
                                     sharding.ENGINE_RULES, stacked=True)
      self._stack = jax.jit(fn, out_shardings=out)
    return self._stack(params)

  def replicate(self, tree: Any) -> Any:
    """`tree` replicated over the mesh (as it is without one)."""
    if self.mesh is None:
      return tree
    return jax.device_put(tree, NamedSharding(self.mesh, PartitionSpec()))


def _drop_layers(params: Any) -> Any:
  """params with every decoder layer's arrays empty (the engine holds them stacked)."""
  return expert_weights.empty_where(params,
                                    lambda path: getattr(path[0], "key", None) == "layers")
