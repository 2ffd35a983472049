"""bench_rollout on CPU: the cases run, report tokens/s and bandwidth, and give the ratios."""

from experiments import bench_rollout


def test_cpu_preset(tmp_path):
  out = tmp_path / "rollout.json"
  res = bench_rollout.main(["prog", "--preset=cpu", "--policies=bf16", "--prompt_len=8",
                            "--new_tokens=8", "--reps=1", f"--json_out={out}"])
  cases = res["cases"]
  assert set(cases) == {"bf16:xla:4", "bf16:kernel:4"}
  for c in cases.values():
    assert c["tokens_per_s"] > 0 and c["tokens"] == 4 * 8 and 0 < c["read_fraction"]
  assert "kernel_over_xla_bf16_b4" in res["ratios"] and out.stat().st_size > 500
