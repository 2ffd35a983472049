"""kernels/fp8_tiles.py: the padded layout's tiles gathered, transposed and quantized in one
pass equal `formats.fp8_quantize_act` of XLA's gather and transpose, bit for bit (codes and
scales), in the Pallas interpreter here and on Triton on a GPU; the kernel lowers to Triton on
any host."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax.kernels import fp8_tiles
from trace_jax.model import grouped
from trace_jax.quant import formats

# name -> (group sizes, M, C): groups that end mid-tile, an empty group, rows past the groups
# (they belong to none), a last tile whose rows run past M if read whole.
CASES = {
    "mid_tile_and_empty_group": ([37, 0, 128, 90], 300, 64),
    "rows_past_the_groups": ([20, 16], 64, 48),
    "one_group_wide": ([200], 200, 192),
}


def _operand(m: int, c: int, dtype) -> jax.Array:
  """Normal values with the quantizer's hard cases: a group whose amax is E4M3's maximum (scale
  1) holding ties to even (normal and subnormal) and the maximum, zeros and -0, a subnormal
  float32, groups below AMAX_FLOOR, non-finite values (their group's scale NaN, codes 0)."""
  x = np.array(jax.random.normal(jax.random.key(0), (m, c), jnp.float32))
  x[:, 0] = 0.0
  x[1, :] = -0.0
  x[2, 3] = 1e-40  # subnormal: flushed
  x[5:10, 7] = [448.0, 1.0625, -1.1875, 3.0 * 2.0**-10, 2.0**-10]  # ties: 1, -1.25, 2**-8, 0
  x[:, 9] = 1e-30  # one column whose groups sit below AMAX_FLOOR
  x[10, 11] = np.inf
  x[12, 13] = np.nan
  return jnp.asarray(x).astype(dtype)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_equals_the_quantizer_of_the_gathered_transpose(name, dtype):
  gs, m, c = CASES[name]
  gs = jnp.asarray(gs, jnp.int32)
  rows = (-(-m // fp8_tiles.TILE) + gs.shape[0]) * fp8_tiles.TILE
  src = grouped.padded_sources(gs, m, fp8_tiles.TILE, rows)
  x = _operand(m, c, dtype)
  want = jax.jit(formats.fp8_quantize_act)(jnp.take(x, src, axis=0, mode="fill",
                                                    fill_value=0).T)
  starts, counts = fp8_tiles.tile_runs(src, m)
  got = fp8_tiles.quantize_tiles(x, starts, counts)  # Triton on a GPU
  assert got.values.shape == want.values.shape and got.values.dtype == jnp.float8_e4m3fn
  np.testing.assert_array_equal(np.asarray(got.values).view(np.uint8),
                                np.asarray(want.values).view(np.uint8))
  s_got, s_want = np.asarray(got.scale), np.asarray(want.scale)
  assert s_got.shape == s_want.shape
  np.testing.assert_array_equal(np.isnan(s_got), np.isnan(s_want))
  np.testing.assert_array_equal(s_got.view(np.uint32)[~np.isnan(s_want)],
                                s_want.view(np.uint32)[~np.isnan(s_want)])
  assert np.isnan(s_want).any()  # the non-finite values' groups were exercised
  assert np.asarray(counts).sum() == int(np.minimum(np.cumsum(gs), m)[-1])


def test_tile_runs_read_the_gather_map():
  """Each tile's first input row and count; a tile holding no row starts at 0 with count 0."""
  m = 300
  src = np.full(3 * 128, m, np.int32)
  src[:37] = np.arange(37) + 5
  src[256:] = np.arange(128) + 100
  starts, counts = fp8_tiles.tile_runs(jnp.asarray(src), m)
  assert np.asarray(starts).tolist() == [5, 0, 100]
  assert np.asarray(counts).tolist() == [37, 0, 128]


def test_bad_inputs_are_refused():
  z = jnp.zeros((1,), jnp.int32)
  with pytest.raises(ValueError, match="multiple of 16"):
    fp8_tiles.quantize_tiles(jnp.zeros((8, 20), jnp.bfloat16), z, z, interpret=True)
  with pytest.raises(ValueError, match=r"expected x \[M, C\]"):
    fp8_tiles.quantize_tiles(jnp.zeros((16,), jnp.bfloat16), z, z, interpret=True)
  with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
    fp8_tiles.quantize_tiles(jnp.zeros((8, 16), jnp.int32), z, z, interpret=True)


@pytest.fixture
def traced_as_on_gpu(monkeypatch):
  """`exact`'s backend-dependent code traces its GPU branch while this host lowers for CUDA."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")


def test_lowers_to_triton(traced_as_on_gpu):
  """The kernel passes Pallas' Triton lowering for CUDA on any host, its divisions straight
  line (Triton's compilation needs the GPU)."""
  x = jax.ShapeDtypeStruct((300, 128), jnp.bfloat16)
  n = jax.ShapeDtypeStruct((4,), jnp.int32)
  f = lambda x, s, c: fp8_tiles.quantize_tiles(x, s, c, interpret=False)
  text = jax.jit(f).trace(x, n, n).lower(lowering_platforms=("cuda",)).as_text()
  assert "triton" in text and "fp8_wgrad_tiles" in text


# name -> shape of the codes [..., N, K]: blocks of 128 both ways, a stack of experts with
# blocks narrower than 128 (N, K multiples of 16 only), a 2-d weight.
TRANSPOSE_CASES = {
    "experts_whole_blocks": (3, 256, 384),
    "experts_narrow_blocks": (2, 48, 80),
    "dense": (384, 128),
}


@pytest.mark.parametrize("name", list(TRANSPOSE_CASES))
def test_transpose_codes_moves_every_byte(name):
  """Every one of the 256 byte values (NaN codes and -0 included) lands at its transposed
  place: the result is numpy's swapaxes of the same bytes."""
  shape = TRANSPOSE_CASES[name]
  bits = np.arange(np.prod(shape), dtype=np.int64).reshape(shape) * 7919 % 256
  codes = jax.lax.bitcast_convert_type(jnp.asarray(bits, jnp.uint8), jnp.float8_e4m3fn)
  got = fp8_tiles.transpose_codes(codes)  # Triton on a GPU
  assert got.dtype == jnp.float8_e4m3fn
  np.testing.assert_array_equal(np.asarray(got).view(np.uint8),
                                np.swapaxes(bits, -1, -2).astype(np.uint8))


def test_transpose_codes_refuses_bad_inputs():
  with pytest.raises(TypeError, match="float8_e4m3fn"):
    fp8_tiles.transpose_codes(jnp.zeros((16, 16), jnp.uint8), interpret=True)
  with pytest.raises(ValueError, match="multiples of 16"):
    fp8_tiles.transpose_codes(jnp.zeros((16, 24), jnp.float8_e4m3fn), interpret=True)


def test_transpose_codes_lowers_to_triton(traced_as_on_gpu):
  x = jax.ShapeDtypeStruct((2, 256, 384), jnp.float8_e4m3fn)
  f = lambda x: fp8_tiles.transpose_codes(x, interpret=False)
  text = jax.jit(f).trace(x).lower(lowering_platforms=("cuda",)).as_text()
  assert "triton" in text and "fp8_transpose_codes" in text
