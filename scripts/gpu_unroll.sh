#!/usr/bin/env bash
# One H200 call (device tool, `carry: [".whl"]`), written 2026-12-03 (fifth session), not run
# yet: do fewer layer-scan iterations per decode step (each one a host round of launches) buy
# back fp4_trace's idle time? bench_rollout at batch 64 with the layer scans at 1, 2 and 4
# layers per iteration (`ModelConfig.scan_unroll`) side by side in one process (ratios
# `<policy>_kernel_unroll<N>_over_kernel_b64`), profiled with command buffers on; then the
# 24-layer fp4_trace compile at the best setting (UNROLL24). 1 skips a step.
source "$(dirname "$0")/gpu_lib.sh"
B="python3 -m experiments.bench_rollout --batches=64 --budget_gb=0 --transformers=false"
stamp start
run unroll "${T_UNROLL:-300}" $B --impls="${IMPLS:-kernel,kernel+unroll2,kernel+unroll4}" \
  --policies="${POLICIES:-bf16,fp4_rtn,fp4_trace}" --reps="${REPS:-3}" \
  --json_out="$OUT/unroll.json"
XLA_FLAGS="--xla_enable_command_buffers_during_profiling=true" run unroll_profile \
  "${T_PROF:-1}" $B --impls="${IMPLS:-kernel,kernel+unroll2,kernel+unroll4}" \
  --policies=fp4_trace --reps=1 --profile_dir=/tmp/prof_unroll --profile_top=20 \
  --json_out="$OUT/unroll_profile.json"
run unroll24 "${T_R24:-150}" $B --impls="kernel+unroll${UNROLL24:-2}" --layers=24 \
  --policies=fp4_trace --reps=1 --json_out="$OUT/unroll24.json"
stamp done
