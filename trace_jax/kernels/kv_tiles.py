"""K/V tiles of a decode step's cache, decoded in a kernel's registers (the decode-attention
kernels' and the dequantize kernel's shared decoders).

Packed cache (`kv_cache.PackedKVCache`): each tile loads the E2M1 codes, E4M3 block scales
and FP32 row scales and decodes them in registers (no float8 `astype`, which XLA or Triton may
rewrite, no gathers) to `formats.nvfp4_dequantize`'s values in the compute dtype, bit for bit,
with one of two decoders, by the cache's codes layout (the kernel plan's `fp4_codes`):
- "words" (the GPU's, bf16/f16; the cache's codes held as words per block,
  `PackedKVCache.as_words`): `fp4_decode.decode_words`, one table of the block's 8 results
  per (row, block), built by the thread that decodes the block, and byte-permute lookups in
  PTX inline assembly. The row scales pick the table per key tile: fast (every scale the
  quantizer makes; unwritten rows' 0 too) or exact (extreme row scales). K may be decoded in
  the MMA operand order (`fp4_decode.mma_order`, head_dim a multiple of 64), q's columns then
  put in the same order outside the kernel: the dot's terms are the same, summed in another
  float32 order.
- "bits" (codes as bytes, the interpreter's layout): integer/bit arithmetic per element
  (`_e2m1_half`), `(code_value * block_scale) * row_scale` in float32 (the first product exact,
  the second rounding once), then a cast to the compute dtype.
A per-byte table decoder of the bytes layout is gone: on the H200 it failed the check of
`experiments/bench/decode_attention.py` (err/tol 24 at 8k contexts) where the words decoder
passes (0.145, the BF16 kernel 0.136: docs/benchmarks.md, decode attention) and runs 1.08-1.13x
faster.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from trace_jax.kernels import common, fp4_decode
from trace_jax.quant import formats


def _neg(x: jax.Array, negative: jax.Array) -> jax.Array:
  """-x where `negative`, by multiplication (Triton lowers negation as 0 - x: loses -0)."""
  return jnp.where(negative, x * np.float32(-1.0), x)


def _bits_f32(x: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(x, jnp.float32)


def e4m3_value_from_bits(bits: jax.Array, log2_factor: int = 0) -> jax.Array:
  """float32 value of E4M3 bytes given as int32 0..255, times 2**log2_factor (exact), as
  `exact.e4m3_value` computes it."""
  e = (bits >> 3) & 0xF
  m = (bits & 0x7).astype(jnp.float32)
  pow2 = _bits_f32((e + (127 - 7 + log2_factor)) << 23)  # 2**(e - 7 + log2_factor)
  normal = pow2 * (np.float32(1.0) + m * np.float32(0.125))
  mag = jnp.where(e == 0, m * np.float32(2.0**(-9 + log2_factor)), normal)
  mag = jnp.where((bits & 0x7F) == 0x7F, np.float32(np.nan), mag)
  return _neg(mag, (bits & 0x80) != 0)


# E2M1 magnitudes come out as |value| / 4 (`_e2m1_half`); the block scale takes the 4.
_E2M1_LOG2_FACTOR = 2


def _e2m1_half(c: jax.Array, shift: int, bs4: jax.Array, row: jax.Array) -> jax.Array:
  """float32 (|code| * block_scale) * row_scale with the code's sign, for the nibble of the
  bytes c (int32) at bit `shift`; bs4 (4 * block_scale) and row broadcast to c's shape.

  Few integer ops (this decode bounds the kernel's speed): with m = |code| (3 bits) put at
  float32 bits 22..24 of exponent 124 (bits 23, 24 clear, so OR adds m >> 1 to it), f is
  2**-3 * {1, 1.5, 2, 3, 4, 6, 8, 12}[m], and min(f, 2 f - 1/4) is |value| / 4 for every m
  (the E2M1 values are {0, .5, 1, 1.5, 2, 3, 4, 6}). All of it is exact, and
  (|value| / 4) * (4 bs) = |value| * bs exactly, so the one rounding (times row) is
  `formats.nvfp4_dequantize`'s. The code's sign flips the sign bit last (code 8 gives -0).
  """
  f = _bits_f32(((c << (22 - shift)) & 0x01C00000) | 0x3E000000)
  quarter = jnp.minimum(f, f * np.float32(2.0) - np.float32(0.25))
  mag = (quarter * bs4) * row
  sign = (c << (28 - shift)) & jnp.int32(-2**31)
  return _bits_f32(jax.lax.bitcast_convert_type(mag, jnp.int32) ^ sign)


def decode_nvfp4_rows(codes: jax.Array, block_bits: jax.Array, row: jax.Array,
                      dtype: jnp.dtype, valid: jax.Array | None = None) -> jax.Array:
  """Rows [n, H] in `dtype` from packed codes [n, H/2] uint8, block-scale bytes [n, H/16]
  (uint8, the E4M3 bits) and row scales [n] float32; kernel-safe ops only.

  Bit-equal to `formats.nvfp4_dequantize(...).astype(dtype)` (same products, same order).
  valid [n]: rows outside it decode to +-0 whatever their bytes (masked loads leave them
  undefined), at the cost of a select per row and per block, not per element.
  """
  n, h2 = codes.shape
  h = 2 * h2
  bits = block_bits.astype(jnp.int32)
  if valid is not None:
    bits = jnp.where(valid[:, None], bits, 0)
    row = jnp.where(valid, row, np.float32(0.0))
  bs4 = e4m3_value_from_bits(bits, _E2M1_LOG2_FACTOR)  # [n, H/16]
  per_byte = formats.NVFP4_BLOCK // 2
  bs4 = jnp.broadcast_to(bs4[:, :, None], (n, h // formats.NVFP4_BLOCK, per_byte))
  bs4 = bs4.reshape(n, h2)
  row = jnp.broadcast_to(row[:, None], (n, h2))
  c = codes.astype(jnp.int32)
  lo = _e2m1_half(c, 0, bs4, row).astype(dtype)
  hi = _e2m1_half(c, 4, bs4, row).astype(dtype)
  return jnp.stack([lo, hi], axis=-1).reshape(n, h)  # element 2i: low nibble


def block_bits_of(x: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(x, jnp.uint8) if x.dtype != jnp.uint8 else x


def check_words(words: bool, dtype: jnp.dtype, interpret: bool) -> None:
  """A cache of code words decodes with the words decoder: bf16/f16, with Pallas' Triton
  inline assembly on the GPU (in interpret mode its programs run as jnp integer ops)."""
  if not words:
    return
  if not fp4_decode.supported_dtype(dtype):
    raise ValueError(f"a cache of code words decodes to bf16/f16 (the words decoder), got "
                     f"{jnp.dtype(dtype)}; hold the codes as bytes (PackedKVCache.as_bytes)")
  if not interpret and not fp4_decode.ASM_AVAILABLE:
    raise ValueError("a cache of code words needs Pallas' Triton inline assembly on the GPU")


def decode_words_rows(words: jax.Array, block_bits: jax.Array, row: jax.Array,
                      dtype: jnp.dtype, *, asm: bool, valid: jax.Array | None = None,
                      table: str | None = None, order: str = "natural") -> jax.Array:
  """Rows [n, H] in dtype from codes held as words [n, H/16, 2] (uint32), block-scale bytes
  [n, H/16] and row scales [n] (float32), by the words decoder (`fp4_decode.decode_words`: one
  table per (row, block), per-row second-level scales): bit-equal to `decode_nvfp4_rows` of the
  same bytes. order: "natural" or "mma" (`fp4_decode.mma_order`, H a multiple of 64). valid:
  rows outside it decode to +-0 (their scale bytes and row scale are zeroed first, so
  undefined masked loads cannot reach the tile's table branch)."""
  if valid is not None:
    block_bits = jnp.where(valid[:, None], block_bits, jnp.zeros((), block_bits.dtype))
    row = jnp.where(valid, row, np.float32(0.0))
  factors = tuple(f.reshape(row.shape[0], 1) for f in fp4_decode.tensor_scale_factors(row))
  w0, w1 = jnp.unstack(words, axis=-1)
  return fp4_decode.decode_words(w0, w1, block_bits, dtype, asm=asm, factors=factors,
                                 table=table, order=order)


def kv_tile(refs, lyr, b, g, t0: int, ok: jax.Array, block_t: int, dtype, *, packed: bool,
             asm: bool, table: str | None, order: str = "natural") -> jax.Array:
  """K or V rows t0 .. t0 + block_t of (layer lyr, sequence b, kv head g) in dtype: [bt, H]
  (codes as words: the words decoder, in `order`; as bytes: the bits decoder). Rows outside
  `ok` come out zero (masked loads leave them undefined, and 0 * NaN would reach the PV
  sum)."""
  rows = pl.ds(t0, block_t)
  if packed:
    c_ref, b_ref, r_ref = refs
    words = c_ref.dtype == jnp.uint32  # [.., H/16, 2] words, else [.., H/2] bytes
    mask_of = lambda shape: jnp.broadcast_to(ok.reshape((block_t,) + (1,) * len(shape)),
                                             (block_t,) + shape)
    tail = (slice(None),) * (2 if words else 1)
    code_shape = tuple(c_ref.shape[4:]) if words else (c_ref.shape[-1],)
    codes = common.masked_load(c_ref, (lyr, b, rows, g, *tail), mask_of(code_shape))
    bits = common.masked_load(b_ref, (lyr, b, rows, g, slice(None)), mask_of((b_ref.shape[-1],)))
    row = common.masked_load(r_ref, (lyr, b, rows, g), ok)
    if words:
      return decode_words_rows(codes, bits, row, dtype, asm=asm, valid=ok, table=table,
                               order=order)
    return decode_nvfp4_rows(codes, bits, row, dtype, valid=ok)
  (ref,) = refs
  mask = jnp.broadcast_to(ok[:, None], (block_t, ref.shape[-1]))
  x = common.masked_load(ref, (lyr, b, rows, g, slice(None)), mask).astype(dtype)
  return jnp.where(mask, x, jnp.zeros((), dtype))


def cache_arrays(cache, packed: bool) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
  """(K arrays, V arrays) as the kernels read them, each with a leading layer axis; the
  block scales as their bytes (a free bitcast)."""
  if not packed:
    return (cache[0],), (cache[1],)
  bits = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint8)
  return ((cache.k_codes, bits(cache.k_block), cache.k_row),
          (cache.v_codes, bits(cache.v_block), cache.v_row))


MIN_ROWS = 16  # Triton's smallest dot tile along M (and N, K)


def padded_rows(r: int) -> int:
  """Rows of a kernel's query tile for R query heads: a power of two >= 16 (Triton's smallest
  dot)."""
  return max(MIN_ROWS, common.next_pow2(r))


def grouped_queries(q: jax.Array, ks: tuple[jax.Array, ...], packed: bool
                    ) -> tuple[jax.Array, str]:
  """(q [B, N, H] as [B, G, Rp, H]: each kv head's R = N // G query heads padded to Rp rows
  (a power of two >= 16, Triton's smallest dot), K's decode order): with a cache of code words
  K is decoded in the MMA operand order where H allows it, and q's columns are put alike."""
  b, n, h = q.shape
  g = ks[0].shape[3]
  r = n // g
  rp = padded_rows(r)
  qg = jnp.pad(q.reshape(b, g, r, h), ((0, 0), (0, 0), (0, rp - r), (0, 0)))
  words = packed and ks[0].dtype == jnp.uint32
  order = "mma" if words and h % fp4_decode.MMA_ORDER_SPAN == 0 else "natural"
  return (fp4_decode.mma_order_columns(qg) if order == "mma" else qg), order


def key_splits(t: int, block_t: int, num_splits: int) -> tuple[int, int]:
  """(key blocks per split, splits) of a context of t keys in blocks of block_t cut into at
  most num_splits splits, every split holding at least one block."""
  nblk = -(-t // block_t)
  bps = -(-nblk // max(1, min(num_splits, nblk)))
  return bps, -(-nblk // bps)
