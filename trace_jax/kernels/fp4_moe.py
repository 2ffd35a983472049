"""MoE grouped matmul at decode: each touched expert's weights read once, packed NVFP4 or BF16.

Contract (the same as `trace_jax.model.grouped.grouped_matmul`): rows x [M, K] sorted by
expert, `group_sizes` [E] (int, summing to M), weights w [E, N, K] (torch [out, in] order,
contraction axis last) -> [M, N] in x.dtype, products summed in float32. Rows past
sum(group_sizes) come out zero, as with ragged_dot.

Weights are either a dense array (BF16 or the compute dtype) or `PackedNVFP4Weights`: the
two-level NVFP4 quantization of `qat.fake_quant_weight(w, "nvfp4")` stored as it is read,
two E2M1 codes per byte (`formats.pack_fp4` nibble order), E4M3 block scales per 16 elements
and one float32 second-level scale per expert. The kernel dequantizes in registers with the
operations and rounding order of `formats.nvfp4_dequantize` (code value * block scale, exact;
then * tensor scale, one float32 rounding; then one rounding to x.dtype), so the weights it
multiplies are bit for bit those of today's fake-quantized path, without materialising them.

Kernel design (`pl.pallas_call`, Triton lowering on GPU, `interpret=True` elsewhere):
- grid (E, N // block_n): one program per (expert, output tile). A program reads its
  expert's row offset and size; an expert with no rows returns before loading anything, so
  untouched experts' weights are never read.
- Each program loops over its expert's rows in blocks of `block_m` (masked loads/stores, so
  M needs no padding), and for each row block over K in tiles of `block_k`: load the weight
  tile (packed codes + block scales, or BF16), dequantize, dot with the x tile (float32
  accumulator [block_m, block_n]), store the row block's output tile once.
- Loop order: row blocks outside, K inside. The accumulator must be a static-size register
  tile while the number of row blocks is dynamic, so the K loop cannot be outermost with
  every row block's accumulator live. The first row block reads the expert's [block_n, K]
  weight slab from HBM; further row blocks (only experts holding more than `block_m` rows)
  re-read the same slab (64 KiB packed FP4 at block_n=64, K=2048) right after, from L2.
  `block_m` defaults to about twice the mean group size (16..64), so at decode nearly every
  expert fits one row block and its weights cross HBM once per step.
- Decoding never uses float8/float4 conversions in jnp (which XLA or Triton may rewrite). The
  codes tile is loaded as whole contiguous rows [block_n, block_k // 2] (coalesced). Three
  decoders (`decoder`):
  - "table" (default on the GPU for bf16/f16 rows): `fp4_decode`, per-block tables of the 8
    results dtype(RN(v * bs * ts)) and byte-permute (`prmt`) lookups, 4 codes per
    instruction, in PTX inline assembly. It yields the even and odd elements apart, so by
    default (`split`) x's even and odd columns (split outside the kernel, one small XLA copy
    of x per call) meet them in two dots; split=False re-interleaves them in registers. The
    tensor scale picks the table per program: the fast one (3 float32 products and 3 packed
    bf16 products per block; every scale the quantizer makes) or the exact one (8 products;
    extreme tensor scales, f16): two copies of the loops, one runs.
  - "float16" (interpret mode, float32 rows, tiles too small for the table decoder): the
    block scale from its E4M3 bits (`exact.e4m3_value`), each byte's two E2M1 codes placed
    into float16 bit patterns by two integer multiplies and masks (`e2m1_pair_scaled`: the
    float16 is the code's value times 2**-14, folded back exactly into the block scale),
    then the two float32 products per weight; the nibbles re-interleaved with a 2-way stack
    + reshape (Triton `join` + `reshape`) or, with split=True, two dots.
  - "words" (codes held as words, `PackedNVFP4Weights.as_words`; the engine's layout on the
    GPU, `pack_for_kernel`): the same tables and byte permutes, but the codes tile is [bn, kb,
    2] uint32, the block scales' shape, so each block's tables are built once, by the thread
    that decodes it (in the byte layout Triton decoded in the MMA fragment's layout, where 4
    threads share a block and each rebuilt its tables). The 16 results of a block are laid out
    in the MMA operand order (`fp4_decode.mma_order`, x's columns permuted alike outside the
    kernel) so no element changes thread on its way to the MMA, and the next K tile's codes
    and scales are loaded before the current one is decoded (`prefetch`). H200, gate/up at
    batch 64: 1.13x faster than "table" (docs/benchmarks.md, 2026-12-03).
  All give `formats.nvfp4_dequantize`'s bits (`fp4_decode`'s docstring proves the table's).
- `swap_ab` (default for packed weights) computes each tile transposed, weights as the MMA's
  first operand: at decode the weight tile is the large side. SASS of the K loop (Triton 3.6,
  sm_90, compiled offline from this kernel's Triton IR after Triton's `make_ttir` passes, as
  XLA runs them; block 64 x 256, 4 warps, 3 stages, block_m 16): table decoder 521
  instructions per thread per tile = 4.1 per weight (577 = 4.5 with the exact table), 176
  registers; float16 decoder 1228 = 9.6 per weight, 212 registers; BF16 weights 182 = 1.4;
  no spills. Timings need the GPU (`experiments/bench_moe_decode.py`).
- Rows past sum(group_sizes) are zeroed by the programs of the last expert.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.experimental import pallas as pl

from trace_jax.kernels import fp4_decode, wgmma_decode, wgmma_moe
from trace_jax.quant import exact, formats

try:  # Triton-specific Pallas names (masked load/store, compiler params)
  from jax.experimental.pallas import triton as _plgpu
except ImportError:  # pragma: no cover - every jax with Pallas ships it
  _plgpu = None

NVFP4_BLOCK = formats.NVFP4_BLOCK
_BYTES_PER_BLOCK = NVFP4_BLOCK // 2  # packed code bytes under one block scale


# ----------------------------------------------------------------------------- packed weights

@struct.dataclass
class PackedNVFP4Weights:
  """Two-level NVFP4 stacked expert weights [E, N, K] as the decode kernel reads them.

  codes: uint8 [E, N, K // 2], two E2M1 codes per byte, element 2i in the low nibble; or
    the same bytes as uint32 words [E, N, K // 16, 2] (`as_words`: each block's 8 bytes as two
    little-endian words), the layout the GPU kernel's "words" decoder reads.
  block_scale: float8_e4m3fn [E, N, K // 16].
  tensor_scale: float32 [E], one second-level scale per expert.
  """
  codes: jax.Array
  block_scale: jax.Array
  tensor_scale: jax.Array

  @property
  def words(self) -> bool:
    """Whether the codes are held as uint32 words per block (`as_words`)."""
    return self.codes.dtype == jnp.uint32

  @property
  def shape(self) -> tuple[int, ...]:
    """The logical weight shape (E, N, K), or (L, E, N, K) for a stack of layers."""
    if self.words:
      *lead, kb, _ = self.codes.shape
      return (*lead, NVFP4_BLOCK * kb)
    *lead, half = self.codes.shape
    return (*lead, 2 * half)

  def as_words(self) -> PackedNVFP4Weights:
    """The same weights with the codes as uint32 words per block (no-op if they are)."""
    if self.words:
      return self
    return self.replace(codes=fp4_decode.to_words(self.codes))

  def as_bytes(self) -> PackedNVFP4Weights:
    """The same weights with the codes as bytes (the ModelOpt layout; no-op if they are)."""
    return self.replace(codes=fp4_decode.from_words(self.codes)) if self.words else self

  def slice_n(self, start: int, stop: int | None = None) -> PackedNVFP4Weights:
    """Output rows [start:stop] of every expert (the tensor scales are shared, not copied)."""
    return PackedNVFP4Weights(codes=self.codes[:, start:stop],
                              block_scale=self.block_scale[:, start:stop],
                              tensor_scale=self.tensor_scale)


def check_packed(p: PackedNVFP4Weights, stacked: bool = False) -> None:
  """Raises ValueError/TypeError if the fields' shapes or dtypes disagree (works on tracers).
  stacked: every field has a leading layer axis L."""
  lead = ("L, " if stacked else "")
  if p.words:
    if p.codes.ndim != 4 + stacked or p.codes.shape[-1] != 2:
      raise TypeError(f"PackedNVFP4Weights.codes as words must be uint32 [{lead}E, N, K // 16, "
                      f"2], got {p.codes.shape}")
  elif p.codes.ndim != 3 + stacked or p.codes.dtype != jnp.uint8:
    raise TypeError(f"PackedNVFP4Weights.codes must be uint8 [{lead}E, N, K // 2] (or uint32 "
                    f"words), got {p.codes.dtype} {p.codes.shape}")
  *layers, e, n, k = p.shape
  if k % NVFP4_BLOCK:
    raise ValueError(f"PackedNVFP4Weights: K={k} is not a multiple of {NVFP4_BLOCK}")
  want = (*layers, e, n, k // NVFP4_BLOCK)
  if p.block_scale.shape != want or p.block_scale.dtype != jnp.float8_e4m3fn:
    raise ValueError(f"PackedNVFP4Weights.block_scale must be float8_e4m3fn {want}, got "
                     f"{p.block_scale.dtype} {p.block_scale.shape}")
  if p.tensor_scale.shape != (*layers, e) or p.tensor_scale.dtype != jnp.float32:
    raise ValueError(f"PackedNVFP4Weights.tensor_scale must be float32 {(*layers, e)}, got "
                     f"{p.tensor_scale.dtype} {p.tensor_scale.shape}")


def pack_nvfp4(w: jax.Array) -> PackedNVFP4Weights:
  """Packs stacked expert weights w [E, N, K] exactly as `qat.fake_quant_weight(w, "nvfp4")`
  quantizes them: one second-level scale per expert (`nvfp4_tensor_scale` over axes 1, 2).

  Pass w in the dtype the model quantizes it in (the compute dtype: `Precision.expert_weights`
  receives the weights already cast to x.dtype), so the codes match its fake quantization.
  """
  if w.ndim != 3:
    raise ValueError(f"pack_nvfp4: expected stacked expert weights [E, N, K], got {w.shape}")
  ts = formats.nvfp4_tensor_scale(w, axes=(1, 2))
  q = formats.nvfp4_quantize(w, ts)
  return PackedNVFP4Weights(codes=formats.pack_fp4(q.codes), block_scale=q.block_scale,
                            tensor_scale=ts.reshape(w.shape[0]))


def pack_for_kernel(w: jax.Array, words: bool) -> PackedNVFP4Weights:
  """`pack_nvfp4` with the codes as words per block (`as_words`, the GPU kernels' decoder) or
  as bytes (the interpreter's faster path): the same values either way."""
  p = pack_nvfp4(w)
  return p.as_words() if words else p


def pack_nvfp4_gate_up(gate: jax.Array, up: jax.Array
                       ) -> tuple[PackedNVFP4Weights, PackedNVFP4Weights]:
  """Gate and up [E, F, D] packed with one shared tensor scale per expert, as
  `Precision.expert_weights` quantizes them (concatenated along N, quantized, split).

  For one fused gate/up matmul, `pack_nvfp4(jnp.concatenate([gate, up], axis=1))` holds the
  same bytes.
  """
  if gate.shape != up.shape:
    raise ValueError(f"pack_nvfp4_gate_up: gate {gate.shape} and up {up.shape} differ")
  f = gate.shape[1]
  both = pack_nvfp4(jnp.concatenate([gate, up], axis=1))
  return both.slice_n(0, f), both.slice_n(f)


def dequantize(p: PackedNVFP4Weights, dtype: Any = jnp.float32) -> jax.Array:
  """[E, N, K] values in `dtype`; equals `qat.fake_quant_weight(w, "nvfp4")` bit for bit
  when dtype is w's dtype (the same `formats.nvfp4_dequantize`, then one rounding)."""
  check_packed(p)
  q = formats.NVFP4Tensor(codes=formats.unpack_fp4(p.as_bytes().codes), block_scale=p.block_scale,
                          tensor_scale=p.tensor_scale.reshape(-1, 1, 1))
  return formats.nvfp4_dequantize(q).astype(dtype)


def weight_bytes_per_expert(w: jax.Array | PackedNVFP4Weights) -> int:
  """Bytes of one expert's weights as stored (what the kernel reads for a touched expert)."""
  if isinstance(w, PackedNVFP4Weights):
    _, n, k = w.shape
    return n * k // 2 + n * k // NVFP4_BLOCK + 4
  _, n, k = w.shape
  return n * k * jnp.dtype(w.dtype).itemsize


# ----------------------------------------------------------------------------- reference

def grouped_matmul_reference(x: jax.Array, w: jax.Array | PackedNVFP4Weights,
                             group_sizes: jax.Array) -> jax.Array:
  """The kernel's contract in plain JAX: dequantize (or cast) to x.dtype, then ragged_dot."""
  from trace_jax.model import grouped  # here: trace_jax.model imports this module

  wd = dequantize(w, x.dtype) if isinstance(w, PackedNVFP4Weights) else w.astype(x.dtype)
  return grouped.grouped_matmul(x, wd, group_sizes.astype(jnp.int32), "ragged_dot")


# ----------------------------------------------------------------------------- Pallas glue

def _masked_load(ref: Any, idx: tuple[Any, ...], mask: jax.Array, other: Any) -> jax.Array:
  if _plgpu is not None and hasattr(_plgpu, "load"):  # jax >= 0.7: pallas.triton.load
    return _plgpu.load(ref.at[idx], mask=mask, other=other)
  return pl.load(ref, idx, mask=mask, other=other)  # pragma: no cover - older jax


def _masked_store(ref: Any, idx: tuple[Any, ...], val: jax.Array, mask: jax.Array) -> None:
  if _plgpu is not None and hasattr(_plgpu, "store"):
    _plgpu.store(ref.at[idx], val, mask=mask)
  else:  # pragma: no cover - older jax
    pl.store(ref, idx, val, mask=mask)


def zero_rows_past(o_ref: Any, total: jax.Array, m: int, bm: int, n0: jax.Array,
                   bn: int) -> None:
  """Zeros output rows total..m of columns n0..n0+bn (rows no group holds, as ragged_dot
  gives them), in masked blocks of bm rows: for one program per output tile to call."""
  rows = jnp.arange(bm, dtype=jnp.int32)[:, None]

  def zero_block(i, carry):
    row0 = total + i * bm
    valid = jnp.broadcast_to((row0 + rows) < m, (bm, bn))
    _masked_store(o_ref, (pl.ds(row0, bm), pl.ds(n0, bn)), jnp.zeros((bm, bn), o_ref.dtype),
                  valid)
    return carry

  jax.lax.fori_loop(0, jax.lax.div(m - total + (bm - 1), bm), zero_block, 0)


def _compiler_params(num_warps: int, num_stages: int) -> Any:
  cls = (getattr(_plgpu, "CompilerParams", None) or getattr(_plgpu, "TritonCompilerParams", None)
         if _plgpu is not None else None)
  if cls is not None:
    return cls(num_warps=num_warps, num_stages=num_stages)
  return {"triton": {"num_warps": num_warps, "num_stages": num_stages}}  # pragma: no cover


def _pow2_divisor(n: int, cap: int) -> int:
  """The largest power of two that divides n and is at most cap."""
  b = 1
  while b * 2 <= cap and n % (b * 2) == 0:
    b *= 2
  return b


def _next_pow2(n: int) -> int:
  return 1 << max(0, n - 1).bit_length()


# Programs a decode launch should have at least (two per SM of an H100/H200, 132 SMs): with
# fewer, a few SMs stream the weights and the rest idle (one 4096-row projection in 64-row
# tiles is 64 programs).
MIN_PROGRAMS = 256


def default_block_n(n: int, num_experts: int, cap: int = 64, floor: int = 16) -> int:
  """Output tile rows: the largest power of two <= cap dividing n, halved (not below floor)
  while the grid (num_experts x n / block_n) has fewer than `MIN_PROGRAMS` programs."""
  bn = _pow2_divisor(n, cap)
  while bn > floor and num_experts * (n // bn) < MIN_PROGRAMS and n % (bn // 2) == 0:
    bn //= 2
  return bn


def default_block_m(m: int, num_experts: int) -> int:
  """Rows per block: about twice the mean group size, a power of two in [16, 64]."""
  return min(64, max(16, _next_pow2(2 * -(-m // num_experts))))


def _check_block(name: str, value: int, lo: int) -> None:
  if value < lo or value & (value - 1):
    raise ValueError(f"{name} must be a power of two >= {lo}, got {value}")


# ----------------------------------------------------------------------------- decoding

_DECODE_SHIFT = np.float32(2.0**14)  # E2M1 bits placed in float16 read as value * 2**-14


def e2m1_pair_scaled(p: jax.Array) -> tuple[jax.Array, jax.Array]:
  """float32 values * 2**-14 of the low and high E2M1 nibbles of packed bytes p (uint8).

  Each nibble's magnitude bits go to float16 bits 11..9 (the two low exponent bits and the top
  mantissa bit) and its sign to bit 15, so the float16 is the E2M1 value times 2**-14 exactly
  (code 1, 0.5, becomes the float16 subnormal 2**-15) and float16 -> float32 is exact on every
  backend. Both halves come from two integer multiplies and masks on the byte (the shifted
  copies never overlap, so no carries): no int -> float conversion (quarter rate on Hopper) and
  no table. The 2**-14 is folded into the block scale (`e4m3_value_scaled`), so the products
  stay exact. Equals `formats.e2m1_decode(formats.unpack_fp4(p)) * 2**-14` bit for bit,
  signed zeros included.
  """
  t = p.astype(jnp.uint32)
  # low nibble -> bits 9..11 and 15, high nibble -> bits 25..27 and 31
  r = (((t * np.uint32(0x00200200)) & np.uint32(0x0E000E00))
       | ((t * np.uint32(0x01001000)) & np.uint32(0x80008000)))
  as_f32 = lambda b: jax.lax.bitcast_convert_type(b.astype(jnp.uint16),
                                                  jnp.float16).astype(jnp.float32)
  return as_f32(r), as_f32(r >> 16)


def e4m3_value_scaled(scale: jax.Array) -> jax.Array:
  """`exact.e4m3_value(scale) * 2**14` (exact: a power-of-two product of a value in
  [2**-9, 448]); pairs with `e2m1_pair_scaled`."""
  return exact.e4m3_value(scale) * _DECODE_SHIFT


# ----------------------------------------------------------------------------- kernel

def _kernel(offs_ref, sizes_ref, layer_ref, *refs, fp4: bool, split: bool, swap_ab: bool,
            lut: bool, words: bool, order: str, prefetch: int, asm: bool, table: str | None,
            m: int, k: int,
            num_experts: int, bm: int, bn: int, bk: int):
  """One (expert, N tile) program: see the module docstring. The weights carry a leading
  layer axis; layer_ref [1] names the layer read (in place: no copy of a layer's slice)."""
  if split:  # x's even and odd columns as two inputs, each [M, K // 2]
    x_refs, (*w_refs, o_ref) = refs[:2], refs[2:]
  else:
    x_refs, (*w_refs, o_ref) = refs[:1], refs[1:]
  dt = o_ref.dtype
  e = pl.program_id(0)
  lyr = layer_ref[0]
  n0 = pl.multiple_of(pl.program_id(1) * bn, bn)
  start = offs_ref[e]
  size = sizes_ref[e]
  end = jnp.minimum(start + size, m)
  row_iota = jnp.arange(bm, dtype=jnp.int32)[:, None]  # [bm, 1]
  xk = bk // 2 if split else bk  # x columns per K tile and input

  if fp4:
    codes_ref, bs_ref, ts_ref = w_refs
    kb = bk // NVFP4_BLOCK  # scale blocks per K tile

    def load_raw(t):  # words: K tile t's codes [bn, kb, 2] and scale bytes [bn, kb]
      kb0 = t * kb if isinstance(t, int) else pl.multiple_of(t * kb, kb)
      return (codes_ref[lyr, e, pl.ds(n0, bn), pl.ds(kb0, kb), :],
              jax.lax.bitcast_convert_type(bs_ref[lyr, e, pl.ds(n0, bn), pl.ds(kb0, kb)],
                                           jnp.uint8))

    def decode_raw(raw, ts, table):
      w0, w1 = jnp.unstack(raw[0], axis=-1)
      return (fp4_decode.decode_words(w0, w1, raw[1], dt, asm=asm, factors=ts, table=table,
                                      order=order),)

    def load_w(t, ts, table=None):
      if words:  # [bn, kb, 2] words: each block's 8 bytes, in the scales' [bn, kb] shape
        return decode_raw(load_raw(t), ts, table)
      kb0 = pl.multiple_of(t * kb, kb)
      scale = bs_ref[lyr, e, pl.ds(n0, bn), pl.ds(kb0, kb)]
      # A 2-D tile of whole contiguous rows (coalesced loads).
      p = codes_ref[lyr, e, pl.ds(n0, bn),
                    pl.ds(pl.multiple_of(t * (bk // 2), bk // 2), bk // 2)]
      if lut:  # per-block byte tables + prmt lookups (fp4_decode); ts: tensor_scale_factors
        bits = jax.lax.bitcast_convert_type(scale, jnp.uint8)
        lo, hi = fp4_decode.decode_blocks(p, bits, None, dt, asm=asm, factors=ts, table=table)
      else:
        # Viewed as [bn, kb, 8]: the bytes under each block scale on their own axis, so the
        # scales broadcast over it.
        p = p.reshape(bn, kb, _BYTES_PER_BLOCK)                              # uint8
        s = e4m3_value_scaled(scale)[:, :, None]
        lo, hi = e2m1_pair_scaled(p)                                         # elements 2i, 2i+1
        # formats.nvfp4_dequantize's order: code value * block scale, exact (the 2**-14 and
        # 2**14 factors cancel exactly), then * tensor scale, one float32 rounding; then dt.
        lo, hi = ((lo * s) * ts).astype(dt), ((hi * s) * ts).astype(dt)
      if split:
        return lo.reshape(bn, bk // 2), hi.reshape(bn, bk // 2)
      return (jnp.stack([lo.reshape(bn, bk // 2), hi.reshape(bn, bk // 2)], axis=-1
                        ).reshape(bn, bk),)
  else:
    (w_ref,) = w_refs

    def load_w(t, ts, table=None):
      del ts, table
      k0 = pl.multiple_of(t * bk, bk)
      return (w_ref[lyr, e, pl.ds(n0, bn), pl.ds(k0, bk)].astype(dt),)

  def matmul(ts, table):
    def row_block(r, carry):
      row0 = start + r * bm
      valid = (row0 + row_iota) < end                                       # [bm, 1]
      x_mask = jnp.broadcast_to(valid, (bm, xk))

      def k_step(t, acc, wts=None):
        k0 = pl.multiple_of(t * xk, xk)
        for x_ref, wt in zip(x_refs, load_w(t, ts, table) if wts is None else wts):
          xt = _masked_load(x_ref, (pl.ds(row0, bm), pl.ds(k0, xk)), x_mask, 0).astype(dt)
          a, b = (wt, xt) if swap_ab else (xt, wt)
          acc = acc + jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                                          preferred_element_type=jnp.float32)
        return acc

      zeros = jnp.zeros((bn, bm) if swap_ab else (bm, bn), jnp.float32)
      nk = k // bk
      depth = min(prefetch, nk) if words else 0
      if depth:  # tiles t + 1 .. t + depth's loads issued before tile t's decode and dot
        def k_step_prefetch(t, carry):
          acc, raws = carry
          nxt = load_raw(jnp.minimum(t + depth, nk - 1))
          return k_step(t, acc, decode_raw(raws[0], ts, table)), (*raws[1:], nxt)

        first = tuple(load_raw(i) for i in range(depth))
        acc, _ = jax.lax.fori_loop(0, nk, k_step_prefetch, (zeros, first))
      else:
        acc = jax.lax.fori_loop(0, nk, k_step, zeros)
      acc = acc.T if swap_ab else acc
      _masked_store(o_ref, (pl.ds(row0, bm), pl.ds(n0, bn)), acc.astype(dt),
                    jnp.broadcast_to(valid, (bm, bn)))
      return carry

    jax.lax.fori_loop(0, jax.lax.div(size + (bm - 1), bm), row_block, 0)

  @pl.when(size > 0)
  def _matmul():
    if not fp4:
      matmul(None, None)
    elif not (lut or words):
      matmul(ts_ref[lyr, e], None)
    else:  # the tensor scale's exact factors, once per program
      factors = fp4_decode.tensor_scale_factors(ts_ref[lyr, e])
      if jnp.dtype(dt) != jnp.dtype(jnp.bfloat16) or table is not None:
        matmul(factors, table or "exact")
      else:  # two copies of the loops: the fast table (every quantizer scale), or the exact
        pl.when(factors[0])(lambda: matmul(factors, "fast"))
        pl.when(jnp.logical_not(factors[0]))(lambda: matmul(factors, "exact"))

  total = offs_ref[num_experts - 1] + sizes_ref[num_experts - 1]

  pl.when((e == num_experts - 1) & (total < m))(lambda: zero_rows_past(o_ref, total, m, bm,
                                                                        n0, bn))


_STATIC = ("interpret", "block_m", "block_n", "block_k", "num_warps", "num_stages", "split",
           "swap_ab", "decoder", "table", "words_order", "prefetch", "debug")
IMPLS = ("triton", "wgmma")


def wgmma_supported(dtype: Any, w: Any) -> bool:
  """Whether impl="wgmma" takes rows of `dtype` times `w` here: packed weights held as words
  on a GPU with the Mosaic GPU API, bf16 rows, shapes `wgmma_moe.supported` takes. On the
  H200 (docs/benchmarks.md) its gate/up at batch 64 ran in 61.5-61.7 us against the Triton
  words kernel's 76.9-79.3, the 8-layer engine's fp4_rtn decode 1.054x faster."""
  if not isinstance(w, PackedNVFP4Weights) or not w.words:
    return False
  _, n, k = w.shape[-3:]
  return (jax.default_backend() == "gpu" and wgmma_decode.available()
          and wgmma_moe.supported(n, k, dtype))


def _tiles(n: int, k: int, block_n: int, block_k: int) -> tuple[int, int]:
  return _pow2_divisor(n, block_n), _pow2_divisor(k, block_k)


def resolve_decoder(decoder: str | None, dtype: Any, n: int, k: int, block_n: int, block_k: int,
                    num_warps: int, interpret: bool) -> str:
  """The packed-weight decoder a call uses. None: "table" (per-block byte tables and byte
  permutes; ~2.3x fewer static instructions per weight on sm_90) on the GPU for bf16/f16 rows
  on tiles it supports (`fp4_decode.choose`); else "float16" (`e2m1_pair_scaled`), always so
  in interpret mode, where XLA has
  no byte permute and the table decoder's emulation is the slower one."""
  bn, bk = _tiles(n, k, block_n, block_k)
  return fp4_decode.choose(decoder, "float16", dtype, bn, bk // 2, num_warps, interpret)


def _resolve_packed_decoder(w: PackedNVFP4Weights, decoder: str | None, dtype: Any, n: int,
                            k: int, block_n: int, block_k: int, num_warps: int,
                            interpret: bool) -> str:
  """Codes held as words take the "words" decoder (one table per block, `fp4_decode`); bytes
  take `resolve_decoder`'s."""
  if not w.words:
    if decoder == "words":
      raise ValueError("decoder='words' needs the codes as words (PackedNVFP4Weights.as_words)")
    return resolve_decoder(decoder, dtype, n, k, block_n, block_k, num_warps, interpret)
  if decoder not in (None, "words"):
    raise ValueError(f"codes held as words take decoder 'words' (or None), got {decoder!r}")
  if not fp4_decode.supported_dtype(dtype):
    raise ValueError(f"the words decoder produces bf16/f16 rows, got {jnp.dtype(dtype)}")
  if not interpret and not fp4_decode.ASM_AVAILABLE:
    raise ValueError("the words decoder needs Pallas' Triton inline assembly on the GPU")
  return "words"


@functools.partial(jax.jit, static_argnames=_STATIC)
def _decode(x, w, group_sizes, layer, *, interpret, block_m, block_n, block_k, num_warps,
            num_stages, split, swap_ab, decoder, table, words_order, prefetch, debug):
  m, k = x.shape
  fp4 = isinstance(w, PackedNVFP4Weights)
  if layer is None:  # one layer: a leading axis of 1 (a free reshape)
    w = jax.tree.map(lambda a: a[None], w)
    layer = jnp.zeros((), jnp.int32)
  e, n = (w.codes if fp4 else w).shape[1:3]
  if m == 0:
    return jnp.zeros((0, n), x.dtype)
  gs = group_sizes.astype(jnp.int32)
  offs = jnp.cumsum(gs) - gs
  bn, bk = _tiles(n, k, block_n, block_k)
  words = fp4 and w.words
  # dense weights: one dot per tile (a strided split does not lower); words: natural order
  split = split and fp4 and not words
  if split and bk < 32:
    raise ValueError(f"split=True needs K tiles of >= 32 columns; K={k} allows {bk}")
  # words: the tile's columns in the MMA operand order (`fp4_decode.mma_order`) where the K
  # tile allows it, x's columns permuted alike; split: x's even and odd columns. Either is one
  # small XLA copy of x per call.
  order = "mma" if words and bk % fp4_decode.MMA_ORDER_SPAN == 0 and words_order == "mma" \
      else "natural"
  if order == "mma":
    xs = (fp4_decode.mma_order_columns(x),)
  else:
    xs = (x[:, 0::2], x[:, 1::2]) if split else (x,)
  if fp4:
    weights = (w.codes, w.block_scale, w.tensor_scale)
  else:
    weights = (w,)
  kernel = functools.partial(_kernel, fp4=fp4, split=split, swap_ab=swap_ab,
                             lut=fp4 and decoder == "table", words=words, order=order,
                             prefetch=prefetch, asm=not interpret, table=table,
                             m=m, k=k, num_experts=e, bm=block_m, bn=bn, bk=bk)
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((m, n), x.dtype), grid=(e, n // bn),
      interpret=interpret, debug=debug,
      name="grouped_matmul_decode_fp4" if fp4 else "grouped_matmul_decode",
      compiler_params=None if interpret else _compiler_params(num_warps, num_stages),
  )(offs, gs, jnp.reshape(layer, (1,)).astype(jnp.int32), *xs, *weights)


def matmul_decode(x: jax.Array, w: jax.Array, *, layer: jax.Array | None = None,
                  **kw) -> jax.Array:
  """x [M, K] times one dense weight w [N, K] -> [M, N], as one "expert" of
  `grouped_matmul_decode` (its grid spreads N over the GPU); with `layer`, w is a stack
  [L, N, K] read at that layer in place."""
  stacked = jnp.expand_dims(w, 0 if layer is None else 1)
  return grouped_matmul_decode(x, stacked, jnp.full((1,), x.shape[0], jnp.int32), layer=layer,
                               **kw)


def grouped_matmul_decode(x: jax.Array, w: jax.Array | PackedNVFP4Weights,
                          group_sizes: jax.Array, *, layer: jax.Array | None = None,
                          interpret: bool | None = None,
                          block_m: int | None = None, block_n: int | None = None,
                          block_k: int = 256,
                          num_warps: int = 4, num_stages: int = 3, split: bool | None = None,
                          swap_ab: bool | None = None, debug: bool = False,
                          decoder: str | None = None, table: str | None = None,
                          words_order: str = "mma", prefetch: int | None = None,
                          impl: str | None = None) -> jax.Array:
  """Rows x [M, K] sorted by expert times w [E, N, K] (dense or packed NVFP4) -> [M, N].

  layer: with it, w holds a stack of layers ([L, E, N, K]; packed: every field with a leading
  L) and the kernel reads layer `layer` (int32 scalar, may be traced: a scan over layers) in
  place, where slicing the stack first would copy the layer's weights at every call.

  interpret: None runs the Triton kernel on GPU and the Pallas interpreter elsewhere.
  block_m: rows per block (None: `default_block_m`); block_n / block_k: output / contraction
  tile caps, each reduced to the largest power of two dividing N / K (N and K must be
  multiples of 16); block_n None: 64, on the GPU `default_block_n` (smaller for few
  experts). num_warps / num_stages: Triton launch parameters.
  split: packed weights only: contract even and odd columns as two dots (x split outside the
  kernel) instead of interleaving the two nibbles of each byte in registers. None: True for
  the table decoder (its natural output; K tiles of >= 32), False otherwise.
  swap_ab: compute each output tile transposed, weights as the MMA's first operand (M = the
  weight tile's rows) and x rows as its N; the same products. None: True for packed weights
  (fewer instructions per weight in Triton 3.6's sm_90 code), False for dense ones.
  decoder: packed weights only: "table", "float16" or None (`resolve_decoder`); codes held as
  words take "words" (None picks it).
  table: decoder "table" only: None picks the fast or exact table per expert from its tensor
  scale; "exact" always takes the exact one (any scale; for tests); "fast" always the fast
  one (exact only for tensor scales in `fp4_decode.tensor_scale_factors`' fast range).
  words_order: codes held as words: "mma" (K tiles of >= 64 columns) lays each decoded tile
  out in the MMA operand order (`fp4_decode.mma_order`, x's columns permuted alike) so each
  block stays in the thread that decodes it; "natural" keeps the columns in order.
  prefetch: codes held as words: how many K tiles ahead the codes and scales are loaded (into
  registers) before tile t is decoded, so their latency overlaps the decode; 0 (or False)
  loads each tile where it is decoded. True counts as 1. None: 1 (Triton), `wgmma_moe.PREFETCH`
  K chunks of 128 (wgmma).
  impl: "triton" (the Pallas kernel above), "wgmma" (packed words on a Hopper GPU, bf16, N a
  multiple of 64 and K of 128: `wgmma_moe`, the weights decoded into wgmma's A registers;
  block_m is its rows per pass, a multiple of 8 up to `wgmma_moe.MAX_ROWS`, default
  `wgmma_moe.default_rows`; table None or "exact": the exact table, "fast" the fast one; the
  Triton launch parameters do not apply) or None: "triton". The model passes its plan's
  choice (`trace_jax.model.plan`).
  """
  if impl not in (None, *IMPLS):
    raise ValueError(f"impl must be one of {IMPLS} or None, got {impl!r}")
  prefetch = None if prefetch is None else int(prefetch)
  if prefetch is not None and prefetch < 0:
    raise ValueError(f"prefetch must be >= 0 K tiles, got {prefetch}")
  if words_order not in ("mma", "natural"):
    raise ValueError(f"words_order must be 'mma' or 'natural', got {words_order!r}")
  if x.ndim != 2:
    raise ValueError(f"grouped_matmul_decode: x must be [M, K], got {x.shape}")
  if x.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
    raise TypeError(f"grouped_matmul_decode: x dtype must be bf16, f16 or f32, got {x.dtype}")
  lead = 0 if layer is None else 1
  if isinstance(w, PackedNVFP4Weights):
    check_packed(w, stacked=layer is not None)
  elif w.ndim != 3 + lead:
    raise ValueError(f"grouped_matmul_decode: w must be [{'L, ' * lead}E, N, K], got {w.shape}")
  if layer is not None and jnp.shape(layer) != ():
    raise ValueError(f"grouped_matmul_decode: layer must be a scalar, got {jnp.shape(layer)}")
  e, n, k = w.shape[lead:]
  if k != x.shape[1]:
    raise ValueError(f"grouped_matmul_decode: x {x.shape} and w {w.shape} disagree on K")
  if group_sizes.shape != (e,):
    raise ValueError(f"grouped_matmul_decode: group_sizes must be [{e}], got "
                     f"{group_sizes.shape}")
  if n % 16 or k % 16:
    raise ValueError(f"grouped_matmul_decode: N={n} and K={k} must be multiples of 16")
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  packed = isinstance(w, PackedNVFP4Weights)
  wgmma_ok = (packed and w.words and not interpret and jax.default_backend() == "gpu"
              and wgmma_decode.available() and wgmma_moe.supported(n, k, x.dtype))
  if impl is None:
    impl = "triton"
  if impl == "wgmma":
    if not wgmma_ok:
      raise ValueError("impl='wgmma' needs packed weights held as words on a Hopper GPU, bf16 "
                       f"rows, N a multiple of {wgmma_decode.TILE} and K of "
                       f"{wgmma_decode.SPAN}; got x {x.shape} {x.dtype}, w {w.shape}")
    if table not in (None, *wgmma_decode.TABLES):
      raise ValueError(f"table must be one of {wgmma_decode.TABLES} or None, got {table!r}")
    rows = wgmma_moe.default_rows(x.shape[0], e) if block_m is None else block_m
    if rows % 8 or not 8 <= rows <= wgmma_moe.MAX_ROWS:
      raise ValueError(f"impl='wgmma' takes block_m (rows per pass) a multiple of 8 in "
                       f"[8, {wgmma_moe.MAX_ROWS}], got {rows}")
    if x.shape[0] == 0:
      return jnp.zeros((0, n), x.dtype)
    if layer is None:  # one layer: a leading axis of 1 (a free reshape)
      w, layer = jax.tree.map(lambda a: a[None], w), jnp.zeros((), jnp.int32)
    return wgmma_moe.grouped_matmul(
        x, w.codes, w.block_scale, w.tensor_scale, group_sizes, layer, rows=rows,
        table=table or "exact", prefetch=wgmma_moe.PREFETCH if prefetch is None else prefetch,
        stream=wgmma_moe.STREAM if k % 256 == 0 else 0, group=wgmma_moe.GROUP)
  block_m = default_block_m(x.shape[0], e) if block_m is None else block_m
  if block_n is None:  # the interpreter runs programs one by one: fewer, larger tiles there
    block_n = 64 if interpret else default_block_n(n, e)
  _check_block("block_m", block_m, 16)
  _check_block("block_n", block_n, 16)
  _check_block("block_k", block_k, 16)
  if swap_ab is None:
    swap_ab = packed
  decoder = _resolve_packed_decoder(w, decoder, x.dtype, n, k, block_n, block_k, num_warps,
                                    bool(interpret)) if packed else "float16"
  if split is None:  # the table decoder's natural output: even and odd elements apart
    split = packed and decoder == "table" and _tiles(n, k, block_n, block_k)[1] >= 32
  return _decode(x, w, group_sizes, layer, interpret=bool(interpret), block_m=block_m,
                 block_n=block_n, block_k=block_k, num_warps=num_warps,
                 num_stages=num_stages, split=bool(split), swap_ab=bool(swap_ab),
                 decoder=decoder, table=table, words_order=words_order,
                 prefetch=1 if prefetch is None else prefetch, debug=debug)
