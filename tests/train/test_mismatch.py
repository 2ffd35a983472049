"""Flip and routing counts (trace_jax/train/mismatch.py) against brute-force references, and
compare_step on a training step's padded taps against a row-by-row count."""

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


def test_code_flips_of_every_pair_of_codes():
  """All 16 x 16 code pairs, in both nibbles of a packed byte (the module counts packed byte
  pairs by table): the brute-force value comparison's counts."""
  a, b = (g.reshape(-1) for g in np.meshgrid(np.arange(16), np.arange(16), indexing="ij"))
  a, b = np.stack([a, b[::-1]]).astype(np.uint8), np.stack([b, a[::-1]]).astype(np.uint8)
  got = mismatch.code_flips(record(a), record(b))
  assert (got.flips, got.one_apart, got.total) == (*brute_flips(a, b), a.size)


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


# ------------------------------------------------------------ compare_step on a training step

COUNTS = [4, 3, 5]  # token rows of each sequence (ragged), padded to SEQ_LEN in the taps
SEQ_LEN, TOP_K, WIDTH, NUM_EXPERTS = 6, 2, 32, 6
# What the trainer's routing of each row is, against the rollout's: the same slots, the same
# experts in the other slot order, one expert replaced (a routing flip), both replaced.
ROW_KINDS = ["same", "swap", "one_new", "swap", "same", "both_new", "swap", "one_new",
             "swap", "same", "one_new", "swap"]


def _padded(rows: np.ndarray, counts: list[int], fill: np.ndarray) -> np.ndarray:
  """Ragged rows [T, ...] -> [len(counts), SEQ_LEN, ...]; padding rows taken from `fill`."""
  out = fill.copy()
  start = 0
  for i, c in enumerate(counts):
    out[i, :c] = rows[start:start + c]
    start += c
  return out


def _step_records(rng, n_audit: int):
  """One layer's rollout records and the trainer's taps for a step.

  Returns (taps: the trainer's padded {site: record, "routing": ids [B, S, K]}, rollout
  records {site: record} of the audited rows, rollout routing [T, K], and the unpacked arrays
  the expected counts are computed from).
  """
  rows = sum(COUNTS)
  audited = sum(COUNTS[:n_audit])
  r_ids = np.stack([rng.permutation(NUM_EXPERTS)[:TOP_K] for _ in range(rows)]).astype(np.int32)
  t_ids = r_ids.copy()
  for j, kind in enumerate(ROW_KINDS):
    unused = [e for e in range(NUM_EXPERTS) if e not in r_ids[j]]
    if kind == "swap":
      t_ids[j] = r_ids[j, ::-1]
    elif kind == "one_new":
      t_ids[j, 1] = unused[0]
    elif kind == "both_new":
      t_ids[j] = unused[:TOP_K]
  # Rollout codes of the audited rows; the trainer's: the same codes of the same expert (in
  # its own slot order), random for an expert the rollout did not select, then some flips.
  r_in = rng.integers(0, 16, (audited, WIDTH), np.uint8)
  r_mid = rng.integers(0, 16, (audited, TOP_K, WIDTH), np.uint8)
  t_in = r_in.copy()
  t_mid = rng.integers(0, 16, (audited, TOP_K, WIDTH), np.uint8)
  for j in range(audited):
    for s in range(TOP_K):
      if t_ids[j, s] in r_ids[j]:
        t_mid[j, s] = r_mid[j, list(r_ids[j]).index(t_ids[j, s])]
  flip = rng.random(t_in.shape) < 0.1
  t_in[flip] = rng.integers(0, 16, int(flip.sum()))
  t_in[:, 0] = r_in[:, 0] ^ 8  # sign flips: -0 vs +0 is no flip, any other value is
  mid_flip = rng.random(t_mid.shape) < 0.1
  t_mid[mid_flip] = rng.integers(0, 16, int(mid_flip.sum()))
  r_in_scale = rng.choice([0.5, 1.0, 2.0], (audited, WIDTH // 16)).astype(np.float32)
  t_in_scale = r_in_scale.copy()
  if audited:
    t_in_scale[-1, 1] *= 2  # one block-scale flip
  r_mid_scale = np.ones((audited, TOP_K, WIDTH // 16), np.float32)
  t_mid_scale = r_mid_scale.copy()
  # A per-head site (k): rows [T, heads, WIDTH], some flips and one block-scale flip.
  r_k = rng.integers(0, 16, (audited, 2, WIDTH), np.uint8)
  t_k = r_k.copy()
  k_flip = rng.random(t_k.shape) < 0.05
  t_k[k_flip] = rng.integers(0, 16, int(k_flip.sum()))
  r_k_scale = np.ones((audited, 2, WIDTH // 16), np.float32)
  t_k_scale = r_k_scale.copy()
  if audited:
    t_k_scale[0, 1, 0] = 2.0

  b = len(COUNTS)
  garbage_ids = rng.integers(0, NUM_EXPERTS, (b, SEQ_LEN, TOP_K)).astype(np.int32)
  taps = {"routing": _padded(t_ids, COUNTS, garbage_ids)}
  audit_counts = COUNTS[:n_audit]
  for site, codes, scales in (("moe_in", t_in, t_in_scale), ("expert_mid", t_mid, t_mid_scale),
                              ("k", t_k, t_k_scale)):
    fill = rng.integers(0, 16, (n_audit, SEQ_LEN) + codes.shape[1:], np.uint8)
    taps[site] = record(_padded(codes, audit_counts, fill),
                        _padded(scales, audit_counts,
                                np.full((n_audit, SEQ_LEN) + scales.shape[1:], 4.0, np.float32)))
  rollout = {"moe_in": record(r_in, r_in_scale), "expert_mid": record(r_mid, r_mid_scale),
             "k": record(r_k, r_k_scale)}
  arrays = dict(r_ids=r_ids, t_ids=t_ids, r_in=r_in, t_in=t_in, r_mid=r_mid, t_mid=t_mid,
                r_in_scale=r_in_scale, t_in_scale=t_in_scale, r_mid_scale=r_mid_scale,
                t_mid_scale=t_mid_scale, r_k=r_k, t_k=t_k, r_k_scale=r_k_scale,
                t_k_scale=t_k_scale)
  return taps, rollout, r_ids, arrays


def _expected_counts(a: dict, audited: int) -> tuple[dict, mismatch.RoutingCount]:
  """FlipCounts per site and the RoutingCount, row by row in plain python."""
  tokens = set_flips = order_swaps = slots = unmatched = 0
  for t, r in zip(a["t_ids"].tolist(), a["r_ids"].tolist()):
    tokens += 1
    same_set = set(t) == set(r)
    set_flips += not same_set
    order_swaps += same_set and t != r
    slots += len(t)
    unmatched += sum(e not in r for e in t)
  routing = mismatch.RoutingCount(tokens, set_flips, order_swaps, slots, unmatched)

  def count(pairs):
    """pairs: (trainer codes, rollout codes, trainer scales, rollout scales) to compare."""
    c = mismatch.FlipCount()
    for tc, rc, ts, rs in pairs:
      flips, near = brute_flips(tc, rc)
      c = c + mismatch.FlipCount(flips, tc.size, near, int(np.sum(ts != rs)), ts.size)
    return c

  moe_in = count((a["t_in"][j], a["r_in"][j], a["t_in_scale"][j], a["r_in_scale"][j])
                 for j in range(audited))
  mid_pairs = []
  for j in range(audited):
    r_ids = a["r_ids"][j].tolist()
    for s, e in enumerate(a["t_ids"][j].tolist()):
      if e in r_ids:  # compared with the rollout slot that holds the same expert
        rs = r_ids.index(e)
        mid_pairs.append((a["t_mid"][j, s], a["r_mid"][j, rs], a["t_mid_scale"][j, s],
                          a["r_mid_scale"][j, rs]))
  k = count((a["t_k"][j], a["r_k"][j], a["t_k_scale"][j], a["r_k_scale"][j])
            for j in range(audited))
  return {"moe_in": moe_in, "expert_mid": count(mid_pairs), "k": k}, routing


@pytest.mark.parametrize("compare", [mismatch.compare_step, mismatch.compare_step_device],
                         ids=["host", "device"])
@pytest.mark.parametrize("n_audit", [pytest.param(0, id="no_audit"),
                                     pytest.param(2, id="two_of_three_audited"),
                                     pytest.param(3, id="all_audited")])
def test_compare_step_counts_match_an_independent_count(n_audit, compare):
  """Padded trainer taps whose top-k slots are the rollout's in another order on some rows,
  with real routing flips and code flips: compare_step's report, counted on the host or on
  the device, equals a row-by-row count."""
  rng = np.random.default_rng(7)
  layers, guided = (0, 1), (1,)
  taps, rollout_records, rollout_routing, arrays = {}, {}, {}, {}
  for layer in layers:
    taps[layer], rollout_records[layer], rollout_routing[layer], arrays[layer] = (
        _step_records(rng, n_audit))
  report = compare(taps, list(COUNTS), n_audit, rollout_records if n_audit else {},
                   rollout_routing, guided)
  audited = sum(COUNTS[:n_audit])
  want_flips, want_routing = {}, {}
  for layer in layers:
    sites, want_routing[layer] = _expected_counts(arrays[layer], audited)
    if n_audit:
      want_flips.update({(layer, site): c for site, c in sites.items()})
  assert report.routing == want_routing
  assert report.flips == want_flips
  assert report.guided_layers == guided
  # The case exercises what it claims: order swaps, set flips, unmatched slots, code flips.
  r = want_routing[1]
  assert r.order_swaps == ROW_KINDS.count("swap") and r.set_flips == 4 and r.unmatched_slots
  if n_audit:
    assert all(c.flips for c in want_flips.values())
    assert want_flips[(1, "moe_in")].scale_flips == 1 and want_flips[(1, "k")].scale_flips == 1
  m = report.metrics()
  g = sum((want_flips[(1, site)] for site in ("moe_in", "expert_mid", "k")),
          mismatch.FlipCount()) if n_audit else None
  assert m["flip_rate_guided"] == (g.flips / g.total if n_audit else None)
  assert m["routing_flip_rate"] == (want_routing[0].set_flips + r.set_flips) / (2 * sum(COUNTS))
  assert m["routing_order_swap_rate"] == (
      (want_routing[0].order_swaps + r.order_swaps) / (2 * sum(COUNTS)))
  assert m["expert_unmatched_rate"] == r.unmatched_slots / r.slots
