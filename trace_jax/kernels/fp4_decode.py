"""In-register NVFP4 decode for the Pallas kernels: per-block byte tables and byte permutes.

The weights a kernel multiplies must be `formats.nvfp4_dequantize`'s, bit for bit:
`w = dtype((code_value * block_scale) * tensor_scale)`, the first product exact in float32, the
second rounded once to float32, then one rounding to the compute dtype (bf16 or f16). Within
one block of 16 elements only the code varies: its value is +-v_m for one of 8 magnitudes
v_m in {0, .5, 1, 1.5, 2, 3, 4, 6}. So this decoder computes, once per block, the 8 16-bit
results T[m] = dtype(RN(v_m * bs * ts)), splits them into a table of their low bytes and one of
their high bytes (two 32-bit registers each), and decodes every code with byte permutes (PTX
`prmt`): one `prmt` looks up 4 codes' bytes at once, the code's 3 magnitude bits being the
byte index. The code's sign flips the result's sign bit (IEEE products and roundings are
sign-symmetric: T[c | 8] = T[c] ^ 0x8000, signed zeros included; NaN stays NaN).

Cost (Triton 3.6, sm_90 SASS, compiled offline from the kernels' Triton IR after Triton's
`make_ttir` passes, as XLA runs them; counts are per thread and exact, from the loop bodies):
  per 8 codes (one 32-bit word): 1 LOP3 + 1 SHF (indices), 4 PRMT (lookups), 1 SHF + 2 PRMT +
  2 LOP3 (signs), 4 PRMT (low/high bytes into bf16 pairs): 15, i.e. 1.9 per element;
  per block of 16, the fast table: 1 PRMT + F2FP.E4M3 + HADD2 (scale byte -> float32), 3 FMUL
  (P = bs * ts, 1.5 bs, Q = 1.5 bs * ts), 1 F2FP (pair [p q]), 3 HMUL2.BF16 ([p/2, 0*q],
  2 [p q], 4 [p q]), 4 PRMT (split): 14, 0.9 per element; the exact table: 21 (1.3).
  The float16 bit trick it replaces (`fp4_moe.e2m1_pair_scaled`) costs ~8 per element plus
  ~20 per block. In the MoE kernel's K loop (64 x 256 tile, 4 warps): 521 instructions per
  thread and tile = 4.1 per weight, against 1228 = 9.6 before (the BF16 kernel's loop: 1.4).

Exactness (docs/numerics.md's order). The reference is RN(RN(v * bs) * ts) = RN(v * bs * ts):
v * bs is exact (<= 6 significant bits, magnitude in [2**-10, 2688], or 0 / NaN). Write v as
2**k or 1.5 * 2**k.
- Exact table (any ts; f16; extreme tensor scales): entries RN(bs' * (2**k * ts')) and
  RN((1.5 * bs') * (2**k * ts')) with ts' = ts * 2**c, bs' = bs * 2**-c for a power of two
  2**c per tensor scale (c = 0 unless |ts| < 2**-125: c = 24, or 2**126 <= |ts| < inf:
  c = -2). Every factor is exact (1.5 * bs' has <= 5 significant bits and stays normal;
  2**k * ts' with |ts'| in [2**-125, 2**126) neither underflows nor overflows), so each entry
  is the single rounding of the same real number as the reference's, with its sign; 0, NaN and
  infinite scales give what the reference gives (code 0's entry is bs' * (0 * ts'): the signed
  zero, or NaN for a NaN block scale or an infinite/NaN tensor scale, as (0 * bs) * ts). Then
  `cvt.rn.{bf16,f16}x2.f32` rounds to the dtype (nearest even, as `astype`).
- Fast table (bf16, when |ts| is 0, infinite, NaN or in [2**-116, 2**118): every tensor scale
  the quantizer makes, `tensor_scale_factors`): P = RN(bs * ts) and Q = RN(1.5 bs * ts) are
  the reference's entries for v = 1 and 1.5; p, q = bf16(P), bf16(Q). For every nonzero block
  scale (|bs| in [2**-9, 448]) |bs * ts| lies in [2**-125, 2**127), so P, Q and P / 2 are
  normal and finite, and scaling by a power of two commutes with both roundings:
  bf16(RN(2**k Z)) = 2**k bf16(RN(Z)) for k in -1..2 (the overflow thresholds scale the same
  way, so an entry that overflows to inf does so on both sides). The bf16 products p / 2,
  2p, 4p, 2q, 4q are exact (or the same inf), and 0 * q is code 0's signed zero (q has the
  sign of bs * ts; 0 * inf = NaN where ts is infinite, as the reference). Zero and NaN block
  scales propagate through the products unchanged. Outside that range a branch (per program
  in the MoE kernel, per key tile in attention) takes the exact table.
`tests/kernels/test_fp4_decode.py` checks both tables against `formats` for every code byte
under every scale byte, at and beyond the fast range's bounds.

Where it runs: on the GPU the pieces that need byte permutes or packed conversions are PTX
inline assembly (`pallas.triton.elementwise_inline_asm`, present with this signature in jax
0.10 and 0.11). With `asm=False` (interpret mode, CPU) the same instruction programs run as jnp
integer ops on the same bit patterns (`prmt` emulated from the PTX definition), so the CPU
tests check the algorithm; only the PTX instructions' own semantics are the GPU's. Pallas
lowers one result per inline-asm statement, so each table / result register is its own
statement holding the whole program: ptxas removes the unused parts and merges the
duplicates (the counts above are after that).

Layout: the codes are held as words per block (`to_words`: a block's 8 code bytes as two
little-endian uint32 words), so a tile of words [R, kb] has the block scales' shape [R, kb]
and, whatever register layout Triton gives it, each block's table is built by the one thread
that decodes it (`decode_words`). The decoder that looked codes up as bytes needed 4
consecutive bytes of one block per thread, rebuilt each table in 4 threads, and failed the
packed attention's check at 8k contexts on the H200; it is gone (the git history of
docs/benchmarks.md).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.quant import exact

try:  # Triton-specific Pallas API (jax >= 0.4.31)
  from jax.experimental.pallas import triton as _plgpu
except ImportError:  # pragma: no cover
  _plgpu = None

ASM_AVAILABLE = _plgpu is not None and hasattr(_plgpu, "elementwise_inline_asm")
BLOCK = 16
_U32 = jnp.uint32
_DTYPES = (jnp.bfloat16, jnp.float16)  # compute dtypes the table decoder produces


def supported_dtype(dtype: Any) -> bool:
  """True for the compute dtypes of the table decoder (2-byte floats)."""
  return jnp.dtype(dtype) in tuple(jnp.dtype(d) for d in _DTYPES)


def _u32(x: int) -> np.uint32:
  return np.uint32(x)


# ----------------------------------------------------------------------------- prmt, in jnp

def prmt_jnp(a: jax.Array, b: jax.Array, sel: jax.Array | int) -> jax.Array:
  """PTX `prmt.b32 d, a, b, sel` (generic form) on uint32 arrays: byte i of d is byte
  sel[4i+2:4i] of {b, a} (a = bytes 0..3, b = bytes 4..7), or that byte's sign replicated
  when bit 4i+3 of sel is set. Bits 16..31 of sel are ignored."""
  a, b = a.astype(_U32), b.astype(_U32)
  sel = jnp.asarray(sel, jnp.int32) if isinstance(sel, int) else sel.astype(jnp.int32)
  out = jnp.zeros(jnp.broadcast_shapes(a.shape, b.shape, jnp.shape(sel)), _U32)
  for i in range(4):
    ctl = (sel >> (4 * i)) & 0xF
    pos = (ctl & 3).astype(_U32) * _u32(8)
    byte = jnp.where((ctl & 4) != 0, b >> pos, a >> pos) & _u32(0xFF)
    byte = jnp.where((ctl & 8) != 0, jnp.where(byte >= 0x80, _u32(0xFF), _u32(0)), byte)
    out = out | (byte << _u32(8 * i))
  return out


# ----------------------------------------------------------------------------- tiny programs
# Each program below is written once against an "ops" object: `JnpOps` runs it on uint32 jnp
# arrays (the interpret-mode path and the tests), `PtxOps` renders it as PTX for the GPU.

_BF16 = jnp.dtype(jnp.bfloat16)


def _is_bf16(dtype: Any) -> bool:
  return jnp.dtype(dtype) == _BF16


class JnpOps:
  """Executes a decode program on uint32 jnp arrays (float inputs: float32 arrays)."""

  def __init__(self, dtype: Any = jnp.bfloat16):
    self.dtype = jnp.dtype(dtype)

  @staticmethod
  def and_(a, imm: int):
    return a & _u32(imm)

  @staticmethod
  def shr(a, n: int):
    return a >> _u32(n)

  @staticmethod
  def shl(a, n: int):
    return a << _u32(n)

  @staticmethod
  def xor_and(a, b, imm: int):  # a ^ (b & imm): one LOP3
    return a ^ (b & _u32(imm))

  @staticmethod
  def prmt(a, b, sel):
    return prmt_jnp(a, b, sel)

  def _bits(self, x):
    return jax.lax.bitcast_convert_type(x.astype(self.dtype), jnp.uint16).astype(_U32)

  def cvt2(self, hi, lo):  # cvt.rn.{bf16,f16}x2.f32 d, hi, lo: d = [lo | hi << 16]
    return self._bits(lo) | (self._bits(hi) << _u32(16))

  def mul2(self, a, c: int):  # mul.rn.{bf16,f16}x2 by the constant pair c
    def half(x, shift):
      v = ((x >> _u32(shift)) & _u32(0xFFFF)).astype(jnp.uint16)
      return jax.lax.bitcast_convert_type(v, self.dtype)
    lo = half(a, 0) * half(jnp.asarray(_u32(c)), 0)
    hi = half(a, 16) * half(jnp.asarray(_u32(c)), 16)
    return self._bits(lo) | (self._bits(hi) << _u32(16))


class PtxOps:
  """Renders a decode program as PTX; values are register names."""

  def __init__(self, dtype: Any = jnp.bfloat16):
    self.lines: list[str] = []
    self.n = 0
    self.suffix = "bf16x2" if _is_bf16(dtype) else "f16x2"

  def _tmp(self) -> str:
    self.n += 1
    return f"%t{self.n}"

  def _emit(self, fmt: str, *args) -> str:
    d = self._tmp()
    self.lines.append(fmt.format(d, *args))
    return d

  def and_(self, a, imm):
    return self._emit("and.b32 {}, {}, {};", a, hex(imm))

  def shr(self, a, n):
    return self._emit("shr.b32 {}, {}, {};", a, n)

  def shl(self, a, n):
    return self._emit("shl.b32 {}, {}, {};", a, n)

  def xor_and(self, a, b, imm):
    t = self._emit("and.b32 {}, {}, {};", b, hex(imm))
    return self._emit("xor.b32 {}, {}, {};", a, t)

  def prmt(self, a, b, sel):
    return self._emit("prmt.b32 {}, {}, {}, {};", a, b, hex(sel) if isinstance(sel, int) else sel)

  def cvt2(self, hi, lo):
    return self._emit(f"cvt.rn.{self.suffix}.f32 {{}}, {{}}, {{}};", hi, lo)

  def mul2(self, a, c: int):
    k = self._emit("mov.b32 {}, {};", hex(c))
    return self._emit(f"mul.rn.{self.suffix} {{}}, {{}}, {{}};", a, k)

  def render(self, outputs: Sequence[str], results: Sequence[str]) -> str:
    body = [f".reg .b32 %t<{self.n + 1}>;", *self.lines]
    body += [f"mov.b32 {r}, {v};" for r, v in zip(outputs, results)]
    return "{\n" + "\n".join(body) + "\n}"


def lookup_program(o, w, tabs_a, tabs_b):
  """Codes word w (4 bytes = 8 codes, nibble i = element i) -> (lo01, lo23, hi01, hi23):
  16-bit pairs [T(low nibble of byte j), T(low nibble of byte j+1)] for j = 0, 2 and the
  same for the high nibbles. tabs_a (bytes 0, 1) and tabs_b (bytes 2, 3) are (TL0, TL1, TH0,
  TH1): the low / high bytes of T[0..3] and of T[4..7]."""
  tl0a, tl1a, th0a, th1a = tabs_a
  tl0b, tl1b, th0b, th1b = tabs_b
  idx = o.and_(w, 0x77777777)  # magnitudes: byte indices (prmt reads the low 16 bits)
  idxh = o.shr(idx, 16)
  w4 = o.shl(w, 4)  # even codes' sign bits at bit 7 of each byte, as the odd codes' in w
  l0 = o.prmt(tl0a, tl1a, idx)  # [L(n0), L(n1), L(n2), L(n3)]
  h0 = o.prmt(th0a, th1a, idx)
  l1 = o.prmt(tl0b, tl1b, idxh)  # [L(n4) .. L(n7)]
  h1 = o.prmt(th0b, th1b, idxh)
  # Sign bits of n0..n3 (w bits 3, 7, 11, 15) -> bits 7, 15, 23, 31 of the high bytes.
  h0 = o.xor_and(h0, o.prmt(w, w4, 0x1504), 0x80808080)
  h1 = o.xor_and(h1, o.prmt(w, w4, 0x3726), 0x80808080)
  return (o.prmt(l0, h0, 0x6240), o.prmt(l1, h1, 0x6240),  # [L H](n0), [L H](n2) ...
          o.prmt(l0, h0, 0x7351), o.prmt(l1, h1, 0x7351))  # [L H](n1), [L H](n3) ...


def split_program(o, p01, p23, p45, p67):
  """16-bit pairs [T0 T1] .. [T6 T7] -> (TL0, TL1, TH0, TH1)."""
  return (o.prmt(p01, p23, 0x6420), o.prmt(p45, p67, 0x6420),
          o.prmt(p01, p23, 0x7531), o.prmt(p45, p67, 0x7531))


def exact_table_program(o, *y):
  """The 8 float32 entries y0..y7 -> (TL0, TL1, TH0, TH1): 4 packed conversions, 4 permutes."""
  return split_program(o, *(o.cvt2(y[2 * i + 1], y[2 * i]) for i in range(4)))


# bf16 pairs [lo | hi << 16] of the constant factors of the fast table
_BF16_HALF_0 = 0x00003F00  # [0.5, 0.0]
_BF16_2_2 = 0x40004000  # [2.0, 2.0]
_BF16_4_4 = 0x40804080  # [4.0, 4.0]


def fast_table_program(o, big_p, big_q):
  """bf16 tables from P = RN(bs * ts) and Q = RN(1.5 * bs * ts) (float32): the other entries
  are p / 2, 0 * q (the signed zero, or NaN, of code 0: q has p's sign and NaN-ness) and the
  pair [p q] times 2 and 4, exact in bf16 when no value is subnormal (`tensor_scale_factors`).
  1 conversion, 3 packed bf16 multiplies, 4 permutes."""
  pq = o.cvt2(big_q, big_p)  # [T2 T3] = [p q]
  t10 = o.mul2(pq, _BF16_HALF_0)  # [p / 2, 0 * q] = [T1 T0]
  t45, t67 = o.mul2(pq, _BF16_2_2), o.mul2(pq, _BF16_4_4)
  return (o.prmt(t10, pq, 0x6402), o.prmt(t45, t67, 0x6420),
          o.prmt(t10, pq, 0x7513), o.prmt(t45, t67, 0x7531))


# Pallas' lowering of `elementwise_inline_asm` returns one result (jax 0.10.2 and 0.11: a
# multi-result op is wrapped as a single value), so each output is its own asm statement
# holding the whole program; ptxas removes the unused parts and merges the duplicates (the
# SASS counts in the module docstring are after that).

def _asm_table_text(program, n_in: int, dtype: Any, which: int) -> str:
  """Table `which` (0: TL0, 1: TL1, 2: TH0, 3: TH1) of `program` from inputs $1..$n_in."""
  o = PtxOps(dtype)
  res = program(o, *(f"${1 + i}" for i in range(n_in)))
  return o.render(["$0"], res[which:which + 1])


def _run_table(program, args: Sequence[jax.Array], dtype: Any, asm: bool) -> tuple:
  if not asm:
    return program(JnpOps(dtype), *args)
  shape = jax.ShapeDtypeStruct(args[0].shape, jnp.int32)  # asm results must be signless
  return tuple(_plgpu.elementwise_inline_asm(
      _asm_table_text(program, len(args), dtype, i), args=list(args),
      constraints="=r," + ",".join(["f"] * len(args)), pack=1,
      result_shape_dtypes=[shape])[0] for i in range(4))


# ----------------------------------------------------------------------------- public pieces

def e4m3_to_f32(bits: jax.Array, *, asm: bool) -> jax.Array:
  """float32 values of E4M3 scale bytes (int/uint array of 0..255), exactly `exact.e4m3_value`
  (NaN for 0x7F/0xFF). asm: the GPU's `cvt.rn.f16x2.e4m3x2` (exact), then float16 -> float32.
  One byte per statement: converting two at once (pack=2) made Triton 3.6 move the whole
  decode into the dot operand's layout, where 4 threads share a block and each recomputes
  its table (4x the per-block work; measured in the SASS)."""
  if not asm:
    return exact.e4m3_value(jax.lax.bitcast_convert_type(bits.astype(jnp.uint8),
                                                         jnp.float8_e4m3fn))
  text = ("{\n.reg .b32 %t;\n.reg .b16 %l, %h;\ncvt.rn.f16x2.e4m3x2 %t, $1;\n"
          "mov.b32 {%l, %h}, %t;\ncvt.f32.f16 $0, %l;\n}")
  [out] = _plgpu.elementwise_inline_asm(
      text, args=[bits.astype(jnp.uint16)], constraints="=f,h", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(bits.shape, jnp.float32)])
  return out


def tensor_scale_factors(ts: jax.Array) -> tuple[jax.Array, ...]:
  """Per tensor scale (float32, any shape): (fast, ts, inv, t0, t_half, t1, t2, t4).

  fast: whether the bf16 fast table is exact for every block scale byte: ts is 0, infinite
  or NaN, or 2**-116 <= |ts| < 2**118 (then every nonzero |bs * ts| lies in [2**-125, 2**127),
  so no entry, half entry or float32 product is subnormal or overflows). The rest serve the
  exact table: inv = 2**-c, t_k = 2**k * ts' with ts' = ts * 2**c (module docstring; c = 0
  unless |ts| < 2**-125 or 2**126 <= |ts| < inf), t0 = 0 * ts'. All exact."""
  ts = ts.astype(jnp.float32)
  a = jnp.abs(ts)
  fast = ((a >= np.float32(2.0**-116)) & (a < np.float32(2.0**118))) | (a == 0) | \
      ~(a < np.float32(np.inf))  # inf or NaN
  small = (a > 0) & (a < np.float32(2.0**-125))
  big = (a >= np.float32(2.0**126)) & (a < np.float32(np.inf))
  scale = jnp.where(small, np.float32(2.0**24), jnp.where(big, np.float32(0.25), np.float32(1)))
  inv = jnp.where(small, np.float32(2.0**-24), jnp.where(big, np.float32(4.0), np.float32(1)))
  t1 = ts * scale
  return (fast, ts, inv, t1 * np.float32(0.0), t1 * np.float32(0.5), t1, t1 * np.float32(2.0),
          t1 * np.float32(4.0))


def exact_entries(bs: jax.Array, factors: Sequence[jax.Array]) -> list[jax.Array]:
  """The 8 float32 table entries RN(v_m * bs * ts), m = 0..7, of block scales bs (float32);
  factors from `tensor_scale_factors`, broadcastable against bs."""
  _, _, inv, t0, th, t1, t2, t4 = factors
  b = bs * inv  # bs * 2**-c, exact
  b15 = bs * (inv * np.float32(1.5))  # 1.5 * bs * 2**-c, exact
  return [b * t0, b * th, b * t1, b15 * t1, b * t2, b15 * t2, b * t4, b15 * t4]


TABLES = ("fast", "exact")


def block_tables(bs: jax.Array, factors: Sequence[jax.Array], dtype: Any, *, asm: bool,
                 table: str | None = None) -> tuple[jax.Array, ...]:
  """(TL0, TL1, TH0, TH1), each bs.shape: the low and high bytes of the 8 entries
  dtype(RN(v_m * bs * ts)) of block scales bs (float32), as 32-bit words (uint32 in jnp,
  int32 from the inline assembly). table: "fast" (bf16 only; exact where `factors`' `fast`
  holds, the caller's promise), "exact", or None: bf16 takes the fast table where `fast`
  holds for the whole tile (one branch per tile) and the exact one otherwise, f16 the exact
  one."""
  exact = lambda b: _run_table(exact_table_program, exact_entries(b, factors), dtype, asm)
  if table not in (None, *TABLES):
    raise ValueError(f"table must be one of {TABLES} or None, got {table!r}")
  if table == "exact" or not _is_bf16(dtype):
    return exact(bs)
  fast, ts = factors[0], factors[1]

  def fast_tables(b):
    return _run_table(fast_table_program, [b * ts, (b * np.float32(1.5)) * ts], dtype, asm)

  if table == "fast":
    return fast_tables(bs)
  if jnp.ndim(fast):  # per-row scales: one branch for the tile (Pallas lowers no reduce_and)
    fast = jnp.min(fast.astype(jnp.int32)) > 0
  out = jax.lax.cond(fast, fast_tables, exact, bs)
  return tuple(out)


# ----------------------------------------------------------------------------- word layout
# One block's 16 codes are 8 bytes: two 32-bit words w0 (elements 0..7) and w1 (8..15). With
# the codes held as words, a tile of words [R, kb] has exactly the block scales' shape [R, kb],
# so whatever register layout Triton gives the tile, each block's table is built by the one
# thread that decodes the block (in the byte layout, after the scales are broadcast over the
# bytes, Triton moved the decode into the MMA operand's layout, where 4 threads share a block
# and each rebuilt its table: the git history of docs/benchmarks.md).


def _word_element(j: int) -> tuple[int, int, int]:
  """Element j (0..15) of a block -> (word, result of `lookup_program`, 16-bit half)."""
  word, e = divmod(j, 8)
  # lookup_program's results: (lo01, lo23, hi01, hi23) = pairs [e0 e2], [e4 e6], [e1 e3],
  # [e5 e7] of the word's 8 elements.
  return word, 2 * (e % 2) + e // 4, (e // 2) % 2


def _asm_word_text(j: int) -> str:
  """PTX of element j of each block: operands $0 (the 16-bit result), $1 w0, $2 w1, then
  TL0, TL1, TH0, TH1 ($3..$6)."""
  o = PtxOps()
  word, res, half = _word_element(j)
  tabs = ("$3", "$4", "$5", "$6")
  pair = lookup_program(o, f"${1 + word}", tabs, tabs)[res]
  return o.render([], []).replace(
      "\n}", f"\n{{\n.reg .b16 %lo, %hi;\nmov.b32 {{%lo, %hi}}, {pair};\n"
      f"mov.b16 $0, {'%hi' if half else '%lo'};\n}}\n}}")


def bitrev4(j: int) -> int:
  """The 4-bit bit reversal (the order in which a tree of 2-way stacks lays out 16 leaves)."""
  return int(f"{j:04b}"[::-1], 2)


def words_lookup(w0: jax.Array, w1: jax.Array, tabs: Sequence[jax.Array], dtype: Any, *,
                 asm: bool) -> jax.Array:
  """[R, kb, 16] in dtype: the decoded elements of blocks whose codes are the words w0, w1
  (uint32 [R, kb]), tables (TL0, TL1, TH0, TH1) of the same shape."""
  if not asm:
    o = JnpOps(dtype)
    outs = [lookup_program(o, w, tuple(tabs), tuple(tabs)) for w in (w0, w1)]
    els = []
    for j in range(16):
      word, res, half = _word_element(j)
      els.append(((outs[word][res] >> _u32(16 * half)) & _u32(0xFFFF)).astype(jnp.uint16))
    return jax.lax.bitcast_convert_type(jnp.stack(els, axis=-1), dtype)
  args = [w0.astype(jnp.int32), w1.astype(jnp.int32), *(t.astype(jnp.int32) for t in tabs)]
  shape = jax.ShapeDtypeStruct(w0.shape, jnp.int16)
  els = [jax.lax.bitcast_convert_type(_plgpu.elementwise_inline_asm(
      _asm_word_text(j), args=args, constraints="=h," + ",".join(["r"] * 6), pack=1,
      result_shape_dtypes=[shape])[0], dtype) for j in range(16)]
  # A tree of 2-way stacks (Triton `join`: each adds a trailing axis of 2) puts leaf i at
  # position bitrev4(i) of the last 16 after the reshape: leaf i = element bitrev4(i).
  level = [els[bitrev4(i)] for i in range(16)]
  while len(level) > 1:
    level = [jnp.stack([level[2 * i], level[2 * i + 1]], axis=-1)
             for i in range(len(level) // 2)]
  return level[0].reshape(w0.shape + (16,))


def decode_words(w0: jax.Array, w1: jax.Array, block_bits: jax.Array, dtype: Any, *,
                 asm: bool, factors: Sequence[jax.Array], table: str | None = None,
                 order: str = "natural") -> jax.Array:
  """[R, 16 * kb] in dtype: `formats.nvfp4_dequantize(...)` bit for bit of blocks held as code
  words w0, w1 (uint32 [R, kb]: elements 0..7 and 8..15, element 2i in the low nibble of byte
  i) with block-scale bytes [R, kb] (E4M3 bits) and the tensor scale's `tensor_scale_factors`.
  order: "natural" element order, or "mma" (`mma_order`, kb a multiple of 4). table: as in
  `block_tables` (None: one fast/exact branch)."""
  bs = e4m3_to_f32(block_bits, asm=asm)
  tabs = block_tables(bs, factors, dtype, asm=asm, table=table)
  r, kb = w0.shape
  out = words_lookup(w0, w1, tabs, dtype, asm=asm)
  return mma_order(out) if order == "mma" else out.reshape(r, 16 * kb)


# The MMA operand order of a words tile. On sm_90 (wgmma A and mma.sync A/B fragments of 16-bit
# operands) lane t = lane % 4 of a quad holds, in every 16 columns of the contraction, columns
# 2t, 2t + 1, 2t + 8 and 2t + 9. Within each 64 columns, natural column 16 b + 4 s + 2 h + j
# (block b = 0..3, element 4 s + 2 h + j) goes to tile column 16 s + 8 h + 2 b + j: the 16
# elements of block b all land on lane b's columns, so the lane that decodes a block (one
# table) is the lane whose MMA fragment holds it, and no element moves between threads. The
# rows x the tile meets take the same permutation (`mma_order_columns`).
MMA_ORDER_SPAN = 64


def mma_order(tile: jax.Array) -> jax.Array:
  """[R, kb, 16] decoded blocks (natural element order) -> [R, 16 kb] in the MMA order."""
  r, kb, _ = tile.shape
  return tile.reshape(r, kb // 4, 4, 4, 2, 2).transpose(0, 1, 3, 4, 2, 5).reshape(r, 16 * kb)


def mma_order_columns(x: jax.Array) -> jax.Array:
  """x [..., K] (K a multiple of 64) with its columns in `mma_order`'s order: a gather of
  constant columns, which XLA fuses with the caller's row gather (the dispatch's
  `xq[order // k]`) as a gather rather than a transpose."""
  k = x.shape[-1]
  if k % MMA_ORDER_SPAN:
    raise ValueError(f"mma_order_columns: K={k} is not a multiple of {MMA_ORDER_SPAN}")
  return jnp.take(x, _mma_columns(k), axis=-1, unique_indices=True, mode="clip")


@functools.cache
def _mma_columns(k: int) -> np.ndarray:
  """Tile column c of `mma_order` holds natural column [c] of this permutation of range(k)."""
  return np.arange(k, dtype=np.int32).reshape(k // 64, 4, 4, 2, 2).transpose(
      0, 2, 3, 1, 4).reshape(k)


def to_words(codes: jax.Array) -> jax.Array:
  """Packed code bytes [..., K // 2] (uint8) -> uint32 words [..., K // 16, 2] (little-endian:
  byte 4i + b is byte b of word i, as the GPU reads them)."""
  *lead, half = codes.shape
  if half % (BLOCK // 2):
    raise ValueError(f"to_words: {half} code bytes per row is not a whole number of blocks")
  b = codes.astype(jnp.uint32).reshape(*lead, half // 8, 2, 4)
  return (b[..., 0] | (b[..., 1] << _u32(8)) | (b[..., 2] << _u32(16))
          | (b[..., 3] << _u32(24)))


def from_words(words: jax.Array) -> jax.Array:
  """The inverse of `to_words`: uint32 [..., kb, 2] -> uint8 [..., 8 * kb]."""
  *lead, kb, two = words.shape
  if two != 2:
    raise ValueError(f"from_words: expected [..., kb, 2] words, got {words.shape}")
  b = jnp.stack([(words >> _u32(8 * i)) & _u32(0xFF) for i in range(4)], axis=-1)
  return b.astype(jnp.uint8).reshape(*lead, 8 * kb)
