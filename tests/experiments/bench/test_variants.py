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
