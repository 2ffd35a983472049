"""Byte accounting of the rollout benchmark (`experiments.bench.rollout`): the bytes of each
part of the model as the rollout engine stores it, a decode step's minimum reads, and how many
sequences fit a fixed memory budget next to the weights (KV cache and the engine's records per
sequence)."""

from __future__ import annotations

import math
from typing import Any

FP8_BYTES = 1 + 4 / 128**2  # E4M3 byte + a float32 scale per 128 x 128 block


def byte_layout(config: Any) -> dict[str, float]:
  """Bytes of each part of the model as the rollout engine stores it (the one place the formats'
  sizes are written down; `weight_bytes` and `step_bytes` sum them).

  decode_impl "kernel": the prepared weights (`expert_weights.prepare`; the params' copies are
  dropped): routed experts as packed NVFP4 under FP4 forwards (0.5 byte a value + an E4M3 scale
  per 16 + one float32 scale per expert for gate/up and one for down), E4M3 + block scales
  under FP8 linears (the attention projections too), else the compute dtype. "xla": the params
  in the compute dtype (FP4 and FP8 are computed from them at every step). Embeddings, lm_head,
  norms and router always in the compute dtype; the KV cache too, but packed NVFP4 (codes,
  E4M3 block scales, a float32 row scale: 76 bytes per head row of 128 against 256) where
  the config's plan says `kv_cache="packed"` (NVFP4 forwards with decode_impl "kernel"). Keys:
  expert (one routed expert), attention (one layer's q, k, v, o), layer_rest (one layer's norms
  and router), embed, lm_head, final_norm, kv_token (one token's K and V in one layer).
  """
  import jax.numpy as jnp

  from trace_jax.kernels import kv_cache
  from trace_jax.model import plan as plan_lib

  c, fwd = config, config.forward
  plan = plan_lib.resolve(c)
  item = jnp.dtype(c.dtype).itemsize
  d, f, h, e = c.hidden_size, c.moe_intermediate_size, c.head_dim, c.num_experts
  kernel = plan.decode_impl == "kernel"
  if kernel and fwd.fp4 == "nvfp4":
    expert = 3 * f * d * (0.5 + 1 / 16) + 2 * 4
  elif kernel and fwd.fp8_linears:
    expert = 3 * f * d * FP8_BYTES
  else:
    expert = 3 * f * d * item
  nq, nkv = c.num_attention_heads * h, c.num_key_value_heads * h
  attn = (2 * nq * d + 2 * nkv * d) * (FP8_BYTES if kernel and fwd.fp8_linears else item)
  if plan.kv_cache == "packed":  # codes, block scales and a row scale per (token, kv head)
    kv_token = 2 * c.num_key_value_heads * kv_cache.bytes_per_head_row(h)
  else:
    kv_token = 2 * nkv * item
  return {"expert": expert, "attention": attn, "layer_rest": (2 * d + 2 * h + e * d) * item,
          "embed": c.vocab_size * d * item, "lm_head": c.vocab_size * d * item,
          "final_norm": d * item, "kv_token": kv_token}


def weight_bytes(config: Any) -> float:
  """Bytes of every weight as the engine stores them (`byte_layout`)."""
  b = byte_layout(config)
  per_layer = config.num_experts * b["expert"] + b["attention"] + b["layer_rest"]
  return config.num_hidden_layers * per_layer + b["embed"] + b["lm_head"] + b["final_norm"]


def kv_bytes_per_token(config: Any) -> float:
  """Bytes of one token's KV cache over all layers."""
  return config.num_hidden_layers * byte_layout(config)["kv_token"]


def step_bytes(config: Any, batch: int, context: float, touched: float) -> float:
  """Bytes one decode step must read at least: `touched` experts per layer, every layer's
  attention projections, norms and router, lm_head, `batch` embedding rows, and the KV cache at
  `context` tokens per sequence, each as the engine stores it (`byte_layout`)."""
  b = byte_layout(config)
  per_layer = (touched * b["expert"] + b["attention"] + b["layer_rest"]
               + batch * context * b["kv_token"])
  return (config.num_hidden_layers * per_layer + b["lm_head"] + b["final_norm"]
          + batch * b["embed"] / config.vocab_size)


def expected_touched(num_experts: int, top_k: int, batch: int) -> float:
  """Mean experts touched per layer by `batch` tokens routed uniformly at random."""
  return num_experts * (1 - (1 - top_k / num_experts) ** batch)


def fit_sequences(budget_bytes: float, weights: float, per_sequence: float) -> tuple[int, str]:
  """(How many sequences of `per_sequence` bytes fit next to `weights` in `budget_bytes`, and
  why none does when 0)."""
  if per_sequence <= 0:
    raise ValueError(f"per-sequence bytes must be > 0, got {per_sequence}")
  if budget_bytes < weights:
    return 0, (f"the budget {budget_bytes / 1e9:.4g} GB does not hold the weights "
               f"({weights / 1e9:.4g} GB)")
  n = int(math.floor((budget_bytes - weights) / per_sequence))
  if n == 0:
    return 0, (f"the budget {budget_bytes / 1e9:.4g} GB holds the weights ({weights / 1e9:.4g} "
               f"GB) but not one sequence ({per_sequence / 1e9:.4g} GB)")
  return n, ""


def record_row_bytes(engine: Any) -> float:
  """Bytes of one token's records as the engine holds them (a byte row of its programs'
  records; 0 when it records nothing)."""
  layout = engine.record_layout()
  return 0.0 if layout is None else float(layout.width)


def decode_record_rows(engine: Any, new_tokens: int) -> int:
  """Byte rows per sequence the decode loop of a turn of `new_tokens` tokens holds
  (`decode.step_rows` at the engine's bucket of new tokens; 0 for no turn)."""
  from trace_jax.rollout import decode
  from trace_jax.rollout import engine as engine_lib

  if new_tokens <= 0:
    return 0
  return decode.step_rows(engine.config, engine_lib.new_tokens_bucket(new_tokens))


def record_bytes_per_seq(engine: Any, new_tokens: int, chunk: int = 1) -> tuple[float, float]:
  """(Bytes of the records the engine holds on the device for a sequence while a session turn
  feeds `chunk` tokens and decodes `new_tokens`, the decode loop's share of them): the chunk's
  rows and the loop's step rows (`decode_record_rows`), live until the turn ends and its
  records go to the host (`rollout.turn_records`). The session's earlier records are on the
  host, so they do not depend on the context."""
  row = record_row_bytes(engine)
  steps = row * decode_record_rows(engine, new_tokens)
  return row * chunk + steps, steps


def budget_plan(engine: Any, budget_bytes: float, context: int,
                new_tokens: int = 0) -> dict[str, Any]:
  """How many sequences of `context` tokens fit in `budget_bytes` next to the weights `engine`
  holds: each costs its KV cache and the records of a session turn that feeds its pending
  token and decodes `new_tokens` tokens (`record_bytes_per_seq`; 0: the pending token's
  alone). `host_record_bytes_per_seq`: the session's records of `context` tokens, kept in host
  memory. `skipped` says why none."""
  weights = weight_bytes(engine.config)
  kv = context * kv_bytes_per_token(engine.config)
  rec, decode_rec = record_bytes_per_seq(engine, new_tokens)
  fits, why = fit_sequences(budget_bytes, weights, kv + rec)
  r = {"weight_bytes": weights, "kv_bytes_per_seq": kv, "record_bytes_per_seq": rec,
       "decode_record_bytes_per_seq": decode_rec,
       "host_record_bytes_per_seq": context * record_row_bytes(engine), "sequences": fits}
  if not fits:
    r["skipped"] = why
  return r
