"""The direct bit-exactness checks of `gpu_check`, runnable on any backend: exhaustive E2M1 and
E4M3 element checks against ml_dtypes, the platform trap (naive `astype` round trips under jit,
counted), the sign of zero in E2M1 codes, JAX against the torch twin bit for bit on random and
adversarial data (`parity_data`), and the straight-through gradient. Each check reports into a
`Checks` collection (pass, fail or skip, with the count of differing elements)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from experiments import common

E2M1_MIDPOINTS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


class Checks:
  """Collects named check results: ok True (pass), False (fail) or None (skipped)."""

  def __init__(self) -> None:
    self.results: list[dict[str, Any]] = []

  def add(self, name: str, ok: bool | None, detail: str = "", **extra: Any) -> bool | None:
    tag = {True: "PASS", False: "FAIL", None: "SKIP"}[ok]
    self.results.append({"name": name, "status": tag, "detail": detail, **extra})
    print(f"[{tag}] {name}: {detail}", flush=True)
    return ok

  def mismatch(self, name: str, got: Any, want: Any, codes: bool = False) -> bool:
    """Bitwise comparison of two arrays; passes when every element's bits agree.

    Parity is about bytes, so E2M1 codes 0 and 8 (+0 and -0) differ here. codes=True (E2M1
    code arrays) also reports how many mismatches are only that sign of zero (equal values,
    `formats.e2m1_values_equal`), which tells a sign-of-zero bug from a rounding bug.
    """
    g, w = common.bits(np.asarray(got)), common.bits(np.asarray(want))
    if g.shape != w.shape:
      return bool(self.add(name, False, f"shape {g.shape} != {w.shape}"))
    bad = int(np.sum(g != w))
    detail = f"{bad} of {g.size} differ"
    if bad and codes:
      from trace_jax.quant import formats

      zero_sign = bad - int(np.sum(~formats.e2m1_values_equal(g, w)))
      detail += f", {zero_sign} of them only in the sign of zero (code 0 vs 8)"
    if bad:
      idx = np.flatnonzero(g.reshape(-1) != w.reshape(-1))[:3]
      detail += f" (first at flat {idx.tolist()}: got {g.reshape(-1)[idx].tolist()}, want " \
                f"{w.reshape(-1)[idx].tolist()})"
    return bool(self.add(name, bad == 0, detail, mismatches=bad, total=int(g.size)))

  def guard(self, name: str, fn: Callable[[], Any]) -> Any:
    """Runs fn; an exception becomes a failed check named `name` (the run goes on)."""
    try:
      return fn()
    except Exception as e:  # report, keep checking the rest
      import traceback

      traceback.print_exc()
      self.add(name, False, f"raised {type(e).__name__}: {str(e)[:300]}")
      return None

  @property
  def failed(self) -> list[str]:
    return [r["name"] for r in self.results if r["status"] == "FAIL"]


def all_finite_bf16() -> np.ndarray:
  """Every finite bfloat16 value (65,280 bit patterns) as an ml_dtypes array."""
  import ml_dtypes

  b = np.arange(2**16, dtype=np.uint16).view(ml_dtypes.bfloat16)
  return b[np.isfinite(b.astype(np.float32))]


def check_exhaustive(checks: Checks) -> None:
  """E2M1 encoding of every finite bf16, E4M3 rounding of every bf16 in [-448, 448] and at
  float32 neighbours of every E4M3 tie, against ml_dtypes, all under jit."""
  import jax
  import jax.numpy as jnp
  import ml_dtypes

  from trace_jax.quant import exact, formats

  print("\n== 2. exhaustive element checks under jax.jit", flush=True)
  vals = all_finite_bf16()
  want = vals.astype(np.float32).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
  enc = jax.jit(formats.e2m1_encode)
  checks.mismatch("e2m1_encode_all_finite_bf16", enc(jnp.asarray(vals)), want)
  checks.mismatch("e2m1_encode_all_finite_bf16_as_f32", enc(jnp.asarray(vals.astype(np.float32))),
                  want)
  dec = jax.jit(formats.e2m1_decode)(jnp.arange(16, dtype=jnp.uint8))
  checks.mismatch("e2m1_decode_all_codes", dec,
                  np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32))

  f32 = vals.astype(np.float32)
  in_range = f32[np.abs(f32) <= 448]
  # float32 neighbours of every E4M3 tie (midpoints between adjacent E4M3 magnitudes).
  e4 = np.arange(0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
  e4 = np.unique(e4[np.isfinite(e4)])
  mids = ((e4[:-1].astype(np.float64) + e4[1:]) / 2).astype(np.float32)
  near = np.concatenate([mids, np.nextafter(mids, np.float32(np.inf)),
                         np.nextafter(mids, np.float32(0))])
  near = np.concatenate([near, -near])
  rnd = jax.jit(lambda v: (exact.round_to_e4m3(v), exact.e4m3_to_bits(exact.round_to_e4m3(v))))
  for name, x in (("bf16_in_448", in_range), ("f32_at_ties", near)):
    got_v, got_b = rnd(jnp.asarray(x))
    ref = x.astype(ml_dtypes.float8_e4m3fn)
    checks.mismatch(f"e4m3_round_{name}_values", got_v, ref.astype(np.float32))
    checks.mismatch(f"e4m3_round_{name}_bits", got_b, ref.view(np.uint8))


def check_platform_trap(checks: Checks) -> dict[str, int]:
  """The trap of docs/numerics.md (fact 1), counted on this backend, and our quantizers on it."""
  import jax
  import jax.numpy as jnp
  import ml_dtypes

  from trace_jax.quant import exact, formats

  print("\n== 2. platform trap: naive astype round trips under jit vs our quantizer",
        flush=True)
  v = np.linspace(-5.9, 5.9, 10001).astype(np.float32)
  ref4 = v.astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
  ref8 = v.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
  s = np.float32(0.37)
  refs = (np.clip(v / s, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)) * s
  naive = {
      "astype(f4).astype(f32)": (jax.jit(
          lambda x: x.astype(jnp.float4_e2m1fn).astype(jnp.float32))(v), ref4),
      "astype(f8_e4m3fn).astype(f32)": (jax.jit(
          lambda x: x.astype(jnp.float8_e4m3fn).astype(jnp.float32))(v), ref8),
      "clip(x/s).astype(f4).astype(f32)*s": (jax.jit(
          lambda x: jnp.clip(x / s, -6, 6).astype(jnp.float4_e2m1fn).astype(jnp.float32) * s)(v),
          refs),
  }
  counts = {}
  for name, (got, ref) in naive.items():
    counts[name] = int(np.sum(np.asarray(got) != ref))
    print(f"  naive {name:38s} {counts[name]:6d} of {v.size} values not quantized "
          f"as ml_dtypes does ({jax.default_backend()}, default flags)")
  ours4 = jax.jit(lambda x: formats.e2m1_decode(formats.e2m1_encode(x)))(v)
  ours8 = jax.jit(exact.round_to_e4m3)(v)
  checks.mismatch("trap_ours_e2m1_round_trip", ours4, ref4)
  checks.mismatch("trap_ours_e4m3_round_trip", ours8, ref8)
  return counts


def parity_data(n_log2: int, k: int, seed: int) -> np.ndarray:
  """float32 [rows, k] test data: magnitudes 2**-20..2**20 per block, per element and per row,
  plus adversarial blocks (E2M1 ties under exact E4M3 scales, E4M3 scale ties, saturation
  edges, all-zero blocks, blocks whose scale underflows E4M3, float32 subnormals)."""
  import ml_dtypes

  rng = np.random.default_rng(seed)
  rows = max(2**n_log2 // k, 128)
  nb = k // 16
  shares = {"block": 0.35, "element": 0.2, "row": 0.25}
  counts = {name: int(rows * f) for name, f in shares.items()}
  counts["adv"] = rows - sum(counts.values())
  parts = []
  r = counts["block"]
  mag = 2.0 ** rng.uniform(-20, 20, (r, nb, 1))
  parts.append((mag * rng.standard_normal((r, nb, 16))).reshape(r, k))
  r = counts["element"]
  parts.append(rng.choice([-1.0, 1.0], (r, k)) * 2.0 ** rng.uniform(-20, 20, (r, k)))
  r = counts["row"]
  outlier = np.where(rng.random(k) < 0.02, 16.0, 1.0)
  parts.append(2.0 ** rng.uniform(-20, 20, (r, 1)) * rng.standard_normal((r, k)) * outlier)

  r = counts["adv"]
  e4 = np.arange(0x08, 0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
  e4 = e4[(e4 >= 2.0**-6) & (e4 <= 448)]
  blocks = np.zeros((r, nb, 16))
  kind = rng.integers(0, 6, (r, nb))
  bs = rng.choice(e4, (r, nb, 1))
  pts = np.concatenate([E2M1_MIDPOINTS, E2M1_GRID]).astype(np.float64)
  ties = rng.choice(pts, (r, nb, 16)) * rng.choice([-1.0, 1.0], (r, nb, 16)) * bs
  ties[..., 0] = 6.0 * bs[..., 0]  # amax = 6 * bs, so amax / 6 is exactly the E4M3 value bs
  blocks = np.where((kind == 0)[..., None], ties, blocks)
  lo = rng.choice(e4[:-1], (r, nb, 1))
  hi = e4[np.searchsorted(e4, lo[..., 0]) + 1][..., None]
  stie = rng.uniform(-1, 1, (r, nb, 16)) * 6.0 * (lo + hi) / 2
  stie[..., 0] = 6.0 * (lo[..., 0] + hi[..., 0]) / 2  # block scale exactly at an E4M3 tie
  blocks = np.where((kind == 1)[..., None], stie, blocks)
  sat = 6.0 * bs * (1.0 + rng.choice([-2.0**-20, 0.0, 2.0**-20, 2.0**-4], (r, nb, 16)))
  sat *= rng.choice([-1.0, 1.0], (r, nb, 16))
  blocks = np.where((kind == 2)[..., None], sat, blocks)
  # kind 3: all-zero blocks (left as zeros)
  under = 2.0 ** rng.uniform(-30, -12, (r, nb, 1)) * rng.standard_normal((r, nb, 16))
  blocks = np.where((kind == 4)[..., None], under, blocks)
  sub = rng.choice([0.0, 1e-39, -1e-39, 2.0**-127, 1.0], (r, nb, 16))
  blocks = np.where((kind == 5)[..., None], sub, blocks)
  parts.append(blocks.reshape(r, k))
  x = np.concatenate(parts).astype(np.float32)
  return x[rng.permutation(rows)]


def _to_torch(a: np.ndarray, device: str) -> Any:
  """A torch tensor with exactly the bits of a numpy float32 or ml_dtypes bfloat16 array."""
  import ml_dtypes
  import torch

  if a.dtype == ml_dtypes.bfloat16:
    return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).to(device)
  return torch.from_numpy(np.ascontiguousarray(a)).to(device)


def _np(t: Any) -> np.ndarray:
  """numpy bits of a torch tensor (float8/bfloat16 as unsigned integers)."""
  import torch

  t = t.detach().cpu()
  if t.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.uint8):
    return t.view(torch.uint8).numpy()
  if t.dtype == torch.bfloat16:
    return t.view(torch.int16).numpy().view(np.uint16)
  return t.numpy()


def _quantized(m: Any, x: Any) -> dict[str, Any]:
  """The quantizations of x by module m (`trace_jax.quant` or its torch twin
  `rollout_bridge.torch_quant`: the same names) that both compare as they are."""
  q1 = m.nvfp4_quantize(x)
  rs = m.nvfp4_row_scale(x)
  q2 = m.nvfp4_quantize(x, rs)
  ts = m.nvfp4_tensor_scale(x)
  qt = m.nvfp4_quantize(x, ts)
  qm = m.mxfp4_quantize(x)
  q8 = m.fp8_quantize_act(x)
  q8w = m.fp8_quantize_weight(x[:(x.shape[0] // 128) * 128])
  return {
      "nvfp4_1level/codes": q1.codes, "nvfp4_1level/block_scale": q1.block_scale,
      "nvfp4_1level/dequant": m.nvfp4_dequantize(q1),
      "nvfp4_row/codes": q2.codes, "nvfp4_row/block_scale": q2.block_scale,
      "nvfp4_row/row_scale": rs, "nvfp4_row/dequant": m.nvfp4_dequantize(q2),
      "nvfp4_tensor/tensor_scale": ts, "nvfp4_tensor/codes": qt.codes,
      "nvfp4_tensor/block_scale": qt.block_scale,
      "mxfp4/codes": qm.codes, "mxfp4/block_scale": qm.block_scale,
      "mxfp4/dequant": m.mxfp4_dequantize(qm),
      "fp8_act/values": q8.values, "fp8_act/scale": q8.scale,
      "fp8_act/dequant": m.fp8_dequantize(q8),
      "fp8_weight/values": q8w.values, "fp8_weight/scale": q8w.scale,
  }


def _jax_all(x: Any) -> dict[str, Any]:
  """Every JAX quantization under test of one input (traced once under jit)."""
  from trace_jax import quant

  return {**_quantized(quant, x),
          "fake_quant_nvfp4": quant.fake_quant_act(x, "nvfp4"),
          "fake_quant_mxfp4": quant.fake_quant_act(x, "mxfp4"),
          "fake_quant_fp8": quant.fake_quant_act(x, "fp8"),
          "fake_quant_weight_nvfp4": quant.fake_quant_weight(x, "nvfp4")}


def _torch_all(x: Any) -> dict[str, Any]:
  """The torch twin's results for the keys of `_jax_all` (its fake quantization: the
  dequantized values in x's dtype)."""
  from rollout_bridge import torch_quant as tq

  out = _quantized(tq, x)
  wq = tq.nvfp4_quantize(x, tq.nvfp4_tensor_scale(x, dims=(-2, -1)))
  return {**out, "fake_quant_nvfp4": out["nvfp4_row/dequant"].to(x.dtype),
          "fake_quant_mxfp4": out["mxfp4/dequant"].to(x.dtype),
          "fake_quant_fp8": out["fp8_act/dequant"].to(x.dtype),
          "fake_quant_weight_nvfp4": tq.nvfp4_dequantize(wq).to(x.dtype)}


def check_parity(checks: Checks, n_log2: int, device: str, seed: int, k: int = 2048) -> None:
  """JAX (jitted, default backend) vs the torch twin on `device`, bit for bit."""
  import jax
  import jax.numpy as jnp
  import ml_dtypes
  import torch

  from rollout_bridge import torch_quant as tq
  from trace_jax import quant

  x32 = parity_data(n_log2, k, seed)
  print(f"\n== 2. parity with the torch twin on {device}: {x32.size} elements "
        f"[{x32.shape[0]}, {k}] per dtype, magnitudes 2**-20..2**20 + adversarial blocks",
        flush=True)
  rng = np.random.default_rng(seed + 1)
  drift = (x32.astype(np.float64) * (1 + 1e-3 * rng.standard_normal(x32.shape))).astype(np.float32)
  jax_all = jax.jit(_jax_all)

  @jax.jit
  def jax_guided(x, xt):
    out = {}
    for mode in ("compact", "full"):
      _, g = quant.quantize_act_record(x, mode)
      out[f"guided_{mode}"] = quant.guided_codes(xt, g)
      out[f"record_{mode}"] = g
    return out

  for dname in ("bfloat16", "float32"):
    if dname == "bfloat16":
      xh, xth = x32.astype(ml_dtypes.bfloat16), drift.astype(ml_dtypes.bfloat16)
    else:
      xh, xth = x32, drift
    t0 = time.perf_counter()
    got = jax.device_get(jax_all(jnp.asarray(xh)))
    got_g = jax.device_get(jax_guided(jnp.asarray(xh), jnp.asarray(xth)))
    t_jax = time.perf_counter() - t0
    xt, xtt = _to_torch(xh, device), _to_torch(xth, device)
    t0 = time.perf_counter()
    with torch.inference_mode():
      want = {k_: _np(v) for k_, v in _torch_all(xt).items()}
      q2 = tq.nvfp4_quantize(xt, tq.nvfp4_row_scale(xt))
      for mode in ("compact", "full"):
        rec = tq.guidance_record(q2, mode)
        want[f"guided_{mode}"] = _np(tq.guided_codes(xtt, rec))
        want[f"record_{mode}"] = {k_: _np(v) for k_, v in rec.items()}
    t_torch = time.perf_counter() - t0
    print(f"  {dname}: jax {t_jax:.1f} s (incl. compile), torch {t_torch:.1f} s", flush=True)
    for key, v in got.items():
      checks.mismatch(f"parity_{dname}_{key}", v, want[key], codes=key.endswith("/codes"))
    for mode in ("compact", "full"):
      checks.mismatch(f"parity_{dname}_guided_{mode}", got_g[f"guided_{mode}"],
                      want[f"guided_{mode}"], codes=True)
      g = got_g[f"record_{mode}"]
      field = "mantissa" if mode == "compact" else "codes"
      for f in ("block_scale", "row_scale", field):
        checks.mismatch(f"parity_{dname}_record_{mode}/{f}", getattr(g, f),
                        want[f"record_{mode}"][f])


def _sign_of_zero_scale(rows: int, k: int) -> np.ndarray:
  """The exact block scale 2**j of `sign_of_zero_data`, per 16-block [rows, k // 16]."""
  r, b = np.arange(rows)[:, None], np.arange(k // 16)[None]
  return (2.0 ** ((r + b // 2) % 15 - 6)).astype(np.float32)


def sign_of_zero_data(rows: int = 64, k: int = 64) -> np.ndarray:
  """float32 [rows, k] whose 16- and 32-blocks have amax 6 * 2**j (so NVFP4 and MXFP4 scales
  are exactly 2**j, j in -6..8) and elements that round to zero: -0, +0, -+0.25 * 2**j (the tie,
  to zero), 2**-20 relative either side of -0.25 * 2**j, small values of both signs, and
  negative float32 subnormals."""
  rng = np.random.default_rng(11)
  small = np.array([-0.0, 0.0, -0.25, 0.25, -0.25 * (1 - 2.0**-20), -0.25 * (1 + 2.0**-20),
                    -0.1, 0.1, -1e-3])
  scale = _sign_of_zero_scale(rows, k).astype(np.float64)
  x = np.zeros((rows, k // 16, 16))
  for r in range(rows):
    for b in range(k // 16):
      vals = rng.choice(small, 13) * scale[r, b]
      vals = np.where(rng.random(13) < 0.1, -1e-40, vals)  # subnormal in float32
      blk = np.concatenate([[6.0 * scale[r, b] * (-1) ** r], vals, [0.75 * scale[r, b],
                                                                    -1.5 * scale[r, b]]])
      x[r, b] = rng.permutation(blk)
  return x.reshape(rows, k).astype(np.float32)


def check_sign_of_zero(checks: Checks, torch_device: str | None) -> None:
  """E2M1 codes keep the sign of zero on this backend (docs/numerics.md): NVFP4 (one- and
  two-level), MXFP4 and guided rounding without drift give code 8 exactly where the input's
  sign bit is set and the magnitude rounds to zero; the single-level codes equal ml_dtypes';
  the torch twin on its device gives the same bytes."""
  import jax
  import jax.numpy as jnp
  import ml_dtypes

  from trace_jax import quant

  print("\n== 2. sign of zero in E2M1 codes under jax.jit", flush=True)
  x = sign_of_zero_data()

  @jax.jit
  def run(v):
    q_row = quant.nvfp4_quantize(v, quant.nvfp4_row_scale(v))
    out = {"nvfp4_1level": quant.nvfp4_quantize(v).codes, "nvfp4_row": q_row.codes,
           "mxfp4": quant.mxfp4_quantize(v).codes}
    for mode in ("compact", "full"):
      out[f"guided_{mode}"] = quant.guided_codes(v, quant.record(q_row, mode))
    return out

  got = jax.device_get(run(jnp.asarray(x)))
  flushed = np.where(np.abs(x) < 2.0**-126, np.copysign(np.float32(0), x), x)
  neg = np.signbit(flushed)
  for name, c in got.items():
    c = np.asarray(c)
    rounds_to_zero = (c & 7) == 0
    want = np.where(rounds_to_zero, np.where(neg, 8, 0), c).astype(np.uint8)
    checks.mismatch(f"sign_of_zero_{name}", c, want, codes=True)
  rows, k = x.shape
  y = flushed.reshape(rows, k // 16, 16) / _sign_of_zero_scale(rows, k)[..., None]  # exact
  ref = y.reshape(rows, k).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
  checks.mismatch("sign_of_zero_nvfp4_1level_vs_ml_dtypes", got["nvfp4_1level"], ref, codes=True)
  checks.mismatch("sign_of_zero_mxfp4_vs_ml_dtypes", got["mxfp4"], ref, codes=True)
  checks.add("sign_of_zero_data_has_negative_zeros",
             bool(np.sum(np.asarray(got["nvfp4_row"]) == 8) > 100),
             f"{int(np.sum(np.asarray(got['nvfp4_row']) == 8))} codes 8 in {x.size}")
  if not torch_device:
    return
  import torch

  from rollout_bridge import torch_quant as tq

  t = torch.from_numpy(x).to(torch_device)
  q_row = tq.nvfp4_quantize(t, tq.nvfp4_row_scale(t))
  want = {"nvfp4_1level": tq.nvfp4_quantize(t).codes, "nvfp4_row": q_row.codes,
          "mxfp4": tq.mxfp4_quantize(t).codes}
  for mode in ("compact", "full"):
    want[f"guided_{mode}"] = tq.guided_codes(t, tq.guidance_record(q_row, mode))
  for name, w in want.items():
    checks.mismatch(f"sign_of_zero_{name}_vs_torch_{torch_device}", got[name], _np(w),
                    codes=True)


def check_grad(checks: Checks) -> None:
  """Straight-through gradient under jit: d/dx sum(fq(x) * c) == bf16(c), in x's dtype."""
  import jax
  import jax.numpy as jnp

  from trace_jax import quant

  print("\n== 2. straight-through gradients under jit", flush=True)
  rng = np.random.default_rng(3)
  x32 = rng.standard_normal((256, 1024)).astype(np.float32)
  c = jnp.asarray(rng.standard_normal((256, 1024)).astype(np.float32))
  for dt in (jnp.bfloat16, jnp.float32):
    x = jnp.asarray(x32).astype(dt)
    for fmt in ("nvfp4", "mxfp4", "fp8"):
      g = jax.jit(jax.grad(lambda v, f=fmt: jnp.sum(quant.fake_quant_act(v, f).astype(
          jnp.float32) * c)))(x)
      want = np.asarray(c.astype(jnp.bfloat16).astype(dt))
      if g.dtype != dt:
        checks.add(f"ste_grad_{fmt}_{jnp.dtype(dt).name}", False, f"dtype {g.dtype} != {dt}")
      else:
        checks.mismatch(f"ste_grad_{fmt}_{jnp.dtype(dt).name}", g, want)
