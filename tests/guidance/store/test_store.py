"""GuidanceStore: batch ids, a rollout's writes and handles, reads by handle, deletion, close."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from store_cases import HASH, HIDDEN, OPTS, TOP_K

from trace_jax.guidance import store as gs
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

