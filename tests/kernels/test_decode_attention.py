"""trace_jax/kernels: the packed NVFP4 KV cache and the decode-attention kernel.

On CPU the Pallas kernels run with interpret=True; on the GPU (`interpret=None` resolves to
False there) the same tests run the Triton kernels. References are computed on the CPU: the
quantizer tests' numpy reference (`numpy_ref`) for what the trainer's site writes, and on the
CPU device `formats` (bit-exact on every backend, docs/numerics.md) for the cache's values and
`attention_math.attend` for attention, so XLA's GPU rewrites of the reference's bf16 roundings
(excess precision) cannot move the target.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpy_ref
import pytest

from tests.kernels.attention_cases import ATTN_CASES, DEFAULT_WORDS
from tests.kernels.attention_cases import attn_inputs as _attn_inputs
from tests.kernels.attention_cases import bits as _bits
from tests.kernels.attention_cases import check_within_tolerance as _check_within_tolerance
from tests.kernels.attention_cases import make_cache as _cache
from tests.kernels.attention_cases import on_cpu as _on_cpu
from tests.kernels.attention_cases import quantize_rows as _quantize_rows
from tests.kernels.attention_cases import reference as _reference
from tests.kernels.attention_cases import tolerance as _tolerance
from tests.kernels.attention_cases import values_of as _values
from trace_jax.kernels import common, kv_cache
from trace_jax.kernels import decode_attention as da
from trace_jax.kernels.decode_attention import AttentionConfig


def _site_reference(x: jax.Array) -> dict[str, np.ndarray]:
  """What the trainer's `k`/`v` site makes of rows x (RTN NVFP4, row second-level scale), by
  the quantizer tests' numpy reference (`numpy_ref`: no XLA program to compile, so the GPU
  machine's tests do not compile the quantizer for XLA's CPU backend, which stalled there):
  codes, block-scale bytes, the row scale, and the values in bf16 (`dequant_bf16`)."""
  x32 = np.asarray(x).astype(np.float32)
  ref = numpy_ref.ref_nvfp4(x32, numpy_ref.ref_tensor_scale(x32, (-1,)))
  ref["dequant_bf16"] = ref["dequant"].astype(jnp.bfloat16)
  return ref


# ----------------------------------------------------------------------------- K/V row cases

def _rows(case: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
  """float32 K/V rows [..., H] (rounded to bf16 by the caller) for a named edge case."""
  h = shape[-1]
  if case == "random":  # Gaussian rows with log-normal row magnitudes
    return rng.standard_normal(shape) * np.exp(rng.standard_normal(shape[:-1] + (1,)))
  if case == "zeros":  # +0 and -0 rows (codes 0 and 8), and one-nonzero rows
    x = np.zeros(shape)
    x[..., 1::2, :] = -0.0
    x[..., 0, 0, 5] = 3.0
    return x
  if case == "saturation":  # block maxima at +-6 steps, values at E2M1 rounding ties
    grid = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.99, 6.0, -6.0, -5.0, -0.25])
    block_exp = rng.integers(-3, 4, shape[:-1] + (h // 16,))
    x = rng.choice(grid, shape) * np.repeat(2.0**block_exp, 16, axis=-1)
    x[..., 0] = 6.0 * 2.0**4  # the row maximum sets the second-level scale
    return x
  if case == "tiny_blocks":  # block scales below E4M3's normal range, clamped to 2**-6
    x = rng.standard_normal(shape) * 1e-5
    x[..., :16] = rng.standard_normal(shape[:-1] + (16,)) * 10.0
    return x
  if case == "row_magnitudes":  # rows 2**-60 .. 2**60 apart in one array
    e = rng.integers(-60, 61, shape[:-1] + (1,))
    return rng.standard_normal(shape) * 2.0**e
  raise ValueError(case)


ROW_CASES = ["random", "zeros", "saturation", "tiny_blocks", "row_magnitudes"]
B, T, G, H, S = 2, 24, 2, 64, 5
# Scattered per-sequence positions of two writes (the second must not clobber the first).
POS1 = np.array([[3, 17, 0, 22, 9], [20, 1, 11, 5, 14]])
POS2 = np.array([[4, 18, 23, 10, 2], [0, 7, 19, 23, 12]])


def _written_cache(case: str, seed: int = 0, words: bool | None = None):
  rng = np.random.default_rng(seed)
  rows = [jnp.asarray(_rows(case, (B, S, G, H), rng), jnp.bfloat16) for _ in range(4)]
  cache = kv_cache.init_packed_cache(B, T, G, H, words=DEFAULT_WORDS if words is None else words)
  cache = kv_cache.write(cache, rows[0], rows[1], jnp.asarray(POS1))
  qk, qv = (_quantize_rows(r) for r in rows[2:])
  cache = kv_cache.write_quantized(cache, qk, qv, jnp.asarray(POS2))
  return cache, rows


@pytest.mark.parametrize("words", [False, True], ids=["bytes", "words"])
@pytest.mark.parametrize("case", ROW_CASES)
def test_write_dequantize_bit_equal(case, words):
  """Written rows dequantize to the trainer's fake-quantized values, bit for bit (XLA and the
  kernel's in-register decoder: the bits decoder for bytes, the words decoder for words);
  unwritten slots stay +0; codes, block-scale bytes and row scales are the numpy reference's,
  in either codes layout."""
  cache, rows = _written_cache(case, words=words)
  assert cache.words == words
  k, v = _on_cpu(lambda c: kv_cache.dequantize(c, jnp.bfloat16), cache)
  kp, vp = da.dequantize_pallas(cache, jnp.bfloat16)
  np.testing.assert_array_equal(_bits(kp), _bits(k))
  np.testing.assert_array_equal(_bits(vp), _bits(v))
  written = np.zeros((B, T), bool)
  bidx = np.arange(B)[:, None]
  for (xk, xv), pos in (((rows[0], rows[1]), POS1), ((rows[2], rows[3]), POS2)):
    ref, ref_v = _site_reference(xk), _site_reference(xv)
    np.testing.assert_array_equal(_bits(k[bidx, pos]), _bits(ref["dequant_bf16"]))
    np.testing.assert_array_equal(_bits(v[bidx, pos]), _bits(ref_v["dequant_bf16"]))
    codes = ref["codes"].reshape(ref["codes"].shape[:-1] + (-1, 2))
    np.testing.assert_array_equal(np.asarray(cache.as_bytes().k_codes)[bidx, pos],
                                  codes[..., 0] | (codes[..., 1] << 4))  # element 2i: low
    np.testing.assert_array_equal(np.asarray(cache.k_block)[bidx, pos].view(np.uint8),
                                  ref["block_scale"])
    np.testing.assert_array_equal(_bits(np.asarray(cache.k_row)[bidx, pos]),
                                  _bits(ref["tensor_scale"][..., 0]))
    written[bidx, pos] = True
  assert not np.any(_bits(k)[~written]) and not np.any(_bits(v)[~written])
  if case == "zeros":  # -0 rows keep their sign through the cache
    assert np.any(_bits(k)[written] == 0x8000)


@pytest.mark.parametrize("words", [False, True], ids=["bytes", "words"])
def test_pack_rows_equals_write(words):
  """A prefill-style `pack_rows` of whole [B, T, G, H] caches holds `write`'s bytes; codes as
  words are the same bytes in memory (`to_words`: little-endian words per block)."""
  rng = np.random.default_rng(5)
  k, v = (jnp.asarray(_rows("random", (B, S, G, H), rng), jnp.bfloat16) for _ in range(2))
  perm = jnp.asarray(np.stack([rng.permutation(S) for _ in range(B)]))
  bidx = jnp.arange(B)[:, None]
  written = kv_cache.write(kv_cache.init_packed_cache(B, S, G, H, words=words), k[bidx, perm],
                           v[bidx, perm], perm)
  packed = kv_cache.pack_rows(k, v, words=words)
  bytes_ = kv_cache.pack_rows(k, v, words=False)
  assert written.words == packed.words == words and packed.shape == (B, S, G, H)
  for name in ("k_codes", "v_codes", "k_block", "v_block", "k_row", "v_row"):
    a, b, c = (np.asarray(getattr(x, name)) for x in (written, packed, bytes_))
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=name)
    np.testing.assert_array_equal(a.reshape(-1).view(np.uint8), c.reshape(-1).view(np.uint8),
                                  err_msg=name)
  assert packed.as_bytes().as_words().k_codes.dtype == jnp.uint32


def test_dequantize_float32_bit_equal():
  """The bits decoder's float32 values (before any cast) are `formats.nvfp4_dequantize`'s (it
  reads the codes as bytes; the words decoder makes bf16/f16 only)."""
  cache, _ = _written_cache("random", seed=1)
  k, v = _on_cpu(lambda c: kv_cache.dequantize(c, jnp.float32), cache)
  kp, vp = da.dequantize_pallas(cache.as_bytes(), jnp.float32)
  np.testing.assert_array_equal(_bits(kp), _bits(k))
  np.testing.assert_array_equal(_bits(vp), _bits(v))


# (name, codes as words, AttentionConfig fields); both decoders run the Triton kernels on the
# GPU (the codes' layout picks the decoder: bytes the bits one, words the words one).
DECODER_CASES = [
    ("bits", False, {"block_t": 16}),
    ("words", True, {"block_t": 16}),
    ("words_exact", True, {"block_t": 16, "table": "exact"}),
]


@pytest.mark.parametrize("name,words,opts", DECODER_CASES, ids=[c[0] for c in DECODER_CASES])
def test_decoder_every_code_and_scale_byte(name, words, opts):
  """All 256 code bytes against all 256 E4M3 block-scale bytes (subnormal scales, negative
  scales, NaN 0x7F/0xFF) decode as `formats` does; NaN where formats gives NaN. Some row
  scales lie outside the words decoder's fast table range (2**118 .. 2**127)."""
  rng = np.random.default_rng(2)
  t, g, h = 256, 1, 32  # 256 rows; 16 code bytes and 2 scale bytes per row
  r = np.arange(t)
  codes = ((r[:, None] * 16 + np.arange(16)[None, :] * 17) % 256).astype(np.uint8)
  block = np.stack([r, (r * 7 + 3) % 256], axis=-1).astype(np.uint8)
  row = np.exp(rng.standard_normal(t)).astype(np.float32)
  row[::5] = 1.0
  # The last rows: scales beyond the fast table's range (so their tiles take the exact
  # table), large rather than tiny ones: no product is subnormal, which the CPU reference would
  # flush to zero and the GPU keep (some overflow to inf, on both).
  row[200:] = np.exp2(rng.uniform(118, 127, t - 200))
  cache = kv_cache.PackedKVCache(
      k_codes=jnp.asarray(codes.reshape(1, t, g, h // 2)),
      v_codes=jnp.asarray(codes[::-1].reshape(1, t, g, h // 2)),
      k_block=jnp.asarray(block.reshape(1, t, g, 2).view(jnp.float8_e4m3fn)),
      v_block=jnp.asarray(block[::-1].reshape(1, t, g, 2).view(jnp.float8_e4m3fn)),
      k_row=jnp.asarray(row.reshape(1, t, g)), v_row=jnp.asarray(row[::-1].reshape(1, t, g)))
  for dtype in (jnp.bfloat16, jnp.float32):
    if words and dtype == jnp.float32:
      continue  # the words decoder makes bf16/f16 only
    want = _on_cpu(lambda c, d=dtype: kv_cache.dequantize(c, d), cache)
    got = da.dequantize_pallas(cache.as_words() if words else cache, dtype,
                               config=AttentionConfig(**opts))
    for w, x in zip(want, got):
      x = np.asarray(x)
      nan = np.isnan(w.astype(np.float32))
      np.testing.assert_array_equal(np.isnan(x.astype(np.float32)), nan)
      np.testing.assert_array_equal(_bits(x)[~nan], _bits(w)[~nan])
      assert nan.any() and (~nan).any()


# ----------------------------------------------------------------------------- attention

# Packed-cache variants: kind -> (codes as words, AttentionConfig fields). "packed": the
# default layout (words on the GPU, bytes in interpret mode); "packed_words" the words decoder
# (K in the MMA operand order where H % 64 == 0, natural order else); "packed_bits" bytes and
# the bits decoder.
PACKED_VARIANTS = {"packed": (None, {}), "packed_words": (True, {}),
                   "packed_words_exact": (True, {"table": "exact"}),
                   "packed_bits": (False, {}),
                   "packed_wgmma": (True, {"impl": "wgmma"}),
                   "packed_wgmma_fused": (True, {"impl": "wgmma_fused"})}
# GPU only (Mosaic GPU, inline PTX)
WGMMA_KINDS = ("packed_wgmma", "packed_wgmma_fused")
KERNEL_CASES = [(name, kind) for name in ATTN_CASES for kind in ("bf16", "packed",
                                                                   "packed_words")] + [
    ("full_r8", "packed_bits"), ("full_r8", "packed_words_exact"),
    ("len1_r4", "packed_words_exact"), ("mixed_lengths_r2_split3", "packed_words_exact")] + [
    (name, kind) for name in ("full_r8", "mixed_r8") for kind in WGMMA_KINDS] + [
    ("mixed_r8_split2", "packed_wgmma_fused"), ("long_r8_split3", "packed_wgmma_fused"),
    ("mixed_r8_split2", "packed_wgmma"), ("long_r8_split3", "packed_wgmma")]
# R = 8 and head_dim 128, the wgmma kernels' shape (GPU only): lengths 1 and mid-tile (rows
# from the pool: B x T x G <= POOL).
# Splits of the single-pass kernel and of the wgmma PV kernel: one without keys (sequence 0's
# second), and three of two tiles each over a length ending mid-tile.
ATTN_CASES_GPU = {"mixed_r8": (2, 128, 4, 32, 128, [1, 70], 64, 1),
                  "mixed_r8_split2": (2, 128, 4, 32, 128, [1, 70], 64, 2),
                  "long_r8_split3": (1, 384, 2, 16, 128, [301], 64, 3)}


@pytest.mark.parametrize("name,kind", KERNEL_CASES, ids=[f"{n}-{k}" for n, k in KERNEL_CASES])
def test_kernel_matches_reference(name, kind):
  """Kernel vs `attend` on the same cache values within `output_tolerance`, and on CPU bit for
  bit in >= 99% of the elements (the same probabilities: online softmax, which rounds
  unnormalized ones, is far from that); a sequence of
  length 1 gets its single V row exactly (softmax weight 1, so the kernel's in-register V
  decode shows through; compared as values, since the PV dot turns -0 into +0)."""
  if kind in WGMMA_KINDS and common.default_interpret():
    pytest.skip("wgmma_attention runs on a Hopper GPU only: Mosaic GPU with inline PTX, no "
                "interpret mode (its CPU coverage: tests/kernels/test_wgmma_attention.py)")
  b, t, g, n, h, lengths, block_t, splits = {**ATTN_CASES, **ATTN_CASES_GPU}[name]
  words, opts = PACKED_VARIANTS.get(kind, (None, {}))
  q, kv, pos = _attn_inputs(b, t, g, n, h)
  cache = _cache("bf16" if kind == "bf16" else "packed", kv, pos, words=words)
  lengths = jnp.asarray(lengths, jnp.int32)
  out = da.decode_attention(q, cache, lengths, config=AttentionConfig(
      block_t=block_t, num_splits=splits, **opts))
  assert out.shape == q.shape and out.dtype == q.dtype
  ref = _reference(q, cache, lengths)
  vals = _on_cpu(_values, cache)
  _check_within_tolerance(out, ref, vals, lengths, n)
  if common.default_interpret():  # CPU: `attend`'s probabilities and XLA's float32 exp/division
    same = np.mean(np.asarray(out).astype(np.float32) == ref)
    assert same >= 0.99, f"only {same:.4f} of the outputs equal attend's bit for bit"
  for bi in np.flatnonzero(np.asarray(lengths) == 1):  # values: the PV dot turns -0 into +0
    want = np.repeat(vals[bi, 0], n // g, axis=0).astype(np.float32)  # head i: kv i // R
    np.testing.assert_array_equal(np.asarray(out)[bi].astype(np.float32), want)


@pytest.mark.parametrize("kind", ["bf16", "packed", "packed_words", "packed_wgmma",
                                  "packed_wgmma_fused"])
def test_stacked_layer_is_read_in_place(kind):
  """A stack of layers [L, ...] read at a (traced) layer gives that layer's result bit for bit,
  and the other layers' rows (NaN here) never reach it."""
  if kind in WGMMA_KINDS and common.default_interpret():
    pytest.skip("wgmma_attention runs on a Hopper GPU only: Mosaic GPU with inline PTX, no "
                "interpret mode (its CPU coverage: tests/kernels/test_wgmma_attention.py)")
  case = "mixed_r8" if kind in WGMMA_KINDS else "mixed_lengths_r2_split3"
  b, t, g, n, h, lengths, block_t, splits = {**ATTN_CASES, **ATTN_CASES_GPU}[case]
  q, kv, pos = _attn_inputs(b, t, g, n, h, seed=6)
  lengths = jnp.asarray(lengths, jnp.int32)
  words, opts = PACKED_VARIANTS.get(kind, (None, {}))
  one = _cache("bf16" if kind == "bf16" else "packed", kv, pos, words=words)
  config = AttentionConfig(block_t=block_t, num_splits=splits, **opts)
  want = np.asarray(da.decode_attention(q, one, lengths, config=config))
  poison = lambda a: jnp.full_like(a, np.nan) if a.dtype in (jnp.bfloat16, jnp.float32) else a
  stack = jax.tree.map(lambda a: jnp.stack([poison(a), a, poison(a)]), one)
  if kind == "bf16":
    stack = tuple(stack)
  run = jax.jit(lambda c, i: da.decode_attention(q, c, lengths, layer=i, config=config))
  got = np.asarray(run(stack, jnp.int32(1)))
  np.testing.assert_array_equal(_bits(got), _bits(want))
  with pytest.raises(ValueError, match="layer axis"):
    da.decode_attention(q, one, lengths, layer=jnp.int32(0))


@pytest.mark.parametrize("kind,case", [(k, c) for k in WGMMA_KINDS
                                       for c in ("mixed_r8", "long_r8_split3")])
def test_prefetch_changes_no_bit(kind, case):
  """L2 prefetches ahead of the decode (1 and 5 tiles; 5 runs past every split and length,
  clamped) give the kernels' outputs bit for bit."""
  if common.default_interpret():
    pytest.skip("wgmma_attention runs on a Hopper GPU only: Mosaic GPU with inline PTX, no "
                "interpret mode (its CPU coverage: tests/kernels/test_mosaic_lowering.py)")
  b, t, g, n, h, lengths, block_t, splits = ATTN_CASES_GPU[case]
  q, kv, pos = _attn_inputs(b, t, g, n, h, seed=8)
  words, opts = PACKED_VARIANTS[kind]
  cache = _cache("packed", kv, pos, words=words)
  lengths = jnp.asarray(lengths, jnp.int32)
  run = lambda d: np.asarray(da.decode_attention(q, cache, lengths, config=AttentionConfig(
      block_t=block_t, num_splits=splits, prefetch=d, **opts)))
  want = run(0)
  for d in (1, 5):
    np.testing.assert_array_equal(_bits(run(d)), _bits(want))


def test_tolerance_rejects_plausible_bugs():
  """The stated tolerance is tight enough to fail: one key too many, the wrong kv head per
  query head, and unquantized K/V all exceed it."""
  b, t, g, n, h, _, block_t, splits = ATTN_CASES["mixed_lengths_r2_split3"]
  q, kv, pos = _attn_inputs(b, t, g, n, h, seed=3)
  lengths = jnp.asarray([5, 9, 12, 30], jnp.int32)
  cache = _cache("packed", kv, pos)
  vals = _on_cpu(_values, cache)
  out = np.asarray(da.decode_attention(q, cache, lengths, config=AttentionConfig(
      block_t=block_t, num_splits=splits))).astype(np.float32)
  tol = lambda ref: _on_cpu(lambda *a: _tolerance(*a, num_heads=n), vals, lengths, ref)
  ok = _reference(q, cache, lengths)
  assert np.all(np.abs(out - ok) <= tol(ok))
  r = n // g
  perm = np.array([(j % r) * g + j // r for j in range(n)])  # head i reads kv head i % G
  wrong = {
      "one key too many": _reference(q, cache, lengths + 1),
      "kv head i % G": _reference(q[:, perm], cache, lengths)[:, np.argsort(perm)],
      "unquantized K/V": _reference(q, _cache("bf16", kv, pos), lengths),
  }
  for what, ref in wrong.items():
    assert np.any(np.abs(out - ref) > tol(ref)), what


def test_masked_keys_are_ignored_and_length_zero():
  """Garbage beyond `lengths` (NaN in a BF16 cache, NaN/huge scale bytes in a packed one)
  never reaches the output; a length of 0 gives zeros."""
  b, t, g, n, h, _, block_t, splits = ATTN_CASES["mixed_lengths_r2_split3"]
  q, kv, pos = _attn_inputs(b, t, g, n, h, seed=4)
  lengths = jnp.asarray([0, 37, 64, 99], jnp.int32)
  beyond = (jnp.arange(t)[None, :] >= lengths[:, None])[:, :, None, None]
  for kind in ("bf16", "packed", "packed_words"):
    clean = _cache(kind.removesuffix("_words"), kv, pos,
                   words=True if kind == "packed_words" else None)
    if kind == "bf16":
      dirty = tuple(jnp.where(beyond, jnp.asarray(np.nan, a.dtype), a) for a in clean)
    else:
      nan_scale = jnp.asarray(np.full((), 0x7F, np.uint8).view(jnp.float8_e4m3fn))
      dirty = clean.replace(
          k_block=jnp.where(beyond, nan_scale, clean.k_block),
          v_block=jnp.where(beyond, nan_scale, clean.v_block),
          v_row=jnp.where(beyond[..., 0], jnp.float32(3e38), clean.v_row),
          v_codes=jnp.where(beyond[..., None] if clean.words else beyond,
                            clean.v_codes.dtype.type(0x77777777 if clean.words else 0x77),
                            clean.v_codes))
    out = np.asarray(da.decode_attention(q, dirty, lengths, config=AttentionConfig(
        block_t=block_t, num_splits=splits))).astype(np.float32)
    assert np.all(out[0] == 0)
    ref = _reference(q, clean, lengths)
    _check_within_tolerance(out[1:], ref[1:], _on_cpu(_values, clean)[1:], lengths[1:], n)


@pytest.mark.parametrize("what", ["q_rank", "heads", "lengths", "block_t", "prefetch",
                                  "head_dim"])
def test_bad_input(what):
  q = jnp.zeros((2, 4, 64), jnp.bfloat16)
  cache = (jnp.zeros((2, 16, 2, 64), jnp.bfloat16),) * 2
  lengths = jnp.ones((2,), jnp.int32)
  if what in ("block_t", "prefetch"):
    with pytest.raises(ValueError, match=what):
      AttentionConfig(**{what: {"block_t": 24, "prefetch": -1}[what]})
  elif what == "q_rank":
    q = q[:, None]
  elif what == "heads":
    q = jnp.zeros((2, 3, 64), jnp.bfloat16)
  elif what == "lengths":
    lengths = jnp.ones((3,), jnp.int32)
  else:
    q, cache = q[..., :24], tuple(a[..., :24] for a in cache)
  if what not in ("block_t", "prefetch"):
    with pytest.raises(ValueError):
      da.decode_attention(q, cache, lengths)
  with pytest.raises(ValueError):
    kv_cache.init_packed_cache(1, 4, 1, 40)


def test_codes_layout_must_fit_the_decoder():
  """A cache of code words decodes to bf16/f16 only (the words decoder); k and v codes share
  one layout; a bad AttentionConfig is refused by name."""
  cache, _ = _written_cache("random")
  q, lengths = jnp.zeros((B, 2 * G, H), jnp.bfloat16), jnp.ones((B,), jnp.int32)
  with pytest.raises(ValueError, match="bf16/f16"):
    da.decode_attention(q.astype(jnp.float32), cache.as_words(), lengths)
  with pytest.raises(ValueError, match="bf16/f16"):
    da.dequantize_pallas(cache.as_words(), jnp.float32)
  with pytest.raises(ValueError, match="differ"):
    da.decode_attention(q, cache.as_bytes().replace(v_codes=cache.as_words().v_codes), lengths)
  with pytest.raises(ValueError, match="impl must be one of"):
    AttentionConfig(impl="cuda")
  with pytest.raises(ValueError, match="table must be one of"):
    AttentionConfig(table="quick")
