"""Guidance handles travel as JSON and come back equal; bad ones are refused."""

import json

import pytest

from trace_jax.guidance.handle import GuidanceHandle


@pytest.mark.parametrize("handle", [
    GuidanceHandle(batch_id="b000003", seq_id="b000003-1"),
    GuidanceHandle(batch_id="b000003", seq_id=7, store="/runs/g",
                   audit_batch_id="b000003.audit", guidance_bytes_per_token=108.5),
], ids=["in_memory", "stored_and_audited"])
def test_handle_json_round_trip(handle):
  assert GuidanceHandle.from_json(json.loads(json.dumps(handle.to_json()))) == handle


@pytest.mark.parametrize("bad", [None, [], {"seq_id": "x"}, {"batch_id": 3, "seq_id": "x"},
                                 {"batch_id": "b0", "seq_id": None}],
                         ids=["none", "list", "no_batch_id", "int_batch_id", "no_seq_id"])
def test_bad_handles_are_refused(bad):
  with pytest.raises(ValueError, match="needs batch_id"):
    GuidanceHandle.from_json(bad)


def test_unknown_keys_are_ignored():
  """A newer server may add fields: an older client keeps what it knows."""
  h = GuidanceHandle.from_json({"batch_id": "b1", "seq_id": "s", "shard": 3})
  assert h == GuidanceHandle(batch_id="b1", seq_id="s")
