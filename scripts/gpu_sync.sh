#!/usr/bin/env bash
# One H200 call (device tool, `carry: [".whl"]`), sixth session (2026-12-03): does checking the
# decode loop's condition once per N steps (`ModelConfig.decode_steps_per_sync`, bench option
# `+sync<N>`) remove the host wait behind each step's predicate copy? bench_rollout at batch 64,
# the plain kernel impl, layer scans 4 layers per iteration, and that with sync 4 and 8, side by
# side in one process; then a command-buffer profile of fp4_trace at TUNED and the 24-layer
# fp4_trace compile at TUNED (T_R24, off by default). 1 skips a step.
source "$(dirname "$0")/gpu_lib.sh"
B="python3 -m experiments.bench_rollout --batches=64 --budget_gb=0 --transformers=false"
TUNED=${TUNED:-kernel+unroll4+sync4}
stamp start
run sync "${T_SYNC:-400}" $B \
  --impls="${IMPLS:-kernel,kernel+unroll4,kernel+unroll4+sync4,kernel+unroll4+sync8}" \
  --policies="${POLICIES:-bf16,fp4_rtn,fp4_trace}" --reps="${REPS:-3}" --key_impl="$TUNED" \
  --json_out="$OUT/sync.json"
XLA_FLAGS="--xla_enable_command_buffers_during_profiling=true" run sync_profile \
  "${T_PROF:-100}" $B --impls="$TUNED" --policies=fp4_trace --reps=1 \
  --profile_dir=/tmp/prof_sync --profile_top=20 --json_out="$OUT/sync_profile.json"
run sync24 "${T_R24:-1}" $B --impls="$TUNED" --layers=24 --policies=fp4_trace --reps=1 \
  --key_impl="$TUNED" --json_out="$OUT/sync24.json"
stamp done
