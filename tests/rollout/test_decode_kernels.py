"""The engine's decode through the Pallas kernels (`ModelConfig.decode_impl="kernel"`, Pallas
interpreter on CPU) against the reference decode (fake-quantized weights, XLA matmuls)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import count_eqns

from trace_jax import model as M
from trace_jax.kernels import kv_cache
from trace_jax.model import expert_weights
from trace_jax.quant import qat
from trace_jax.rollout import engine as engine_lib
from trace_jax.rollout.engine import InProcessEngine
from trace_jax.rollout.protocol import SamplingParams

NEW = 32


def _engines(policy: str):
  config = M.tiny(policy=policy, dtype="bfloat16", num_hidden_layers=2, vocab_size=128)
  params = jax.tree.map(lambda a: a if a.ndim == 1 else a * 4.0, M.init_params(config, 3))
  return params, [InProcessEngine(params, config.replace(decode_impl=impl), audit_fraction=1.0,
                                  record_routing=True, max_batch=2) for impl in ("xla", "kernel")]


@pytest.mark.parametrize("policy", ["bf16", "fp4_trace"])
def test_kernel_decode_matches_the_reference(policy):
  """Greedy: the same 32 tokens per prompt, log-probs within BF16 matmul rounding, and (FP4)
  the records' codes of the decode steps equal but for values at a rounding boundary."""
  params, (ref, fast) = _engines(policy)
  # Both hold the layers stacked per run (their params' layer arrays empty); the kernel engine
  # keeps one copy of the experts: the prepared ones.
  assert ref.params["layers"][0]["moe"]["gate_proj"][...].size == 0
  full = params["layers"][0]["moe"]["gate_proj"][...].shape
  assert ref.layers[0]["moe"]["gate_proj"][...].shape[1:] == full
  assert fast.layers[0]["moe"]["gate_proj"][...].size == 0
  prompts = np.random.default_rng(0).integers(1, 128, (2, 9)).tolist()
  sp = SamplingParams(max_new_tokens=NEW, temperature=0.0)
  a = ref.generate(prompts, sp)
  fast.update_weights(params)  # the shape check sees the full params, not the dropped ones
  b = fast.generate(prompts, sp)
  for x, y in zip(a, b):
    assert x.tokens == y.tokens and len(x.tokens) == NEW
    np.testing.assert_allclose(x.logprobs, y.logprobs, atol=2e-2)
  if policy == "fp4_trace":
    ra, rb = ref.last_guidance["audit"]["guidance"], fast.last_guidance["audit"]["guidance"]
    for layer, sites in ra.items():
      for site, g in sites.items():
        same = np.mean(np.asarray(g.codes) == np.asarray(rb[layer][site].codes))
        assert same > 0.99, (layer, site, same)


@pytest.mark.parametrize("words", [False, True], ids=["bytes", "words"])
def test_packed_experts_are_the_fake_quantized_weights(words):
  """The engine's packed experts dequantize to the fake-quantized weights, with the codes as
  bytes (CPU default) or as words per block (the GPU's layout; the plan's `fp4_codes`)."""
  config = M.tiny(policy="fp4_rtn", dtype="bfloat16", num_hidden_layers=1,
                  fp4_codes="words" if words else "bytes")
  params = M.init_params(config, 0)
  (run,) = jax.jit(lambda p: expert_weights.prepare(p, config))(params)
  ew = jax.tree.map(lambda a: a[0], run)  # the run's one layer
  assert ew.packed and ew.gate_up.words == words and ew.down.words == words
  moe = params["layers"][0]["moe"]
  gate, up, down = (moe[n][...].astype("bfloat16") for n in ("gate_proj", "up_proj",
                                                              "down_proj"))
  fake_quant = jax.jit(qat.fake_quant_weight, static_argnums=1)
  dense = jax.jit(expert_weights.dense, static_argnums=1)
  gu = fake_quant(np.concatenate([gate, up], axis=1), "nvfp4")
  np.testing.assert_array_equal(np.asarray(dense(ew.gate_up, "bfloat16")), np.asarray(gu))
  np.testing.assert_array_equal(np.asarray(dense(ew.down, "bfloat16")),
                                np.asarray(fake_quant(down, "nvfp4")))


@pytest.mark.parametrize("policy,scan,programs", [
    pytest.param("fp4_trace", True, 2, id="fp4_trace_runs_of_2_and_3"),
    pytest.param("fp8_unified", True, 1, id="fp8_one_run"),
    pytest.param("bf16", False, 1, id="bf16_five_runs_of_1"),
])
def test_engine_prepares_one_layer_at_a_time_with_one_program(policy, scan, programs):
  """The engine writes its prepared weights layer by layer (`expert_weights.write_layer`): one
  program per run length, not one whose size grows with the depth; the runs equal
  `expert_weights.prepare`'s bit for bit, and `update_weights` rewrites them."""
  extra = dict(moe_intermediate_size=128, head_dim=64) if policy == "fp8_unified" else {}
  config = M.tiny(policy=policy, dtype="bfloat16", num_hidden_layers=5, vocab_size=128,
                  decode_impl="kernel", scan_layers=scan, **extra)
  prepare = jax.jit(expert_weights.prepare, static_argnums=1)
  write = engine_lib._write_layer
  write.clear_cache()
  params = M.init_params(config, 0)
  engine = InProcessEngine(params, config, max_batch=2)
  assert write._cache_size() == programs
  assert len(engine.experts) == len(M.layer_runs(config))
  equal = lambda a, b: jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, a),
                                    jax.tree.map(np.asarray, b))
  equal(engine.experts, prepare(params, config))
  new = M.init_params(config, 1)
  engine.update_weights(new)
  assert write._cache_size() == programs
  equal(engine.experts, prepare(new, config))
  with pytest.raises(AssertionError):  # the comparison sees other weights
    equal(engine.experts, prepare(params, config))


def test_unsupported_forwards_are_refused():
  config = M.tiny(policy="mxfp4_trace", decode_impl="kernel")
  with pytest.raises(ValueError, match="runs BF16, NVFP4 and FP8 weights"):
    InProcessEngine(M.init_params(config, 0), config)


@pytest.mark.parametrize("attention, kv_write, calls", [
    ("triton", "xla", 7), ("fused", "xla", 6), ("triton", "kernel", 8)],
    ids=["triton", "fused_attention", "kv_append"])
def test_decode_steps_run_the_kernel_and_prefill_does_not(attention, kv_write, calls):
  config = M.tiny(policy="fp4_rtn", dtype="bfloat16", num_hidden_layers=1,
                  decode_impl="kernel", decode_attention=attention, kv_write=kv_write)
  params = M.init_params(config, 0)
  experts = expert_weights.prepare(params, config)
  cache = M.init_cache(config, 2, 8)
  step = jax.make_jaxpr(lambda p, e, c: M.decode_step(
      p, config, c, np.zeros(2, np.int32), np.zeros(2, np.int32), experts=e).logits)(
          params, experts, cache)
  prefill = jax.make_jaxpr(lambda p, e: M.prefill(p, config, np.zeros((2, 4), np.int32), 8,
                                                  experts=e).logits)(params, experts)
  # q, k and v as one call, o, attention (scores and PV, or the one fused kernel), the experts'
  # gate/up and down of the one layer, and lm_head (and the k/v sites' write into the packed
  # cache, `kv_append`); none in prefill.
  assert count_eqns(step.jaxpr, "pallas_call") == calls
  assert count_eqns(prefill.jaxpr, "pallas_call") == 0


def test_fused_attention_decode_step_logits():
  """Three decode steps of the BF16 policy through the kernel decode, the plan's
  decode_attention "fused" against "triton" (`attend`'s probabilities), fed the same tokens
  (the second sequence starts at position 2 over two unwritten rows): layer 0's cache is the
  same bit for bit (attention does not write it), and the logits agree within BF16 rounding.
  (Under an FP4 policy an output one BF16 ulp off may round to the neighbouring FP4 code at
  the next site, so logits there differ by more: the kernel tests hold the packed cache's
  numerics, tests/kernels/test_flash_decode.py.)"""
  config = M.tiny(policy="bf16", dtype="bfloat16", num_hidden_layers=2, vocab_size=128,
                  decode_impl="kernel")
  params = jax.tree.map(lambda a: a if a.ndim == 1 else a * 4.0, M.init_params(config, 3))
  outs = []
  for attention in ("triton", "fused"):
    cfg = config.replace(decode_attention=attention)
    step = jax.jit(lambda p, c, t, pos, cfg=cfg: M.decode_step(p, cfg, c, t, pos))
    cache, logits = M.init_cache(cfg, 2, 16), []
    for i, tok in enumerate(([5, 9], [7, 1], [3, 3])):
      out = step(params, cache, np.array(tok, np.int32), np.array([i, i + 2], np.int32))
      cache, logits = out.cache, logits + [np.asarray(out.logits, np.float32)]
    outs.append((cache, logits))
  (ca, la), (cb, lb) = outs
  for a, b in zip(jax.tree.leaves(ca), jax.tree.leaves(cb)):  # the run's stack [L, ...]
    np.testing.assert_array_equal(np.asarray(a)[0], np.asarray(b)[0])
  for x, y in zip(la, lb):
    np.testing.assert_allclose(x, y, atol=0.05 * np.max(np.abs(x)), rtol=0)


def test_fp8_kernel_rollout_matches_the_reference():
  """fp8_unified rollout with the FP8 GEMM kernel (`fp8_gemm="kernel"`) against its float32
  reference ("xla"): the same greedy tokens for at least 16 steps and close log-probs; with
  the weights quantized once (`decode_impl="kernel"`, `expert_weights.prepare`) the same
  tokens and log-probs as quantizing them in every step, exactly (the same GEMMs). Looser than BF16
  rounding: the two sum in different orders, and an output one BF16 ulp apart can round to the
  neighbouring E4M3 code when the next layer quantizes it (1/16 of the value), so differences
  grow layer by layer."""
  config = M.tiny(policy="fp8_unified", dtype="bfloat16", num_hidden_layers=2, vocab_size=128,
                  moe_intermediate_size=128, head_dim=64)
  params = jax.tree.map(lambda a: a if a.ndim == 1 else a * 4.0, M.init_params(config, 3))
  ref, fast, packed = (InProcessEngine(params, config.replace(fp8_gemm=g, decode_impl=d),
                                       max_batch=2)
                       for g, d in (("xla", "xla"), ("kernel", "xla"), ("kernel", "kernel")))
  assert packed.experts[0].fp8 and set(packed.experts[0].attention) == {
      "qkv", "o_proj"}
  assert packed.layers[0]["attn"]["q_proj"]["kernel"][...].size == 0  # one copy: the FP8 one
  prompts = np.random.default_rng(1).integers(1, 128, (2, 9)).tolist()
  sp = SamplingParams(max_new_tokens=NEW, temperature=0.0)
  for x, y, z in zip(ref.generate(prompts, sp), fast.generate(prompts, sp),
                     packed.generate(prompts, sp)):
    assert len(x.tokens) == len(y.tokens) == NEW
    # Greedy paths part only at a near tie of the tiny random model's flat distribution (seen:
    # step 27 of one prompt, log-probs -3.39 and -3.38): compare up to and including the first
    # step that picks differently (both saw the same tokens before it).
    n = next((i for i, (u, w) in enumerate(zip(x.tokens, y.tokens)) if u != w), NEW - 1)
    assert n >= NEW // 2, f"the FP8 kernel's greedy tokens leave the reference's at step {n}"
    d = np.abs(np.asarray(x.logprobs[:n + 1]) - np.asarray(y.logprobs[:n + 1]))
    assert d.max() < 0.15 and d.mean() < 0.04, (d.max(), d.mean())
    # Weights quantized once or per step: the same GEMMs; the decode-attention kernel gives
    # attend's outputs bit for bit on CPU.
    assert y.tokens == z.tokens
    np.testing.assert_array_equal(y.logprobs, z.logprobs)


def test_packed_kv_cache_holds_the_codes_and_sessions_match_the_reference():
  """decode_impl="kernel" under an NVFP4 forward keeps the KV cache packed (codes + scales,
  22 of 64 bytes per head row at head_dim 32); a two-turn session (the second turn fed as
  several tokens: the XLA path over the packed cache) gives the reference engine's greedy
  tokens. (A turn of the pending tokens only runs the one-token decode step, generate's:
  test_kernel_decode_matches_the_reference; the values a decode step writes into the packed
  cache are the dense cache's bit for bit: test_packed_kv_cache_as_words_in_the_decode_step.)"""
  config = M.tiny(policy="fp4_trace", dtype="bfloat16", num_hidden_layers=2, vocab_size=128,
                  decode_impl="xla")
  kv = lambda cfg: M.resolve_plan(cfg).kv_cache
  assert kv(config.replace(decode_impl="kernel")) == "packed"
  assert kv(config) == "dense" and kv(config.replace(policy="bf16", decode_impl="kernel")) == \
      "dense"
  dense, packed = (M.init_cache(config.replace(decode_impl=d), 2, 16) for d in ("xla", "kernel"))
  assert all(isinstance(c, kv_cache.PackedKVCache) for c in packed)
  nbytes = lambda tree: sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))
  assert nbytes(packed) * 64 == nbytes(dense) * 22
  params = jax.tree.map(lambda a: a if a.ndim == 1 else a * 4.0, M.init_params(config, 3))
  # Without records: the sessions' subject is the cache (the rollout sites' kernel and records
  # under decode_impl="kernel" are test_precision.py's; in the Pallas interpreter they took
  # this test from 90 to 109 s on a 2-core CPU).
  engines = [InProcessEngine(params, config.replace(decode_impl=d), max_batch=2,
                             record_guidance=False, record_routing=False)
             for d in ("xla", "kernel")]
  sp = [SamplingParams(max_new_tokens=6, temperature=0.0)] * 2
  turns = []
  for eng in engines:
    s = eng.open_session(2, 40)
    first = eng.extend(s, [0, 1], [[3, 4, 5], [7, 8]], sp)
    second = eng.extend(s, [0, 1], [[11, 12, 13, 14], [15]], sp)
    eng.close_session(s, [[1], [2]])
    turns.append([x.tokens for x in first + second])
  assert turns[0] == turns[1]


def _words_step(params, config, cache):
  """One decode step of two sequences at positions 0 and 3, layer 1 tapped in full mode."""
  return jax.jit(lambda p, c: M.decode_step(p, config, c, np.array([5, 9], np.int32),
                                            np.array([0, 3], np.int32), tap_layers=(1,),
                                            tap_mode="full"))(params, cache)


@functools.cache
def _dense_words_step():
  """(config, params, the XLA decode step's output over the dense cache), computed once."""
  config = M.tiny(policy="fp4_rtn", dtype="bfloat16", num_hidden_layers=2, vocab_size=128,
                  fp4_codes="words")
  params = jax.tree.map(lambda a: a if a.ndim == 1 else a * 4.0, M.init_params(config, 3))
  return config, params, _words_step(params, config, M.init_cache(config, 2, 16))


@pytest.mark.parametrize("kv_write", ["xla", "kernel"])
def test_packed_kv_cache_as_words_in_the_decode_step(kv_write):
  """The GPU's layout on CPU: a cache whose codes are words per block (the plan's
  `fp4_codes="words"`), written by the layer scan's decode step (the site kernel and XLA's
  scatters, or `kv_append`'s one kernel: kv_write) and read by the words decoder, holds the
  dense cache's values bit for bit and gives its logits; layer 1, tapped in full mode (an
  audit), records the k/v sites' codes and scales as the dense path does."""
  config, params, dense_out = _dense_words_step()
  kernel = config.replace(decode_impl="kernel", kv_write=kv_write)
  packed = M.init_cache(kernel, 2, 16)
  assert all(c.words and c.k_codes.dtype == jnp.uint32 for c in packed)
  assert M.resolve_plan(kernel).kv_write == kv_write
  outs = [dense_out, _words_step(params, kernel, packed)]
  for site in ("k", "v"):
    for a, b in zip(jax.tree.leaves(outs[0].taps[1][site]), jax.tree.leaves(outs[1].taps[1][site])):
      np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
  for (dk, dv), pc in zip(outs[0].cache, outs[1].cache):
    assert pc.words
    pk, pv = kv_cache.dequantize(pc, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(pk).view(np.uint16), np.asarray(dk).view(np.uint16))
    np.testing.assert_array_equal(np.asarray(pv).view(np.uint16), np.asarray(dv).view(np.uint16))
  np.testing.assert_array_equal(np.asarray(outs[0].logits, np.float32),
                                np.asarray(outs[1].logits, np.float32))
