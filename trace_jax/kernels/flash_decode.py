"""Single-pass decode attention (flash decoding) over a BF16 or packed NVFP4 KV cache.

`decode_attention`'s exact pair writes the float32 scores [B, G, R, T] to memory, soft-maxes them
in XLA and reads the probabilities back for the PV sum: per key and kv head that is R x (4 + 4 +
2 + 2) bytes (96 at R = 8), next to the packed cache's 152 bytes of K and V at head_dim 128, so
at long contexts the score traffic is about 40% of the attention's bytes. This kernel keeps it
on chip. Program (b, g, s) of the grid (B, G, S) walks its split's key blocks below the length
(`kv_tiles.kv_tile` decodes K and V in registers, as the pair does) with an online softmax:

  m' = max(m, max_j s_j)           a  = exp(m - m')
  p_j = exp(s_j - m')              l' = a l + sum_j p_j          (float32)
  acc' = a acc + round(p, q.dtype) @ V                             (float32 dot)

and ends with out = acc / l (one split) or writes (acc, m, l); `combine` then rescales the
splits to their common maximum in float32 and divides once.

Numerics against `attention_math.attend` (the trainer's): the same float32 scores up to the dot's
summation order, but the probabilities rounded to q.dtype are the unnormalized exp(s - m') and
the division comes after the PV sum, so the outputs are not `attend`'s bits even on CPU (the
exact pair's are, nearly always). Each rounded p_j is within 2**-9 relative of its exact value,
as the pair's normalized ones are, so `decode_attention.output_tolerance` bounds it the same way
(tests). What the lost bits cost the rollout/trainer agreement depends on the trainer's
attention: on CPU (`attend`) the fused kernel doubles fp4_trace's |dlogp| against the exact
pair; on the GPU, where the trainer's attention is cuDNN's flash attention, it lowers it (0.72x
on the H100; docs/benchmarks.md, "Decode attention").

Keys at or beyond `lengths` are ignored entirely (masked to -inf before the maximum, their K/V
rows decoded as zeros); a length of 0 gives zeros.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from trace_jax.kernels import attention_math, common, kv_tiles


def _block_scores(q, k_refs, lyr, b, g, i, length, *, packed: bool, asm: bool,
                  table: str | None, order: str, block_t: int, scale: float):
  """Key block i's float32 scores [Rp, block_t] (-inf at and beyond the length) and its
  (t0, valid keys)."""
  t0 = pl.multiple_of(i * block_t, block_t)
  ok = t0 + jnp.arange(block_t) < length
  k = kv_tiles.kv_tile(k_refs, lyr, b, g, t0, ok, block_t, q.dtype, packed=packed, asm=asm,
                       table=table, order=order)
  s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                          preferred_element_type=jnp.float32) * np.float32(scale)
  return jnp.where(ok[None, :], s, np.float32(-np.inf)), t0, ok


def _program(layer_ref, len_ref, q_ref, *, packed: bool, asm: bool, table: str | None,
             order: str, block_t: int, blocks_per_split: int, scale: float):
  """What every program starts from: its (b, g, split), the layer, its key blocks [first, last)
  below sequence b's length, the length, its query rows q [Rp, H] (columns in the order K is
  decoded in) and `_block_scores`' tile arguments."""
  b, g, si = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  length = len_ref[b]
  first = si * blocks_per_split
  last = jnp.minimum(first + blocks_per_split, (length + block_t - 1) // block_t)
  tile = dict(packed=packed, asm=asm, table=table, order=order, block_t=block_t, scale=scale)
  return (b, g, si), layer_ref[0], (first, last, length), q_ref[b, g], tile


def _kernel(layer_ref, len_ref, q_ref, *refs, nk: int, packed: bool, asm: bool,
            table: str | None, order: str, r: int, block_t: int, blocks_per_split: int,
            splits: int, scale: float):
  """Program (b, g, split): the online softmax and PV sum over the split's key blocks."""
  k_refs, v_refs, out_refs = refs[:nk], refs[nk:2 * nk], refs[2 * nk:]
  (b, g, si), lyr, (first, last, length), q, tile = _program(
      layer_ref, len_ref, q_ref, packed=packed, asm=asm, table=table, order=order,
      block_t=block_t, blocks_per_split=blocks_per_split, scale=scale)
  dtype = q.dtype
  rp = q.shape[0]
  width = out_refs[0].shape[-1]

  def body(i, carry):
    acc, m, l = carry
    s, t0, ok = _block_scores(q, k_refs, lyr, b, g, i, length, **tile)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[:, None])
    v = kv_tiles.kv_tile(v_refs, lyr, b, g, t0, ok, block_t, dtype, packed=packed, asm=asm,
                         table=table)
    pv = jax.lax.dot_general(p.astype(dtype), v, (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)
    return acc * alpha[:, None] + pv, m_new, l * alpha + jnp.sum(p, axis=1)

  init = (jnp.zeros((rp, width), jnp.float32), jnp.full((rp,), -np.inf, jnp.float32),
          jnp.zeros((rp,), jnp.float32))
  acc, m, l = jax.lax.fori_loop(first, last, body, init)
  rows_ok = jnp.arange(rp) < r
  if splits == 1:
    out = jnp.where(l[:, None] > 0, acc / jnp.maximum(l, np.float32(1e-30))[:, None],
                    np.float32(0.0))
    _store_out(out_refs[0], out, b, g, si, rows_ok, splits)
    return
  o_ref, m_ref, l_ref = out_refs
  _store_out(o_ref, acc, b, g, si, rows_ok, splits)
  common.masked_store(m_ref, (b, g, si, slice(None)), m, rows_ok)
  common.masked_store(l_ref, (b, g, si, slice(None)), l, rows_ok)


def _store_out(o_ref, out, b, g, si, rows_ok, splits: int) -> None:
  """A program's output rows: [B, G, Rp, H] in the output dtype (one split) or one split's
  float32 partial of [B, G, S, Rp, H]."""
  tile_ok = jnp.broadcast_to(rows_ok[:, None], out.shape)
  at = (b, g) + ((si,) if splits > 1 else ()) + (slice(None), slice(None))
  common.masked_store(o_ref, at, out.astype(o_ref.dtype), tile_ok)


def combine(acc: jax.Array, m: jax.Array, l: jax.Array, dtype: jnp.dtype) -> jax.Array:
  """The splits' partial results [.., S, R, H], [.., S, R], [.., S, R] -> [.., R, H] in dtype:
  each split rescaled to the common maximum, summed in float32, divided once (rows with no
  valid key give zeros)."""
  top = jnp.max(m, axis=-2, keepdims=True)
  w = jnp.where(m == -np.inf, np.float32(0.0), jnp.exp(m - top))  # a split without keys: 0
  num = jnp.sum(acc * w[..., None], axis=-3)
  den = jnp.sum(l * w, axis=-2)
  out = jnp.where(den[..., None] > 0, num / jnp.maximum(den, np.float32(1e-30))[..., None],
                  np.float32(0.0))
  return out.astype(dtype)


def attention(q: jax.Array, ks: tuple[jax.Array, ...], vs: tuple[jax.Array, ...],
              lengths: jax.Array, lyr: jax.Array, *, packed: bool, block_t: int,
              num_splits: int, table: str | None, launch: tuple[int, int],
              interpret: bool) -> jax.Array:
  """[B, N, H] in q.dtype: q [B, N, H] over the cache arrays `kv_tiles.cache_arrays` gives
  (each [L, B, T, G, ...]), layer lyr [1] int32, lengths [B] int32 clipped to [0, T], in
  `num_splits` key splits (at least one key block each). launch: Triton's (num_warps,
  num_stages). Called by `decode_attention.decode_attention` with impl="fused"."""
  b, n, h = q.shape
  t, g = ks[0].shape[2], ks[0].shape[3]
  r = n // g
  qg, order = kv_tiles.grouped_queries(q, ks, packed)
  rp = qg.shape[2]
  bps, splits = kv_tiles.key_splits(t, block_t, num_splits)
  kw = dict(nk=len(ks), packed=packed, asm=not interpret, table=table, order=order, r=r,
            block_t=block_t, blocks_per_split=bps, scale=attention_math.score_scale(h))
  stats = (jax.ShapeDtypeStruct((b, g, splits, rp), jnp.float32),) * 2
  out_shape = ((jax.ShapeDtypeStruct((b, g, rp, h), q.dtype),) if splits == 1
               else (jax.ShapeDtypeStruct((b, g, splits, rp, h), jnp.float32),) + stats)
  outs = pl.pallas_call(
      functools.partial(_kernel, splits=splits, **kw), grid=(b, g, splits), out_shape=out_shape,
      interpret=interpret, compiler_params=None if interpret else common.compiler_params(*launch),
      name="flash_decode" + ("_nvfp4" if packed else ""))(lyr, lengths, qg, *ks, *vs)
  out = outs[0] if splits == 1 else combine(*outs, q.dtype)
  return out[:, :, :r].reshape(b, n, h)
