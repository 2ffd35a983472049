"""Guidance store reader: bit-exact reads of any selection, prefetch, and bad guidance (every
damage raises GuidanceError or flags exactly the affected sequences for RTN fallback)."""

from __future__ import annotations

import json
import logging
import os
import shutil

import numpy as np
import pytest
import tensorstore as ts
from store_cases import (
    BAD_IDS,
    HASH,
    IDS,
    LAYERS,
    LENS,
    OPTS,
    TOP_K,
    assert_batch_matches,
    bits,
    records,
    write,
)

from trace_jax.guidance import record, schema
from trace_jax.guidance import store as gs
from trace_jax.guidance.store import arrays
from trace_jax.guidance.store import reader as reader_lib


@pytest.mark.parametrize("mode", ["compact", "full"])
@pytest.mark.parametrize("select", [None, (42, 11, 3, 99), (3,)],
                         ids=["all", "subset_reordered", "empty_sequence_only"])
def test_round_trip_bit_exact(stored, mode, select):
  reader = gs.GuidanceReader(stored[0], HASH)
  batch = reader.read(mode, select)
  positions = range(len(IDS)) if select is None else [IDS.index(s) for s in select]
  assert batch.seq_ids == list(IDS if select is None else select)
  assert batch.valid.all()
  np.testing.assert_array_equal(np.diff(batch.seq_offsets), [LENS[i] for i in positions])
  assert_batch_matches(batch, mode, positions)
  assert reader.stats.fallback_sequences == 0


def test_string_ids(tmp_path):
  ids = [f"req-{i}" for i in range(len(LENS))]
  write(tmp_path, "compact", ids=ids)
  batch = gs.GuidanceReader(tmp_path, HASH).read("b0", ["req-2", "req-1"])
  assert batch.seq_ids == ["req-2", "req-1"]
  assert_batch_matches(batch, "compact", [2, 1])


def test_prefetch_returns_same_data(tmp_path):
  guidance, routing = records("compact")
  with gs.GuidanceWriter(tmp_path, HASH, OPTS) as w:
    for i in range(2):
      w.write_batch(f"step{i}", IDS, LENS, guidance, routing)
  reader = gs.GuidanceReader(tmp_path, HASH, layers=[3], sites=["k", "v"])
  fut = reader.prefetch("step1", [99, 42])
  now = reader.read("step0", [99, 42])  # the trainer works on the current batch meanwhile
  pre = reader.get("step1", [99, 42])
  assert fut.done() and pre.batch_id == "step1"
  assert set(pre.guidance) == {3} and set(pre.guidance[3]) == {"k", "v"}
  assert set(pre.routing) == set(LAYERS)
  for site in ("k", "v"):
    for field in record.MODE_FIELDS["compact"]:
      np.testing.assert_array_equal(bits(getattr(pre.guidance[3][site], field)),
                                    bits(getattr(now.guidance[3][site], field)))
  np.testing.assert_array_equal(pre.seq_offsets, now.seq_offsets)
  reader.close()


def _recreate(path, rows=None, trailing=None):
  """Rewrites an array in place with another row count or trailing shape (a bad writer)."""
  old = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path) + "/"}},
                open=True).result()
  data = old.read().result()
  data = data[:rows] if rows is not None else data
  if trailing is not None:
    data = np.zeros((data.shape[0],) + trailing, data.dtype)
  md = arrays.zarr_metadata(data.shape, data.dtype.name, 128, 32, OPTS)
  t = ts.open(arrays.spec(str(path), md), create=True, delete_existing=True).result()
  t.write(data).result()


def _corrupt_shard(path):
  """Flips bytes inside shard 1 (rows 128..255: only sequence position 1 lives there)."""
  shard = path / "c.1.0.0"
  raw = bytearray(shard.read_bytes())
  for i in range(4, len(raw) - 40, 7):
    raw[i] ^= 0x5A
  shard.write_bytes(bytes(raw))


def _chunk_from_other_batch(d, array=("layer_002", "v", "mantissa"), shard="c.1.0.0"):
  """Writes a batch of the same shapes (other data) beside d and copies one of its valid
  shard files over d's (rows 128..255: only sequence position 1 lives there)."""
  write(d.parent, batch_id="donor", seed=7)
  shutil.copyfile(d.parent.joinpath("donor", *array, shard), d.joinpath(*array, shard))


def _manifest_from_other_batch(d):
  """The manifest of a batch of the same shapes and ids (other data) over d's."""
  write(d.parent, batch_id="donor", seed=7)
  manifest = json.loads((d.parent / "donor" / schema.MANIFEST).read_text())
  manifest["batch_id"] = "b0"
  (d / schema.MANIFEST).write_text(json.dumps(manifest))


ALL = list(range(len(IDS)))


# name -> (damage(batch_dir), reader kwargs, requested ids, flagged positions, error regex)
CASES = {
    "missing_manifest": (lambda d: os.remove(d / schema.MANIFEST), {}, IDS, ALL,
                         r"'b0'.*incomplete batch: no manifest"),
    "garbled_manifest": (lambda d: (d / schema.MANIFEST).write_text("{not json"), {}, IDS, ALL,
                         r"'b0'.*unreadable manifest.json"),
    "missing_array": (lambda d: shutil.rmtree(d / "layer_003" / "k" / "row_scale"), {}, IDS, ALL,
                      r"'b0', layer 3, site 'k'.*row_scale missing"),
    "truncated_array": (lambda d: _recreate(d / "layer_002" / "moe_in" / "mantissa", rows=310),
                        {}, IDS, [2, 4], r"layer 2, site 'moe_in', sequences \[42, 99\].*"
                        r"truncated to 310 of 323"),
    "wrong_shape": (lambda d: _recreate(d / "layer_003" / "expert_mid" / "block_scale",
                                        trailing=(TOP_K, 3)), {}, IDS, ALL,
                    r"layer 3, site 'expert_mid'.*has shape \(323, 2, 3\)"),
    "wrong_config_hash": (lambda d: None, {"expected_config_hash": "sha256:other"}, IDS, ALL,
                          r"'b0'.*config hash 'sha256:.*' .* != trainer's expected "
                          r"'sha256:other'"),
    "unknown_seq_id": (lambda d: None, {}, IDS + ("nope",), [5],
                       r"'b0', sequences \['nope'\]: sequence ids not in this batch"),
    "lost_shard": (lambda d: os.remove(d / "layer_003" / "routing" / "ids" / "c.1.0"), {},
                   IDS, [1], r"layer 3, site 'routing', sequences \[7\].*missing"),
    "corrupt_chunk": (lambda d: _corrupt_shard(d / "layer_002" / "v" / "mantissa"), {}, IDS, [1],
                      r"layer 2, site 'v', sequences \[7\].*unreadable"),
    "chunk_from_other_batch": (_chunk_from_other_batch, {}, IDS, [1],
                               r"layer 2, site 'v', sequences \[7\].*CRC-32 mismatch"),
    "manifest_from_other_batch": (_manifest_from_other_batch, {}, IDS, [0, 1, 2, 4],
                                  r"'b0', layer \d, site '\w+', sequences \[.*CRC-32 mismatch"),
    "missing_root": (lambda d: shutil.rmtree(d.parent), {}, IDS, ALL,
                     r"'b0'.*guidance root .* does not exist"),
}


# The stats reason each case is counted under (default: the case name).
REASONS = {"garbled_manifest": "bad_manifest", "wrong_shape": "corrupt_array",
           "wrong_config_hash": "config_hash", "unknown_seq_id": "unknown_sequence",
           "lost_shard": "corrupt_array", "corrupt_chunk": "corrupt_array",
           "chunk_from_other_batch": "checksum_mismatch",
           "manifest_from_other_batch": "checksum_mismatch"}


@pytest.mark.parametrize("on_missing", ["error", "fallback"])
@pytest.mark.parametrize("case", list(CASES))
def test_bad_guidance(tmp_path, caplog, case, on_missing):
  damage, kwargs, ids, flagged, pattern = CASES[case]
  write(tmp_path)
  damage(tmp_path / "b0")
  kwargs = {"expected_config_hash": HASH, **kwargs}
  reader = gs.GuidanceReader(tmp_path, on_missing=on_missing, **kwargs)
  if on_missing == "error":
    with pytest.raises(gs.GuidanceError, match=pattern):
      reader.read("b0", ids)
    return
  with caplog.at_level(logging.WARNING, logger=reader_lib.__name__):
    batch = reader.read("b0", ids)
  assert list(np.flatnonzero(~batch.valid)) == flagged
  assert reader.stats.reasons[REASONS.get(case, case)] >= 1, reader.stats.reasons
  assert reader.stats.fallback_sequences == len(flagged)
  assert reader.stats.fallback_batches == 1
  assert any("RTN fallback" in r.message for r in caplog.records)
  lens = np.diff(batch.seq_offsets)
  assert all(lens[j] == 0 for j in flagged)
  kept = [j for j in range(len(ids)) if j not in flagged]
  if kept:
    assert_batch_matches(batch, "compact", kept)
  assert all(a.shape[0] == 0 for sites in batch.guidance.values() for g in sites.values()
             for a in (g.block_scale, g.row_scale, g.mantissa)) or kept
  # Counting accumulates over reads.
  reader.read("b0", ids)
  assert reader.stats.fallback_sequences == 2 * len(flagged)


@pytest.mark.parametrize("select", [(7,), (99, 7, 11), IDS, (11, 42, 3, 99)],
                         ids=["one", "subset", "all", "unaffected"])
def test_chunk_from_other_batch_detected_in_subsets(tmp_path, select):
  """A valid shard copied in from another batch of the same shape (TensorStore reads it without
  complaint) is caught by the per-sequence checksums whatever subset of sequences is read; only
  the sequence whose rows changed (7: the copied shard holds rows 128..255) is flagged."""
  write(tmp_path)
  _chunk_from_other_batch(tmp_path / "b0")
  raw = ts.open(arrays.spec(str(tmp_path / "b0" / "layer_002" / "v" / "mantissa")),
                open=True).result().read().result()
  assert not np.array_equal(raw, records("compact")[0][2]["v"].mantissa)  # wrong rows, readable
  reader = gs.GuidanceReader(tmp_path, HASH, on_missing="fallback")
  batch = reader.read("b0", select)
  flagged = [j for j, s in enumerate(select) if s == 7]
  assert list(np.flatnonzero(~batch.valid)) == flagged
  assert reader.stats.reasons["checksum_mismatch"] == (1 if flagged else 0)
  kept = [IDS.index(s) for s in select if s != 7]
  if kept:
    assert_batch_matches(batch, "compact", kept)
  other = gs.GuidanceReader(tmp_path, HASH, layers=[3])  # the damaged array is not read
  assert other.read("b0", select).valid.all()
  if flagged:
    with pytest.raises(gs.GuidanceError, match=r"layer 2, site 'v', sequences \[7\].*CRC-32"):
      gs.GuidanceReader(tmp_path, HASH).read("b0", select)


def _set(path):
  """Manifest edit: sets the value at `path` (keys into the manifest's JSON) to v."""
  def edit(m, v):
    for k in path[:-1]:
      m = m[k]
    m[path[-1]] = v
  return edit


def _first_array(m):
  return m["arrays"]["layer_002/moe_in/mantissa"]


# name -> (edit(manifest), value): fields of the wrong type or inconsistent values.
BAD_FIELDS = {
    "counts_str": (_set(["token_counts"]), ["5", "300", "17", "0", "1"]),
    "counts_float": (_set(["token_counts"]), [5.5, 300, 17, 0, 0.5]),
    "counts_bool": (_set(["token_counts"]), [5, 300, 17, False, True]),
    "counts_dict": (_set(["token_counts"]), {"a": 1}),
    "num_tokens_str": (_set(["num_tokens"]), "323"),
    "layers_str": (_set(["layers"]), ["2", "3"]),
    "layers_float": (_set(["layers"]), [2.5, 3]),
    "layers_negative": (_set(["layers"]), [-1, 3]),
    "routing_layers_none": (_set(["routing_layers"]), None),
    "sites_int": (_set(["sites"]), [5]),
    "seq_ids_lists": (_set(["seq_ids"]), [[1], [2], [3], [4], [5]]),
    "mode_list": (_set(["mode"]), ["compact"]),
    "arrays_list": (_set(["arrays"]), []),
    "array_entry_str": (lambda m, v: m["arrays"].__setitem__("layer_002/moe_in/mantissa", v),
                        "uint8"),
    "array_shape_str": (lambda m, v: _first_array(m).__setitem__("shape", v), "abc"),
    "array_shape_none": (lambda m, v: _first_array(m).__setitem__("shape", v), [None, 8]),
    "array_dtype_list": (lambda m, v: _first_array(m).__setitem__("dtype", v), ["uint8"]),
    "array_path_traversal": (lambda m, v: m["arrays"].__setitem__("../../x", v),
                             {"dtype": "uint8", "stored_dtype": "uint8", "shape": [323]}),
    "missing_field": (lambda m, v: m.pop("token_counts"), None),
    "manifest_list": (None, [1, 2]),
}


@pytest.mark.parametrize("on_missing", ["error", "fallback"])
@pytest.mark.parametrize("case", list(BAD_FIELDS))
def test_manifest_wrong_types_are_a_bad_batch(tmp_path, case, on_missing):
  """A manifest field of the wrong type (or an inconsistent one) makes the batch unusable:
  GuidanceError under "error", every sequence flagged and counted as bad_manifest under
  "fallback"; never a KeyError/TypeError/ValueError."""
  write(tmp_path)
  path = tmp_path / "b0" / schema.MANIFEST
  manifest = json.loads(path.read_text())
  edit, value = BAD_FIELDS[case]
  if edit is None:
    manifest = value
  else:
    edit(manifest, value)
  path.write_text(json.dumps(manifest))
  reader = gs.GuidanceReader(tmp_path, HASH, on_missing=on_missing)
  if on_missing == "error":
    with pytest.raises(gs.GuidanceError, match=r"'b0'.*(bad )?manifest"):
      reader.read("b0", IDS)
    return
  batch = reader.read("b0", IDS)
  assert not batch.valid.any() and reader.stats.fallback_sequences == len(IDS)
  assert reader.stats.reasons["bad_manifest"] == 1, reader.stats.reasons


def test_schema_1_batches_are_refused(tmp_path):
  """A batch of the previous schema (no checksums) is unusable: schema_version."""
  write(tmp_path)
  path = tmp_path / "b0" / schema.MANIFEST
  manifest = json.loads(path.read_text())
  manifest["schema_version"] = 1
  path.write_text(json.dumps(manifest))
  reader = gs.GuidanceReader(tmp_path, HASH, on_missing="fallback")
  assert not reader.read("b0", IDS).valid.any()
  assert reader.stats.reasons["schema_version"] == 1


@pytest.mark.parametrize("on_missing", ["error", "fallback"])
def test_read_never_leaves_the_root(tmp_path, on_missing):
  """read("../outside/b9") of a valid batch outside the root: a bad batch id, nothing read."""
  write(tmp_path / "outside", batch_id="b9")
  (tmp_path / "root").mkdir()
  reader = gs.GuidanceReader(tmp_path / "root", HASH, on_missing=on_missing)
  for bid in BAD_IDS:
    if on_missing == "error":
      with pytest.raises(gs.GuidanceError, match="batch id .* is invalid"):
        reader.read(bid, IDS)
    else:
      batch = reader.read(bid, IDS)
      assert not batch.valid.any() and not batch.guidance and not batch.routing, bid
  if on_missing == "fallback":
    assert reader.stats.reasons["bad_batch_id"] == len(BAD_IDS)
    assert reader.stats.fallback_sequences == len(BAD_IDS) * len(IDS)


@pytest.mark.parametrize("on_missing", ["error", "fallback"])
def test_missing_root_is_named(tmp_path, on_missing):
  """A reader whose root does not exist says so (not "no manifest.json")."""
  reader = gs.GuidanceReader(tmp_path / "nowhere", HASH, on_missing=on_missing)
  assert reader.complete_batches() == []
  if on_missing == "error":
    with pytest.raises(gs.GuidanceError, match=r"guidance root .*nowhere does not exist"):
      reader.read("b0", IDS)
    return
  assert not reader.read("b0", IDS).valid.any()
  assert reader.stats.reasons == {"missing_root": 1}
