"""byte_rows: trees of mixed dtypes through one uint8 row per row and back, bit for bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax.guidance import byte_rows
from trace_jax.guidance.record import Guidance


def _tree(rng: np.random.Generator, lead: tuple[int, ...]):
  f32 = rng.normal(size=lead + (3,)).astype(np.float32)
  f32.reshape(-1)[:4] = [np.nan, -0.0, np.inf, np.float32(1e-45)]  # NaN, -0, inf, subnormal
  nan_payload = np.array(0x7FC0_1234, np.uint32).view(np.float32)
  f32.reshape(-1)[4] = nan_payload
  return {
      "scales": jnp.asarray(rng.integers(0, 256, lead + (2, 4), np.uint8)).view(
          jnp.float8_e4m3fn),  # every byte, the NaN codes 0x7f / 0xff included
      "row": jnp.asarray(f32),
      "ids": jnp.asarray(rng.integers(-(2**31), 2**31 - 1, lead + (8,), np.int64), jnp.int32),
      "bits": jnp.asarray(rng.integers(0, 256, lead + (5,), np.uint8)),
      "mask": jnp.asarray(rng.integers(0, 2, lead, np.uint8) == 1),
      "half": jnp.asarray(rng.normal(size=lead + (2,)), jnp.bfloat16),
  }


def _bits(a):
  a = np.asarray(a)
  return a if a.dtype == bool else a.view(np.uint8)


@pytest.mark.parametrize("lead", [(4,), (2, 3)], ids=["one_axis", "two_axes"])
def test_round_trip_is_bit_exact(lead):
  """pack, then unpack on the device and on the host (`unpack_host`): every bit back."""
  tree = _tree(np.random.default_rng(0), lead)
  layout = byte_rows.layout_of(tree, len(lead))
  rows = jax.jit(lambda t: byte_rows.pack(t, len(lead))[0])(tree)
  assert rows.dtype == jnp.uint8 and rows.shape == lead + (layout.width,)
  assert layout.width == 8 + 12 + 32 + 5 + 1 + 4
  for unpack in (jax.jit(byte_rows.unpack, static_argnums=1), byte_rows.unpack_host):
    back = unpack(np.asarray(rows) if unpack is byte_rows.unpack_host else rows, layout)
    assert jax.tree.structure(back) == jax.tree.structure(tree)
    for name in tree:
      assert back[name].dtype == tree[name].dtype and back[name].shape == tree[name].shape, name
      np.testing.assert_array_equal(_bits(back[name]), _bits(tree[name]), err_msg=name)


def test_rows_move_together():
  """A permutation of the packed rows permutes every leaf alike (what one scatter relies on);
  control: unpacking rows of another layout's tree does not give the tree back."""
  tree = _tree(np.random.default_rng(1), (6,))
  rows, layout = byte_rows.pack(tree, 1)
  perm = np.array([3, 0, 5, 1, 4, 2])
  moved = byte_rows.unpack(rows[perm], layout)
  for name in tree:
    np.testing.assert_array_equal(_bits(moved[name]), _bits(tree[name])[perm], err_msg=name)
  shifted = byte_rows.unpack(jnp.roll(rows, 1, axis=-1), layout)
  assert not np.array_equal(_bits(shifted["row"]), _bits(tree["row"]))


def test_guidance_record():
  g = Guidance(block_scale=jnp.ones((2, 3, 8), jnp.float8_e4m3fn),
               row_scale=jnp.full((2, 3, 1), 0.5, jnp.float32),
               mantissa=jnp.arange(2 * 3 * 16, dtype=jnp.uint8).reshape(2, 3, 16))
  rows, layout = byte_rows.pack({"moe_in": g}, 2)
  assert rows.shape == (2, 3, 8 + 4 + 16)
  back = byte_rows.unpack(rows, layout)["moe_in"]
  assert back.codes is None
  np.testing.assert_array_equal(np.asarray(back.mantissa), np.asarray(g.mantissa))


def test_bad_input_is_refused():
  with pytest.raises(ValueError, match="leading axes"):
    byte_rows.pack({"a": jnp.zeros((2, 3)), "b": jnp.zeros((3, 2))}, 1)
  with pytest.raises(ValueError, match="empty"):
    byte_rows.pack({}, 1)
  _, layout = byte_rows.pack({"a": jnp.zeros((2, 3))}, 1)
  with pytest.raises(ValueError, match="width 12"):
    byte_rows.unpack(jnp.zeros((2, 11), jnp.uint8), layout)
  with pytest.raises(ValueError, match="width 12"):
    byte_rows.unpack_host(np.zeros((2, 11), np.uint8), layout)


def test_forward_tap_rows_are_the_packed_taps():
  """`ForwardOut.tap_rows`, joined by `rows_of_layers`, is `pack(out.taps)` bit for bit (the
  decode loop writes the former and unpacks with the latter's layout) on an fp4_trace forward
  of 4 layers whose scans tap differently: layers 0-1 routing only, 2-3 routing and every
  site's record (two scans of two layers). Joined in another order, the rows differ."""
  from trace_jax import model as M

  cfg = M.tiny(policy="fp4_trace", dtype="float32", num_hidden_layers=4)
  params = M.init_params(cfg, 0, param_dtype="float32")
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 5)), jnp.int32)
  out = jax.jit(lambda p, t: M.forward(p, cfg, t, tap_layers=(2, 3), tap_routing=True,
                                       record=True))(params, tokens)
  assert sorted(out.taps) == [0, 1, 2, 3] and len(out.tap_rows) == 2
  assert [r.shape[0] for r in out.tap_rows] == [2, 2]
  packed, layout = byte_rows.pack(out.taps, lead=2)
  joined = M.rows_of_layers(out.tap_rows)
  assert joined.shape == packed.shape == (2, 5, layout.width)
  np.testing.assert_array_equal(np.asarray(joined), np.asarray(packed))
  swapped = M.rows_of_layers(out.tap_rows[::-1])
  assert not np.array_equal(np.asarray(swapped), np.asarray(packed))


def test_unpack_host_views_the_rows_bytes():
  """`unpack_host` copies nothing but booleans: every other leaf is a view of the rows."""
  tree = _tree(np.random.default_rng(2), (5,))
  rows, layout = byte_rows.pack(tree, 1)
  host = np.asarray(rows).copy()
  back = byte_rows.unpack_host(host, layout)
  for name, leaf in back.items():
    assert np.shares_memory(leaf, host) == (name != "mask"), name
