"""Float32 arithmetic that gives the same bits on every XLA backend.

XLA rewrites float division (by a constant or broadcast scalar into a reciprocal multiply)
and on GPU its division and reciprocal are approximate; its CPU runtime flushes subnormals;
on GPU it drops `astype(fp4/fp8)` round trips inside `jit`
(docs/numerics.md). The scale formulas of docs/design.md §3.2 are IEEE float32
quotients, as torch and numpy compute them. Everything here is built from integer and bit
operations, comparisons and exact multiplications by powers of two, which every backend
computes exactly, so the JAX quantizers reproduce the torch twin bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

FLT_MIN_NORMAL = np.float32(2.0**-126)
_MANT_BITS = 23
_IMPLICIT = 1 << _MANT_BITS
_MANT_MASK = _IMPLICIT - 1


def f32_bits(x: jax.Array) -> jax.Array:
  """x's float32 bit pattern as int32 (the sign in the int's sign)."""
  return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)


def f32_from_bits(b: jax.Array) -> jax.Array:
  """The float32 whose bit pattern is int32 b."""
  return jax.lax.bitcast_convert_type(b.astype(jnp.int32), jnp.float32)


def flush_subnormal(x: jax.Array) -> jax.Array:
  """Replaces float32 subnormals by a zero of the same sign (XLA's CPU runtime does so anyway).

  Both twins flush explicitly so that CPU, GPU and torch see the same input.
  """
  b = f32_bits(x)
  is_sub = (b & 0x7F800000) == 0
  return f32_from_bits(jnp.where(is_sub, b & jnp.int32(-0x80000000), b))


def sign_bit(x: jax.Array) -> jax.Array:
  """True where the float32 sign bit is set (also for -0.0)."""
  return f32_bits(x) < 0


def _unroll() -> bool | int:
  return 1 if jax.default_backend() == "cpu" else True


def _parts(a: jax.Array, b: jax.Array) -> tuple[jax.Array, ...]:
  """Biased exponents (ea, eb) and significands with the implicit bit (ma, mb) of float32 a
  and b broadcast together (non-negative a, b)."""
  a, b = jnp.broadcast_arrays(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
  ai, bi = f32_bits(a), f32_bits(b)
  return (ai >> _MANT_BITS, bi >> _MANT_BITS, (ai & _MANT_MASK) | _IMPLICIT,
          (bi & _MANT_MASK) | _IMPLICIT)


def ieee_div(a: jax.Array, b: jax.Array, *, straight_line: bool = False) -> jax.Array:
  """IEEE float32 quotient a / b (round to nearest even) from integer long division.

  Defined for finite a >= 0 and finite normal b > 0. A zero or subnormal `a`, or a
  quotient below the normal range, gives 0 (callers clamp such quotients from below);
  a quotient beyond float32 gives +inf.
  straight_line: the division's steps unrolled in Python, no loop primitive: what a Pallas
  kernel on the GPU needs (Triton's lowering rejects scans with unroll != 1). Same bits.
  """
  ea, eb, ma, mb = _parts(a, b)
  below = ma < mb
  r = jnp.where(below, ma << 1, ma)  # now mb <= r < 2 mb, quotient in [1, 2)
  exp = ea - eb + 127 - below.astype(jnp.int32)
  def step(_, qr):
    q, r = qr
    bit = r >= mb
    return (q << 1) | bit.astype(jnp.int32), jnp.where(bit, r - mb, r) << 1

  # 24 significant bits and one guard bit. Rolled on CPU (XLA compiles it far faster), unrolled
  # elsewhere (one fused kernel on GPU); the integer steps give the same bits either way.
  q, r = jnp.zeros_like(r), r
  if straight_line:
    for i in range(_MANT_BITS + 2):
      q, r = step(i, (q, r))
  else:
    q, r = jax.lax.fori_loop(0, _MANT_BITS + 2, step, (q, r), unroll=_unroll())
  return _round_quotient(q, r != 0, exp, ea)


def _round_quotient(q: jax.Array, sticky: jax.Array, exp: jax.Array, ea: jax.Array
                    ) -> jax.Array:
  """The float32 of a quotient's 24 significant bits and guard bit q (25 bits), rounded to
  nearest even with the sticky flag (a nonzero remainder below), biased exponent exp; 0 where
  the numerator's exponent ea is 0 or the quotient underflows, inf where it overflows."""
  guard = q & 1
  q = q >> 1
  round_up = (guard == 1) & (sticky | ((q & 1) == 1))
  q = q + round_up.astype(jnp.int32)
  carry = q >> (_MANT_BITS + 1)
  q = jnp.where(carry == 1, q >> 1, q)
  exp = exp + carry
  out = f32_from_bits((exp << _MANT_BITS) | (q & _MANT_MASK))
  out = jnp.where(exp >= 255, jnp.float32(np.inf), out)
  return jnp.where((exp <= 0) | (ea == 0), jnp.float32(0.0), out)


def ieee_div_short(a: jax.Array, b: jax.Array, divisor_bits: int) -> jax.Array:
  """`ieee_div(a, b)`, the same bits, for divisors whose significand has at most
  `divisor_bits` (0..5) bits after the point (6.0: 1; every E4M3 value: 3), from one integer
  division instead of 25 long-division steps.

  The divisor's significand is then a (divisor_bits + 1)-bit integer, so a's 24-bit
  significand shifted left by 7 (< 2**31) divided by it gives 30 - divisor_bits or
  31 - divisor_bits quotient bits and a remainder: at least the 24 significant bits, a guard
  bit and a sticky bit that rounding to nearest even needs. Integer division is exact on
  every backend. A divisor with more significand bits than `divisor_bits` is the caller's
  error (the low bits are dropped).
  """
  if not 0 <= divisor_bits <= 5:
    raise ValueError(f"ieee_div_short: divisor_bits must be in 0..5, got {divisor_bits}")
  ea, eb, ma, mb = _parts(a, b)
  mb = mb >> (_MANT_BITS - divisor_bits)                               # [2**d, 2**(d+1))
  below = ma < (mb << (_MANT_BITS - divisor_bits))
  n = ma << 7
  q = jax.lax.div(n, mb)                     # 31 - d significant bits, one fewer when below
  r = n - q * mb
  shift = 6 - divisor_bits - below.astype(jnp.int32)   # down to 25 bits: 24 and a guard bit
  sticky = (r != 0) | ((q & ((1 << shift) - 1)) != 0)
  return _round_quotient(q >> shift, sticky, ea - eb + 127 - below.astype(jnp.int32), ea)


def _above(am: jax.Array, ea: jax.Array, bm: jax.Array, eb: jax.Array, mid: jax.Array
           ) -> tuple[jax.Array, jax.Array]:
  """(a / b > mid + h, a / b < mid - h) exactly, h half of mid's float32 ulp, for a midpoint
  `mid` of the E4M3 grid (5 significant bits, the last set) and significands am, bm (24-bit
  integers) with biased exponents ea, eb: int32 arithmetic only."""
  mb = f32_bits(mid)
  mi = ((mb & _MANT_MASK) | _IMPLICIT) >> 19                        # 5-bit odd integer
  em = (mb >> _MANT_BITS) - 4                                       # mid = mi * 2**(em - 127)
  d = jnp.clip(ea - eb - em + 127, 0, 7)  # a / b ~ mid: 3..6 where it matters (clamps keep signs)
  diff = (am << d) - bm * mi              # (a / b - mid) in units of b * 2**(em - 127 - d)...
  # ... compared with h = 2**-20 of those units: diff * 2**20 against +-bm (bm < 2**24)
  big = jnp.abs(diff) >= 16
  scaled = jnp.where(big, 0, diff) << 20
  return (diff > 0) & (big | (scaled > bm)), (diff < 0) & (big | (-scaled > bm))


def e4m3_quotient(a: jax.Array, b: jax.Array, b_inv: jax.Array) -> jax.Array:
  """`round_mantissa(clip(ieee_div(a, b), E4M3_MIN_NORMAL, E4M3_MAX), 3)`, the same bits, with
  no division: an NVFP4 block scale (amax / 6) / ts given ts's reciprocal b_inv =
  `ieee_div(1, b)` (one per row). For finite a >= 0 and normal b > 0 with a normal
  reciprocal (b < 2**126: a row scale is at most FLT_MAX / 2688).

  a * b_inv is within 2**-22 of a / b, so its E4M3 rounding c is the answer or a neighbour; the
  quotient's float32 rounding is compared exactly (int32 products) with the two midpoints
  around c, ties of the float32 rounding and of the E4M3 one included.
  """
  a, b, b_inv = jnp.broadcast_arrays(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32),
                                     jnp.asarray(b_inv, jnp.float32))
  c = round_mantissa(jnp.clip(a * b_inv, E4M3_MIN_NORMAL, E4M3_MAX), 3)
  ea, eb, am, bm = _parts(a, b)
  step = exp2i(exponent(c) - 3)                                     # c's E4M3 step
  pow2 = (f32_bits(c) & _MANT_MASK) == 0
  up = c + step
  down = c - jnp.where(pow2, step * np.float32(0.5), step)
  up_gt, up_lt = _above(am, ea, bm, eb, c + step * np.float32(0.5))
  dn_gt, dn_lt = _above(am, ea, bm, eb, (c + down) * np.float32(0.5))
  even = lambda v: ((f32_bits(v) >> 20) & 1) == 0  # noqa: E731
  r = jnp.where(up_gt | (~up_lt & even(up)), up, c)
  r = jnp.where(dn_lt | (~dn_gt & even(down)), down, r)
  r = jnp.clip(r, E4M3_MIN_NORMAL, E4M3_MAX)
  return jnp.where(ea == 0, E4M3_MIN_NORMAL, r)  # a zero or subnormal a: ieee_div's 0


def exponent(x: jax.Array) -> jax.Array:
  """floor(log2(|x|)) of a normal float32, read from its exponent bits."""
  return ((f32_bits(x) >> _MANT_BITS) & 0xFF) - 127


def exp2i(e: jax.Array) -> jax.Array:
  """2**e as an exact float32 for integer e in [-126, 127]."""
  return f32_from_bits((e.astype(jnp.int32) + 127) << _MANT_BITS)


def round_mantissa(x: jax.Array, keep_bits: int) -> jax.Array:
  """Rounds normal float32 values to `keep_bits` mantissa bits, RNE, by integer arithmetic."""
  drop = _MANT_BITS - keep_bits
  b = f32_bits(x)
  lsb = (b >> drop) & 1
  b = (b + ((1 << (drop - 1)) - 1) + lsb) & ~((1 << drop) - 1)
  return f32_from_bits(b)


E4M3_MAX = np.float32(448.0)
E4M3_MIN_NORMAL = np.float32(2.0**-6)
_E4M3_SUB_STEP = np.float32(2.0**-9)
_ROUNDER_BITS = np.int32(0x4B000000)  # 2**23: y + it - it rounds 0 <= y < 2**22 half to even


def round_to_e4m3(x: jax.Array) -> jax.Array:
  """Rounds float32 to the nearest E4M3 value (RNE), saturating at +-448, as float32.

  Normals round to 3 mantissa bits; below 2**-6 the grid is the subnormal step 2**-9.
  NaN stays NaN. Subnormal float32 inputs are taken as zero.
  """
  x = flush_subnormal(x)
  a = jnp.minimum(jnp.abs(x), E4M3_MAX)
  normal = round_mantissa(jnp.maximum(a, E4M3_MIN_NORMAL), 3)
  # Below 2**-6, a * 2**9 < 8 rounds to an integer (half to even) by adding and taking away
  # 2**23, whose float32 ulp is 1: float addition's own rounding, where a Pallas kernel's
  # Triton lowering has no rounding op (the product is exact, so a fused multiply-add gives
  # the same sum). 2**23 is made from a's exponent bits (it is 2**23 wherever this branch is
  # taken): XLA cancels `y + c - c` for a constant c. Never under fast-math.
  rounder = f32_from_bits(jnp.maximum(f32_bits(a) & 0x7F800000, _ROUNDER_BITS))
  sub = ((a * np.float32(2.0**9) + rounder) - rounder) * _E4M3_SUB_STEP
  mag = jnp.where(a >= E4M3_MIN_NORMAL, normal, sub)
  mag = jnp.where(jnp.isnan(x), x, mag)
  return jnp.where(sign_bit(x), -mag, mag)


def e4m3_to_bits(v: jax.Array) -> jax.Array:
  """uint8 E4M3 encoding of float32 values that are already exact E4M3 values (or NaN)."""
  b = f32_bits(v)
  sign = ((b >> 24) & 0x80).astype(jnp.uint8)
  a = jnp.abs(v)
  e = ((b >> _MANT_BITS) & 0xFF) - 127 + 7
  normal = (e << 3) | ((b >> 20) & 0x7)
  # exact: a is a multiple of 2**-9, so the product is an integer (no rounding op: it also
  # runs inside Pallas kernels, whose Triton lowering has none)
  sub = (a * np.float32(2.0**9)).astype(jnp.int32)
  mag = jnp.where(a >= E4M3_MIN_NORMAL, normal, sub)
  mag = jnp.where(jnp.isnan(v), 0x7F, mag).astype(jnp.uint8)
  return sign | mag


def bits_to_e4m3(bits: jax.Array) -> jax.Array:
  """Reinterprets uint8 codes as float8_e4m3fn (a bitcast; no rounding)."""
  return jax.lax.bitcast_convert_type(bits.astype(jnp.uint8), jnp.float8_e4m3fn)


def e4m3_value(scale: jax.Array) -> jax.Array:
  """float32 value of float8_e4m3fn scales, decoded from their bits (exact on every backend)."""
  return e4m3_bits_value(jax.lax.bitcast_convert_type(scale, jnp.uint8))


def e4m3_bits_value(bits: jax.Array) -> jax.Array:
  """float32 value of E4M3 bytes (uint8 or int 0..255): `e4m3_value` of their bitcast, in
  integer and float ops only (it runs inside Pallas kernels too)."""
  bits = bits.astype(jnp.int32)
  e = (bits >> 3) & 0xF
  m = bits & 0x7
  normal = exp2i(e - 7) * (np.float32(1.0) + m.astype(jnp.float32) * np.float32(0.125))
  sub = m.astype(jnp.float32) * _E4M3_SUB_STEP
  mag = jnp.where(e == 0, sub, normal)
  mag = jnp.where((bits & 0x7F) == 0x7F, jnp.float32(np.nan), mag)
  return jnp.where((bits & 0x80) != 0, -mag, mag)
