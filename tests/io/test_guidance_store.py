"""Guidance store: bit-exact round trips, manifest-last, async writes, prefetch, bad guidance."""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts

from trace_jax.io import guidance_store as gs
from trace_jax.quant import guided, qat
from trace_jax.quant.guided import Guidance, bytes_per_row

LENS = (5, 300, 17, 0, 1)  # ragged, with an empty sequence; 323 tokens over 3 shards
IDS = (11, 7, 42, 3, 99)
LAYERS = (2, 3)
TOP_K, KV_HEADS, HIDDEN, INTER, HEAD_DIM = 2, 2, 64, 32, 16
OPTS = gs.StoreOptions(shard_tokens=128, chunk_tokens=32, fsync=False)  # fsync: real-record test
HASH = gs.config_hash({"policy": "fp4_trace", "guided_layers": LAYERS})
T = sum(LENS)
OFFSETS = np.concatenate([[0], np.cumsum(LENS)])


def _records(mode: str, seed: int | None = None) -> tuple[dict, dict]:
  """Records for every guided layer and site: random bytes in every field.

  Random bit patterns (float8 NaNs, float32 NaNs/infs included) make the round trip a strict
  bit-exactness test; `test_real_rollout_record_round_trip` covers quantize_act_record output.
  """
  rng = np.random.default_rng((0 if mode == "compact" else 1) if seed is None else seed)
  shapes = {"moe_in": (T, HIDDEN), "expert_mid": (T, TOP_K, INTER),
            "k": (T, KV_HEADS, HEAD_DIM), "v": (T, KV_HEADS, HEAD_DIM)}
  per_col = {"block_scale": 16, "mantissa": 8, "codes": 2}
  guidance = {}
  for layer in LAYERS:
    guidance[layer] = {}
    for site, shape in shapes.items():
      fields = {f: rng.integers(0, 256, shape[:-1] + (shape[-1] // per_col[f],), np.uint8)
                for f in gs.MODE_FIELDS[mode] if f in per_col}
      fields["block_scale"] = fields["block_scale"].view(jnp.float8_e4m3fn)
      fields["row_scale"] = rng.integers(0, 2**32, shape[:-1] + (1,), np.uint32).view(np.float32)
      guidance[layer][site] = Guidance(**fields)
  routing = {layer: rng.integers(0, 8, (T, TOP_K), np.int32) for layer in LAYERS}
  return guidance, routing


RECORDS = {}


def records(mode: str) -> tuple[dict, dict]:
  if mode not in RECORDS:
    RECORDS[mode] = _records(mode)
  return RECORDS[mode]


def write(root, mode: str = "compact", batch_id: str = "b0", ids=IDS,
          seed: int | None = None) -> gs.BatchWrite:
  """Writes one batch; seed: other random records of the same shapes (another batch)."""
  guidance, routing = records(mode) if seed is None else _records(mode, seed)
  with gs.GuidanceWriter(root, HASH, OPTS) as w:
    handle = w.write_batch(batch_id, ids, LENS, guidance, routing)
  return handle


@pytest.fixture(scope="module")
def stored(tmp_path_factory) -> tuple:
  """One pristine batch per mode (batch id = mode), shared by the read-only tests."""
  root = tmp_path_factory.mktemp("guidance")
  stats = {mode: write(root, mode, batch_id=mode).stats for mode in ("compact", "full")}
  return root, stats


def bits(a) -> np.ndarray:
  """Raw bytes of an array, so NaNs and float8 compare bit for bit."""
  a = np.ascontiguousarray(np.asarray(a))
  return a.view(np.uint8)


def expected_rows(a, positions) -> np.ndarray:
  return np.concatenate([np.asarray(a)[OFFSETS[i]:OFFSETS[i + 1]] for i in positions])


def assert_batch_matches(batch: gs.GuidanceBatch, mode: str, positions) -> None:
  """Valid sequences' rows equal the written records bit for bit."""
  guidance, routing = records(mode)
  for layer in LAYERS:
    assert set(batch.guidance[layer]) == set(guidance[layer])
    for site, g in guidance[layer].items():
      got = batch.guidance[layer][site]
      assert got.mode == mode
      for field in gs.MODE_FIELDS[mode]:
        want = expected_rows(getattr(g, field), positions)
        have = getattr(got, field)
        assert have.dtype == want.dtype, (layer, site, field)
        assert have.shape == want.shape, (layer, site, field)
        np.testing.assert_array_equal(bits(have), bits(want), err_msg=f"{layer}/{site}/{field}")
    np.testing.assert_array_equal(batch.routing[layer], expected_rows(routing[layer], positions))


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


def test_real_rollout_record_round_trip(tmp_path):
  """quantize_act_record's compact record survives the store and guides rounding identically."""
  x = (jax.random.normal(jax.random.key(0), (T, HIDDEN)) * 3).astype(jnp.bfloat16)
  rec = jax.jit(qat.quantize_act_record, static_argnums=1)(x, "compact")[1]
  with gs.GuidanceWriter(tmp_path, HASH, gs.StoreOptions(128, 32)) as w:  # fsync on
    w.write_batch("real", IDS, LENS, {5: {"moe_in": rec}})
  back = gs.GuidanceReader(tmp_path, HASH).read("real").guidance[5]["moe_in"]
  for field in gs.MODE_FIELDS["compact"]:
    np.testing.assert_array_equal(bits(getattr(back, field)), bits(getattr(rec, field)))
  as_bytes = jax.lax.bitcast_convert_type(jnp.asarray(back.block_scale), jnp.uint8)
  np.testing.assert_array_equal(np.asarray(as_bytes), bits(rec.block_scale))
  guided.validate(x, jax.tree.map(jnp.asarray, back))


@pytest.mark.parametrize("mode", ["compact", "full"])
def test_bytes_per_token_reported(stored, mode):
  stats = stored[1][mode]
  per_token = {m: sum(len(LAYERS) * rows * bytes_per_row(k, m)
                      for rows, k in ((1, HIDDEN), (TOP_K, INTER), (KV_HEADS, HEAD_DIM),
                                      (KV_HEADS, HEAD_DIM))) for m in ("compact", "full")}
  assert stats["guidance_bytes_per_token"] == per_token[mode]
  assert stats["compact_bytes_per_token"] == per_token["compact"]
  assert stats["full_bytes_per_token"] == per_token["full"]
  assert stats["full_over_compact"] == per_token["full"] / per_token["compact"]
  assert stats["routing_bytes_per_token"] == len(LAYERS) * TOP_K * 4
  guidance, _ = records(mode)
  assert stats["guidance_bytes"] == sum(g.nbytes for s in guidance.values() for g in s.values())
  with open(stored[0] / mode / gs.MANIFEST) as f:
    manifest = json.load(f)
  assert {k: manifest["bytes"][k] for k in stats if k in manifest["bytes"]} == {
      k: v for k, v in stats.items() if k not in gs._NOT_BYTES}
  assert 0 < manifest["bytes"]["stored_chunk_bytes"]
  print(f"\n{mode}: guidance {stats['guidance_bytes_per_token']:.1f} B/token (compact "
        f"{stats['compact_bytes_per_token']:.1f}, full {stats['full_bytes_per_token']:.1f}, "
        f"x{stats['full_over_compact']:.2f}); on disk "
        f"{manifest['bytes']['stored_chunk_bytes_per_token']:.1f} B/token incl. routing")


def test_device_arrays_with_padding_rows(tmp_path, stored):
  """Device arrays may carry rows past the batch's tokens (the engine's padded ragged rows,
  copied to the host on the writer thread): the padding is dropped, and the batch reads back,
  with the same manifest shapes and byte stats, as the numpy write of the exact rows. A numpy
  array with extra rows, and a device array with too few, stay errors."""
  guidance, routing = records("compact")
  pad = lambda a: jnp.concatenate([jnp.asarray(a), jnp.zeros((5,) + a.shape[1:], a.dtype)])
  dev_g = jax.tree.map(pad, guidance)
  dev_r = {layer: pad(ids) for layer, ids in routing.items()}
  with gs.GuidanceWriter(tmp_path, HASH, OPTS) as w:
    stats = w.write_batch("padded", IDS, LENS, dev_g, dev_r).result()["bytes"]
  assert_batch_matches(gs.GuidanceReader(tmp_path, HASH).read("padded"), "compact",
                       range(len(IDS)))
  with open(stored[0] / "compact" / gs.MANIFEST) as f:
    want = json.load(f)
  with open(tmp_path / "padded" / gs.MANIFEST) as f:
    got = json.load(f)
  assert {p: e["shape"] for p, e in got["arrays"].items()} == {
      p: e["shape"] for p, e in want["arrays"].items()}
  assert {k: stats[k] for k in stats if "chunk" not in k} == {
      k: v for k, v in want["bytes"].items() if "chunk" not in k}
  one = next(iter(guidance))
  with gs.GuidanceWriter(tmp_path, HASH, OPTS) as w:
    with pytest.raises(ValueError, match="rows"):
      w.write_batch("np_pad", IDS, LENS, jax.tree.map(lambda a: np.asarray(pad(a)), guidance))
    short = jax.tree.map(lambda a: jnp.asarray(a)[:-1], {one: guidance[one]})
    with pytest.raises(ValueError, match="rows"):
      w.write_batch("short", IDS, LENS, short)


def test_manifest_contents(stored):
  with open(stored[0] / "compact" / gs.MANIFEST) as f:
    manifest = json.load(f)
  assert manifest["schema_version"] == gs.SCHEMA_VERSION and manifest["config_hash"] == HASH
  assert manifest["seq_ids"] == list(IDS) and manifest["token_counts"] == list(LENS)
  assert manifest["layers"] == list(LAYERS) and manifest["routing_layers"] == list(LAYERS)
  assert manifest["sites"] == list(gs.SITES) and manifest["mode"] == "compact"
  bs = manifest["arrays"]["layer_003/expert_mid/block_scale"]
  assert {k: v for k, v in bs.items() if k != "seq_crc32"} == {
      "dtype": "float8_e4m3fn", "stored_dtype": "uint8", "shape": [T, TOP_K, 2]}
  assert manifest["created_unix"] > 0 and manifest["storage"]["shard_tokens"] == 128
  assert manifest["checksum"]["algorithm"] == "crc32" and gs.SCHEMA_VERSION == 2


def test_manifest_checksums_are_crc32_of_each_sequences_rows(stored):
  """seq_crc32 of every array: zlib CRC-32 of each sequence's rows (C-order bytes of the
  stored dtype), 8 hex digits per sequence, recomputed here from the written records."""
  with open(stored[0] / "compact" / gs.MANIFEST) as f:
    manifest = json.load(f)
  guidance, routing = records("compact")
  arrays = {gs.array_path(layer, site, field): getattr(g, field)
            for layer, sites in guidance.items() for site, g in sites.items()
            for field in gs.MODE_FIELDS["compact"]}
  arrays |= {gs.array_path(layer, gs.ROUTING, "ids"): ids for layer, ids in routing.items()}
  assert set(arrays) == set(manifest["arrays"]) - {"seq_offsets"}
  for path, a in arrays.items():
    raw = np.ascontiguousarray(np.asarray(a)).view(np.uint8).reshape(T, -1)
    want = "".join(f"{zlib.crc32(raw[OFFSETS[i]:OFFSETS[i + 1]].tobytes()):08x}"
                   for i in range(len(IDS)))
    assert manifest["arrays"][path]["seq_crc32"] == want, path


def test_spec_uses_sharding_indexed_and_zstd(stored):
  path = stored[0] / "compact" / "layer_002" / "k" / "block_scale"
  t = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path) + "/"}},
              open=True).result()
  md = t.spec().to_json()["metadata"]
  assert md["data_type"] == "uint8" and md["shape"] == [T, KV_HEADS, 1]
  assert md["chunk_grid"]["configuration"]["chunk_shape"] == [128, KV_HEADS, 1]
  (codec,) = md["codecs"]
  assert codec["name"] == "sharding_indexed"
  cfg = codec["configuration"]
  assert cfg["chunk_shape"] == [32, KV_HEADS, 1]
  assert [c["name"] for c in cfg["codecs"]] == ["bytes", "zstd"]
  assert [c["name"] for c in cfg["index_codecs"]] == ["bytes", "crc32c"]
  shards = sorted(f for f in os.listdir(path) if f != "zarr.json")
  assert shards == ["c.0.0.0", "c.1.0.0", "c.2.0.0"]  # 323 rows / 128 per shard


def test_crash_before_manifest_is_never_read(tmp_path, monkeypatch):
  def crash(path, obj, fsync=True):
    raise OSError("simulated crash before the manifest")
  monkeypatch.setattr(gs, "_write_json_atomic", crash)
  guidance, routing = records("compact")
  w = gs.GuidanceWriter(tmp_path, HASH, OPTS)
  w.write_batch("b0", IDS, LENS, guidance, routing)
  with pytest.raises(gs.GuidanceError, match="simulated crash"):
    w.flush()
  w.close()
  assert (tmp_path / "b0" / "layer_002" / "moe_in" / "mantissa" / "zarr.json").exists()
  assert not (tmp_path / "b0" / gs.MANIFEST).exists()
  reader = gs.GuidanceReader(tmp_path, HASH)
  assert reader.complete_batches() == []
  with pytest.raises(gs.GuidanceError, match="no manifest.json"):
    reader.read("b0")
  # A manifest temp file left by a crash mid-rename does not count either.
  (tmp_path / "b0" / "manifest.json.tmp-1-2").write_text("{}")
  with pytest.raises(gs.GuidanceError, match="no manifest.json"):
    reader.read("b0")


def test_async_write_completes_after_flush(tmp_path, monkeypatch):
  gate = threading.Event()
  real = gs._write_json_atomic

  def gated(path, obj, fsync=True):
    assert gate.wait(10)
    real(path, obj, fsync)
  monkeypatch.setattr(gs, "_write_json_atomic", gated)
  guidance, routing = records("full")
  w = gs.GuidanceWriter(tmp_path, HASH, OPTS)
  handles = [w.write_batch(f"b{i}", IDS, LENS, guidance, routing) for i in range(2)]
  assert not any(h.done() for h in handles)  # write_batch returned with the work in flight
  assert handles[0].stats["num_tokens"] == T  # stats come back at once
  reader = gs.GuidanceReader(tmp_path, HASH)
  with pytest.raises(gs.GuidanceError, match="incomplete batch"):
    reader.read("b0")
  gate.set()
  manifests = w.flush()
  assert [m["batch_id"] for m in manifests] == ["b0", "b1"]
  with open(tmp_path / "b1" / gs.MANIFEST) as f:
    assert json.load(f) == json.loads(json.dumps(manifests[1]))
  assert all(h.done() for h in handles) and reader.complete_batches() == ["b0", "b1"]
  assert_batch_matches(reader.read("b1"), "full", range(len(IDS)))
  w.close()


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
    for field in gs.MODE_FIELDS["compact"]:
      np.testing.assert_array_equal(bits(getattr(pre.guidance[3][site], field)),
                                    bits(getattr(now.guidance[3][site], field)))
  np.testing.assert_array_equal(pre.seq_offsets, now.seq_offsets)
  reader.close()


def test_writer_rejects_bad_input(tmp_path):
  guidance, routing = records("compact")
  with gs.GuidanceWriter(tmp_path, HASH, OPTS) as w:
    with pytest.raises(ValueError, match="tokens"):
      w.write_batch("bad", IDS, (5, 300, 17, 0, 2), guidance, routing)
    with pytest.raises(ValueError, match="duplicate"):
      w.write_batch("bad", (1, 1, 2, 3, 4), LENS, guidance, routing)
    with pytest.raises(ValueError, match="mixed guidance modes"):
      w.write_batch("bad", IDS, LENS, {2: guidance[2], 3: records("full")[0][3]}, routing)
    w.write_batch("b0", IDS, LENS, guidance, routing)
  with gs.GuidanceWriter(tmp_path, HASH, OPTS) as w, pytest.raises(FileExistsError):
    w.write_batch("b0", IDS, LENS, guidance, routing)


def _recreate(path, rows=None, trailing=None):
  """Rewrites an array in place with another row count or trailing shape (a bad writer)."""
  old = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path) + "/"}},
                open=True).result()
  data = old.read().result()
  data = data[:rows] if rows is not None else data
  if trailing is not None:
    data = np.zeros((data.shape[0],) + trailing, data.dtype)
  md = gs._zarr_metadata(data.shape, data.dtype.name, 128, 32, OPTS)
  t = ts.open(gs._spec(str(path), md), create=True, delete_existing=True).result()
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
  manifest = json.loads((d.parent / "donor" / gs.MANIFEST).read_text())
  manifest["batch_id"] = "b0"
  (d / gs.MANIFEST).write_text(json.dumps(manifest))


ALL = list(range(len(IDS)))
# name -> (damage(batch_dir), reader kwargs, requested ids, flagged positions, error regex)
CASES = {
    "missing_manifest": (lambda d: os.remove(d / gs.MANIFEST), {}, IDS, ALL,
                         r"'b0'.*incomplete batch: no manifest"),
    "garbled_manifest": (lambda d: (d / gs.MANIFEST).write_text("{not json"), {}, IDS, ALL,
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
  with caplog.at_level(logging.WARNING, logger=gs.__name__):
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


def test_ragged_rows_and_config_hash():
  padded = np.arange(3 * 4 * 2).reshape(3, 4, 2)
  got = gs.ragged_rows(padded, [2, 0, 3], starts=[1, 0, 0])
  np.testing.assert_array_equal(got, np.concatenate([padded[0, 1:3], padded[2, :3]]))
  assert gs.config_hash({"a": 1, "b": (2, 3)}) == gs.config_hash({"b": [2, 3], "a": 1})
  assert gs.config_hash({"a": 1}) != gs.config_hash({"a": 2})


# ----------------------------------------------------------------------------- hardening


@pytest.mark.parametrize("select", [(7,), (99, 7, 11), IDS, (11, 42, 3, 99)],
                         ids=["one", "subset", "all", "unaffected"])
def test_chunk_from_other_batch_detected_in_subsets(tmp_path, select):
  """A valid shard copied in from another batch of the same shape (TensorStore reads it without
  complaint) is caught by the per-sequence checksums whatever subset of sequences is read; only
  the sequence whose rows changed (7: the copied shard holds rows 128..255) is flagged."""
  write(tmp_path)
  _chunk_from_other_batch(tmp_path / "b0")
  raw = ts.open(gs._spec(str(tmp_path / "b0" / "layer_002" / "v" / "mantissa")),
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
  path = tmp_path / "b0" / gs.MANIFEST
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
  path = tmp_path / "b0" / gs.MANIFEST
  manifest = json.loads(path.read_text())
  manifest["schema_version"] = 1
  path.write_text(json.dumps(manifest))
  reader = gs.GuidanceReader(tmp_path, HASH, on_missing="fallback")
  assert not reader.read("b0", IDS).valid.any()
  assert reader.stats.reasons["schema_version"] == 1


BAD_IDS = ["../outside/b9", "..", "a/b", "b0/../b1", "b0..", "b0\n", "", ".hidden", "-x",
           "b" * 129, "a\\b"]


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


def test_batch_ids_on_write(tmp_path):
  """The writer rejects ids that are not one path component; "b000012" and "b000012.audit"
  (the audit batches' suffix) are written and read back."""
  guidance, routing = records("compact")
  with gs.GuidanceWriter(tmp_path / "root", HASH, OPTS) as w:
    for bid in BAD_IDS:
      with pytest.raises(ValueError, match="batch id"):
        w.write_batch(bid, IDS, LENS, guidance, routing)
    for bid in ("b000012", "b000012.audit", "step-3_a.b"):
      w.write_batch(bid, IDS, LENS, guidance, routing)
  assert not (tmp_path / "outside").exists()
  reader = gs.GuidanceReader(tmp_path / "root", HASH)
  assert reader.complete_batches() == ["b000012", "b000012.audit", "step-3_a.b"]
  for bid in reader.complete_batches():
    assert_batch_matches(reader.read(bid), "compact", range(len(IDS)))


def test_writer_rejects_non_integer_counts_and_bad_layers(tmp_path):
  """token counts must be integers (no floats, even integral ones, no bools, no strings);
  layers (guidance and routing keys) non-negative integers."""
  guidance, routing = records("compact")
  with gs.GuidanceWriter(tmp_path, HASH, OPTS) as w:
    for counts in ((5.7, 300, 17, 0, 1), (5.0, 300, 17, 0, 1), (5, 300, 17, False, True),
                   ("5", 300, 17, 0, 1), np.array(LENS, np.float64)):
      with pytest.raises(ValueError, match="token counts must be integers"):
        w.write_batch("bad", IDS, counts, guidance, routing)
    for layer in (-1, 2.0, True, "2"):
      with pytest.raises(ValueError, match="guidance layers must be non-negative integers"):
        w.write_batch("bad", IDS, LENS, {layer: guidance[2]}, {})
      with pytest.raises(ValueError, match="routing layers must be non-negative integers"):
        w.write_batch("bad", IDS, LENS, guidance, {layer: routing[2]})
    w.write_batch("ok", IDS, np.array(LENS, np.int64), {np.int64(2): guidance[2]},
                  {np.int32(3): routing[3]})
  assert not (tmp_path / "bad").exists()
  batch = gs.GuidanceReader(tmp_path, HASH).read("ok")
  assert set(batch.guidance) == {2} and set(batch.routing) == {3}


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


@pytest.mark.parametrize("mode", ["compact", "full"])
def test_mxfp4_record_round_trip(tmp_path, mode):
  """MXFP4 records (E8M0 scales per 32, no row scale) survive the store bit for bit, say their
  format in the manifest, and guide rounding as the original record does."""
  key = jax.random.key(3)
  x = (jax.random.normal(key, (T, HIDDEN)) * 3).astype(jnp.bfloat16)
  kv = (jax.random.normal(key, (T, KV_HEADS, 32)) * 0.1).astype(jnp.bfloat16)
  rec = {site: jax.jit(qat.quantize_act_record, static_argnums=(1, 2))(a, mode, "mxfp4")[1]
         for site, a in (("moe_in", x), ("k", kv))}
  with gs.GuidanceWriter(tmp_path, HASH, OPTS) as w:
    stats = w.write_batch("mx", IDS, LENS, {4: rec}).stats
  manifest = json.loads((tmp_path / "mx" / gs.MANIFEST).read_text())
  assert manifest["fp4_format"] == "mxfp4" and stats["fp4_format"] == "mxfp4"
  assert "layer_004/moe_in/row_scale" not in manifest["arrays"]
  assert stats["guidance_bytes"] == sum(int(np.prod(g.block_scale.shape[:-1])) *
                                        bytes_per_row(g.k, mode, "mxfp4") for g in rec.values())
  back = gs.GuidanceReader(tmp_path, HASH).read("mx").guidance[4]
  drifted = (x.astype(jnp.float32) * 1.001).astype(jnp.bfloat16)
  for site, g in rec.items():
    assert back[site].format == "mxfp4" and back[site].row_scale is None
    for field in gs.mode_fields(mode, "mxfp4"):
      np.testing.assert_array_equal(bits(getattr(back[site], field)), bits(getattr(g, field)))
  np.testing.assert_array_equal(
      np.asarray(guided.guided_codes(drifted, jax.tree.map(jnp.asarray, back["moe_in"]))),
      np.asarray(guided.guided_codes(drifted, rec["moe_in"])))


def test_mixed_formats_and_nvfp4_manifests_without_a_format(tmp_path):
  x = jax.random.normal(jax.random.key(4), (T, HIDDEN)).astype(jnp.bfloat16)
  record = jax.jit(qat.quantize_act_record, static_argnums=(1, 2))  # the programs other tests run
  nv, mx = (record(x, "compact", fmt)[1] for fmt in ("nvfp4", "mxfp4"))
  with gs.GuidanceWriter(tmp_path, HASH, OPTS) as w:
    with pytest.raises(ValueError, match=r"mixed FP4 formats \['mxfp4', 'nvfp4'\]"):
      w.write_batch("mix", IDS, LENS, {0: {"moe_in": nv}, 1: {"moe_in": mx}})
    w.write_batch("nv", IDS, LENS, {0: {"moe_in": nv}})
  path = tmp_path / "nv" / gs.MANIFEST
  manifest = json.loads(path.read_text())
  assert manifest.pop("fp4_format") == "nvfp4"
  path.write_text(json.dumps(manifest))  # as written before MXFP4 records existed
  back = gs.GuidanceReader(tmp_path, HASH).read("nv").guidance[0]["moe_in"]
  np.testing.assert_array_equal(bits(back.row_scale), bits(nv.row_scale))


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
