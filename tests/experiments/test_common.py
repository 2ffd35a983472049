"""`experiments.common`'s timing helper: what a sample counts (on a fake clock)."""

from __future__ import annotations

import pytest

from experiments import common


@pytest.mark.parametrize("calls", [1, 4], ids=["one_call", "four_calls"])
def test_median_seconds_times_one_call_of_a_sample(calls, monkeypatch):
  """A sample of `calls` back-to-back calls, synced once, gives the time per call: a call
  costs 2 clock units, a sync's round trip 10, counted once per sample."""
  clock, n_calls, n_syncs = [0.0], [0], [0]
  monkeypatch.setattr(common.time, "perf_counter", lambda: clock[0])

  def fn():
    n_calls[0] += 1
    clock[0] += 2.0
    return n_calls[0]

  def sync(out):
    n_syncs[0] += 1
    clock[0] += 10.0
    return out

  med, best = common.median_seconds(fn, sync, warmup=1, reps=3, calls=calls)
  assert n_calls[0] == 1 + 3 * calls and n_syncs[0] == 1 + 3
  assert med == best == pytest.approx(2.0 + 10.0 / calls)
