#!/usr/bin/env bash
# One H200 call (device tool, `carry: [".whl"]`), 2026-12-03 (second session): the decode step
# with its records packed into byte rows (`model/byte_rows.py`): bench_rollout at batch 64 with
# a per-kernel profile and the optimized HLO, then fp4_trace/bf16 with XLA's WHILE and
# CONDITIONAL command buffers (the loop's control flow inside CUDA graphs), then the 24-layer
# fp4_trace program (compile time). 1 skips a step.
source "$(dirname "$0")/gpu_lib.sh"
stamp start
XLA_FLAGS="--xla_dump_to=/tmp/hlo --xla_dump_hlo_as_text --xla_dump_hlo_module_re=generate" \
  run rollout8 "${T_R8:-200}" python3 -m experiments.bench_rollout --impls=kernel --batches=64 \
  --policies="${POLICIES:-bf16,fp4_rtn,fp4_trace}" --reps=2 --budget_gb=0 --transformers=false \
  --profile_dir=/tmp/prof --profile_top=40 --json_out="$OUT/rollout8.json"
(cd /tmp/hlo 2>/dev/null && tar czf "$OUT/hlo.tgz" $(ls | grep -E "after_optimizations.txt$" | head -20)) || true
XLA_FLAGS="--xla_gpu_enable_command_buffer=${CMDBUF:-FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL}" \
  run cmdbuf "${T_CB:-150}" python3 -m experiments.bench_rollout --impls=kernel --batches=64 \
  --policies=bf16,fp4_trace --reps=2 --budget_gb=0 --transformers=false \
  --profile_dir=/tmp/prof_cb --json_out="$OUT/rollout_cmdbuf.json"
run rollout24 "${T_R24:-120}" python3 -m experiments.bench_rollout --impls=kernel --batches=64 \
  --layers=24 --policies=fp4_trace --reps=1 --budget_gb=0 --transformers=false \
  --json_out="$OUT/rollout24.json"
stamp done
