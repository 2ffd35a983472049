"""Precision policies as data: every run policy is two registered forwards; bad ones refuse."""

import pytest

from trace_jax import model as M
from trace_jax.model import config, policies
from trace_jax.model.policies import FORWARDS, POLICIES, Forward, PrecisionPolicy


def test_every_run_policy_pairs_registered_forwards():
  for name, p in POLICIES.items():
    assert p.name == name
    assert FORWARDS[p.rollout.name] is p.rollout and FORWARDS[p.train.name] is p.train
    # A guided trainer needs a rollout in its FP4 format that records (the TRACE forwards).
    assert not p.guided or (p.rollout.guided and p.rollout.fp4 == p.train.fp4)
    for fwd in (p.rollout, p.train):  # both forwards valid on a shape FP8 blocks can hold
      M.tiny(policy=fwd.name, num_key_value_heads=4, moe_intermediate_size=128)
  assert POLICIES["fp4_rollout"].train.name == "bf16" and POLICIES["fp8_rollout"].train.name \
      == "bf16"  # the off-policy baselines
  assert {p.train.fp4 for p in POLICIES.values() if p.fp4_train} == {"nvfp4", "mxfp4"}


@pytest.mark.parametrize("kwargs,match", [
    (dict(fp4="fp6"), "unknown FP4 format 'fp6'"),
    (dict(guided=True), "guided rounding needs an FP4 format"),
    (dict(fp4="nvfp4", fp8_linears=True), "not combined"),
], ids=["unknown_format", "guided_without_fp4", "fp4_and_fp8"])
def test_bad_forwards_refuse(kwargs, match):
  with pytest.raises(ValueError, match=match):
    Forward("x", **kwargs)


def test_bad_run_policies_refuse():
  with pytest.raises(ValueError, match="guided training needs a rollout in its format"):
    PrecisionPolicy("x", FORWARDS["fp4_trace"], FORWARDS["mxfp4_trace"], "")
  with pytest.raises(ValueError, match="unknown precision policy 'fp5'"):
    policies.parse("fp5")
  with pytest.raises(ValueError, match=r"\+r3 replays the routing"):
    policies.parse("bf16+r3")
  assert policies.parse("mxfp4_trace+r3").replay
  assert policies.parse("fp8_unified+fp8bwd").fp8_backward
  assert not policies.parse("fp8_unified").fp8_backward
  for name in ("bf16+fp8bwd", "fp8_rollout+fp8bwd"):  # trained without FP8 linears
    with pytest.raises(ValueError, match="trains without FP8 linears"):
      policies.parse(name)


@pytest.mark.parametrize("section,overrides,want", [
    ("tiny", {}, dict(hidden_size=128, policy="bf16")),
    ({"preset": "qwen3_30b_a3b", "num_hidden_layers": 2}, {"policy": "fp4_trace"},
     dict(hidden_size=2048, num_hidden_layers=2, policy="fp4_trace")),
    ({"hidden_size": 64, "guided_layers": [0]}, {}, dict(hidden_size=64, guided_layers=(0,))),
], ids=["preset_name", "preset_with_overrides", "default_preset"])
def test_resolve(section, overrides, want):
  c = config.resolve(section, **overrides)
  assert {k: getattr(c, k) for k in want} == want


@pytest.mark.parametrize("section,match", [
    ("tiny_h200", "unknown model preset 'tiny_h200'"),
    ({"hidden": 64}, r"unknown model fields \['hidden'\]"),
], ids=["preset", "field"])
def test_resolve_refuses_unknown_names(section, match):
  with pytest.raises(ValueError, match=match):
    config.resolve(section)
