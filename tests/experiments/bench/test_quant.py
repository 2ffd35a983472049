"""experiments/bench/quant.py: a smoke run at a tiny size (keys and byte counts; no timings)."""

from __future__ import annotations

import json

import pytest

from experiments.bench import quant as bench_quant

ROWS, K = 8, 1024
OPS = ["nvfp4_quantize_2level", "fp8_dequantize", "guided_codes_compact", "fake_quant_fwd_bwd"]


def test_smoke_run_keys_torch_and_bytes(tmp_path):
  """One tiny run (compilation dominates); no timing assertions."""
  path = tmp_path / "bench.json"
  bench_quant.main(["bench_quant", f"--size={ROWS * K}", f"--k={K}", "--reps=1", "--warmup=1",
                    "--torch_reps=1", "--torch_max_elements=0", f"--ops={','.join(OPS)}",
                    f"--json_out={path}"])
  with open(path) as f:
    bench = json.load(f)
  _check_keys(bench)
  _check_torch(bench)
  _check_bytes(bench)


def _check_keys(bench):
  for key in ("backend", "device_kind", "device_count", "size", "rows", "k", "dtype", "reps",
              "warmup", "copy_gbps", "ops", "torch_device", "flags"):
    assert key in bench, key
  assert "partial" not in bench
  assert (bench["rows"], bench["k"], bench["size"]) == (ROWS, K, ROWS * K)
  assert list(bench["ops"]) == ["copy"] + OPS  # the copy reference always runs
  for name, e in bench["ops"].items():
    assert "error" not in e, (name, e.get("error"))
    for key in ("median_ms", "min_ms", "bytes_in", "bytes_out", "gbps_in", "gbps_moved",
                "frac_copy"):
      assert key in e, (name, key)
  assert bench["ops"]["copy"]["frac_copy"] == pytest.approx(1.0)


def _check_torch(bench):
  try:
    import torch  # noqa: F401
  except ImportError:
    assert bench["torch_device"] is None
    return
  assert bench["torch_device"] == "cpu"
  for name in ("copy", "nvfp4_quantize_2level", "fp8_dequantize", "guided_codes_compact"):
    assert "torch_median_ms" in bench["ops"][name], name
    assert "jax_over_torch" in bench["ops"][name], name
  assert "torch_median_ms" not in bench["ops"]["fake_quant_fwd_bwd"]  # no torch twin


def _check_bytes(bench):
  n = ROWS * K
  ops = bench["ops"]
  assert ops["copy"]["bytes_in"] == ops["copy"]["bytes_out"] == 2 * n  # bf16 in and out
  # codes (one byte each, as JAX holds them) + E4M3 block scales + float32 row scales
  assert ops["nvfp4_quantize_2level"]["bytes_in"] == 2 * n
  assert ops["nvfp4_quantize_2level"]["bytes_out"] == n + n // 16 + 4 * ROWS
  # x + compact record (mantissa bits, block scales, row scales) in, codes out
  assert ops["guided_codes_compact"]["bytes_in"] == 2 * n + n // 8 + n // 16 + 4 * ROWS
  assert ops["guided_codes_compact"]["bytes_out"] == n
  assert ops["fake_quant_fwd_bwd"]["bytes_in"] == ops["fake_quant_fwd_bwd"]["bytes_out"] == 4 * n


def test_fake_quant_kernels_beside_xla(tmp_path):
  """The fake quantizers' kernels (interpret mode here) run beside XLA's, with their bytes."""
  path = tmp_path / "bench.json"
  ops = ["qdq_rows_xla", "qdq_rows_kernel", "guided_qdq_rows_kernel"]
  bench_quant.main(["bench_quant", f"--size={4 * 768}", "--k=768", "--reps=1", "--warmup=1",
                    "--torch=false", f"--ops={','.join(ops)}", f"--json_out={path}"])
  with open(path) as f:
    bench = json.load(f)
  n = 4 * 768
  for name in ops:
    assert "error" not in bench["ops"][name], bench["ops"][name].get("error")
    assert bench["ops"][name]["bytes_out"] == 2 * n
  assert bench["ops"]["qdq_rows_kernel"]["bytes_in"] == 2 * n + 4 * 4


def test_unknown_op_is_an_error(tmp_path):
  with pytest.raises(ValueError, match="unknown ops"):
    bench_quant.main(["bench_quant", "--size=1024", "--k=1024", "--ops=nope",
                      f"--json_out={tmp_path / 'b.json'}"])


def test_sites_smoke(tmp_path):
  """--sites at one tiny shape (a padded block axis): both paths timed per site call and
  bit-identical (the kernel runs in the Pallas interpreter here); no timing assertions."""
  path = tmp_path / "sites.json"
  bench_quant.main(["bench_quant", "--sites", "--site_shapes=3x48", "--site_chain=2",
                    "--reps=1", "--warmup=1", f"--json_out={path}"])
  with open(path) as f:
    bench = json.load(f)
  assert bench["mode"] == "sites" and bench["chain"] == 2
  assert list(bench["sites"]) == ["3x48"]
  for key, e in bench["sites"].items():
    for field in ("xla_us", "kernel_us", "xla_call_ms", "kernel_call_ms", "xla_over_kernel",
                  "xla_entry_ops", "kernel_entry_ops"):
      assert field in e, (key, field)
    assert e["bit_identical"] is True, key
  assert bench["bit_identical"] is True


def test_sites_bad_shape_is_an_error(tmp_path):
  with pytest.raises(ValueError, match="multiple of 16"):
    bench_quant.main(["bench_quant", "--sites", "--site_shapes=4x40",
                      f"--json_out={tmp_path / 'b.json'}"])


def test_entry_ops_counts_kernels_not_plumbing():
  hlo = """HloModule m

fused_computation {
  p = f32[4]{0} parameter(0)
  ROOT n = f32[4]{0} negate(p)
}

ENTRY main {
  %p0 = f32[4]{0} parameter(0)
  %c = f32[] constant(1)
  %f = f32[4]{0} fusion(f32[4]{0} %p0), kind=kLoop, calls=fused_computation
  %cc = (f32[4]{0}, u8[4]{0}) custom-call(f32[4]{0} %f), custom_call_target="x"
  %g = f32[4]{0} get-tuple-element((f32[4]{0}, u8[4]{0}) %cc), index=0
  %b = f32[2,2]{1,0} bitcast(f32[4]{0} %g)
  ROOT %t = (f32[2,2]{1,0}) tuple(f32[2,2]{1,0} %b)
}
"""
  assert bench_quant.entry_ops(hlo) == 2
