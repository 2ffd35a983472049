"""An NVFP4 activation site's whole quantize-dequantize in one Pallas kernel.

`quantize_rows(x)` returns `(y, q)` with q == `formats.fp4_quantize_act(x, "nvfp4")` field for
field and y == `formats.fp4_dequantize(q).astype(x.dtype)`, bit for bit (as under `jit`: a
row holding NaN/Inf is poisoned, never raised on). XLA runs that as ~6 small kernels per site
(row amax, row scale, block amax, scales, codes, dequantize); at decode the rows are few and
each of those launches costs more than its bytes, so this is one launch per site.

The training forward's fake quantizers (the plan's `fake_quant`), the dequantized values only,
one read and one write per element where XLA's quantizers make several passes:
`qdq_rows(x, tensor_scale)` is the same kernel under second-level scales given per row (a
weight's, one per expert: `formats.nvfp4_quantize(x, ts)`); `guided_qdq_rows(x, g)` rounds
rows under a compact guidance record (`guided.guided_quantize`), some rows RTN instead.

Kernel design (`pl.pallas_call`, Triton lowering on GPU, `interpret=True` elsewhere):
- x [M, K] is viewed as [M, K // 16, 16] (a free reshape outside): one NVFP4 block per row of
  the last two axes, so a block's amax is a reduction over the last axis of the tile.
- grid (cdiv(M, block_m),): one program per `block_m` whole rows (the row scale needs the row's
  amax before any block is scaled). The tile is [block_m, nbp, 16], nbp = K // 16 rounded up to
  a power of two (Triton tiles are powers of two): rows past M and blocks past K // 16 are
  masked, loaded as 0 (no amax changes) and never stored.
- In registers: block amaxes and non-finite flags from one int32 max of |x|'s bits per block
  (non-negative floats order as their bits; Inf and NaN above every finite value; subnormals
  flushed on the max and on the element), the row amax (a max of the block amaxes), row scale,
  block scales, inverse scales, E2M1 codes, E4M3 bytes, and the dequantized values; stores: y
  and codes [block_m, nbp, 16], scale bytes [block_m, nbp], row scales [block_m]. The E4M3
  bytes leave as uint8 and are bitcast outside.
- `mantissa=True` also stores each block's 16 code low bits as one uint16 (bit j: element j),
  whose two little-endian bytes are `guided.pack_bits(codes & 1)`'s: the compact guidance
  record's payload, so a recording site needs no XLA fusion to pack it.
- Defaults (`default_block_m`, `default_num_warps`): tiles of at most `TILE_ELEMENTS` (4096)
  elements, fewer rows still while the grid has fewer than `common.MIN_PROGRAMS` programs
  (decode is launch- and latency-bound: more, smaller programs spread over the SMs); num_warps
  so that each thread holds ~16 elements (1..8 warps). The decode sites: [64, 2048] -> block_m 1
  (64 programs, 4 warps); [512, 768] -> 2 (256 programs of [2, 64, 16], 4 warps); [512, 128]
  -> 2 (256 programs of [2, 8, 16], 1 warp). Rows of K > 8192 hold > 32 elements per thread.
  Not tuned on the GPU yet: `experiments/bench/quant.py --sites` times them against XLA's.
- The values-only kernels (`qdq_rows`, `guided_qdq_rows`) are ALU-bound, not byte-bound, so each
  element costs as few operations as the bits allow: they round |x| scaled straight to E2M1
  values (`formats.e2m1_round_magnitude`, `guided.compact_magnitude`: no codes made or
  decoded) and put the sign back as a bit; a non-finite block's NaN comes from its block
  scale, with no select per element; the rows' inverse scales 1 / ts come in from XLA
  (`inverse_row_scales`, one per row: a program would divide the long way in every thread);
  rows, which share only a given scale, are split in `row_parts(K)` so no tile holds padded
  blocks (K = 768: three rows of 16 blocks, not one of 64 with 16 masked), and where block_m
  divides M no load or store is masked.
- A block's scales take no long division (25 integer steps each): amax / 6 and the inverse
  scale's division by the E4M3 block scale have short divisors (`exact.ieee_div_short`, one
  integer division), and the E4M3 rounding of (amax / 6) / ts is decided from ts's reciprocal
  with exact int32 comparisons (`exact.e4m3_quotient`); a row divides the long way once (1 / ts;
  its own scale amax / 2688 is a short division too; the values-only kernels take 1 / ts
  given).

Numerics are `formats`' (exact float32 scale arithmetic from `exact`), in-kernel; the subnormal
flush (`exact.flush_subnormal`) is taken on |x|'s bits (`_flushed`). Reused as they are:
`exact.round_mantissa`, `exact.sign_bit` (through
`formats.e2m1_encode`), `formats.e2m1_encode`, `formats.e2m1_magnitude` and the constants.
Three of them take a form a Triton kernel lowers, with the same bits everywhere:
`exact.ieee_div(..., straight_line=True)` (its `fori_loop` is fully unrolled on the GPU, which
Pallas' Triton lowering rejects: scans with unroll != 1), and `formats.e2m1_decode` signs with
`* -1` (Triton lowers negation as 0 - x, which would turn code 8's -0 into +0);
`exact.e4m3_to_bits` uses no rounding op. Kernel-local: `formats._amax` as an int32
max (Triton lowers max/min/sum reductions only), and the float32 block scale itself in place of
`exact.e4m3_value(block_scale)` (an E4M3 value, exactly).
Float division and float8/float4 `astype` never appear (see `exact`'s docstring).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from trace_jax.guidance.record import Guidance
from trace_jax.kernels import common
from trace_jax.quant import exact, formats, guided

BLOCK = formats.NVFP4_BLOCK
# Elements per program's tile at most (block_m * nbp * 16), unless one row is larger.
TILE_ELEMENTS = 4096
DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)  # activation dtypes the kernels take


def _prev_pow2(n: int) -> int:
  return 1 << max(1, n).bit_length() - 1


def padded_blocks(k: int) -> int:
  """Blocks per row in the kernel's tile: K // 16 rounded up to a power of two."""
  return common.next_pow2(k // BLOCK)


def default_block_m(m: int, k: int) -> int:
  """Rows per program: the largest power of two with tiles of at most `TILE_ELEMENTS`
  elements (at least 1 row), halved while the grid has fewer than `common.MIN_PROGRAMS`
  programs (about two per SM of an H100/H200)."""
  bm = max(1, _prev_pow2(TILE_ELEMENTS // (padded_blocks(k) * BLOCK)))
  while bm > 1 and -(-m // bm) < common.MIN_PROGRAMS:
    bm //= 2
  return bm


def default_num_warps(block_m: int, k: int) -> int:
  """Warps per program: ~16 tile elements per thread, 1..8 warps."""
  elems = block_m * padded_blocks(k) * BLOCK
  return int(min(8, max(1, elems // (16 * 32))))


# ----------------------------------------------------------------------------- in-kernel math

# `exact` / `formats` helpers in the forms a Triton kernel lowers (the same bits everywhere):
# the division unrolled in Python (Pallas rejects scans with unroll != 1); E4M3 bytes and E2M1
# values without rounding or negation ops.
ieee_div = functools.partial(exact.ieee_div, straight_line=True)
_e4m3_bits = exact.e4m3_to_bits
_e2m1_value = formats.e2m1_decode


def _any(flags: jax.Array, axis: int) -> jax.Array:
  """jnp.any over `axis` as an int32 max (Triton lowers only max/min/sum reductions)."""
  return jnp.max(flags.astype(jnp.int32), axis=axis) > 0


# ----------------------------------------------------------------------------- kernel

def _block_max(a: jax.Array) -> jax.Array:
  """The max over a's block axes (every axis after the first two), one axis at a time."""
  for axis in range(a.ndim - 1, 1, -1):
    a = jnp.max(a, axis=axis)
  return a


def _per_block(a: jax.Array, ndim: int) -> jax.Array:
  """a [R, NB] broadcastable against a tile of `ndim` axes (unit block axes appended)."""
  return a[(slice(None), slice(None)) + (None,) * (ndim - 2)]


def _block_amax(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """float32 rows x [R, NB, *block]: (|x|'s bits int32 shaped as x, each block's amax of its
  finite elements with subnormals flushed (`formats._amax` of `exact.flush_subnormal(x)`)
  [R, NB], the blocks holding a NaN or Inf [R, NB]). One int32 max per block: non-negative
  floats order as their bits, Inf and NaN above every finite value; a block's amax matters
  only where it is finite."""
  a = exact.f32_bits(x) & np.int32(0x7FFFFFFF)
  amax = _block_max(a)
  bad = amax >= np.int32(0x7F800000)
  amax = jnp.where((amax < np.int32(0x00800000)) | bad, np.int32(0), amax)
  return a, exact.f32_from_bits(amax), bad


def _scales(x: jax.Array, ts: jax.Array | None, inv_ts: jax.Array | None = None
            ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
  """`formats.nvfp4_quantize`'s scales of float32 rows x [R, NB, *block] in a kernel: (|x|'s
  bits (`_block_amax`), inverse block scales [R, NB], non-finite blocks [R, NB], block scales
  [R, NB] (NaN where non-finite), row scales [R]). inv_ts: `ieee_div(1, ts)` [R] where ts is
  finite (1 elsewhere), given with ts, or None to divide here."""
  a, amax, block_bad = _block_amax(x)                                    # [R, NB]
  if ts is None:  # formats.nvfp4_row_scale
    row_bad = _any(block_bad, axis=1)                                    # [R]
    row_amax = jnp.max(amax, axis=1)                                     # [R]
    # 2688 = 1.0101b * 2**11: a short significand as well
    ts = exact.ieee_div_short(jnp.maximum(row_amax, formats.AMAX_FLOOR),
                              formats.NVFP4_TENSOR_DIVISOR, 4)
    ts = jnp.where(row_bad, np.float32(np.nan), ts)                      # [R]
  else:  # a given scale poisons its rows where it is not finite, as in formats
    row_bad = ~jnp.isfinite(ts)

  # formats.nvfp4_quantize with tensor_scale=ts (the row's non-finite flag is ts's): per block
  # no long division (6 and the E4M3 block scales have short significands; the division by
  # ts is decided from its reciprocal, `exact.e4m3_quotient`), per row one: 1 / ts, taken
  # where ts is finite (a poisoned row's inverse scales are never used: its blocks are bad)
  bad = block_bad | row_bad[:, None]
  ts_div = jnp.where(row_bad, np.float32(1.0), ts)[:, None]
  if inv_ts is None:
    inv_ts = ieee_div(np.float32(1.0), ts_div)                            # [R, 1]
  else:
    inv_ts = inv_ts[:, None]
  bs = exact.e4m3_quotient(exact.ieee_div_short(amax, formats.E2M1_MAX, 1), ts_div, inv_ts)
  inv = _div_by_e4m3(inv_ts, bs)                                         # [R, NB]
  return a, inv, bad, jnp.where(bad, np.float32(np.nan), bs), ts


def inverse_row_scales(ts: jax.Array) -> jax.Array:
  """`ieee_div(1, ts)` of row scales [R] where finite (1 elsewhere), in XLA: what the
  values-only kernels take so that no program divides the long way."""
  ts = ts.astype(jnp.float32)
  return exact.ieee_div(np.float32(1.0), jnp.where(jnp.isfinite(ts), ts, np.float32(1.0)))


def _flushed(a: jax.Array) -> jax.Array:
  """|x| from its bits a, subnormals flushed to 0 (`exact.flush_subnormal`)."""
  return exact.f32_from_bits(jnp.where(a < np.int32(0x00800000), np.int32(0), a))


def _div_by_e4m3(a: jax.Array, bs: jax.Array) -> jax.Array:
  """a / bs, IEEE float32, for E4M3-valued block scales bs (3 bits after the point)."""
  return exact.ieee_div_short(a, bs, 3)


def quantize_tile(x: jax.Array, ts: jax.Array | None = None
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """In-kernel `formats.fp4_quantize_act(x, "nvfp4")` of float32 rows x [R, NB, *block]: row
  r's NVFP4 block j is x[r, j] (its 16 elements over the block axes, in any arrangement).
  ts: the rows' second-level scales float32 [R] given (`formats.nvfp4_quantize(x, ts)`: a
  weight's per-expert scale), or None for each row's own (the activation sites').
  Returns (codes uint8 shaped as x, block scales float32 [R, NB] (E4M3 values; NaN in a
  non-finite block or row), row scales float32 [R] (NaN in a non-finite row)). Elements loaded
  as 0 past the data change no amax. Shared by the site kernel and `kv_append`."""
  a, inv, bad, bs, ts = _scales(x, ts)
  scaled = jnp.minimum(_flushed(a) * _per_block(inv, x.ndim), formats.E2M1_MAX)
  codes = formats.e2m1_encode(formats.copysign_bits(scaled, exact.f32_bits(x)))
  codes = jnp.where(_per_block(bad, x.ndim), jnp.uint8(0), codes)
  return codes, bs, ts


def qdq_tile(x: jax.Array, ts: jax.Array | None = None, inv_ts: jax.Array | None = None
             ) -> jax.Array:
  """`quantize_tile`'s codes dequantized, float32 shaped as x, rounded straight to E2M1
  values (`formats.e2m1_round_magnitude` of |x| scaled, the sign put back as a bit: no codes made or
  decoded): what the fake quantizers need. inv_ts: as `_scales`'. A non-finite block's NaN
  comes from its block scale (a value times NaN), so its values need no mask."""
  a, inv, _, bs, ts = _scales(x, ts, inv_ts)
  v = formats.copysign_bits(formats.e2m1_round_magnitude(_flushed(a) * _per_block(inv, x.ndim)),
                            exact.f32_bits(x))
  # formats.nvfp4_dequantize: (value * block scale) * row scale
  return (v * _per_block(bs, x.ndim)) * ts[(slice(None),) + (None,) * (x.ndim - 1)]


def _tile_masks(m: int, nb: int, bm: int, nbp: int) -> tuple[jax.Array | None, ...]:
  """A program's rows [r0, r0 + bm) as a [bm, nbp, 16] tile: (index, 3-axis mask, [bm, nbp]
  mask, row mask); rows past m and blocks past nb are masked. Masks are None where every
  tile is whole (bm divides m, no padded blocks): no predicate per element."""
  r0 = pl.program_id(0) * bm
  idx = (pl.ds(r0, bm), pl.ds(0, nbp), pl.ds(0, BLOCK))
  if m % bm == 0 and nb == nbp:
    return idx, None, None, None
  row_ok = (r0 + jnp.arange(bm, dtype=jnp.int32)) < m                    # [bm]
  blk_ok = jnp.arange(nbp, dtype=jnp.int32) < nb                         # [nbp]
  ok2 = row_ok[:, None] & blk_ok[None, :]                                # [bm, nbp]
  ok3 = jnp.broadcast_to(ok2[:, :, None], (bm, nbp, BLOCK))
  return idx, ok3, ok2, row_ok


def _kernel(x_ref, y_ref, codes_ref, scale_ref, ts_ref, *mant_ref, m: int, nb: int, bm: int,
            nbp: int):
  """One program: rows [r0, r0 + bm) whole, as [bm, nbp, 16] (see the module docstring);
  mant_ref: the blocks' code low bits (`mantissa=True`) or nothing."""
  idx3, ok3, ok2, row_ok = _tile_masks(m, nb, bm, nbp)
  x = common.masked_load(x_ref, idx3, ok3, 0).astype(jnp.float32)
  codes, bs, ts = quantize_tile(x)

  # formats.nvfp4_dequantize(...).astype(dtype): (code value * block scale) * row scale
  y = (_e2m1_value(codes) * bs[:, :, None]) * ts[:, None, None]

  common.masked_store(y_ref, idx3, y.astype(y_ref.dtype), ok3)
  common.masked_store(codes_ref, idx3, codes, ok3)
  common.masked_store(scale_ref, idx3[:2], _e4m3_bits(bs), ok2)
  common.masked_store(ts_ref, idx3[:1], ts, row_ok)
  if mant_ref:  # bit j of a block's uint16: element j's code low bit (a sum of distinct bits)
    shifts = jnp.arange(BLOCK, dtype=jnp.int32)[None, None, :]
    bits = jnp.sum((codes & 1).astype(jnp.int32) << shifts, axis=2)
    common.masked_store(mant_ref[0], idx3[:2], bits.astype(jnp.uint16), ok2)


def _qdq_kernel(x_ref, *refs, m: int, nb: int, bm: int, nbp: int):
  """One program of `qdq_rows`: `_kernel`'s rows under the given row scales and their
  inverses (refs: (ts, inv_ts, y)) or their own (refs: (y,)), values only."""
  *ts_refs, y_ref = refs
  idx3, ok3, _, row_ok = _tile_masks(m, nb, bm, nbp)
  x = common.masked_load(x_ref, idx3, ok3, 0).astype(jnp.float32)
  # rows past m load a scale of 1 (never stored), so no NaN flag runs through their blocks
  ts = inv_ts = None
  if ts_refs:
    ts, inv_ts = (common.masked_load(r, idx3[:1], row_ok, 1) for r in ts_refs)
  common.masked_store(y_ref, idx3, qdq_tile(x, ts, inv_ts).astype(y_ref.dtype), ok3)


def _guided_kernel(x_ref, scale_ref, ts_ref, inv_ts_ref, mant_ref, *refs, m: int, nb: int,
                   bm: int, nbp: int):
  """One program of `guided_qdq_rows`: refs are (rtn flags, rtn row scales, y) or (y)."""
  *rtn_refs, y_ref = refs
  idx3, ok3, ok2, row_ok = _tile_masks(m, nb, bm, nbp)
  x = common.masked_load(x_ref, idx3, ok3, 0).astype(jnp.float32)
  ts = common.masked_load(ts_ref, idx3[:1], row_ok, 1)                   # [bm]
  inv_ts = common.masked_load(inv_ts_ref, idx3[:1], row_ok, 1)           # [bm]
  # past the data: scale byte 0x38 (1.0), no mantissa bits (never stored)
  bs = exact.e4m3_bits_value(common.masked_load(scale_ref, idx3[:2], ok2, 0x38))
  mant = common.masked_load(mant_ref, idx3[:2], ok2, 0).astype(jnp.int32)
  # guided.guided_codes under a compact record: the rollout's scales, its mantissa bits
  a, _, x_bad = _block_amax(x)                                           # [bm, nbp]
  inv = _div_by_e4m3(inv_ts[:, None], bs)                                # [bm, nbp]
  z = jnp.minimum(_flushed(a) * inv[:, :, None], formats.E2M1_MAX)
  bit = (mant[:, :, None] >> jnp.arange(BLOCK, dtype=jnp.int32)[None, None, :]) & 1
  v = formats.copysign_bits(guided.compact_magnitude(z, bit), exact.f32_bits(x))
  # guided.guided_quantize's NaN scale where x, the record's scale or its row scale is not
  # finite (then a value times NaN), then nvfp4_dequantize
  bs = jnp.where(x_bad | ~jnp.isfinite(bs), np.float32(np.nan), bs)
  y = (v * bs[:, :, None]) * jnp.where(jnp.isfinite(ts), ts, np.float32(np.nan))[:, None, None]
  if rtn_refs:  # rows that round RTN with their own scales (whole rows' scales, given): few
    # (slots whose expert the rollout did not select), so a tile without any skips them
    rtn = common.masked_load(rtn_refs[0], idx3[:1], row_ok, 0) != 0
    rtn_ts = common.masked_load(rtn_refs[1], idx3[:1], row_ok, 1)
    y = jax.lax.cond(_any(rtn, axis=0), lambda: jnp.where(rtn[:, None, None],
                                                          qdq_tile(x, rtn_ts), y), lambda: y)
  common.masked_store(y_ref, idx3, y.astype(y_ref.dtype), ok3)


@functools.partial(jax.jit, static_argnames=("interpret", "block_m", "num_warps", "mantissa"))
def _quantize_rows(x: jax.Array, *, interpret: bool, block_m: int, num_warps: int,
                   mantissa: bool) -> tuple[jax.Array, ...]:
  m, k = x.shape
  nb = k // BLOCK
  if m == 0:
    q = formats.NVFP4Tensor(codes=jnp.zeros((0, k), jnp.uint8),
                            block_scale=jnp.zeros((0, nb), jnp.float8_e4m3fn),
                            tensor_scale=jnp.zeros((0, 1), jnp.float32))
    return (jnp.zeros((0, k), x.dtype), q) + ((jnp.zeros((0, k // 8), jnp.uint8),) * mantissa)
  nbp = padded_blocks(k)
  kernel = functools.partial(_kernel, m=m, nb=nb, bm=block_m, nbp=nbp)
  y, codes, scale, ts, *mant = pl.pallas_call(
      kernel,
      out_shape=(jax.ShapeDtypeStruct((m, nb, BLOCK), x.dtype),
                 jax.ShapeDtypeStruct((m, nb, BLOCK), jnp.uint8),
                 jax.ShapeDtypeStruct((m, nb), jnp.uint8),
                 jax.ShapeDtypeStruct((m,), jnp.float32))
                + ((jax.ShapeDtypeStruct((m, nb), jnp.uint16),) if mantissa else ()),
      grid=(pl.cdiv(m, block_m),), interpret=interpret, name="nvfp4_quantize_rows",
      compiler_params=None if interpret else common.compiler_params(num_warps, 1),
  )(x.reshape(m, nb, BLOCK))
  q = formats.NVFP4Tensor(codes=codes.reshape(m, k),
                          block_scale=jax.lax.bitcast_convert_type(scale, jnp.float8_e4m3fn),
                          tensor_scale=ts.reshape(m, 1))
  # uint16 -> its two bytes, little-endian (elements 0-7, then 8-15), as XLA bitcasts on CPU
  # and GPU alike.
  bits = tuple(jax.lax.bitcast_convert_type(a, jnp.uint8).reshape(m, k // 8) for a in mant)
  return (y.reshape(m, k), q) + bits


def row_parts(k: int) -> int:
  """Parts a row of K elements is split into by the values-only kernels (`qdq_rows`,
  `guided_qdq_rows`), whose rows share nothing but their given scale: K // 16 blocks over the
  largest power of two dividing it, so no tile holds padded blocks (K = 768: 3 rows of 256)."""
  nb = k // BLOCK
  return nb // (nb & -nb)


def _launch(name: str, x: jax.Array, block_m: int | None, num_warps: int | None,
            interpret: bool | None, split: bool = False) -> tuple[int, int, bool]:
  """Checks rows x [M, K] and resolves a launch's (block_m, num_warps, interpret); split: for
  x's rows split into `row_parts(K)` rows."""
  if not hasattr(x, "dtype") or not hasattr(x, "ndim"):
    raise TypeError(f"{name}: expected an array, got {type(x).__name__}")
  if x.ndim != 2:
    raise ValueError(f"{name}: x must be [M, K], got shape {x.shape}")
  if x.dtype not in DTYPES:
    raise TypeError(f"{name}: x dtype must be bf16, f16 or f32, got {x.dtype}")
  m, k = x.shape
  if k == 0 or k % BLOCK:
    raise ValueError(f"{name}: K={k} (x of shape {x.shape}) must be a positive multiple "
                     f"of the block size {BLOCK}")
  if split:
    m, k = m * row_parts(k), k // row_parts(k)
  if block_m is None:
    block_m = default_block_m(m, k)
  if block_m < 1 or block_m & (block_m - 1):
    raise ValueError(f"{name}: block_m must be a power of two >= 1, got {block_m}")
  if num_warps is None:
    num_warps = default_num_warps(block_m, k)
  if num_warps < 1 or num_warps & (num_warps - 1):
    raise ValueError(f"{name}: num_warps must be a power of two >= 1, got {num_warps}")
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  return int(block_m), int(num_warps), bool(interpret)


def quantize_rows(x: jax.Array, *, interpret: bool | None = None, block_m: int | None = None,
                  num_warps: int | None = None, mantissa: bool = False
                  ) -> tuple[jax.Array, ...]:
  """NVFP4 quantize-dequantize of activation rows x [M, K] (bf16, f16 or f32; K a multiple of
  16) in one kernel: (y, q), y [M, K] in x.dtype, q an `NVFP4Tensor` (codes uint8 [M, K],
  block_scale float8_e4m3fn [M, K // 16], tensor_scale float32 [M, 1]); with `mantissa`,
  (y, q, bits): bits uint8 [M, K // 8] == `guided.pack_bits(q.codes & 1)`, the compact
  guidance record's payload.

  Bit for bit `q = formats.fp4_quantize_act(x, "nvfp4")` and
  `y = formats.fp4_dequantize(q).astype(x.dtype)` as under jit (non-finite rows are poisoned:
  NaN scales and y, codes 0 in their non-finite blocks; never raised on).
  interpret: None runs the Triton kernel on GPU and the Pallas interpreter elsewhere.
  block_m: rows per program, a power of two (None: `default_block_m`); num_warps: Triton's
  (None: `default_num_warps`).
  """
  block_m, num_warps, interpret = _launch("quantize_rows", x, block_m, num_warps, interpret)
  return _quantize_rows(x, interpret=interpret, block_m=block_m, num_warps=num_warps,
                        mantissa=bool(mantissa))


def _values_call(kernel_fn, name: str, x: jax.Array, *args: jax.Array, interpret: bool,
                 block_m: int, num_warps: int) -> jax.Array:
  """A values-only kernel over rows x [M, K] (`_qdq_kernel`, `_guided_kernel`): x viewed as
  [M, K // 16, 16] and `args` its other operands, out [M, K] in x.dtype."""
  m, k = x.shape
  if m == 0:
    return jnp.zeros((0, k), x.dtype)
  nb = k // BLOCK
  kernel = functools.partial(kernel_fn, m=m, nb=nb, bm=block_m, nbp=padded_blocks(k))
  y = pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((m, nb, BLOCK), x.dtype),
      grid=(pl.cdiv(m, block_m),), interpret=interpret, name=name,
      compiler_params=None if interpret else common.compiler_params(num_warps, 1),
  )(x.reshape(m, nb, BLOCK), *args)
  return y.reshape(m, k)


@functools.partial(jax.jit, static_argnames=("interpret", "block_m", "num_warps"))
def _qdq_rows(x: jax.Array, ts: jax.Array | None, *, interpret: bool, block_m: int,
              num_warps: int) -> jax.Array:
  m, k = x.shape
  p = row_parts(k)
  if ts is None and p > 1:  # the rows' own scales, of whole rows (the kernel sees parts)
    ts = formats.nvfp4_row_scale(x).reshape(m)
  args = () if ts is None else (jnp.repeat(ts, p), jnp.repeat(inverse_row_scales(ts), p))
  y = _values_call(_qdq_kernel, "nvfp4_qdq_rows", x.reshape(m * p, k // p), *args,
                   interpret=interpret, block_m=block_m, num_warps=num_warps)
  return y.reshape(m, k)


def qdq_rows(x: jax.Array, tensor_scale: jax.Array | None = None, *,
             interpret: bool | None = None, block_m: int | None = None,
             num_warps: int | None = None) -> jax.Array:
  """NVFP4 quantize-dequantize of rows x [M, K] under given second-level scales
  `tensor_scale` float32 [M] (a weight's per-expert scale, one per row), or None for each
  row's own (an unguided activation site's), in one kernel: the values only, [M, K] in
  x.dtype. What the training forward's fake quantizers need: one read and one write per
  element, the block scales made in registers (a row split in `row_parts(K)` > 1 parts has
  its own scale made by XLA first, one more read).

  Bit for bit `formats.nvfp4_dequantize(formats.nvfp4_quantize(x, tensor_scale[:, None]))
  .astype(x.dtype)` as under jit (`qdq_reference`; None: `reference(x)[0]`): a non-finite
  block, or a row whose scale is not finite, comes out NaN. interpret, block_m, num_warps:
  as `quantize_rows`', block_m counting the rows split in `row_parts(K)`.
  """
  block_m, num_warps, interpret = _launch("qdq_rows", x, block_m, num_warps, interpret,
                                         split=True)
  if tensor_scale is None:
    return _qdq_rows(x, None, interpret=interpret, block_m=block_m, num_warps=num_warps)
  ts = jnp.asarray(tensor_scale)
  if ts.shape != x.shape[:1] or ts.dtype != jnp.float32:
    raise ValueError(f"qdq_rows: tensor_scale must be float32 [{x.shape[0]}] (one per row of x "
                     f"{x.shape}), got {ts.dtype} {ts.shape}")
  return _qdq_rows(x, ts, interpret=interpret, block_m=block_m, num_warps=num_warps)


@functools.partial(jax.jit, static_argnames=("interpret", "block_m", "num_warps"))
def _guided_qdq_rows(x: jax.Array, scale: jax.Array, ts: jax.Array, mant: jax.Array,
                     rtn: jax.Array | None, *, interpret: bool, block_m: int,
                     num_warps: int) -> jax.Array:
  m, k = x.shape
  p = row_parts(k)
  mp, nbp = m * p, k // BLOCK // p  # rows split in p parts (`row_parts`)
  # the record's bytes of a block's 16 mantissa bits as one little-endian uint16 (bit j:
  # element j), as XLA bitcasts on CPU and GPU alike
  words = jax.lax.bitcast_convert_type(mant.reshape(mp, nbp, 2), jnp.uint16)
  args = (jax.lax.bitcast_convert_type(scale, jnp.uint8).reshape(mp, nbp), jnp.repeat(ts, p),
          jnp.repeat(inverse_row_scales(ts), p), words)
  if rtn is not None:  # the RTN rows' own scales, of whole rows (the kernel sees parts)
    rtn_ts = formats.nvfp4_row_scale(x).reshape(m)
    args += (jnp.repeat(rtn.astype(jnp.int32), p), jnp.repeat(rtn_ts, p))
  y = _values_call(_guided_kernel, "nvfp4_guided_qdq_rows", x.reshape(mp, k // p), *args,
                   interpret=interpret, block_m=block_m, num_warps=num_warps)
  return y.reshape(m, k)


def guided_qdq_rows(x: jax.Array, g: Guidance, rtn_rows: jax.Array | None = None, *,
                    interpret: bool | None = None, block_m: int | None = None,
                    num_warps: int | None = None) -> jax.Array:
  """NVFP4 fake quantization of rows x [M, K] rounded under a compact guidance record g (rows
  [M]: block_scale [M, K // 16], row_scale [M, 1], mantissa [M, K // 8]), in one kernel: the
  values only, [M, K] in x.dtype. rtn_rows: bool [M], rows that round to nearest with their
  own scales instead (expert_mid slots whose expert the rollout did not select), or None.

  Bit for bit `formats.fp4_dequantize(guided.guided_quantize(x, g)).astype(x.dtype)`, and
  `formats.fp4_dequantize(formats.fp4_quantize_act(x)).astype(x.dtype)` on rtn_rows, as under
  jit (`guided_qdq_reference`). interpret, block_m, num_warps: as `qdq_rows`'.
  """
  block_m, num_warps, interpret = _launch("guided_qdq_rows", x, block_m, num_warps, interpret,
                                         split=True)
  guided.validate(x, g, "guided_qdq_rows")
  if g.format != "nvfp4" or g.mantissa is None:
    raise ValueError(f"guided_qdq_rows: takes compact NVFP4 records, got {g.format} {g.mode}")
  m = x.shape[0]
  if rtn_rows is not None and (rtn_rows.shape != (m,) or rtn_rows.dtype != jnp.bool_):
    raise ValueError(f"guided_qdq_rows: rtn_rows must be bool [{m}], got {rtn_rows.dtype} "
                     f"{rtn_rows.shape}")
  return _guided_qdq_rows(x, g.block_scale, g.row_scale.reshape(m), g.mantissa, rtn_rows,
                          interpret=interpret, block_m=block_m, num_warps=num_warps)


def guided_qdq_reference(x: jax.Array, g: Guidance, rtn_rows: jax.Array | None = None
                         ) -> jax.Array:
  """`guided_qdq_rows`' contract in XLA (`guided`, `formats`)."""
  y = formats.fp4_dequantize(guided.guided_quantize(x, g)).astype(x.dtype)
  if rtn_rows is None:
    return y
  rtn = formats.fp4_dequantize(formats.fp4_quantize_act(x, "nvfp4")).astype(x.dtype)
  return jnp.where(rtn_rows[:, None], rtn, y)


def qdq_reference(x: jax.Array, tensor_scale: jax.Array) -> jax.Array:
  """`qdq_rows`' contract in XLA (`formats`)."""
  q = formats.nvfp4_quantize(x, tensor_scale[:, None])
  return formats.nvfp4_dequantize(q).astype(x.dtype)


def reference(x: jax.Array) -> tuple[jax.Array, formats.NVFP4Tensor]:
  """The kernel's contract in XLA (`formats`): what `quantize_rows` replaces."""
  q = formats.fp4_quantize_act(x, "nvfp4")
  return formats.fp4_dequantize(q).astype(x.dtype), q
