"""trace_jax/kernels/flash_decode.py: decode attention without scores in memory, in one pass
(online softmax, impl "fused").

Against `attention_math.attend` on the cache's values (`decode_attention_reference`, computed on
the CPU device) within `decode_attention.output_tolerance`, on the cases of the exact pair's
tests (`attention_cases`: lengths 1, mid-block and full, R = 1..16, key splits), plus
scores whose running maximum moves block after block (the rescaling's case); the exact pair
gives `attend`'s outputs bit for bit in nearly every element, where the one-pass kernel does
not. The kernel runs in the Pallas interpreter on CPU and as Triton on the GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.kernels import attention_cases as ac
from trace_jax.kernels import decode_attention as da
from trace_jax.kernels import flash_decode
from trace_jax.kernels.decode_attention import AttentionConfig

# (case of ac.ATTN_CASES, cache kind, codes as words or None for the default layout)
CASES = [("len1_r4", "packed", None), ("nonmultiple_mqa_r1", "packed", None),
         ("full_r8", "packed", True), ("mixed_lengths_r2_split3", "packed", None),
         ("mixed_lengths_r2_split3", "packed", True), ("mqa_r16_unpadded", "bf16", None),
         ("full_r8", "bf16", None)]


def _run(q, cache, lengths, block_t, splits, impl="fused", **kw):
  return da.decode_attention(q, cache, lengths, config=AttentionConfig(
      impl=impl, block_t=block_t, num_splits=splits), **kw)


@pytest.mark.parametrize("case", CASES,
                         ids=[f"{n}-{k}{'-words' if w else ''}" for n, k, w in CASES])
def test_flash_matches_reference(case):
  """Within `output_tolerance` of `attend`; a sequence of length 1 gets its single V row
  exactly (one key: p = exp(0) = 1, l = 1)."""
  name, kind, words = case
  b, t, g, n, h, lengths, block_t, splits = ac.ATTN_CASES[name]
  q, kv, pos = ac.attn_inputs(b, t, g, n, h)
  cache = ac.make_cache(kind, kv, pos, words=words)
  lengths = jnp.asarray(lengths, jnp.int32)
  out = _run(q, cache, lengths, block_t, splits)
  assert out.shape == q.shape and out.dtype == q.dtype
  ref = ac.reference(q, cache, lengths)
  vals = ac.on_cpu(ac.values_of, cache)
  ac.check_within_tolerance(out, ref, vals, lengths, n)
  for bi in np.flatnonzero(np.asarray(lengths) == 1):
    want = np.repeat(vals[bi, 0], n // g, axis=0).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(out)[bi].astype(np.float32), want)


@pytest.mark.parametrize("splits", [1, 4], ids=["one_split", "four_splits"])
def test_a_moving_maximum_is_rescaled(splits):
  """Scores that grow with the key's position (keys shifted along q's direction by up to 40
  score units): nearly every block raises the running maximum, so each block's rescaling of
  the sums before it decides the result (skipping it would weigh the early keys up to e**40
  too much); one and four splits stay within tolerance of `attend`."""
  b, t, g, n, h = 2, 128, 1, 4, 64
  _, kv, pos = ac.attn_inputs(b, t, g, n, h, seed=5)
  (k, _), (v, qv) = kv
  u = np.ones(h, np.float32) / np.sqrt(h)
  shift = 40.0 * pos[:, :, None, None] / t * u  # row i lands at position pos[b, i]
  k = (np.asarray(k, np.float32) + shift).astype(k.dtype)
  q = jnp.asarray(np.broadcast_to(np.sqrt(h) * u, (b, n, h)), jnp.bfloat16)
  cache = ac.make_cache("bf16", ((k, None), (v, qv)), pos)
  lengths = jnp.asarray([t, 97], jnp.int32)
  out = np.asarray(_run(q, cache, lengths, 16, splits)).astype(np.float32)
  ref = ac.reference(q, cache, lengths)
  ac.check_within_tolerance(out, ref, ac.on_cpu(ac.values_of, cache), lengths, n)
  scores = np.einsum("h,th->t", np.sqrt(h) * u, np.asarray(cache[0], np.float32)[0, :, 0])
  scores /= np.sqrt(h)
  block_max = scores.reshape(-1, 16).max(axis=1)
  assert np.all(np.diff(block_max) > 0) and np.ptp(scores) > 30, "the maximum must move"


def test_stacked_layer_is_read_in_place():
  """A stack of layers [L, ...] read at a traced layer gives that layer's result bit for bit;
  the other layers' rows (NaN) never reach it."""
  b, t, g, n, h, lengths, block_t, splits = ac.ATTN_CASES["mixed_lengths_r2_split3"]
  q, kv, pos = ac.attn_inputs(b, t, g, n, h, seed=6)
  lengths = jnp.asarray(lengths, jnp.int32)
  one = ac.make_cache("packed", kv, pos)
  want = np.asarray(_run(q, one, lengths, block_t, splits))
  poison = lambda a: jnp.full_like(a, np.nan) if a.dtype in (jnp.bfloat16, jnp.float32) else a
  stack = jax.tree.map(lambda a: jnp.stack([poison(a), a, poison(a)]), one)
  got = jax.jit(lambda c, i: _run(q, c, lengths, block_t, splits, layer=i))(stack, jnp.int32(1))
  np.testing.assert_array_equal(ac.bits(np.asarray(got)), ac.bits(want))


def test_masked_keys_are_ignored_and_length_zero():
  """NaN beyond `lengths` (a BF16 cache; a packed one with NaN scale bytes and huge row
  scales) never reaches the output; a length of 0 gives zeros, in one split and in several."""
  b, t, g, n, h, _, block_t, _ = ac.ATTN_CASES["mixed_lengths_r2_split3"]
  q, kv, pos = ac.attn_inputs(b, t, g, n, h, seed=4)
  lengths = jnp.asarray([0, 37, 64, 99], jnp.int32)
  beyond = (jnp.arange(t)[None, :] >= lengths[:, None])[:, :, None, None]
  clean = ac.make_cache("bf16", kv, pos)
  dirty = tuple(jnp.where(beyond, jnp.asarray(np.nan, a.dtype), a) for a in clean)
  packed = ac.make_cache("packed", kv, pos)
  nan_scale = jnp.asarray(np.full((), 0x7F, np.uint8).view(jnp.float8_e4m3fn))
  dirty_packed = packed.replace(k_block=jnp.where(beyond, nan_scale, packed.k_block),
                                v_row=jnp.where(beyond[..., 0], jnp.float32(3e38), packed.v_row))
  for cache, bad, splits in ((clean, dirty, 1), (clean, dirty, 3), (packed, dirty_packed, 3)):
    out = np.asarray(_run(q, bad, lengths, block_t, splits)).astype(np.float32)
    assert np.all(out[0] == 0)
    ref = ac.reference(q, cache, lengths)
    ac.check_within_tolerance(out[1:], ref[1:], ac.on_cpu(ac.values_of, cache)[1:],
                                lengths[1:], n)


def test_the_pair_keeps_attend_s_bits_where_one_pass_loses_them():
  """The metric that shows the one-pass kernel's departure from `attend`: the share of output
  elements that differ from `attend`'s (same cache, CPU). The exact pair (Triton) normalizes
  before rounding, as `attend` does, and differs in at most 0.5% of the elements (measured:
  0-0.02% over 3 seeds, packed bytes and words and BF16 caches); the one-pass kernel rounds
  unnormalized probabilities and differs in over 10% (measured: 37-39%)."""
  b, t, g, n, h, lengths, block_t, splits = ac.ATTN_CASES["full_r8"]
  q, kv, pos = ac.attn_inputs(b, t, g, n, h, seed=1)
  lengths = jnp.asarray(lengths, jnp.int32)
  for kind, words in (("packed", True), ("bf16", None)):
    cache = ac.make_cache(kind, kv, pos, words=words)
    ref = np.asarray(ac.reference(q, cache, lengths)).astype(np.float32)
    share = {impl: float(np.mean(np.asarray(_run(q, cache, lengths, block_t, splits, impl))
                                 .astype(np.float32) != ref))
             for impl in ("triton", "fused")}
    assert share["triton"] <= 0.005, (kind, share)
    assert share["fused"] > 0.1, (kind, share)


def test_combine_against_numpy():
  """Splits' partials (acc, m, l), one split without keys (m = -inf, l = 0) and one row with no
  key at all: combine equals the float64 sum of the rescaled partials, and the empty row is 0."""
  rng = np.random.default_rng(0)
  s, r, h = 3, 4, 8
  acc = rng.standard_normal((s, r, h)).astype(np.float32)
  m = rng.standard_normal((s, r)).astype(np.float32) * 5
  l = rng.uniform(1, 3, (s, r)).astype(np.float32)
  m[1, :], l[1, :], acc[1] = -np.inf, 0, 0
  m[:, 3], l[:, 3], acc[:, 3] = -np.inf, 0, 0
  got = np.asarray(flash_decode.combine(jnp.asarray(acc), jnp.asarray(m), jnp.asarray(l),
                                        jnp.float32))
  w = np.where(np.isinf(m), 0, np.exp(m.astype(np.float64) - np.max(m[:, :3], axis=0).max()))
  w, acc3, l3 = w[:, :3], acc[:, :3].astype(np.float64), l[:, :3]
  want = np.einsum("srh,sr->rh", acc3, w) / np.sum(l3 * w, axis=0)[:, None]
  np.testing.assert_allclose(got[:3], want, rtol=1e-5)
  assert np.all(got[3] == 0)


def test_fused_rejects_what_the_pair_rejects():
  """The fused impl takes the pair's input checks (a bad shape is refused by name)."""
  q = jnp.zeros((2, 3, 64), jnp.bfloat16)
  cache = (jnp.zeros((2, 16, 2, 64), jnp.bfloat16),) * 2
  with pytest.raises(ValueError, match="multiple of G"):
    _run(q, cache, jnp.ones((2,), jnp.int32), 16, 1)


@pytest.mark.parametrize("kind,words,splits", [
    ("bf16", None, 1), ("packed", False, 3), ("packed", True, 1), ("packed", True, 3)],
    ids=["bf16", "bytes_split3", "words", "words_split3"])
def test_lowers_to_triton(kind, words, splits):
  """The kernel passes Pallas' Triton lowering for the CUDA platform on any host (supported
  primitives, power-of-two tiles); Triton's own compilation needs the GPU run."""
  b, t, g, n, h, lengths, block_t, _ = ac.ATTN_CASES["full_r8"]
  q, kv, pos = ac.attn_inputs(b, t, g, n, h)
  cache = ac.make_cache(kind, kv, pos, words=words)
  config = AttentionConfig(impl="fused", block_t=block_t, num_splits=splits, interpret=False)
  f = lambda q, c, lens: da.decode_attention(q, c, lens, config=config)
  text = jax.jit(f).trace(q, cache, jnp.asarray(lengths, jnp.int32)).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "triton" in text and "flash_decode" in text
