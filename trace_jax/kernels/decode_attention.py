"""Decode attention (one query token per sequence) over a BF16 or packed NVFP4 KV cache.

`decode_attention` is a Pallas kernel for the Triton GPU lowering (`interpret=True` on CPU):
split-K flash decoding. Grid (B, G, S): program (b, g, s) takes the R = N // G query heads that
read kv head g (padded to 16 rows, the smallest Triton dot), and loops over its share of the
key blocks [0, ceil(length / block_t)) with a dynamic trip count, holding the online-softmax
state (row max, row sum, [16, H] accumulator) in float32. S = 1 writes the normalized output;
S > 1 writes each split's state and a small XLA pass merges them (split-K pays off when B * G
is small next to the GPU's SM count).

Packed cache (`kv_cache.PackedKVCache`): each block loads the E2M1 codes (two per byte), E4M3
block scales and FP32 row scales and decodes them in registers (no float8 `astype`, which XLA
or Triton may rewrite, no gathers) to `formats.nvfp4_dequantize`'s values in q.dtype, bit for
bit, with one of two decoders (`decoder`):
- "table" (default on the GPU for bf16/f16): `fp4_decode`, per-(row, block) tables of the 8
  results and byte-permute lookups in PTX inline assembly. It yields the even and odd
  head_dim elements apart: q comes as its even and odd columns (split outside the kernel),
  the scores are the sum of two half dots, V's halves accumulate separately and the output
  is interleaved outside. The row scales pick the table per key tile: fast (every scale the
  quantizer makes; unwritten rows' 0 too) or exact (extreme row scales).
- "bits" (interpret mode, float32, tiles too small for the table decoder): integer/bit
  arithmetic per element (`_e2m1_half`), `(code_value * block_scale) * row_scale` in float32
  (the first product exact, the second rounding once), then a cast to q.dtype.
So the kernel's K/V are the trainer's fake-quantized values bit for bit (tests check this
through `dequantize_pallas`, which runs the same decoders, and through the exact output at
length 1). SASS of the key loop (Triton 3.6, sm_90, offline from the kernel's Triton IR after
`make_ttir`; H=128, 32 query / 4 KV heads, block_t 64, 4 warps, 2 stages): "table" 1092
instructions per thread per key block on the fast path (1338 with the exact tables), 144
registers; "bits" 1915, 152 registers; the BF16 kernel 591; no spills.

Numerics against `attention.attend` (the model's decode path, `decode_attention_reference`):
the scores are rounded as `attend` rounds them (float32 dot, cast to q.dtype, times
q.dtype(H**-0.5) in q.dtype, then float32), keys at or beyond `lengths` are masked, softmax
runs in float32, and probabilities are cast to q.dtype before the PV dot. Differences that
remain, so outputs match within a tolerance and not bit for bit: (1) dot accumulation order
(a score whose float32 sum lands across a bf16 rounding boundary differs by one bf16 ulp);
(2) online softmax casts the *unnormalized* exp(s - running max) to bf16 and divides at the
end, `attend` casts the normalized probabilities; (3) the final division. Stated tolerance
(`output_tolerance`): |out - ref| <= 2**-7 * (max|v| + |ref|) elementwise, max|v| over the
valid V rows of that sequence and kv head (the budget is in its docstring).
Keys at or beyond `lengths` are ignored entirely (even NaN ones); `attend` lets NaN in any
cache row (also unwritten ones) reach every output through 0 * NaN in its PV einsum.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from trace_jax.kernels import fp4_decode
from trace_jax.kernels.kv_cache import PackedKVCache, dequantize
from trace_jax.model import attention
from trace_jax.quant import formats

try:  # Triton-specific APIs (jax >= 0.4.31); masked loads/stores moved here from `pl`.
  from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover
  plgpu = None

BF16Cache = tuple[jax.Array, jax.Array]
MIN_ROWS = 16  # Triton's smallest dot tile along M (and N, K)
DEFAULT_BLOCK_T = 64
# Block dims squeezed out of a kernel's view (None in older jax, `pl.squeezed` in newer).
_SQ = getattr(pl, "squeezed", None)
_F32_MIN = float(np.finfo(np.float32).min)


# ----------------------------------------------------------------------------- version guards

def _load(ref, idx, mask=None):
  """Masked load of ref[idx] (lanes where mask is False are undefined; callers select)."""
  if plgpu is not None and hasattr(plgpu, "load"):
    return plgpu.load(ref.at[idx], mask=mask)
  return pl.load(ref, idx, mask=mask)  # older jax


def _store(ref, idx, val, mask=None) -> None:
  if plgpu is not None and hasattr(plgpu, "store"):
    plgpu.store(ref.at[idx], val, mask=mask)
  else:
    pl.store(ref, idx, val, mask=mask)  # older jax


def _compiler_params(num_warps: int, num_stages: int):
  cls = getattr(plgpu, "CompilerParams", None) or getattr(pl, "TritonCompilerParams", None)
  if cls is None:  # pragma: no cover
    return {"triton": {"num_warps": num_warps, "num_stages": num_stages}}
  return cls(num_warps=num_warps, num_stages=num_stages)


def _default_interpret() -> bool:
  return jax.default_backend() != "gpu"


# ----------------------------------------------------------------------------- decoding

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


def _block_bits(x: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(x, jnp.uint8) if x.dtype != jnp.uint8 else x


KEYS_FIRST = False


def resolve_decoder(decoder: str | None, dtype: jnp.dtype, rows: int, head_dim: int,
                    num_warps: int, interpret: bool) -> str:
  """The packed-cache decoder. None: "table" (per-block byte tables and `prmt` lookups;
  ~1.75x fewer static instructions per loop iteration on sm_90) on the GPU for bf16/f16 on
  tiles it supports, while `fp4_decode.TABLE_BY_DEFAULT` is set (since the H200 run of
  2026-12-02); else "bits" (`decode_nvfp4_rows`), always so in interpret mode, where XLA has
  no byte permute and the table decoder's emulation is the slower one."""
  return fp4_decode.choose(decoder, "bits", dtype, rows, head_dim // 2, num_warps, interpret)


def decode_nvfp4_split(codes: jax.Array, block_bits: jax.Array, row: jax.Array,
                       dtype: jnp.dtype, *, asm: bool, valid: jax.Array | None = None,
                       table: str | None = None) -> tuple[jax.Array, jax.Array]:
  """(even, odd) elements [n, H/2] in dtype of rows as `decode_nvfp4_rows` takes them, by the
  table decoder (`fp4_decode.decode_blocks`, per-row second-level scales); bit-equal to its
  even and odd columns. valid: rows outside it decode to +-0 (their scale bytes and row
  scale are zeroed first, so undefined masked loads cannot reach the tile's table branch).
  table: `fp4_decode.block_tables`' (None: the fast table when every row of the tile allows
  it)."""
  bits = block_bits.astype(jnp.int32)
  if valid is not None:
    bits = jnp.where(valid[:, None], bits, 0)
    row = jnp.where(valid, row, np.float32(0.0))
  return fp4_decode.decode_blocks(codes, bits.astype(jnp.uint8), row, dtype, asm=asm,
                                  table=table)


# ----------------------------------------------------------------------------- the kernel

def _attention_kernel(len_ref, *refs, packed: bool, lut: bool, asm: bool, table: str | None,
                      keys_first: bool, r: int, block_t: int, blocks_per_split: int,
                      splits: int, scale: float):
  """One (b, g, split): online softmax over this split's key blocks.

  lut (table decoder): K and V decode as even and odd head_dim halves; q comes as its even
  and odd columns, the scores are the sum of the two half dots, and the output (or split
  state) is written as the even and odd halves of the accumulator."""
  n_q = 2 if lut else 1
  n_kv = 6 if packed else 2
  q_refs, kv_refs, out_refs = refs[:n_q], refs[n_q:n_q + n_kv], refs[n_q + n_kv:]
  qs = [q_ref[...] for q_ref in q_refs]  # [Rp, H] (or two [Rp, H/2]), rows >= r zero padding
  qts = [q.T for q in qs] if keys_first else None
  rp, hq = qs[0].shape
  dtype = qs[0].dtype
  length = len_ref[...]
  first = pl.program_id(2) * blocks_per_split
  last = jnp.minimum(first + blocks_per_split, (length + block_t - 1) // block_t)
  sc = jnp.asarray(scale, dtype)

  def load_kv(t0, ok):
    """(ks, vs): lists of [block_t, hq] tiles (the whole head_dim, or its two halves)."""
    rows = pl.ds(t0, block_t)
    if packed:
      kc, vc, kb, vb, kr, vr = kv_refs
      h2 = kc.shape[-1]
      m2 = jnp.broadcast_to(ok[:, None], (block_t, h2))
      mb = jnp.broadcast_to(ok[:, None], (block_t, kb.shape[-1]))
      args = lambda c, b, rr: (_load(c, (rows, slice(None)), m2),
                               _block_bits(_load(b, (rows, slice(None)), mb)),
                               _load(rr, (rows,), ok))
      if lut:  # invalid rows decode to zeros (K's scores are masked anyway). One table
        # branch per tile: a joint one for K and V kept both tables live (spills, measured).
        k = decode_nvfp4_split(*args(kc, kb, kr), dtype, asm=asm, valid=ok, table=table)
        v = decode_nvfp4_split(*args(vc, vb, vr), dtype, asm=asm, valid=ok, table=table)
        return list(k), list(v)
      k = decode_nvfp4_rows(*args(kc, kb, kr), dtype)  # invalid rows: scores masked
      v = decode_nvfp4_rows(*args(vc, vb, vr), dtype, valid=ok)
      return [k], [v]
    else:
      k_ref, v_ref = kv_refs
      h = k_ref.shape[-1]
      mk = jnp.broadcast_to(ok[:, None], (block_t, h))
      k = _load(k_ref, (rows, slice(None)), mk).astype(dtype)
      v = _load(v_ref, (rows, slice(None)), mk).astype(dtype)
      # Masked lanes are undefined: zero V there (K's scores are masked below).
      return [k], [jnp.where(mk, v, jnp.zeros((), dtype))]

  def body(i, carry):
    m, l, accs = carry
    t0 = i * block_t
    ok = t0 + jnp.arange(block_t) < length
    ks, vs = load_kv(t0, ok)
    s = None
    if keys_first:  # scores transposed, [block_t, Rp]: K is the MMA's first operand
      for qt, k in zip(qts, ks):
        d = jax.lax.dot_general(k, qt, (((1,), (0,)), ((), ())),
                                preferred_element_type=jnp.float32)
        s = d if s is None else s + d
      s = (s.astype(dtype) * sc).astype(jnp.float32)  # attend's rounding of the scores
      s = jnp.where(ok[:, None], s, -jnp.inf)
      m_new = jnp.maximum(m, jnp.max(s, axis=0))
      alpha = jnp.exp(m - m_new)
      p = jnp.exp(s - m_new[None, :])
      l = alpha * l + jnp.sum(p, axis=0)
      pd = p.astype(dtype).T
    else:
      for q, k in zip(qs, ks):
        d = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32)  # [Rp, block_t]
        s = d if s is None else s + d
      s = (s.astype(dtype) * sc).astype(jnp.float32)  # attend's rounding of the scores
      s = jnp.where(ok[None, :], s, -jnp.inf)
      m_new = jnp.maximum(m, jnp.max(s, axis=1))
      alpha = jnp.exp(m - m_new)
      p = jnp.exp(s - m_new[:, None])
      l = alpha * l + jnp.sum(p, axis=1)
      pd = p.astype(dtype)
    accs = tuple(acc * alpha[:, None] + jax.lax.dot_general(
        pd, v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        for acc, v in zip(accs, vs))  # [Rp, hq] each
    return m_new, l, accs

  init = (jnp.full((rp,), _F32_MIN, jnp.float32), jnp.zeros((rp,), jnp.float32),
          tuple(jnp.zeros((rp, hq), jnp.float32) for _ in qs))
  m, l, accs = jax.lax.fori_loop(first, last, body, init)

  row_ok = jnp.arange(rp) < r
  mask2 = None if r == rp else jnp.broadcast_to(row_ok[:, None], (rp, hq))
  mask1 = None if r == rp else row_ok
  if splits == 1:
    for o_ref, acc in zip(out_refs, accs):
      out = acc / jnp.where(l > 0, l, 1.0)[:, None]
      _store(o_ref, (slice(None), slice(None)), out.astype(o_ref.dtype), mask2)
  else:
    *o_refs, m_ref, l_ref = out_refs
    for o_ref, acc in zip(o_refs, accs):
      _store(o_ref, (slice(None), slice(None)), acc, mask2)
    _store(m_ref, (slice(None),), m, mask1)
    _store(l_ref, (slice(None),), l, mask1)


def _interleave(even: jax.Array, odd: jax.Array) -> jax.Array:
  """[..., H/2] even and odd columns -> [..., H]."""
  return jnp.stack([even, odd], axis=-1).reshape(even.shape[:-1] + (2 * even.shape[-1],))


def _next_pow2(x: int) -> int:
  return 1 << max(int(x) - 1, 0).bit_length()


def default_num_splits(batch: int, num_kv_heads: int, num_blocks: int) -> int:
  """Key splits so that about 2 programs per SM run (132 SMs assumed off-GPU), with at least
  4 key blocks per split."""
  try:
    sms = int(getattr(jax.devices()[0], "core_count", 0)) or 132
  except Exception:  # pragma: no cover
    sms = 132
  want = -(-2 * sms // max(batch * num_kv_heads, 1))
  return int(max(1, min(want, num_blocks // 4)))


@functools.partial(jax.jit, static_argnames=("interpret", "block_t", "num_splits", "num_warps",
                                             "num_stages", "decoder", "table"))
def _decode_attention(q, cache, lengths, *, interpret: bool, block_t: int, num_splits: int,
                      num_warps: int, num_stages: int, decoder: str = "bits",
                      table: str | None = None):
  packed = isinstance(cache, PackedKVCache)
  lut = packed and decoder == "table"
  b, n, h = q.shape
  if packed:
    _, t, g, _ = cache.shape
    kv = (cache.k_codes, cache.v_codes, cache.k_block, cache.v_block, cache.k_row, cache.v_row)
  else:
    kv = tuple(cache)
    t, g = kv[0].shape[1], kv[0].shape[2]
  r = n // g
  rp = max(MIN_ROWS, _next_pow2(r))
  nblk = -(-t // block_t)
  splits = max(1, min(num_splits, nblk))
  bps = -(-nblk // splits)
  splits = -(-nblk // bps)  # no split without blocks
  qg = q.reshape(b, g, r, h)
  if rp != r:
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rp - r), (0, 0)))
  qs = (qg[..., 0::2], qg[..., 1::2]) if lut else (qg,)  # lut: even and odd columns
  hq = qs[0].shape[-1]
  lengths = jnp.clip(lengths.astype(jnp.int32), 0, t)

  def kv_spec(a):  # program (b, g, s) sees cache[b, :, g] ([T] or [T, last])
    zeros = (0,) * (a.ndim - 3)
    return pl.BlockSpec((_SQ, t, _SQ) + a.shape[3:], lambda bi, gi, si: (bi, 0, gi) + zeros)

  q_spec = pl.BlockSpec((_SQ, _SQ, rp, hq), lambda bi, gi, si: (bi, gi, 0, 0))
  in_specs = [pl.BlockSpec((_SQ,), lambda bi, gi, si: (bi,))] + [q_spec] * len(qs)
  in_specs += [kv_spec(a) for a in kv]
  if splits == 1:
    out_shape = [jax.ShapeDtypeStruct((b, g, r, hq), q.dtype)] * len(qs)
    out_specs = [q_spec] * len(qs)
  else:
    acc_spec = pl.BlockSpec((_SQ, _SQ, _SQ, rp, hq), lambda bi, gi, si: (bi, gi, si, 0, 0))
    out_shape = [jax.ShapeDtypeStruct((b, g, splits, r, hq), jnp.float32)] * len(qs) + [
        jax.ShapeDtypeStruct((b, g, splits, r), jnp.float32),
        jax.ShapeDtypeStruct((b, g, splits, r), jnp.float32)]
    out_specs = [acc_spec] * len(qs) + [
        pl.BlockSpec((_SQ, _SQ, _SQ, rp), lambda bi, gi, si: (bi, gi, si, 0)),
        pl.BlockSpec((_SQ, _SQ, _SQ, rp), lambda bi, gi, si: (bi, gi, si, 0))]
  kernel = functools.partial(_attention_kernel, packed=packed, lut=lut, asm=not interpret,
                             table=table, keys_first=KEYS_FIRST, r=r, block_t=block_t,
                             blocks_per_split=bps,
                             splits=splits, scale=h ** -0.5)
  outs = pl.pallas_call(
      kernel, grid=(b, g, splits), in_specs=in_specs, out_specs=out_specs,
      out_shape=out_shape, interpret=interpret,
      compiler_params=_compiler_params(num_warps, num_stages),
      name="decode_attention_nvfp4" if packed else "decode_attention_bf16",
  )(lengths, *qs, *kv)
  if splits == 1:
    out = _interleave(*outs) if lut else outs[0]
    return out.reshape(b, n, h)
  *acc, m, l = outs
  acc = _interleave(*acc) if lut else acc[0]
  mx = jnp.max(m, axis=2, keepdims=True)
  w = jnp.exp(m - mx)  # empty splits: m = float32.min, weight 0
  lt = jnp.sum(w * l, axis=2)
  out = jnp.sum(w[..., None] * acc, axis=2) / jnp.where(lt > 0, lt, 1.0)[..., None]
  return out.astype(q.dtype).reshape(b, n, h)


def _check(q: jax.Array, cache: PackedKVCache | BF16Cache, lengths: jax.Array,
           block_t: int) -> None:
  if q.ndim != 3:
    raise ValueError(f"q must be [B, N, H] (one query token per sequence), got {q.shape}")
  b, n, h = q.shape
  shape = cache.shape if isinstance(cache, PackedKVCache) else tuple(cache[0].shape)
  if not isinstance(cache, PackedKVCache) and tuple(cache[1].shape) != shape:
    raise ValueError(f"k {shape} and v {cache[1].shape} differ")
  if len(shape) != 4 or shape[0] != b or shape[3] != h or n % shape[2]:
    raise ValueError(f"cache [B, T, G, H] = {shape} does not fit q [B, N, H] = {q.shape} "
                     "(N must be a multiple of G)")
  if lengths.shape != (b,):
    raise ValueError(f"lengths must be [B] = ({b},), got {lengths.shape}")
  if block_t < MIN_ROWS or block_t & (block_t - 1):
    raise ValueError(f"block_t must be a power of two >= {MIN_ROWS}, got {block_t}")
  if h < MIN_ROWS or h & (h - 1):
    raise ValueError(f"head_dim must be a power of two >= {MIN_ROWS}, got {h}")


def decode_attention(q: jax.Array, cache: PackedKVCache | BF16Cache, lengths: jax.Array, *,
                     interpret: bool | None = None, block_t: int = DEFAULT_BLOCK_T,
                     num_splits: int | None = None, num_warps: int = 4,
                     num_stages: int = 2, decoder: str | None = None,
                     table: str | None = None) -> jax.Array:
  """Attention of one query token per sequence over its cache: q [B, N, H] -> [B, N, H].

  cache: a `PackedKVCache` (NVFP4) or BF16 (k, v), each [B, T, G, H]; lengths [B]: keys
  0..lengths-1 are valid (the cache already holds the current token; lengths >= 1; 0 gives
  zeros). Query head n reads kv head n // (N // G). interpret=None: interpret off-GPU.
  num_splits=None: `default_num_splits`. decoder (packed cache): "table", "bits" or None
  (`resolve_decoder`); table (decoder "table"): None picks the bf16 fast table per key block
  where its row scales allow it, "exact" always takes the exact one (for tests), "fast"
  always the fast one (only exact for row scales in `fp4_decode.tensor_scale_factors`' fast
  range; for instruction counts). Output in q.dtype; the numerics are the module's.
  """
  _check(q, cache, lengths, block_t)
  if interpret is None:
    interpret = _default_interpret()
  packed = isinstance(cache, PackedKVCache)
  b, t, g, h = cache.shape if packed else cache[0].shape
  if num_splits is None:
    num_splits = default_num_splits(b, g, -(-t // block_t))
  decoder = resolve_decoder(decoder, q.dtype, block_t, h, num_warps, bool(interpret)) \
      if packed else "bits"
  return _decode_attention(q, cache, lengths, interpret=bool(interpret), block_t=block_t,
                           num_splits=int(num_splits), num_warps=num_warps,
                           num_stages=num_stages, decoder=decoder, table=table)


# ----------------------------------------------------------------------------- references

def decode_attention_reference(q: jax.Array, cache: PackedKVCache | BF16Cache,
                               lengths: jax.Array) -> jax.Array:
  """The same contract in plain JAX: dequantize (packed) or cast the cache to q.dtype, then
  `attention.attend` with query position lengths - 1 (the model's decode path)."""
  if isinstance(cache, PackedKVCache):
    k, v = dequantize(cache, q.dtype)
  else:
    k, v = (a.astype(q.dtype) for a in cache)
  b, t = k.shape[:2]
  key_pos = jnp.broadcast_to(jnp.arange(t), (b, t))
  out = attention.attend(q[:, None], k, v, (lengths.astype(jnp.int32) - 1)[:, None], key_pos)
  return out[:, 0]


def output_tolerance(v: jax.Array, lengths: jax.Array, ref: jax.Array,
                     num_heads: int) -> jax.Array:
  """Elementwise bound on |kernel - reference| [B, N, H]: 2**-7 * (max|v| + |ref|).

  max|v| is over the valid V rows (t < length) of the kv head the query head reads. Budget
  (bf16 compute dtype): both round the probabilities to bf16 (relative 2**-9 each, after
  different normalizations), <= 2**-8 * max|v| together; both round the output once to bf16,
  <= 2**-8 * |ref| together; the other 2**-8 * (max|v| + |ref|) is left for scores whose
  float32 dots (different accumulation orders) round to neighbouring bf16 values (one ulp,
  <= 2**-7 |score|, moves that key's probability by that factor: rare, small) and for the
  GPU's float32 exp/division. Measured on CPU (scores of std 1..16): at most 0.37 of it.
  """
  b, t, g, h = v.shape
  ok = jnp.arange(t)[None, :] < lengths[:, None]
  vmax = jnp.max(jnp.where(ok[:, :, None, None], jnp.abs(v.astype(jnp.float32)), 0.0),
                 axis=(1, 3))  # [B, G]
  vmax = jnp.repeat(vmax, num_heads // g, axis=1)[:, :, None]  # [B, N, 1]
  return np.float32(2.0**-7) * (vmax + jnp.abs(ref.astype(jnp.float32)))


# ----------------------------------------------------------------------------- dequantize kernel

def _dequant_kernel(c_ref, b_ref, r_ref, *o_refs, block_t: int, t: int, lut: bool, asm: bool,
                    table: str | None):
  i = pl.program_id(1)
  rows = pl.ds(i * block_t, block_t)
  ok = i * block_t + jnp.arange(block_t) < t
  h2 = c_ref.shape[-1]
  m2 = jnp.broadcast_to(ok[:, None], (block_t, h2))
  mb = jnp.broadcast_to(ok[:, None], (block_t, b_ref.shape[-1]))
  args = (_load(c_ref, (rows, slice(None)), m2), _block_bits(_load(b_ref, (rows, slice(None)), mb)),
          _load(r_ref, (rows,), ok))
  if lut:  # even and odd elements as two outputs
    for o_ref, x in zip(o_refs, decode_nvfp4_split(*args, o_refs[0].dtype, asm=asm,
                                                   table=table)):
      _store(o_ref, (rows, slice(None)), x, m2)
  else:
    (o_ref,) = o_refs
    x = decode_nvfp4_rows(*args, o_ref.dtype)
    _store(o_ref, (rows, slice(None)), x, jnp.broadcast_to(ok[:, None], (block_t, 2 * h2)))


@functools.partial(jax.jit, static_argnames=("dtype", "interpret", "block_t", "decoder",
                                             "num_warps", "table"))
def _dequantize_pallas(codes, block, row, *, dtype, interpret: bool, block_t: int,
                       decoder: str = "bits", num_warps: int = 4, table: str | None = None):
  lead, h2 = codes.shape[:-1], codes.shape[-1]
  t = int(np.prod(lead))
  c = codes.reshape(1, t, h2)
  bb = block.reshape(1, t, block.shape[-1])
  rr = row.reshape(1, t)
  nblk = -(-t // block_t)
  lut = decoder == "table"

  def spec(a):
    zeros = (0,) * (a.ndim - 1)
    return pl.BlockSpec((_SQ, t) + a.shape[2:], lambda i, j: (i,) + zeros)

  width = h2 if lut else 2 * h2
  n_out = 2 if lut else 1
  outs = pl.pallas_call(
      functools.partial(_dequant_kernel, block_t=block_t, t=t, lut=lut, asm=not interpret,
                        table=table),
      grid=(1, nblk), in_specs=[spec(c), spec(bb), spec(rr)],
      out_specs=[pl.BlockSpec((_SQ, t, width), lambda i, j: (i, 0, 0))] * n_out,
      out_shape=[jax.ShapeDtypeStruct((1, t, width), dtype)] * n_out, interpret=interpret,
      compiler_params=_compiler_params(num_warps, 1), name="nvfp4_kv_dequantize")(c, bb, rr)
  out = _interleave(*outs) if lut else outs[0]
  return out.reshape(lead + (2 * h2,))


def dequantize_pallas(cache: PackedKVCache, dtype: jnp.dtype = jnp.bfloat16, *,
                      interpret: bool | None = None, block_t: int = DEFAULT_BLOCK_T,
                      decoder: str | None = None,
                      table: str | None = None) -> tuple[jax.Array, jax.Array]:
  """(k, v) [B, T, G, H] decoded by the attention kernel's in-register decoder (a Pallas
  kernel of its own), so tests can compare its bits with `kv_cache.dequantize`. decoder,
  table: as in `decode_attention`."""
  if interpret is None:
    interpret = _default_interpret()
  decoder = resolve_decoder(decoder, dtype, block_t, cache.shape[-1], 4, bool(interpret))
  f = functools.partial(_dequantize_pallas, dtype=jnp.dtype(dtype), interpret=bool(interpret),
                        block_t=block_t, decoder=decoder, table=table)
  return (f(cache.k_codes, cache.k_block, cache.k_row),
          f(cache.v_codes, cache.v_block, cache.v_row))
