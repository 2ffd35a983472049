"""experiments/bench/moe_decode.py: one tiny `--preset=cpu` run (keys, verification, bytes)."""

from __future__ import annotations

import json

import pytest

from experiments.bench import moe_decode as bench_moe_decode


def test_cpu_preset_runs_and_verifies(tmp_path):
  """Compilation dominates (interpret-mode kernels, the FP4 quantizer); no timing assertions."""
  path = tmp_path / "bench.json"
  bench_moe_decode.main(["bench_moe_decode", "--preset=cpu", "--projections=down", "--reps=1",
                         "--warmup=0", "--copy_mib=4", f"--json_out={path}"])
  with open(path) as f:
    res = json.load(f)
  for key in ("backend", "device_kind", "copy_gbps", "kernel_opts", "shapes", "flags"):
    assert key in res, key
  [shape] = res["shapes"]
  assert (shape["experts"], shape["batch"], shape["projection"]) == (8, 4, "down")
  # off the GPU every case but the GPU-only ones (the wgmma kernel), which are refused there
  assert list(shape["cases"]) == [c for c in bench_moe_decode.CASES
                                  if c not in bench_moe_decode.GPU_ONLY]
  with pytest.raises(ValueError, match="run on a Hopper GPU only"):
    bench_moe_decode.main(["bench_moe_decode", "--preset=cpu", "--projections=down",
                           "--cases=kernel_fp4_wgmma", "--copy_mib=4"])
  v = shape["verify"]
  assert v["dequant_bits_equal_fake_quant"]
  for name in ("kernel_bf16_vs_ragged_bf16", "kernel_fp4_vs_dq_ragged_fp4",
               "kernel_fp4_vs_fq_ragged_fp4"):
    assert v[name]["ok"], (name, v[name])
  d, f, touched = res["hidden"], res["width"], shape["touched"]
  cases = shape["cases"]
  assert cases["ragged_bf16"]["weight_bytes"] == touched * d * f * 2
  assert cases["kernel_fp4"]["weight_bytes"] == touched * (d * f // 2 + d * f // 16 + 4)
  assert cases["ragged_bf16"]["time_over_ragged_bf16"] == 1.0
  for entry in cases.values():
    assert entry["median_ms"] > 0 and entry["frac_copy"] > 0
  assert cases["dq_ragged_fp4"]["weight_bytes"] == cases["kernel_fp4"]["weight_bytes"]
  assert cases["fq_ragged_fp4"]["weight_bytes"] == cases["ragged_bf16"]["weight_bytes"]
