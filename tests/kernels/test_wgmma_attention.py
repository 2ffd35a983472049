"""The wgmma scores kernel's register map, checked on CPU against the numpy reference quantizer.

The kernel itself runs only on a Hopper GPU (Mosaic GPU, inline PTX; `python -m
experiments.bench.decode_attention --impls=kernel_packed_wgmma` checks its outputs there).
Here every thread's part of a K tile is rebuilt as the kernel builds it: its code words, block
scales and row scales read at the kernel's addresses, the same table and lookup programs
(`fp4_decode`'s, run as jnp integer ops) and its registers placed where Mosaic GPU's WGMMA
layout puts them (lane // 4 + 16 warp + 8 half, columns 8 ct + 2 (lane % 4)); the tile must
equal the dequantized K in `column_order`.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from trace_jax.kernels import fp4_decode, kv_cache, wgmma_attention, wgmma_decode


def _tile_as_the_kernel_builds_it(codes: np.ndarray, scale_bits: np.ndarray,
                                  rows: np.ndarray, valid: int | None = None) -> np.ndarray:
  """uint16 bits [64, H] of the A operand from one (sequence, kv head)'s 64 rows: codes uint8
  [64, H/2], scale bytes [64, H/16], row scales float32 [64]. Thread (warp, lane), half: row
  16 warp + lane // 4 + 8 half (any row), quad = lane % 4; all threads at once. valid (the
  PV kernel's mask): rows at or beyond it get scales 0."""
  h = 2 * codes.shape[1]
  nb = 2 * h // wgmma_decode.SPAN
  o = fp4_decode.JnpOps(jnp.bfloat16)
  own = codes.astype(np.uint32).reshape(-1, 4, 2 * nb, 4)  # [row, quad, word, byte]
  words = own[..., 0] | own[..., 1] << 8 | own[..., 2] << 16 | own[..., 3] << 24
  bs = scale_bits.reshape(-1, 4, nb).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
  ts = rows.astype(np.float32)[:, None]
  if valid is not None:
    dead = np.arange(codes.shape[0]) >= valid
    bs = np.where(dead[:, None, None], np.float32(0), bs)
    ts = np.where(dead[:, None], np.float32(0), ts)
  out = np.zeros((codes.shape[0], h // 8, 4, 2), np.uint16)  # [row, ct, quad, j]
  for i in range(nb):
    p = jnp.asarray(bs[:, :, i] * ts)
    q = jnp.asarray((bs[:, :, i] * np.float32(1.5)) * ts)
    tabs = fp4_decode.fast_table_program(o, p, q)
    for k in range(2):
      res = fp4_decode.lookup_program(o, jnp.asarray(words[:, :, 2 * i + k]), tabs, tabs)
      for m in range(4):
        pair = np.asarray(res[m]).astype(np.uint32)
        out[:, 8 * i + 4 * k + m, :, 0] = pair & 0xFFFF
        out[:, 8 * i + 4 * k + m, :, 1] = pair >> 16
  return out.reshape(codes.shape[0], h)  # column 8 ct + 2 quad + j


@pytest.mark.parametrize("h", [128, 256], ids=["head_dim_128", "head_dim_256"])
def test_column_order_is_a_permutation_of_whole_blocks_per_thread(h):
  order = wgmma_decode.column_order(h)
  assert sorted(order.tolist()) == list(range(h))
  nb = 2 * h // wgmma_decode.SPAN
  for quad in range(4):  # a thread's 8 ct + 2 quad + {0, 1} columns are its nb whole blocks
    cols = [8 * ct + 2 * quad + j for ct in range(h // 8) for j in range(2)]
    assert sorted(order[cols] // 16) == sorted(list(range(nb * quad, nb * (quad + 1))) * 16)


@pytest.mark.parametrize("case", ["random", "zeros_and_extremes"])
def test_register_tile_equals_the_dequantized_keys(case):
  rng = np.random.default_rng(0)
  h = 128
  k = rng.standard_normal((1, wgmma_decode.TILE, 1, h)).astype(np.float32) * 3
  if case == "zeros_and_extremes":
    k[0, 0] = 0.0  # an all-zero row: row scale 0 (as unwritten cache rows)
    k[0, 1, 0, ::2] = 0.0  # zero codes of both signs
    k[0, 1, 0, 1::2] *= -1
    k[0, 2] *= 1e30  # large and tiny rows: row scales far from 1
    k[0, 3] *= 1e-30
    k[0, 4, 0, :16] = 0.0  # one all-zero block in a nonzero row
  k = jnp.asarray(k, jnp.bfloat16)
  cache = kv_cache.pack_rows(k, k, words=False)
  codes = np.asarray(cache.k_codes[0, :, 0])
  bits = np.asarray(cache.k_block[0, :, 0]).view(np.uint8)
  rows = np.asarray(cache.k_row[0, :, 0])
  assert bool(np.all(np.asarray(fp4_decode.tensor_scale_factors(jnp.asarray(rows))[0])))
  tile = _tile_as_the_kernel_builds_it(codes, bits, rows)
  want = np.asarray(kv_cache.dequantize(cache, jnp.bfloat16)[0][0, :, 0]).view(np.uint16)
  np.testing.assert_array_equal(tile, want[:, wgmma_decode.column_order(h)])


@pytest.mark.parametrize("valid", [0, 1, 37, 64, 100], ids=lambda v: f"valid_{v}")
def test_masked_rows_decode_to_zero(valid):
  """The PV kernel's V tile: rows below `valid` exactly as unmasked, the rest +-0 (also rows
  whose stale scales are NaN or inf)."""
  rng = np.random.default_rng(1)
  k = jnp.asarray(rng.standard_normal((1, wgmma_decode.TILE, 1, 128)) * 3, jnp.bfloat16)
  cache = kv_cache.pack_rows(k, k, words=False)
  codes = np.asarray(cache.k_codes[0, :, 0])
  bits = np.asarray(cache.k_block[0, :, 0]).view(np.uint8).copy()
  rows = np.asarray(cache.k_row[0, :, 0]).copy()
  bits[-1, 0], rows[-2] = 0x7F, np.inf  # NaN scale byte, infinite row scale in masked rows
  full = _tile_as_the_kernel_builds_it(codes, bits, rows)
  tile = _tile_as_the_kernel_builds_it(codes, bits, rows, valid=valid)
  live = min(valid, wgmma_decode.TILE)
  np.testing.assert_array_equal(tile[:live], full[:live])
  assert np.all(tile[live:].view(jnp.bfloat16).astype(np.float32) == 0.0)


def test_unsupported_shapes_are_refused():
  assert wgmma_attention.supported(128, 8, 1024, jnp.bfloat16)
  assert not wgmma_attention.supported(64, 8, 1024, jnp.bfloat16)
  assert not wgmma_attention.supported(128, 4, 1024, jnp.bfloat16)
  assert not wgmma_attention.supported(128, 8, 1000, jnp.bfloat16)
  assert not wgmma_attention.supported(128, 8, 1024, jnp.float16)


def test_every_row_scale_the_quantizer_makes_takes_the_fast_table():
  """The kernel builds the fast table only: exact for row scales in `tensor_scale_factors`'
  fast range, which every cache row the quantizer writes must be in (the amax floor keeps
  all-zero and tiny rows inside it, bf16's range the largest; NaN/inf rows give NaN)."""
  big, tiny = float(jnp.finfo(jnp.bfloat16).max), float(jnp.finfo(jnp.bfloat16).tiny)
  rows = np.zeros((8, 128), np.float32)
  rows[1] = big
  rows[2, 0] = tiny
  rows[3, 0] = tiny / 4  # subnormal: flushed
  rows[4, 0] = np.nan
  rows[5, 0] = np.inf
  rows[6] = -big
  rows[7] = np.linspace(-1, 1, 128)
  k = jnp.asarray(rows, jnp.bfloat16).reshape(1, 8, 1, 128)
  cache = kv_cache.pack_rows(k, k, words=False)
  fast = np.asarray(fp4_decode.tensor_scale_factors(cache.k_row)[0])
  assert fast.all(), np.asarray(cache.k_row)
  # and a row scale outside the range is told apart (the check can fail)
  assert not bool(fp4_decode.tensor_scale_factors(jnp.float32(2.0**-120))[0])


def test_decode_attention_refuses_wgmma_where_it_cannot_run():
  """impl="wgmma" off the GPU (or on another shape) fails loudly instead of falling back;
  an unknown impl is named."""
  from trace_jax.kernels import decode_attention as da

  b, t, g, n, h = 1, 64, 1, 8, 128
  q = jnp.zeros((b, n, h), jnp.bfloat16)
  cache = kv_cache.init_packed_cache(b, t, g, h, words=True)
  lengths = jnp.full((b,), t, jnp.int32)
  with pytest.raises(ValueError, match="needs a packed cache of code words on the GPU"):
    da.decode_attention(q, cache, lengths, config=da.AttentionConfig(interpret=True, impl="wgmma"))
  with pytest.raises(ValueError, match="impl must be one of"):
    da.AttentionConfig(interpret=True, impl="cuda")
  with pytest.raises(ValueError, match="needs impl='triton'"):
    da.decode_attention(q, cache, lengths,
                        config=da.AttentionConfig(interpret=True, impl="wgmma", table="exact"))
  # where the kernels do not run, the model's choice for a call is the Triton pair
  assert da.wgmma_impl(q, cache, interpret=True) == "triton"
  assert da.wgmma_impl(q, cache.as_bytes()) == "triton"
  assert da.wgmma_impl(q, cache, interpret=True, fused=True) == "fused"
  with pytest.raises(ValueError, match="needs a packed cache of code words on the GPU"):
    da.decode_attention(q, cache, lengths,
                        config=da.AttentionConfig(interpret=True, impl="wgmma_fused"))


@pytest.mark.parametrize("half", [0, 1], ids=["low_scale_byte", "high_scale_byte"])
def test_block_ptx_text_runs_as_the_emulated_program(half):
  """The attention kernels' block PTX (`wgmma_decode.block_ptx`, fast table), run as text by
  the numpy PTX interpreter, equals the jnp emulation of the same programs used above, on every
  scale byte and random code words (so the register tests above hold for the text the kernel
  runs)."""
  import ptx_sim

  rng = np.random.default_rng(3)
  n = 256 * 4
  w0, w1 = (rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32) for _ in range(2))
  byte = np.repeat(np.arange(256, dtype=np.uint32), 4)
  other = rng.integers(0, 256, n).astype(np.uint32)
  pair = (byte << 8 | other) if half else (other << 8 | byte)
  ts = np.float32(0.37)
  got = ptx_sim.run(wgmma_decode.block_ptx(half, "fast"),
                    {8: w0, 9: w1, 10: pair, 11: np.full(n, ts).view(np.uint32)})
  o = fp4_decode.JnpOps(jnp.bfloat16)
  bs = byte.astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
  tabs = fp4_decode.fast_table_program(o, jnp.asarray(bs * ts),
                                        jnp.asarray((bs * np.float32(1.5)) * ts))
  want = [*fp4_decode.lookup_program(o, jnp.asarray(w0), tabs, tabs),
          *fp4_decode.lookup_program(o, jnp.asarray(w1), tabs, tabs)]
  for i in range(8):
    g, w = got[i].astype(np.uint32), np.asarray(want[i]).astype(np.uint32)
    for s in (0, 16):  # NaN results compare by NaN-ness (either side's NaN bits)
      gh, wh = (g >> s) & 0xFFFF, (w >> s) & 0xFFFF
      nan = ((wh & 0x7F80) == 0x7F80) & ((wh & 0x7F) != 0)
      assert np.array_equal(((gh & 0x7F80) == 0x7F80) & ((gh & 0x7F) != 0), nan)
      assert np.array_equal(gh[~nan], wh[~nan]), f"result {i}, half {s}"


def _decoded(words, bits, rows, lyr: int) -> np.ndarray:
  """float32 [B, T, G, H] values of layer `lyr` of a cache's words, scale bytes and row
  scales (as the kernels take them), columns in the decode's `column_order`."""
  h = 16 * bits.shape[-1]
  codes = words[lyr].reshape(words.shape[1:4] + (h // 16, 2))
  block = jax.lax.bitcast_convert_type(bits[lyr], jnp.float8_e4m3fn)
  one = kv_cache.PackedKVCache(k_codes=codes, v_codes=codes, k_block=block, v_block=block,
                               k_row=rows[lyr], v_row=rows[lyr])
  return np.asarray(kv_cache.dequantize(one, jnp.float32)[0])[..., wgmma_decode.column_order(h)]


def _glue_case(t: int, lengths: list[int], seed: int):
  """A two-sequence packed cache (words; 2 kv heads, 16 query heads of 128) stacked as layer 1
  of 2: (q, cache, lengths, its K and V arrays as the kernels take them)."""
  from tests.kernels.attention_cases import attn_inputs, make_cache
  from trace_jax.kernels import kv_tiles

  q, kv, pos = attn_inputs(2, t, 2, 16, 128, seed=seed)
  cache = make_cache("packed", kv, pos, words=True)
  stack = jax.tree.map(lambda a: jnp.stack([jnp.zeros_like(a), a]), cache)
  ks, vs = kv_tiles.cache_arrays(stack, True)
  return q, cache, jnp.asarray(lengths, jnp.int32), ks, vs


def _partials_stand_in(q, k, v, lengths, layer, *, scale, splits, prefetch):
  """`wgmma_flash.partials`' contract in numpy (the kernel runs on a GPU only): each split's
  float32 (acc, m, l) over its keys below the length, K and V decoded from the arguments in
  `column_order` as the kernel decodes them, unnormalized probabilities rounded to bf16."""
  del prefetch  # L2 requests only: no value of the contract depends on them
  assert q.shape[2] == wgmma_attention.ROWS  # the query heads as wgmma's N: not padded
  lyr = int(np.asarray(layer)[0])
  b, g, r, h = q.shape
  kv, vv = _decoded(*k, lyr), _decoded(*v, lyr)
  tile = wgmma_decode.TILE
  per, n_splits = wgmma_attention.split_steps(kv.shape[1], tile, splits)
  acc = np.zeros((b, g, n_splits, r, h), np.float32)
  m = np.full((b, g, n_splits, r), -np.inf, np.float32)
  l = np.zeros((b, g, n_splits, r), np.float32)
  qf = np.asarray(q, np.float32)
  for bi, n in enumerate(np.asarray(lengths)):
    for si in range(n_splits):
      lo, hi = si * per * tile, min((si + 1) * per * tile, int(n))
      if lo >= hi:
        continue
      for gi in range(g):
        s = qf[bi, gi] @ kv[bi, lo:hi, gi].T * np.float32(scale)
        m[bi, gi, si] = s.max(axis=1)
        p = np.exp(s - m[bi, gi, si][:, None])
        l[bi, gi, si] = p.sum(axis=1)
        p16 = np.asarray(jnp.asarray(p, jnp.bfloat16), np.float32)
        acc[bi, gi, si] = p16 @ vv[bi, lo:hi, gi]
  return jnp.asarray(acc), jnp.asarray(m), jnp.asarray(l)


@pytest.mark.parametrize("splits", [1, 3], ids=["one_split", "three_splits"])
def test_single_pass_glue_around_the_kernel(monkeypatch, splits):
  """impl "wgmma_fused" around its kernel (replaced by a numpy stand-in of its contract): q's
  columns permuted (its 8 rows a kv head unpadded), the cache's words handed over per layer,
  the splits combined and the columns put back give `attend`'s output within
  `output_tolerance`; a split without keys (sequence 1's last) adds nothing."""
  from tests.kernels.attention_cases import check_within_tolerance, reference, values_of
  from trace_jax.kernels import decode_attention as da
  from trace_jax.kernels import wgmma_flash

  monkeypatch.setattr(wgmma_flash, "partials", _partials_stand_in)
  q, cache, lengths, ks, vs = _glue_case(256, [256, 70], seed=3)
  out = da._wgmma_fused(q, ks, vs, lengths, jnp.asarray([1], jnp.int32), num_splits=splits,
                        prefetch=2)
  assert out.shape == q.shape and out.dtype == q.dtype
  check_within_tolerance(out, reference(q, cache, lengths), values_of(cache), lengths,
                         q.shape[1])


def _pv_stand_in(probs, codes, scale_bits, rows, lengths, layer, *, prefetch, splits):
  """`wgmma_attention.pv`'s contract in numpy (the kernel runs on a GPU only): probabilities x
  V decoded in `column_order` over the keys below each length, one bf16 rounding, or with
  several splits each split's float32 sum over its tiles."""
  del prefetch  # L2 requests only
  b, g, r, t = probs.shape
  h = 16 * scale_bits.shape[-1]
  vv = _decoded(codes, scale_bits, rows, int(np.asarray(layer)[0]))
  per, n_splits = wgmma_attention.split_steps(t, wgmma_decode.TILE, splits)
  p = np.asarray(probs, np.float32)
  acc = np.zeros((b, g, n_splits, r, h), np.float32)
  for bi, n in enumerate(np.asarray(lengths)):
    for si in range(n_splits):
      lo, hi = si * per * wgmma_decode.TILE, min((si + 1) * per * wgmma_decode.TILE, int(n))
      for gi in range(g):
        if lo < hi:
          acc[bi, gi, si] = p[bi, gi, :, lo:hi] @ vv[bi, lo:hi, gi]
  if n_splits == 1:
    return jnp.asarray(acc[:, :, 0], jnp.bfloat16)
  return jnp.asarray(acc)


@pytest.mark.parametrize("splits", [1, 3], ids=["one_split", "three_splits"])
def test_split_pv_glue_around_the_kernel(monkeypatch, splits):
  """impl "wgmma"'s PV around its kernel (replaced by a numpy stand-in of its contract): the
  splits' float32 partial sums added and rounded once, the columns put back, give `attend`'s
  output within `output_tolerance` from `attend`'s probabilities (three splits of one tile:
  sequence 0's last ends mid-tile, sequence 1's last holds no key)."""
  from tests.kernels.attention_cases import check_within_tolerance, reference, values_of
  from trace_jax.kernels import attention_math
  from trace_jax.kernels import decode_attention as da

  monkeypatch.setattr(wgmma_attention, "pv", _pv_stand_in)
  t = 192
  q, cache, lengths, ks, vs = _glue_case(t, [150, 70], seed=5)
  b, n, h = q.shape
  g = ks[0].shape[3]
  k, _ = kv_cache.dequantize(cache, jnp.float32)
  qg = np.asarray(q, np.float32).reshape(b, g, n // g, h)
  scores = np.einsum("bgrh,btgh->bgrt", qg, np.asarray(k)) * attention_math.score_scale(h)
  mask = (jnp.arange(t)[None, :] < lengths[:, None])[:, None, None, None, :]
  probs = attention_math.attention_probs(jnp.asarray(scores)[:, :, :, None, :], mask,
                                         q.dtype)[:, :, :, 0, :]
  out = da._pv(probs, vs, lengths, jnp.asarray([1], jnp.int32), h, packed=True,
               config=da.AttentionConfig(impl="wgmma"), num_splits=splits, interpret=True)
  assert out.shape == (b, g, n // g, h) and out.dtype == q.dtype
  check_within_tolerance(out.reshape(b, n, h), reference(q, cache, lengths), values_of(cache),
                         lengths, n)
