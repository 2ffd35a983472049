"""Guided rounding (docs/design.md §3.5) properties with hypothesis, flip rates and byte accounting.

The rollout quantizes x_rollout (NVFP4, per-row two-level) and records guidance; training
rounds x_train with the rollout's scales. The bracketing grid points, RTN with the rollout's
scales and all distances are recomputed here in numpy (IEEE float32 + ml_dtypes).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import cases
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import trace_jax.quant as quant
from trace_jax.guidance import record
from trace_jax.quant import formats, guided

F32 = cases.F32
GRID = cases.E2M1_GRID
GRID16 = np.concatenate([GRID, -GRID])
SHAPE = (64, 256)  # one shape for every example and the flip-rate test: one compile


@functools.cache
def _program() -> Callable:
  def run(x_r, x_t):
    q = quant.nvfp4_quantize(x_r, quant.nvfp4_row_scale(x_r))
    gc, gf = quant.record(q, "compact"), quant.record(q, "full")
    own = quant.nvfp4_quantize(x_t, quant.nvfp4_row_scale(x_t))
    return {"rollout": q.codes, "block_scale": q.block_scale, "row_scale": q.tensor_scale,
            "compact": quant.guided_codes(x_t, gc), "full": quant.guided_codes(x_t, gf),
            "own_rtn": own.codes, "mantissa": gc.mantissa, "packed": gf.codes,
            "nbytes_compact": jnp.int32(gc.nbytes), "nbytes_full": jnp.int32(gf.nbytes)}

  return jax.jit(run)


def _run(x_r: np.ndarray, x_t: np.ndarray) -> dict[str, np.ndarray]:
  out = _program()(jnp.asarray(x_r, jnp.float32), jnp.asarray(x_t, jnp.float32))
  return {k: cases.to_numpy(v) for k, v in out.items()}


def _analysis(r: dict, x_t: np.ndarray) -> dict[str, np.ndarray]:
  """z_train with the rollout's scales, its bracket, RTN code, and the neighbour condition."""
  with np.errstate(all="ignore"):
    bs = r["block_scale"].view(cases.E4M3).astype(F32)
    inv = (F32(1) / r["row_scale"]) / bs
    xt = np.where(np.abs(x_t) < 2.0**-126, np.copysign(F32(0), x_t), x_t).astype(F32)
    z = np.clip(xt.reshape(bs.shape + (16,)) * inv[..., None], F32(-6), F32(6)).reshape(x_t.shape)
  a = np.abs(z).astype(np.float64)
  lo = np.searchsorted(GRID, a, side="right") - 1
  hi = np.where(GRID[lo] == a, lo, np.minimum(lo + 1, 7))
  sgn = np.where(np.signbit(z), -1.0, 1.0)
  rtn = (z.astype(cases.E2M1).view(np.uint8) & 0xF).astype(np.uint8)  # sign of zero kept
  c = GRID16[r["rollout"]]
  neighbour = (c == sgn * GRID[lo]) | (c == sgn * GRID[hi])
  return {"z": z, "rtn": rtn, "neighbour": neighbour}


def _values(codes: np.ndarray) -> np.ndarray:
  return GRID16[codes.astype(np.int64)]


def _first_bad(mask: np.ndarray, **arrays: np.ndarray) -> str:
  idx = tuple(np.argwhere(mask)[0])
  return ", ".join(f"{k}={cases.hexs(np.asarray(v)[idx])}" for k, v in arrays.items()) + \
      f" at {idx} ({int(mask.sum())} such elements)"


@st.composite
def _rollout_input(draw) -> np.ndarray:
  """[64, 256] float32: row magnitudes around 2**e (e in -20..20, spread over up to 20
  binades), elements spread over up to 20 binades within rows, optional zeros, and optionally
  values snapped to E2M1 grid points / midpoints of a power-of-two scale."""
  rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
  base = draw(st.floats(-20, 20))
  row_spread = draw(st.sampled_from([0.0, 4.0, 20.0]))
  spread = draw(st.sampled_from([0.0, 1.0, 4.0, 20.0]))
  row_e = base - rng.uniform(0, row_spread, (SHAPE[0], 1))
  x = rng.standard_normal(SHAPE) * np.exp2(np.clip(row_e - rng.uniform(0, spread, SHAPE), -20, 20))
  if draw(st.booleans()):
    pts = np.concatenate([GRID, cases.E2M1_MIDPOINTS]) * 2.0 ** draw(st.integers(-10, 10))
    snap = rng.random(SHAPE) < 0.5
    x = np.where(snap, rng.choice(pts, SHAPE) * np.sign(x), x)
  x = np.where(rng.random(SHAPE) < draw(st.sampled_from([0.0, 0.1])), 0.0, x)
  return x.astype(F32)


def _drift(x: np.ndarray, rel: float, seed: int) -> np.ndarray:
  return cases.drift(x, rel, seed)


HYP = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@HYP
@given(x_r=_rollout_input(), rel=st.floats(0.0, 3e-3), seed=st.integers(0, 2**32 - 1))
def test_small_drift_reproduces_rollout_codes(x_r: np.ndarray, rel: float, seed: int) -> None:
  """x_train = x_rollout * (1 + eps), |eps| <= ~3e-3 * 5 sigma: every rollout code is one of
  the two grid neighbours of z_train, and the guided code equals it (compact and full)."""
  x_t = (x_r.astype(np.float64) * (1 + np.clip(rel * np.random.default_rng(seed).standard_normal(
      SHAPE), -0.015, 0.015))).astype(F32)
  r = _run(x_r, x_t)
  an = _analysis(r, x_t)
  assert an["neighbour"].all(), "rollout code not a neighbour: " + _first_bad(
      ~an["neighbour"], x_r=x_r, x_t=x_t, z=an["z"], rollout=r["rollout"])
  for mode in ("compact", "full"):
    bad = r[mode] != r["rollout"]
    assert not bad.any(), f"{mode}: " + _first_bad(bad, x_r=x_r, x_t=x_t, z=an["z"],
                                                    rollout=r["rollout"], guided=r[mode])


@HYP
@given(x_r=_rollout_input(), rel=st.sampled_from([0.01, 0.1, 0.5, 2.0]),
       seed=st.integers(0, 2**32 - 1))
def test_any_drift_neighbour_and_distance(x_r: np.ndarray, rel: float, seed: int) -> None:
  """Any drift (sign flips included): wherever the rollout code is a neighbour of z_train the
  guided code has the rollout code's value (both modes; a zero takes z_train's sign, so 0 vs 8
  counts as equal), and full-mode guided rounding is never farther (in value) from the rollout
  code than RTN with the rollout's scales."""
  x_t = _drift(x_r, rel, seed)
  r = _run(x_r, x_t)
  an = _analysis(r, x_t)
  for mode in ("compact", "full"):
    bad = an["neighbour"] & ~formats.e2m1_values_equal(r[mode], r["rollout"])
    assert not bad.any(), f"{mode}: " + _first_bad(bad, x_t=x_t, z=an["z"], rollout=r["rollout"],
                                                    guided=r[mode])
  c = _values(r["rollout"])
  d_guided = np.abs(_values(r["full"]) - c)
  d_rtn = np.abs(_values(an["rtn"]) - c)
  bad = d_guided > d_rtn
  assert not bad.any(), "full mode farther than RTN: " + _first_bad(
      bad, x_t=x_t, z=an["z"], rollout=r["rollout"], guided=r["full"], rtn=an["rtn"])
  # compact and full differ only where the rollout code is not a neighbour
  assert np.all((r["compact"] == r["full"]) | ~an["neighbour"])


@HYP
@given(x_r=_rollout_input())
def test_no_drift_equals_rtn(x_r: np.ndarray) -> None:
  """x_train == x_rollout: guided codes (both modes) equal RTN, i.e. the rollout's codes,
  bit for bit, and RTN with the rollout's scales recomputed here."""
  r = _run(x_r, x_r)
  an = _analysis(r, x_r)
  for mode in ("compact", "full"):
    cases.assert_bits_equal(r[mode], r["rollout"], f"{mode} vs rollout", {"x": x_r})
  cases.assert_bits_equal(r["own_rtn"], r["rollout"], "own-scale RTN vs rollout", {"x": x_r})
  cases.assert_bits_equal(an["rtn"], r["rollout"], "numpy RTN vs rollout", {"x": x_r})


def test_compact_beyond_one_code_is_outside_the_guarantee() -> None:
  """The limit of 1-bit guidance (documented in docs/numerics.md):
  docs/design.md §3.5's "never farther
  than RTN" holds for compact mode only while the rollout code neighbours z_train. Here
  z_rollout = 3 (code 5, mantissa 1) and z_train = 1.8: compact picks 1.5 (same mantissa bit,
  distance 1.5) where RTN picks 2 (distance 1); full mode, which knows the code, picks 2."""
  x_r = np.zeros(SHAPE, F32)
  x_t = np.zeros(SHAPE, F32)
  x_r[:, 0], x_t[:, 0] = 6.0, 6.0  # the same rollout and training amax: scales ~1
  x_r[:, 1], x_t[:, 1] = 3.0, 1.8
  r = _run(x_r, x_t)
  an = _analysis(r, x_t)
  c = _values(r["rollout"])[:, 1]
  np.testing.assert_array_equal(_values(r["compact"])[:, 1], 1.5)
  np.testing.assert_array_equal(_values(an["rtn"])[:, 1], 2.0)
  np.testing.assert_array_equal(c, 3.0)
  np.testing.assert_array_equal(_values(r["full"])[:, 1], 2.0)


def test_zero_keeps_its_sign_under_guidance() -> None:
  """Negative values that round to zero, and -0: the rollout code is 8, and guided rounding
  (both modes) without drift gives 8 too, bit for bit. With the training values' signs flipped
  (small drift across zero) the guided codes are 0: the rollout's value (+0 == -0), and what RTN
  with the rollout's scales gives."""
  x_r = np.zeros(SHAPE, F32)
  x_r[:, ::16] = 6.0  # amax 6 per block: the scales are ~1
  small = np.array([-0.0, -0.1, -0.25, -0.2, -1e-40, 0.1, 0.0, -0.24], F32)
  cols = np.arange(SHAPE[1]) % 16 != 0
  x_r[:, cols] = np.resize(small, (SHAPE[0], int(cols.sum())))
  r = _run(x_r, x_r)
  neg = np.signbit(x_r) & cols
  assert np.all(r["rollout"][neg] == 8) and np.all(r["rollout"][~neg & cols] == 0)
  for mode in ("compact", "full"):
    cases.assert_bits_equal(r[mode], r["rollout"], f"{mode} without drift", {"x": x_r})
  x_t = np.where(cols, -x_r, x_r).astype(F32)
  r = _run(x_r, x_t)
  an = _analysis(r, x_t)
  for mode in ("compact", "full"):
    np.testing.assert_array_equal(r[mode][:, cols], np.where(np.signbit(x_t[:, cols]), 8, 0))
    cases.assert_bits_equal(r[mode], an["rtn"], f"{mode} across zero vs RTN", {"x": x_t})
    assert np.all(formats.e2m1_values_equal(r[mode], r["rollout"]))


# ----------------------------------------------------------------------------- flip rate

@functools.cache
def _flip_run() -> dict[str, np.ndarray]:
  rng = np.random.default_rng(14)
  x_r = rng.standard_normal(SHAPE).astype(F32)
  x_t = cases.drift(x_r, 1e-3, seed=15)
  r = {k: cases.to_numpy(v) for k, v in _program()(jnp.asarray(x_r), jnp.asarray(x_t)).items()}
  return r | {"analysis": _analysis(r, x_t)}


def test_flip_rate_rtn_vs_guided() -> None:
  """64 x 256 normal activations, 1e-3 relative drift: RTN with training's own scales flips
  codes; guided rounding (both modes) flips none (the drift stays within one code)."""
  r = _flip_run()

  def count(codes: np.ndarray) -> int:  # flips are value changes (+0 and -0 are equal)
    return int((~formats.e2m1_values_equal(codes, r["rollout"])).sum())

  rtn_own = count(r["own_rtn"])
  rtn_rollout_scales = count(r["analysis"]["rtn"])
  flips = {m: count(r[m]) for m in ("compact", "full")}
  print(f"\ncode flips of {r['rollout'].size}: RTN own scales {rtn_own}, RTN rollout scales "
        f"{rtn_rollout_scales}, guided {flips}")
  assert r["analysis"]["neighbour"].all()
  assert rtn_own > 0 and rtn_rollout_scales > 0
  assert flips == {"compact": 0, "full": 0}


def test_record_bit_packing() -> None:
  """Compact: element 8i+j is bit j of byte i of the mantissa bits; full: element 2i is the
  low nibble of byte i."""
  r = _flip_run()
  codes = r["rollout"]
  bits = (r["mantissa"][..., None] >> np.arange(8, dtype=np.uint8)) & 1
  np.testing.assert_array_equal(bits.reshape(codes.shape), codes & 1)
  nib = np.stack([r["packed"] & 0xF, r["packed"] >> 4], axis=-1)
  np.testing.assert_array_equal(nib.reshape(codes.shape), codes)


def test_record_takes_a_packed_mantissa() -> None:
  """A mantissa packed elsewhere (the site kernel's) is compact mode's payload as given; full
  mode refuses one."""
  x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 64)), jnp.float32)
  q = formats.fp4_quantize_act(x, "nvfp4")
  own = guided.record(q, "compact")
  given = guided.record(q, "compact", mantissa=own.mantissa + 1)
  np.testing.assert_array_equal(np.asarray(given.mantissa), np.asarray(own.mantissa + 1))
  np.testing.assert_array_equal(np.asarray(given.row_scale), np.asarray(own.row_scale))
  with pytest.raises(ValueError, match="compact mode's payload"):
    guided.record(q, "full", mantissa=own.mantissa)


@pytest.mark.parametrize("shape", [(5, 64), (5, 3, 64), (1, 16)], ids=["rows", "slots", "one"])
def test_compact_of_a_full_record_is_the_compact_record(shape) -> None:
  """`compact` keeps exactly the bits `record` packs in compact mode (numpy's little-endian
  packbits of the codes' low bits), the same scales, and passes a compact record through."""
  x = jnp.asarray(np.random.default_rng(4).standard_normal(shape), jnp.float32)
  q = formats.fp4_quantize_act(x, "nvfp4")
  got = guided.compact(guided.record(q, "full"))
  want = guided.record(q, "compact")
  bits = np.packbits(np.asarray(q.codes) & 1, axis=-1, bitorder="little")
  np.testing.assert_array_equal(np.asarray(got.mantissa), bits)
  np.testing.assert_array_equal(np.asarray(got.mantissa), np.asarray(want.mantissa))
  np.testing.assert_array_equal(np.asarray(got.row_scale), np.asarray(want.row_scale))
  assert got.mode == "compact" and got.codes is None
  assert guided.compact(want) is want


# ----------------------------------------------------------------------------- bytes

RECORD_SHAPES = [(1, 16), (3, 64), (2, 5, 2048), (7, 4096)]


@pytest.mark.parametrize("mode", record.MODES)
@pytest.mark.parametrize("shape", RECORD_SHAPES, ids=["x".join(map(str, s)) for s in RECORD_SHAPES])
def test_nbytes_equals_bytes_per_row(shape: tuple[int, ...], mode: str) -> None:
  g = jax.eval_shape(lambda v: quant.quantize_act_record(v, mode)[1],
                     jax.ShapeDtypeStruct(shape, jnp.bfloat16))
  rows = int(np.prod(shape[:-1]))
  k = shape[-1]
  assert g.nbytes == quant.bytes_per_row(k, mode) * rows
  payload = k // 8 if mode == "compact" else k // 2
  assert quant.bytes_per_row(k, mode) == payload + k // 16 + 4


def test_nbytes_of_a_real_record() -> None:
  r = _flip_run()
  assert int(r["nbytes_compact"]) == quant.bytes_per_row(256, "compact") * 64 == 64 * 52
  assert int(r["nbytes_full"]) == quant.bytes_per_row(256, "full") * 64 == 64 * 148


def test_compact_vs_full_caching_budget() -> None:
  """docs/design.md §5 budget at K = 2048 with exact bytes: per site, compact (1 mantissa bit + E4M3
  scale per 16 + FP32 row scale) is 2.98x smaller than full 4.5-bit caching of the same rows
  (4-bit codes + scales + the same row scale); guiding only the deeper half of the layers
  doubles that to 5.96x against full caching of every layer. The 6x of the TRACE paper
  leaves out the 4-byte row scale that both need."""
  k = 2048
  compact = quant.bytes_per_row(k, "compact")
  full_cache = quant.bytes_per_row(k, "full")
  assert compact == k // 8 + k // 16 + 4 == 388
  assert full_cache == k // 2 + k // 16 + 4 == 1156
  per_site = full_cache / compact
  whole_model = 2 * per_site  # deeper half of the layers guided, full caching of all
  print(f"\nK={k}: compact {compact} B/row, full {full_cache} B/row: {per_site:.3f}x per "
        f"site, {whole_model:.3f}x with half the layers guided")
  assert 2.97 < per_site < 3.0
  assert 5.9 < whole_model < 6.0


@pytest.mark.parametrize("bit", [0, 1], ids=["bit0", "bit1"])
def test_compact_values_are_the_compact_codes_decoded(bit: int) -> None:
  """compact_values (the guided kernel's values without codes) equals
  e2m1_decode(compact_codes(z, bit)) bit for bit: every finite bf16 value clipped to +-6, the
  grid, its midpoints and their float32 neighbours, both signs (the sign of zero kept)."""
  import ml_dtypes
  bf = np.arange(1 << 16, dtype=np.uint16).view(ml_dtypes.bfloat16).astype(F32)
  with np.errstate(invalid="ignore"):
    bf = bf[np.isfinite(bf)]
  base = np.concatenate([cases.E2M1_GRID, cases.E2M1_MIDPOINTS]).astype(F32)
  ex = np.concatenate([base, cases.nudge(base, True), cases.nudge(base, False)])
  z = np.concatenate([np.clip(bf, -6, 6), np.clip(ex, 0, 6), -np.clip(ex, 0, 6)]).astype(F32)
  b = np.full(z.shape, bit, np.uint8)
  got = np.asarray(jax.jit(guided.compact_values)(z, b))
  want = np.asarray(jax.jit(lambda z, b: formats.e2m1_decode(guided.compact_codes(z, b)))(z, b))
  cases.assert_bits_equal(got, want, f"compact_values bit {bit}", {"z": z})
  # control: off the grid the bit picks between two grid points, so the other bit differs
  other = np.asarray(jax.jit(guided.compact_values)(z, 1 - b))
  off = ~np.isin(np.abs(z), cases.E2M1_GRID) & (np.abs(z) >= 2.0**-126)
  assert off.sum() > 10000 and np.all(got[off] != other[off])
