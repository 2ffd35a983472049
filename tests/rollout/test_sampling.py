"""Token sampling: greedy, temperature, top-k, top-p, and the sort-free path."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax.rollout import sampling

V = 64
# One compile per shape instead of op-by-op dispatch.
_sample_static = jax.jit(sampling.sample, static_argnames="truncate")


def _sample(logits, keys, temps, top_ps, top_ks, truncate=None):
  """sample with truncate decided from the settings, as the engine does, unless given."""
  if truncate is None:
    truncate = bool(np.any(sampling.truncating(np.asarray(temps), np.asarray(top_ps),
                                               np.asarray(top_ks), logits.shape[-1])))
  return _sample_static(logits, keys, temps, top_ps, top_ks, truncate=truncate)

_filter = jax.jit(sampling.filter_logits)


def _logits(rows: int, seed: int = 0) -> jax.Array:
  return jax.random.normal(jax.random.key(seed), (rows, V), jnp.float32) * 3


def _keys(rows: int, seed: int = 1) -> jax.Array:
  return jax.random.split(jax.random.key(seed), rows)


def _settings(rows, temp, top_p, top_k):
  return (jnp.full(rows, temp, jnp.float32), jnp.full(rows, top_p, jnp.float32),
          jnp.full(rows, top_k, jnp.int32))


def test_greedy_rows_take_the_argmax_and_its_log_prob():
  x = _logits(8)
  tok, lp = _sample(x, _keys(8), *_settings(8, 0.0, 1.0, 0))
  np.testing.assert_array_equal(tok, np.argmax(np.asarray(x), axis=-1))
  ref = jax.nn.log_softmax(np.asarray(x, np.float64), axis=-1)
  np.testing.assert_allclose(lp, np.take_along_axis(np.asarray(ref), np.asarray(tok)[:, None],
                                                    axis=-1)[:, 0], rtol=1e-6)


@pytest.mark.parametrize("top_k", [1, 2, 5], ids=lambda k: f"k{k}")
def test_top_k_keeps_exactly_k_tokens(top_k):
  x = _logits(6)
  f = _filter(x, *_settings(6, 1.0, 1.0, top_k))
  kept = np.isfinite(np.asarray(f))
  np.testing.assert_array_equal(kept.sum(-1), top_k)
  best = np.argsort(-np.asarray(x), axis=-1)[:, :top_k]
  assert np.take_along_axis(kept, best, axis=-1).all()


def test_a_small_top_p_keeps_only_the_best_token():
  x = _logits(6)
  f = np.asarray(_filter(x, *_settings(6, 1.0, 1e-6, 0)))
  np.testing.assert_array_equal(np.isfinite(f).sum(-1), 1)
  tok, _ = _sample(x, _keys(6), *_settings(6, 1.0, 1e-6, 0))
  np.testing.assert_array_equal(tok, np.argmax(np.asarray(x), axis=-1))


def test_top_p_one_keeps_the_whole_vocabulary_even_with_rounding_in_the_cumulative_mass():
  # One dominant token: float32 cumsum of the tail's tiny masses reaches 1 before the end.
  x = jnp.concatenate([jnp.full((2, 1), 30.0), jnp.zeros((2, V - 1))], axis=-1)
  f = np.asarray(_filter(x, *_settings(2, 1.0, 1.0, 0)))
  assert np.isfinite(f).all()


def test_the_sort_free_path_draws_what_the_filtering_path_draws():
  """Rows with no truncation: the unsorted path must equal the full filter, draw for draw; a
  mixed batch takes the filter and must leave such rows unchanged."""
  x, keys = _logits(32), _keys(32)
  t, p, k = _settings(32, 0.7, 1.0, 0)
  plain, _ = _sample(x, keys, t, p, k)
  filtered = _filter(x, t, p, k)
  np.testing.assert_array_equal(filtered, x / 0.7)
  np.testing.assert_array_equal(plain, jax.vmap(jax.random.categorical)(keys, filtered))
  forced, _ = _sample(x, keys, t, p, k, truncate=True)
  np.testing.assert_array_equal(forced, plain)
  mixed, _ = _sample(x, keys, t, p, k.at[0].set(2))  # row 0 truncates: filter path
  np.testing.assert_array_equal(mixed[1:], plain[1:])


@pytest.mark.parametrize("temp, top_p, top_k, want", [
    pytest.param(0.0, 0.5, 3, False, id="greedy_ignores_its_top_k_p"),
    pytest.param(1.0, 1.0, 0, False, id="plain_temperature"),
    pytest.param(1.0, 1.0, V, False, id="top_k_of_the_whole_vocabulary"),
    pytest.param(1.0, 1.0, V - 1, True, id="top_k_below_the_vocabulary"),
    pytest.param(1.0, 0.9, 0, True, id="top_p_below_one"),
])
def test_truncating_rows(temp, top_p, top_k, want):
  t, p, k = (np.asarray(a) for a in _settings(3, temp, top_p, top_k))
  np.testing.assert_array_equal(sampling.truncating(t, p, k, V), [want] * 3)


def test_without_truncate_a_top_k_row_is_not_filtered():
  """The flag is what decides: the same top-k row sampled with truncate=False may draw outside
  its top k (the control showing the flag matters), with truncate=True never does."""
  x, keys = _logits(256, seed=3), _keys(256, seed=4)
  t, p, k = _settings(256, 1.0, 1.0, 1)
  top1 = np.argmax(np.asarray(x), axis=-1)
  kept, _ = _sample(x, keys, t, p, k, truncate=True)
  np.testing.assert_array_equal(kept, top1)
  loose, _ = _sample(x, keys, t, p, k, truncate=False)
  assert (np.asarray(loose) != top1).sum() > 10


def test_temperature_one_draws_follow_the_softmax():
  x = jnp.tile(jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]])), (4000, 1))
  tok, _ = _sample(x, _keys(4000, 7), *_settings(4000, 1.0, 1.0, 0))
  freq = np.bincount(np.asarray(tok), minlength=4) / 4000
  np.testing.assert_allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.03)  # ~4 sd at n=4000


@pytest.mark.parametrize("truncate", [False, True], ids=["plain", "truncating"])
def test_the_vocabulary_sort_runs_only_when_truncating_and_nothing_branches(truncate):
  jaxpr = jax.make_jaxpr(functools.partial(sampling.sample, truncate=truncate))(
      _logits(4), _keys(4), *_settings(4, 1.0, 1.0, 0))
  text = str(jaxpr)  # nested jits included
  assert (" sort[" in text) == truncate and " cond[" not in text, text
