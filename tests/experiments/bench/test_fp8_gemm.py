"""bench_fp8_gemm on CPU (interpret mode): the cases run, the kernel matches the reference and
the ratios are reported."""

from experiments.bench import fp8_gemm as bench_fp8_gemm


def test_cpu_preset(tmp_path):
  out = tmp_path / "fp8.json"
  res = bench_fp8_gemm.main(["prog", "--preset=cpu", "--only=dense_o,grouped_down_decode64",
                             "--reps=1", f"--json_out={out}"])
  assert set(res["shapes"]) == {"dense_o", "grouped_down_decode64"}
  for row in res["shapes"].values():
    assert row["kernel_rel_err"] < 1e-5  # float32 summation order only
    assert row["kernel_ms"] > 0 and row["bf16_ms"] > 0 and row["kernel_over_bf16"] > 0
  assert "xla_fp8_tensor_ms" in res["shapes"]["dense_o"] and out.stat().st_size > 300
