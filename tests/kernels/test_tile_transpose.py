"""kernels/tile_transpose.py: the padded layout's tiles transposed equal the gather and transpose
they replace, bit for bit (a copy), in the Pallas interpreter here and on Triton on a GPU; the
kernel lowers to Triton on any host."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax.kernels import tile_transpose
from trace_jax.model import grouped

# name -> (group sizes, M, C, tile): groups that end mid-tile, an empty group, rows past the
# groups (they belong to none), a last tile whose rows run past M if read whole.
CASES = {
    "mid_tile_and_empty_group": ([37, 0, 128, 90], 300, 64, 128),
    "rows_past_the_groups": ([20, 16], 64, 48, 16),
    "one_group_wide": ([200], 200, 192, 64),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_equals_the_gather_and_transpose(name, dtype):
  gs, m, c, tile = CASES[name]
  gs = jnp.asarray(gs, jnp.int32)
  rows = (-(-m // tile) + gs.shape[0]) * tile
  src = grouped.padded_sources(gs, m, tile, rows)
  x = jax.random.normal(jax.random.key(0), (m, c), jnp.float32).astype(dtype)
  x = x.at[3, 5].set(-0.0).at[4, 6].set(jnp.nan)  # bits, not values, are copied
  want = jnp.take(x, src, axis=0, mode="fill", fill_value=0).T
  starts, counts = tile_transpose.tile_runs(src, m, tile)
  got = tile_transpose.transpose_tiles(x, starts, counts, tile=tile)  # Triton on a GPU
  assert got.shape == want.shape and got.dtype == want.dtype
  bits = lambda a: np.asarray(a).view(np.uint16 if a.dtype == jnp.bfloat16 else np.uint32)
  np.testing.assert_array_equal(bits(got), bits(want))
  assert np.asarray(counts).sum() == int(np.minimum(np.cumsum(gs), m)[-1])


def test_tile_runs_read_the_gather_map():
  """Each tile's first input row and count; a tile holding no row starts at 0 with count 0."""
  src = jnp.asarray([5, 6, 7, 9, 9, 9, 9, 9, 0, 1, 2, 3], jnp.int32)  # m = 9, tile 4
  starts, counts = tile_transpose.tile_runs(src, 9, 4)
  assert np.asarray(starts).tolist() == [5, 0, 0]
  assert np.asarray(counts).tolist() == [3, 0, 4]


def test_bad_shapes_are_refused():
  x = jnp.zeros((8, 20), jnp.bfloat16)
  z = jnp.zeros((1,), jnp.int32)
  with pytest.raises(ValueError, match="multiple of 16"):
    tile_transpose.transpose_tiles(x, z, z, interpret=True)
  with pytest.raises(ValueError, match=r"expected x \[M, C\]"):
    tile_transpose.transpose_tiles(x[0], z, z, interpret=True)


def test_lowers_to_triton():
  """The kernel passes Pallas' Triton lowering for CUDA on any host (Triton's own compilation
  needs the GPU)."""
  x = jax.ShapeDtypeStruct((300, 128), jnp.bfloat16)
  n = jax.ShapeDtypeStruct((4,), jnp.int32)
  f = lambda x, s, c: tile_transpose.transpose_tiles(x, s, c, interpret=False)
  text = jax.jit(f).trace(x, n, n).lower(lowering_platforms=("cuda",)).as_text()
  assert "triton" in text and "tile_transpose" in text
