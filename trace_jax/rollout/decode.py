"""The rollout engine's jitted programs: prefill + decode loop, and multi-turn session turns.

Each program runs entirely on the device (`lax.while_loop` over decode steps; nothing returns
to the host per token) and keeps the records the engine asked for (taps of the chosen layers
and routing): row t of a sequence's record is what the rollout computed when it fed token t,
prompt + completion[:-1] for one call, the whole transcript for a session. Each decode step's
records go to one byte row per sequence (`byte_rows`). No program keeps buffers of a
sequence's whole length: `generate` returns the prefill's records and the step rows as they
are (`ragged_records` lays them out for the engine); a session turn returns the rows of the
chunk it fed and of its decode steps, which the engine moves to the host as the turn ends
(`turn_records`), so a session holds its KV cache on the device and its records on the host.

- `generate`: a padded batch of prompts -> completions (prefill, then decode).
- `extend`: a session turn: feed each row's new tokens (the previous turn's last sampled token,
  then e.g. an environment's observation) through the model in decode mode on top of the KV
  cache the session keeps, then decode a continuation.
- `feed`: a session's last tokens, recorded without sampling.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from trace_jax import model as model_lib
from trace_jax.guidance import byte_rows
from trace_jax.guidance import layout as guidance_layout
from trace_jax.model.config import ModelConfig
from trace_jax.rollout import sampling as sampling_lib

_STATIC = ("config", "max_new", "truncate", "tap_layers", "tap_mode", "tap_routing", "plan")


def step_rows(config: ModelConfig, max_new: int) -> int:
  """Byte rows per sequence of the decode loop's step records for max_new tokens (steps past
  max_new in the last block of `decode_steps_per_sync` land in the spare ones)."""
  return max_new + config.decode_steps_per_sync - 1


def _sample_and_decode(params, config: ModelConfig, cache, layout, last_logits, start,
                       max_new_each, temps, top_ps, top_ks, keys, stop_ids, live0, *,
                       max_new: int, truncate: bool, tap_layers: tuple[int, ...], tap_mode: str,
                       tap_routing: bool, experts=None, layers=None, plan=None):
  """Samples a first token from last_logits [B, V], then decodes up to max_new tokens.

  start [B]: the position the first sampled token will be fed at. live0 [B]: rows that sample
  at all. truncate: some row has a top-k / top-p (`sampling.sample`). layout: the
  `byte_rows.Layout` of one position's records (None: nothing recorded). Returns (ids [B, N],
  log-probs [B, N], number generated [B], cache, steps): steps uint8 [B, step_rows, width],
  column s the records of step s (1 <= s < number generated: the token fed at start + s - 1),
  or None; the last generated token of a row is not fed.
  """
  b = last_logits.shape[0]
  fixed = (model_lib.resolve_plan(config) if plan is None else plan).invariant
  tok, lp = sampling_lib.sample(last_logits.astype(jnp.float32),
                                jax.vmap(jax.random.fold_in)(keys, jnp.zeros(b, jnp.int32)),
                                temps, top_ps, top_ks, truncate=truncate, fixed_order=fixed)
  gen = jnp.zeros((b, max_new), jnp.int32).at[:, 0].set(tok)
  logps = jnp.zeros((b, max_new), jnp.float32).at[:, 0].set(lp)
  done = ~live0 | jnp.any(tok[:, None] == stop_ids, axis=-1) | (max_new_each <= 1)
  n_gen = live0.astype(jnp.int32)

  def cond(state):
    step, _, _, _, _, done, _, _ = state
    return (step < max_new) & ~jnp.all(done)

  # A step's records go to one byte row per sequence, at column `step` of `steps` (one
  # update per step, whatever the number of tapped arrays; `byte_rows`: one kernel per record
  # and step cost the host more than the GPU's work).
  # The loop checks `cond` once per `per_sync` steps (`ModelConfig.decode_steps_per_sync`):
  # steps past max_new then run with no live row, their writes past the buffers' ends dropped
  # (scatters) or kept to the spare columns of `steps` (its dynamic_update_slice clamps).
  per_sync = config.decode_steps_per_sync
  steps = None if layout is None else jnp.zeros((b, step_rows(config, max_new), layout.width),
                                                jnp.uint8)

  def body(state):
    step, cache, tok, gen, logps, done, n_gen, steps = state
    if per_sync > 1:  # a block's steps past max_new (one step per check never gets there)
      done = done | (step >= max_new)
    pos = start + step - 1  # position of `tok`, the token fed in this step
    o = model_lib.decode_step(params, config, cache, tok, pos, tap_layers=tap_layers,
                              tap_mode=tap_mode, tap_routing=tap_routing, record=True,
                              experts=experts, layers=layers, plan=plan)
    live = ~done
    if steps is not None:  # the scans' byte rows as they are (unpacking them is dead code)
      row = model_lib.rows_of_layers(o.tap_rows)
      if row.shape[-1] != layout.width:
        raise AssertionError(f"decode: tap rows of {row.shape[-1]} bytes, the taps' layout "
                             f"has {layout.width}")
      steps = jax.lax.dynamic_update_slice_in_dim(steps, row, step, axis=1)
    step_keys = jax.vmap(jax.random.fold_in)(keys, jnp.full(b, step, jnp.int32))
    nxt, lp = sampling_lib.sample(o.logits[:, 0].astype(jnp.float32), step_keys, temps, top_ps,
                                  top_ks, truncate=truncate, fixed_order=fixed)
    nxt = jnp.where(live, nxt, 0)
    gen = gen.at[:, step].set(nxt)
    logps = logps.at[:, step].set(jnp.where(live, lp, 0.0))
    n_gen = n_gen + live.astype(jnp.int32)
    hit = jnp.any(nxt[:, None] == stop_ids, axis=-1)
    done = done | (live & (hit | (step + 1 >= max_new_each)))
    return step + 1, o.cache, nxt, gen, logps, done, n_gen, steps

  state = (jnp.int32(1), cache, tok, gen, logps, done, n_gen, steps)
  if per_sync > 1:  # a loop of known trip count: XLA runs it without asking the host
    block = lambda state: jax.lax.fori_loop(0, per_sync, lambda _, st: body(st), state)
  else:
    block = body
  _, cache, _, gen, logps, _, n_gen, steps = jax.lax.while_loop(cond, block, state)
  return gen, logps, n_gen, cache, steps


def _layout(taps) -> byte_rows.Layout | None:
  """The byte-row layout of one position of record buffers [B, S, ...] (None: no records)."""
  return byte_rows.layout_of(jax.tree.map(lambda a: a[:, :1], taps), lead=2) if taps else None


@functools.partial(jax.jit, static_argnames=_STATIC)
def generate(params, config: ModelConfig, tokens, prompt_lens, max_new_each, temps, top_ps,
             top_ks, keys, stop_ids, *, max_new: int, truncate: bool,
             tap_layers: tuple[int, ...], tap_mode: str, tap_routing: bool, experts=None,
             layers=None, plan=None):
  """Prefill + decode loop for one padded batch.

  tokens [B, P] (right-padded), prompt_lens [B], per-request sampling arrays [B], keys [B]
  (typed PRNG keys), stop_ids [B, S] (-1 = none); truncate: whether any row is
  `sampling.truncating` (static: one program per value); experts: the engine's per-run
  `expert_weights.ExpertWeights`, or None (the params' experts); layers: the layers' params
  stacked per run (`model.stack_layers`), or None (params["layers"]); plan: the engine's
  `KernelPlan` (None: the config's, resolved as the program is traced). Returns generated ids
  [B, N], their log-probs [B, N], the number generated per row [B], and the records as
  (prompt, steps): the prefill's taps [B, P, ...] by position and the decode loop's step rows
  (`_sample_and_decode`; None when nothing is recorded), laid out by `ragged_records`.
  """
  b, p = tokens.shape
  total = p + max_new
  out = model_lib.prefill(params, config, tokens, total, tap_layers=tap_layers,
                          tap_mode=tap_mode, tap_routing=tap_routing, record=True,
                          experts=experts, layers=layers, plan=plan)
  last = out.logits[jnp.arange(b), prompt_lens - 1]
  gen, logps, n_gen, _, steps = _sample_and_decode(
      params, config, out.cache, _layout(out.taps), last, prompt_lens, max_new_each, temps,
      top_ps, top_ks, keys, stop_ids, jnp.ones(b, bool), max_new=max_new, truncate=truncate,
      tap_layers=tap_layers, tap_mode=tap_mode, tap_routing=tap_routing, experts=experts,
      layers=layers, plan=plan)
  return gen, logps, n_gen, (out.taps, steps)


@functools.partial(jax.jit, static_argnames=("total",))
def ragged_records(prompt, steps, prompt_lens, counts, *, total: int):
  """`generate`'s records (prompt, steps) as `guidance_layout.ragged_rows` lays out records
  by position [B, total, ...]: leaves [B * total, ...] whose first sum(counts) rows are
  sequence 0's first counts[0] rows, then sequence 1's, ... (the rows after them: padding).
  Row t of sequence i is its prefill's row t for t < prompt_lens[i], else the step row
  t - prompt_lens[i] + 1, byte for byte. counts: int32 [B] (0 for unused rows)."""
  b, p = jax.tree.leaves(prompt)[0].shape[:2]
  # The sequence and position of each ragged row, in `ragged_rows`' own order.
  seq, pos = guidance_layout.ragged_rows(
      (jnp.broadcast_to(jnp.arange(b)[:, None], (b, total)),
       jnp.broadcast_to(jnp.arange(total)[None, :], (b, total))), counts)
  prompt_rows, layout = byte_rows.pack(prompt, 2)
  plen = prompt_lens[seq]
  col = jnp.clip(pos - plen + 1, 0, steps.shape[1] - 1)
  rows = jnp.where((pos < plen)[:, None], prompt_rows[seq, jnp.minimum(pos, p - 1)],
                   steps[seq, col])
  return byte_rows.unpack(rows, layout)


def _feed(params, config: ModelConfig, cache, lens, chunk, chunk_lens, *,
          tap_layers: tuple[int, ...], tap_mode: str, tap_routing: bool, experts=None, layers=None,
          plan=None):
  """Feeds chunk [B, C] (row r: its first chunk_lens[r] tokens) at positions lens[r]...

  Decode-mode attention over the cache: each new token sees the session's earlier tokens and
  the chunk's tokens before it. Padding entries write K/V past the row's end, where the next
  feed or decode step overwrites them before anything attends to them. Returns (logits of
  each row's last fed token [B, V], cache, the chunk's taps [B, C, ...]: row r's first
  chunk_lens[r] are its records, the rest padding).
  """
  b, c = chunk.shape
  pos = lens[:, None] + jnp.arange(c)[None, :]
  out = model_lib.forward(params, config, chunk, pos, cache=cache, decode=True,
                          tap_layers=tap_layers, tap_mode=tap_mode, tap_routing=tap_routing,
                          record=True, experts=experts, layers=layers, plan=plan)
  last = out.logits[jnp.arange(b), jnp.maximum(chunk_lens - 1, 0)]
  return last, out.cache, out.taps


def _chunk_rows(taps):
  """A chunk's taps [B, C, ...] as byte rows uint8 [B, C, W] (None: nothing recorded)."""
  return byte_rows.pack(taps, 2)[0] if taps else None


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("cache",))
def extend(params, config: ModelConfig, cache, lens, chunk, chunk_lens, max_new_each, temps,
           top_ps, top_ks, keys, stop_ids, *, max_new: int, truncate: bool,
           tap_layers: tuple[int, ...], tap_mode: str, tap_routing: bool, experts=None,
           layers=None, plan=None):
  """One session turn: `_feed` the chunk, then sample and decode (rows with chunk_lens 0 sit
  the turn out). Returns (ids [B, N], log-probs [B, N], number generated [B], cache, records):
  records (chunk rows [B, C, W], step rows [B, step_rows, W]) in the layout of
  `record_layout` (`turn_records.Turn`), or None when nothing is recorded."""
  tap = dict(tap_layers=tap_layers, tap_mode=tap_mode, tap_routing=tap_routing,
             experts=experts, layers=layers, plan=plan)
  last, cache, taps = _feed(params, config, cache, lens, chunk, chunk_lens, **tap)
  start, live0 = lens + chunk_lens, chunk_lens > 0
  gen, logps, n_gen, cache, steps = _sample_and_decode(
      params, config, cache, _layout(taps), last, start, max_new_each, temps, top_ps, top_ks,
      keys, stop_ids, live0, max_new=max_new, truncate=truncate, **tap)
  records = (_chunk_rows(taps), steps) if taps else None
  return gen, logps, n_gen, cache, records


FEED_STATIC = ("config", "tap_layers", "tap_mode", "tap_routing", "plan")


@functools.partial(jax.jit, static_argnames=FEED_STATIC, donate_argnames=("cache",))
def feed(params, config: ModelConfig, cache, lens, chunk, chunk_lens, *,
         tap_layers: tuple[int, ...], tap_mode: str, tap_routing: bool, experts=None, layers=None,
         plan=None):
  """A session's closing tokens, recorded without sampling. Returns (cache, the chunk's record
  rows uint8 [B, C, W] or None)."""
  _, cache, taps = _feed(params, config, cache, lens, chunk, chunk_lens,
                         tap_layers=tap_layers, tap_mode=tap_mode, tap_routing=tap_routing,
                         experts=experts, layers=layers, plan=plan)
  return cache, _chunk_rows(taps)


def record_layout(params, config: ModelConfig, *, tap_layers: tuple[int, ...], tap_mode: str,
                  tap_routing: bool, experts=None, layers=None,
                  plan=None) -> byte_rows.Layout | None:
  """The byte-row layout of one position's records, as a decode step taps them (shapes only;
  None when nothing is recorded)."""
  if not (tap_layers or tap_routing):
    return None
  cache = model_lib.init_cache(config, 1, 1, plan=plan)
  taps = jax.eval_shape(lambda p, c, e, s: model_lib.decode_step(
      p, config, c, jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32),
      tap_layers=tap_layers, tap_mode=tap_mode, tap_routing=tap_routing, record=True,
      experts=e, layers=s, plan=plan).taps, params, cache, experts, layers)
  return byte_rows.layout_of(taps, lead=2)
