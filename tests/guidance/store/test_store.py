"""GuidanceStore: batch ids, a rollout's writes and handles, reads by handle, deletion, close,
and removal of batches a killed write left without a manifest."""

from __future__ import annotations

import logging
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from store_cases import HASH, HIDDEN, OPTS, TOP_K

from trace_jax.guidance import schema
from trace_jax.guidance import store as gs
from trace_jax.guidance.store import store as store_lib
from trace_jax.guidance.store import writer as writer_lib
from trace_jax.quant import qat


def _rollout_records(n_seqs: int, seed: int, n_audit: int = 2
                     ) -> tuple[list[int], dict, dict, dict]:
  """Ragged records of a rollout of n_seqs sequences: compact guidance of layer 1, routing of
  layers 0 and 1, full codes of the first n_audit sequences (audit)."""
  rng = np.random.default_rng(seed)
  counts = [int(c) for c in rng.integers(1, 9, n_seqs)]
  x = jnp.asarray(rng.standard_normal((sum(counts), HIDDEN)), jnp.float32)
  record = jax.jit(qat.quantize_act_record, static_argnums=1)
  compact = record(x, "compact")[1]
  full = jax.tree.map(lambda a: a[:sum(counts[:n_audit])], record(x, "full")[1])
  routing = {layer: rng.integers(0, 8, (sum(counts), TOP_K), np.int32) for layer in (0, 1)}
  return counts, {1: {"moe_in": compact}}, routing, {1: {"moe_in": full}}


def test_store_owns_the_batch_lifecycle(tmp_path):
  """GuidanceStore: ids continue after the batches under the root, a rollout batch's handles
  (audited sequences first), reads for samples spanning two batches in sample order, audit
  reads, deletion of a batch with its audit, and close."""
  (tmp_path / "b000007").mkdir()  # a batch of an earlier process: numbering continues after it
  store = gs.GuidanceStore(tmp_path, HASH, options=OPTS)
  a = _rollout_records(3, 0)
  b = _rollout_records(2, 1)
  ha = store.write_rollout(a[0], a[1], a[2], a[3], n_audit=2)
  hb = store.write_rollout(b[0], b[1], b[2], b[3], n_audit=2)
  assert [h.batch_id for h in ha + hb] == ["b000008"] * 3 + ["b000009"] * 2
  assert [h.audit_batch_id for h in ha] == ["b000008.audit"] * 2 + [None]
  assert all(h.store == str(tmp_path) and h.guidance_bytes_per_token > 0 for h in ha)
  assert store.batches() == ["b000007", "b000008", "b000009"]
  # Samples in another order than written, from both batches.
  picked = [hb[1], ha[2], ha[0]]
  got = store.read(picked)
  assert got.seq_ids == [h.seq_id for h in picked] and got.valid.all()
  want_rows = [(b, 1), (a, 2), (a, 0)]
  expect = lambda rec, i, arr: np.asarray(arr)[sum(rec[0][:i]):sum(rec[0][:i + 1])]
  np.testing.assert_array_equal(np.diff(got.seq_offsets), [r[0][i] for r, i in want_rows])
  np.testing.assert_array_equal(
      got.guidance[1]["moe_in"].mantissa,
      np.concatenate([expect(r, i, r[1][1]["moe_in"].mantissa) for r, i in want_rows]))
  np.testing.assert_array_equal(
      got.routing[0], np.concatenate([expect(r, i, r[2][0]) for r, i in want_rows]))
  audit = store.read([ha[1], hb[0]], audit=True)
  np.testing.assert_array_equal(
      audit.guidance[1]["moe_in"].codes,
      np.concatenate([expect(a, 1, a[3][1]["moe_in"].codes),
                      expect(b, 0, b[3][1]["moe_in"].codes)]))
  with pytest.raises(ValueError, match="has no audit record"):
    store.read([ha[2]], audit=True)
  store.delete([ha[0].batch_id])
  assert store.batches() == ["b000007", "b000009"]
  assert not (tmp_path / "b000008.audit").exists() and (tmp_path / "b000009.audit").exists()
  with pytest.raises(ValueError, match="path separator|one path component|not a valid"):
    store.delete(["../b000009"])
  store.close()
  with pytest.raises(RuntimeError, match="closed"):
    store.write_rollout(a[0], a[1], a[2])


def _half_written(store: gs.GuidanceStore, how: str, monkeypatch) -> list:
  """A rollout batch (and its audit batch) whose arrays are on disk without a manifest: the
  write killed before its manifest, or a written batch whose manifest was deleted."""
  b = _rollout_records(2, 1)
  if how == "killed_before_manifest":
    def killed(path, obj, fsync=True):
      raise OSError("killed before the manifest")
    monkeypatch.setattr(writer_lib, "write_json_atomic", killed)
    handles = store.write_rollout(b[0], b[1], b[2], b[3], n_audit=2)
    with pytest.raises(gs.GuidanceError, match="killed before the manifest"):
      store.flush()
    monkeypatch.undo()
  else:
    handles = store.write_rollout(b[0], b[1], b[2], b[3], n_audit=2)
    store.flush()
    for bid in (handles[0].batch_id, handles[0].audit_batch_id):
      os.remove(os.path.join(store.root, bid, schema.MANIFEST))
  return handles


@pytest.mark.parametrize("how", ["killed_before_manifest", "manifest_deleted"])
def test_remove_incomplete_deletes_only_batches_without_a_manifest(tmp_path, caplog,
                                                                   monkeypatch, how):
  """remove_incomplete deletes the batch directories without a manifest (a rollout batch and
  its audit batch), returns their ids sorted and logs one line; the complete batch beside them
  still reads bit for bit, and files, symlinks and directories that are not batch ids stay."""
  root = tmp_path / "root"
  store = gs.GuidanceStore(root, HASH, options=OPTS)
  a = _rollout_records(3, 0)
  done = store.write_rollout(a[0], a[1], a[2], a[3], n_audit=2)
  store.flush()
  half = _half_written(store, how, monkeypatch)
  bid = half[0].batch_id
  assert (root / bid / "layer_001" / "moe_in" / "mantissa" / "zarr.json").exists()
  assert not (root / bid / schema.MANIFEST).exists()
  (root / "notes.txt").write_text("not a batch")
  for name in (".partial", "a b", "b0.."):
    (root / name).mkdir()
  (tmp_path / "elsewhere").mkdir()
  os.symlink(tmp_path / "elsewhere", root / "b000777")
  with caplog.at_level(logging.WARNING, logger=store_lib.__name__):
    removed = store.remove_incomplete()
  assert removed == [bid, f"{bid}.audit"]
  lines = [r.getMessage() for r in caplog.records if r.name == store_lib.__name__]
  assert len(lines) == 1 and f"{bid}, {bid}.audit" in lines[0], lines
  assert not (root / bid).exists() and not (root / f"{bid}.audit").exists()
  assert (root / "notes.txt").is_file() and (root / "b000777").is_symlink()
  assert all((root / name).is_dir() for name in (".partial", "a b", "b0.."))
  assert (tmp_path / "elsewhere").is_dir()
  assert done[0].batch_id in store.batches() and bid not in store.batches()
  got = store.read(done)
  assert got.valid.all()
  np.testing.assert_array_equal(got.guidance[1]["moe_in"].mantissa,
                                np.asarray(a[1][1]["moe_in"].mantissa))
  np.testing.assert_array_equal(store.read(done[:2], audit=True).guidance[1]["moe_in"].codes,
                                np.asarray(a[3][1]["moe_in"].codes))
  with pytest.raises(gs.GuidanceError, match="no manifest"):
    store.read(half)
  caplog.clear()
  with caplog.at_level(logging.WARNING, logger=store_lib.__name__):
    assert store.remove_incomplete() == []
  assert not [r for r in caplog.records if r.name == store_lib.__name__]
  store.close()


def test_remove_incomplete_leaves_batches_being_written(tmp_path, monkeypatch):
  """A batch this store is still writing has no manifest yet: it is not removed, and it reads
  once its write completes."""
  arrays_written, gate = threading.Event(), threading.Event()
  real = writer_lib.write_json_atomic

  def gated(path, obj, fsync=True):
    arrays_written.set()
    assert gate.wait(10)
    real(path, obj, fsync)
  monkeypatch.setattr(writer_lib, "write_json_atomic", gated)
  store = gs.GuidanceStore(tmp_path, HASH, options=OPTS)
  a = _rollout_records(3, 0)
  handles = store.write_rollout(a[0], a[1], a[2])
  assert arrays_written.wait(10)  # the batch directory is there, its manifest not yet
  assert store.remove_incomplete() == []
  assert (tmp_path / handles[0].batch_id).is_dir()
  gate.set()
  store.flush()
  assert (tmp_path / handles[0].batch_id / schema.MANIFEST).exists()
  np.testing.assert_array_equal(store.read(handles).guidance[1]["moe_in"].mantissa,
                                np.asarray(a[1][1]["moe_in"].mantissa))
  store.close()
