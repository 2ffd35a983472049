"""Expert parallelism (`trace_jax.model.expert_parallel`) on an 8-device CPU mesh against one
device: logits and gradients within float32 summation order, the records in the one-device
layout and values, guided training forwards alike; and the compiled program keeps the expert
weights sharded (XLA's own partitioning, without the shard_map, gathers them)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import assert_bits_equal

from trace_jax import model as M
from trace_jax.model import expert_parallel, expert_weights, mesh_context, sharding

needs_8 = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices: run with "
                             "XLA_FLAGS=--xla_force_host_platform_device_count=8")

MESHES = [
    pytest.param(dict(data=1, fsdp=2, expert=2, tensor=2), id="fsdp2_ep2_tp2"),
    pytest.param(dict(data=2, fsdp=1, expert=4, tensor=1), id="dp2_ep4"),
    pytest.param(dict(data=1, fsdp=1, expert=8, tensor=1), id="ep8"),
    # expert 1: the block data-parallel (every expert on each device, weights gathered over fsdp)
    pytest.param(dict(data=2, fsdp=2, expert=1, tensor=2), id="dp2_fsdp2_tp2"),
]


def _setup(policy: str = "bf16", mesh_shape=None, **overrides):
  config = M.tiny(policy=policy, **overrides)
  params = jax.tree.map(lambda x: x if x.ndim == 1 else x * 4.0, M.init_params(config, 0))
  toks = np.random.default_rng(0).integers(0, config.vocab_size, (8, 16), np.int32)
  mesh = sharding.make_mesh(mesh_shape or dict(expert=8), jax.devices()[:8])
  return config, params, toks, mesh


def _on_mesh(fn, mesh, params, *args):
  """fn(params, *args) jitted on params sharded over `mesh`, batch sharded, experts parallel."""
  sp = sharding.shard_params(params, mesh)
  args = [jax.device_put(a, sharding.activation_sharding(mesh, a.shape)) for a in args]
  with mesh_context.use_mesh(mesh):
    return jax.jit(fn)(sp, *args), sp


@needs_8
@pytest.mark.parametrize("shape", MESHES)
def test_logits_and_gradients_match_one_device(shape):
  config, params, toks, mesh = _setup(mesh_shape=shape)

  def loss(p, t):
    logp = jax.nn.log_softmax(M.forward(p, config, t).logits.astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp[:, :-1], t[:, 1:, None], axis=-1))

  ref_l, ref_g = jax.jit(jax.value_and_grad(loss))(params, toks)
  (l, g), _ = _on_mesh(jax.value_and_grad(loss), mesh, params, toks)
  np.testing.assert_allclose(float(l), float(ref_l), rtol=1e-5)
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref_g)):
    a, b = np.asarray(a), np.asarray(b)
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * max(np.abs(b).max(), 1e-30))


@needs_8
@pytest.mark.parametrize("policy", ["fp4_rtn", "fp8_unified"])
def test_quantized_forwards_match_one_device(policy):
  """The weights' per-expert quantization (NVFP4 tensor scale per expert; FP8 128 x 128
  blocks; `Precision.expert_weights` / `grouped`) runs on each device's own experts."""
  # FP8: blocks of 128 along every contraction axis
  sizes = dict(moe_intermediate_size=128, head_dim=64) if policy == "fp8_unified" else {}
  config, params, toks, mesh = _setup(policy, dict(fsdp=2, expert=4), **sizes)
  fn = lambda p, t: M.forward(p, config, t).logits
  want = np.asarray(jax.jit(fn)(params, toks))
  got, _ = _on_mesh(fn, mesh, params, toks)
  # Layer 0's outputs differ in summation order; a layer-1 activation at an FP4/FP8 rounding
  # boundary then rounds the other way: a few tokens move by about one quantization step.
  diff = np.abs(np.asarray(got) - want)
  scale = np.abs(want).max()
  assert diff.max() <= 2e-2 * scale, diff.max()
  off = diff.max(axis=-1) > 1e-4 * scale
  assert off.mean() <= 0.05, f"{int(off.sum())} of {off.size} tokens differ"


@needs_8
def test_records_match_one_device():
  """fp4_trace rollout-side forward with taps on ep4 x dp2 against one device: the records
  have the one-device layout, and layer 0's (routing, moe_in, k, v and expert_mid, the
  expert-parallel site) are bit for bit the same. Later layers' inputs differ in summation
  order (layer 0's outputs are summed over devices). A guided forward given the one-device
  records, its fake quantizers on their kernels (`fake_quant="kernel"`: the weights in the
  expert-parallel block, the guided sites per batch shard), gives the one-device XLA
  quantizers' logits within summation order. Both layers guided: one run of layers, one scan
  body per program (a guided and an unguided run compile two)."""
  config, params, toks, mesh = _setup("fp4_trace", dict(data=2, expert=4), guided_layers=(0, 1))
  config = config.replace(dtype="bfloat16")
  layers = tuple(range(config.num_hidden_layers))
  run = lambda p, t: M.forward(p, config, t, tap_layers=layers, record=True)
  ref = jax.jit(run)(params, toks)
  out, sp = _on_mesh(run, mesh, params, toks)
  for layer in layers:
    assert set(out.taps[layer]) == set(ref.taps[layer]) >= {"routing", "moe_in", "expert_mid"}
    for site, want in ref.taps[layer].items():
      got = out.taps[layer][site]
      assert jax.tree.structure(got) == jax.tree.structure(want), (layer, site)
      for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.shape == b.shape and a.dtype == b.dtype, (layer, site)
        if layer == 0:
          assert_bits_equal(a, b, f"layer {layer} {site}")
  guidance = {l: {s: g for s, g in sites.items() if s != "routing"}
              for l, sites in ref.taps.items()}
  routing = {l: sites["routing"] for l, sites in ref.taps.items()}
  guided = lambda c: lambda p, t, g, r: M.forward(p, c, t, guidance=g, routing=r).logits
  want = np.asarray(jax.jit(guided(config))(params, toks, guidance, routing), np.float32)
  with mesh_context.use_mesh(mesh):  # the fake quantizers on their kernels, per device
    got = np.asarray(jax.jit(guided(config.replace(fake_quant="kernel")))(
        sp, toks, guidance, routing), np.float32)
  # bf16 over 2 layers: a token whose layer-1 router sits at a near tie may pick another
  # expert than on one device (the layer-0 outputs differ in summation order); the rest agree.
  off = np.max(np.abs(got - want), axis=-1) > 2e-2 * np.abs(want).max()
  assert off.mean() <= 0.08, f"{int(off.sum())} of {off.size} tokens differ"


@needs_8
@pytest.mark.parametrize("policy", ["bf16", "fp8_unified"])
def test_prepared_weights_match_one_device(policy):
  """The rollout engine's prepared weights (`expert_weights.prepare`; FP8 under FP8 linears,
  read in place by `Precision.grouped`) placed as the engine places them on a mesh (experts
  split along E over `expert`, the rest replicated: `expert_weights.shardings`,
  `sharding.ENGINE_RULES`), through the XLA path (a prefill-shaped forward): logits within
  summation order of one device's (FP8: a few tokens a quantization step off, as above), layer
  0's routing bit for bit. (NVFP4's packed experts: tests/rollout/test_engine_mesh.py.)"""
  sizes = dict(moe_intermediate_size=128, head_dim=64) if policy == "fp8_unified" else {}
  config, params, toks, mesh = _setup(policy, dict(data=2, expert=4), **sizes)
  experts = jax.jit(expert_weights.prepare, static_argnums=1)(params, config)
  run = lambda p, e, t: M.forward(p, config, t, tap_routing=True, experts=e)
  ref = jax.jit(run)(params, experts, toks)
  placed = jax.device_put(experts, expert_weights.shardings(experts, mesh))
  assert all(not a.sharding.is_fully_replicated for r in placed for a in jax.tree.leaves(
      (r.gate_up, r.down)))
  params = jax.device_put(params, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  toks = jax.device_put(toks, sharding.activation_sharding(mesh, toks.shape))
  with mesh_context.use_mesh(mesh, sharding.ENGINE_RULES):
    out = jax.jit(lambda *a: run(*a))(params, placed, toks)
  assert_bits_equal(out.taps[0]["routing"], ref.taps[0]["routing"], "layer 0 routing")
  want, got = np.asarray(ref.logits, np.float32), np.asarray(out.logits, np.float32)
  if policy == "bf16":  # float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
  else:
    diff, scale = np.abs(got - want), np.abs(want).max()
    assert diff.max() <= 2e-2 * scale, diff.max()
    off = diff.max(axis=-1) > 1e-4 * scale
    assert off.mean() <= 0.05, f"{int(off.sum())} of {off.size} tokens differ"


def _collective_shapes(hlo: str) -> list[tuple[int, ...]]:
  """Result shapes of the collectives in compiled HLO text."""
  return [shape for _, shape in sharding.collectives(hlo)]


@needs_8
def test_expert_weights_stay_sharded():
  """No collective of the compiled EP forward holds every expert of a gate/up/down weight;
  the detector sees one where the program asks for the weight replicated."""
  config, params, toks, mesh = _setup(mesh_shape=dict(fsdp=2, expert=4))
  e, f, d = config.num_experts, config.moe_intermediate_size, config.hidden_size
  full = {(e, f, d), (e, d, f)}
  sp = sharding.shard_params(params, mesh)
  st = jax.device_put(toks, sharding.activation_sharding(mesh, toks.shape))
  fn = jax.jit(lambda p, t: M.forward(p, config, t).logits)
  with mesh_context.use_mesh(mesh):
    hlo = fn.lower(sp, st).compile().as_text()
  shapes = _collective_shapes(hlo)
  assert shapes and not full & set(shapes), shapes
  gather = jax.jit(lambda w: jax.lax.with_sharding_constraint(
      w * 2, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())))
  w = sp["layers"][0]["moe"]["gate_proj"].get_value()
  assert full & set(_collective_shapes(gather.lower(w).compile().as_text()))


def test_mesh_that_does_not_divide_the_experts_is_refused():
  mesh = sharding.make_mesh(dict(expert=1), jax.devices()[:1])
  with mesh_context.use_mesh(mesh):
    assert expert_parallel.active_mesh(8) is None  # expert axis of 1: off
  if len(jax.devices()) >= 3:
    mesh = sharding.make_mesh(dict(expert=3), jax.devices()[:3])
    with mesh_context.use_mesh(mesh), pytest.raises(ValueError, match="do not split"):
      expert_parallel.active_mesh(8)
  assert expert_parallel.active_mesh(8) is None  # outside the context
