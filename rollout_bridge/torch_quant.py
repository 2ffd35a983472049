"""Torch twin of `trace_jax.quant` (docs/design.md §3), for rollout servers (SGLang plugin).

Written as the literal formulas, in IEEE float32: this file is the reference the
exact-arithmetic JAX quantizers reproduce bit for bit. Every division goes through `_div`
with a full tensor divisor: on CUDA, torch turns division by a Python scalar into a
multiplication by its reciprocal (measured on the H200: 3,681 of 16,384 row scales
`amax / 2688` off by one ulp), while tensor-by-tensor division is IEEE-rounded. Rounding
to E2M1 is nearest-grid-point search with ties to the even code, an algorithm independent of
the JAX side's comparison ladder; E4M3 rounding is torch's own float8 cast.

Edge behaviour is the same as in `trace_jax/quant/formats.py`: subnormal inputs count as
zero of the same sign; E2M1 codes keep the sign of zero (a negative value that rounds to zero,
and -0, get code 8, as ModelOpt, torchao and the hardware's E2M1 convert do; docs/numerics.md);
a block holding NaN/Inf (or under a NaN second-level scale) gets a NaN block scale and codes 0.
Eager torch calls raise on non-finite input unless `allow_nonfinite=True`.
"""

from __future__ import annotations

import dataclasses

import torch

E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float32)
NVFP4_BLOCK = 16
MXFP4_BLOCK = 32
FP8_GROUP = 128
E4M3_MAX = 448.0
E4M3_MIN_NORMAL = 2.0**-6
AMAX_FLOOR = 2.0**-100
FLT_MIN_NORMAL = 2.0**-126


@dataclasses.dataclass
class NVFP4Tensor:
  codes: torch.Tensor          # uint8, shape of x
  block_scale: torch.Tensor    # float8_e4m3fn, x.shape[:-1] + (K // 16,)
  tensor_scale: torch.Tensor | None = None  # float32, broadcastable to x.shape[:-1] + (1,)


@dataclasses.dataclass
class MXFP4Tensor:
  codes: torch.Tensor          # uint8, shape of x
  block_scale: torch.Tensor    # float8_e8m0fnu, x.shape[:-1] + (K // 32,)
  tensor_scale: None = None


@dataclasses.dataclass
class FP8Tensor:
  values: torch.Tensor         # float8_e4m3fn
  scale: torch.Tensor          # float32 per block
  block_rows: int = 1


def _prepare(x: torch.Tensor, block: int, name: str, allow_nonfinite: bool) -> torch.Tensor:
  if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float32, torch.bfloat16,
                                                         torch.float16):
    raise TypeError(f"{name}: expected a float32/bfloat16/float16 tensor, got "
                    f"{getattr(x, 'dtype', type(x))}")
  if x.dim() == 0:
    raise ValueError(f"{name}: expected at least 1 dimension (the contraction axis)")
  if x.shape[-1] % block:
    raise ValueError(f"{name}: contraction size {x.shape[-1]} (last axis of shape "
                     f"{tuple(x.shape)}) is not divisible by the block size {block}")
  x = x.float()
  if not allow_nonfinite:
    bad = int((~torch.isfinite(x)).sum())
    if bad:
      raise ValueError(f"{name}: input holds {bad} non-finite values (NaN/Inf)")
  return flush_subnormal(x)


def _div(a: torch.Tensor | float, b: torch.Tensor | float) -> torch.Tensor:
  """IEEE float32 a / b on every device: both operands as full tensors, never a scalar."""
  if not isinstance(a, torch.Tensor):
    a = torch.full_like(b, a)
  if not isinstance(b, torch.Tensor):
    b = torch.full_like(a, b)
  a, b = torch.broadcast_tensors(a, b)
  return torch.div(a.contiguous(), b.contiguous())


def flush_subnormal(x: torch.Tensor) -> torch.Tensor:
  """Subnormal float32 values become a zero of the same sign."""
  sub = (x.abs() < FLT_MIN_NORMAL) & (x != 0)
  return torch.where(sub, torch.copysign(torch.zeros_like(x), x), x)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
  return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _unblock(x: torch.Tensor) -> torch.Tensor:
  return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])


def _amax(xb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
  finite = torch.isfinite(xb).all(dim=-1)
  amax = torch.where(torch.isfinite(xb), xb.abs(), torch.zeros_like(xb)).amax(dim=-1)
  return amax, ~finite


# ----------------------------------------------------------------------------- E2M1

def e2m1_encode(y: torch.Tensor) -> torch.Tensor:
  """E2M1 codes of float values: nearest grid point, ties to the even code, saturating at 6;
  the sign from the sign bit, zero included (-0 and negative values that round to zero: code 8).
  NaN gives code 0."""
  y = flush_subnormal(y.float())
  a = y.abs().clamp(max=6.0)
  grid = E2M1_GRID.to(y.device)
  dist = (a.unsqueeze(-1) - grid).abs()
  best = dist.min(dim=-1, keepdim=True).values
  cand = dist == best
  # Among equidistant neighbours prefer the even code (mantissa bit 0).
  even = torch.arange(8, device=y.device) % 2 == 0
  pick = torch.where(cand & even, 0, torch.where(cand, 1, 2)).to(torch.int32)
  mag = (pick * 8 + torch.arange(8, device=y.device)).argmin(dim=-1) % 8
  mag = torch.where(torch.isnan(y), torch.zeros_like(mag), mag)
  neg = torch.signbit(y) & ~torch.isnan(y)
  return (mag + neg.to(mag.dtype) * 8).to(torch.uint8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
  c = codes.to(torch.int64)
  mag = E2M1_GRID.to(codes.device)[c & 7]
  return torch.where((c & 8) != 0, -mag, mag)


def e2m1_values_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
  """True where E2M1 codes encode the same value: equal codes, or +0 (code 0) and -0 (code 8)."""
  return (a == b) | (((a | b) & 7) == 0)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
  """Two codes per byte, element 2i in the low nibble (NVFP4 checkpoint order)."""
  if codes.shape[-1] % 2:
    raise ValueError(f"pack_fp4: last axis must be even, got shape {tuple(codes.shape)}")
  c = codes.to(torch.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
  return (c[..., 0] & 0xF) | ((c[..., 1] & 0xF) << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
  p = packed.to(torch.uint8)
  return torch.stack([p & 0xF, p >> 4], dim=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)


# ----------------------------------------------------------------------------- NVFP4

def nvfp4_tensor_scale(x: torch.Tensor, dims: tuple[int, ...] | None = None) -> torch.Tensor:
  """`max(amax, 2**-100) / (448 * 6)` over `dims` (kept); NaN where the input is non-finite."""
  xf = flush_subnormal(x.float())
  dims = tuple(range(xf.dim())) if dims is None else tuple(d % xf.dim() for d in dims)
  finite = torch.isfinite(xf)
  for d in dims:
    finite = finite.all(dim=d, keepdim=True)
  amax = torch.where(torch.isfinite(xf), xf.abs(), torch.zeros_like(xf)).amax(dim=dims,
                                                                              keepdim=True)
  ts = _div(amax.clamp(min=AMAX_FLOOR), 448.0 * 6.0)
  return torch.where(finite, ts, torch.full_like(ts, float("nan")))


def nvfp4_row_scale(x: torch.Tensor) -> torch.Tensor:
  return nvfp4_tensor_scale(x, dims=(-1,))


def nvfp4_quantize(x: torch.Tensor, tensor_scale: torch.Tensor | None = None, *,
                   allow_nonfinite: bool = False) -> NVFP4Tensor:
  """NVFP4, docs/design.md §3.2 written literally.

  bs = clamp(amax/6 [/ts]) -> E4M3; y = x*(1/bs).
  """
  xf = _prepare(x, NVFP4_BLOCK, "nvfp4_quantize", allow_nonfinite)
  xb = _blocks(xf, NVFP4_BLOCK)
  amax, bad = _amax(xb)
  if tensor_scale is None:
    bs = _div(amax, 6.0)
  else:
    ts = tensor_scale.float()
    bad = bad | ~torch.isfinite(ts)
    bs = _div(_div(amax, 6.0), torch.where(torch.isfinite(ts), ts, torch.ones_like(ts)))
  bs8 = bs.clamp(E4M3_MIN_NORMAL, E4M3_MAX).to(torch.float8_e4m3fn)
  bsf = bs8.float()
  if tensor_scale is None:
    inv = _div(1.0, bsf)
  else:
    inv = _div(_div(1.0, torch.where(torch.isfinite(ts), ts, torch.ones_like(ts))), bsf)
  y = (xb * inv.unsqueeze(-1)).clamp(-6.0, 6.0)
  codes = e2m1_encode(y)  # sign of zero kept
  codes = torch.where(bad.unsqueeze(-1), torch.zeros_like(codes), codes)
  bs8 = torch.where(bad, torch.full_like(bsf, float("nan")), bsf).to(torch.float8_e4m3fn)
  return NVFP4Tensor(codes=_unblock(codes), block_scale=bs8,
                     tensor_scale=None if tensor_scale is None else tensor_scale.float())


def nvfp4_dequantize(q: NVFP4Tensor) -> torch.Tensor:
  vals = _blocks(e2m1_decode(q.codes), NVFP4_BLOCK)
  out = _unblock(vals * q.block_scale.float().unsqueeze(-1))
  if q.tensor_scale is not None:
    out = out * q.tensor_scale
  return out


# ----------------------------------------------------------------------------- MXFP4

def mxfp4_quantize(x: torch.Tensor, tensor_scale: None = None, *,
                   allow_nonfinite: bool = False) -> MXFP4Tensor:
  """MXFP4: scale 2**(floor(log2(amax)) - 2) per 32 elements; all-zero block -> byte 0."""
  if tensor_scale is not None:
    raise ValueError("mxfp4_quantize: MXFP4 has no second-level scale; pass tensor_scale=None")
  xf = _prepare(x, MXFP4_BLOCK, "mxfp4_quantize", allow_nonfinite)
  xb = _blocks(xf, MXFP4_BLOCK)
  amax, bad = _amax(xb)
  zero = amax == 0
  _, exp = torch.frexp(torch.where(zero | bad, torch.ones_like(amax), amax))
  e = (exp.to(torch.int32) - 1 - 2).clamp(-127, 127)  # frexp mantissa in [0.5, 1)
  e = torch.where(zero, torch.full_like(e, -127), e)
  y = torch.ldexp(xb, (-e).unsqueeze(-1).to(torch.float32)).clamp(-6.0, 6.0)
  codes = e2m1_encode(y)  # sign of zero kept
  codes = torch.where(bad.unsqueeze(-1), torch.zeros_like(codes), codes)
  byte = torch.where(bad, torch.full_like(e, 255), e + 127).to(torch.uint8)
  return MXFP4Tensor(codes=_unblock(codes), block_scale=byte.view(torch.float8_e8m0fnu))


def mxfp4_dequantize(q: MXFP4Tensor) -> torch.Tensor:
  byte = q.block_scale.view(torch.uint8).to(torch.int32)
  vals = _blocks(e2m1_decode(q.codes), MXFP4_BLOCK)
  out = torch.ldexp(vals, (byte - 127).unsqueeze(-1).to(torch.float32))
  out = torch.where((byte == 255).unsqueeze(-1), torch.full_like(out, float("nan")), out)
  return flush_subnormal(_unblock(out))


# ----------------------------------------------------------------------------- FP8

def _fp8_encode(x: torch.Tensor, s: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
  inv = _div(1.0, s)
  v = (x * inv).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
  v = torch.where((v == 0) | bad, torch.zeros_like(v), v)
  return v.to(torch.float8_e4m3fn)


def fp8_quantize_act(x: torch.Tensor, *, allow_nonfinite: bool = False) -> FP8Tensor:
  """E4M3, one scale `max(amax, 2**-100) / 448` per 1 x 128 group."""
  xf = _prepare(x, FP8_GROUP, "fp8_quantize_act", allow_nonfinite)
  xb = _blocks(xf, FP8_GROUP)
  amax, bad = _amax(xb)
  s = _div(amax.clamp(min=AMAX_FLOOR), E4M3_MAX)
  values = _unblock(_fp8_encode(xb, s.unsqueeze(-1), bad.unsqueeze(-1)))
  return FP8Tensor(values=values, scale=torch.where(bad, torch.full_like(s, float("nan")), s))


def fp8_quantize_weight(w: torch.Tensor, *, allow_nonfinite: bool = False) -> FP8Tensor:
  """E4M3 for [..., N, K] weights, one scale per 128 x 128 block."""
  wf = _prepare(w, FP8_GROUP, "fp8_quantize_weight", allow_nonfinite)
  if w.dim() < 2 or w.shape[-2] % FP8_GROUP:
    raise ValueError(f"fp8_quantize_weight: expected [..., N, K] with N and K multiples of "
                     f"{FP8_GROUP}, got shape {tuple(w.shape)}")
  n, k = w.shape[-2:]
  wb = wf.reshape(*w.shape[:-2], n // FP8_GROUP, FP8_GROUP, k // FP8_GROUP, FP8_GROUP)
  finite = torch.isfinite(wb)
  amax = torch.where(finite, wb.abs(), torch.zeros_like(wb)).amax(dim=(-3, -1))
  bad = ~finite.all(dim=-1).all(dim=-2)
  s = _div(amax.clamp(min=AMAX_FLOOR), E4M3_MAX)
  values = _fp8_encode(wb, s[..., :, None, :, None], bad[..., :, None, :, None])
  return FP8Tensor(values=values.reshape(w.shape),
                   scale=torch.where(bad, torch.full_like(s, float("nan")), s),
                   block_rows=FP8_GROUP)


def fp8_dequantize(q: FP8Tensor) -> torch.Tensor:
  v = q.values.float()
  if q.block_rows == 1:
    return _unblock(_blocks(v, FP8_GROUP) * q.scale.unsqueeze(-1))
  n, k = v.shape[-2:]
  vb = v.reshape(*v.shape[:-2], n // FP8_GROUP, FP8_GROUP, k // FP8_GROUP, FP8_GROUP)
  return (vb * q.scale[..., :, None, :, None]).reshape(v.shape)


# ----------------------------------------------------------------------------- guidance

def pack_bits(bits: torch.Tensor) -> torch.Tensor:
  """0/1 values packed 8 per byte along the last axis, element 8i+j in bit j of byte i."""
  if bits.shape[-1] % 8:
    raise ValueError(f"pack_bits: last axis must be a multiple of 8, got {tuple(bits.shape)}")
  b = bits.to(torch.int32).reshape(*bits.shape[:-1], bits.shape[-1] // 8, 8)
  weights = (1 << torch.arange(8, device=bits.device, dtype=torch.int32))
  return (b * weights).sum(dim=-1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor) -> torch.Tensor:
  shifts = torch.arange(8, device=packed.device, dtype=torch.uint8)
  b = (packed.unsqueeze(-1) >> shifts) & 1
  return b.reshape(*packed.shape[:-1], packed.shape[-1] * 8)


def guidance_record(q: NVFP4Tensor, mode: str = "compact") -> dict[str, torch.Tensor]:
  """Rollout guidance from a two-level NVFP4 quantization: the arrays of `quant.Guidance`."""
  if q.tensor_scale is None:
    raise ValueError("guidance needs two-level NVFP4 (per-row second-level scale)")
  rec = {"block_scale": q.block_scale,
         "row_scale": q.tensor_scale.float().expand(*q.codes.shape[:-1], 1).contiguous()}
  if mode == "compact":
    rec["mantissa"] = pack_bits(q.codes & 1)
  elif mode == "full":
    rec["codes"] = pack_fp4(q.codes)
  else:
    raise ValueError(f"unknown guidance mode {mode!r}; expected 'compact' or 'full'")
  return rec


def guided_codes(x: torch.Tensor, rec: dict[str, torch.Tensor]) -> torch.Tensor:
  """Training-side guided rounding (docs/design.md §3.5) with the rollout's scales and record.

  Written as the definition: among the E2M1 grid points at distance < one step from z, the
  two that bracket z, pick by mantissa bit (compact) or by distance to the rollout value (full).
  """
  xf = flush_subnormal(x.float())
  bs = rec["block_scale"].float()
  ts = rec["row_scale"].float()
  inv = _div(_div(1.0, ts), bs)
  z = _unblock((_blocks(xf, NVFP4_BLOCK) * inv.unsqueeze(-1)).clamp(-6.0, 6.0))
  a = z.abs()
  grid = E2M1_GRID.to(x.device)
  lo = (a.unsqueeze(-1) >= grid).sum(dim=-1) - 1
  hi = torch.where(grid[lo] == a, lo, (lo + 1).clamp(max=7))
  if "mantissa" in rec:
    bit = unpack_bits(rec["mantissa"]).to(lo.dtype)
    mag = torch.where((lo % 2) == bit, lo, hi)
  else:
    ref = e2m1_decode(unpack_fp4(rec["codes"]))
    sgn = torch.where(torch.signbit(z), -1.0, 1.0)
    mag = torch.where((sgn * grid[lo] - ref).abs() <= (sgn * grid[hi] - ref).abs(), lo, hi)
  codes = (mag + torch.signbit(z).to(mag.dtype) * 8).to(torch.uint8)  # sign of zero kept
  x_bad = ~torch.isfinite(_blocks(xf, NVFP4_BLOCK)).all(-1)
  bad = ~torch.isfinite(bs) | ~torch.isfinite(ts) | x_bad
  return _unblock(torch.where(bad.unsqueeze(-1), torch.zeros_like(_blocks(codes, NVFP4_BLOCK)),
                              _blocks(codes, NVFP4_BLOCK)))
