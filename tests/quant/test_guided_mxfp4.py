"""Guided rounding under MXFP4 (blocks of 32, E8M0 power-of-two scales, no row scale).

The rollout quantizes x_rollout with `mxfp4_quantize` and records guidance; training rounds
x_train with the rollout's scales. The reference here is numpy + ml_dtypes: z = x * 2**-e
(exact), its E2M1 bracket, and the compact/full picking rule of docs/design.md §3.5.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import cases
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import trace_jax.quant as quant
from trace_jax.guidance import record
from trace_jax.quant import formats, guided

F32 = cases.F32
GRID = cases.E2M1_GRID
GRID16 = np.concatenate([GRID, -GRID])
SHAPE = (32, 128)


@functools.cache
def _program() -> Callable:
  def run(x_r, x_t):
    q = quant.mxfp4_quantize(x_r)
    gc, gf = quant.record(q, "compact"), quant.record(q, "full")
    return {"rollout": q.codes, "scale": jax.lax.bitcast_convert_type(q.block_scale, jnp.uint8),
            "compact": quant.guided_codes(x_t, gc), "full": quant.guided_codes(x_t, gf),
            "own_rtn": quant.mxfp4_quantize(x_t).codes,
            "fq": quant.fake_quant_act_guided(x_t, gc),
            "fq_scale": jax.lax.bitcast_convert_type(guided.guided_quantize(x_t, gc).block_scale,
                                                     jnp.uint8)}
  return jax.jit(run)


def _run(x_r: np.ndarray, x_t: np.ndarray) -> dict[str, np.ndarray]:
  out = _program()(jnp.asarray(x_r, jnp.float32), jnp.asarray(x_t, jnp.float32))
  return {k: np.asarray(v) for k, v in out.items()}


def _reference(scale_bits: np.ndarray, x_t: np.ndarray, rollout: np.ndarray, mode: str
               ) -> np.ndarray:
  """Guided codes recomputed in numpy from the rollout's scale bytes and codes."""
  e = scale_bits.astype(np.int64) - 127
  xt = np.where(np.abs(x_t) < 2.0**-126, np.copysign(F32(0), x_t), x_t).astype(np.float64)
  z = np.clip(xt.reshape(e.shape + (32,)) * np.exp2(-e)[..., None], -6, 6).reshape(x_t.shape)
  a = np.abs(z)
  lo = np.searchsorted(GRID, a, side="right") - 1
  hi = np.where(GRID[lo] == a, lo, np.minimum(lo + 1, 7))
  if mode == "compact":
    mag = np.where((lo & 1) == (rollout & 1), lo, hi)
  else:
    ref = GRID16[rollout.astype(np.int64)]
    sgn = np.where(np.signbit(z), -1.0, 1.0)
    mag = np.where(np.abs(sgn * GRID[lo] - ref) <= np.abs(sgn * GRID[hi] - ref), lo, hi)
  return (np.where(np.signbit(z), 8, 0) | mag).astype(np.uint8)


def _inputs(seed: int, spread: float) -> np.ndarray:
  rng = np.random.default_rng(seed)
  row_e = rng.uniform(-20, 20, (SHAPE[0], 1))
  x = rng.standard_normal(SHAPE) * np.exp2(row_e - rng.uniform(0, spread, SHAPE))
  return np.where(rng.random(SHAPE) < 0.05, 0.0, x).astype(F32)


CASES = {"one_binade": (0, 0.0), "four_binades": (1, 4.0), "twenty_binades": (2, 20.0)}


@pytest.mark.parametrize("case", CASES)
def test_no_drift_equals_rtn(case: str) -> None:
  x = _inputs(*CASES[case])
  r = _run(x, x)
  for mode in ("compact", "full"):
    np.testing.assert_array_equal(r[mode], r["rollout"], err_msg=mode)
  np.testing.assert_array_equal(r["own_rtn"], r["rollout"])
  # The shared exponent floor(log2(amax)) - 2 from numpy's frexp (exact), zero blocks -127.
  amax = np.abs(x.reshape(SHAPE[0], -1, 32)).max(-1)
  e = np.where(amax > 0, np.frexp(amax)[1] - 1 - 2, -127)
  np.testing.assert_array_equal(r["scale"].astype(np.int64) - 127, e)


@pytest.mark.parametrize("rel", [1e-3, 0.05, 0.5], ids=["drift_1e-3", "drift_5e-2", "drift_5e-1"])
@pytest.mark.parametrize("case", CASES)
def test_drift_matches_the_numpy_rule(case: str, rel: float) -> None:
  """Any drift: both modes equal the numpy rule; small drift reproduces the rollout's values;
  the fake-quant op dequantizes the guided codes with the rollout's scales."""
  x_r = _inputs(*CASES[case])
  x_t = cases.drift(x_r, rel, 7)
  r = _run(x_r, x_t)
  for mode in ("compact", "full"):
    np.testing.assert_array_equal(r[mode], _reference(r["scale"], x_t, r["rollout"], mode),
                                  err_msg=mode)
  if rel <= 1e-3:
    assert formats.e2m1_values_equal(r["compact"], r["rollout"]).mean() > 0.999
  else:  # drift large enough that RTN with the trainer's own scales flips codes
    assert not formats.e2m1_values_equal(r["own_rtn"], r["rollout"]).all()
  deq = np.asarray(quant.mxfp4_dequantize(quant.MXFP4Tensor(
      codes=jnp.asarray(r["compact"]),
      block_scale=jax.lax.bitcast_convert_type(jnp.asarray(r["scale"]), jnp.float8_e8m0fnu))))
  np.testing.assert_array_equal(r["fq"], deq)
  np.testing.assert_array_equal(r["fq_scale"], r["scale"])


def test_poisoned_blocks_get_zero_codes_and_nan_scales() -> None:
  x = _inputs(3, 2.0)
  x_t = x.copy()
  x_t[0, 5] = np.nan
  x_t[1, 40] = np.inf
  r = _run(x, x_t)
  assert (r["compact"][0, :32] == 0).all() and (r["compact"][1, 32:64] == 0).all()
  assert r["fq_scale"][0, 0] == 255 and r["fq_scale"][1, 1] == 255
  assert np.isnan(r["fq"][0, :32]).all() and np.isfinite(r["fq"][2]).all()


@pytest.mark.parametrize("mode", record.MODES)
def test_record_bytes_and_validation(mode: str) -> None:
  x = jnp.asarray(_inputs(4, 1.0))
  g = quant.record(quant.mxfp4_quantize(x), mode)
  assert g.format == "mxfp4" and g.row_scale is None and g.k == SHAPE[1]
  assert g.nbytes == SHAPE[0] * record.bytes_per_row(SHAPE[1], mode, "mxfp4")
  assert record.bytes_per_row(128, "compact", "mxfp4") == 16 + 4
  with pytest.raises(ValueError, match="not divisible by 32"):
    guided.validate(jnp.zeros((2, 48)), g)
  bad = guided.Guidance(block_scale=g.block_scale, row_scale=jnp.ones(SHAPE[:1] + (1,)),
                        mantissa=g.mantissa, codes=g.codes)
  with pytest.raises(ValueError, match="MXFP4 guidance has no row_scale"):
    guided.validate(x, bad)
