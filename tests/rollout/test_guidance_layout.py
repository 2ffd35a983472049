"""Ragged <-> padded guidance rows and the full -> compact reduction, against references."""

import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax.quant import formats, guided
from trace_jax.rollout import guidance_layout


@pytest.mark.parametrize("shape", [(5, 64), (5, 3, 64), (1, 16)], ids=["rows", "slots", "one"])
def test_to_compact_equals_the_quantizer_record(shape):
  """The host reduction keeps exactly the bits `guided.record` packs in compact mode."""
  codes = np.random.default_rng(0).integers(0, 16, shape).astype(np.uint8)
  lead = shape[:-1]
  full = guided.Guidance(block_scale=jnp.ones(lead + (shape[-1] // 16,), jnp.float8_e4m3fn),
                         row_scale=jnp.ones(lead + (1,), jnp.float32),
                         codes=formats.pack_fp4(jnp.asarray(codes)))
  got = guidance_layout.to_compact(full)
  np.testing.assert_array_equal(got.mantissa, np.asarray(guided.pack_bits(jnp.asarray(codes & 1))))
  assert got.mode == "compact" and got.codes is None


def test_unpad_of_a_record_is_the_pad_inverse():
  rng = np.random.default_rng(1)
  counts = [3, 0, 5]
  rows = guided.Guidance(block_scale=jnp.ones((8, 2), jnp.float8_e4m3fn),
                         row_scale=jnp.asarray(rng.random((8, 1)), jnp.float32),
                         mantissa=jnp.asarray(rng.integers(0, 256, (8, 4)), jnp.uint8))
  padded = guidance_layout.pad_guidance(rows, counts, 6)
  back = guidance_layout.unpad(padded, counts)
  for f in ("block_scale", "row_scale", "mantissa"):
    np.testing.assert_array_equal(np.asarray(getattr(back, f)), np.asarray(getattr(rows, f)))
