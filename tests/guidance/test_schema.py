"""The store schema's pure parts: config hash, batch ids, per-sequence checksums."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from trace_jax.guidance import schema


def test_config_hash():
  assert schema.config_hash({"a": 1, "b": (2, 3)}) == schema.config_hash({"b": [2, 3], "a": 1})
  assert schema.config_hash({"a": 1}) != schema.config_hash({"a": 2})


@pytest.mark.parametrize("batch_id,ok", [
    ("b000012", True), ("b000012.audit", True), ("step-3_a.b", True), ("b" * 128, True),
    ("b" * 129, False), ("..", False), ("b0..", False), ("a/b", False), (".hidden", False),
    ("", False), (7, False),
], ids=["rollout", "audit", "punctuation", "longest", "too_long", "dotdot", "trailing_dotdot",
        "separator", "hidden", "empty", "not_str"])
def test_batch_id_problem(batch_id, ok):
  assert (schema.batch_id_problem(batch_id) is None) == ok


@pytest.mark.parametrize("dtype", ["uint8", "<i4", ">i4", "float32"],
                         ids=["bytes", "int32_le", "int32_be", "float32"])
def test_seq_checksums_are_crc32_of_little_endian_rows(dtype):
  """Each sequence's CRC-32 is zlib's over its rows' little-endian C-order bytes, whatever the
  array's byte order, starting at row `start`."""
  rng = np.random.default_rng(0)
  a = rng.integers(0, 100, (9, 2, 3)).astype(dtype)
  offsets = [4, 6, 6, 13]  # rows 4..12 of the batch: sequences of 2, 0 and 7 rows
  le = np.ascontiguousarray(a.astype(np.dtype(dtype).newbyteorder("<")))
  want = [zlib.crc32(le[lo - 4:hi - 4].tobytes()) for lo, hi in zip(offsets, offsets[1:])]
  assert schema.seq_checksums(a, offsets, start=4) == want
  assert schema.crc_hex(want) == "".join(f"{c:08x}" for c in want)
