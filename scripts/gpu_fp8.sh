#!/usr/bin/env bash
# One H200 call (device tool, `carry: [".whl"]`, timeout_s 600) for issue 15's FP8 GEMMs and
# the FP4 table decoder: the FP8 kernel's tests on the GPU (T_TESTS), the table decoder's
# tests (T_DECODE), bench_fp8_gemm (T_GEMM, GEMM_ARGS), bench_moe_decode with the table decoder
# (T_MOE), bench_train_step (T_TRAIN, TRAIN_ARGS: bf16 vs fp8_unified with the kernel, BF16 and
# FP8 backward, and fp4_trace at 4 Qwen3-width layers, 8k tokens), bench_rollout (T_ROLLOUT,
# ROLLOUT_ARGS; T_ROLLOUT2/ROLLOUT2_ARGS a second configuration, e.g. 24 layers). Each step has
# its own limit in seconds; 1 skips a step.
source "$(dirname "$0")/gpu_lib.sh"
stamp start
run fp8_tests "${T_TESTS:-120}" python3 -m pytest -q -p no:cacheprovider -rf -x \
  tests/kernels/test_fp8_gemm.py
run fp4_decode_tests "${T_DECODE:-1}" python3 -m pytest -q -p no:cacheprovider -rf -x \
  tests/kernels/test_fp4_decode.py
run bench_fp8_gemm "${T_GEMM:-240}" python3 -m experiments.bench_fp8_gemm \
  --json_out="$OUT/bench_fp8_gemm.json" ${GEMM_ARGS:-}
run bench_moe_table "${T_MOE:-1}" python3 -m experiments.bench_moe_decode --experts=64 \
  --decoder=table --cases=kernel_bf16,kernel_fp4,kernel_fp4_float16,dq_ragged_fp4 \
  --json_out="$OUT/bench_moe_decode_table.json"
run bench_train_step "${T_TRAIN:-1}" python3 -m experiments.bench_train_step \
  --preset=qwen3_layers --steps=5 ${TRAIN_ARGS:-}
run bench_rollout "${T_ROLLOUT:-1}" python3 -m experiments.bench_rollout \
  --json_out="$OUT/bench_rollout.json" ${ROLLOUT_ARGS:-}
run bench_rollout2 "${T_ROLLOUT2:-1}" python3 -m experiments.bench_rollout \
  --json_out="$OUT/bench_rollout2.json" ${ROLLOUT2_ARGS:-}
stamp done
