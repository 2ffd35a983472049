"""Shared records and helpers of the guidance store's tests (writer, reader, store)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from trace_jax.guidance import record
from trace_jax.guidance import store as gs
from trace_jax.guidance.record import Guidance

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
                for f in record.MODE_FIELDS[mode] if f in per_col}
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
      for field in record.MODE_FIELDS[mode]:
        want = expected_rows(getattr(g, field), positions)
        have = getattr(got, field)
        assert have.dtype == want.dtype, (layer, site, field)
        assert have.shape == want.shape, (layer, site, field)
        np.testing.assert_array_equal(bits(have), bits(want), err_msg=f"{layer}/{site}/{field}")
    np.testing.assert_array_equal(batch.routing[layer], expected_rows(routing[layer], positions))


BAD_IDS = ["../outside/b9", "..", "a/b", "b0/../b1", "b0..", "b0\n", "", ".hidden", "-x",
           "b" * 129, "a\\b"]
