"""FP4 (E2M1: NVFP4, MXFP4) and FP8 (E4M3) block quantization, bit-exact on every backend.

The numerics are docs/design.md §3. Codes and scales are computed with comparisons, integer
arithmetic and exact float32 products only (see `exact.py`), so they match the torch twin
(`rollout_bridge/torch_quant.py`) and `ml_dtypes` bit for bit on CPU and GPU under default
XLA flags, inside and outside `jit`.

Defined behaviour at the edges (the same in both twins):
- Subnormal float32 inputs (|x| < 2**-126) are taken as zero of the same sign.
- E2M1 codes keep the sign of zero (docs/numerics.md, "Sign of zero"): +0 and positive values
  that round to zero get code 0; negative values that round to zero, and -0, get code 8, as
  ModelOpt, torchao and the hardware's E2M1 convert do, so exported bytes equal theirs. Flip
  counts compare values (`e2m1_values_equal`), so codes 0 and 8 count as equal there.
- Non-finite input poisons: a block holding NaN or +-Inf gets a NaN block scale and codes 0
  (+0, whatever the signs of its elements), and with two-level scaling so does every block
  under a NaN second-level scale, so dequantization returns NaN there. Eager calls on concrete
  arrays raise instead (`check_finite`).
- Shapes: the last axis is the contraction axis and must be a multiple of the block size.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from trace_jax.quant import exact

# E2M1 magnitudes by code 0..7 (docs/design.md §3.1).
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
E2M1_MAX = np.float32(6.0)
# Rounding boundaries between neighbours and whether the boundary itself rounds up (RNE: the
# tie goes to the code with mantissa bit 0, i.e. the even code).
_E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False),
                   (3.5, True), (5.0, False))

NVFP4_BLOCK = 16
MXFP4_BLOCK = 32
FP8_GROUP = 128
FP8_MAX = exact.E4M3_MAX
NVFP4_TENSOR_DIVISOR = np.float32(448.0 * 6.0)
# Second-level amax floor: all-zero (padding) rows and tensors get a finite, normal scale.
AMAX_FLOOR = np.float32(2.0**-100)


# ----------------------------------------------------------------------------- validation

def _check_input(x: jax.Array, block: int, name: str) -> jax.Array:
  if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"{name}: expected a floating-point array, got {getattr(x, 'dtype', type(x))}")
  if x.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
    raise TypeError(f"{name}: input dtype must be float32, bfloat16 or float16, got {x.dtype}")
  if x.ndim == 0:
    raise ValueError(f"{name}: expected at least 1 dimension (the contraction axis), got a scalar")
  if x.shape[-1] % block:
    raise ValueError(
        f"{name}: contraction size {x.shape[-1]} (last axis of shape {x.shape}) is not "
        f"divisible by the block size {block}")
  check_finite(x, name)
  return exact.flush_subnormal(x.astype(jnp.float32))


def check_finite(x: jax.Array, name: str) -> None:
  """Raises on NaN/Inf in a concrete array; traced arrays are left to NaN poisoning."""
  if isinstance(x, jax.core.Tracer):
    return
  bad = int(jnp.sum(~jnp.isfinite(x)))
  if bad:
    raise ValueError(f"{name}: input holds {bad} non-finite values (NaN/Inf); FP4/FP8 codes are "
                     "undefined for them. Under jit such blocks dequantize to NaN.")


def _blocks(x: jax.Array, block: int) -> jax.Array:
  return x.reshape(x.shape[:-1] + (x.shape[-1] // block, block))


def _unblock(x: jax.Array) -> jax.Array:
  return x.reshape(x.shape[:-2] + (x.shape[-2] * x.shape[-1],))


def _amax(xb: jax.Array, axis: int | tuple[int, ...] = -1) -> tuple[jax.Array, jax.Array]:
  """Per-block amax over `axis` (the last: a block of a row), and whether the block holds a
  non-finite value (its amax is then 0: every caller masks such blocks).

  One integer max reduction of the magnitudes' bit patterns: for float32 values >= 0 the bit
  patterns order as the values, and a non-finite magnitude's (exponent all ones) is above
  every finite one's. (A float max of the finite values beside an all-finite flag is two
  reductions over the block; and XLA's float max does not promise to propagate NaN.)"""
  m = jnp.max(exact.f32_bits(xb) & np.int32(0x7FFFFFFF), axis=axis)
  bad = m >= np.int32(0x7F800000)
  return jnp.where(bad, np.float32(0.0), exact.f32_from_bits(m)), bad


# ----------------------------------------------------------------------------- E2M1 element

def e2m1_encode(y: jax.Array) -> jax.Array:
  """E2M1 codes (uint8 0..15) of float values: RNE, ties to even, saturating at +-6.

  Matches `ml_dtypes.float4_e2m1fn` on every non-NaN input (including -0 -> code 8 and
  +-Inf -> +-6); NaN gives code 0.
  """
  y = exact.flush_subnormal(jnp.asarray(y).astype(jnp.float32))
  a = jnp.abs(y)
  mag = jnp.zeros(y.shape, jnp.uint8)
  for mid, tie_up in _E2M1_MIDPOINTS:
    mag = mag + ((a >= mid) if tie_up else (a > mid)).astype(jnp.uint8)
  sign = jnp.where(exact.sign_bit(y) & ~jnp.isnan(y), jnp.uint8(8), jnp.uint8(0))
  return sign | mag


def e2m1_magnitude(m: jax.Array) -> jax.Array:
  """float32 grid value of magnitude codes 0..7, elementwise (no table gather, so XLA fuses it).

  Codes 0..4 are m / 2; 5 and 6 are m - 2; 7 is 6.
  """
  mf = m.astype(jnp.float32)
  return jnp.where(m <= 4, mf * np.float32(0.5), jnp.where(m <= 6, mf - 2.0, E2M1_MAX))


def e2m1_decode(codes: jax.Array) -> jax.Array:
  """float32 values of E2M1 codes (uint8 0..15)."""
  codes = codes.astype(jnp.int32)
  mag = e2m1_magnitude(codes & 7)
  # `* -1`, not `-mag`: Triton lowers negation as 0 - x, which would make code 8 +0 inside
  # the Pallas kernels that decode with this (`kernels/nvfp4_act.py`).
  return jnp.where((codes & 8) != 0, mag * np.float32(-1.0), mag)


# 1.5 * 2**22, the rounder of |y| < 2 (step 0.5): float32 bits 0x4AC00000, i.e. the exponent
# field of 1.0 plus 22 and the significand's top bit.
_E2M1_ROUNDER_OFFSET = (22 << 23) | 0x400000
_ONE_EXPONENT = 0x3F800000


def e2m1_rounder(a: jax.Array) -> jax.Array:
  """For float32 0 <= a <= 6: 1.5 * 2**(23 + log2(step)), step a's E2M1 grid step (0.5 below
  2, 1 below 4, 2 up to 6): a float32 whose ulp is the step and whose binade holds a + it, so
  that `a + rounder` rounds a to the grid (RNE) and its low bits count grid steps. Three
  integer operations on a's exponent bits."""
  e = exact.f32_bits(a) & 0x7F800000
  return exact.f32_from_bits(jnp.maximum(e, _ONE_EXPONENT) + _E2M1_ROUNDER_OFFSET)


def copysign_bits(v: jax.Array, sign: jax.Array) -> jax.Array:
  """v (>= 0, or +0) with the sign bit of the int32 bits `sign` (only its sign bit is read)."""
  return exact.f32_from_bits(exact.f32_bits(v) | (sign & np.int32(-0x80000000)))


def e2m1_round(y: jax.Array) -> jax.Array:
  """The E2M1 grid value of y as float32, without codes: `e2m1_decode(e2m1_encode(y))` for
  every non-NaN y (RNE, ties to even, saturating at +-6, the sign of zero kept); NaN stays NaN.

  |y| plus, then minus, a constant whose float32 ulp is the grid's step at |y|
  (`e2m1_rounder`): float addition's round to nearest even is E2M1's, since the grid's even
  codes are the even multiples of each step. About a third of the operations of encode +
  decode (a kernel's fake quantizer needs the value only). Never under fast-math
  reassociation.
  """
  y = jnp.asarray(y).astype(jnp.float32)
  return copysign_bits(e2m1_round_magnitude(jnp.abs(y)), exact.f32_bits(y))


def e2m1_round_magnitude(a: jax.Array) -> jax.Array:
  """`e2m1_round` of float32 a >= 0 (saturating at 6), with no sign handling: what a kernel
  that carries the sign apart rounds."""
  a = jnp.minimum(a, E2M1_MAX)
  c = e2m1_rounder(a)
  return (a + c) - c


def e2m1_values_equal(a: Any, b: Any) -> Any:
  """True where E2M1 codes `a` and `b` (0..15) encode the same value: equal codes, or +0 and -0.

  Codes keep the sign of zero (code 8 is -0), so code flips between two quantizations of
  nearby inputs must be counted on values, never with `a != b`. Integer operators only: works
  elementwise on numpy, JAX (inside jit too) and torch integer arrays, and on Python ints.
  """
  return (a == b) | (((a | b) & 7) == 0)


def pack_fp4(codes: jax.Array) -> jax.Array:
  """Packs two 4-bit codes per byte along the last axis: element 2i in the low nibble."""
  if codes.shape[-1] % 2:
    raise ValueError(f"pack_fp4: last axis must be even, got shape {codes.shape}")
  c = codes.astype(jnp.uint8).reshape(codes.shape[:-1] + (codes.shape[-1] // 2, 2))
  return (c[..., 0] & 0xF) | ((c[..., 1] & 0xF) << 4)


def unpack_fp4(packed: jax.Array) -> jax.Array:
  """Inverse of `pack_fp4`."""
  p = packed.astype(jnp.uint8)
  c = jnp.stack([p & 0xF, p >> 4], axis=-1)
  return c.reshape(p.shape[:-1] + (p.shape[-1] * 2,))


# ----------------------------------------------------------------------------- NVFP4

@struct.dataclass
class NVFP4Tensor:
  """NVFP4 quantization of an array whose last axis is the contraction axis.

  codes: uint8, shape of x, one E2M1 code per element.
  block_scale: float8_e4m3fn, x.shape[:-1] + (K // 16,).
  tensor_scale: float32 second-level scale broadcastable to x.shape[:-1] + (1,), or None.
  """
  codes: jax.Array
  block_scale: jax.Array
  tensor_scale: jax.Array | None = None


def nvfp4_tensor_scale(x: jax.Array, axes: tuple[int, ...] | None = None) -> jax.Array:
  """Second-level scale `amax / (448 * 6)` over `axes` (kept as size-1 dims).

  axes=None: the whole tensor; axes=(-1,): per row (activations); for stacked expert weights
  [E, N, K] use axes=(1, 2) (one scale per expert). All-zero inputs use amax 2**-100.
  """
  return nvfp4_shared_tensor_scale((x,), axes)


def nvfp4_shared_tensor_scale(xs: Sequence[jax.Array], axes: tuple[int, ...] | None = None
                              ) -> jax.Array:
  """`nvfp4_tensor_scale` of the arrays xs joined along an axis outside `axes` (of one shape
  after the reduction), without joining them: the gate and up projections [E, F, D] share one
  scale per expert, as SGLang's fused w13 does. The max is exact, so this is the joined
  array's scale bit for bit."""
  if not xs:
    raise ValueError("nvfp4_shared_tensor_scale: no arrays given")
  amax, finite = None, None
  for x in xs:
    xf = exact.flush_subnormal(jnp.asarray(x).astype(jnp.float32))
    ax = tuple(range(xf.ndim)) if axes is None else axes
    # Explicit: XLA's max reduction does not promise to propagate NaN.
    f = jnp.all(jnp.isfinite(xf), axis=ax, keepdims=True)
    a = jnp.max(jnp.where(jnp.isfinite(xf), jnp.abs(xf), 0.0), axis=ax, keepdims=True)
    amax = a if amax is None else jnp.maximum(amax, a)
    finite = f if finite is None else finite & f
  ts = exact.ieee_div(jnp.maximum(amax, AMAX_FLOOR), NVFP4_TENSOR_DIVISOR)
  return jnp.where(finite, ts, jnp.float32(np.nan))


def nvfp4_row_scale(x: jax.Array) -> jax.Array:
  """Per-token-row second-level scale for activations (batch-invariant), shape [..., 1]."""
  return nvfp4_tensor_scale(x, axes=(-1,))


def _nvfp4_block_scale(amax: jax.Array, ts: jax.Array | None) -> jax.Array:
  """E4M3-rounded block scale as float32: clamp((amax / 6) [/ ts], 2**-6, 448)."""
  bs = exact.ieee_div(jnp.where(jnp.isfinite(amax), amax, 0.0), np.float32(6.0))
  if ts is not None:
    bs = exact.ieee_div(bs, jnp.where(jnp.isfinite(ts), ts, 1.0))
  bs = jnp.clip(bs, exact.E4M3_MIN_NORMAL, exact.E4M3_MAX)
  return exact.round_mantissa(bs, 3)


def _nvfp4_inverse_scale(bs: jax.Array, ts: jax.Array | None) -> jax.Array:
  """Per-block multiplier: 1 / bs (single level) or (1 / ts) / bs (two level), IEEE float32."""
  num = jnp.float32(1.0) if ts is None else exact.ieee_div(jnp.float32(1.0), ts)
  return exact.ieee_div(num, bs)


def _encode_blocks(xb: jax.Array, inv: jax.Array, bad: jax.Array) -> jax.Array:
  """Codes of blocks xb scaled by inv (sign of zero kept); poisoned blocks get codes 0."""
  y = jnp.clip(xb * inv[..., None], -E2M1_MAX, E2M1_MAX)
  return jnp.where(bad[..., None], jnp.uint8(0), e2m1_encode(y))


def _broadcast_ts(ts: jax.Array, x: jax.Array, name: str) -> jax.Array:
  ts = jnp.asarray(ts, jnp.float32)
  target = x.shape[:-1] + (1,)
  try:
    np.broadcast_shapes(ts.shape, target)
  except ValueError:
    raise ValueError(f"{name}: tensor_scale of shape {ts.shape} does not broadcast to "
                     f"{target} (x.shape[:-1] + (1,))") from None
  if len(np.broadcast_shapes(ts.shape, target)) != len(target) or \
      np.broadcast_shapes(ts.shape, target) != target:
    raise ValueError(f"{name}: tensor_scale of shape {ts.shape} would broadcast x of shape "
                     f"{x.shape} to a larger shape")
  return ts


def nvfp4_quantize(x: jax.Array, tensor_scale: jax.Array | None = None) -> NVFP4Tensor:
  """NVFP4 quantization (docs/design.md §3.2): 16-element blocks, E4M3 block scales.

  tensor_scale=None: single-level scaling. Otherwise two-level with the given float32
  second-level scale (from `nvfp4_row_scale` for activations, `nvfp4_tensor_scale` for
  weights), broadcastable to x.shape[:-1] + (1,).
  """
  xf = _check_input(x, NVFP4_BLOCK, "nvfp4_quantize")
  ts = None if tensor_scale is None else _broadcast_ts(tensor_scale, x, "nvfp4_quantize")
  xb = _blocks(xf, NVFP4_BLOCK)
  amax, bad = _amax(xb)
  if ts is not None:
    bad = bad | ~jnp.isfinite(ts)  # [..., 1] broadcasts over blocks
  bs = _nvfp4_block_scale(amax, ts)
  inv = _nvfp4_inverse_scale(bs, ts)
  codes = _unblock(_encode_blocks(xb, inv, bad))
  bs = jnp.where(bad, jnp.float32(np.nan), bs)
  block_scale = exact.bits_to_e4m3(exact.e4m3_to_bits(bs))
  return NVFP4Tensor(codes=codes, block_scale=block_scale, tensor_scale=ts)


def nvfp4_dequantize(q: NVFP4Tensor) -> jax.Array:
  """float32 values `code_value * block_scale [* tensor_scale]`."""
  vals = _blocks(e2m1_decode(q.codes), NVFP4_BLOCK)
  out = _unblock(vals * exact.e4m3_value(q.block_scale)[..., None])
  if q.tensor_scale is not None:
    out = out * q.tensor_scale
  return out


# ----------------------------------------------------------------------------- MXFP4

@struct.dataclass
class MXFP4Tensor:
  """MXFP4 (OCP MX v1.0): codes uint8 per element, block_scale float8_e8m0fnu per 32."""
  codes: jax.Array
  block_scale: jax.Array
  tensor_scale: None = None


def mxfp4_quantize(x: jax.Array, tensor_scale: None = None) -> MXFP4Tensor:
  """MXFP4: shared exponent floor(log2(amax)) - 2 per 32 elements, E2M1 RNE, saturating.

  An all-zero block gets scale byte 0 (2**-127). `tensor_scale` exists for signature parity
  with NVFP4 and must be None.
  """
  if tensor_scale is not None:
    raise ValueError("mxfp4_quantize: MXFP4 has no second-level scale; pass tensor_scale=None")
  xf = _check_input(x, MXFP4_BLOCK, "mxfp4_quantize")
  xb = _blocks(xf, MXFP4_BLOCK)
  amax, bad = _amax(xb)
  zero = amax == 0
  e = jnp.clip(exact.exponent(jnp.where(zero | bad, 1.0, amax)) - 2, -127, 127)
  e = jnp.where(zero, -127, e)
  # e lies in [-127, 125] (float32 amax < 2**128), so 2**-e is a normal float32.
  y = xb * exact.exp2i(-e)[..., None]
  codes = e2m1_encode(jnp.clip(y, -E2M1_MAX, E2M1_MAX))
  codes = _unblock(jnp.where(bad[..., None], jnp.uint8(0), codes))
  scale_bits = jnp.where(bad, 0xFF, e + 127).astype(jnp.uint8)
  block_scale = jax.lax.bitcast_convert_type(scale_bits, jnp.float8_e8m0fnu)
  return MXFP4Tensor(codes=codes, block_scale=block_scale)


def mxfp4_dequantize(q: MXFP4Tensor) -> jax.Array:
  """float32 values `code_value * 2**scale_exponent`; subnormal results flush to zero.

  Built from exponent and mantissa bits: no float multiplication, so no backend can flush
  or reassociate an intermediate (code magnitudes are 0.5 * 2**0 or (1 + m/2) * 2**(E - 1)).
  """
  bits = jax.lax.bitcast_convert_type(q.block_scale, jnp.uint8).astype(jnp.int32)
  e = jnp.repeat(bits - 127, MXFP4_BLOCK, axis=-1)
  codes = q.codes.astype(jnp.int32)
  m = codes & 7
  exp = jnp.where(m == 1, -1, (m >> 1) - 1) + e
  mant = jnp.where(m >= 2, m & 1, 0)
  out_bits = ((exp + 127) << 23) | (mant << 22)
  out = jax.lax.bitcast_convert_type(out_bits, jnp.float32)
  out = jnp.where(exp > 127, jnp.float32(np.inf), out)
  out = jnp.where((m == 0) | (exp < -126), jnp.float32(0.0), out)
  out = jnp.where((codes & 8) != 0, -out, out)
  return jnp.where(jnp.repeat(bits == 255, MXFP4_BLOCK, axis=-1), jnp.float32(np.nan), out)


# ----------------------------------------------------------------------------- FP8 (Jet-RL)

@struct.dataclass
class FP8Tensor:
  """FP8 E4M3 with float32 scales `amax / 448` per block.

  values: float8_e4m3fn, shape of x.
  scale: float32; activations [..., K // 128] (block_rows=1); weights [..., N // 128, K // 128]
    (block_rows=128).
  """
  values: jax.Array
  scale: jax.Array
  block_rows: int = struct.field(pytree_node=False, default=1)


def _fp8_scale(amax: jax.Array, bad: jax.Array, straight_line: bool = False
               ) -> tuple[jax.Array, jax.Array]:
  div = functools.partial(exact.ieee_div, straight_line=straight_line)
  s = div(jnp.maximum(jnp.where(bad, 0.0, amax), AMAX_FLOOR), FP8_MAX)
  inv = div(jnp.float32(1.0), s)
  return jnp.where(bad, jnp.float32(np.nan), s), inv


def _fp8_codes(x: jax.Array, inv: jax.Array, bad: jax.Array) -> jax.Array:
  v = exact.round_to_e4m3(jnp.clip(x * inv, -FP8_MAX, FP8_MAX))
  v = jnp.where(v == 0, jnp.float32(0.0), v)  # no negative zero
  v = jnp.where(bad, jnp.float32(0.0), v)
  return exact.e4m3_to_bits(v)


def _fp8_encode(x: jax.Array, inv: jax.Array, bad: jax.Array) -> jax.Array:
  return exact.bits_to_e4m3(_fp8_codes(x, inv, bad))


def fp8_group_codes(xb: jax.Array, *, straight_line: bool = False
                    ) -> tuple[jax.Array, jax.Array]:
  """The activations' quantizer on groups xb [..., 128] of float32 values (subnormals
  flushed): (uint8 E4M3 codes [..., 128], float32 scales [...]), `fp8_quantize_act`'s bits.
  Integer and float operations only, so a Pallas kernel can run it (straight_line: its
  divisions without loop primitives, as Triton's lowering needs; the same bits)."""
  amax, bad = _amax(xb)
  s, inv = _fp8_scale(amax, bad, straight_line)
  return _fp8_codes(xb, inv[..., None], bad[..., None]), s


def fp8_quantize_act(x: jax.Array) -> FP8Tensor:
  """FP8 E4M3 for activations: one scale per 1 x 128 group along the last axis."""
  xf = _check_input(x, FP8_GROUP, "fp8_quantize_act")
  codes, s = fp8_group_codes(_blocks(xf, FP8_GROUP))
  return FP8Tensor(values=exact.bits_to_e4m3(_unblock(codes)), scale=s)


def fp8_quantize_weight(w: jax.Array) -> FP8Tensor:
  """FP8 E4M3 for weights [..., N, K] (torch [out, in] order): one scale per 128 x 128 block."""
  wf = _check_input(w, FP8_GROUP, "fp8_quantize_weight")
  if w.ndim < 2 or w.shape[-2] % FP8_GROUP:
    raise ValueError(f"fp8_quantize_weight: expected [..., N, K] with N and K multiples of "
                     f"{FP8_GROUP}, got shape {w.shape}")
  n, k = w.shape[-2:]
  wb = wf.reshape(w.shape[:-2] + (n // FP8_GROUP, FP8_GROUP, k // FP8_GROUP, FP8_GROUP))
  amax, bad = _amax(wb, axis=(-3, -1))
  s, inv = _fp8_scale(amax, bad)
  values = _fp8_encode(wb, inv[..., :, None, :, None], bad[..., :, None, :, None])
  return FP8Tensor(values=values.reshape(w.shape), scale=s, block_rows=FP8_GROUP)


def fp8_dequantize(q: FP8Tensor) -> jax.Array:
  """float32 values `value * scale` per block."""
  v = exact.e4m3_value(q.values)
  if q.block_rows == 1:  # activation groups
    return _unblock(_blocks(v, FP8_GROUP) * q.scale[..., None])
  n, k = v.shape[-2:]
  vb = v.reshape(v.shape[:-2] + (n // FP8_GROUP, FP8_GROUP, k // FP8_GROUP, FP8_GROUP))
  return (vb * q.scale[..., :, None, :, None]).reshape(v.shape)


# ----------------------------------------------------------------------------- FP4 by name

FP4_FORMATS = ("nvfp4", "mxfp4")
FP4_BLOCKS = {"nvfp4": NVFP4_BLOCK, "mxfp4": MXFP4_BLOCK}
FP4Tensor = NVFP4Tensor | MXFP4Tensor


def check_fp4_format(fmt: str) -> None:
  if fmt not in FP4_FORMATS:
    raise ValueError(f"unknown FP4 format {fmt!r}; expected one of {FP4_FORMATS}")


def fp4_quantize_act(x: jax.Array, fmt: str = "nvfp4") -> FP4Tensor:
  """Activation rows [..., K] in an FP4 format, each row on its own (batch-invariant): NVFP4
  two-level with the row's second-level scale (`nvfp4_row_scale`), or MXFP4."""
  check_fp4_format(fmt)
  if fmt == "nvfp4":
    return nvfp4_quantize(x, nvfp4_row_scale(x))
  return mxfp4_quantize(x)


def fp4_format(q: FP4Tensor) -> str:
  """"nvfp4" or "mxfp4": the format of a quantized tensor."""
  if isinstance(q, NVFP4Tensor):
    return "nvfp4"
  if isinstance(q, MXFP4Tensor):
    return "mxfp4"
  raise TypeError(f"not an FP4 tensor: {type(q).__name__}")


def fp4_dequantize(q: FP4Tensor) -> jax.Array:
  """float32 values of an NVFP4 or MXFP4 tensor."""
  return nvfp4_dequantize(q) if fp4_format(q) == "nvfp4" else mxfp4_dequantize(q)
