"""Ragged <-> padded guidance rows, against references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax.guidance import layout
from trace_jax.guidance.record import Guidance


def test_unpad_of_a_record_is_the_pad_inverse():
  rng = np.random.default_rng(1)
  counts = [3, 0, 5]
  rows = Guidance(block_scale=jnp.ones((8, 2), jnp.float8_e4m3fn),
                  row_scale=jnp.asarray(rng.random((8, 1)), jnp.float32),
                  mantissa=jnp.asarray(rng.integers(0, 256, (8, 4)), jnp.uint8))
  padded = layout.pad_guidance(rows, counts, 6)
  back = layout.unpad(padded, counts)
  for f in ("block_scale", "row_scale", "mantissa"):
    np.testing.assert_array_equal(np.asarray(getattr(back, f)), np.asarray(getattr(rows, f)))


@pytest.mark.parametrize("counts", [[3, 0, 5, 6], [6, 6, 6, 6], [0, 0, 0, 0], [1, 0, 0, 0]],
                         ids=["mixed", "full", "empty", "one_row"])
def test_ragged_rows_on_the_device_equal_unpad(counts):
  """Every leaf's leading sum(counts) rows are `unpad`'s bits (scales of every byte, NaN
  payloads included); a wrong order of the sequences would fail it (control below)."""
  rng = np.random.default_rng(2)
  b, s = 4, 6
  f32 = rng.normal(size=(b, s, 1)).astype(np.float32)
  f32[0, 0, 0] = np.array(0x7FC0_0001, np.uint32).view(np.float32)
  tree = {3: {"moe_in": Guidance(
      block_scale=jnp.asarray(rng.integers(0, 256, (b, s, 2), np.uint8)).view(
          jnp.float8_e4m3fn),
      row_scale=jnp.asarray(f32),
      mantissa=jnp.asarray(rng.integers(0, 256, (b, s, 4), np.uint8))),
      "routing": jnp.asarray(rng.integers(0, 64, (b, s, 8)), jnp.int32)}}
  got = layout.ragged_rows(tree, jnp.asarray(counts, jnp.int32))
  want = layout.unpad(tree, counts)
  n = sum(counts)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.shape[0] == b * s and g.dtype == w.dtype
    np.testing.assert_array_equal(np.asarray(g)[:n].view(np.uint8), np.asarray(w).view(np.uint8))
  if counts[0] and counts[2]:  # control: sequences 0 and 2 taken in the other order
    perm = [2, 1, 0, 3]
    swapped = layout.unpad(jax.tree.map(lambda a: np.asarray(a)[perm], tree),
                                    [counts[i] for i in perm])
    assert not np.array_equal(np.asarray(got[3]["routing"])[:n], swapped[3]["routing"])


def test_start_host_copy_moves_records_to_pinned_host_memory_bit_for_bit():
  """Every leaf lands in pinned host memory with its bytes (fp8 scales, NaN payloads) and
  dtype; the device's arrays are left as they were."""
  rng = np.random.default_rng(3)
  f32 = rng.normal(size=(6, 1)).astype(np.float32)
  f32[1, 0] = np.array(0x7FC0_0001, np.uint32).view(np.float32)
  tree = {5: {"moe_in": Guidance(
      block_scale=jnp.asarray(rng.integers(0, 256, (6, 2), np.uint8)).view(jnp.float8_e4m3fn),
      row_scale=jnp.asarray(f32),
      mantissa=jnp.asarray(rng.integers(0, 256, (6, 4), np.uint8))),
      "routing": jnp.asarray(rng.integers(0, 64, (6, 8)), jnp.int32)}}
  host = layout.start_host_copy(tree)
  assert jax.tree.structure(host) == jax.tree.structure(tree)
  for h, d in zip(jax.tree.leaves(host), jax.tree.leaves(tree)):
    assert h.sharding.memory_kind == "pinned_host" and d.sharding.memory_kind == "device"
    assert h.dtype == d.dtype and h.shape == d.shape
    np.testing.assert_array_equal(np.asarray(h).view(np.uint8), np.asarray(d).view(np.uint8))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_pad_records_rows_and_benign_padding(fmt):
  """Each sequence's ragged rows land at the start of its padded row; padding rows hold block
  scales that decode to 1.0 in the record's format, row scale 1.0, mantissa bits 0, and route
  to experts 0..K-1. No records: None."""
  rng = np.random.default_rng(4)
  counts, seq_len, top_k = [2, 0, 3], 4, 3
  t = sum(counts)
  scale_dtype = jnp.float8_e4m3fn if fmt == "nvfp4" else jnp.float8_e8m0fnu
  rec = Guidance(block_scale=rng.integers(0, 120, (t, 2), np.uint8).view(scale_dtype),
                 row_scale=rng.random((t, 1)).astype(np.float32) if fmt == "nvfp4" else None,
                 mantissa=rng.integers(0, 256, (t, 4), np.uint8))
  ids = rng.integers(0, 8, (t, top_k)).astype(np.int32)
  guidance, routing = layout.pad_records({2: {"moe_in": rec}}, {2: ids}, counts, seq_len)
  got = guidance[2]["moe_in"]
  assert got.format == fmt and got.block_scale.shape == (3, seq_len, 2)
  assert routing[2].dtype == jnp.int32 and routing[2].shape == (3, seq_len, top_k)
  start = 0
  for i, c in enumerate(counts):
    for field in ("block_scale", "row_scale", "mantissa"):
      want = getattr(rec, field)
      if want is None:
        assert getattr(got, field) is None
        continue
      have = np.asarray(getattr(got, field))
      np.testing.assert_array_equal(have[i, :c].view(np.uint8),
                                    want[start:start + c].view(np.uint8), err_msg=field)
      pad = have[i, c:].astype(np.float32)
      np.testing.assert_array_equal(pad, 1.0 if field != "mantissa" else 0.0, err_msg=field)
    np.testing.assert_array_equal(np.asarray(routing[2])[i, :c], ids[start:start + c])
    np.testing.assert_array_equal(np.asarray(routing[2])[i, c:],
                                  np.broadcast_to(np.arange(top_k), (seq_len - c, top_k)))
    start += c
  assert layout.pad_records(None, {}, counts, seq_len) == (None, None)
