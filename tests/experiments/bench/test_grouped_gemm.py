"""bench_grouped_gemm on CPU (interpret mode): every pass runs, matches the tiled path and the
ratios are reported."""

from experiments.bench import grouped_gemm as bench_grouped_gemm


def test_cpu_preset(tmp_path):
  out = tmp_path / "grouped.json"
  res = bench_grouped_gemm.main(["prog", "--preset=cpu", "--only=down", "--reps=1",
                                 f"--json_out={out}"])
  row = res["projections"]["down"]
  for p in ("fprop", "dgrad", "wgrad"):
    assert row[f"kernel_{p}_rel_err"] < 2**-7  # bf16 outputs: one rounding apart at most
    assert row[f"kernel_{p}_ms"] > 0
  assert row["tiled_fwd_bwd_ms"] > 0 and row["kernel_fwd_bwd_over_tiled"] > 0
  assert out.stat().st_size > 300
