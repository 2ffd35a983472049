"""Forward modes (full sequence vs KV-cache decode), MoE and aux loss against numpy float64."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trace_jax import model as M
from trace_jax.model.moe import load_balancing_loss
from trace_jax.model.precision import Precision

CONFIG = M.tiny()
MAX_LEN = 24


def scaled_params(config: M.ModelConfig, seed: int) -> nnx.State:
  """Random params with weights large enough that routing and attention are far from uniform."""
  params = M.init_params(config, seed)
  return jax.tree.map(lambda x: x if x.ndim == 1 else x * 4.0, params)


@pytest.fixture(scope="module")
def params():
  return scaled_params(CONFIG, 0)


@functools.partial(jax.jit, static_argnames="config")
def _decode(params, config, cache, toks, pos):
  out = M.decode_step(params, config, cache, toks, pos)
  return out.logits[:, 0].astype(jnp.float32), out.cache


@functools.partial(jax.jit, static_argnames=("config", "max_len"))
def _prefill(params, config, toks, max_len):
  out = M.prefill(params, config, toks, max_len)
  return out.logits.astype(jnp.float32), out.cache


def rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def test_prefill_then_decode_matches_full_sequence(params):
  """Sequences of different prompt lengths: right-padded prefill, then per-sequence decode."""
  rng = np.random.default_rng(0)
  total = 20
  seqs = rng.integers(0, CONFIG.vocab_size, (2, total), np.int32)
  full = np.asarray(M.logits(params, CONFIG, seqs))
  prompt_len = np.array([5, 9])
  prompts = np.where(np.arange(9)[None] < prompt_len[:, None], seqs[:, :9], 0)
  pre_logits, cache = _prefill(params, CONFIG, prompts, MAX_LEN)
  for b in range(2):
    n = prompt_len[b]
    assert rel(pre_logits[b, :n], full[b, :n]) < 1e-5
  pos = prompt_len.copy()
  errs = []
  while pos.max() < total:
    step_pos = np.minimum(pos, total - 1)
    logits, cache = _decode(params, CONFIG, cache, seqs[np.arange(2), step_pos], step_pos)
    for b in range(2):
      if pos[b] < total:
        errs.append(rel(logits[b], full[b, pos[b]]))
    pos = pos + 1
  print(f"decode vs full-sequence max relative error: {max(errs):.2e} over {len(errs)} steps")
  assert max(errs) < 1e-5


def _moe_reference(x, router, gate, up, down, k, norm):
  """float64 numpy MoE: per token, softmax router, top-k, SwiGLU experts, weighted sum."""
  x, router, gate, up, down = (np.asarray(a, np.float64) for a in (x, router, gate, up, down))
  logits = x @ router.T
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  out = np.zeros_like(x)
  for t in range(x.shape[0]):
    top = np.argsort(-p[t])[:k]
    w = p[t, top] / (p[t, top].sum() if norm else 1.0)
    for e, wi in zip(top, w):
      g, u = gate[e] @ x[t], up[e] @ x[t]
      out[t] += wi * (down[e] @ (g / (1 + np.exp(-g)) * u))
  return out, logits


@pytest.mark.parametrize("moe_impl", M.MOE_IMPLS)
@pytest.mark.parametrize("norm_topk_prob", [pytest.param(True, id="norm_topk"),
                                            pytest.param(False, id="raw_topk")])
def test_moe_matches_numpy(norm_topk_prob, moe_impl):
  if moe_impl == "mgpu":
    pytest.skip("moe_impl='mgpu' runs bf16 on a Hopper GPU only (its lowering: "
                "tests/kernels/test_mosaic_lowering.py)")
  config = CONFIG.replace(norm_topk_prob=norm_topk_prob, moe_impl=moe_impl)
  model = nnx.merge(M.graphdef(config), scaled_params(config, 1))
  moe = model.layers[0].moe
  x = jax.random.normal(jax.random.key(2), (3, 7, config.hidden_size), jnp.float32)
  out, router_logits = moe(x, Precision(config), 0)
  ref, ref_logits = _moe_reference(x.reshape(-1, config.hidden_size), moe.router.kernel[...],
                                   moe.gate_proj[...], moe.up_proj[...], moe.down_proj[...],
                                   config.num_experts_per_tok, norm_topk_prob)
  np.testing.assert_allclose(router_logits, ref_logits, rtol=1e-5, atol=1e-6)
  assert rel(out.reshape(ref.shape), ref) < 1e-5


def test_moe_routing_replay():
  """Replaying the router's own choice changes nothing; replaying others changes the output."""
  model = nnx.merge(M.graphdef(CONFIG), scaled_params(CONFIG, 1))
  moe = model.layers[0].moe
  x = jax.random.normal(jax.random.key(3), (2, 5, CONFIG.hidden_size), jnp.float32)
  prec = Precision(CONFIG, tap_layers=(0,))
  out, _ = moe(x, prec, 0)
  ids = prec.taps[0]["routing"]
  assert ids.shape == (2, 5, CONFIG.num_experts_per_tok) and ids.dtype == jnp.int32
  same, _ = moe(x, Precision(CONFIG), 0, ids, replay=True)
  np.testing.assert_array_equal(same, out)
  other, _ = moe(x, Precision(CONFIG), 0, (ids + 1) % CONFIG.num_experts, replay=True)
  assert not np.allclose(other, out)


def test_aux_loss_matches_numpy():
  rng = np.random.default_rng(0)
  e, k = 8, 2
  layers = [rng.normal(size=(12, e)).astype(np.float32) for _ in range(3)]
  mask = (rng.random(12) > 0.3).astype(np.float32)
  for m in (None, mask):
    w = np.ones(12) if m is None else m.astype(np.float64)
    counts, probs, rows = np.zeros(e), np.zeros(e), 0.0
    for lg in layers:
      p = np.exp(lg - lg.max(-1, keepdims=True))
      p /= p.sum(-1, keepdims=True)
      top = np.argsort(-p, axis=-1)[:, :k]
      for t in range(12):
        counts[top[t]] += w[t]
      probs += (p * w[:, None]).sum(0)
      rows += w.sum()
    ref = e * np.sum((counts / rows) * (probs / rows))
    got = load_balancing_loss([jnp.asarray(lg) for lg in layers], e, k,
                              None if m is None else jnp.asarray(m))
    np.testing.assert_allclose(float(got), ref, rtol=1e-5)


def test_bf16_compute_from_f32_params(params):
  """config.dtype selects the compute dtype independently of the stored params' dtype."""
  toks = np.random.default_rng(5).integers(0, CONFIG.vocab_size, (2, 8), np.int32)
  f32 = np.asarray(M.logits(params, CONFIG, toks))
  bf16 = np.asarray(M.logits(params, CONFIG.replace(dtype="bfloat16"), toks))
  assert bf16.dtype == np.float32
  assert 1e-4 < rel(bf16, f32) < 5e-2  # bf16 rounding, but the same function


def test_logits_fp32_rounds_the_lm_head_output_no_more(params):
  """logits_fp32 under bf16 compute: the LM head's output keeps float32 digits (values no
  bf16 holds) and rounds to the bf16 head's output; the layers below are unchanged (the bf16
  head's logits are its float32 logits rounded, for nearly every element)."""
  toks = np.random.default_rng(6).integers(0, CONFIG.vocab_size, (2, 8), np.int32)
  bf16 = CONFIG.replace(dtype="bfloat16")
  plain = np.asarray(M.logits(params, bf16, toks))
  wide = np.asarray(M.logits(params, bf16.replace(logits_fp32=True), toks))
  as_bf16 = lambda a: np.asarray(jnp.asarray(a).astype(jnp.bfloat16).astype(jnp.float32))
  assert np.mean(as_bf16(wide) != wide) > 0.9  # float32 digits below bf16's precision
  assert np.all(as_bf16(plain) == plain)  # the plain head's output is bf16-rounded
  assert np.mean(as_bf16(wide) == plain) > 0.95
  assert rel(wide, plain) < 1e-2
  f32 = CONFIG.replace(logits_fp32=True)  # float32 compute: the same function either way
  np.testing.assert_allclose(np.asarray(M.logits(params, f32, toks)),
                             np.asarray(M.logits(params, CONFIG, toks)), rtol=1e-5, atol=1e-5)
