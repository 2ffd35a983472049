"""The kernel plan (`trace_jax.model.plan`): its resolution per backend (faked `Backend`s),
presets and forced fields, and that a forced field reaches its operation (the traced program
holds that implementation's kernel and not the other's)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import pallas_calls

from trace_jax import model as M
from trace_jax.kernels import attention_math, decode_attention, fp4_moe
from trace_jax.model import expert_weights
from trace_jax.model import plan as plan_lib
from trace_jax.model.plan import Backend, KernelPlan

CPU = Backend("cpu")
HOPPER = Backend("gpu", (9, 0), sm_count=132, mosaic_gpu=True, triton_asm=True)
AMPERE = Backend("gpu", (8, 0), sm_count=108, mosaic_gpu=False, triton_asm=True)
REFERENCE = dict(moe_impl="tiled", decode_impl="xla", decode_moe_kernel="triton",
                 fp4_codes="bytes", decode_attention="triton", kv_cache="dense",
                 nvfp4_sites="xla", fp8_gemm="xla", seq_attention="xla", layer_loop="scan",
                 kv_write="xla", fake_quant="xla", fp8_bwd_operands="xla")
KERNELS = dict(moe_impl="mgpu", decode_impl="kernel", decode_moe_kernel="wgmma",
               fp4_codes="words", decode_attention="fused", kv_cache="packed",
               nvfp4_sites="kernel", fp8_gemm="wgmma", seq_attention="cudnn",
               layer_loop="unrolled", kv_write="kernel", fake_quant="kernel",
               fp8_bwd_operands="kernel")


def _fields(plan: KernelPlan) -> dict[str, str]:
  return {k: v for k, v in plan.as_dict().items() if k in plan_lib.FIELDS}


@pytest.mark.parametrize("make", [M.qwen3_30b_a3b, functools.partial(M.tiny, dtype="bfloat16")],
                         ids=["qwen3_30b_a3b", "tiny"])
def test_default_config_resolves_to_the_kernels_on_hopper_and_the_reference_on_cpu(make):
  config = make(policy="fp4_trace")
  deep = config.num_hidden_layers > plan_lib.UNROLLED_MAX_LAYERS  # Qwen3-30B-A3B's 48 scan
  assert _fields(plan_lib.resolve(config, HOPPER)) == dict(
      KERNELS, layer_loop="scan" if deep else "unrolled")
  assert _fields(plan_lib.resolve(config, CPU)) == REFERENCE
  assert plan_lib.resolve(config, CPU) == plan_lib.reference()
  assert plan_lib.resolve(config, HOPPER).sm_count == 132


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the suite's CPU machine")
def test_this_machine_resolves_to_the_reference():
  """The suite runs on CPU: every default config's plan is today's CPU path."""
  backend = Backend.current()
  assert backend.platform == "cpu" and not backend.hopper and backend is Backend.current()
  for policy in ("bf16", "fp4_trace", "fp8_unified"):
    extra = dict(moe_intermediate_size=128, head_dim=64) if policy == "fp8_unified" else {}
    assert plan_lib.resolve(M.tiny(policy=policy, **extra)) == plan_lib.reference()


def test_other_gpus_resolve_to_the_reference_but_words():
  """"auto" picks the kernels on Hopper only; the packed codes' layout is the GPU kernels'
  (inert while nothing is packed)."""
  want = dict(REFERENCE, fp4_codes="words")
  assert _fields(plan_lib.resolve(M.tiny(policy="fp4_trace"), AMPERE)) == want
  no_asm = Backend("gpu", (8, 0), triton_asm=False)
  assert _fields(plan_lib.resolve(M.tiny(policy="fp4_trace"), no_asm)) == REFERENCE


@pytest.mark.parametrize("policy,want", [
    pytest.param("bf16", dict(KERNELS, kv_cache="dense", nvfp4_sites="xla", kv_write="xla",
                              fake_quant="xla"), id="bf16"),
    pytest.param("fp4_rtn", KERNELS, id="fp4_rtn"),
    pytest.param("mxfp4_trace", dict(KERNELS, decode_impl="xla", kv_cache="dense",
                                     nvfp4_sites="xla", kv_write="xla", fake_quant="xla"),
                 id="mxfp4_decodes_on_xla"),
])
def test_hopper_plan_follows_the_forward(policy, want):
  """The packed cache, the site kernel, the one-kernel k/v write and the fake-quantization
  kernels are NVFP4's; the decode attention is the single pass over either cache (Triton's
  over a dense one, the wgmma kernel over the packed one: the fastest measured); MXFP4
  forwards' weights are not prepared for the decode kernels, so their decode stays on XLA (its
  decode_attention then inert)."""
  assert _fields(plan_lib.resolve(M.tiny(policy=policy, dtype="bfloat16"), HOPPER)) == want


@pytest.mark.parametrize("layers,backend,want", [
    pytest.param(plan_lib.UNROLLED_MAX_LAYERS, HOPPER, "unrolled", id="hopper_at_the_bound"),
    pytest.param(plan_lib.UNROLLED_MAX_LAYERS + 1, HOPPER, "scan", id="hopper_deeper"),
    pytest.param(2, AMPERE, "scan", id="ampere"),
    pytest.param(2, CPU, "scan", id="cpu"),
])
def test_layer_loop_unrolls_on_hopper_up_to_its_bound(layers, backend, want):
  """layer_loop "auto": every forward's scans unrolled on Hopper for models up to
  `UNROLLED_MAX_LAYERS` layers (compile time grows with depth), else scanned; forced either
  way on any backend."""
  config = M.tiny(dtype="bfloat16", num_hidden_layers=layers)
  assert plan_lib.resolve(config, backend).layer_loop == want
  for forced in ("scan", "unrolled"):
    assert plan_lib.resolve(config.replace(layer_loop=forced), backend).layer_loop == forced


@pytest.mark.parametrize("config,backend,want", [
    pytest.param(M.tiny(dtype="bfloat16"), HOPPER, "mgpu", id="bf16"),
    pytest.param(M.tiny(), HOPPER, "kernel", id="float32_compute"),
    pytest.param(M.tiny(dtype="bfloat16", moe_intermediate_size=48), HOPPER, "kernel",
                 id="width_48"),
    pytest.param(M.tiny(dtype="bfloat16"), dataclasses.replace(HOPPER, mosaic_gpu=False),
                 "kernel", id="no_mosaic_gpu"),
    pytest.param(M.tiny(dtype="bfloat16"), AMPERE, "tiled", id="ampere"),
])
def test_moe_impl_is_jax_s_mosaic_kernel_where_it_runs(config, backend, want):
  """moe_impl "auto": "mgpu" on Hopper for bf16/f16 compute and widths of 64-column tiles,
  else the Pallas kernels for widths of 16, else (not Hopper) the tiled reference; forcing
  "mgpu" on a config it cannot take is refused by name."""
  assert plan_lib.resolve(config, backend).moe_impl == want
  if want == "kernel" and backend.mosaic_gpu:
    with pytest.raises(ValueError, match='moe_impl="mgpu" needs'):
      config.replace(moe_impl="mgpu")


def test_kernels_without_mosaic_gpu():
  """A Hopper GPU without the Mosaic GPU API: the packed cache's attention is the Triton pair,
  a dense cache's still the single-pass kernel; the FP8 GEMMs Triton's."""
  no_mosaic = dataclasses.replace(HOPPER, mosaic_gpu=False)
  assert plan_lib.resolve(M.tiny(policy="fp4_rtn"), no_mosaic).decode_attention == "triton"
  assert plan_lib.resolve(M.tiny(policy="bf16"), no_mosaic).decode_attention == "fused"
  fp8 = M.tiny(policy="fp8_unified", moe_intermediate_size=128, head_dim=64)
  assert plan_lib.resolve(fp8, no_mosaic).fp8_gemm == "kernel"
  assert plan_lib.resolve(fp8, HOPPER).fp8_gemm == "wgmma"


def test_auto_falls_back_where_shapes_rule_the_kernels_out():
  config = M.tiny(moe_intermediate_size=40)  # bf16: no block constraint of its own
  plan = plan_lib.resolve(config, HOPPER)
  assert plan.moe_impl == "tiled" and plan.decode_impl == "xla"
  with pytest.raises(ValueError, match='moe_impl="kernel" needs'):
    config.replace(moe_impl="kernel")


@pytest.mark.parametrize("overrides,want", [
    pytest.param(dict(dtype="bfloat16"), "cudnn", id="bf16_head32"),
    pytest.param(dict(dtype="float32"), "xla", id="float32"),
    pytest.param(dict(dtype="bfloat16", head_dim=12), "xla", id="head_dim_not_a_multiple_of_8"),
    pytest.param(dict(dtype="bfloat16", head_dim=256), "xla", id="head_dim_over_128"),
])
def test_fused_sequence_attention_where_cudnn_takes_the_shapes(overrides, want):
  assert plan_lib.resolve(M.tiny(**overrides), HOPPER).seq_attention == want
  assert plan_lib.resolve(M.tiny(**overrides), CPU).seq_attention == "xla"
  if want == "xla":
    with pytest.raises(ValueError, match='seq_attention="cudnn" needs'):
      M.tiny(seq_attention="cudnn", **overrides)


def test_forced_fields_win_over_the_backend_and_the_preset():
  config = M.tiny(policy="fp4_trace", plan="reference", decode_impl="kernel",
                  decode_attention="wgmma", fp8_bwd_operands="kernel")
  plan = plan_lib.resolve(config, HOPPER)
  assert _fields(plan) == dict(REFERENCE, decode_impl="kernel", decode_attention="wgmma",
                               fp8_bwd_operands="kernel")
  # "auto" with forced fields: the rest by the backend (the cache and sites follow decode).
  plan = plan_lib.resolve(M.tiny(policy="fp4_trace", decode_impl="kernel",
                                 decode_moe_kernel="wgmma"), CPU)
  assert _fields(plan) == dict(REFERENCE, decode_impl="kernel", decode_moe_kernel="wgmma",
                               kv_cache="packed", nvfp4_sites="kernel")
  plan = plan_lib.resolve(M.tiny(policy="fp4_trace", decode_impl="kernel", kv_cache="dense",
                                 fp4_codes="words"), CPU)
  assert (plan.kv_cache, plan.nvfp4_sites, plan.fp4_codes) == ("dense", "kernel", "words")
  # kv_write "kernel" runs where the plan has the packed cache and the site kernel (on CPU
  # forced, on Hopper by "auto"), and "xla" forced wins on Hopper.
  forced = dict(policy="fp4_trace", decode_impl="kernel", kv_write="kernel")
  assert plan_lib.resolve(M.tiny(**forced), CPU).kv_write == "kernel"
  assert plan_lib.resolve(M.tiny(**forced, kv_cache="dense"), CPU).kv_write == "xla"
  assert plan_lib.resolve(M.tiny(**forced, nvfp4_sites="xla"), HOPPER).kv_write == "xla"
  assert plan_lib.resolve(M.tiny(**dict(forced, policy="bf16")), HOPPER).kv_write == "xla"
  assert plan_lib.resolve(M.tiny(policy="fp4_trace", kv_write="xla"), HOPPER).kv_write == "xla"
  # A forward without NVFP4 sites keeps a dense cache and XLA's weights whatever is forced: the
  # plan says what runs.
  assert plan_lib.resolve(M.tiny(kv_cache="packed", nvfp4_sites="kernel"), HOPPER).kv_cache == \
      "dense"
  for policy, want in (("fp4_rtn", "kernel"), ("bf16", "xla"), ("mxfp4_trace", "xla")):
    assert plan_lib.resolve(M.tiny(policy=policy, fake_quant="kernel"), CPU).fake_quant == want


def test_reference_preset_on_hopper_and_as_dict():
  plan = plan_lib.resolve(M.tiny(policy="fp4_trace", plan="reference"), HOPPER)
  assert _fields(plan) == REFERENCE
  d = plan.as_dict()
  assert set(d) == set(plan_lib.FIELDS) | {"sm_count", "invariant"} and d["sm_count"] == 132
  assert d["invariant"] is False
  assert KernelPlan(**d) == plan
  hash(plan)  # a static argument of the engine's programs


@pytest.mark.parametrize("field,value,pattern", [
    pytest.param("plan", "fastest", "plan must be one of", id="preset"),
    pytest.param("kv_cache", "bytes", "kv_cache must be one of", id="kv_cache"),
    pytest.param("fp4_codes", "nibbles", "fp4_codes must be one of", id="fp4_codes"),
    pytest.param("decode_attention", "cuda", "decode_attention must be one of", id="attention"),
    pytest.param("nvfp4_sites", "pallas", "nvfp4_sites must be one of", id="sites"),
    pytest.param("kv_write", "scatter", "kv_write must be one of", id="kv_write"),
    pytest.param("fake_quant", "triton", "fake_quant must be one of", id="fake_quant"),
])
def test_bad_plan_fields_are_refused(field, value, pattern):
  with pytest.raises(ValueError, match=pattern):
    M.tiny(**{field: value})
  with pytest.raises(ValueError, match=field):
    KernelPlan(**{**REFERENCE, field: value}) if field != "plan" else M.tiny(plan=value)


@pytest.mark.parametrize("backend", [CPU, HOPPER], ids=["cpu", "hopper"])
def test_invariant_preset_is_the_reference_with_fixed_order_sums(backend):
  plan = plan_lib.resolve(M.tiny(policy="fp4_trace", plan="invariant"), backend)
  assert _fields(plan) == REFERENCE and plan.invariant and plan.grouped == "invariant"
  for preset in ("auto", "reference"):
    other = plan_lib.resolve(M.tiny(policy="fp4_trace", plan=preset), backend)
    assert not other.invariant and other.grouped == other.moe_impl


@pytest.mark.parametrize("fields,pattern", [
    pytest.param(dict(decode_impl="kernel"), 'plan="invariant" runs decode_impl="xla"',
                 id="decode_kernel"),
    pytest.param(dict(moe_impl="ragged_dot"), 'plan="invariant" runs moe_impl="tiled"',
                 id="ragged_dot"),
    pytest.param(dict(policy="fp8_unified", moe_intermediate_size=128, head_dim=64),
                 'plan="invariant" takes no FP8 linears', id="fp8_linears"),
])
def test_invariant_preset_refuses_kernels_and_fp8(fields, pattern):
  M.tiny(plan="invariant", moe_impl="tiled")  # the reference's own values are accepted
  with pytest.raises(ValueError, match=pattern):
    M.tiny(plan="invariant", **fields)


# ----------------------------------------------------------------------------- reaching the ops

def _primitives(jaxpr) -> set[str]:
  """Names of every primitive in a jaxpr and the jaxprs nested in its equations."""
  names = set()
  for eqn in jaxpr.eqns:
    names.add(eqn.primitive.name)
    for p in eqn.params.values():
      for sub in p if isinstance(p, (tuple, list)) else (p,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          names |= _primitives(inner)
  return names


def test_invariant_plan_reaches_every_matmul_and_rows_do_not_depend_on_the_batch():
  """Under the invariant plan the forward holds no XLA dot (every matmul, the experts' too, is
  a chain of `kernels.invariant`), and a sequence's logits are the same bits alone and in a
  batch; the default plan's forward runs XLA's dots."""
  config, params = _tiny("bf16", plan="invariant")
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (3, 6)))
  fwd = lambda p, t: M.forward(p, config, t).logits
  assert "dot_general" not in _primitives(jax.make_jaxpr(fwd)(params, tokens).jaxpr)
  default, _ = _tiny("bf16")
  assert "dot_general" in _primitives(jax.make_jaxpr(
      lambda p, t: M.forward(p, default, t).logits)(params, tokens).jaxpr)
  batch = np.asarray(jax.jit(fwd)(params, tokens))
  alone = np.asarray(jax.jit(fwd)(params, tokens[1:2]))
  assert np.array_equal(alone.view(np.uint16), batch[1:2].view(np.uint16))

def _kernels(fn, *args) -> list[str]:
  """The Pallas kernels the traced program of fn(*args) calls, by name."""
  return [name for name, _ in pallas_calls(jax.make_jaxpr(fn)(*args).jaxpr)]


@functools.cache
def _tiny(policy: str = "fp4_rtn", **fields):
  extra = dict(moe_intermediate_size=128, head_dim=64) if policy == "fp8_unified" else {}
  config = M.tiny(policy=policy, dtype="bfloat16", num_hidden_layers=1, **extra, **fields)
  return config, M.init_params(config, 0)


def _decode_kernels(**fields) -> list[str]:
  config, params = _tiny(**fields)
  plan = M.resolve_plan(config)
  experts = expert_weights.prepare(params, config, plan)
  cache = M.init_cache(config, 2, 8, plan=plan)
  return _kernels(lambda p, e, c: M.decode_step(
      p, config, c, np.zeros(2, np.int32), np.zeros(2, np.int32), experts=e, record=True,
      plan=plan).logits, params, experts, cache)


@pytest.mark.parametrize("impl,has,lacks", [
    pytest.param("kernel", "grouped_fprop", None, id="kernel"),
    pytest.param("tiled", None, "grouped_fprop", id="tiled"),
])
def test_moe_impl_reaches_the_grouped_matmuls(impl, has, lacks):
  config, params = _tiny("bf16", moe_impl=impl)
  names = _kernels(lambda p: M.forward(p, config, jnp.zeros((2, 4), jnp.int32)).logits, params)
  assert (has is None or has in names) and (lacks is None or lacks not in names), names


@pytest.mark.parametrize("impl,fp8_kernels", [("kernel", True), ("xla", False)])
def test_fp8_gemm_reaches_the_linears(impl, fp8_kernels):
  config, params = _tiny("fp8_unified", fp8_gemm=impl, moe_impl="tiled")  # no BF16 kernels
  names = _kernels(lambda p: M.forward(p, config, jnp.zeros((2, 4), jnp.int32)).logits, params)
  assert ("fp8_gemm" in names and "fp8_grouped_gemm" in names) == fp8_kernels, names
  assert fp8_kernels or not names


def test_decode_impl_kv_cache_and_sites_reach_the_decode_step():
  xla = _decode_kernels(decode_impl="xla")
  assert xla == [], xla
  packed = _decode_kernels(decode_impl="kernel")  # "auto" cache and sites: packed, kernel
  assert {"decode_attention_scores_nvfp4", "grouped_matmul_decode_fp4",
          "nvfp4_quantize_rows"} <= set(packed), packed
  assert "decode_attention_scores" not in packed
  dense = _decode_kernels(decode_impl="kernel", kv_cache="dense", nvfp4_sites="xla",
                          decode_attention="triton")
  assert "decode_attention_scores" in dense and "nvfp4_quantize_rows" not in dense, dense
  assert "decode_attention_scores_nvfp4" not in dense


@pytest.mark.parametrize("codes", ["bytes", "words"])
def test_fp4_codes_reach_the_weights_and_the_cache(codes):
  config, params = _tiny(decode_impl="kernel", fp4_codes=codes)
  plan = M.resolve_plan(config)
  want = jnp.uint32 if codes == "words" else jnp.uint8
  (run,) = expert_weights.prepare(params, config, plan)
  assert run.gate_up.codes.dtype == want and run.down.codes.dtype == want
  (cache,) = M.init_cache(config, 2, 8, plan=plan)
  assert cache.k_codes.dtype == want and cache.words == (codes == "words")


_MOE_DEFAULT, _ATTENTION_DEFAULT = fp4_moe.DecodeConfig(), decode_attention.AttentionConfig()


@pytest.mark.parametrize("moe,attention,impl", [("wgmma", "wgmma", "wgmma"),
                                               ("triton", "triton", "triton"),
                                               ("triton", "fused", "wgmma_fused")])
def test_decode_kernel_choices_reach_their_kernels(moe, attention, impl, monkeypatch):
  """The plan's experts' and attention kernels are the ones the decode step asks for (the
  wgmma kernels run on a Hopper GPU only: here the calls are recorded and run on Triton),
  with the plan's SM count for the attention's launch shape."""
  seen = []
  real_mm, real_attn = fp4_moe.grouped_matmul_decode, decode_attention.decode_attention

  def mm(x, w, *a, config=_MOE_DEFAULT, **k):
    if isinstance(w, fp4_moe.PackedNVFP4Weights):  # the experts (not the BF16 projections)
      seen.append(("moe", config.impl))
    return real_mm(x, w, *a, config=dataclasses.replace(config, impl="triton"), **k)

  def attn(*a, config=_ATTENTION_DEFAULT, **k):
    seen.append(("attention", config.impl, config.sm_count))
    return real_attn(*a, config=dataclasses.replace(config, impl="triton"), **k)

  monkeypatch.setattr(fp4_moe, "wgmma_supported", lambda dtype, w: True)
  monkeypatch.setattr(decode_attention, "wgmma_impl",
                      lambda q, c, fused=False, **k: "wgmma_fused" if fused else "wgmma")
  monkeypatch.setattr(fp4_moe, "grouped_matmul_decode", mm)
  monkeypatch.setattr(decode_attention, "decode_attention", attn)
  _decode_kernels(decode_impl="kernel", decode_moe_kernel=moe, decode_attention=attention)
  assert set(seen) == {("moe", moe), ("attention", impl, plan_lib.DEFAULT_SM_COUNT)}, seen


def test_seq_attention_fuses_only_forwards_over_index_positions(monkeypatch):
  """seq_attention="cudnn" reaches the fused attention in a forward over positions 0..S-1
  (training, prefill) and nowhere else: not with positions given, not in decode steps. cuDNN
  runs on a GPU only: here the calls are recorded and run on the same API's XLA code, whose
  logits equal the reference's within bf16 rounding."""
  calls = []
  real = attention_math.fused_attend

  def fused(q, k, v, implementation="cudnn"):
    calls.append(implementation)
    return real(q, k, v, implementation="xla")

  monkeypatch.setattr(attention_math, "fused_attend", fused)
  config, params = _tiny("bf16", seq_attention="cudnn")
  tokens = jax.random.randint(jax.random.key(2), (2, 12), 0, config.vocab_size)
  got = M.forward(params, config, tokens).logits
  assert calls == ["cudnn"]
  want = M.forward(params, config.replace(seq_attention="xla"), tokens).logits
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             atol=0.05, rtol=0.05)
  positions = jnp.broadcast_to(jnp.arange(12), (2, 12))
  M.forward(params, config, tokens, positions)
  cache = M.init_cache(config, 2, 16)
  M.decode_step(params, config, cache, np.zeros(2, np.int32), np.zeros(2, np.int32))
  assert calls == ["cudnn"]
