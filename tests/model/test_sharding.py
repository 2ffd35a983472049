"""Sharding: the same code on 1 device and on an 8-device CPU mesh; the real shape, abstractly."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from trace_jax import model as M
from trace_jax.model import sharding

needs_8 = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices: run with "
                             "XLA_FLAGS=--xla_force_host_platform_device_count=8")


def mesh8(**shape):
  return sharding.make_mesh(shape or dict(data=2, fsdp=1, expert=2, tensor=2),
                            jax.devices()[:8])


@needs_8
@pytest.mark.parametrize("shape", [
    pytest.param(dict(data=2, fsdp=1, expert=2, tensor=2), id="dp2_ep2_tp2"),
    pytest.param(dict(data=1, fsdp=2, expert=4, tensor=1), id="fsdp2_ep4"),
])
def test_sharded_logits_match_single_device(shape):
  config = M.tiny()
  params = jax.tree.map(lambda x: x if x.ndim == 1 else x * 4.0, M.init_params(config, 0))
  toks = np.random.default_rng(0).integers(0, config.vocab_size, (4, 12), np.int32)
  ref = np.asarray(M.logits(params, config, toks))
  mesh = mesh8(**shape)
  sp = sharding.shard_params(params, mesh)
  moe = sp["layers"][0]["moe"]
  assert moe["gate_proj"].get_value().sharding.spec[0] == "expert"
  st = jax.device_put(toks, sharding.activation_sharding(mesh, toks.shape))
  out = M.logits(sp, config, st)
  assert len(out.sharding.device_set) == 8
  np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@needs_8
def test_qwen3_30b_a3b_builds_abstractly_and_shards():
  config = M.qwen3_30b_a3b()
  abstract = M.abstract_params(config)
  leaves = jax.tree.leaves(abstract)
  n = sum(int(np.prod(x.shape)) for x in leaves)
  assert 30.0e9 < n < 31.0e9, n  # Qwen3-30B-A3B: 30.5B parameters
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
  mesh = mesh8(data=1, fsdp=2, expert=2, tensor=2)
  shard = sharding.param_shardings(abstract, mesh)
  layer = shard["layers"][47]
  assert layer["moe"]["gate_proj"].get_value().spec == P("expert", "tensor", "fsdp")
  assert layer["moe"]["down_proj"].get_value().spec == P("expert", "fsdp", "tensor")
  assert layer["attn"]["q_proj"]["kernel"].get_value().spec == P("tensor", ("fsdp", "expert"))
  assert shard["lm_head"]["kernel"].get_value().spec == P("tensor", ("fsdp", "expert"))
  assert layer["input_norm"]["scale"].get_value().spec == P(None)
  # Per-device bytes of the sharded bf16 weights: about an eighth of ~61 GB.
  per_dev = sum(int(np.prod(s.shard_shape(x.shape))) * 2 for s, x in
                zip(jax.tree.leaves(shard), leaves))
  assert per_dev < 61e9 / 8 * 1.05
  # The forward traces at full width (shapes only, nothing allocated; 4 of the 48 layers).
  short = config.replace(num_hidden_layers=4, guided_layers=None)
  toks = jax.ShapeDtypeStruct((2, 8), np.int32)
  out = jax.eval_shape(lambda p, t: M.forward(p, short, t).logits, M.abstract_params(short),
                       toks)
  assert out.shape == (2, 8, config.vocab_size)


def test_logical_rules_drop_non_dividing_axes():
  mesh = sharding.make_mesh(dict(data=1), jax.devices()[:1])
  assert sharding.logical_to_spec(("exp", "mlp", "embed"), (8, 64, 128), mesh) == P(None, None,
                                                                                    None)
  with pytest.raises(ValueError, match="needs 16 devices"):
    sharding.make_mesh(dict(data=16))
  with pytest.raises(KeyError, match="no sharding rule"):
    sharding.logical_to_spec(("nope",), (4,), mesh)
