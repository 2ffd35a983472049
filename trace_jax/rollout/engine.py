"""The embedded JAX rollout engine: batched sampling with the model's decode mode.

One jitted program per (batch, prompt-length, new-token) bucket runs prefill and the whole
decode loop (`lax.while_loop`) on the device; nothing returns to the host per token. Requests
are padded into power-of-two buckets, so a stream of requests of varying sizes compiles only a
few programs (one, for prompts under the engine's `min_prompt_len`). Under `fp4_trace` the
program also records, into preallocated device buffers, the guidance (compact or full) of the
configured layers and sites plus the routed expert ids, for every position the trainer will
later run through its forward (prompt + completion[:-1]).
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax import model as model_lib
from trace_jax.model.config import ModelConfig
from trace_jax.rollout import sampling as sampling_lib
from trace_jax.rollout.protocol import Sample, SamplingParams, normalize_request

log = logging.getLogger(__name__)

_MIN_LEN_BUCKET = 16
_MAX_STOP_IDS = 8
_SEED_MOD = 2**32


def batch_dirs(root: str) -> set[str]:
  """Names of the guidance batches this engine wrote under a store root ("b000123")."""
  names = os.listdir(root) if os.path.isdir(root) else []
  return {n for n in names if n[:1] == "b" and n[1:].isdigit()}


def _next_batch_index(writer: Any) -> int:
  """Continues after the highest batch id already under the writer's root (restarts)."""
  ids = [int(n[1:]) for n in batch_dirs(writer.root)] if writer is not None else []
  return max(ids) + 1 if ids else 0


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


def _tap_rows(a: jax.Array, b: int, s: int) -> jax.Array:
  """Tap arrays have rows [B, S, ...]."""
  return a.reshape((b, s) + a.shape[2:])


@functools.partial(jax.jit, static_argnames=("config", "max_new", "tap_layers", "tap_mode"))
def _generate(params, config: ModelConfig, tokens, prompt_lens, max_new_each, temps, top_ps,
              top_ks, keys, stop_ids, *, max_new: int, tap_layers: tuple[int, ...],
              tap_mode: str):
  """Prefill + decode loop for one padded batch.

  tokens [B, P] (right-padded), prompt_lens [B], per-request sampling arrays [B], keys [B]
  (typed PRNG keys), stop_ids [B, S] (-1 = none). Returns generated ids [B, N], their
  log-probs [B, N], the number generated per row [B], and the tap buffers with rows
  [B, P + N, ...] indexed by absolute position.
  """
  b, p = tokens.shape
  total = p + max_new
  rows = jnp.arange(b)
  out = model_lib.prefill(params, config, tokens, total, tap_layers=tap_layers,
                          tap_mode=tap_mode, record=True)
  taps = jax.tree.map(lambda a: jnp.zeros((b, total) + a.shape[2:], a.dtype).at[:, :p].set(a),
                      out.taps)
  last = out.logits[rows, prompt_lens - 1].astype(jnp.float32)
  tok, lp = sampling_lib.sample(last, jax.vmap(jax.random.fold_in)(keys, jnp.zeros(b, jnp.int32)),
                                temps, top_ps, top_ks)
  gen = jnp.zeros((b, max_new), jnp.int32).at[:, 0].set(tok)
  logps = jnp.zeros((b, max_new), jnp.float32).at[:, 0].set(lp)
  done = jnp.any(tok[:, None] == stop_ids, axis=-1) | (max_new_each <= 1)
  n_gen = jnp.ones(b, jnp.int32)

  def cond(state):
    step, _, _, _, _, done, _, _ = state
    return (step < max_new) & ~jnp.all(done)

  def body(state):
    step, cache, tok, gen, logps, done, n_gen, taps = state
    pos = prompt_lens + step - 1  # position of `tok`, the token fed in this step
    o = model_lib.decode_step(params, config, cache, tok, pos, tap_layers=tap_layers,
                              tap_mode=tap_mode, record=True)
    live = ~done
    taps = jax.tree.map(
        lambda buf, a: buf.at[rows, pos].set(jnp.where(
            live.reshape((b,) + (1,) * (a.ndim - 2)), a[:, 0], buf[rows, pos])),
        taps, o.taps)
    step_keys = jax.vmap(jax.random.fold_in)(keys, jnp.full(b, step, jnp.int32))
    nxt, lp = sampling_lib.sample(o.logits[:, 0].astype(jnp.float32), step_keys, temps, top_ps,
                                  top_ks)
    nxt = jnp.where(live, nxt, 0)
    gen = gen.at[:, step].set(nxt)
    logps = logps.at[:, step].set(jnp.where(live, lp, 0.0))
    n_gen = n_gen + live.astype(jnp.int32)
    hit = jnp.any(nxt[:, None] == stop_ids, axis=-1)
    done = done | (live & (hit | (step + 1 >= max_new_each)))
    return step + 1, o.cache, nxt, gen, logps, done, n_gen, taps

  state = (jnp.int32(1), out.cache, tok, gen, logps, done, n_gen, taps)
  _, _, _, gen, logps, _, n_gen, taps = jax.lax.while_loop(cond, body, state)
  return gen, logps, n_gen, taps


class InProcessEngine:
  """`RolloutEngine` running the trainer's Flax model in this process.

  config.policy selects the rollout precision. Under `fp4_trace`, guidance of
  `config.guided_layers` (all four sites and routing) is recorded; with a `guidance_writer`
  (`trace_jax.io.guidance_store.GuidanceWriter`) each batch is written asynchronously and every
  Sample carries its handle; without one, the last batch's guidance stays in
  `self.last_guidance` (ragged rows, for notebooks and tests). `min_prompt_len` pads every
  batch's prompts to at least that length (see `prompt_bucket`): a trainer that knows its
  longest prompt passes it and compiles one program for the whole run.
  """

  def __init__(self, params: Any, config: ModelConfig, *, guidance_writer: Any = None,
               record_guidance: bool | None = None, max_batch: int = 64, seed: int = 0,
               min_prompt_len: int = 0):
    if min_prompt_len < 0:
      raise ValueError(f"min_prompt_len must be >= 0, got {min_prompt_len}")
    self.params = params
    self.config = config
    self.writer = guidance_writer
    self.record = (config.policy == "fp4_trace") if record_guidance is None else record_guidance
    self.max_batch = max_batch
    self.min_prompt_len = min_prompt_len
    self._seed_counter = itertools.count((seed * 1_000_003) % _SEED_MOD)
    self._batch_counter = itertools.count(_next_batch_index(guidance_writer))
    self._lock = threading.Lock()
    self.last_guidance: dict[str, Any] | None = None
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
    """New weights from an HF checkpoint directory or a params pytree (same shapes)."""
    if isinstance(path_or_params, (str, os.PathLike)):
      from trace_jax.io import hf
      config, params = hf.load_hf_checkpoint(os.fspath(path_or_params))
      mine = dataclasses_shape(self.config)
      if dataclasses_shape(config) != mine:
        raise ValueError(f"checkpoint shape {dataclasses_shape(config)} does not match the "
                         f"served model {mine}")
    else:
      params = path_or_params
    old = jax.tree.map(lambda a: (a.shape, a.dtype), self.params)
    new = jax.tree.map(lambda a: (a.shape, jnp.asarray(a).dtype), params)
    if jax.tree.structure(old) != jax.tree.structure(new) or jax.tree.leaves(old) != \
        jax.tree.leaves(new):
      raise ValueError("update_weights: new parameters differ in structure, shape or dtype")
    with self._lock:
      self.params = params
      self.weights_version += 1

  def close(self) -> None:
    if self.writer is not None:
      self.writer.flush()

  # ---------------------------------------------------------------------------- internals

  def _generate_batch(self, prompts: list[list[int]],
                      sampling: list[SamplingParams]) -> list[Sample]:
    n = len(prompts)
    b = bucket(n)
    p = prompt_bucket(max(map(len, prompts)), self.min_prompt_len)
    max_new = bucket(max(s.max_new_tokens for s in sampling), _MIN_LEN_BUCKET)
    tokens = np.zeros((b, p), np.int32)
    lens = np.ones(b, np.int32)
    for i, pr in enumerate(prompts):
      tokens[i, :len(pr)] = pr
      lens[i] = len(pr)
    pad = [SamplingParams(max_new_tokens=1)] * (b - n)
    sp = sampling + pad
    seeds = [(s.seed if s.seed is not None else next(self._seed_counter)) % _SEED_MOD
             for s in sp]
    keys = jax.vmap(jax.random.key)(jnp.asarray(seeds, jnp.uint32))
    stop = np.full((b, _MAX_STOP_IDS), -1, np.int32)
    for i, s in enumerate(sp):
      stop[i, :len(s.stop_token_ids)] = s.stop_token_ids
    tap_layers = tuple(self.config.guided_layers) if self.record else ()
    gen, logps, n_gen, taps = _generate(
        self.params, self.config, jnp.asarray(tokens), jnp.asarray(lens),
        jnp.asarray([s.max_new_tokens for s in sp], jnp.int32),
        jnp.asarray([s.temperature for s in sp], jnp.float32),
        jnp.asarray([s.top_p for s in sp], jnp.float32),
        jnp.asarray([s.top_k for s in sp], jnp.int32), keys, jnp.asarray(stop),
        max_new=max_new, tap_layers=tap_layers, tap_mode=self.config.guidance_mode)
    gen, logps, n_gen = np.asarray(gen), np.asarray(logps), np.asarray(n_gen)
    samples = []
    for i in range(n):
      k = int(n_gen[i])
      toks = gen[i, :k].tolist()
      hit = bool(sampling[i].stop_token_ids) and toks[-1] in sampling[i].stop_token_ids
      samples.append(Sample(prompt=prompts[i], tokens=toks, logprobs=logps[i, :k].tolist(),
                            finish_reason="stop" if hit else "length",
                            meta={"weights_version": self.weights_version}))
    if tap_layers:
      self._emit_guidance(samples, taps)
    return samples

  def _emit_guidance(self, samples: list[Sample], taps: dict) -> None:
    """Ragged guidance rows (prompt + completion[:-1] per sample) to the store or memory."""
    counts = [len(s.prompt) + len(s.tokens) - 1 for s in samples]
    idx_b = np.concatenate([np.full(c, i) for i, c in enumerate(counts)])
    idx_t = np.concatenate([np.arange(c) for c in counts])
    taps = jax.device_get(taps)  # one transfer; gathering on the host compiles nothing
    guidance, routing = {}, {}
    for layer, sites in taps.items():
      for site, rec in sites.items():
        rows = jax.tree.map(lambda a: np.asarray(a)[idx_b, idx_t], rec)
        if site == "routing":
          routing[int(layer)] = rows
        else:
          guidance.setdefault(int(layer), {})[site] = rows
    batch_id = f"b{next(self._batch_counter):06d}"
    seq_ids = [f"{batch_id}-{i}" for i in range(len(samples))]
    if self.writer is not None:
      handle = self.writer.write_batch(batch_id, seq_ids, counts, guidance, routing)
      for s, sid in zip(samples, seq_ids):
        s.guidance = {"store": self.writer.root, "batch_id": batch_id, "seq_id": sid,
                      "guidance_bytes_per_token": handle.stats.get("guidance_bytes_per_token")}
    else:
      self.last_guidance = {"batch_id": batch_id, "seq_ids": seq_ids, "token_counts": counts,
                            "guidance": guidance, "routing": routing}
      for s, sid in zip(samples, seq_ids):
        s.guidance = {"store": None, "batch_id": batch_id, "seq_id": sid}


def dataclasses_shape(config: ModelConfig) -> tuple:
  """The fields that fix parameter shapes (policy and dtype may differ between checkpoints)."""
  return (config.vocab_size, config.hidden_size, config.num_hidden_layers,
          config.num_attention_heads, config.num_key_value_heads, config.head_dim,
          config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size)
