"""MemoryGuidanceStore: what the disk store reads back, read back from host memory; the
writer's checks on what is written; device arrays' padding rows cut; clear errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from store_cases import HASH, LENS, OPTS, bits, records

from trace_jax.guidance import store as gs
from trace_jax.guidance.record import Guidance

N = len(LENS)


def _write_both(tmp_path, n_audit: int = 2):
  """The same two rollout batches written to a disk store and a memory store: compact records
  and routing of every sequence, full codes (random bytes) of the first n_audit."""
  compact, routing = records("compact")
  full, _ = records("full")
  audit_rows = sum(LENS[:n_audit])
  audit = {layer: {site: Guidance(*(None if a is None else np.asarray(a)[:audit_rows]
                                    for a in g)) for site, g in sites.items()}
           for layer, sites in full.items()}
  disk = gs.GuidanceStore(tmp_path, HASH, options=OPTS)
  memory = gs.MemoryGuidanceStore(HASH)
  handles = {}
  for name, store in (("disk", disk), ("memory", memory)):
    handles[name] = [store.write_rollout(LENS, compact, routing, audit, n_audit)
                     for _ in range(2)]
  return disk, memory, handles


def _assert_same_batch(a: gs.GuidanceBatch, b: gs.GuidanceBatch) -> None:
  """Two reads of the same records: equal ids, offsets and every field bit for bit."""
  assert a.seq_ids == b.seq_ids
  np.testing.assert_array_equal(a.seq_offsets, b.seq_offsets)
  np.testing.assert_array_equal(a.valid, b.valid)
  assert a.guidance.keys() == b.guidance.keys() and a.routing.keys() == b.routing.keys()
  for layer, sites in a.guidance.items():
    assert sites.keys() == b.guidance[layer].keys()
    for site, g in sites.items():
      for field, x, y in zip(Guidance._fields, g, b.guidance[layer][site]):
        assert (x is None) == (y is None), (layer, site, field)
        if x is not None:
          assert x.dtype == y.dtype and x.shape == y.shape, (layer, site, field)
          np.testing.assert_array_equal(bits(x), bits(y), err_msg=f"{layer}/{site}/{field}")
  for layer, ids in a.routing.items():
    assert ids.dtype == b.routing[layer].dtype
    np.testing.assert_array_equal(ids, b.routing[layer])


# (name, which handles of the two batches, audit read): selections a trainer makes.
SELECTIONS = [
    ("one_whole_batch", lambda h: h[0], False),
    ("reordered_across_batches", lambda h: [h[1][3], h[0][1], h[1][0], h[0][4]], False),
    ("empty_sequence_alone", lambda h: [h[0][3]], False),
    ("audit_of_both_batches", lambda h: [h[0][0], h[0][1], h[1][1]], True),
]


@pytest.mark.parametrize("select,audit", [s[1:] for s in SELECTIONS],
                         ids=[s[0] for s in SELECTIONS])
def test_memory_reads_what_the_disk_store_reads(select, audit, tmp_path):
  disk, memory, handles = _write_both(tmp_path)
  got_disk = disk.read(select(handles["disk"]), audit=audit)
  got_memory = memory.read(select(handles["memory"]), audit=audit)
  _assert_same_batch(got_disk, got_memory)
  assert [h.guidance_bytes_per_token for h in handles["memory"][0]] == [
      h.guidance_bytes_per_token for h in handles["disk"][0]]
  assert all(h.store is None for h in handles["memory"][0])
  disk.close()
  memory.close()


def test_lifecycle_and_errors():
  """Ids count up; delete drops a batch with its audit batch; a deleted batch, a sequence
  without audit, and a record the writer refuses are one-line errors."""
  compact, routing = records("compact")
  memory = gs.MemoryGuidanceStore(HASH)
  a = memory.write_rollout(LENS, compact, routing, {}, 0)
  b = memory.write_rollout(LENS, compact, routing, {}, 0)
  assert [a[0].batch_id, b[0].batch_id] == ["b000000", "b000001"]
  assert memory.batches() == ["b000000", "b000001"] and memory.remove_incomplete() == []
  with pytest.raises(ValueError, match="has no audit record"):
    memory.read(a[:1], audit=True)
  memory.delete([a[0].batch_id])
  assert memory.batches() == ["b000001"]
  with pytest.raises(gs.GuidanceError, match="b000000.*not in memory"):
    memory.read(a)
  bad = {layer: {site: g.replace(row_scale=np.asarray(g.row_scale)[:-1])
                 for site, g in sites.items()} for layer, sites in compact.items()}
  with pytest.raises(ValueError, match="row_scale shape"):
    memory.write_rollout(LENS, bad, routing)
  memory.close()


def test_numpy_inputs_are_copied_and_device_padding_rows_cut():
  """A caller may reuse its numpy buffers after the write; device arrays may hold padding rows
  past the batch's tokens (the engine's one program per batch shape), cut after the copy."""
  compact, routing = records("compact")
  mine = {layer: ids.copy() for layer, ids in routing.items()}
  padded = {layer: {site: Guidance(*(None if x is None else jnp.concatenate(
      [jnp.asarray(x), jnp.zeros((7,) + x.shape[1:], x.dtype)]) for x in g))
                    for site, g in sites.items()} for layer, sites in compact.items()}
  memory = gs.MemoryGuidanceStore(HASH)
  handles = memory.write_rollout(LENS, padded, mine)
  for ids in mine.values():
    ids[:] = -1
  got = memory.read(handles)
  with pytest.raises(ValueError, match="read-only"):
    got.routing[min(got.routing)][0, 0] = 5  # the store's own arrays: no caller changes them
  for layer, sites in compact.items():
    np.testing.assert_array_equal(got.routing[layer], routing[layer])
    for site, g in sites.items():
      assert isinstance(got.guidance[layer][site].mantissa, np.ndarray)
      np.testing.assert_array_equal(bits(got.guidance[layer][site].block_scale),
                                    bits(jax.device_get(g.block_scale)))
  memory.close()
