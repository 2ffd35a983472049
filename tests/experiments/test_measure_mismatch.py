"""measure_mismatch on the tiny config: guided rounding removes the FP4 flips RTN shows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import measure_mismatch
from trace_jax import model as model_lib
from trace_jax.quant import formats
from trace_jax.rollout.protocol import SamplingParams


@pytest.fixture(scope="module")
def report(tmp_path_factory):
  """What `measure_mismatch.main` does with --num_prompts=4 --prompt_len=10 --max_new=8."""
  config = measure_mismatch.tiny_config()
  params = model_lib.init_params(config, jax.random.fold_in(jax.random.key(0), 0))
  prompts = np.random.default_rng(0).integers(0, config.vocab_size, (4, 10)).tolist()
  sampling = [SamplingParams(max_new_tokens=8, seed=i) for i in range(4)]
  r = measure_mismatch.measure(params, config, prompts, sampling, keep_records=True)
  path = tmp_path_factory.mktemp("mismatch") / "m.png"
  measure_mismatch.plot(r, str(path))
  return r, path


def test_guided_sites_have_no_flips_and_rtn_has_some(report):
  r, _ = report
  assert r["flip_rate_trace"] == 0.0, r["policies"]["fp4_trace"]["per_layer"]
  assert r["flip_rate_rtn"] > 0.0, r["policies"]["fp4_rtn"]["per_layer"]


def _values(packed) -> np.ndarray:
  return np.asarray(formats.e2m1_decode(formats.unpack_fp4(jnp.asarray(packed))))


@pytest.mark.parametrize("policy", ["fp4_rtn", "fp4_trace"])
def test_flips_match_an_independent_count(report, policy):
  """The report's per-site flip rates against a count done here on the same batch: decoded
  E2M1 values (floats, so -0 == +0) compared element by element, expert_mid slots paired by
  expert id in a Python loop."""
  r, _ = report
  roll, train = r["records"]["rollout"], r["records"][policy]
  for layer, sites in roll["audit"]["guidance"].items():
    for site, rec in sites.items():
      a, b = _values(train["taps"][layer][site].codes), _values(rec.codes)
      if site == "expert_mid":
        flips = total = 0
        ti, ri = train["routing"][layer], roll["routing"][layer]
        for t in range(a.shape[0]):
          for j in range(a.shape[1]):
            match = [q for q in range(ri.shape[1]) if ri[t, q] == ti[t, j]]
            if match:
              flips += int(np.sum(a[t, j] != b[t, match[0]]))
              total += a.shape[-1]
        want = flips / total
      else:
        want = float(np.mean(a != b))
      assert r["policies"][policy]["per_layer"][str(layer)][site] == pytest.approx(
          want, abs=1e-12), (layer, site)


def test_trace_mismatch_not_above_rtn(report):
  r, _ = report
  assert r["mean_abs_dlogp"]["fp4_trace"] <= r["mean_abs_dlogp"]["fp4_rtn"]


def test_report_fields_and_plot(report):
  r, path = report
  for key in ("flip_rate_rtn", "flip_rate_trace", "routing_flip_rate", "mean_abs_dlogp",
              "k3_kl", "guidance_bytes_per_token"):
    assert key in r, key
  layers = r["policies"]["fp4_rtn"]["per_layer"]
  assert set(layers) == {"0", "1"}
  assert set(layers["1"]) == {"moe_in", "expert_mid", "k", "v", "routing", "routing_order_swaps"}
  assert path.stat().st_size > 10_000
  # Bytes: compact record of the guided layers and their int32 expert ids, per token, from
  # the formula.
  c = r["config"]
  per_token = sum(r["guidance_bytes_per_row_formula"][f"compact_K{k}"] * n for k, n in (
      (c["hidden_size"], 1), (c["moe_intermediate_size"], c["num_experts_per_tok"]),
      (c["head_dim"], 2 * c["num_key_value_heads"]))) + 4 * c["num_experts_per_tok"]
  assert np.isclose(r["guidance_bytes_per_token"], per_token * len(r["guided_layers"]))


def test_kernel_plan_rollout_is_reproduced_bit_for_bit(report):
  """The rollout on the decode kernels (Pallas interpreter here; packed NVFP4 experts and KV
  cache, the site kernel): its records equal the reference path's (the `report` fixture's)
  bit for bit, the trainer's fp4_trace forward reproduces its guided sites' codes (0 flips)
  and both policies' log-prob mismatch is the reference path's."""
  ref, _ = report
  config = measure_mismatch.tiny_config().replace(decode_impl="kernel")
  plan = model_lib.resolve_plan(config.replace(policy="fp4_trace"))  # the rollout's forward
  assert (plan.kv_cache, plan.nvfp4_sites) == ("packed", "kernel")
  params = model_lib.init_params(config, jax.random.fold_in(jax.random.key(0), 0))
  prompts = np.random.default_rng(0).integers(0, config.vocab_size, (4, 10)).tolist()
  sampling = [SamplingParams(max_new_tokens=8, seed=i) for i in range(4)]
  r = measure_mismatch.measure(params, config, prompts, sampling, keep_records=True)
  assert r["flip_rate_trace"] == 0.0, r["policies"]["fp4_trace"]["per_layer"]
  assert r["mean_abs_dlogp"] == ref["mean_abs_dlogp"]
  got, want = (x["records"]["rollout"]["audit"]["guidance"] for x in (r, ref))
  for layer, sites in want.items():
    for site, g in sites.items():
      np.testing.assert_array_equal(np.asarray(got[layer][site].codes), np.asarray(g.codes),
                                    err_msg=f"layer {layer} {site}")


def test_mxfp4_pair_end_to_end():
  """--format=mxfp4: the engine records MXFP4 (E8M0 scales per 32, no row scale), mxfp4_trace
  reproduces the rollout's codes at the guided layer, mxfp4_rtn flips some, and the bytes per
  token follow the MXFP4 formula."""
  config = measure_mismatch.tiny_config()
  params = model_lib.init_params(config, jax.random.fold_in(jax.random.key(0), 0))
  prompts = np.random.default_rng(0).integers(0, config.vocab_size, (4, 10)).tolist()
  sampling = [SamplingParams(max_new_tokens=8, seed=i) for i in range(4)]
  r = measure_mismatch.measure(params, config, prompts, sampling, fmt="mxfp4",
                               keep_records=True)
  assert list(r["policies"]) == ["mxfp4_rtn", "mxfp4_trace"] and r["format"] == "mxfp4"
  rec = r["records"]["rollout"]["audit"]["guidance"][1]["moe_in"]
  assert rec.format == "mxfp4" and rec.row_scale is None
  assert r["flip_rate_trace"] == 0.0, r["policies"]["mxfp4_trace"]["per_layer"]
  assert r["flip_rate_rtn"] > 0.0
  assert r["guidance_bytes_per_row_formula"]["compact_K128"] == 128 / 8 + 128 / 32


def test_by_decode_impl_ratios():
  """Two decode paths' reports: the first is the report, both summaries sit beside it and
  each policy's |dlogp| ratio is kernel over xla (a zero reference gives 1 only when equal)."""
  def fake(dlogp):
    return {"mean_abs_dlogp": dlogp, "k3_kl": {p: 0.0 for p in dlogp}, "flip_rate_rtn": 0.1,
            "flip_rate_trace": 0.0, "policies": {}}

  r = measure_mismatch.by_decode_impl({
      "xla": fake({"fp4_rtn": 0.02, "fp4_trace": 0.01, "z": 0.0}),
      "kernel": fake({"fp4_rtn": 0.03, "fp4_trace": 0.011, "z": 0.0})})
  assert r["mean_abs_dlogp"]["fp4_trace"] == 0.01  # the first report's
  assert set(r["by_decode_impl"]) == {"xla", "kernel"}
  assert r["fp4_trace_dlogp_kernel_over_xla"] == pytest.approx(1.1)
  assert r["fp4_rtn_dlogp_kernel_over_xla"] == pytest.approx(1.5)
  assert r["z_dlogp_kernel_over_xla"] == 1.0
  one = measure_mismatch.by_decode_impl({"kernel": fake({"fp4_trace": 0.01})})
  assert not any(k.endswith("_over_xla") for k in one)


def test_plan_fields_parse_and_refuse():
  """--plan_fields entries become config fields; a field that is no plan field, or a value that
  is not one of its choices, is refused naming the entry."""
  assert measure_mismatch.plan_fields(["decode_attention=fused", "layer_loop=unrolled"]) == {
      "decode_attention": "fused", "layer_loop": "unrolled"}
  for bad, match in (("decode_attention", "want field=value"), ("dtype=float32", "field one of"),
                     ("decode_attention=flash", "decode_attention is one of")):
    with pytest.raises(ValueError, match=match):
      measure_mismatch.plan_fields([bad])
