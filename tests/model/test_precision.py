"""Precision policies in the forward: every policy runs and trains; TRACE guidance removes flips.

Drift source on CPU: rollout decodes token by token in bfloat16 (the rollout engine's
numerics), training runs the full sequence in float32 on the same float32 master weights, so
quantizer inputs differ slightly, as they do between SGLang kernels and the trainer on GPU.
(On CPU, bf16 prefill and bf16 decode give identical activations, so they cannot be the drift.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax import model as M
from trace_jax.model.policies import FP4_RUNS, POLICIES
from trace_jax.quant import formats, guided
from trace_jax.train import mismatch

B, T, MAX_LEN = 2, 10, 16


def _params(config):
  return jax.tree.map(lambda x: x if x.ndim == 1 else x * 4.0,
                      M.init_params(config, 0, param_dtype="float32"))


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["bf16", "fp8_unified", "fp4_rtn"])
def test_policy_forward_and_grad(policy):
  """Each policy gives finite logits near the bf16 ones and finite float32 gradients."""
  shape = dict(num_hidden_layers=1, moe_intermediate_size=128, head_dim=64)
  config = M.tiny(policy=policy, **shape)
  params = _params(config)
  toks = np.random.default_rng(0).integers(0, config.vocab_size, (B, 8), np.int32)

  def loss(p):
    out = M.forward(p, config, toks)
    return jnp.mean(out.logits.astype(jnp.float32) ** 2), out.logits

  (val, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  ref = M.logits(params, config, toks)
  err = float(jnp.max(jnp.abs(logits - ref)) / jnp.max(jnp.abs(ref)))
  assert np.isfinite(float(val)) and all(bool(jnp.all(jnp.isfinite(g)))
                                         for g in jax.tree.leaves(grads))
  assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
  if policy == "bf16":
    assert err < 1e-6, err
  else:
    assert 0.0 < err < 0.5, err  # quantized, but the same model


def _codes(g: guided.Guidance) -> np.ndarray:
  """E2M1 values as grid ordinals: codes that differ only in the sign of zero compare equal."""
  return mismatch.e2m1_ordinal(formats.unpack_fp4(g.codes))


@functools.partial(jax.jit, static_argnames="config")
def _rollout_step(params, config, cache, tok, pos):
  out = M.decode_step(params, config, cache, tok, pos, tap_layers=(0,), tap_mode="full",
                      record=True)
  return out.cache, out.taps


@functools.partial(jax.jit, static_argnames=("config", "replay"))
def _train_taps(params, config, toks, guidance, routing, replay=True):
  out = M.forward(params, config, toks, guidance=guidance, routing=routing, replay=replay,
                  tap_layers=(0,), tap_mode="full")
  return out.taps, out.logits


ROLLOUT_CFG = M.tiny(policy="fp4_trace", dtype="bfloat16", num_hidden_layers=1,
                     guided_layers=(0,))
TRAIN_CFG = ROLLOUT_CFG.replace(dtype="float32")
FORMATS = tuple(FP4_RUNS)


@functools.cache
def _rollout_of(fmt: str):
  """(params, tokens, full-mode taps of layer 0) of a token-by-token bf16 decode in `fmt`."""
  config = ROLLOUT_CFG.replace(policy=POLICIES[FP4_RUNS[fmt][1]].rollout.name)
  params = _params(config)
  toks = np.random.default_rng(1).integers(0, config.vocab_size, (B, T), np.int32)
  cache = M.init_cache(config, B, MAX_LEN)
  steps = []
  for s in range(T):
    cache, taps = _rollout_step(params, config, cache, toks[:, s], jnp.full((B,), s))
    steps.append(taps)
  return params, toks, jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=1), *steps)[0]


@pytest.fixture(scope="module")
def rollout():
  return _rollout_of("nvfp4")


def _compact(roll):
  return {s: guided.Guidance(block_scale=roll[s].block_scale, row_scale=roll[s].row_scale,
                             mantissa=guided.pack_bits(formats.unpack_fp4(roll[s].codes) & 1))
          for s in M.SITES}


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_trace_guidance_reproduces_rollout_codes(fmt):
  """Guided training with rollout guidance reproduces the rollout's codes; RTN flips many,
  in either FP4 format (NVFP4: E4M3 scales per 16 and a row scale; MXFP4: E8M0 per 32).

  moe_in, k and v: 0 flips. expert_mid (silu(gate) * up, where bf16 and float32 differ
  most) keeps a small residue: values whose drift crosses zero or spans more than one code
  cannot be guided back (docs/numerics.md), so there the bound is relative to RTN.
  """
  params, toks, roll = _rollout_of(fmt)
  rtn_policy, trace_policy = (POLICIES[p].train.name for p in FP4_RUNS[fmt])
  assert all(roll[s].format == fmt for s in M.SITES)
  routing = {0: roll["routing"]}
  flips = {}
  for name, cfg, guidance in (("rtn", TRAIN_CFG.replace(policy=rtn_policy), None),
                              ("trace", TRAIN_CFG.replace(policy=trace_policy),
                               {0: _compact(roll)})):
    taps = _train_taps(params, cfg, toks, guidance, routing)[0][0]
    flips[name] = {s: float(np.mean(_codes(taps[s]) != _codes(roll[s]))) for s in M.SITES}
  print(fmt, "code flip rate vs rollout:", flips)
  trace, rtn = flips["trace"], flips["rtn"]
  assert trace["moe_in"] == trace["k"] == trace["v"] == 0.0, flips
  assert trace["expert_mid"] <= 0.01 and trace["expert_mid"] * 20 < rtn["expert_mid"], flips
  assert min(rtn.values()) > 0.0, flips


def test_guidance_of_another_format_is_refused(rollout):
  params, toks, roll = rollout
  with pytest.raises(ValueError, match=r"guidance in \['nvfp4'\] for policy 'mxfp4_trace'"):
    M.forward(params, TRAIN_CFG.replace(policy="mxfp4_trace"), toks,
              guidance={0: _compact(roll)}, routing={0: roll["routing"]})


def test_fp4_forward_policies():
  """Both NVFP4 forwards quantize; bf16 does not (posthoc_fp4 is no forward policy any more:
  its old meaning, FP4 rollout with BF16 training, is the run policy fp4_rollout)."""
  from trace_jax.model.precision import Precision
  for policy in ("fp4_rtn", "fp4_trace"):
    assert Precision(M.tiny(policy=policy)).fp4
  assert not Precision(M.tiny(policy="bf16")).fp4
  with pytest.raises(ValueError, match="unknown precision policy 'posthoc_fp4'"):
    M.tiny(policy="posthoc_fp4")


@pytest.mark.slow
def test_expert_mid_guidance_follows_experts_not_slots(rollout):
  """expert_mid guidance is matched by expert id, not by top-k slot.

  The rollout's record is re-ordered as if its top-k had listed the same experts in another
  order (slots reversed, ids with them). The trainer, routing on its own (no replay), must
  round exactly as with the original order. Matching by slot instead (what the trainer did
  before the ids travelled with the guidance) hands each slot the other expert's scales and
  bits: most of those codes change.
  """
  params, toks, roll = rollout
  ids = roll["routing"]
  guidance = _compact(roll)
  flip = lambda a: a[:, :, ::-1]
  swapped = dict(guidance, expert_mid=jax.tree.map(flip, guidance["expert_mid"]))
  taps, logits = _train_taps(params, TRAIN_CFG, toks, {0: guidance}, {0: ids}, replay=False)
  taps_sw, logits_sw = _train_taps(params, TRAIN_CFG, toks, {0: swapped}, {0: flip(ids)},
                                   replay=False)
  np.testing.assert_array_equal(_codes(taps_sw[0]["expert_mid"]),
                                _codes(taps[0]["expert_mid"]))
  np.testing.assert_array_equal(np.asarray(logits_sw), np.asarray(logits))
  # Slot matching: the trainer's own ids as if they were the rollout's, reversed guidance.
  own = taps[0]["routing"]
  taps_slot, by_slot = _train_taps(params, TRAIN_CFG, toks, {0: swapped}, {0: own},
                                   replay=False)
  assert not np.array_equal(np.asarray(by_slot), np.asarray(logits))
  wrong = float(np.mean(_codes(taps_slot[0]["expert_mid"]) != _codes(taps[0]["expert_mid"])))
  assert wrong > 0.3, wrong


def test_expert_mid_guidance_needs_the_rollout_ids():
  """Refused while tracing (eval_shape: the check is Python, nothing to compile or run; run
  eagerly the forward compiled some 700 single ops before reaching it)."""
  config = M.tiny(policy="fp4_trace", num_hidden_layers=1, guided_layers=(0,))
  params = M.abstract_params(config)
  x = np.zeros((1, 4), np.int32)
  k, i = config.num_experts_per_tok, config.moe_intermediate_size
  g = guided.Guidance(block_scale=jnp.ones((1, 4, k, i // 16), jnp.float8_e4m3fn),
                      row_scale=jnp.ones((1, 4, k, 1), jnp.float32),
                      mantissa=jnp.zeros((1, 4, k, i // 8), jnp.uint8))
  with pytest.raises(ValueError, match="expert ids"):
    jax.eval_shape(lambda p: M.forward(p, config, x, guidance={0: {"expert_mid": g}}), params)


def _differing_bytes(a, b) -> list[float]:
  return [float(np.mean(np.asarray(x).view(np.uint8) != np.asarray(y).view(np.uint8)))
          for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))]


def test_site_input_is_rounded_to_the_compute_dtype_under_jit():
  """A quantizer fused with the bf16 expression feeding it sees the bf16 value, as an eager
  (materialized) input does: XLA's excess precision would otherwise hand it float32
  (docs/numerics.md). Control, on the CPU: the same program without `dtype_rounded` records
  other bits. (XLA's GPU backend rounded this small program's h on the H200 (docs/numerics.md),
  so the control cannot show it there; the rounded program equalled the eager bits there too.)"""
  rng = np.random.default_rng(0)
  g, u = (jnp.asarray(rng.normal(size=(64, 768)), jnp.bfloat16) for _ in range(2))

  def record(h):
    return guided.record(formats.fp4_quantize_act(h, "nvfp4"), "full")

  ref = record(jax.nn.silu(g) * u)  # eager: h is stored as bf16 before the quantizer runs
  rounded = jax.jit(lambda g, u: record(M.precision.dtype_rounded(jax.nn.silu(g) * u)))(g, u)
  raw = jax.jit(lambda g, u: record(jax.nn.silu(g) * u))(g, u)
  assert max(_differing_bytes(rounded, ref)) == 0.0
  if jax.default_backend() == "cpu":
    assert max(_differing_bytes(raw, ref)) > 0.0, "control: no excess precision to remove"


@pytest.mark.parametrize("tap,mode", [(False, "compact"), (True, "compact"), (True, "full")],
                         ids=["untapped", "tapped_compact", "tapped_full"])
def test_engine_sites_run_the_site_kernel_with_the_same_bits(tap, mode, monkeypatch):
  """Rollout forwards with the kernel decode (`decode_impl="kernel"`) quantize NVFP4 sites
  without guidance in one kernel (`kernels.nvfp4_act`): values, records (compact ones with the
  kernel's mantissa bits, not XLA's packing) and the packed KV cache's codes equal the XLA
  path's bit for bit; training forwards (record=False) keep the XLA quantizers (the kernel is
  not called)."""
  from trace_jax.kernels import nvfp4_act
  from trace_jax.model.precision import Precision
  from trace_jax.quant import guided

  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((2, 3, 48)) * np.exp2(rng.integers(-6, 6, (2, 3, 1))),
                  jnp.bfloat16)
  kv = jnp.asarray(rng.standard_normal((2, 3, 2, 32)), jnp.bfloat16)
  taps = (0,) if tap else ()
  ref, fast = (Precision(M.tiny(policy="fp4_trace", decode_impl=impl), record=True,
                         tap_layers=taps, tap_mode=mode) for impl in ("xla", "kernel"))
  assert fast.site_kernel and not ref.site_kernel
  calls = []
  real = nvfp4_act.quantize_rows
  monkeypatch.setattr(nvfp4_act, "quantize_rows", lambda *a, **k: calls.append(k) or real(
      *a, **k))
  packed = []
  real_pack = guided.pack_bits
  monkeypatch.setattr(guided, "pack_bits", lambda a: packed.append(1) or real_pack(a))
  bits = lambda t: [np.ascontiguousarray(np.asarray(a)).view(np.uint8)
                    for a in jax.tree.leaves(t)]
  outs = [(p.site(0, "moe_in", x), p.kv_site(0, kv, kv * 2, codes=True), p.taps)
          for p in (ref, fast)]
  assert len(calls) == 2  # moe_in and k/v, in the kernel engine's Precision only
  assert [k["mantissa"] for k in calls] == [tap and mode == "compact"] * 2
  # XLA packs the mantissa bits of the reference's compact records only (moe_in, k/v stacked).
  assert len(packed) == (2 if tap and mode == "compact" else 0)
  for a, b in zip(bits(outs[0]), bits(outs[1])):
    np.testing.assert_array_equal(a, b)
  assert (len(jax.tree.leaves(outs[1][2])) > 0) == tap
  if tap:
    assert (outs[1][2][0]["moe_in"].mantissa is not None) == (mode == "compact")
  trainer = Precision(M.tiny(policy="fp4_trace", decode_impl="kernel"), record=False)
  assert not trainer.site_kernel
  trainer.site(0, "moe_in", x)
  assert len(calls) == 2


def _bits(tree) -> list[np.ndarray]:
  return [np.ascontiguousarray(np.asarray(a)).view(np.uint8) for a in jax.tree.leaves(tree)]


def test_weight_kernel_is_the_xla_quantizer_bit_for_bit_with_its_gradient():
  """`fake_quant_weights_kernel` (gate and up under one scale per expert without joining them,
  one kernel each) equals `qat.fake_quant_weight` of the joined weights, values and
  straight-through cotangents, on experts alike, all-zero, poisoned by one NaN, and one whose
  largest value lies in `up` only (the shared scale is the pair's, not gate's)."""
  from trace_jax.model.precision import fake_quant_weights_kernel
  from trace_jax.quant import qat

  rng = np.random.default_rng(4)
  gate, up = (jnp.asarray(rng.standard_normal((4, 8, 48)), jnp.bfloat16) for _ in range(2))
  gate, up = gate.at[1].set(0.0), up.at[1].set(0.0)
  up = up.at[2, 3, 5].set(jnp.nan).at[3, 0, 0].set(64.0)

  def xla(g, u):
    gu = qat.fake_quant_weight(jnp.concatenate([g, u], axis=1), "nvfp4")
    return gu[:, :8], gu[:, 8:]

  kernel = lambda g, u: fake_quant_weights_kernel((g, u))
  cot = tuple(jnp.asarray(rng.standard_normal(gate.shape), jnp.bfloat16) for _ in range(2))
  outs = []
  for f in (xla, kernel):
    y, vjp = jax.vjp(jax.jit(f), gate, up)
    outs.append((y, vjp(cot)))
  assert len(_bits(outs[0])) == 4
  for a, b in zip(_bits(outs[0]), _bits(outs[1]), strict=True):
    np.testing.assert_array_equal(a, b)
  y = np.asarray(outs[1][0][0].astype(jnp.float32))
  assert np.isnan(y[2]).all() and not np.isnan(y[[0, 1, 3]]).any() and (y[1] == 0).all()


@pytest.mark.parametrize("policy,weights,sites,rtn_sites",
                         [("fp4_trace", 3, 3, 0), ("fp4_rtn", 3, 0, 3)])
def test_fake_quant_kernel_trains_the_xla_quantizers_bits(policy, weights, sites, rtn_sites):
  """A training forward with fake_quant="kernel" calls the weight kernel (three per layer) and
  the site kernels: under guidance the guided one (moe_in, k/v stacked, expert_mid with its
  RTN rows), unguided the RTN one (the weight kernel under the rows' own scales); and gives the
  "xla" plan's logits and float32 gradients bit for bit."""
  from cases import pallas_calls

  toks = np.random.default_rng(5).integers(0, 64, (B, 8), np.int32)
  results = []
  for impl in ("xla", "kernel"):
    config = M.tiny(policy=policy, num_hidden_layers=1, fake_quant=impl)
    params = _params(config)
    guidance = routing = None
    if policy == "fp4_trace":  # a bf16 rollout's records: the trainer's input drifts from them
      rollout = config.replace(dtype="bfloat16")
      taps = jax.jit(lambda p, c=rollout: M.forward(p, c, toks, tap_layers=(0,),
                                                     record=True).taps)(params)
      guidance, routing = {0: {s: taps[0][s] for s in M.SITES}}, {0: taps[0]["routing"]}

    def loss(p, c=config, g=guidance, r=routing):
      out = M.forward(p, c, toks, guidance=g, routing=r)
      return jnp.mean(out.logits.astype(jnp.float32) ** 2)

    names = [n for n, _ in pallas_calls(jax.make_jaxpr(loss)(params).jaxpr)]
    on = impl == "kernel"
    assert names.count("nvfp4_qdq_rows") == (weights + rtn_sites) * on, names
    assert names.count("nvfp4_guided_qdq_rows") == sites * on, names
    results.append(jax.jit(jax.value_and_grad(loss))(params))
  for a, b in zip(_bits(results[0]), _bits(results[1]), strict=True):
    np.testing.assert_array_equal(a, b)


def test_site_row_order_needs_its_inverse():
  """A site computed in another row order puts its record back by the inverse the dispatch
  holds; given one without the other it refuses."""
  from trace_jax.model.precision import Precision

  p = Precision(M.tiny(policy="fp4_trace"), record=True)
  x = jnp.zeros((4, 32), jnp.float32)
  with pytest.raises(ValueError, match="row_order and row_inverse go together"):
    p.site(0, "expert_mid", x, row_order=jnp.arange(4), tap_shape=(1, 1, 4))
