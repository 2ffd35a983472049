#!/usr/bin/env bash
# One H200 call (device tool, `carry: [".whl"]`, timeout_s 600): the Pallas kernels' tests on
# the GPU (Triton lowering, interpret=False), the MXFP4 guided-rounding tests on the GPU, and
# the kernels' benchmarks. Logs and JSON land in $OUT; each step has its own time limit, so a
# slow step cuts only itself (T_TESTS, T_MOE, T_ATTN seconds; 1 skips a step).
source "$(dirname "$0")/gpu_lib.sh"
stamp start
run kernel_tests "${T_TESTS:-200}" python3 -m pytest -q -p no:cacheprovider -rf \
  tests/kernels tests/quant/test_guided_mxfp4.py
run bench_moe_e64 "${T_MOE:-170}" python3 -m experiments.bench_moe_decode --experts=64 \
  --json_out="$OUT/bench_moe_decode_e64.json"
run bench_moe_e128 "${T_MOE:-170}" python3 -m experiments.bench_moe_decode --experts=128 \
  --json_out="$OUT/bench_moe_decode_e128.json"
run bench_attn "${T_ATTN:-150}" python3 -m experiments.bench_decode_attention \
  --json_out="$OUT/bench_decode_attention.json"
stamp done
