"""NVFP4 activation rows built to break a quantizer (ties, saturation, signed zeros, subnormals,
tiny and huge scales, NaN/Inf), each with the checks its known answer allows: shared by the
tests of the kernels that quantize activations (`nvfp4_act`, `kv_append`).

Each maker returns rows [ADV_ROWS, ADV_K // 16, 16] in float64; `adversarial_input` casts them
to a dtype as [ADV_ROWS, ADV_K]. An `expect` check takes the quantization's fields as numpy
arrays (codes, block_scale bytes, tensor_scale, y) of the float32 / bfloat16 input.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

F32 = np.float32
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
# RNE E2M1 magnitude codes of the midpoints above: ties go to the even code.
MIDPOINT_CODES = (0, 2, 2, 4, 4, 6, 6)
ADV_ROWS, ADV_K = 5, 128


def empty() -> np.ndarray:
  return np.zeros((ADV_ROWS, ADV_K // 16, 16))


def tie_rows(scales) -> np.ndarray:
  """Row r: block 0 holds the row amax 2688 * 2**t (so ts = 2**t exactly); block j >= 1 holds
  +-6 * s_j and +-(each E2M1 midpoint) * s_j, s_j = scales[j - 1], all times 2**t."""
  x = empty()
  rng = np.random.default_rng(1)
  for r, t in enumerate((0, -20, 10, -60, 3)):
    x[r, 0] = rng.uniform(-1, 1, 16)
    x[r, 0, 0] = 2688.0
    for j, s in enumerate(scales, start=1):
      x[r, j] = np.array([6.0, -6.0] + [v for mid in MIDPOINTS for v in (mid, -mid)]) * s
    x[r] *= 2.0**t
  return x


def ties_pow2():
  return tie_rows([2.0**e for e in range(-3, 4)])


def expect_ties_pow2(got: dict) -> None:
  """The midpoints sit exactly on ties (block scale 2**e, inverse exact): RNE to even codes."""
  want = np.array([7, 15] + [c | s for c in MIDPOINT_CODES for s in (0, 8)], np.uint8)
  codes = got["codes"].reshape(ADV_ROWS, ADV_K // 16, 16)
  np.testing.assert_array_equal(codes[:, 1:], np.broadcast_to(want, (ADV_ROWS, 7, 16)))
  np.testing.assert_array_equal(got["block_scale"][:, 1:],  # 2**e: exponent field e + 7
                                np.broadcast_to((np.arange(-3, 4) + 7) << 3, (ADV_ROWS, 7)))
  np.testing.assert_array_equal(got["tensor_scale"][:, 0],
                                np.exp2(np.array([0, -20, 10, -60, 3])).astype(F32))


def ties_other_scales():
  """Midpoints times block scales that are not powers of two: the inverse scale is rounded, so
  the product decides the side of each near-tie."""
  return tie_rows([1.5, 1.25, 0.875, 3.5, 0.5625, 1.125, 1.75])


def saturation():
  """One huge element per block (every block's scale 448, codes +-6); blocks whose scale
  rounds down (amax / 6 = 1.0625 * 2**e, a tie to 1.0) so x * inv > 6 is clamped to 6; scales
  rounding up; values between 5 and 6."""
  rng = np.random.default_rng(2)
  x = rng.uniform(-1, 1, (ADV_ROWS, ADV_K // 16, 16))
  x[0, :, 3] = 1e4 * np.where(np.arange(ADV_K // 16) % 2, 1.0, -1.0)
  for r, up in ((1, False), (2, True)):
    x[r, 0, 0] = 2688.0
    for j in range(1, ADV_K // 16):
      s = 2.0**(j - 4)
      x[r, j] = rng.uniform(-5.9, 5.9, 16) * s
      x[r, j, 5] = (1.1875 if up else 1.0625) * 6.0 * s
      x[r, j, 6] = -5.5 * s
  x[3] *= 1e30
  x[4, :, 0] = -3e4
  return x


def zeros():
  """All-zero rows (+0 and -0), zero blocks among random ones, -0.0 scattered."""
  rng = np.random.default_rng(3)
  x = empty()
  x[1] = -0.0
  x[2, :4] = np.where(np.arange(16) % 2, -0.0, 0.0)
  x[2, 4:] = rng.standard_normal((4, 16))
  x[3] = rng.standard_normal((ADV_K // 16, 16))
  x[3, :, ::4] = -0.0
  x[4, 5, 7] = 1e-20
  return x


def expect_zeros(got: dict) -> None:
  floor_ts = np.array([F32(2.0**-100) / F32(2688.0)] * 2, F32)
  np.testing.assert_array_equal(got["tensor_scale"][:2, 0].view(np.uint32),
                                floor_ts.view(np.uint32))
  assert (got["codes"][0] == 0).all() and (got["codes"][1] == 8).all()  # -0 keeps its sign
  assert (got["block_scale"][:2] == 0x08).all()  # clamped to 2**-6
  assert (np.signbit(got["y"][1]) & (got["y"][1] == 0)).all()


def subnormals():
  """float32 subnormals (flushed to signed zero first): alone, sprinkled among normals, one
  block of them, next to the smallest normal 2**-126."""
  rng = np.random.default_rng(4)
  sub = lambda shape: rng.uniform(-1, 1, shape) * 2.0**-127
  x = rng.standard_normal((ADV_ROWS, ADV_K // 16, 16))
  x[0] = sub((ADV_K // 16, 16))
  x[1, :, ::3] = sub((ADV_K // 16, 6))
  x[2, 3] = sub(16)
  x[3] = 2.0**-126 * np.where(rng.uniform(size=(ADV_K // 16, 16)) < 0.5, 1.0, -1.0)
  x[3, :, ::2] = sub((ADV_K // 16, 8))
  return x


def expect_subnormals(got: dict) -> None:
  x = subnormals().astype(F32).reshape(ADV_ROWS, ADV_K)
  np.testing.assert_array_equal(got["codes"][0], np.where(np.signbit(x[0]), 8, 0))
  assert (got["y"][0] == 0).all()


def tiny():
  """Blocks far below the row amax (scales clamp at 2**-6); rows below the 2**-100 amax floor,
  at it, near the smallest normal, and 2**-110 times Gaussian."""
  rng = np.random.default_rng(5)
  x = rng.standard_normal((ADV_ROWS, ADV_K // 16, 16))
  x[0, 1:] *= 1e-3
  x[0, 0, 0] = 1e3
  x[1] *= 1e-35
  x[2] = 2.0**-100 * np.sign(x[2])
  x[3] *= 2.0**-120
  x[4] *= 2.0**-110
  return x


def expect_tiny(got: dict) -> None:
  assert (got["block_scale"][0, 1:] == 0x08).all()  # 2**-6


def non_finite():
  """NaN, +Inf and -Inf in some blocks of rows 0-2 and 4 (all NaN); row 3 finite."""
  rng = np.random.default_rng(6)
  x = rng.standard_normal((ADV_ROWS, ADV_K // 16, 16))
  x[0, 2, 5] = np.nan
  x[1, 5, 0] = np.inf
  x[2, 0, 15] = -np.inf
  x[2, 7, 1] = np.nan
  x[4] = np.nan
  return x


def expect_non_finite(got: dict) -> None:
  bad = [0, 1, 2, 4]  # the row scale is NaN, so every block of those rows is poisoned
  assert np.isnan(got["tensor_scale"][bad]).all()
  assert (got["block_scale"][bad] == 0x7F).all() and (got["codes"][bad] == 0).all()
  assert np.isnan(got["y"][bad]).all()
  assert np.isfinite(got["y"][3]).all() and (got["block_scale"][3] != 0x7F).all()


def huge():
  """Values near float32's max (and bf16's), alone and next to tiny blocks."""
  rng = np.random.default_rng(7)
  flt_max = float(np.finfo(F32).max)
  x = rng.uniform(-1, 1, (ADV_ROWS, ADV_K // 16, 16))
  x[0] *= 1e38
  x[0, 3, 3] = 3.4e38
  x[1, 0, 0], x[1, 6, 9] = flt_max, -flt_max
  x[2] *= 1e38 * np.exp2(-rng.integers(0, 30, (ADV_K // 16, 1)))
  x[3, :4] *= 1e38
  x[3, 4:] *= 1e-30
  x[4] *= float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
  return x


# (id, rows [5, 8, 16] in float64, extra checks on the float32 / bfloat16 input or None)
ADVERSARIAL = [
    ("e2m1_ties_pow2_scales", ties_pow2, expect_ties_pow2),
    ("e2m1_ties_other_scales", ties_other_scales, None),
    ("saturation", saturation, None),
    ("zeros_and_signed_zeros", zeros, expect_zeros),
    ("f32_subnormals", subnormals, expect_subnormals),
    ("tiny_block_and_row_scales", tiny, expect_tiny),
    ("nan_and_inf", non_finite, expect_non_finite),
    ("huge_near_float32_max", huge, None),
]


def adversarial_input(make, dtype: str) -> jax.Array:
  with np.errstate(all="ignore"):  # f16 overflows to inf: a non-finite row, still compared
    return jnp.asarray(make().astype(F32).reshape(ADV_ROWS, ADV_K), DTYPES[dtype])
