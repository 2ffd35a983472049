"""Benchmarks and GPU diagnostics: `python -m experiments.bench.<name>` (rollout, train_step,
moe_decode, decode_attention, fp8_gemm, grouped_gemm, quant, multi_gpu, gpu_check). profiling
is the profile reader they share and bit_checks holds gpu_check's direct bit-exactness checks.
Each benchmark prints ratios measured side by side in one process and writes its JSON;
`scripts/gpu_runbook.sh` runs them on the device machine."""
