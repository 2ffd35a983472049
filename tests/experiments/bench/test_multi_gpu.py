"""bench_multi_gpu: its ratios from known tokens/s, its records comparison on known records,
and one CPU run on 1 vs 2 devices."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from experiments import common
from experiments.bench import multi_gpu as bm


def test_summary_ratios():
  cases = {"1": {"train": {"tokens_per_s": 100.0, "first_loss": 2.0, "first_grad_norm": 4.0},
                 "decode": {"tokens_per_s": 50.0}},
           "2": {"train": {"tokens_per_s": 150.0, "first_loss": 2.002, "first_grad_norm": 3.0},
                 "decode": {"tokens_per_s": 40.0}}}
  s = bm.summary(cases, [1, 2])
  assert s["two_gpu_over_one"] == pytest.approx(1.5)
  assert s["two_gpu_decode_over_one"] == pytest.approx(0.8)  # a slower mesh reads below 1
  assert s["first_loss_rel_diff"]["2"] == pytest.approx(1e-3)
  assert s["first_grad_norm_rel_diff"]["2"] == pytest.approx(0.25)


class _Device:
  def __init__(self, stats):
    self.stats = stats

  def memory_stats(self):
    return self.stats


def test_device_memory_is_the_largest_over_the_devices():
  devs = [_Device({"bytes_in_use": 3e9, "peak_bytes_in_use": 5e9}),
          _Device({"bytes_in_use": 4e9, "peak_bytes_in_use": 4.5e9})]
  assert common.device_memory(devs) == {"bytes_in_use_gb_max": 4.0,
                                        "peak_bytes_in_use_gb_max": 5.0}
  assert common.device_memory(devs + [_Device(None)]) is None  # a backend without counters
  assert common.device_memory(jax.devices()[:1]) is None  # CPU


def _records(rows: int, seed: int) -> dict:
  """Records as the engine's last_guidance holds them: ragged rows of every sequence."""
  rng = np.random.default_rng(seed)
  site = {"codes": rng.integers(0, 256, (rows, 4, 8), dtype=np.uint8),
          "scale": rng.standard_normal((rows, 4)).astype(np.float32)}
  return {"guidance": {1: {"moe_in": site}},
          "routing": {0: rng.integers(0, 8, (rows, 2)).astype(np.int32),
                      1: rng.integers(0, 8, (rows, 2)).astype(np.int32)}}


def test_records_agreement_compares_the_rows_of_each_sequence():
  # Reference: sequences of 5 and 6 rows; this run's second sequence is shorter (4 rows), and
  # only the first 3 and 4 rows of each came from the same tokens.
  ref = _records(11, 0)
  counts, ref_counts, rows = [5, 4], [5, 6], [3, 4]
  pick = np.r_[0:5, 5:9]  # this run's rows: sequence 0 whole, sequence 1's first 4
  mine = jax.tree.map(lambda a: a[pick].copy(), ref)
  mine["routing"][0][4] = 7 - mine["routing"][0][4]  # row 4 of sequence 0: not compared
  assert bm.records_agreement(mine, ref, rows, counts, ref_counts) == {"0": 1.0, "1": 1.0}
  # One bit of one compared element: its layer reads below 1 by exactly that element.
  mine["guidance"][1]["moe_in"]["scale"][6, 2] = -mine["guidance"][1]["moe_in"]["scale"][6, 2]
  got = bm.records_agreement(mine, ref, rows, counts, ref_counts)
  per_row = 4 * 8 + 4 + 2  # codes, scales and routing of layer 1
  assert got["0"] == 1.0 and got["1"] == pytest.approx(1 - 1 / (7 * per_row))
  # +0 and -0 differ as bits; a NaN equals itself
  z = jax.tree.map(lambda a: a[pick].copy(), ref)
  z["guidance"][1]["moe_in"]["scale"][0, 0] = np.nan
  ref_z = jax.tree.map(np.copy, ref)
  ref_z["guidance"][1]["moe_in"]["scale"][0, 0] = np.nan
  ref_z["guidance"][1]["moe_in"]["scale"][1, 0] = 0.0
  z["guidance"][1]["moe_in"]["scale"][1, 0] = -0.0
  got = bm.records_agreement(z, ref_z, rows, counts, ref_counts)
  assert got["1"] == pytest.approx(1 - 1 / (7 * per_row))
  # Unrelated records: mostly unequal (the metric sees a broken record)
  got = bm.records_agreement(_records(9, 1), ref, rows, counts, ref_counts)
  assert got["0"] < 0.3 and got["1"] < 0.3, got
  with pytest.raises(ValueError, match="lacks"):
    bm.records_agreement({"routing": mine["routing"]}, ref, rows, counts, ref_counts)


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices: run with "
                    "XLA_FLAGS=--xla_force_host_platform_device_count=8")
def test_cpu_run(tmp_path):
  res = bm.main(["prog", "--preset=cpu", "--devices=1,2", "--layers=1", "--reps=1",
                 "--seq=16", "--new_tokens=4", f"--json_out={tmp_path / 'mg.json'}"])
  for n in ("1", "2"):
    assert res["cases"][n]["train"]["tokens_per_s"] > 0
    assert res["cases"][n]["decode"]["tokens_per_s"] > 0
  # The same GRPO step (on the one-device rollout) on two devices: loss and grad norm within
  # BF16 accumulation error; greedy tokens mostly the same (BF16 near-ties may part).
  assert res["cases"]["1"]["train"]["step"] == "grpo"
  assert res["first_loss_rel_diff"]["2"] < 1e-3
  assert res["first_grad_norm_rel_diff"]["2"] < 1e-2
  assert res["cases"]["2"]["decode"]["token_agreement_with_first"] >= 0.75
  assert "records_equal_with_first" not in res["cases"]["2"]["decode"]  # bf16 records nothing
  assert res["cases"]["2"]["train"]["memory"] is None  # CPU keeps no allocator counters
  assert (tmp_path / "mg.json").exists()
  with pytest.raises(ValueError, match="divide"):
    bm.main(["prog", "--preset=cpu", "--devices=3", "--layers=1"])
  with pytest.raises(ValueError, match="needs --decode"):
    bm.main(["prog", "--preset=cpu", "--devices=1", "--nodecode"])
