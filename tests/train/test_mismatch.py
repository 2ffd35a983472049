"""Flip and routing counts (trace_jax/train/mismatch.py) against brute-force references."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax.guidance.record import Guidance
from trace_jax.quant import formats
from trace_jax.train import mismatch

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def value(code: int) -> float:
  """E2M1 value of a 4-bit code, by the table (independent of the module)."""
  return (-1.0 if code & 8 else 1.0) * E2M1[code & 7]


def record(codes: np.ndarray, scales: np.ndarray | None = None) -> Guidance:
  """A full-mode record of codes [..., K] (block scales 1.0 unless given)."""
  lead = codes.shape[:-1]
  bs = np.full(lead + (codes.shape[-1] // 16,), 1.0, np.float32) if scales is None else scales
  return Guidance(block_scale=np.asarray(bs).astype(jnp.float8_e4m3fn),
                  row_scale=np.ones(lead + (1,), np.float32),
                  codes=np.asarray(formats.pack_fp4(jnp.asarray(codes))))


def brute_flips(a: np.ndarray, b: np.ndarray) -> tuple[int, int]:
  """(value flips, flips one grid step apart) element by element."""
  grid = sorted({value(c) for c in range(16)})
  flips = near = 0
  for x, y in zip(a.reshape(-1), b.reshape(-1)):
    vx, vy = value(int(x)), value(int(y))
    if vx != vy:
      flips += 1
      near += abs(grid.index(vx) - grid.index(vy)) == 1
  return flips, near


def test_ordinal_orders_the_grid_and_merges_signed_zeros():
  codes = np.arange(16, dtype=np.uint8)
  ords = mismatch.e2m1_ordinal(codes)
  assert ords[0] == ords[8] == 0
  by_value = sorted(range(16), key=value)
  assert [value(c) for c in by_value] == sorted(value(c) for c in range(16))
  assert list(np.diff([ords[c] for c in by_value if c != 8])) == [1] * 14


@pytest.mark.parametrize("case", ["identical", "unrelated", "signed_zero", "one_apart", "mixed"])
def test_code_flips_match_brute_force(case):
  rng = np.random.default_rng(0)
  a = rng.integers(0, 16, (6, 32), np.uint8)
  b = {
      "identical": a.copy(),
      "unrelated": rng.integers(0, 16, a.shape, np.uint8),
      "signed_zero": np.where(a & 7, a, a ^ 8).astype(np.uint8),  # +0 <-> -0 only
      "one_apart": np.where(a == 3, 4, a).astype(np.uint8),  # 1.5 -> 2.0
      "mixed": np.where(rng.random(a.shape) < 0.2, rng.integers(0, 16, a.shape), a
                        ).astype(np.uint8),
  }[case]
  got = mismatch.code_flips(record(a), record(b))
  flips, near = brute_flips(a, b)
  assert (got.flips, got.one_apart, got.total) == (flips, near, a.size)
  assert got.scale_flips == 0
  if case == "unrelated":  # a metric fed unrelated codes must see most of them differ
    assert got.rate > 0.8
  if case in ("identical", "signed_zero"):
    assert got.flips == 0


def test_block_scale_flips():
  a = np.zeros((4, 32), np.uint8)
  s1 = np.full((4, 2), 1.0, np.float32)
  s2 = s1.copy()
  s2[1, 0] = 2.0
  got = mismatch.code_flips(record(a, s1), record(a, s2))
  assert (got.scale_flips, got.scale_total, got.flips) == (1, 8, 0)


def test_routing_counts_set_flips_order_swaps_unmatched():
  rollout = np.array([[1, 2], [3, 4], [5, 6], [0, 7]], np.int32)
  train = np.array([[1, 2],    # same
                    [4, 3],    # order swap
                    [5, 1],    # set flip, one slot unmatched
                    [2, 3]],   # set flip, two slots unmatched
                   np.int32)
  c = mismatch.routing_counts(train, rollout)
  assert (c.tokens, c.set_flips, c.order_swaps, c.slots, c.unmatched_slots) == (4, 2, 1, 8, 3)
  src, matched = mismatch.match_slots(train, rollout)
  assert src[1].tolist() == [1, 0] and matched[2].tolist() == [True, False]


def test_expert_mid_rows_are_compared_by_expert_not_slot():
  """The rollout recorded slots in another order: aligned by expert there are no flips; a
  slot whose expert the rollout did not select is left out of the count."""
  rng = np.random.default_rng(1)
  t, k, i = 5, 2, 32
  rollout_ids = np.stack([rng.permutation(8)[:k] for _ in range(t)]).astype(np.int32)
  codes = rng.integers(0, 16, (t, k, i), np.uint8)
  train_ids = rollout_ids[:, ::-1].copy()
  train_codes = codes[:, ::-1].copy()
  by_slot = mismatch.code_flips(record(train_codes), record(codes))
  assert by_slot.rate > 0.5  # the slot-order comparison sees "flips" that are not there
  src, matched = mismatch.match_slots(train_ids, rollout_ids)
  assert mismatch.code_flips(record(train_codes), record(codes), src, matched).flips == 0
  train_ids[0, 0] = 99  # not selected in rollout: nothing to compare for that slot
  src, matched = mismatch.match_slots(train_ids, rollout_ids)
  got = mismatch.code_flips(record(train_codes), record(codes), src, matched)
  assert (got.flips, got.total) == (0, (t * k - 1) * i)


def test_compare_report_sums_guided_and_unguided_layers():
  rng = np.random.default_rng(2)
  rows, k = 6, 2
  ids = {layer: np.stack([rng.permutation(8)[:k] for _ in range(rows)]).astype(np.int32)
         for layer in (0, 1)}

  def recs(flip_layer):
    out = {}
    for layer in (0, 1):
      c = {"moe_in": np.zeros((rows, 32), np.uint8),
           "expert_mid": np.zeros((rows, k, 32), np.uint8)}
      if layer == flip_layer:
        c["moe_in"][0, :4] = 2
      out[layer] = {s: record(v) for s, v in c.items()}
    return out

  report = mismatch.compare(recs(1), recs(None), ids, ids, guided_layers=(1,))
  m = report.metrics()
  assert m["flip_rate_guided"] == 4 / (rows * 32 + rows * k * 32)
  assert m["flip_rate_unguided"] == 0.0
  assert m["routing_flip_rate"] == 0.0 and m["expert_unmatched_rate"] == 0.0
  assert {(r["layer"], r["site"]) for r in report.rows()} >= {(0, "routing"), (1, "moe_in")}
