"""Packed NVFP4 KV cache: per layer, K and V rows as E2M1 codes, E4M3 block scales, FP32 scales.

Under FP4 policies the model fake-quantizes K and V at the `k`/`v` sites before they enter the
cache (`Precision.kv_site`: rows = (token, kv head), blocks of 16 along head_dim, two-level with
the row's FP32 second-level scale), then stores the dequantized values in BF16: as many bytes as
a BF16 cache. This cache stores what the quantizer produced instead, 4.5 bits per element plus
32 bits per head row (76 bytes instead of 256 for head_dim 128), and `dequantize` rebuilds the
values the trainer's forward sees, bit for bit: `formats.nvfp4_dequantize(q).astype(dtype)`.

The codes are held as bytes (`formats.pack_fp4`'s layout) or, on the GPU, as the same bytes
viewed as two little-endian uint32 words per block of 16 (`as_words`, the layout the attention
kernels' "words" decoder reads: one table per block, built by the thread that decodes it, as
`fp4_moe.PackedNVFP4Weights`' words); the caller picks the layout (the kernel plan's
`fp4_codes`), and every writer keeps the cache's layout.

The quantizer is `trace_jax.quant.formats` itself (RTN, as the rollout records it). `write`
must get K/V rows *before* the site's fake quantization: quantizing already-dequantized values
again is not the identity (the row amax, hence the row scale, moves). `write_quantized` takes
the site's `NVFP4Tensor`s directly when the caller already quantized them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from trace_jax.kernels import fp4_decode
from trace_jax.quant import formats


@struct.dataclass
class PackedKVCache:
  """One layer's NVFP4 KV cache.

  k_codes, v_codes: uint8 [B, T, G, H // 2], two E2M1 codes per byte (`formats.pack_fp4`:
    element 2i in the low nibble); or the same bytes as uint32 words [B, T, G, H // 16, 2]
    (`as_words`: each block's 8 bytes as two little-endian words).
  k_block, v_block: float8_e4m3fn [B, T, G, H // 16], the block scales.
  k_row, v_row: float32 [B, T, G], the per-(token, kv head) second-level scales.
  Unwritten slots are all zero bytes, which dequantize to +0 (as a zero BF16 cache holds).
  """
  k_codes: jax.Array
  v_codes: jax.Array
  k_block: jax.Array
  v_block: jax.Array
  k_row: jax.Array
  v_row: jax.Array

  @property
  def words(self) -> bool:
    """Whether the codes are held as uint32 words per block (`as_words`)."""
    return self.k_codes.dtype == jnp.uint32

  @property
  def shape(self) -> tuple[int, ...]:
    """(B, T, G, H) of the K/V arrays this cache holds ((L, B, T, G, H) for a stack of
    layers)."""
    if self.words:
      *lead, kb, _ = self.k_codes.shape
      return (*lead, formats.NVFP4_BLOCK * kb)
    *lead, h2 = self.k_codes.shape
    return (*lead, 2 * h2)

  def as_words(self) -> PackedKVCache:
    """The same cache with the codes as uint32 words per block (no-op if they are)."""
    if self.words:
      return self
    return self.replace(k_codes=fp4_decode.to_words(self.k_codes),
                        v_codes=fp4_decode.to_words(self.v_codes))

  def as_bytes(self) -> PackedKVCache:
    """The same cache with the codes as bytes (`formats.pack_fp4`'s layout; no-op if they
    are)."""
    if not self.words:
      return self
    return self.replace(k_codes=fp4_decode.from_words(self.k_codes),
                        v_codes=fp4_decode.from_words(self.v_codes))

  def nbytes(self) -> int:
    """Bytes held (K and V), as the arrays are laid out in memory."""
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(self))


def bytes_per_head_row(head_dim: int) -> int:
  """Bytes of one (token, kv head) row of K or V: codes, block scales, row scale."""
  return head_dim // 2 + head_dim // formats.NVFP4_BLOCK + 4


def _check_head_dim(head_dim: int) -> None:
  if head_dim % formats.NVFP4_BLOCK:
    raise ValueError(f"head_dim {head_dim} is not a multiple of the NVFP4 block "
                     f"{formats.NVFP4_BLOCK}")


def init_packed_cache(batch: int, max_len: int, num_kv_heads: int, head_dim: int,
                      words: bool = False) -> PackedKVCache:
  """An empty (all-zero) cache of [batch, max_len, num_kv_heads, head_dim] K and V; codes as
  words or bytes."""
  _check_head_dim(head_dim)
  lead = (batch, max_len, num_kv_heads)
  if words:
    codes = jnp.zeros(lead + (head_dim // formats.NVFP4_BLOCK, 2), jnp.uint32)
  else:
    codes = jnp.zeros(lead + (head_dim // 2,), jnp.uint8)
  block = jnp.zeros(lead + (head_dim // formats.NVFP4_BLOCK,), jnp.float8_e4m3fn)
  row = jnp.zeros(lead, jnp.float32)
  return PackedKVCache(k_codes=codes, v_codes=codes, k_block=block, v_block=block,
                       k_row=row, v_row=row)


def quantize_rows(x: jax.Array) -> formats.NVFP4Tensor:
  """NVFP4 of K or V rows [..., H] exactly as the `k`/`v` sites quantize them (RTN, two-level
  with the per-row second-level scale)."""
  return formats.nvfp4_quantize(x, formats.nvfp4_row_scale(x))


def _scatter(a: jax.Array, new: jax.Array, positions: jax.Array,
             layer: jax.Array | None = None) -> jax.Array:
  """a [B, T, ...] (or [L, B, T, ...] written at `layer`) with new [B, S, ...] written at
  positions [B, S] (as attention.py does)."""
  bidx = jnp.arange(positions.shape[0])[:, None]
  if layer is None:
    return a.at[bidx, positions].set(new.astype(a.dtype))
  return a.at[layer, bidx, positions].set(new.astype(a.dtype))


def write_quantized(cache: PackedKVCache, qk: formats.NVFP4Tensor, qv: formats.NVFP4Tensor,
                    positions: jax.Array, layer: jax.Array | None = None) -> PackedKVCache:
  """Writes NVFP4 K/V rows (codes [B, S, G, H], two-level) at per-sequence positions [B, S];
  with `layer` (int32 scalar, may be traced), the cache is a stack of layers [L, B, T, ...]
  and the rows go into that layer in place (the engine's per-run cache)."""
  b, t, g, h = cache.shape[0 if layer is None else 1:]
  for name, q in (("k", qk), ("v", qv)):
    if q.codes.shape[0] != b or q.codes.shape[2:] != (g, h) or q.tensor_scale is None:
      raise ValueError(f"write_quantized: {name} codes of shape {q.codes.shape} (two-level "
                       f"expected) do not fit a cache of [B, T, G, H] = {(b, t, g, h)}")
  if positions.shape != qk.codes.shape[:2]:
    raise ValueError(f"write_quantized: positions of shape {positions.shape}, expected "
                     f"{qk.codes.shape[:2]}")
  return _write(cache, qk, qv, positions, layer)


@jax.jit
def _write(cache, qk, qv, positions, layer):
  lead = qk.codes.shape[:3]
  row = lambda q: jnp.broadcast_to(q.tensor_scale, lead + (1,))[..., 0]
  codes = lambda q: _codes_like(cache, formats.pack_fp4(q.codes))
  return PackedKVCache(
      k_codes=_scatter(cache.k_codes, codes(qk), positions, layer),
      v_codes=_scatter(cache.v_codes, codes(qv), positions, layer),
      k_block=_scatter(cache.k_block, qk.block_scale, positions, layer),
      v_block=_scatter(cache.v_block, qv.block_scale, positions, layer),
      k_row=_scatter(cache.k_row, row(qk), positions, layer),
      v_row=_scatter(cache.v_row, row(qv), positions, layer))


def _codes_like(cache: PackedKVCache, packed: jax.Array) -> jax.Array:
  """Code bytes [..., H // 2] in the cache's codes layout."""
  return fp4_decode.to_words(packed) if cache.words else packed


@jax.jit
def write(cache: PackedKVCache, k: jax.Array, v: jax.Array,
          positions: jax.Array) -> PackedKVCache:
  """Quantizes new K/V rows [B, S, G, H] (unquantized values) and writes them at positions
  [B, S], one position per sequence and token, as the BF16 cache update of attention.py."""
  if k.shape != v.shape:
    raise ValueError(f"write: k {k.shape} and v {v.shape} differ")
  q = quantize_rows(jnp.stack([k, v]))  # one quantizer for both (rows are independent)
  qk, qv = (jax.tree.map(lambda a, i=i: a[i], q) for i in (0, 1))
  return write_quantized(cache, qk, qv, positions)


def pack_rows(k: jax.Array, v: jax.Array, words: bool = False) -> PackedKVCache:
  """A whole cache from K/V rows [B, T, G, H] (a prefill; no scatter): the same bytes as
  `write` of every position into an empty cache (codes as words or bytes)."""
  return _pack_rows(k, v, words=bool(words))


@functools.partial(jax.jit, static_argnames=("words",))
def _pack_rows(k: jax.Array, v: jax.Array, *, words: bool) -> PackedKVCache:
  qk, qv = quantize_rows(k), quantize_rows(v)
  cache = PackedKVCache(
      k_codes=formats.pack_fp4(qk.codes), v_codes=formats.pack_fp4(qv.codes),
      k_block=qk.block_scale, v_block=qv.block_scale,
      k_row=qk.tensor_scale[..., 0], v_row=qv.tensor_scale[..., 0])
  return cache.as_words() if words else cache


def _dequantize_one(codes: jax.Array, block: jax.Array, row: jax.Array,
                    dtype: jnp.dtype) -> jax.Array:
  q = formats.NVFP4Tensor(codes=formats.unpack_fp4(codes), block_scale=block,
                          tensor_scale=row[..., None])
  return formats.nvfp4_dequantize(q).astype(dtype)


@functools.partial(jax.jit, static_argnames=("dtype",))
def dequantize(cache: PackedKVCache,
               dtype: jnp.dtype = jnp.bfloat16) -> tuple[jax.Array, jax.Array]:
  """(k, v) [B, T, G, H] in `dtype`: the trainer's fake-quantized values, bit for bit (XLA)."""
  cache = cache.as_bytes()
  return (_dequantize_one(cache.k_codes, cache.k_block, cache.k_row, dtype),
          _dequantize_one(cache.v_codes, cache.v_block, cache.v_row, dtype))
