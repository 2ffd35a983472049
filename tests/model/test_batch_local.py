"""batch_local.on_batch_shards: a kernel per shard of the batch on the entered mesh, with the
batch-indexed operands split as the rules split the batch and the rest replicated; the call
as it is off a mesh, where the batch does not split, and inside another shard_map body."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import count_eqns

from trace_jax.model import batch_local, mesh_context, sharding

needs_8 = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices: run with "
                             "XLA_FLAGS=--xla_force_host_platform_device_count=8")


def _inputs(b: int):
  """rows [B, 3], a stack [L=2, B, 4] indexed by the batch on axis 1, a replicated weight
  [2, 3] and a layer index."""
  rng = np.random.default_rng(0)
  return (jnp.asarray(rng.standard_normal((b, 3)), jnp.float32),
          jnp.asarray(rng.standard_normal((2, b, 4)), jnp.float32),
          jnp.asarray(rng.standard_normal((2, 3)), jnp.float32), jnp.asarray(1, jnp.int32))


def _call(rows, stack, w, layer, seen):
  def kernel(r, s, w, i):  # per-row work (elementwise: exact on any split)
    seen.append((r.shape, s.shape, w.shape))
    return r * w[i], s[i] + r[:, :1]
  return batch_local.on_batch_shards(kernel, (rows, stack, w, layer), (0, 1, None, None),
                                     rows.shape[0])


def test_off_a_mesh_it_is_the_call():
  seen = []
  args = _inputs(8)
  got = jax.jit(lambda *a: _call(*a, seen))(*args)
  want = _call(*args, [])
  assert seen == [((8, 3), (2, 8, 4), (2, 3))]
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)


@needs_8
@pytest.mark.parametrize("shape,b,local", [
    pytest.param(dict(data=2, expert=4), 8, 1, id="dp2_ep4_b8"),     # 8 shards of 1 row
    pytest.param(dict(data=2, expert=4), 4, 2, id="dp2_ep4_b4"),     # data only: 2 rows each
    pytest.param(dict(expert=2, tensor=4), 6, 3, id="ep2_tp4_b6"),   # tensor: replicas
    pytest.param(dict(data=2, expert=4), 3, 3, id="dp2_ep4_b3"),     # no split: the call
])
def test_each_device_runs_its_own_rows(shape, b, local):
  mesh = sharding.make_mesh(shape, jax.devices()[:8])
  args = _inputs(b)
  want = _call(*args, [])
  seen = []
  fn = jax.jit(lambda *a: _call(*a, seen))
  with mesh_context.use_mesh(mesh, sharding.ENGINE_RULES):
    got = fn(*args)
    jaxpr = jax.make_jaxpr(lambda *a: _call(*a, []))(*args).jaxpr
  assert seen == [((local, 3), (2, local, 4), (2, 3))]  # local rows, the whole weight
  assert count_eqns(jaxpr, "shard_map") == (local < b)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)
  if local < b:  # the outputs come back split along the batch
    assert not got[0].sharding.is_fully_replicated


@needs_8
def test_inside_a_shard_map_body_it_is_the_call():
  mesh = sharding.make_mesh(dict(data=2, expert=4), jax.devices()[:8])
  args = _inputs(8)
  with mesh_context.use_mesh(mesh, sharding.ENGINE_RULES), mesh_context.manual_body():
    assert batch_local.batch_axes(8) is None
    jaxpr = jax.make_jaxpr(lambda *a: _call(*a, []))(*args).jaxpr
  assert count_eqns(jaxpr, "shard_map") == 0
  with mesh_context.use_mesh(mesh, sharding.ENGINE_RULES):
    assert batch_local.batch_axes(8) == ("data", "expert")


@needs_8
def test_summed_over_batch_shards_adds_each_devices_partial():
  """A kernel that contracts over the batch (a weight gradient): each device its own rows'
  partial, the partials summed; integers, so any order of the sum is exact."""
  x = jnp.asarray(np.random.default_rng(2).integers(-9, 9, (8, 3)), jnp.int32)
  gram = lambda r: r.T @ r
  mesh = sharding.make_mesh(dict(data=2, expert=4), jax.devices()[:8])
  seen = []
  fn = lambda r: seen.append(r.shape) or gram(r)
  with mesh_context.use_mesh(mesh, sharding.ENGINE_RULES):
    got = jax.jit(lambda a: batch_local.summed_over_batch_shards(fn, (a,), (0,), 8))(x)
  assert seen == [(1, 3)]
  np.testing.assert_array_equal(got, gram(x))
  assert got.sharding.is_fully_replicated
  assert batch_local.summed_over_batch_shards(gram, (x,), (0,), 8).shape == (3, 3)  # off a mesh


@needs_8
def test_outputs_indexed_by_the_batch_on_another_axis():
  """A kernel that updates a stack of layers [L, B, ...] in place (the packed KV cache's
  write) returns it with the batch on axis 1: `out_dim=1` puts each device's rows back there."""
  rows, stack, _, layer = _inputs(8)
  update = lambda r, s, i: s.at[i].add(r[:, :1])
  mesh = sharding.make_mesh(dict(data=2, expert=4), jax.devices()[:8])
  seen = []
  fn = lambda r, s, i: seen.append(s.shape) or update(r, s, i)
  with mesh_context.use_mesh(mesh, sharding.ENGINE_RULES):
    got = jax.jit(lambda *a: batch_local.on_batch_shards(fn, a, (0, 1, None), 8, out_dim=1))(
        rows, stack, layer)
  assert seen == [(2, 1, 4)]
  np.testing.assert_array_equal(got, update(rows, stack, layer))
  assert got.sharding.spec[1] == ("data", "expert")
