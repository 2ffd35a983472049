"""The independent numpy reference of the quantizers, written from docs/design.md §3.2-3.4 with
numpy's IEEE float32 arithmetic, ml_dtypes' float8_e4m3fn / float4_e2m1fn casts and float64
products: the third implementation next to the JAX quantizers and the torch twin (importable as
`numpy_ref` from every test directory, as `cases` is). No XLA program is compiled, so the GPU's
tests can use it without compiling a quantizer for XLA's CPU backend.
"""

from __future__ import annotations

import cases
import numpy as np

F32 = cases.F32
E4M3 = cases.E4M3
E2M1 = cases.E2M1
GRID16 = np.concatenate([cases.E2M1_GRID, -cases.E2M1_GRID])


def flush(x: np.ndarray) -> np.ndarray:
  """Documented edge behaviour: float32 subnormal inputs count as zeros of the same sign."""
  x = np.asarray(x, F32)
  sub = (np.abs(x) < 2.0**-126) & (x != 0)
  return np.where(sub, np.copysign(F32(0), x), x).astype(F32)


def _amax_bad(xb: np.ndarray, axis) -> tuple[np.ndarray, np.ndarray]:
  finite = np.isfinite(xb)
  return np.where(finite, np.abs(xb), F32(0)).max(axis=axis), ~finite.all(axis=axis)


def _e2m1(y: np.ndarray) -> np.ndarray:
  """ml_dtypes' E2M1 codes (RNE, saturating, sign kept: -0 and negatives that round to zero
  are code 8)."""
  return (np.asarray(y).astype(E2M1).view(np.uint8) & 0xF).astype(np.uint8)


def value(codes: np.ndarray) -> np.ndarray:
  return GRID16[codes.astype(np.int64)]


def ref_tensor_scale(x: np.ndarray, axes: tuple[int, ...] | None) -> np.ndarray:
  """ts = max(amax, 2**-100) / (448 * 6) in IEEE float32; NaN if the reduced part is not finite."""
  x = flush(x)
  axes = tuple(range(x.ndim)) if axes is None else axes
  finite = np.isfinite(x)
  amax = np.where(finite, np.abs(x), F32(0)).max(axis=axes, keepdims=True)
  ts = np.maximum(amax, F32(2.0**-100)) / F32(2688.0)
  return np.where(finite.all(axis=axes, keepdims=True), ts, F32(np.nan)).astype(F32)


def ref_nvfp4(x: np.ndarray, ts: np.ndarray | None = None) -> dict[str, np.ndarray]:
  """docs/design.md §3.2: bs = clamp(amax/6 [/ ts], 2**-6, 448) -> E4M3 RNE; y = x * (1/bs) or
  x * ((1/ts)/bs); code = RNE_E2M1(clamp(y, -6, 6)); dequant = value * bs [* ts]."""
  with np.errstate(all="ignore"):
    xb = flush(x).reshape(x.shape[:-1] + (x.shape[-1] // 16, 16))
    amax, bad = _amax_bad(xb, -1)
    bs = amax / F32(6)
    if ts is not None:
      ts = np.asarray(ts, F32)
      bad = bad | ~np.isfinite(ts)
      tsv = np.where(np.isfinite(ts), ts, F32(1))
      bs = bs / tsv
    bs8 = np.clip(bs, F32(2.0**-6), F32(448)).astype(F32).astype(E4M3)
    bsf = bs8.astype(F32)
    inv = F32(1) / bsf if ts is None else (F32(1) / tsv) / bsf
    y = np.clip(xb * inv[..., None], F32(-6), F32(6))
    codes = np.where(bad[..., None], 0, _e2m1(y)).astype(np.uint8)
    scale_bytes = np.where(bad, 0x7F, bs8.view(np.uint8)).astype(np.uint8)
    deq = value(codes) * np.where(bad, np.nan, bsf.astype(np.float64))[..., None]
    if ts is not None:
      deq = deq * ts.astype(np.float64)[..., None]
  out = {"codes": codes.reshape(x.shape), "block_scale": scale_bytes,
         "dequant": deq.reshape(x.shape).astype(F32)}
  if ts is not None:
    out["tensor_scale"] = ts
  return out


def ref_mxfp4(x: np.ndarray) -> dict[str, np.ndarray]:
  """docs/design.md §3.3 / OCP MX v1.0: scale 2**(floor(log2 amax) - 2), byte 0 for zero
  blocks."""
  with np.errstate(all="ignore"):
    xb = flush(x).reshape(x.shape[:-1] + (x.shape[-1] // 32, 32))
    amax, bad = _amax_bad(xb, -1)
    _, ex = np.frexp(amax.astype(np.float64))
    e = np.where(amax == 0, -127, np.clip(ex - 1 - 2, -127, 127))
    y = np.clip(np.ldexp(xb.astype(np.float64), -e[..., None]), -6.0, 6.0)
    codes = np.where(bad[..., None], 0, _e2m1(y)).astype(np.uint8)
    deq = value(codes) * np.where(bad, np.nan, np.exp2(e.astype(np.float64)))[..., None]
    deq = flush(deq.astype(F32))  # documented: subnormal results flush to zero
  return {"codes": codes.reshape(x.shape),
          "block_scale": np.where(bad, 255, e + 127).astype(np.uint8),
          "dequant": deq.reshape(x.shape)}


def ref_fp8(x: np.ndarray, block_rows: int) -> dict[str, np.ndarray]:
  """docs/design.md §3.4: s = max(amax, 2**-100) / 448 (IEEE float32),
  v = E4M3(clamp(x * (1/s)))."""
  with np.errstate(all="ignore"):
    xf = flush(x)
    if block_rows == 1:
      xb = xf.reshape(x.shape[:-1] + (x.shape[-1] // 128, 128))
      axes, expand = (-1,), (..., None)
    else:
      n, k = x.shape[-2:]
      xb = xf.reshape(x.shape[:-2] + (n // 128, 128, k // 128, 128))
      axes, expand = (-3, -1), (..., slice(None), None, slice(None), None)
    amax, bad = _amax_bad(xb, axes)
    s = np.maximum(amax, F32(2.0**-100)) / F32(448)
    inv = F32(1) / s
    v = np.clip(xb * inv[expand], F32(-448), F32(448)).astype(E4M3).astype(F32)
    v = np.where((v == 0) | bad[expand], F32(0), v)
    deq = v.astype(np.float64) * np.where(bad, np.nan, s.astype(np.float64))[expand]
  return {"values": v.astype(E4M3).view(np.uint8).reshape(x.shape),
          "scale": np.where(bad, F32(np.nan), s).astype(F32),
          "dequant": deq.astype(F32).reshape(x.shape)}


def dequantize_packed_nvfp4(packed: np.ndarray, scale_bytes: np.ndarray,
                            tensor_scale: np.ndarray) -> np.ndarray:
  """bf16 values of packed NVFP4 [..., N, K]: packed uint8 [..., N, K/2] (element 2i in the low
  nibble), E4M3 scale bytes [..., N, K/16], one float32 tensor scale per leading index [...].
  `formats.nvfp4_dequantize`'s order in IEEE float32 (code value * block scale, exact; *
  tensor scale, one rounding; one rounding to bf16), subnormals kept as the GPU keeps them
  (XLA's CPU runtime flushes them)."""
  import ml_dtypes

  b = np.asarray(packed, np.uint8)
  codes = np.stack([b & 0xF, b >> 4], axis=-1).reshape(*b.shape[:-1], -1)
  bs = np.asarray(scale_bytes, np.uint8).view(E4M3).astype(F32)
  v = value(codes).astype(F32).reshape(*bs.shape, 16) * bs[..., None]
  ts = np.asarray(tensor_scale, F32).reshape(*bs.shape[:-2], 1, 1)
  with np.errstate(all="ignore"):
    w = v.reshape(codes.shape) * ts
  return w.astype(ml_dtypes.bfloat16)
