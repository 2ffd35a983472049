#!/usr/bin/env bash
# One H200 call (device tool, `carry: [".whl"]`), 2026-12-03 (third session): the FP4 words
# kernel loading 1, 2 or more K tiles ahead (`prefetch`), side by side and in a tile sweep at
# batch 64, ncu occupancy and DRAM figures of depth 1 vs 2, and bench_rollout at batch 64 with
# fp4_trace's record transfer timed apart (`emit_s_per_call`). 1 skips a step.
source "$(dirname "$0")/gpu_lib.sh"
stamp start
run moe "${T_MOE:-130}" python3 -m experiments.bench_moe_decode --experts=64 --batches=8,64 \
  --cases=kernel_bf16,kernel_fp4_words,kernel_fp4_words_prefetch2,kernel_fp4_words_noprefetch \
  --json_out="$OUT/moe.json"
run rollout "${T_ROLLOUT:-190}" python3 -m experiments.bench_rollout --impls=kernel \
  --batches=64 --policies="${POLICIES:-bf16,fp4_rtn,fp4_trace}" --reps=3 --budget_gb=0 \
  --transformers=false --json_out="$OUT/rollout.json"
run sweep "${T_SWEEP:-170}" python3 -m experiments.bench_moe_decode --experts=64 \
  --batches=64 --cases=kernel_fp4_words --sweep --sweep_configs="${SWEEP:-64:256:16:4:3:auto:words:2,64:256:16:4:3:auto:words:3,64:128:16:4:3:auto:words:3,64:128:16:4:3:auto:words:4,128:256:16:8:3:auto:words:2,32:256:16:4:3:auto:words:2,64:512:16:4:3:auto:words:2}" \
  --json_out="$OUT/sweep.json"
if [ "${T_NCU:-70}" -gt 1 ]; then
  run ncu "${T_NCU:-70}" ncu --clock-control none --kernel-name regex:grouped_matmul_decode_fp4 \
    --launch-count 4 --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__registers_per_thread,launch__occupancy_limit_registers,sm__warps_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__inst_executed.sum \
    python3 -m experiments.bench_moe_decode --experts=64 --batches=64 --projections=gate_up \
    --cases=kernel_fp4_words,kernel_fp4_words_prefetch2 --reps=1 --inner=1 --warmup=0 \
    --json_out=/tmp/ncu.json
fi
stamp done
