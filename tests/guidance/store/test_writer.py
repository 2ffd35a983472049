"""Guidance store writer: manifest contents and checksums, chunking, byte stats, manifest last,
async writes, bad input refused, MXFP4 records."""

from __future__ import annotations

import json
import os
import threading
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts
from store_cases import (
    BAD_IDS,
    HASH,
    HEAD_DIM,
    HIDDEN,
    IDS,
    INTER,
    KV_HEADS,
    LAYERS,
    LENS,
    OFFSETS,
    OPTS,
    TOP_K,
    T,
    assert_batch_matches,
    bits,
    records,
)

from trace_jax.guidance import record, schema
from trace_jax.guidance import store as gs
from trace_jax.guidance.record import bytes_per_row
from trace_jax.guidance.store import writer as writer_lib
from trace_jax.quant import guided, qat


def test_real_rollout_record_round_trip(tmp_path):
  """quantize_act_record's compact record survives the store and guides rounding identically."""
  x = (jax.random.normal(jax.random.key(0), (T, HIDDEN)) * 3).astype(jnp.bfloat16)
  rec = jax.jit(qat.quantize_act_record, static_argnums=1)(x, "compact")[1]
  with gs.GuidanceWriter(tmp_path, HASH, gs.StoreOptions(128, 32)) as w:  # fsync on
    w.write_batch("real", IDS, LENS, {5: {"moe_in": rec}})
  back = gs.GuidanceReader(tmp_path, HASH).read("real").guidance[5]["moe_in"]
  for field in record.MODE_FIELDS["compact"]:
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
  with open(stored[0] / mode / schema.MANIFEST) as f:
    manifest = json.load(f)
  assert {k: manifest["bytes"][k] for k in stats if k in manifest["bytes"]} == {
      k: v for k, v in stats.items() if k not in writer_lib.NOT_BYTES}
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
  with open(stored[0] / "compact" / schema.MANIFEST) as f:
    want = json.load(f)
  with open(tmp_path / "padded" / schema.MANIFEST) as f:
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
  with open(stored[0] / "compact" / schema.MANIFEST) as f:
    manifest = json.load(f)
  assert manifest["schema_version"] == schema.SCHEMA_VERSION and manifest["config_hash"] == HASH
  assert manifest["seq_ids"] == list(IDS) and manifest["token_counts"] == list(LENS)
  assert manifest["layers"] == list(LAYERS) and manifest["routing_layers"] == list(LAYERS)
  assert manifest["sites"] == list(record.SITES) and manifest["mode"] == "compact"
  bs = manifest["arrays"]["layer_003/expert_mid/block_scale"]
  assert {k: v for k, v in bs.items() if k != "seq_crc32"} == {
      "dtype": "float8_e4m3fn", "stored_dtype": "uint8", "shape": [T, TOP_K, 2]}
  assert manifest["created_unix"] > 0 and manifest["storage"]["shard_tokens"] == 128
  assert manifest["checksum"]["algorithm"] == "crc32" and schema.SCHEMA_VERSION == 2


def test_manifest_checksums_are_crc32_of_each_sequences_rows(stored):
  """seq_crc32 of every array: zlib CRC-32 of each sequence's rows (C-order bytes of the
  stored dtype), 8 hex digits per sequence, recomputed here from the written records."""
  with open(stored[0] / "compact" / schema.MANIFEST) as f:
    manifest = json.load(f)
  guidance, routing = records("compact")
  arrays = {schema.array_path(layer, site, field): getattr(g, field)
            for layer, sites in guidance.items() for site, g in sites.items()
            for field in record.MODE_FIELDS["compact"]}
  arrays |= {schema.array_path(layer, record.ROUTING, "ids"): ids for layer, ids in routing.items()}
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
  monkeypatch.setattr(writer_lib, "write_json_atomic", crash)
  guidance, routing = records("compact")
  w = gs.GuidanceWriter(tmp_path, HASH, OPTS)
  w.write_batch("b0", IDS, LENS, guidance, routing)
  with pytest.raises(gs.GuidanceError, match="simulated crash"):
    w.flush()
  w.close()
  assert (tmp_path / "b0" / "layer_002" / "moe_in" / "mantissa" / "zarr.json").exists()
  assert not (tmp_path / "b0" / schema.MANIFEST).exists()
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
  real = writer_lib.write_json_atomic

  def gated(path, obj, fsync=True):
    assert gate.wait(10)
    real(path, obj, fsync)
  monkeypatch.setattr(writer_lib, "write_json_atomic", gated)
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
  with open(tmp_path / "b1" / schema.MANIFEST) as f:
    assert json.load(f) == json.loads(json.dumps(manifests[1]))
  assert all(h.done() for h in handles) and reader.complete_batches() == ["b0", "b1"]
  assert_batch_matches(reader.read("b1"), "full", range(len(IDS)))
  w.close()


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
  manifest = json.loads((tmp_path / "mx" / schema.MANIFEST).read_text())
  assert manifest["fp4_format"] == "mxfp4" and stats["fp4_format"] == "mxfp4"
  assert "layer_004/moe_in/row_scale" not in manifest["arrays"]
  assert stats["guidance_bytes"] == sum(int(np.prod(g.block_scale.shape[:-1])) *
                                        bytes_per_row(g.k, mode, "mxfp4") for g in rec.values())
  back = gs.GuidanceReader(tmp_path, HASH).read("mx").guidance[4]
  drifted = (x.astype(jnp.float32) * 1.001).astype(jnp.bfloat16)
  for site, g in rec.items():
    assert back[site].format == "mxfp4" and back[site].row_scale is None
    for field in record.mode_fields(mode, "mxfp4"):
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
  path = tmp_path / "nv" / schema.MANIFEST
  manifest = json.loads(path.read_text())
  assert manifest.pop("fp4_format") == "nvfp4"
  path.write_text(json.dumps(manifest))  # as written before MXFP4 records existed
  back = gs.GuidanceReader(tmp_path, HASH).read("nv").guidance[0]["moe_in"]
  np.testing.assert_array_equal(bits(back.row_scale), bits(nv.row_scale))
