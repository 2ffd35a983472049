"""Exact float32 arithmetic (`trace_jax.quant.exact`) against IEEE numpy and ml_dtypes.

Every function runs inside `jax.jit` (how the quantizers use them) on JAX's default backend.
"""

from __future__ import annotations

import functools

import cases
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from trace_jax.quant import exact

F32 = np.float32
E4M3 = ml_dtypes.float8_e4m3fn
FLT_MIN = 2.0**-126

ieee_div = jax.jit(exact.ieee_div)
round_to_e4m3 = jax.jit(exact.round_to_e4m3)
e4m3_to_bits = jax.jit(exact.e4m3_to_bits)
e4m3_value = jax.jit(exact.e4m3_value)
to_e4m3 = jax.jit(lambda v: exact.bits_to_e4m3(exact.e4m3_to_bits(exact.round_to_e4m3(v))))
round_mantissa = jax.jit(exact.round_mantissa, static_argnums=1)


def _from_parts(rng: np.random.Generator, exps: np.ndarray) -> np.ndarray:
  """Positive float32 with the given biased exponents and uniformly random mantissas."""
  mant = rng.integers(0, 1 << 23, exps.shape, dtype=np.int64)
  return ((exps.astype(np.int64) << 23) | mant).astype(np.uint32).view(F32)


def _ieee_quotient(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """IEEE float32 a / b twice: numpy float32 division, cross-checked with float64 division
  rounded once to float32 (exact: 53 >= 2 * 24 + 2, so double rounding is innocuous)."""
  with np.errstate(all="ignore"):
    q32 = np.divide(a, b, dtype=F32)
    q64 = (a.astype(np.float64) / b.astype(np.float64)).astype(F32)
  np.testing.assert_array_equal(cases.bits(q32), cases.bits(q64))
  return q32


def _expected_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """IEEE a / b where that is normal or inf; 0 where it underflows or a is zero/subnormal
  (documented behaviour of ieee_div: callers clamp such quotients from below)."""
  want = _ieee_quotient(a, b)
  want = np.where(np.abs(want) < FLT_MIN, F32(0.0), want).astype(F32)
  return np.where(np.abs(a) < FLT_MIN, F32(0.0), want).astype(F32)


# ----------------------------------------------------------------------------- ieee_div

def _adversarial_div() -> dict[str, tuple[np.ndarray, np.ndarray]]:
  rng = np.random.default_rng(3)
  out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
  # E4M3 ties: amax = 6 * t for every E4M3 midpoint t (amax / 6 is exactly the tie), +-1..2 ulps.
  mids = cases.e4m3_midpoints()
  amax = (mids.astype(np.float64) * 6).astype(F32)
  assert np.all(amax.astype(np.float64) == mids.astype(np.float64) * 6)
  amax_all = np.concatenate([amax] + [
      (cases.bits(amax).astype(np.int64) + d).astype(np.uint32).view(F32) for d in (-2, -1, 1, 2)])
  out["e4m3_ties_over_6"] = (amax_all, np.full(amax_all.shape, 6.0, F32))
  # Two-level: (amax / 6) / ts with ts a power of two, and 1 / bs for every E4M3 scale.
  ts = np.exp2(rng.integers(-111, 20, amax_all.size)).astype(F32)
  out["e4m3_ties_over_ts"] = ((amax_all / F32(6)).astype(F32) * ts, ts)
  scales = cases.e4m3_values()[1:]
  out["one_over_e4m3"] = (np.ones_like(scales), scales)
  tsr = np.exp2(rng.uniform(-111, 20, scales.size)).astype(F32)
  out["inv_ts_over_e4m3"] = ((F32(1) / tsr).astype(F32), scales)
  out["amax_over_448"] = (_from_parts(rng, rng.integers(1, 255, 4096)), np.full(4096, 448, F32))
  out["amax_over_2688"] = (_from_parts(rng, rng.integers(1, 255, 4096)), np.full(4096, 2688, F32))
  # Quotients within a hair of a float32 rounding midpoint (exact ties are impossible in
  # division): a = RN(b * m) for 25-bit midpoints m.
  b = _from_parts(rng, rng.integers(100, 150, 20000))
  m = (1 + (2 * rng.integers(0, 1 << 23, b.size) + 1) * 2.0**-24) * np.exp2(
      rng.integers(-20, 20, b.size))
  a = (b.astype(np.float64) * m).astype(F32)
  out["near_float32_ties"] = (np.concatenate([a, cases.nudge(a, True), cases.nudge(a, False)]),
                              np.concatenate([b, b, b]))
  ones = np.uint32(0x7FFFFF)
  all_ones = ((np.arange(1, 255, dtype=np.uint32) << 23) | ones).view(F32)
  pairs = np.array(np.meshgrid(all_ones, all_ones[::7])).reshape(2, -1)
  out["mantissa_all_ones"] = (pairs[0], pairs[1])
  pow2 = np.exp2(np.arange(-126, 128)).astype(F32)
  pairs = np.array(np.meshgrid(pow2, pow2[::5])).reshape(2, -1)
  out["powers_of_two"] = (pairs[0], pairs[1])
  mixed = np.concatenate([pow2[::3], all_ones[::3]])
  pairs = np.array(np.meshgrid(mixed, all_ones[::3])).reshape(2, -1)
  out["pow2_by_all_ones"] = (pairs[0], pairs[1])
  # Near overflow: FLT_MAX-sized numerators over divisors just below / above one.
  big = _from_parts(rng, np.full(5000, 254))
  near1 = _from_parts(rng, np.repeat([126, 127], 2500))
  out["near_overflow"] = (np.concatenate([big, np.full(3, np.finfo(F32).max, F32)]),
                          np.concatenate([near1, np.array([1.0, cases.nudge(F32(1), False),
                                                           cases.nudge(F32(1), True)], F32)]))
  # Near underflow: quotients around 2**-126, where the result leaves the normal range.
  small = _from_parts(rng, np.full(5000, 1))
  out["near_underflow"] = (small, near1)
  den = _from_parts(rng, np.full(5000, 127))
  at_min = (den * F32(FLT_MIN)).astype(F32)  # quotient exactly 2**-126
  out["underflow_boundary"] = (np.concatenate([at_min, cases.nudge(at_min, True),
                                               cases.nudge(at_min, False)]), np.tile(den, 3))
  # Zero and subnormal numerators give 0 (subnormals are flushed).
  sub = np.array([0.0, 1e-45, 2.0**-127, 2.0**-149, 1.1e-38], F32)
  out["zero_and_subnormal_numerator"] = (sub, np.full(sub.shape, 3.0, F32))
  return out


def _random_div() -> dict[str, tuple[np.ndarray, np.ndarray]]:
  rng = np.random.default_rng(1)
  n = 1_000_000  # quotients across the normal range: exponent gap within +-100
  eb = rng.integers(1, 255, n)
  ea = np.clip(eb + rng.integers(-100, 101, n), 1, 254)
  m = 200_000  # exponents anywhere: many quotients overflow to inf or underflow to 0
  return {"random_1M": (_from_parts(rng, ea), _from_parts(rng, eb)),
          "random_all_exponents": (_from_parts(rng, rng.integers(1, 255, m)),
                                   _from_parts(rng, rng.integers(1, 255, m)))}


_DIV_CASES = _random_div() | _adversarial_div()


@functools.cache
def _div_results() -> dict[str, np.ndarray]:
  """ieee_div on every case at once (one jitted call), split back by case."""
  a = np.concatenate([v[0] for v in _DIV_CASES.values()]).astype(F32)
  b = np.concatenate([v[1] for v in _DIV_CASES.values()]).astype(F32)
  q = np.asarray(ieee_div(a, b))
  out, i = {}, 0
  for name, (x, _) in _DIV_CASES.items():
    out[name] = q[i:i + x.size]
    i += x.size
  return out


@pytest.mark.parametrize("name", list(_DIV_CASES), ids=list(_DIV_CASES))
def test_ieee_div(name: str) -> None:
  """ieee_div equals IEEE float32 division (numpy, cross-checked with float64)."""
  a, b = (np.asarray(v, F32) for v in _DIV_CASES[name])
  cases.assert_bits_equal(_div_results()[name], _expected_div(a, b), f"ieee_div {name}",
                          {"a": a, "b": b})


def test_ieee_div_e4m3_ties_are_exact() -> None:
  """(6 t) / 6 returns exactly t for every E4M3 midpoint t (XLA's own division does not)."""
  mids = cases.e4m3_midpoints()
  got = _div_results()["e4m3_ties_over_6"][:mids.size]
  cases.assert_bits_equal(got, mids, "ieee_div(6 t, 6)", {"t": mids})
  assert _DIV_CASES["random_1M"][0].size >= 10**6


# ----------------------------------------------------------------------------- ieee_div_short

def _short_div_cases() -> dict[str, tuple[np.ndarray, np.ndarray, int]]:
  """(a, b, divisor_bits): divisors with short significands, as the kernels divide by them."""
  rng = np.random.default_rng(5)
  scales = cases.e4m3_values()[1:]                     # every positive E4M3 value
  n = 400_000
  b = rng.choice(scales, n)
  out = {"random_over_e4m3": (_from_parts(rng, rng.integers(1, 255, n)), b, 3)}
  # Quotients within a hair of a float32 rounding midpoint, over E4M3 divisors.
  b = rng.choice(scales, 20000)
  m = (1 + (2 * rng.integers(0, 1 << 23, b.size) + 1) * 2.0**-24) * np.exp2(
      rng.integers(-20, 20, b.size))
  a = (b.astype(np.float64) * m).astype(F32)
  out["near_float32_ties_over_e4m3"] = (
      np.concatenate([a, cases.nudge(a, True), cases.nudge(a, False)]), np.tile(b, 3), 3)
  tsr = np.exp2(rng.uniform(-111, 20, scales.size)).astype(F32)
  out["inv_ts_over_e4m3"] = ((F32(1) / tsr).astype(F32), scales, 3)
  a6, b6 = _DIV_CASES["e4m3_ties_over_6"]
  out["e4m3_ties_over_6"] = (a6, b6, 1)
  out["random_over_6"] = (_from_parts(rng, rng.integers(1, 255, n)), np.full(n, 6.0, F32), 1)
  # every significand length 0..5 over divisors near the exponent range's ends
  for d in range(6):
    bd = (_from_parts(rng, rng.choice([1, 2, 127, 253, 254], 5000)).view(np.uint32)
          & ~np.uint32((1 << (23 - d)) - 1)).view(F32)
    out[f"bits{d}_all_exponents"] = (_from_parts(rng, rng.integers(1, 255, 5000)), bd, d)
  sub = np.array([0.0, 1e-45, 2.0**-127, 2.0**-149, 1.1e-38], F32)
  out["zero_and_subnormal_numerator"] = (sub, np.full(sub.shape, 3.0, F32), 1)
  return out


_SHORT_CASES = _short_div_cases()


@pytest.mark.parametrize("name", list(_SHORT_CASES), ids=list(_SHORT_CASES))
def test_ieee_div_short(name: str) -> None:
  """ieee_div_short equals IEEE float32 division and ieee_div where the divisor's significand
  is as short as it is told."""
  a, b, d = _SHORT_CASES[name]
  got = np.asarray(jax.jit(exact.ieee_div_short, static_argnums=2)(a, b, d))
  cases.assert_bits_equal(got, _expected_div(a, b), f"ieee_div_short {name}", {"a": a, "b": b})


def test_ieee_div_short_control_needs_short_divisors() -> None:
  """Control: a divisor with more significand bits than `divisor_bits` gives other quotients
  (its low bits are dropped), so the cases above can fail; bad bit counts raise."""
  rng = np.random.default_rng(6)
  a = _from_parts(rng, np.full(1000, 127))
  b = _from_parts(rng, np.full(1000, 127))
  got = np.asarray(jax.jit(exact.ieee_div_short, static_argnums=2)(a, b, 3))
  assert np.mean(got != _expected_div(a, b)) > 0.9
  with pytest.raises(ValueError, match="divisor_bits"):
    exact.ieee_div_short(a, b, 6)


# ----------------------------------------------------------------------------- e4m3_quotient

def _quotient_cases() -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """(a, b) for `e4m3_quotient`: block amaxes over 6 and row scales, as the kernels divide."""
  rng = np.random.default_rng(8)
  n = 300_000
  eb = rng.integers(1, 252, n)                          # 1 / b stays normal
  out = {"random": (_from_parts(rng, np.clip(eb + rng.integers(-14, 16, n), 1, 254)),
                    _from_parts(rng, eb))}
  # a / b within a few float32 ulps of every E4M3 midpoint: the float32 rounding's and the
  # E4M3 rounding's ties, and double rounding onto a midpoint
  mids = cases.e4m3_midpoints()
  mids = mids[(mids > 2.0**-6) & (mids < 448)]
  b = _from_parts(rng, rng.integers(60, 190, 40 * mids.size))
  m = np.tile(mids, 40).astype(np.float64)
  a = (b.astype(np.float64) * m).astype(F32)
  near = [a] + [(cases.bits(a).astype(np.int64) + d).astype(np.uint32).view(F32)
                for d in (-3, -2, -1, 1, 2, 3)]
  out["near_e4m3_midpoints"] = (np.concatenate(near), np.tile(b, len(near)))
  vals = cases.e4m3_values()
  vals = vals[(vals >= 2.0**-6) & (vals <= 448)]
  b = _from_parts(rng, rng.integers(60, 190, 20 * vals.size))
  a = (b.astype(np.float64) * np.tile(vals, 20)).astype(F32)
  out["near_e4m3_values"] = (np.concatenate([a, cases.nudge(a, True), cases.nudge(a, False)]),
                             np.tile(b, 3))
  # quotients far outside [2**-6, 448] (clamped), and zero / subnormal numerators (2**-6)
  b = _from_parts(rng, rng.integers(1, 240, 4000))
  out["clamped"] = (np.concatenate([(b * F32(2.0**-9)).astype(F32), (b * F32(1000)).astype(F32)]),
                    np.tile(b, 2))
  sub = np.array([0.0, 1e-45, 2.0**-127, 1.1e-38], F32)
  out["zero_and_subnormal_numerator"] = (sub, np.full(sub.shape, 3.0, F32))
  return out


_QUOTIENT_CASES = _quotient_cases()


@functools.cache
def _quotients(name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(e4m3_quotient, its definition through ieee_div, the control: a * 1 / b rounded)."""
  a, b = _QUOTIENT_CASES[name]

  @jax.jit
  def run(a, b):
    inv = exact.ieee_div(np.float32(1.0), b)
    want = exact.round_mantissa(jnp.clip(exact.ieee_div(a, b), exact.E4M3_MIN_NORMAL,
                                         exact.E4M3_MAX), 3)
    naive = exact.round_mantissa(jnp.clip(a * inv, exact.E4M3_MIN_NORMAL, exact.E4M3_MAX), 3)
    return exact.e4m3_quotient(a, b, inv), want, naive
  return tuple(np.asarray(v) for v in run(a, b))


@pytest.mark.parametrize("name", list(_QUOTIENT_CASES), ids=list(_QUOTIENT_CASES))
def test_e4m3_quotient(name: str) -> None:
  """e4m3_quotient is the E4M3 rounding of ieee_div's quotient, bit for bit, and of numpy's
  IEEE quotient (ml_dtypes' E4M3 cast, clamped)."""
  a, b = _QUOTIENT_CASES[name]
  got, want, _ = _quotients(name)
  cases.assert_bits_equal(got, want, f"e4m3_quotient {name}", {"a": a, "b": b})
  q = np.clip(_expected_div(a, b), 2.0**-6, 448).astype(E4M3).astype(F32)
  cases.assert_bits_equal(got, q, f"e4m3_quotient {name} vs numpy", {"a": a, "b": b})


def test_e4m3_quotient_control_the_reciprocal_alone_is_wrong() -> None:
  """Control: rounding a * (1 / b) without the exact comparisons misses near the midpoints."""
  got, want, naive = _quotients("near_e4m3_midpoints")
  assert np.sum(naive != want) > 100 and np.array_equal(got, want)


# ----------------------------------------------------------------------------- E4M3

@functools.cache
def _bf16_in_e4m3_range() -> np.ndarray:
  """Every finite bf16 value with |x| <= 448, as float32 (includes -0 and bf16 subnormals)."""
  v = np.arange(1 << 16, dtype=np.uint16).view(ml_dtypes.bfloat16).astype(F32)
  with np.errstate(invalid="ignore"):
    return v[np.isfinite(v) & (np.abs(v) <= 448)]


def _midpoints_and_neighbours() -> np.ndarray:
  m = cases.e4m3_midpoints()
  m = m[m <= 448]  # 464 rounds to NaN in ml_dtypes; saturation is tested separately
  vals = np.concatenate([m, cases.nudge(m, True), cases.nudge(m, False), cases.e4m3_values()])
  vals = vals[vals <= 448]
  return np.concatenate([vals, -vals]).astype(F32)


E4M3_INPUTS = {"bf16_all_finite_le_448": _bf16_in_e4m3_range,
               "e4m3_midpoints_and_nextafter": _midpoints_and_neighbours}


@pytest.mark.parametrize("name", list(E4M3_INPUTS), ids=list(E4M3_INPUTS))
def test_round_to_e4m3_matches_ml_dtypes(name: str) -> None:
  x = E4M3_INPUTS[name]()
  want_bytes = x.astype(E4M3).view(np.uint8)
  want = want_bytes.view(E4M3).astype(F32)
  got = np.asarray(round_to_e4m3(x))
  cases.assert_bits_equal(got, want, f"round_to_e4m3 {name}", {"x": x})
  cases.assert_bits_equal(np.asarray(e4m3_to_bits(got)), want_bytes, f"e4m3_to_bits {name}",
                          {"x": x})
  cases.assert_bits_equal(np.asarray(to_e4m3(x)).view(np.uint8), want_bytes,
                          f"bits_to_e4m3 {name}", {"x": x})


def test_round_to_e4m3_saturates_and_keeps_nan() -> None:
  """|x| > 448 saturates to +-448 (ml_dtypes would give NaN); NaN stays NaN."""
  big = np.array([448.5, 464.0, 480.0, 1e6, 3.0e38, np.inf], F32)
  x = np.concatenate([big, -big, [np.nan]]).astype(F32)
  got = np.asarray(round_to_e4m3(x))
  want = np.concatenate([np.full(6, 448.0), np.full(6, -448.0), [np.nan]]).astype(F32)
  cases.assert_bits_equal(got, want, "round_to_e4m3 saturation", {"x": x})
  b = np.asarray(e4m3_to_bits(got))
  assert list(b[:6]) == [0x7E] * 6 and list(b[6:12]) == [0xFE] * 6 and (b[12] & 0x7F) == 0x7F


def test_e4m3_value_all_bytes() -> None:
  """e4m3_value decodes all 256 E4M3 bytes exactly like ml_dtypes (NaN at 0x7F and 0xFF)."""
  b = np.arange(256, dtype=np.uint8)
  want = b.view(E4M3).astype(F32)
  got = np.asarray(e4m3_value(b.view(E4M3)))
  cases.assert_bits_equal(got, want, "e4m3_value", {"byte": b})
  assert np.isnan(got[0x7F]) and np.isnan(got[0xFF]) and np.isnan(got).sum() == 2


def test_e4m3_to_bits_round_trips_every_value() -> None:
  b = np.arange(256, dtype=np.uint8)
  v = b.view(E4M3).astype(F32)
  got = np.asarray(e4m3_to_bits(v))
  cases.assert_bits_equal(got, b, "e4m3_to_bits(e4m3 value)", {"value": v})


# ----------------------------------------------------------------------------- round_mantissa

def _round_mantissa_ref(x: np.ndarray, keep: int) -> np.ndarray:
  """RNE to `keep` mantissa bits in float64 (frexp/ldexp and numpy's half-to-even round)."""
  m, e = np.frexp(x.astype(np.float64))
  with np.errstate(over="ignore"):
    return np.ldexp(np.round(np.ldexp(m, keep + 1)), e - keep - 1).astype(F32)


KEEP_BITS = [1, 2, 3, 7, 10, 22]  # keep=0 has no even/odd mantissa; unused


@pytest.mark.parametrize("keep", KEEP_BITS, ids=[f"keep{k}" for k in KEEP_BITS])
def test_round_mantissa(keep: int) -> None:
  """Random normals of every exponent, plus values exactly at / one ulp around rounding ties."""
  rng = np.random.default_rng(10 + keep)
  x = _from_parts(rng, rng.integers(1, 255, 200_000))
  drop = 23 - keep
  tie_bits = (cases.bits(x[:50_000]) & ~np.uint32((1 << drop) - 1)) | np.uint32(1 << (drop - 1))
  ties = tie_bits.view(F32)
  x = np.concatenate([x, ties, cases.nudge(ties, True), cases.nudge(ties, False)])
  x = np.concatenate([x, -x]).astype(F32)
  want = _round_mantissa_ref(x, keep)
  cases.assert_bits_equal(np.asarray(round_mantissa(x, keep)), want, f"round_mantissa({keep})",
                          {"x": x})


def test_round_mantissa_matches_bf16_and_e4m3_casts() -> None:
  """keep=7 is bf16 RNE, keep=3 is E4M3 RNE on E4M3's normal range (ml_dtypes)."""
  rng = np.random.default_rng(4)
  x = _from_parts(rng, rng.integers(1, 254, 100_000))
  cases.assert_bits_equal(np.asarray(round_mantissa(x, 7)),
                          x.astype(ml_dtypes.bfloat16).astype(F32), "keep 7 vs bf16", {"x": x})
  y = _from_parts(rng, rng.integers(127 - 6, 127 + 9, 100_000))
  y = y[y <= 448]
  cases.assert_bits_equal(np.asarray(round_mantissa(y, 3)), y.astype(E4M3).astype(F32),
                          "keep 3 vs e4m3", {"x": y})


# ----------------------------------------------------------------------------- small helpers

def test_exponent_exp2i_flush_and_sign() -> None:
  rng = np.random.default_rng(5)
  x = _from_parts(rng, rng.integers(1, 255, 10_000))
  x = np.concatenate([x, -x])
  got = np.asarray(jax.jit(exact.exponent)(x))
  np.testing.assert_array_equal(got, np.frexp(x)[1] - 1)
  e = np.arange(-126, 128, dtype=np.int32)
  cases.assert_bits_equal(np.asarray(jax.jit(exact.exp2i)(e)), np.exp2(e.astype(np.float64)).astype(
      F32), "exp2i", {"e": e})
  v = np.array([0.0, -0.0, 1e-45, -1e-45, 2.0**-127, -(2.0**-127), 2.0**-126, -(2.0**-126), 1.0,
                np.inf, -np.inf, np.nan], F32)
  want = np.array([0.0, -0.0, 0.0, -0.0, 0.0, -0.0, 2.0**-126, -(2.0**-126), 1.0, np.inf, -np.inf,
                   np.nan], F32)
  cases.assert_bits_equal(np.asarray(jax.jit(exact.flush_subnormal)(v)), want, "flush_subnormal",
                          {"x": v})
  np.testing.assert_array_equal(np.asarray(jax.jit(exact.sign_bit)(v)), np.signbit(v))
