"""Layers under `lax.scan` (`ModelConfig.scan_layers`, `model/layer_runs.py`) against the
unrolled forward (`scan_layers=False`, every layer compiled apart): the same logits, taps,
cache and gradients up to float32 summation order, and a program whose size does not grow
with depth."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from cases import count_eqns

from trace_jax import model as M


def _config(policy: str, layers: int = 3, **kw) -> M.ModelConfig:
  return M.tiny(policy=policy, num_hidden_layers=layers, dtype="float32", **kw)


class LayerRunsTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("bf16_one_run", "bf16", (2,), ((0, 4),)),
      ("guided_suffix", "fp4_trace", (2, 3), ((0, 2), (2, 4))),
      ("guided_middle", "fp4_trace", (1, 2), ((0, 1), (1, 3), (3, 4))),
      ("unguided_policy_ignores_guided_layers", "fp4_rtn", (1,), ((0, 4),)),
  )
  def test_runs(self, policy, guided, want):
    c = _config(policy, 4, guided_layers=guided)
    self.assertEqual(M.layer_runs(c), want)
    self.assertEqual(M.layer_runs(c.replace(scan_layers=False)),
                     tuple((i, i + 1) for i in range(4)))

  def test_program_size_does_not_grow_with_depth(self):
    """The scanned forward's program (jaxpr equations, scan bodies included) is as large at
    6 layers as at 2 (two runs each: the unguided layers, the guided last one), while the
    unrolled one triples: compile time stays flat in depth."""
    def size(layers, scan):
      c = _config("fp4_trace", layers, scan_layers=scan, guided_layers=(layers - 1,))
      p = M.abstract_params(c)
      jaxpr = jax.make_jaxpr(lambda p: M.forward(p, c, jnp.zeros((1, 4), jnp.int32)).logits)(p)
      return count_eqns(jaxpr.jaxpr)
    self.assertLess(abs(size(6, True) - size(2, True)), 0.05 * size(2, True))
    self.assertGreater(size(6, False), 2.5 * size(2, False))

  def test_bad_cache_is_refused(self):
    c = _config("bf16")
    p = M.init_params(c, 0)
    cache = M.init_cache(c.replace(scan_layers=False), 1, 8)  # one entry per layer: 3 runs
    with pytest.raises(ValueError, match="cache for 3 runs of layers, config has 1"):
      M.forward(p, c, jnp.zeros((1, 4), jnp.int32), cache=cache)


def _both(c: M.ModelConfig, f, p):
  """f(config, params), jitted, under scan and unrolled."""
  return [jax.jit(functools.partial(f, c.replace(scan_layers=s)))(p) for s in (True, False)]


def _close(a, b, atol):
  np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), atol=atol)


def test_scan_matches_unrolled_bf16_with_cache_taps_and_grads():
  """bf16, 3 layers in one run: prefill logits and cache, then a decode step, and the
  gradient of a loss; taps on layer 1 only split the run into three (sliced, then joined).
  The plan's layer_loop="unrolled" (each scan unrolled whole, the cache written in place as
  scanned) gives the same values too."""
  c = _config("bf16")
  p = M.init_params(c, 0)
  toks = jax.random.randint(jax.random.key(1), (2, 6), 0, c.vocab_size)

  def f(cc, p):
    out = M.prefill(p, cc, toks, 8, tap_layers=(1,), tap_mode="full")
    step = M.decode_step(p, cc, out.cache, toks[:, -1], jnp.full((2,), 6), tap_routing=True)
    grad = jax.grad(lambda p: jnp.sum(M.forward(p, cc, toks).logits ** 2) * 1e-3)(p)
    k = jnp.concatenate([k for k, _ in step.cache])  # [L, B, T, G, H] either way
    return out.logits, out.taps, step.logits, k, step.taps, grad

  a, b = _both(c, f, p)
  _close(a[0], b[0], 1e-5)
  assert sorted(a[1]) == sorted(b[1]) == [0, 1, 2]  # routing of every layer (bf16: no sites)
  assert set(a[1][1]) == {"routing"}
  for layer in (0, 1, 2):
    np.testing.assert_array_equal(a[1][layer]["routing"], b[1][layer]["routing"])
  _close(a[2], b[2], 1e-5)
  _close(a[3], b[3], 1e-5)
  assert jax.tree.structure(a[4]) == jax.tree.structure(b[4])
  for x, y in zip(jax.tree.leaves(a[5]), jax.tree.leaves(b[5])):
    _close(x, y, 1e-6)
  u = jax.jit(functools.partial(f, c.replace(layer_loop="unrolled")))(p)
  for i in (0, 2, 3):
    _close(a[i], u[i], 1e-5)
  for layer in (0, 1, 2):
    np.testing.assert_array_equal(a[1][layer]["routing"], u[1][layer]["routing"])
  for x, y in zip(jax.tree.leaves(a[5]), jax.tree.leaves(u[5])):
    _close(x, y, 1e-6)


def test_scan_matches_unrolled_fp4_trace_guided():
  """fp4_trace, 3 layers (layer 2 guided): rollout taps of the guided layer, then a guided
  training forward given them: the same logits and records either way, and the guided
  forward reproduces the rollout's codes under scan too."""
  c = _config("fp4_trace", guided_layers=(2,))
  p = M.init_params(c, 0)
  toks = jax.random.randint(jax.random.key(2), (2, 6), 0, c.vocab_size)

  def f(cc, p):
    roll = M.forward(p, cc, toks, tap_layers=(2,), tap_mode="full", record=True)
    g = {2: {s: roll.taps[2][s] for s in M.SITES}}
    routing = {i: roll.taps[i]["routing"] for i in roll.taps}
    train = M.forward(p, cc, toks, guidance=g, routing=routing, tap_layers=(2,),
                      tap_mode="full")
    return roll.logits, roll.taps, train.logits, train.taps

  a, b = _both(c, f, p)
  for i in (0, 2):
    _close(a[i], b[i], 1e-5)
  for x, y in zip(jax.tree.leaves(a[1]), jax.tree.leaves(b[1])):
    assert x.dtype == y.dtype and x.shape == y.shape
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    # codes and ids equal but for values at a rounding boundary; scales to float32 rounding
    assert np.mean(np.isclose(x, y, rtol=1e-5, atol=0)) > 0.99
  # Under scan the guided training forward rounds as its rollout did, site by site.
  for s in M.SITES:
    np.testing.assert_array_equal(np.asarray(a[3][2][s].codes), np.asarray(a[1][2][s].codes))


def test_decode_carries_the_cache_through_the_scan():
  """A decode step's scan carries each run's cache stack (written one token in place) and
  stacks no per-layer cache as an output: the old form (cache sliced in as xs, every layer's
  whole cache written back as ys) fails this."""
  c = _config("bf16", layers=3)
  params = M.init_params(c, 0)
  cache = M.init_cache(c, 2, 8)
  jaxpr = jax.make_jaxpr(lambda p, k: M.decode_step(
      p, c, k, jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int32)).logits)(params, cache)
  scans = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
  assert scans, "no scan over layers"
  cache_shapes = {a.shape for a in jax.tree.leaves(cache)}
  for e in scans:
    carried = {v.aval.shape for v in e.outvars[:e.params["num_carry"]]}
    stacked = {v.aval.shape for v in e.outvars[e.params["num_carry"]:]}
    assert cache_shapes <= carried, (cache_shapes, carried)
    assert not cache_shapes & stacked, stacked


def test_scan_unroll_runs_the_same_layers_in_fewer_iterations():
  """scan_unroll=2 over a 3-layer run (one iteration of two, then the rest): the scan carries
  unroll=2 and the prefill, cache and decode step match unroll=1 (the knob was ignored before
  it existed: the jaxpr check fails then)."""
  c = _config("bf16")
  p = M.init_params(c, 0)
  toks = jax.random.randint(jax.random.key(3), (2, 6), 0, c.vocab_size)

  def f(cc, p):
    out = M.prefill(p, cc, toks, 8, tap_routing=True)
    step = M.decode_step(p, cc, out.cache, toks[:, -1], jnp.full((2,), 6), tap_routing=True)
    return out.logits, step.logits, jax.tree.leaves(step.cache), out.taps

  two = c.replace(scan_unroll=2)
  jaxpr = jax.make_jaxpr(functools.partial(f, two))(p)
  assert [e.params["unroll"] for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"] == [2, 2]
  a, b = (jax.jit(functools.partial(f, cc))(p) for cc in (c, two))
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    _close(x, y, 1e-5)


@pytest.mark.parametrize("name", ["scan_unroll", "decode_steps_per_sync"])
@pytest.mark.parametrize("bad", [0, -1, 1.5, True], ids=["zero", "negative", "float", "bool"])
def test_bad_loop_counts_are_refused(name, bad):
  with pytest.raises(ValueError, match=f"{name} must be an int >= 1"):
    _config("bf16", **{name: bad})



def _scan_unrolls(jaxpr) -> list[tuple[int, int]]:
  """(length, unroll) of every scan in a jaxpr, top level (the forward's layer scans)."""
  return [(e.params["length"], e.params["unroll"]) for e in jaxpr.eqns
          if e.primitive.name == "scan"]


@pytest.mark.parametrize("layer_loop,cache,want", [
    pytest.param("unrolled", False, [(4, 4)], id="unrolled_forward"),
    pytest.param("unrolled", True, [(4, 4)], id="unrolled_prefill"),
    pytest.param("scan", False, [(4, 1)], id="scan_forward"),
    pytest.param("scan", True, [(4, 1)], id="scan_prefill"),
])
def test_layer_loop_unrolled_unrolls_every_forwards_scans_whole(layer_loop, cache, want):
  """The plan's layer_loop="unrolled": every forward, the prefill with its cache as much as the
  training forward, unrolls each run's scan whole (one body, traced once: the jaxpr stays as
  small as the scanned one's); "scan" runs `scan_unroll` layers per iteration."""
  c = _config("bf16", 4, layer_loop=layer_loop)
  p, toks = M.abstract_params(c), jnp.zeros((1, 4), jnp.int32)
  f = ((lambda p: M.prefill(p, c, toks, 8).logits) if cache else
       (lambda p: M.forward(p, c, toks).logits))
  assert _scan_unrolls(jax.make_jaxpr(f)(p).jaxpr) == want
