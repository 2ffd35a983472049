"""bench_multi_gpu: its ratios from known tokens/s, and one CPU run on 1 vs 2 devices."""

from __future__ import annotations

import jax
import pytest

from experiments import bench_multi_gpu as bm


def test_summary_ratios():
  cases = {"1": {"train": {"tokens_per_s": 100.0, "first_loss": 2.0},
                 "decode": {"tokens_per_s": 50.0}},
           "2": {"train": {"tokens_per_s": 150.0, "first_loss": 2.002},
                 "decode": {"tokens_per_s": 40.0}}}
  s = bm.summary(cases, [1, 2])
  assert s["two_gpu_over_one"] == pytest.approx(1.5)
  assert s["two_gpu_decode_over_one"] == pytest.approx(0.8)  # a slower mesh reads below 1
  assert s["first_loss_rel_diff"]["2"] == pytest.approx(1e-3)


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices: run with "
                    "XLA_FLAGS=--xla_force_host_platform_device_count=8")
def test_cpu_run(tmp_path):
  res = bm.main(["prog", "--preset=cpu", "--devices=1,2", "--layers=1", "--reps=1",
                 "--seq=16", "--new_tokens=4", f"--json_out={tmp_path / 'mg.json'}"])
  for n in ("1", "2"):
    assert res["cases"][n]["train"]["tokens_per_s"] > 0
    assert res["cases"][n]["decode"]["tokens_per_s"] > 0
  # The same maths on two devices: the first loss within BF16 accumulation error, greedy
  # tokens mostly the same (BF16 near-ties may part).
  assert res["first_loss_rel_diff"]["2"] < 1e-3
  assert res["cases"]["2"]["decode"]["token_agreement_with_first"] >= 0.75
  assert (tmp_path / "mg.json").exists()
  with pytest.raises(ValueError, match="divide"):
    bm.main(["prog", "--preset=cpu", "--devices=3", "--layers=1"])
