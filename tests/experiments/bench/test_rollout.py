"""bench_rollout: the byte accounting against the arrays the engine holds, the fixed-memory fit,
the top-level keys, and one CPU run of every part (fixed batch, fixed memory, transformers)."""

from __future__ import annotations

import types

import jax
import numpy as np
import pytest
from absl import flags

from experiments import common
from experiments.bench import rollout as br
from experiments.bench import rollout_bytes as rb
from trace_jax import model as model_lib
from trace_jax.model import expert_weights


def preset_config(preset: str = "cpu", **overrides) -> model_lib.ModelConfig:
  return model_lib.tiny(**dict(br.PRESETS[preset]["model"], dtype="bfloat16", **overrides))


def nbytes(tree) -> int:
  return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


def engine_held_bytes(config) -> int:
  """Bytes of the weights an InProcessEngine holds for `config` (its `_set_params`: the params,
  or with decode_impl "kernel" the prepared weights + the params without their copies), from
  the arrays' shapes (no memory, any model size)."""
  params = model_lib.abstract_params(config, "bfloat16")
  if config.decode_impl != "kernel":
    return nbytes(params)
  held = jax.eval_shape(lambda p: (expert_weights.prepare(p, config),
                                   expert_weights.drop_prepared(p, config)), params)
  return nbytes(held)


# FP8 blocks are 128 x 128: the FP8 cases widen the CPU model's experts and heads to 128 rows.
FP8_SHAPE = dict(head_dim=64, moe_intermediate_size=128)


@pytest.mark.parametrize("preset,policy,impl,extra", [
    pytest.param("cpu", "bf16", "xla", {}, id="cpu_bf16_xla"),
    pytest.param("cpu", "bf16", "kernel", {}, id="cpu_bf16_kernel"),
    pytest.param("cpu", "fp4_rtn", "xla", {}, id="cpu_fp4_rtn_xla"),
    pytest.param("cpu", "fp4_rtn", "kernel", {}, id="cpu_fp4_rtn_kernel"),
    pytest.param("cpu", "fp4_trace", "kernel", {}, id="cpu_fp4_trace_kernel"),
    pytest.param("cpu", "fp8_unified", "kernel", FP8_SHAPE, id="cpu_fp8_unified_kernel"),
    pytest.param("cpu", "fp8_unified", "xla", FP8_SHAPE, id="cpu_fp8_unified_xla"),
    pytest.param("h200", "bf16", "kernel", {}, id="h200_bf16_kernel"),
    pytest.param("h200", "fp4_rtn", "kernel", {}, id="h200_fp4_rtn_kernel"),
    pytest.param("h200", "fp8_unified", "kernel", {}, id="h200_fp8_unified_kernel"),
])
def test_weight_bytes_match_the_engines_arrays(preset, policy, impl, extra):
  config = preset_config(preset, **extra).replace(policy=policy, decode_impl=impl,
                                                  fp8_gemm=impl)
  assert rb.weight_bytes(config) == pytest.approx(engine_held_bytes(config), rel=1e-12)


def test_bf16_weight_bytes_are_the_params():
  config = preset_config()
  params = model_lib.init_params(config, 0, param_dtype="bfloat16")
  assert rb.weight_bytes(config) == sum(a.nbytes for a in jax.tree.leaves(params))


@pytest.mark.parametrize("preset,policy,impl", [("cpu", "bf16", "xla"), ("h200", "bf16", "xla"),
                                                ("h200", "fp4_rtn", "kernel")],
                         ids=["cpu", "h200", "h200_packed_kv"])
def test_kv_and_step_bytes(preset, policy, impl):
  config = preset_config(preset).replace(policy=policy, decode_impl=impl)
  cache = jax.eval_shape(lambda: model_lib.init_cache(config, 3, 40))
  if impl == "kernel":  # packed NVFP4: 76 of 256 bytes per head row of 128
    assert rb.kv_bytes_per_token(config) * 256 == rb.kv_bytes_per_token(
        config.replace(decode_impl="xla")) * 76
  assert rb.kv_bytes_per_token(config) * 3 * 40 == nbytes(cache)
  # Every expert touched, no sequence: a step reads all weights but the embedding table.
  layout = rb.byte_layout(config)
  assert rb.step_bytes(config, 0, 0, config.num_experts) == pytest.approx(
      rb.weight_bytes(config) - layout["embed"])
  assert rb.step_bytes(config, 2, 10, 1) - rb.step_bytes(config, 2, 0, 1) == pytest.approx(
      2 * 10 * rb.kv_bytes_per_token(config))


def test_fit_is_monotone_and_explains_zero():
  weights, per_seq = 1000.0, 64.0
  fits = [rb.fit_sequences(b, weights, per_seq)[0] for b in np.linspace(0, 5000, 201)]
  assert fits == sorted(fits) and fits[-1] == (5000 - 1000) // 64
  n, why = rb.fit_sequences(999.0, weights, per_seq)
  assert n == 0 and "does not hold the weights" in why
  n, why = rb.fit_sequences(1063.0, weights, per_seq)
  assert n == 0 and "not one sequence" in why
  assert rb.fit_sequences(1064.0, weights, per_seq) == (1, "")


def test_budget_plan_counts_fp4_trace_records():
  """fp4_trace's engine keeps guidance and routing records per token: each sequence costs
  them on top of its KV cache; the fit grows with the budget."""
  config = preset_config().replace(policy="fp4_trace", decode_impl="kernel")
  engine = br._engine(model_lib.init_params(config, 0, param_dtype="bfloat16"), config, 4)[0]
  kv = 64 * rb.kv_bytes_per_token(config)
  runs = [rb.budget_plan(engine, b, 64) for b in np.linspace(0.5e6, 3e6, 11)]
  for budget, r in zip(np.linspace(0.5e6, 3e6, 11), runs):
    assert r["weight_bytes"] == rb.weight_bytes(config) and r["kv_bytes_per_seq"] == kv
    assert 0 < r["record_bytes_per_seq"] < kv
    free = budget - r["weight_bytes"]
    assert r["sequences"] == max(0, int(free // (kv + r["record_bytes_per_seq"])))
  fits = [r["sequences"] for r in runs]
  assert fits == sorted(fits) and fits[0] == 0 and "skipped" in runs[0]
  assert 0 < fits[-1] < (3e6 - runs[-1]["weight_bytes"]) // kv  # fewer than without records


def test_budget_plan_counts_what_a_session_turn_holds():
  """The fixed-memory case's records per sequence are what its decode turn holds on the
  device: over the compiled `decode.extend` program's buffers (arguments, temporaries and
  outputs, less the donated ones), recording adds the fed chunk's rows and the decode loop's
  step rows, both counted by `budget_plan`, and nothing that grows with the context (the
  session's earlier records are on the host)."""
  import jax.numpy as jnp

  from trace_jax.rollout import decode
  from trace_jax.rollout import engine as engine_lib
  from trace_jax.rollout.protocol import SamplingParams

  config = model_lib.tiny(vocab_size=64, policy="bf16", decode_steps_per_sync=4)
  params = model_lib.init_params(config, 0, param_dtype="float32")
  b, new = 4, 16
  held, plans = {}, {}
  for routing in (False, True):
    eng = engine_lib.InProcessEngine(params, config, record_routing=routing, max_batch=b)
    for context in (128, 256):
      session = eng.open_session(b, context - 1)
      tap_layers, tap_mode = eng._tap_plan()
      sp = [SamplingParams(max_new_tokens=new, temperature=0.0)] * b
      m = decode.extend.lower(
          eng.params, config, session.cache, jnp.full(b, context - new - 2),
          jnp.ones((b, 1), jnp.int32), jnp.ones(b, jnp.int32), *eng._sampling_arrays(sp, b),
          max_new=engine_lib.new_tokens_bucket(new), truncate=False, tap_layers=tap_layers,
          tap_mode=tap_mode, tap_routing=routing, experts=eng.experts, layers=eng.layers,
          plan=eng.plan).compile().memory_analysis()
      held[routing, context] = (m.argument_size_in_bytes + m.temp_size_in_bytes
                                + m.output_size_in_bytes - m.alias_size_in_bytes)
      plans[routing, context] = rb.budget_plan(eng, 1e9, context, new_tokens=new)
  assert plans[False, 128]["record_bytes_per_seq"] == 0
  row = config.num_hidden_layers * config.num_experts_per_tok * 4  # int32 expert ids
  for context in (128, 256):
    rec = plans[True, context]["record_bytes_per_seq"]
    steps = plans[True, context]["decode_record_bytes_per_seq"]
    assert (rec, steps) == (row * (1 + 16 + 3), row * (16 + 3))
    assert plans[True, context]["host_record_bytes_per_seq"] == row * context
    extra = held[True, context] - held[False, context]
    # Beyond the rows: a chunk's taps before they are packed (tens of bytes a row here).
    assert b * rec <= extra <= 1.1 * b * rec, (held, rec)
  assert held[True, 256] - held[False, 256] == held[True, 128] - held[False, 128], held
  assert rb.budget_plan(eng, 1e9, 128)["record_bytes_per_seq"] == row


def test_summary_keys():
  def case(tps, **kw):
    return dict(tokens_per_s=tps, **kw)
  res = {"key_batch": 64, "layers": 24,
         "cases": {"bf16:kernel:64": case(100.0, read_fraction=0.4, copy_fraction=0.38,
                                          compile_s=5.0, engine_init_s=0.5,
                                          update_weights_s=0.2),
                   "fp4_rtn:kernel:64": case(80.0, compile_s=60.0, engine_init_s=9.0,
                                             update_weights_s=0.1),
                   "fp4_trace:kernel:64": case(72.0), "fp8_unified:kernel:64": case(110.0),
                   "bf16:kernel:8": case(30.0)},
         "fixed_memory": {"cases": {"bf16": case(50.0, sequences=100, compile_s=70.0),
                                    "fp4_rtn": case(60.0, sequences=130)}},
         "fixed_memory_32k": {"cases": {"bf16": case(10.0, sequences=25),
                                        "fp4_rtn": case(35.0, sequences=90),
                                        "fp4_trace": case(31.5, sequences=80)}},
         "long_context": {"cases": {"bf16": case(20.0), "fp4_rtn": case(50.0),
                                    "fp4_trace": case(45.0, compile_s=80.0)}},
         "transformers": {"cases": {"64": {"tokens_per_s": 20.0}}}}
  got = br.summary(res)
  want = {"fp4_over_bf16_fixed_batch": 0.8, "fp8_over_bf16_fixed_batch": 1.1,
          "fp4_trace_over_fp4_rtn_b64": 0.9, "decode_bandwidth_fraction": 0.4,
          "decode_bandwidth_fraction_copy": 0.38, "fp4_over_bf16_fixed_memory": 1.2,
          "fp4_over_bf16_fixed_memory_sequences": 1.3, "bf16_over_transformers": 5.0,
          "fp4_over_bf16_fixed_memory_32k": 3.5, "fp4_over_bf16_fixed_memory_32k_sequences": 3.6,
          "fp4_trace_over_fp4_rtn_fixed_memory_32k": 0.9, "fp4_over_bf16_long_context": 2.5,
          "fp4_trace_over_fp4_rtn_long_context": 0.9,
          "fp4_over_transformers": 4.0, "compile_s_max": 80.0,
          "compile_s_max_case": "long:fp4_trace", "compile_s_24_layers": 80.0,
          "engine_init_s_max": 9.0, "engine_init_s_max_case": "fp4_rtn:kernel:64",
          "update_weights_s_max": 0.2, "update_weights_s_max_case": "bf16:kernel:64"}
  assert set(got) == set(want)
  for k, v in want.items():
    assert got[k] == (v if isinstance(v, str) else pytest.approx(v)), k
  assert br.summary({"key_batch": 64, "layers": 8, "cases": {}}) == {}
  # --key_impl: the fixed-batch keys come from that impl's cases, not the plain kernel's.
  tuned = br.summary(dict(res, key_impl="kernel+sync4", cases={
      **res["cases"], "bf16:kernel+sync4:64": case(100.0, read_fraction=0.5, copy_fraction=0.45),
      "fp4_rtn:kernel+sync4:64": case(100.0), "fp4_trace:kernel+sync4:64": case(80.0)}))
  assert tuned["fp4_over_bf16_fixed_batch"] == pytest.approx(1.0)
  assert tuned["fp4_trace_over_fp4_rtn_b64"] == pytest.approx(0.8)
  assert tuned["decode_bandwidth_fraction"] == 0.5 and "fp8_over_bf16_fixed_batch" not in tuned
  assert br.ratios({"bf16:xla:8": case(10.0), "bf16:kernel:8": case(30.0),
                    "fp4_rtn:kernel:8": case(15.0)}) == {
                        "kernel_over_xla_bf16_b8": 3.0, "fp4_rtn_over_bf16_kernel_b8": 0.5}
  assert br.ratios({"fp4_rtn:kernel:8": case(15.0), "fp4_rtn:kernel_bytes:8": case(12.0)}) == {
      "kernel_words_over_bytes_fp4_rtn_b8": 1.25}
  assert br.ratios({"fp4_trace:kernel:8": case(20.0), "fp4_trace:kernel+unroll2:8": case(22.0),
                    "fp4_trace:kernel+unrolled:8": case(16.0)}) == {
      "fp4_trace_kernel_unroll2_over_kernel_b8": pytest.approx(1.1),
      "fp4_trace_kernel_unrolled_over_kernel_b8": pytest.approx(0.8)}
  assert br.ratios({"fp4_rtn:kernel+sync4:8": case(25.0), "fp4_trace:kernel+sync4:8": case(20.0),
                    "bf16:kernel+sync4:8": case(40.0)}) == {
      "fp4_trace_over_fp4_rtn_kernel_sync4_b8": pytest.approx(0.8),
      "fp4_rtn_over_bf16_kernel_sync4_b8": pytest.approx(0.625),
      "fp4_trace_over_bf16_kernel_sync4_b8": pytest.approx(0.5)}


@pytest.mark.parametrize("impl, want", [
    pytest.param("kernel", ("kernel", {}), id="plain"),
    pytest.param("kernel_bytes", ("kernel", {"fp4_codes": "bytes"}), id="codes_as_bytes"),
    pytest.param("kernel+unroll2", ("kernel", {"scan_unroll": 2}), id="unroll2"),
    pytest.param("xla+unrolled", ("xla", {"scan_layers": False}), id="unrolled"),
    pytest.param("kernel+unroll4+sync8", ("kernel", {"scan_unroll": 4,
                                                     "decode_steps_per_sync": 8}), id="both"),
    pytest.param("kernel+unroll4+moetriton", ("kernel", {"scan_unroll": 4,
                                                         "decode_moe_kernel": "triton"}),
                 id="moe_triton"),
    pytest.param("kernel+moewgmma", ("kernel", {"decode_moe_kernel": "wgmma"}), id="moe_wgmma"),
    pytest.param("kernel+attnfused", ("kernel", {"decode_attention": "fused"}),
                 id="attention_fused"),
    pytest.param("kernel+attntriton", ("kernel", {"decode_attention": "triton"}),
                 id="attention_triton"),
    pytest.param("kernel+unroll4+kvappend", ("kernel", {"scan_unroll": 4, "kv_write": "kernel"}),
                 id="kv_append"),
    pytest.param("kernel+kvxla", ("kernel", {"kv_write": "xla"}), id="kv_write_xla"),
])
def test_impl_options(impl, want):
  assert br.impl_options(impl) == want


def test_impl_case_is_a_config():
  """An entry's case is the base config with its fields: nothing else changes for it."""
  base = types.SimpleNamespace(replace=lambda **kw: kw)
  assert br._impl_case(base, "fp4_rtn", "kernel_bytes+moetriton") == {
      "policy": "fp4_rtn", "decode_impl": "kernel", "fp8_gemm": "kernel", "fp4_codes": "bytes",
      "decode_moe_kernel": "triton"}


@pytest.mark.parametrize("impl, match", [
    pytest.param("kernel+unroll0", "options are", id="unroll0"),
    pytest.param("kernel+sync0", "options are", id="sync0"),
    pytest.param("kernel+fast", "options are", id="unknown_option"),
    pytest.param("kernel+stream4", "options are", id="stream"),
    pytest.param("kernel+attntwopass", "options are", id="removed_two_pass_attention"),
    pytest.param("triton", "is not one of", id="unknown_impl"),
])
def test_bad_impls_are_refused(impl, match):
  with pytest.raises(ValueError, match=match):
    br.impl_options(impl)
  for flag in ("impls", "key_impl", "budget_impl"):  # refused at parse, before any work
    with pytest.raises(flags.IllegalFlagValueError, match=match):
      br.main(["prog", f"--{flag}={impl}"])


@pytest.mark.parametrize("value", [
    pytest.param("cuGraphLaunch", id="no_index"), pytest.param("cuGraphLaunch:x", id="bad_index"),
])
def test_bad_profile_timeline_is_refused(value):
  with pytest.raises(flags.IllegalFlagValueError, match="must be ANCHOR:N"):
    br.main(["prog", f"--profile_timeline={value}"])


def test_cpu_run(tmp_path):
  """Fixed batch (bf16, kernel), fixed memory (bf16 and fp4_rtn, kernel) and the transformers
  reference on the CPU model; a budget of the BF16 weights + 2.5 sequences."""
  context, new = 32, 8
  config = preset_config()
  per_seq = nbytes(jax.eval_shape(lambda: model_lib.init_cache(config, 1, context)))
  budget = engine_held_bytes(config.replace(decode_impl="kernel")) + 2.5 * per_seq
  out = tmp_path / "rollout.json"
  res = br.main(["prog", "--preset=cpu", "--policies=bf16", "--impls=kernel", "--prompt_len=8",
                 f"--new_tokens={new}", "--reps=1", "--budget_policies=bf16,fp4_rtn",
                 f"--budget_gb={budget / 1e9}", f"--budget_context={context}",
                 "--budget_max_batch=4", "--transformers", "--long_context=24",
                 f"--json_out={out}"])
  cases = res["cases"]
  assert set(cases) == {"bf16:kernel:4"}
  for c in cases.values():
    assert c["tokens_per_s"] > 0 and c["tokens"] == 4 * new and c["step_bytes"] > 0
    assert 0 < c["read_fraction"] and 0 < c["copy_fraction"] and c["compile_s"] >= 0
    assert c["engine_init_s"] > 0 and c["update_weights_s"] > 0
  assert res["ratios"] == {} and out.stat().st_size > 500

  fm = res["fixed_memory"]["cases"]
  assert fm["bf16"]["sequences"] == 2 and fm["bf16"]["batch"] == 2
  assert fm["fp4_rtn"]["sequences"] > 2 and fm["fp4_rtn"]["batch"] == 4
  for policy, c in fm.items():
    assert c["tokens"] == c["batch"] * new and c["tokens_per_s"] > 0, policy
    assert c["total_bytes"] <= budget
  long = res["long_context"]["cases"]["bf16"]
  assert (long["batch"], long["tokens"]) == (4, 4 * new) and "sequences" not in long
  for c in (*fm.values(), long):
    assert 0 < c["read_fraction"] and c["step_bytes"] > 0
  hf = res["transformers"]["cases"]["4"]
  assert hf["tokens"] == 4 * new and hf["tokens_per_s"] > 0 and "first_token_agreement" in hf

  for key in ("decode_bandwidth_fraction", "decode_bandwidth_fraction_copy",
              "fp4_over_bf16_fixed_memory", "bf16_over_transformers", "compile_s_max",
              "compile_s_2_layers", "engine_init_s_max", "update_weights_s_max"):
    assert res[key] > 0, key
  assert res["fp4_over_bf16_fixed_memory_sequences"] == fm["fp4_rtn"]["sequences"] / 2
  # Not run: no FP4/FP8 fixed-batch case, so no key claims one.
  for key in ("fp4_over_bf16_fixed_batch", "fp8_over_bf16_fixed_batch", "fp4_over_transformers"):
    assert key not in res, key


def test_budget_below_one_sequence_is_reported(capsys):
  config = preset_config()
  weights = engine_held_bytes(config.replace(decode_impl="kernel"))
  res = br.main(["prog", "--preset=cpu", "--policies=bf16", "--budget_policies=bf16",
                 "--cases=none", "--reps=1", "--new_tokens=8", "--budget_context=32",
                 f"--budget_gb={(weights + 10) / 1e9}"])
  c = res["fixed_memory"]["cases"]["bf16"]
  assert c["sequences"] == 0 and "not one sequence" in c["skipped"] and "tokens_per_s" not in c
  assert "not one sequence" in capsys.readouterr().out
  assert "fp4_over_bf16_fixed_memory" not in res and "compile_s_max" not in res


class _RecordingEngine:
  """An engine stand-in that records: each call hands off 100 bytes of records; a read of
  `last_guidance` is a wait for them (counted)."""

  experts = layers = None

  def __init__(self):
    self.emit_seconds, self.emit_bytes, self.waits, self.updates = 0.0, 0, 0, 0

  def update_weights(self, params):
    self.updates += 1

  def generate(self, prompts, sp):
    self.emit_bytes += 100
    return [types.SimpleNamespace(tokens=[1] * sp.max_new_tokens) for _ in prompts]

  @property
  def last_guidance(self):
    self.waits += 1
    return {}


@pytest.mark.parametrize("drain,warmup,waits", [
    pytest.param("overlap", 0, 1, id="overlap_waits_once_after_the_timed_calls"),
    pytest.param("each", 0, 1 + 3 + 1, id="each_waits_in_every_call"),
    pytest.param("each", 2, 1 + 2 + 3 + 1, id="each_waits_in_warmup_calls_too"),
])
def test_records_drain(monkeypatch, drain, warmup, waits):
  engine = _RecordingEngine()
  monkeypatch.setattr(br, "_engine", lambda params, config, batch: (engine, 0.0))
  common.parse_flags(br.FLAGS, ["prog", f"--records_drain={drain}", "--new_tokens=2",
                               "--prompt_len=3", f"--warmup_calls={warmup}"])
  try:
    config = types.SimpleNamespace(vocab_size=16, policy="fp4_trace")
    r, first = br.run_case(None, config, batch=2, reps=3, name="fp4_trace:kernel:2")
  finally:
    br.FLAGS.unparse_flags()
  assert engine.waits == waits and engine.updates == 1 and r["update_weights_s"] >= 0
  assert r["emit_bytes_per_call"] == 100 and r["tokens"] == 4 and first == [1, 1]
  # the first call, the untimed warm-up calls and the timed ones
  assert len(r["emit_s_calls"]) == 1 + warmup + 3 and len(r["warmup_calls_s"]) == warmup
  assert 0 < r["generate_s"] <= r["median_s"]
