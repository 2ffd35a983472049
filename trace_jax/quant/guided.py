"""Rollout-guided FP4 rounding (TRACE, docs/design.md §3.5) under a guidance record (§5).

Rollout quantizes a site with an FP4 format, NVFP4 (blocks of 16, E4M3 block scales, per-row
FP32 second-level scale) or MXFP4 (blocks of 32, E8M0 power-of-two scales), and keeps, per
element, the code's mantissa bit (compact) or the whole 4-bit code (full), plus its scales.
Training rounds its own input with the rollout's scales and, between the two E2M1 grid
points that bracket it, picks the one the rollout chose (same mantissa bit) or the one nearest
to the rollout value. With no drift this equals round-to-nearest, bit for bit; with drift within
one code it reproduces the rollout code's value exactly (a zero takes the sign of the training
input, so the codes may differ as 0 vs 8: compare them with `formats.e2m1_values_equal`).

The record's format (fields, dtypes, widths, bytes per row) is `trace_jax.guidance.record`'s;
this module makes records from quantized tensors (`record`) and rounds under them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.guidance.record import Guidance, check_mode, field_dtype, field_shapes
from trace_jax.quant import exact, formats
from trace_jax.quant.formats import (
  E2M1_GRID,
  E2M1_MAX,
  FP4_BLOCKS,
  FP4Tensor,
  MXFP4Tensor,
  NVFP4Tensor,
  _blocks,
  _nvfp4_inverse_scale,
  _unblock,
  e2m1_decode,
  e2m1_magnitude,
  fp4_format,
  pack_fp4,
  unpack_fp4,
)


def pack_bits(bits: jax.Array) -> jax.Array:
  """Packs 0/1 values 8 per byte along the last axis: element 8i+j is bit j of byte i."""
  if bits.shape[-1] % 8:
    raise ValueError(f"pack_bits: last axis must be a multiple of 8, got shape {bits.shape}")
  b = bits.astype(jnp.uint8).reshape(bits.shape[:-1] + (bits.shape[-1] // 8, 8))
  weights = jnp.asarray(1 << np.arange(8), jnp.uint8)
  return jnp.sum(b * weights, axis=-1, dtype=jnp.uint8)


def unpack_bits(packed: jax.Array) -> jax.Array:
  """Inverse of `pack_bits` (uint8 0/1 values)."""
  shifts = jnp.arange(8, dtype=jnp.uint8)
  b = (packed[..., None] >> shifts) & 1
  return b.reshape(packed.shape[:-1] + (packed.shape[-1] * 8,)).astype(jnp.uint8)


def record(q: FP4Tensor, mode: str = "compact", mantissa: jax.Array | None = None) -> Guidance:
  """The guidance record of a rollout-side quantization: two-level NVFP4 or MXFP4.

  mantissa: compact mode's payload already packed (`pack_bits(q.codes & 1)`, as the NVFP4 site
  kernel writes it), used as given."""
  check_mode(mode)
  row_scale = None
  if fp4_format(q) == "nvfp4":
    if q.tensor_scale is None:
      raise ValueError("guidance needs two-level NVFP4 (per-row second-level scale); got "
                       "single-level scaling")
    row_scale = jnp.broadcast_to(q.tensor_scale, q.codes.shape[:-1] + (1,)).astype(jnp.float32)
  if mantissa is not None and mode != "compact":
    raise ValueError(f"record: a packed mantissa is compact mode's payload, not {mode!r}'s")
  if mode == "compact":
    payload = dict(mantissa=pack_bits(q.codes & 1) if mantissa is None else mantissa)
  else:
    payload = dict(codes=pack_fp4(q.codes))
  return Guidance(block_scale=q.block_scale, row_scale=row_scale, **payload)


def compact(g: Guidance) -> Guidance:
  """A full-mode record reduced to compact mode: its codes' mantissa bits as `record` packs
  them, the same scales; a compact record as it is. (The engine compacts the full records
  that audits make it tap, on the device.)"""
  if g.mantissa is not None:
    return g
  return Guidance(block_scale=g.block_scale, row_scale=g.row_scale,
                  mantissa=pack_bits(unpack_fp4(g.codes) & 1))


def validate(x: jax.Array, g: Guidance, name: str = "guidance") -> None:
  """Raises ValueError when `g` cannot guide an input of x's shape (the record's fields:
  `guidance.record.field_shapes` and `field_dtype`)."""
  fmt = g.format
  block = FP4_BLOCKS[fmt]
  k = x.shape[-1]
  if k % block:
    raise ValueError(f"{name}: contraction size {k} is not divisible by {block} ({fmt})")
  if fmt != "nvfp4" and g.row_scale is not None:
    raise ValueError(f"{name}: MXFP4 guidance has no row_scale")
  if (g.mantissa is None) == (g.codes is None):
    raise ValueError(f"{name}: exactly one of mantissa (compact) or codes (full) must be set")
  want = field_shapes(x.shape[:-1], k, g.mode, fmt)
  for field in ("block_scale", "row_scale", "mantissa", "codes"):
    a = getattr(g, field)
    if field not in want:
      continue
    if a is None:
      raise ValueError(f"{name}: {fmt} guidance needs {field}")
    if tuple(a.shape) != want[field]:
      raise ValueError(f"{name}: {field} has shape {tuple(a.shape)}, expected {want[field]} "
                       f"for an input of shape {tuple(x.shape)}")
  for field in ("block_scale", "row_scale", "mantissa", "codes"):
    a = getattr(g, field)
    if a is not None and jnp.dtype(a.dtype).name != field_dtype(field, fmt):
      raise ValueError(f"{name}: {field} has dtype {a.dtype}, expected "
                       f"{field_dtype(field, fmt)}")


def _scaled(xf: jax.Array, g: Guidance) -> tuple[jax.Array, jax.Array]:
  """(x in the rollout's scale units per block [..., K // block, block], blocks whose
  guidance is poisoned [..., K // block]), computed as the format's quantizer computes them."""
  if g.format == "nvfp4":
    bs = exact.e4m3_value(g.block_scale)
    inv = _nvfp4_inverse_scale(bs, g.row_scale)
    bad = ~jnp.isfinite(bs) | ~jnp.isfinite(g.row_scale)
    return _blocks(xf, FP4_BLOCKS["nvfp4"]) * inv[..., None], bad
  bits = jax.lax.bitcast_convert_type(g.block_scale, jnp.uint8).astype(jnp.int32)
  # 2**-(bits - 127) is a normal float32 for every finite scale byte (0..254), as in
  # mxfp4_quantize; byte 255 is the NaN scale of a poisoned block.
  inv = exact.exp2i(jnp.clip(127 - bits, -126, 127))
  return _blocks(xf, FP4_BLOCKS["mxfp4"]) * inv[..., None], bits == 255


def _bracket(a: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Magnitude codes (lo, hi) of the E2M1 grid points with grid[lo] <= a <= grid[hi]."""
  lo = jnp.zeros(a.shape, jnp.uint8)
  for g in E2M1_GRID[1:]:
    lo = lo + (a >= g).astype(jnp.uint8)
  on_grid = a == e2m1_magnitude(lo)
  hi = jnp.where(on_grid, lo, jnp.minimum(lo + 1, 7)).astype(jnp.uint8)
  return lo, hi


def _signed(z: jax.Array, mag: jax.Array) -> jax.Array:
  """Magnitude codes with the sign of z, zero included (code 8 for a negative z that rounds to
  zero, as RTN gives it), so with no drift the guided code equals the rollout's bit for bit."""
  return jnp.where(exact.sign_bit(z), jnp.uint8(8), jnp.uint8(0)) | mag


def compact_codes(z: jax.Array, bit: jax.Array) -> jax.Array:
  """E2M1 codes of values z in the rollout's scale units (clipped to +-6) under a compact
  record's mantissa bits (0/1 per element): of the two grid points bracketing |z|, the one
  whose code has the rollout's low bit. Elementwise (the guided Pallas kernel runs it too)."""
  lo, hi = _bracket(jnp.abs(z))
  return _signed(z, jnp.where((lo & 1) == bit, lo, hi))


def compact_values(z: jax.Array, bit: jax.Array) -> jax.Array:
  """`e2m1_decode(compact_codes(z, bit))` as float32, without codes (the guided kernel's fake
  quantizer needs the value only), for |z| <= 6: `compact_magnitude(|z|)` with z's sign."""
  return formats.copysign_bits(compact_magnitude(jnp.abs(z).astype(jnp.float32), bit),
                               exact.f32_bits(z))


def compact_magnitude(a: jax.Array, bit: jax.Array) -> jax.Array:
  """`compact_values` of float32 0 <= a <= 6, with no sign handling.

  a + `formats.e2m1_rounder(a)` holds a's nearest grid point (RNE) as a count of grid steps in
  its low bits, whose parity is the E2M1 code's low bit in every binade (codes 0-4 are 0..2 in
  steps of 0.5, 4-6 are 2..4 in steps of 1, 6-7 are 4 and 6). Where the parity is not the
  record's bit and a is not on the grid, the other neighbour is one step (one ulp of the sum)
  towards a: the value the compact record's rule (the neighbour below or above a whose low
  bit is `bit`) picks.
  """
  c = formats.e2m1_rounder(a)
  s = exact.f32_bits(a + c)
  r = exact.f32_from_bits(s) - c
  keep = ((s & 1) == bit.astype(jnp.int32)) | (r == a)
  s = jnp.where(keep, s, s + jnp.where(r < a, np.int32(1), np.int32(-1)))
  return exact.f32_from_bits(s) - c


def guided_codes(x: jax.Array, g: Guidance) -> jax.Array:
  """E2M1 codes (uint8 per element) of training input x rounded under rollout guidance."""
  validate(x, g)
  block = FP4_BLOCKS[g.format]
  xf = exact.flush_subnormal(x.astype(jnp.float32))
  zb, bad = _scaled(xf, g)
  z = _unblock(jnp.clip(zb, -E2M1_MAX, E2M1_MAX))
  if g.mantissa is not None:
    codes = compact_codes(z, unpack_bits(g.mantissa))
  else:
    lo, hi = _bracket(jnp.abs(z))
    ref = e2m1_decode(unpack_fp4(g.codes))
    sgn = jnp.where(exact.sign_bit(z), np.float32(-1.0), np.float32(1.0))
    d_lo = jnp.abs(sgn * e2m1_magnitude(lo) - ref)
    d_hi = jnp.abs(sgn * e2m1_magnitude(hi) - ref)
    codes = _signed(z, jnp.where(d_lo <= d_hi, lo, hi))
  # Blocks whose guidance is poisoned (NaN scales) or whose input is not finite get codes 0,
  # as the quantizers give them.
  bad = bad | ~jnp.all(jnp.isfinite(_blocks(xf, block)), axis=-1)
  return _unblock(jnp.where(bad[..., None], jnp.uint8(0), _blocks(codes, block)))


def guided_quantize(x: jax.Array, g: Guidance) -> FP4Tensor:
  """The FP4 tensor with the rollout's scales and guided codes (NaN scale where x is not
  finite)."""
  codes = guided_codes(x, g)
  block = FP4_BLOCKS[g.format]
  x_bad = ~jnp.all(jnp.isfinite(_blocks(x.astype(jnp.float32), block)), axis=-1)
  bits = jax.lax.bitcast_convert_type(g.block_scale, jnp.uint8)
  if g.format == "mxfp4":
    scale = jax.lax.bitcast_convert_type(jnp.where(x_bad, jnp.uint8(0xFF), bits),
                                         jnp.float8_e8m0fnu)
    return MXFP4Tensor(codes=codes, block_scale=scale)
  block_scale = exact.bits_to_e4m3(jnp.where(x_bad, jnp.uint8(0x7F), bits))
  return NVFP4Tensor(codes=codes, block_scale=block_scale, tensor_scale=g.row_scale)
