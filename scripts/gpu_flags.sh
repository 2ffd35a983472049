#!/usr/bin/env bash
# One H200 call (device tool, `carry: [".whl"]`), 2026-12-03 (fifth session): does XLA's host
# launch work bound fp4_trace's decode? bench_rollout at batch 64 (bf16, fp4_rtn, fp4_trace side
# by side) in one process per XLA_FLAGS arm: the defaults, while loops and conditionals inside
# command buffers (CUDA graphs with conditional nodes: no host round trip per layer-scan
# iteration), and that with known-trip-count loops unrolled into the graph. Then one profiled
# fp4_trace case with command buffers left on while profiling (XLA turns them off by default,
# so a default profile shows more host gaps than a plain run has). ARMS picks arms, POLICIES
# and REPS the arms' cases, PROF_POLICIES the profiled ones; a limit of 1 skips a step.
source "$(dirname "$0")/gpu_lib.sh"
B="python3 -m experiments.bench_rollout --impls=kernel --batches=64 --budget_gb=0 --transformers=false"
stamp start
for arm in ${ARMS:-base cbwhile cbwhile_unroll}; do
  XLA_FLAGS="${FLAGS_OF[$arm]}" run "arm_$arm" "${T_ARM:-150}" $B \
    --policies="${POLICIES:-bf16,fp4_rtn,fp4_trace}" --reps="${REPS:-3}" \
    --json_out="$OUT/arm_$arm.json"
done
XLA_FLAGS="--xla_enable_command_buffers_during_profiling=true ${PROFILE_FLAGS:-}" \
  run profile_cb "${T_PROF:-1}" $B --policies="${PROF_POLICIES:-fp4_rtn,fp4_trace}" --reps=1 \
  --profile_dir=/tmp/prof_cb --profile_top=30 --json_out="$OUT/profile_cb.json"
stamp done
