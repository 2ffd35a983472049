"""The training-step benchmark's policy syntax (`experiments.bench.variants.train_variant`):
the config each `name@impl+option` string times."""

from __future__ import annotations

import pytest
from absl import app

from experiments.bench import variants
from trace_jax import model as M

BASE = M.tiny(moe_intermediate_size=128, head_dim=64)  # FP8 blocks of 128 fit


@pytest.mark.parametrize("policy,want", [
    pytest.param("bf16", dict(policy="bf16", fp8_gemm="auto", fp8_backward=False,
                              layer_loop="auto"), id="plain"),
    pytest.param("fp8_unified@xla", dict(policy="fp8_unified", fp8_gemm="xla"), id="fp8_xla"),
    pytest.param("fp8_unified@kernel+fp8bwd", dict(policy="fp8_unified", fp8_gemm="kernel",
                                                   fp8_backward=True), id="fp8_full"),
    pytest.param("bf16+scan", dict(layer_loop="scan"), id="scan"),
    pytest.param("fp4_trace+fake_quant=kernel+unrolled",
                 dict(policy="fp4_trace", fake_quant="kernel", layer_loop="unrolled"),
                 id="plan_field"),
])
def test_policy_strings_set_the_config(policy, want):
  config = variants.train_variant(BASE, "tiled", "xla", policy)
  assert (config.moe_impl, config.seq_attention) == ("tiled", "xla")
  assert {k: getattr(config, k) for k in want} == want


@pytest.mark.parametrize("policy,pattern", [
    pytest.param("bf16+fast", "options are", id="unknown_option"),
    pytest.param("bf16+scan+unrolled", "options are", id="two_loops"),
    pytest.param("bf16+speed=max", "not plan fields", id="unknown_field"),
    pytest.param("bf16+moe_impl=tiled", "own flags", id="flag_field"),
])
def test_bad_policy_strings_are_refused(policy, pattern):
  with pytest.raises(app.UsageError, match=pattern):
    variants.train_variant(BASE, "tiled", "xla", policy)


def _row(ms, policy, fp8_gemm="xla", fp8_backward=False):
  return {"ms_per_step": ms, "policy": policy, "fp8_gemm": fp8_gemm,
          "fp8_backward": fp8_backward}


@pytest.mark.parametrize("rows,want", [
    pytest.param({"t x bf16": _row(10.0, "bf16"), "t x fp8_unified": _row(8.0, "fp8_unified",
                                                                          "kernel"),
                  "t x fp4_trace": _row(11.0, "fp4_trace")},
                 {"fp8_unified_over_bf16": 0.8, "fp4_trace_over_bf16": 1.1},
                 id="plain_name_on_the_kernels"),
    pytest.param({"t x bf16": _row(10.0, "bf16"),
                  "t x fp8_unified@xla": _row(400.0, "fp8_unified", "xla"),
                  "t x fp8_unified@kernel+fp8bwd": _row(7.0, "fp8_unified", "kernel", True)},
                 {"fp8_full_over_bf16": 0.7}, id="reference_gemm_is_no_headline"),
    pytest.param({"t x bf16": _row(10.0, "bf16"),
                  "t x fp8_unified@kernel": _row(13.0, "fp8_unified", "kernel"),
                  "t x fp8_unified@wgmma": _row(12.0, "fp8_unified", "wgmma")},
                 {"fp8_unified_over_bf16": 1.2}, id="wgmma_before_triton"),
    pytest.param({"u x bf16": _row(5.0, "bf16"), "t x bf16": _row(10.0, "bf16"),
                  "u x fp4_trace": _row(5.5, "fp4_trace"),
                  "t x fp4_trace": _row(20.0, "fp4_trace")},
                 {"fp4_trace_over_bf16": 2.0}, id="first_impl_only"),
])
def test_headline_ratios(rows, want):
  """The headline keys come from the first impl's rows, the FP8 ones only from rows whose plan
  ran the FP8 GEMM kernels, wgmma's first (a plain name counts where the plan resolved to
  them)."""
  got = variants.headline_ratios(rows, "t x", flop=5e12, rate=1e15)
  assert got.pop("bf16_mfu") == pytest.approx(5e12 / 10e-3 / 1e15)
  assert got == pytest.approx(want)
