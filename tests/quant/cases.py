"""Shared test data and checks for the quantization tests (JAX, numpy reference, torch twin).

- `adversarial_cases()`: named float32 arrays [ROWS, K] of hand-built edge cases (E2M1 ties,
  saturation edges, zero blocks, E4M3 scale underflow, E4M3 rounding ties of the scale, ...).
- `random_mixed()`: random data whose magnitudes span 2**-20..2**20, varying per row, per
  block and within blocks.
- `stacked()`: all of the above as chunks [C, ROWS, K]; `jax_results()` runs each jitted JAX
  quantizer of FORMATS once over all of it (cached per process), `jax_guided_results()` the
  rollout record + guided rounding of `stacked_train()`.
- `assert_bits_equal()`: bitwise comparison that fails loudly with the first mismatching
  positions, values and inputs in hex.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from trace_jax import quant

F32 = np.float32
BF16 = ml_dtypes.bfloat16
E4M3 = ml_dtypes.float8_e4m3fn
E2M1 = ml_dtypes.float4_e2m1fn
ROWS, K = 128, 256
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E2M1_MIDPOINTS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
FLT_MAX = float(np.finfo(F32).max)
BF16_MAX = float(ml_dtypes.finfo(BF16).max)
EXPERTS = 4


# ----------------------------------------------------------------------------- bits and hex

def bits(a: np.ndarray) -> np.ndarray:
  """The raw bits of an array as unsigned integers of the same width."""
  a = np.asarray(a)
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def hexs(a: np.ndarray, limit: int = 16) -> str:
  """Elements as 'hexbits(value)', at most `limit` of them (and the amax of the rest)."""
  a = np.asarray(a)
  flat = a.reshape(-1)
  b = bits(flat)
  width = a.dtype.itemsize * 2
  items = []
  for v, u in zip(flat[:limit], b[:limit], strict=False):
    shown = int(v) if a.dtype.kind in "ui" else float(np.float32(v))
    items.append(f"0x{int(u):0{width}x}({shown!r})")
  text = ", ".join(items)
  if flat.size > limit:
    rest = np.abs(flat.astype(np.float64))
    text += f", ... ({flat.size} values, amax {float(np.nanmax(rest)) if rest.size else 0!r})"
  return f"[{text}]" if a.ndim else text


def _canonical(a: np.ndarray) -> np.ndarray:
  """Bits of `a` with every float NaN replaced by one canonical pattern."""
  a = np.asarray(a)
  b = bits(a).copy()
  if a.dtype == np.float32:
    b[np.isnan(a)] = 0x7FC00000
  return b


def to_numpy(a) -> np.ndarray:
  """numpy copy of a JAX array or torch tensor (float8/e8m0 torch tensors come back as uint8)."""
  if hasattr(a, "detach"):  # torch
    import torch

    t = a.detach().cpu()
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu):
      return t.view(torch.uint8).numpy()
    if t.dtype == torch.bfloat16:
      return t.view(torch.int16).numpy().view(BF16)
    return t.numpy()
  a = np.asarray(a)
  if a.dtype in (np.dtype(E4M3), np.dtype(ml_dtypes.float8_e8m0fnu)):
    return a.view(np.uint8)
  return a


def assert_bits_equal(got, want, what: str, context: dict[str, np.ndarray] | None = None,
                      limit: int = 4) -> None:
  """Asserts bit-identical arrays (NaNs of float32 count as equal); reports mismatches in hex.

  `context` maps names to arrays whose leading dims equal the compared shape (e.g. the input
  block behind each block scale); their entries at the first mismatching positions are shown.
  """
  got, want = to_numpy(got), to_numpy(want)
  assert got.shape == want.shape, f"{what}: shape {got.shape} != expected {want.shape}"
  assert got.dtype.itemsize == want.dtype.itemsize, f"{what}: dtype {got.dtype} vs {want.dtype}"
  diff = _canonical(got) != _canonical(want)
  n = int(diff.sum())
  if not n:
    return
  lines = [f"{what}: {n} of {diff.size} differ (got {got.dtype}, want {want.dtype})"]
  for idx in np.argwhere(diff)[:limit]:
    idx = tuple(int(i) for i in idx)
    lines.append(f"  at {idx}: got {hexs(got[idx])}, want {hexs(want[idx])}")
    for name, c in (context or {}).items():
      c = np.asarray(c)
      if c.shape[:got.ndim] == got.shape:
        lines.append(f"    {name}: {hexs(c[idx])}")
  raise AssertionError("\n".join(lines))


def assert_fields_equal(got: dict, want: dict, what: str, x: np.ndarray,
                        block_rows: int = 1) -> None:
  """Compares every field of `want` with `got` (scales first: they explain code mismatches),
  with the inputs behind each entry as context."""
  order = ("tensor_scale", "row_scale", "scale", "block_scale")
  for field in sorted(want, key=lambda f: (order.index(f) if f in order else len(order), f)):
    g = to_numpy(got[field])
    ctx = {"x": block_view(x, g.shape, block_rows)}
    assert_bits_equal(g, want[field], f"{what}: {field}", ctx)


def block_view(x: np.ndarray, shape: tuple[int, ...], block_rows: int = 1) -> np.ndarray:
  """x arranged so that its leading dims are `shape` (one row of inputs per compared entry)."""
  x = np.asarray(x, F32)
  if x.shape == tuple(shape):
    return x
  if block_rows == 1 or len(shape) < 2 or x.shape[-2] == shape[-2]:
    return x.reshape(tuple(shape) + (-1,))
  n, k = x.shape[-2:]
  g = x.reshape(x.shape[:-2] + (n // block_rows, block_rows, k // block_rows, block_rows))
  g = np.moveaxis(g, -3, -2)
  return g.reshape(g.shape[:-2] + (-1,)).reshape(tuple(shape) + (-1,))


# ----------------------------------------------------------------------------- E4M3 helpers

@functools.cache
def e4m3_values() -> np.ndarray:
  """All finite non-negative E4M3 values, ascending, as float32."""
  v = np.arange(256, dtype=np.uint8).view(E4M3).astype(F32)
  v = v[np.isfinite(v) & (v >= 0) & ~np.signbit(v)]
  return np.unique(v)


def e4m3_midpoints(normal_only: bool = False) -> np.ndarray:
  """Midpoints between consecutive non-negative E4M3 values, and 464 (above 448), float32."""
  v = e4m3_values().astype(np.float64)
  mids = np.concatenate([(v[:-1] + v[1:]) / 2, [464.0]])
  if normal_only:
    mids = mids[mids > 2.0**-6]
  out = mids.astype(F32)
  assert np.all(out.astype(np.float64) == mids)  # midpoints are exact float32 values
  return out


def nudge(a: np.ndarray, up: bool | np.ndarray) -> np.ndarray:
  """One float32 ulp away from zero (up=True) or towards zero (up=False)."""
  a = np.asarray(a, F32)
  away = np.where(np.signbit(a), F32(-np.inf), F32(np.inf))
  with np.errstate(over="ignore"):
    out = np.where(up, np.nextafter(a, away), np.nextafter(a, -away)).astype(F32)
  return np.where(np.isinf(out) & np.isfinite(a), a, out).astype(F32)  # stay finite


def to_bf16(x: np.ndarray) -> np.ndarray:
  """bfloat16 values (RNE) of finite float32 input, saturated to the finite bf16 range."""
  return np.clip(np.asarray(x, F32), -BF16_MAX, BF16_MAX).astype(BF16)


# ----------------------------------------------------------------------------- random data

def random_mixed(rows: int, k: int, seed: int, block: int = 16) -> np.ndarray:
  """float32 [rows, k]: magnitudes 2**-20..2**20, varying per row, per block and in blocks.

  The row magnitude is log-uniform; each block sits 0..12 binades below it (a tenth of the
  blocks up to 20, so block scales underflow under per-row scaling); within a block the
  elements spread over 1, 4 or 16 binades (chosen per block); about 1% of elements are zero.
  """
  rng = np.random.default_rng(seed)
  nb = k // block
  row_e = rng.uniform(-20.0, 20.0, (rows, 1, 1))
  blk_e = -rng.uniform(0.0, 12.0, (rows, nb, 1))
  deep = rng.random((rows, nb, 1)) < 0.1
  blk_e = np.where(deep, -rng.uniform(0.0, 20.0, (rows, nb, 1)), blk_e)
  spread = rng.choice(np.array([1.0, 4.0, 16.0]), (rows, nb, 1))
  el_e = -rng.uniform(0.0, 1.0, (rows, nb, block)) * spread
  e = np.clip(row_e + blk_e + el_e, -20.0, 20.0)
  x = rng.uniform(1.0, 2.0, e.shape) * np.exp2(e) * rng.choice(np.array([-1.0, 1.0]), e.shape)
  x = np.where(rng.random(e.shape) < 0.01, 0.0, x)
  return x.reshape(rows, k).astype(F32)


def drift(x: np.ndarray, rel: float, seed: int) -> np.ndarray:
  """x * (1 + rel * N(0, 1)) in float32: a training input near the rollout's."""
  rng = np.random.default_rng(seed)
  return (x.astype(np.float64) * (1.0 + rel * rng.standard_normal(x.shape))).astype(F32)


# ----------------------------------------------------------------------------- adversarial

def _tie_block(b: int, nudged: int = 0) -> np.ndarray:
  """16 values: 6 (the amax) and every E2M1 midpoint with both signs (unit scale).

  nudged: 0 exact ties, +1 one ulp away from zero, -1 one ulp towards zero (not the amax).
  """
  p = np.concatenate([[6.0], E2M1_MIDPOINTS, -E2M1_MIDPOINTS, [0.0]]).astype(F32)
  if nudged:
    p[1:15] = nudge(p[1:15], nudged > 0)
  p = np.roll(p, b)
  return -p if b % 2 else p


def _e2m1_ties(nudged: int, odd_scale: bool) -> np.ndarray:
  out = np.empty((ROWS, K // 16, 16), F32)
  mants = np.array([1.125, 1.25, 1.375, 1.5, 1.625, 1.75, 1.875])
  for r in range(ROWS):
    k = (r % 15) - 6 if r < ROWS // 2 else (r % 41) - 20
    s = 2.0**k * (mants[r % 7] if odd_scale else 1.0)
    for b in range(K // 16):
      out[r, b] = (_tie_block(b, nudged).astype(np.float64) * s).astype(F32)
  return out.reshape(ROWS, K)


def _saturation_edge(rng: np.random.Generator) -> np.ndarray:
  out = np.empty((ROWS, K // 16, 16), F32)
  amaxes = [6.0, None, 6.0 * (1 + 2.0**-4), 6.0 * (1 + 2.0**-3), 6.5, 6.0 * (1 - 2.0**-5),
            6.0 * (1 - 2.0**-4), 7.0, 5.999]
  others = np.array([5.0, 5.5, 5.999, 4.0, 3.5, 2.5, 0.2, -5.0, -4.5, 1.75, 0.75, 5.0, 5.0,
                     -5.0, 0.0])
  for r in range(ROWS):
    s = 2.0 ** ((r % 15) - 6) * (1.5 if r % 2 else 1.0)
    for b in range(K // 16):
      a = amaxes[(r + b) % len(amaxes)]
      blk = np.concatenate([[6.0 if a is None else a], others]) * s
      blk = blk.astype(F32)
      if a is None:
        blk[0] = nudge(blk[0], True)
      blk[12] = nudge(blk[12], True)   # just above the 4|6 tie at 5
      blk[13] = nudge(blk[13], False)  # just below it
      out[r, b] = rng.permutation(blk) * (-1 if (r + b) % 3 == 0 else 1)
  return out.reshape(ROWS, K)


def _all_zero(rng: np.random.Generator) -> np.ndarray:
  out = np.zeros((ROWS, K), F32)
  for r in range(ROWS):
    kind = r % 4
    if kind == 1:
      out[r] = -0.0
    elif kind == 2:
      vals = rng.standard_normal(K) * 2.0 ** ((r % 21) - 10)
      mask = (np.arange(K) // 16) % 2 == 1
      out[r] = np.where(mask, vals, 0.0)
    elif kind == 3:
      one = np.zeros(K)
      pos = np.arange(0, K, 32) + (r % 32)
      one[pos] = rng.choice(np.array([-1.0, 1.0]), pos.size) * 2.0 ** rng.uniform(-20, 20,
                                                                                   pos.size)
      out[r] = one
  return out


def _negative_zero(rng: np.random.Generator) -> np.ndarray:
  """Signed zeros: blocks of -0, of alternating -0/+0, and blocks with amax 6 * 2**j (or -3 *
  2**j) whose other elements are -0, negative values that round to zero (the -0.25 tie, one
  2**-20 step inside it, uniform in (-0.25, 0]), one 2**-20 step outside the tie (code 9), and
  a negative float32 subnormal: codes 8 (sign kept) in every E2M1 format."""
  out = np.empty((ROWS, K // 16, 16), F32)
  for r in range(ROWS):
    s = 2.0 ** ((r % 15) - 6)
    for b in range(K // 16):
      kind = (r + b) % 4
      if kind == 0:
        blk = np.full(16, -0.0)
      elif kind == 1:
        blk = np.where(np.arange(16) % 2 == 0, -0.0, 0.0)
      else:
        blk = np.concatenate([[6.0], [-0.0] * 2, [-0.1, -0.2, -0.24, -0.25, -0.01],
                              rng.uniform(-0.25, 0.0, 5),
                              [-0.25 * (1 - 2.0**-20), -0.25 * (1 + 2.0**-20), 0.0]]) * s
        blk[-1] = -1e-40  # float32 subnormal: flushed to -0
        if kind == 3:
          blk[0] = -blk[0] * 0.5
      out[r, b] = rng.permutation(blk.astype(F32))
  return out.reshape(ROWS, K)


def _scale_underflow(rng: np.random.Generator) -> np.ndarray:
  out = np.empty((ROWS, K // 16, 16), F32)
  floor_amax = F32(6 * 2.0**-6)  # amax / 6 == 2**-6, the smallest normal E4M3 scale
  amaxes = [float(floor_amax), float(nudge(floor_amax, False)), float(nudge(floor_amax, True))]
  amaxes += [6 * 2.0**-6 * 2.0**-j for j in range(1, 24)]
  amaxes += [2.0**-60, 2.0**-100, 2.0**-120, 2.0**-125, 2.0**-126, 1.5 * 2.0**-126]
  for r in range(ROWS):
    for b in range(K // 16):
      a = amaxes[(r * 7 + b) % len(amaxes)]
      blk = rng.uniform(-1.0, 1.0, 16) * a
      blk[(r + b) % 16] = a if (r + b) % 2 else -a
      out[r, b] = np.maximum(np.abs(blk), 2.0**-126) * np.sign(blk)  # keep inputs normal
    if r % 2:
      out[r, 0, 0] = 2.0 ** ((r % 21) - 10)  # a big element: the row scale dwarfs the rest
  return out.reshape(ROWS, K)


def _subnormal_inputs(rng: np.random.Generator) -> np.ndarray:
  out = np.empty((ROWS, K // 16, 16), F32)
  for r in range(ROWS):
    for b in range(K // 16):
      sub = rng.choice(np.array([-1.0, 1.0]), 16) * 2.0 ** -rng.integers(127, 150, 16)
      kind = (r + b) % 3
      if kind == 1:
        sub[0] = 2.0**-126  # smallest normal
        sub[1] = -(2.0**-126) * 1.5
      elif kind == 2:
        sub[: 8] = rng.standard_normal(8) * 2.0 ** ((r % 11) - 20)
      out[r, b] = sub.astype(F32)
  return out.reshape(ROWS, K)


def _e4m3_scale_ties(two_level: bool, rng: np.random.Generator) -> np.ndarray:
  """Blocks whose amax / 6 (/ ts) is an E4M3 rounding tie, or one / two ulps off it."""
  mids = e4m3_midpoints(normal_only=True).astype(np.float64)
  if two_level:
    mids = mids[:-1]  # 6 * 464 * ts would exceed the row amax 2688 * ts
  out = np.empty((ROWS, K // 16, 16), F32)
  i = 0
  for r in range(ROWS):
    j = (r % 31) - 20
    ts = 2.0**j if two_level else 1.0
    for b in range(K // 16):
      if two_level and b == 0:
        amax = F32(2688.0 * ts)  # row amax: ts = amax / 2688 == 2**j exactly
        off = 0
      else:
        t = mids[(i // 5) % mids.size]
        off = (0, 1, -1, 2, -2)[i % 5]
        i += 1
        amax = F32(6.0 * t * ts)
        assert float(amax) == 6.0 * t * ts
        amax = amax.view(np.int32) + np.int32(off)
        amax = np.int32(amax).view(F32)
      blk = rng.uniform(-1.0, 1.0, 16) * float(amax)
      blk[(r + b) % 16] = amax if (r + b) % 2 else -amax
      out[r, b] = blk.astype(F32)
  return out.reshape(ROWS, K)


def _fp8_ties(rng: np.random.Generator) -> np.ndarray:
  """1x128 groups with amax 448 * 2**j (scale 2**j exactly) and E4M3 midpoints * 2**j."""
  mids = e4m3_midpoints()[:-1].astype(np.float64)  # the 464 midpoint is above the amax
  out = np.empty((ROWS, K // 128, 128), F32)
  for r in range(ROWS):
    s = 2.0 ** ((r % 41) - 20)
    for g in range(K // 128):
      m = rng.choice(mids, 127)
      vals = (m * s).astype(F32)
      kind = (r + g) % 3
      if kind:
        vals = nudge(vals, kind == 1)
      vals = vals * rng.choice(np.array([-1.0, 1.0], F32), 127)
      out[r, g] = np.concatenate([[F32(448.0 * s)], vals]).astype(F32)
  return out.reshape(ROWS, K)


def _pow2_edges(rng: np.random.Generator) -> np.ndarray:
  """MXFP4 edges: block amax at, just below and just above powers of two; MX element ties."""
  out = np.empty((ROWS, K // 32, 32), F32)
  for r in range(ROWS):
    for b in range(K // 32):
      k = int(rng.integers(-30, 31))
      kind = (r + b) % 6
      amax = F32(2.0**k)
      if kind == 1:
        amax = nudge(amax, False)  # floor(log2) drops by one: elements near 8 saturate to 6
      elif kind == 2:
        amax = nudge(amax, True)
      elif kind == 3:
        amax = F32(1.5 * 2.0**k)
      elif kind == 4:
        amax = F32(1.75 * 2.0**k)  # 7 * 2**(k-2): saturates
      elif kind == 5:
        amax = nudge(F32(2.0 ** (k + 1)), False)
      e = int(np.floor(np.log2(float(amax)))) - 2
      mids = np.concatenate([E2M1_MIDPOINTS, -E2M1_MIDPOINTS]) * 2.0**e
      vals = rng.choice(mids, 31)
      vals = np.where(np.abs(vals) < float(amax), vals, 0.0)
      vals = vals.astype(F32)
      if r % 2:
        vals = nudge(vals, r % 4 == 1)
      out[r, b] = rng.permutation(np.concatenate([[amax], vals]).astype(F32))
  return out.reshape(ROWS, K)


def _mixed_magnitudes(rng: np.random.Generator) -> np.ndarray:
  e = rng.uniform(-20.0, 20.0, (ROWS, K))
  return (rng.uniform(1, 2, (ROWS, K)) * np.exp2(e) * rng.choice([-1.0, 1.0], (ROWS, K))).astype(
      F32)


def _huge(rng: np.random.Generator) -> np.ndarray:
  big = np.array([FLT_MAX, -FLT_MAX, 3.0e38, 1.0e38, 2.0**127, BF16_MAX, -BF16_MAX])
  out = (rng.standard_normal((ROWS, K)) * 2.0 ** rng.uniform(-20, 20, (ROWS, 1))).astype(F32)
  for r in range(ROWS):
    cols = rng.choice(K, 8, replace=False)
    out[r, cols] = rng.choice(big, 8) * (1.0 if r % 2 else 2.0**-10)
  return out.astype(F32)


@functools.cache
def adversarial_cases() -> dict[str, np.ndarray]:
  """Named float32 [ROWS, K] arrays of edge cases, built deterministically (read-only)."""
  rng = np.random.default_rng(20261130)
  cases = {
      "e2m1_ties": _e2m1_ties(0, odd_scale=False),
      "e2m1_ties_up": _e2m1_ties(1, odd_scale=False),
      "e2m1_ties_down": _e2m1_ties(-1, odd_scale=False),
      "e2m1_ties_odd_scale": _e2m1_ties(0, odd_scale=True),
      "saturation_edge": _saturation_edge(rng),
      "all_zero_blocks": _all_zero(rng),
      "negative_zero": _negative_zero(rng),
      "scale_underflow": _scale_underflow(rng),
      "subnormal_inputs": _subnormal_inputs(rng),
      "e4m3_scale_ties": _e4m3_scale_ties(False, rng),
      "e4m3_scale_ties_two_level": _e4m3_scale_ties(True, rng),
      "fp8_ties": _fp8_ties(rng),
      "mxfp4_pow2_edges": _pow2_edges(rng),
      "mixed_magnitudes": _mixed_magnitudes(rng),
      "huge": _huge(rng),
  }
  for name, a in cases.items():
    assert a.shape == (ROWS, K) and a.dtype == F32 and np.all(np.isfinite(a)), name
    a.flags.writeable = False
  return cases


def guided_train_input(x: np.ndarray) -> np.ndarray:
  """A training input near rollout input x: rows alternate between x itself, one ulp away
  from zero, one ulp towards zero, and a 1e-3 relative drift."""
  x = np.asarray(x, F32)
  kind = (np.arange(x.shape[0]) % 4)[:, None]
  scaled = x.astype(np.float64) * (1 + 1e-3 * np.cos(np.arange(x.size).reshape(x.shape)))
  scaled = np.clip(scaled, -FLT_MAX, FLT_MAX)
  out = np.where(kind == 0, x, np.where(kind == 1, nudge(x, True), nudge(x, False)))
  return np.where(kind == 3, scaled.astype(F32), out).astype(F32)


# ----------------------------------------------------------------------------- JAX ops

def _as_experts(x: jax.Array) -> jax.Array:
  """[N, K] -> [EXPERTS, N // EXPERTS, K] (stacked expert weights)."""
  return x.reshape((EXPERTS, x.shape[-2] // EXPERTS) + x.shape[-1:])


def _nvfp4_fields(q: quant.NVFP4Tensor) -> dict[str, jax.Array]:
  out = {"codes": q.codes, "block_scale": q.block_scale, "dequant": quant.nvfp4_dequantize(q)}
  if q.tensor_scale is not None:
    out["tensor_scale"] = q.tensor_scale
  return out


def _nvfp4(x: jax.Array) -> dict[str, jax.Array]:
  return _nvfp4_fields(quant.nvfp4_quantize(x))


def _nvfp4_row(x: jax.Array) -> dict[str, jax.Array]:
  return _nvfp4_fields(quant.nvfp4_quantize(x, quant.nvfp4_row_scale(x)))


def _nvfp4_tensor(x: jax.Array) -> dict[str, jax.Array]:
  return _nvfp4_fields(quant.nvfp4_quantize(x, quant.nvfp4_tensor_scale(x)))


def _nvfp4_expert(x: jax.Array) -> dict[str, jax.Array]:
  w = _as_experts(x)
  return _nvfp4_fields(quant.nvfp4_quantize(w, quant.nvfp4_tensor_scale(w, axes=(1, 2))))


def _mxfp4(x: jax.Array) -> dict[str, jax.Array]:
  q = quant.mxfp4_quantize(x)
  return {"codes": q.codes, "block_scale": q.block_scale, "dequant": quant.mxfp4_dequantize(q)}


def _fp8_fields(q: quant.FP8Tensor) -> dict[str, jax.Array]:
  return {"values": q.values, "scale": q.scale, "dequant": quant.fp8_dequantize(q)}


def _fp8_act(x: jax.Array) -> dict[str, jax.Array]:
  return _fp8_fields(quant.fp8_quantize_act(x))


def _fp8_weight(x: jax.Array) -> dict[str, jax.Array]:
  return _fp8_fields(quant.fp8_quantize_weight(x))


# name -> (function of x, block rows of its scales: 128 for FP8 weight blocks)
FORMATS: dict[str, tuple[Callable, int]] = {
    "nvfp4": (_nvfp4, 1),
    "nvfp4_row": (_nvfp4_row, 1),
    "nvfp4_tensor": (_nvfp4_tensor, 1),
    "nvfp4_expert": (_nvfp4_expert, 1),
    "mxfp4": (_mxfp4, 1),
    "fp8_act": (_fp8_act, 1),
    "fp8_weight": (_fp8_weight, 128),
}


@functools.cache
def jax_op(name: str) -> Callable[[jax.Array], dict[str, jax.Array]]:
  """The jitted JAX quantizer `name` of FORMATS, mapped over a leading chunk axis."""
  return jax.jit(jax.vmap(FORMATS[name][0]))


def _rollout_record(x: jax.Array, mode: str) -> tuple:
  q = quant.nvfp4_quantize(x, quant.nvfp4_row_scale(x))
  return q, quant.record(q, mode)


def _guided(x_r: jax.Array, x_t: jax.Array, mode: str) -> dict[str, jax.Array]:
  q, g = _rollout_record(x_r, mode)
  gq = quant.guided_quantize(x_t, g)
  out = {"rollout_codes": q.codes, "block_scale": g.block_scale, "row_scale": g.row_scale,
         "guided_codes": gq.codes, "guided_block_scale": gq.block_scale,
         "guided_dequant": quant.nvfp4_dequantize(gq)}
  out["mantissa" if mode == "compact" else "codes"] = (
      g.mantissa if mode == "compact" else g.codes)
  return out


@functools.cache
def jax_guided(mode: str) -> Callable:
  """Jitted (x_rollout, x_train) -> rollout codes, guidance fields, guided codes and dequant."""
  return jax.jit(functools.partial(_guided, mode=mode))


# ----------------------------------------------------------------------------- stacked data

RANDOM_CHUNKS = 32  # 32 x 128 x 256 = 2**20 random elements


@functools.cache
def stacked() -> tuple[np.ndarray, dict[str, slice]]:
  """All test data as float32 chunks [C, ROWS, K]: 2**20 random elements, then one chunk per
  adversarial case; and the chunk range of each data name ('random_1M' and the case names)."""
  rnd = random_mixed(RANDOM_CHUNKS * ROWS, K, seed=20261201).reshape(RANDOM_CHUNKS, ROWS, K)
  adv = adversarial_cases()
  arr = np.concatenate([rnd] + [a[None] for a in adv.values()]).astype(F32)
  index = {"random_1M": slice(0, RANDOM_CHUNKS)}
  for i, name in enumerate(adv):
    index[name] = slice(RANDOM_CHUNKS + i, RANDOM_CHUNKS + i + 1)
  arr.flags.writeable = False
  return arr, index


@functools.cache
def stacked_train() -> np.ndarray:
  """Training inputs for the guided tests, chunk by chunk near `stacked()`: 3e-3 relative
  drift on the random chunks, `guided_train_input` on the adversarial ones."""
  arr, _ = stacked()
  rnd = drift(arr[:RANDOM_CHUNKS], 3e-3, seed=5)
  adv = np.stack([guided_train_input(c) for c in arr[RANDOM_CHUNKS:]])
  out = np.concatenate([rnd, adv]).astype(F32)
  out.flags.writeable = False
  return out


DATA = ["random_1M"] + list(adversarial_cases())
DTYPES = ["float32", "bfloat16"]


@functools.cache
def jax_results(fmt: str, dtype: str) -> dict[str, np.ndarray]:
  """FORMATS[fmt] on all of `stacked()` in `dtype`: one jitted call, numpy results."""
  arr, _ = stacked()
  return {k: to_numpy(v) for k, v in jax_op(fmt)(jnp_input(arr, dtype)).items()}


@functools.cache
def jax_guided_results(mode: str, dtype: str) -> dict[str, np.ndarray]:
  arr, _ = stacked()
  out = jax_guided(mode)(jnp_input(arr, dtype), jnp_input(stacked_train(), dtype))
  return {k: to_numpy(v) for k, v in out.items()}


def jnp_input(x: np.ndarray, dtype: str) -> jax.Array:
  """JAX array of float32 data in 'float32' or 'bfloat16' (rounded RNE, saturated)."""
  return jnp.asarray(to_bf16(x)) if dtype == "bfloat16" else jnp.asarray(np.asarray(x, F32))


def input_as_f32(x: np.ndarray, dtype: str) -> np.ndarray:
  """The exact float32 values a quantizer sees for `x` given in `dtype`."""
  return to_bf16(x).astype(F32) if dtype == "bfloat16" else np.asarray(x, F32)


def walk_eqns(jaxpr, inside: bool = False):
  """(eqn, inside) of every equation of a jaxpr and of the jaxprs nested in it (scan, jit,
  shard_map and custom-rule bodies, each at each of its calls); inside: whether the equation
  lies in a shard_map body."""
  for eqn in jaxpr.eqns:
    yield eqn, inside
    nested = inside or eqn.primitive.name == "shard_map"
    for v in eqn.params.values():
      for sub in v if isinstance(v, (tuple, list)) else (v,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          yield from walk_eqns(sub.jaxpr, nested)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          yield from walk_eqns(sub, nested)


def count_eqns(jaxpr, primitive: str | None = None) -> int:
  """Equations of a jaxpr (only those of `primitive`, if given), every jaxpr nested in it
  (scan, jit, custom-rule bodies) counted at each of its calls."""
  return sum(primitive is None or eqn.primitive.name == primitive
             for eqn, _ in walk_eqns(jaxpr))


def pallas_calls(jaxpr) -> list[tuple[str, bool]]:
  """(kernel name, whether it is inside a shard_map body) of every pallas_call of a jaxpr and
  of the jaxprs nested in it: on a mesh a Pallas kernel outside one runs on the whole batch on
  every device (`trace_jax.model.batch_local`)."""
  out = []
  for eqn, inside in walk_eqns(jaxpr):
    if eqn.primitive.name == "pallas_call":
      name = eqn.params.get("name")  # jax 0.10; later versions: name_and_src_info.name
      if name is None:
        name = getattr(eqn.params.get("name_and_src_info"), "name", None)
      out.append((str(name), inside))
  return out
