"""Decode attention (one query token per sequence) over a BF16 or packed NVFP4 KV cache.

`decode_attention` runs two Pallas kernels (Triton GPU lowering; `interpret=True` on CPU)
around `attention_math.attention_probs`, so that its probabilities are `attention_math.attend`'s:
1. scores: grid (B, G, key blocks). Program (b, g, j) takes the R = N // G query heads that
   read kv head g (padded to 16 rows, the smallest Triton dot) and key block j of the
   sequence (skipped at or beyond its length), and writes the float32 scores [R, block_t]
   (float32 dot times float32 H**-0.5, as `attend`) into [B, G, R, T].
2. XLA: `attention_math.attention_probs` on those scores, the very function `attend` calls
   (masked beyond each length, float32 softmax, one rounding to q.dtype).
3. PV: grid (B, G, S). Program (b, g, s) sums its share of the key blocks below the length of
   probabilities x V in float32; S = 1 writes the output in q.dtype, S > 1 each split's sums,
   added in float32 by XLA (split-K pays off when B * G is small next to the GPU's SM count).
With `layer`, the cache is a stack of layers ([L, B, T, G, ...], the engine's per-run cache)
and both kernels read that layer where it lies: no per-step copy of a layer's cache. The split
writes the float32 scores and reads the probabilities back: 96 bytes per key and kv head at 8
query heads per kv head, next to 512 bytes of a BF16 cache's K and V at H = 128 but 152 of the
packed cache's. What it buys is `attend`'s normalization order exactly (online softmax rounds
unnormalized probabilities: tokens of the tiny model left the reference at step 28 that way,
and on CPU fp4_trace's rollout/trainer |dlogp| doubled, docs/benchmarks.md).

Packed cache (`kv_cache.PackedKVCache`): each block's K/V are decoded in registers by
`kv_tiles.kv_tile` (the words decoder for codes held as words, the GPU's; the bits decoder for
bytes) to `formats.nvfp4_dequantize`'s values in q.dtype, bit for bit; with code words, K is
decoded in the MMA operand order and q's columns are put in the same order outside the kernel.
So the kernel's K/V are the trainer's fake-quantized values bit for bit (tests check this
through `dequantize_pallas`, which runs the same decoders, and through the exact output at
length 1). H200 (ncu, batch 256, 8k): the packed kernels are bound by the L1/shared-memory pipe
(scores 93%, PV 84% of its peak; DRAM 31-33%), not by the decode's instructions: the decoded
tile reaches the MMA through shared memory (these figures and the old decoder's: the git
history of docs/benchmarks.md).

On a Hopper GPU the packed cache's attention takes `wgmma_attention`'s Mosaic GPU kernels
where the shape allows (`AttentionConfig.impl`; `wgmma_impl`, which the model asks where its
kernel plan says `decode_attention="wgmma"`): the same probabilities and K/V values, with K
decoded straight into wgmma's A registers and V into shared memory, read transposed as the A
operand of the PV sum (0.66x the Triton pair's time at batch 256, 8k, before the PV sum was
transposed).

`AttentionConfig(impl="fused")` runs `flash_decode`'s single kernel instead (scores, online
softmax and PV in one pass: no scores in memory, not `attend`'s bits; its module docstring);
`impl="wgmma_fused"` the same arithmetic over the packed cache on Hopper with the wgmma
kernels' decoders (`wgmma_flash`), which `wgmma_impl(..., fused=True)` picks where they run.

Numerics against `attention_math.attend` (the model's decode path, `decode_attention_reference`):
the same float32 scores up to the dot's float32 accumulation order, the same probabilities
from them (same function), and the PV sum in float32 in another order, rounded once. On CPU
the outputs are bit-equal to `attend`'s in nearly every element (tests). The GPU's exp and
division differ from XLA's CPU ones; the stated tolerance (`output_tolerance`):
|out - ref| <= 2**-7 * (max|v| + |ref|) elementwise, max|v| over the valid V rows of that
sequence and kv head (the budget is in its docstring).
Keys at or beyond `lengths` are ignored entirely (even NaN ones); `attend` lets NaN in any
cache row (also unwritten ones) reach every output through 0 * NaN in its PV einsum.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from trace_jax.kernels import (
  attention_math,
  common,
  flash_decode,
  fp4_decode,
  kv_tiles,
  wgmma_attention,
  wgmma_decode,
  wgmma_flash,
)
from trace_jax.kernels.kv_cache import PackedKVCache, dequantize
from trace_jax.quant import formats

BF16Cache = tuple[jax.Array, jax.Array]
IMPLS = ("triton", "wgmma", "fused", "wgmma_fused")  # `AttentionConfig.impl`
WGMMA_IMPLS = ("wgmma", "wgmma_fused")
MIN_ROWS = kv_tiles.MIN_ROWS
DEFAULT_BLOCK_T = 64
SM_COUNT = 132  # an H100/H200's; the caller passes its device's (the kernel plan's sm_count)


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """How `decode_attention` (and `dequantize_pallas`) run.

  impl: "triton" (the Pallas kernels of the module docstring), "wgmma" (a packed cache of code
    words on a Hopper GPU, `wgmma_attention`'s shapes: K decoded into wgmma's A registers for
    the scores, V into shared memory for the PV sum, with the fast table, exact for every row
    scale the quantizer makes; the PV kernel with key splits where B x G gives few programs);
    `wgmma_impl` picks it for a call where it runs;
    "fused": `flash_decode`'s single kernel (online softmax, no scores in memory; not
    `attend`'s bits: its module docstring), with `block_t`, `num_splits` and the launch
    parameters as the Triton pair's; "wgmma_fused": the same arithmetic over a packed cache
    of code words on a Hopper GPU with `wgmma_attention`'s decoders (`wgmma_flash`; its
    splits `num_splits` or `wgmma_attention.default_splits`).
  table: codes as words: None picks the bf16 fast table per key block where its row scales
    allow it, "exact" always takes the exact one (for tests), "fast" always the fast one (only
    exact for row scales in `fp4_decode.tensor_scale_factors`' fast range).
  block_t: keys per block of the Triton kernels (a power of two >= 16).
  num_splits: key splits of the PV kernel (Triton's or wgmma's) or the fused kernel (None:
    `default_num_splits`; the wgmma kernels `wgmma_attention.default_splits`).
  num_warps / num_stages: Triton launch parameters.
  sm_count: the device's SMs (the kernel plan's): the PV kernel's default key splits.
  prefetch: 64-key tiles (steps of the single pass) the wgmma kernels ask L2 for ahead of
    the one they decode (`wgmma_attention.tile_prefetcher`; 0: none). On the H100 one tile
    ahead took the exact pair to 0.92x its time at 64 x 32k and 256 x 8k (2 and 4 tiles:
    0.96-0.97x; the padded single pass that preceded `wgmma_flash`'s: 0.98-1.01x at any
    distance; docs/benchmarks.md).
  interpret: None runs the kernels on the GPU and the Pallas interpreter elsewhere.
  """
  impl: str = "triton"
  table: str | None = None
  block_t: int = DEFAULT_BLOCK_T
  num_splits: int | None = None
  num_warps: int = 4
  num_stages: int = 2
  sm_count: int = SM_COUNT
  prefetch: int = 1
  interpret: bool | None = None

  def __post_init__(self):
    if self.impl not in IMPLS:
      raise ValueError(f"AttentionConfig: impl must be one of {IMPLS}, got {self.impl!r}")
    if self.table not in (None, *fp4_decode.TABLES):
      raise ValueError(f"AttentionConfig: table must be one of {(None, *fp4_decode.TABLES)}, "
                       f"got {self.table!r}")
    if self.block_t < MIN_ROWS or self.block_t & (self.block_t - 1):
      raise ValueError(f"block_t must be a power of two >= {MIN_ROWS}, got {self.block_t}")
    if self.prefetch < 0:
      raise ValueError(f"AttentionConfig: prefetch must be >= 0, got {self.prefetch}")


def _scores_kernel(layer_ref, len_ref, q_ref, *refs, packed: bool, asm: bool,
                   table: str | None, order: str, r: int, block_t: int, scale: float):
  """Program (b, g, j): float32 scores of key block j for the R query heads of kv head g, as
  `attention_math.attend` computes them (float32 dot times float32 H**-0.5); blocks at or beyond
  the sequence's length are skipped (left unwritten)."""
  k_refs, s_ref = refs[:-1], refs[-1]
  b, g, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  length = len_ref[b]
  t0 = pl.multiple_of(j * block_t, block_t)

  @pl.when(t0 < length)
  def _():
    ok = t0 + jnp.arange(block_t) < length
    k = kv_tiles.kv_tile(k_refs, layer_ref[0], b, g, t0, ok, block_t, q_ref.dtype, packed=packed,
                 asm=asm, table=table, order=order)
    s = jax.lax.dot_general(q_ref[b, g], k, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)        # [Rp, block_t]
    s = s * np.float32(scale)
    rp = s.shape[0]
    mask = (jnp.arange(rp) < r)[:, None] & ok[None, :]
    common.masked_store(s_ref, (b, g, pl.ds(0, rp), pl.ds(t0, block_t)), s, mask)


def _pv_kernel(layer_ref, len_ref, p_ref, *refs, packed: bool, asm: bool,
               table: str | None, r: int, block_t: int, blocks_per_split: int, splits: int):
  """Program (b, g, split): sum over this split's key blocks of probabilities x V in float32;
  the output (one split) or the split's partial sums."""
  v_refs, o_ref = refs[:-1], refs[-1]
  b, g, si = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  length = len_ref[b]
  first = si * blocks_per_split
  last = jnp.minimum(first + blocks_per_split, (length + block_t - 1) // block_t)
  dtype = p_ref.dtype
  rp, width = o_ref.shape[-2:]
  row_ok = (jnp.arange(rp) < r)[:, None]

  def body(i, acc):
    t0 = pl.multiple_of(i * block_t, block_t)
    ok = t0 + jnp.arange(block_t) < length
    p = common.masked_load(p_ref, (b, g, pl.ds(0, rp), pl.ds(t0, block_t)), row_ok & ok[None, :])
    p = jnp.where(row_ok & ok[None, :], p, jnp.zeros((), dtype))
    v = kv_tiles.kv_tile(v_refs, layer_ref[0], b, g, t0, ok, block_t, dtype, packed=packed,
                 asm=asm, table=table)
    return acc + jax.lax.dot_general(p, v, (((1,), (0,)), ((), ())),
                                     preferred_element_type=jnp.float32)

  acc = jax.lax.fori_loop(first, last, body, jnp.zeros((rp, width), jnp.float32))
  idx = (b, g) if splits == 1 else (b, g, si)
  common.masked_store(o_ref, idx + (slice(None), slice(None)), acc.astype(o_ref.dtype),
         jnp.broadcast_to(row_ok, (rp, width)))


def default_num_splits(batch: int, num_kv_heads: int, num_blocks: int,
                       sm_count: int = SM_COUNT) -> int:
  """Key splits of the PV kernel so that about 2 programs per SM run on a GPU of `sm_count`
  SMs, with at least 4 key blocks per split."""
  want = -(-2 * sm_count // max(batch * num_kv_heads, 1))
  return int(max(1, min(want, num_blocks // 4)))


def _scores(q, ks, lengths, lyr, *, packed: bool, config: AttentionConfig,
            interpret: bool) -> jax.Array:
  """float32 scores [B, G, R, T] of the Triton scores kernel or wgmma's."""
  b, n, h = q.shape
  t, g = ks[0].shape[2], ks[0].shape[3]
  r = n // g
  scale = attention_math.score_scale(h)
  if config.impl == "wgmma":  # K decoded into wgmma's A registers (Mosaic GPU)
    kc, kbits, krow = ks
    qw = jnp.take(q.reshape(b, g, r, h), wgmma_decode.column_order(h), axis=-1)
    return wgmma_attention.scores(qw, kc.reshape(kc.shape[:4] + (h // 8,)), kbits, krow,
                                  lengths, lyr, scale=float(scale), prefetch=config.prefetch)
  qg, order = kv_tiles.grouped_queries(q, ks, packed)
  return pl.pallas_call(
      functools.partial(_scores_kernel, packed=packed, asm=not interpret, table=config.table,
                        order=order, r=r, block_t=config.block_t, scale=scale),
      grid=(b, g, -(-t // config.block_t)),
      out_shape=jax.ShapeDtypeStruct((b, g, r, t), jnp.float32), interpret=interpret,
      compiler_params=None if interpret else common.compiler_params(config.num_warps,
                                                                    config.num_stages),
      name="decode_attention_scores_nvfp4" if packed else "decode_attention_scores",
  )(lyr, lengths, qg, *ks)


def _pv(probs, vs, lengths, lyr, h: int, *, packed: bool, config: AttentionConfig,
        num_splits: int, interpret: bool) -> jax.Array:
  """[B, G, R, H]: probabilities [B, G, R, T] times V, by the Triton PV kernel (its key splits
  summed in float32 by XLA) or wgmma's."""
  b, g, r, t = probs.shape
  if config.impl == "wgmma":  # V decoded into shared memory, read transposed by wgmma
    vc, vbits, vrow = vs
    out = wgmma_attention.pv(probs, vc.reshape(vc.shape[:4] + (h // 8,)), vbits, vrow,
                             lengths, lyr, prefetch=config.prefetch, splits=num_splits)
    if out.ndim == 5:  # the splits' float32 partial sums
      out = jnp.sum(out, axis=2).astype(probs.dtype)
    return jnp.take(out, np.argsort(wgmma_decode.column_order(h)), axis=-1)
  rp = kv_tiles.padded_rows(r)
  bps, splits = kv_tiles.key_splits(t, config.block_t, num_splits)
  if splits == 1:
    out_shape = jax.ShapeDtypeStruct((b, g, rp, h), probs.dtype)
  else:
    out_shape = jax.ShapeDtypeStruct((b, g, splits, rp, h), jnp.float32)
  out = pl.pallas_call(
      functools.partial(_pv_kernel, packed=packed, asm=not interpret, table=config.table, r=r,
                        block_t=config.block_t, blocks_per_split=bps, splits=splits),
      grid=(b, g, splits), out_shape=out_shape, interpret=interpret,
      compiler_params=None if interpret else common.compiler_params(config.num_warps,
                                                                    config.num_stages),
      name="decode_attention_pv_nvfp4" if packed else "decode_attention_pv",
  )(lyr, lengths, probs, *vs)
  if splits > 1:
    out = jnp.sum(out, axis=2).astype(probs.dtype)
  return out[:, :, :r]


@functools.partial(jax.jit, static_argnames=("config", "num_splits", "interpret"))
def _decode_attention(q, cache, lengths, layer, *, config: AttentionConfig, num_splits: int,
                      interpret: bool):
  packed = isinstance(cache, PackedKVCache)
  if layer is None:  # one layer: a leading axis of 1 (a free reshape)
    cache = jax.tree.map(lambda a: a[None], cache)
    layer = jnp.zeros((), jnp.int32)
  ks, vs = kv_tiles.cache_arrays(cache, packed)
  b, n, h = q.shape
  t = ks[0].shape[2]
  lengths = jnp.clip(lengths.astype(jnp.int32), 0, t)
  lyr = jnp.reshape(layer, (1,)).astype(jnp.int32)
  if config.impl == "wgmma_fused":
    return _wgmma_fused(q, ks, vs, lengths, lyr, num_splits=num_splits,
                        prefetch=config.prefetch)
  if config.impl == "fused":
    return flash_decode.attention(q, ks, vs, lengths, lyr, packed=packed, block_t=config.block_t,
                                  num_splits=num_splits, table=config.table,
                                  launch=(config.num_warps, config.num_stages),
                                  interpret=interpret)
  scores = _scores(q, ks, lengths, lyr, packed=packed, config=config, interpret=interpret)
  # `attend`'s probabilities from the same scores: masked beyond each length (blocks the
  # kernel skipped hold no data and are masked), float32 softmax, one rounding.
  mask = (jnp.arange(t)[None, :] < lengths[:, None])[:, None, None, None, :]
  probs = attention_math.attention_probs(scores[:, :, :, None, :], mask,
                                         q.dtype)[:, :, :, 0, :]
  out = _pv(probs, vs, lengths, lyr, h, packed=packed, config=config, num_splits=num_splits,
            interpret=interpret)
  return out.reshape(b, n, h)


def _wgmma_fused(q, ks, vs, lengths, lyr, *, num_splits: int, prefetch: int) -> jax.Array:
  """[B, N, H]: `wgmma_flash`'s splits over the packed cache, combined as `flash_decode`'s."""
  b, n, h = q.shape
  g = ks[0].shape[3]
  r = n // g
  order = wgmma_decode.column_order(h)
  qw = jnp.take(q.reshape(b, g, r, h), order, axis=-1)
  words = lambda c: c.reshape(c.shape[:4] + (h // 8,))
  k = (words(ks[0]),) + tuple(ks[1:])
  v = (words(vs[0]),) + tuple(vs[1:])
  scale = float(attention_math.score_scale(h))
  acc, m, l = wgmma_flash.partials(qw, k, v, lengths, lyr, scale=scale, splits=num_splits,
                                   prefetch=prefetch)
  out = flash_decode.combine(acc, m, l, q.dtype)
  return jnp.take(out, np.argsort(order), axis=-1).reshape(b, n, h)


def wgmma_impl(q: jax.Array, cache: PackedKVCache | BF16Cache, *,
               layer: jax.Array | None = None, interpret: bool | None = None,
               fused: bool = False) -> str:
  """The impl for this call of the exact pair (fused=False) or the single pass (fused=True),
  with the wgmma kernels where they run (a packed cache of code words on a GPU with the Mosaic
  GPU API, `wgmma_attention.supported`'s shapes). The pair: "wgmma" where they run, else
  "triton" (on the H200 0.66x the Triton pair's time at batch 256 x 8k; on the H100 with its
  PV kernel's key splits 0.78x the time of wgmma scores with the Triton PV's at 16 x 32k).
  The single pass: "wgmma_fused" where they run (on the H100 0.48-0.54x the Triton single
  pass's time and 0.71-0.88x the wgmma pair's at 8k-32k contexts), else "fused"
  (docs/benchmarks.md)."""
  portable = "fused" if fused else "triton"
  if not isinstance(cache, PackedKVCache) or not cache.words:
    return portable
  interpret = common.default_interpret() if interpret is None else interpret
  if interpret or not wgmma_decode.available():
    return portable
  b, t, g = cache.k_codes.shape[(0 if layer is None else 1):][:3]
  if not wgmma_attention.supported(q.shape[-1], q.shape[1] // g, t, q.dtype):
    return portable
  if fused:
    return "wgmma_fused"
  return "wgmma"


def _check(q: jax.Array, cache: PackedKVCache | BF16Cache, lengths: jax.Array,
           layer: jax.Array | None) -> None:
  if q.ndim != 3:
    raise ValueError(f"q must be [B, N, H] (one query token per sequence), got {q.shape}")
  b, n, h = q.shape
  lead = 0 if layer is None else 1
  if isinstance(cache, PackedKVCache):
    shape = tuple(cache.shape[lead:])
    words = int(cache.words)
    ranks = {a.ndim - lead - words for a in (cache.k_codes, cache.v_codes)} | {
        a.ndim - lead for a in (cache.k_block, cache.v_block)} | {cache.k_row.ndim - lead + 1}
    if cache.v_codes.dtype != cache.k_codes.dtype:
      raise ValueError(f"k_codes {cache.k_codes.dtype} and v_codes {cache.v_codes.dtype} "
                       "differ (both words or both bytes)")
  else:
    shape = tuple(cache[0].shape[lead:])
    ranks = {cache[0].ndim - lead, cache[1].ndim - lead}
    if tuple(cache[1].shape) != tuple(cache[0].shape):
      raise ValueError(f"k {cache[0].shape} and v {cache[1].shape} differ")
  if ranks != {4}:
    raise ValueError(f"cache arrays must be [{'L, ' * lead}B, T, G, ...] "
                     f"({'with' if lead else 'without'} a layer axis, as `layer` says)")
  if len(shape) != 4 or shape[0] != b or shape[3] != h or n % shape[2]:
    raise ValueError(f"cache [B, T, G, H] = {shape} does not fit q [B, N, H] = {q.shape} "
                     "(N must be a multiple of G)")
  if lengths.shape != (b,):
    raise ValueError(f"lengths must be [B] = ({b},), got {lengths.shape}")
  if layer is not None and jnp.shape(layer) != ():
    raise ValueError(f"layer must be a scalar, got {jnp.shape(layer)}")
  if h < MIN_ROWS or h & (h - 1):
    raise ValueError(f"head_dim must be a power of two >= {MIN_ROWS}, got {h}")


def decode_attention(q: jax.Array, cache: PackedKVCache | BF16Cache, lengths: jax.Array, *,
                     layer: jax.Array | None = None,
                     config: AttentionConfig = AttentionConfig()) -> jax.Array:
  """Attention of one query token per sequence over its cache: q [B, N, H] -> [B, N, H].

  cache: a `PackedKVCache` (NVFP4; codes as words take the words decoder, as bytes the bits
  decoder) or BF16 (k, v), each [B, T, G, H]; with `layer` (int32 scalar, may be traced: a
  scan over layers) every array has a leading layer axis [L, ...] and layer `layer` is read
  in place (slicing it out first would copy it at every step). lengths [B]: keys
  0..lengths-1 are valid (the cache already holds the current token; lengths >= 1; 0 gives
  zeros). Query head n reads kv head n // (N // G). config: the kernels and their tiles
  (`AttentionConfig`). Output in q.dtype; numerics: the module's.
  """
  _check(q, cache, lengths, layer)
  interpret = common.default_interpret() if config.interpret is None else config.interpret
  packed = isinstance(cache, PackedKVCache)
  lead = 0 if layer is None else 1
  b, t, g = (cache.k_codes if packed else cache[0]).shape[lead:lead + 3]
  if packed:
    kv_tiles.check_words(cache.words, q.dtype, bool(interpret))
  num_splits = config.num_splits
  if num_splits is None and config.impl in ("wgmma", "wgmma_fused"):
    num_splits = wgmma_attention.default_splits(b, g, t // wgmma_decode.TILE, config.sm_count)
  elif num_splits is None:
    num_splits = default_num_splits(b, g, -(-t // config.block_t), config.sm_count)
  if config.impl in WGMMA_IMPLS:
    if config.table == "exact":
      raise ValueError(f"impl={config.impl!r} builds the fast table only (exact for every row "
                       "scale the quantizer makes); table='exact' needs impl='triton'")
    ok = (packed and not interpret and cache.words and wgmma_decode.available()
          and wgmma_attention.supported(q.shape[-1], q.shape[1] // g, t, q.dtype))
    if not ok:
      raise ValueError(f"impl={config.impl!r} needs a packed cache of code words on the GPU, "
                       f"bf16, {wgmma_attention.ROWS} query heads per kv head, head_dim a "
                       f"multiple of {wgmma_decode.SPAN} and a context a multiple of "
                       f"{wgmma_decode.TILE}; got q {q.shape} {q.dtype}, T={t}")
    if config.impl == "wgmma_fused" and config.block_t != wgmma_decode.TILE:
      raise ValueError(f"impl='wgmma_fused' takes block_t {wgmma_decode.TILE}, got "
                       f"{config.block_t}")
  return _decode_attention(q, cache, lengths, layer, config=config, num_splits=int(num_splits),
                           interpret=bool(interpret))


# ----------------------------------------------------------------------------- references

def decode_attention_reference(q: jax.Array, cache: PackedKVCache | BF16Cache,
                               lengths: jax.Array) -> jax.Array:
  """The same contract in plain JAX: dequantize (packed) or cast the cache to q.dtype, then
  `attention_math.attend` with query position lengths - 1 (the model's decode path)."""
  if isinstance(cache, PackedKVCache):
    k, v = dequantize(cache, q.dtype)
  else:
    k, v = (a.astype(q.dtype) for a in cache)
  b, t = k.shape[:2]
  key_pos = jnp.broadcast_to(jnp.arange(t), (b, t))
  out = attention_math.attend(q[:, None], k, v, (lengths.astype(jnp.int32) - 1)[:, None], key_pos)
  return out[:, 0]


def output_tolerance(v: jax.Array, lengths: jax.Array, ref: jax.Array,
                     num_heads: int) -> jax.Array:
  """Elementwise bound on |kernel - reference| [B, N, H]: 2**-7 * (max|v| + |ref|).

  max|v| is over the valid V rows (t < length) of the kv head the query head reads. Budget
  (bf16 compute dtype): both round the probabilities to bf16 (relative 2**-9 each) from float32
  softmaxes that may differ in the last bits (the GPU's exp and division against XLA's CPU
  ones), <= 2**-8 * max|v| together; both round the output once to bf16 after float32 sums in
  different orders, <= 2**-8 * |ref| together; the other 2**-8 * (max|v| + |ref|) is left for
  scores whose float32 dots differ in their last bits. Measured on CPU: 0 in most cases (the
  kernel and `attend` agree bit for bit but for rare last-ulp differences).
  """
  b, t, g, h = v.shape
  ok = jnp.arange(t)[None, :] < lengths[:, None]
  vmax = jnp.max(jnp.where(ok[:, :, None, None], jnp.abs(v.astype(jnp.float32)), 0.0),
                 axis=(1, 3))  # [B, G]
  vmax = jnp.repeat(vmax, num_heads // g, axis=1)[:, :, None]  # [B, N, 1]
  return np.float32(2.0**-7) * (vmax + jnp.abs(ref.astype(jnp.float32)))


# ----------------------------------------------------------------------------- dequantize kernel

def _dequant_kernel(c_ref, b_ref, r_ref, o_ref, *, block_t: int, t: int, asm: bool,
                    table: str | None):
  """Program i: rows i * block_t .. of a [1, 1, t, 1, ...] cache, decoded by `_kv_tile`."""
  t0 = pl.program_id(0) * block_t
  ok = t0 + jnp.arange(block_t) < t
  zero = jnp.int32(0)  # layer, sequence and kv head of the flat view
  x = kv_tiles.kv_tile((c_ref, b_ref, r_ref), zero, zero, zero, t0, ok, block_t, o_ref.dtype,
               packed=True, asm=asm, table=table)
  common.masked_store(o_ref, (pl.ds(t0, block_t), slice(None)), x,
                      jnp.broadcast_to(ok[:, None], (block_t, o_ref.shape[-1])))


@functools.partial(jax.jit, static_argnames=("dtype", "interpret", "block_t", "num_warps",
                                             "table"))
def _dequantize_pallas(codes, block, row, *, dtype, interpret: bool, block_t: int,
                       num_warps: int = 4, table: str | None = None):
  words = codes.dtype == jnp.uint32
  lead = row.shape
  h = block.shape[-1] * formats.NVFP4_BLOCK
  t = int(np.prod(lead))
  flat = lambda a, tail: a.reshape((1, 1, t, 1) + tail)
  c = flat(codes, codes.shape[-2:] if words else codes.shape[-1:])
  bb, rr = flat(kv_tiles.block_bits_of(block), block.shape[-1:]), flat(row, ())
  out = pl.pallas_call(
      functools.partial(_dequant_kernel, block_t=block_t, t=t, asm=not interpret,
                        table=table),
      grid=(-(-t // block_t),), out_shape=jax.ShapeDtypeStruct((t, h), dtype),
      interpret=interpret, compiler_params=common.compiler_params(num_warps, 1),
      name="nvfp4_kv_dequantize")(c, bb, rr)
  return out.reshape(lead + (h,))


def dequantize_pallas(cache: PackedKVCache, dtype: jnp.dtype = jnp.bfloat16, *,
                      config: AttentionConfig = AttentionConfig()
                      ) -> tuple[jax.Array, jax.Array]:
  """(k, v) [B, T, G, H] decoded by the attention kernels' in-register decoder (`_kv_tile`,
  in a Pallas kernel of its own; the cache's codes layout picks it), so tests can compare its
  bits with `kv_cache.dequantize`. config: block_t, table, num_warps and interpret apply."""
  interpret = common.default_interpret() if config.interpret is None else config.interpret
  kv_tiles.check_words(cache.words, dtype, bool(interpret))
  f = functools.partial(_dequantize_pallas, dtype=jnp.dtype(dtype), interpret=bool(interpret),
                        block_t=config.block_t, num_warps=config.num_warps, table=config.table)
  return (f(cache.k_codes, cache.k_block, cache.k_row),
          f(cache.v_codes, cache.v_block, cache.v_row))
