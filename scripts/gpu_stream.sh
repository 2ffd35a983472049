#!/usr/bin/env bash
# One H200 call (device tool, `carry: [".whl"]`, ~9 min), issue 14's wgmma_moe stream variant
# (codes through a TMA ring in shared memory), after its first ncu run (2026-12-05, 61.3 us at
# 4 stages, group 1; group 2 hung the call). Steps (a limit of 1 skips one):
# T_TEST: its bit-exact dequantization test on the GPU (rings of 4 and 2, passes of 128 / 16).
# T_NCU: ncu side by side in one process: the Triton words kernel, wgmma over registers, wgmma
#   stream (4 stages, group 1), outputs checked against each other first (gate/up, batch 64);
#   a watchdog kills the profiled process (ncu does not pass its timeout's signal on).
# T_ROLL: the 8-layer engine at batch 64, bf16 and fp4_rtn: Triton experts, wgmma, wgmma stream.
# T_EXACT: gpu_probe14.sh's exact-table attention probe.
source "$(dirname "$0")/gpu_lib.sh"
stamp start
TAIL=12 run test "${T_TEST:-120}" python3 -m pytest -q -p no:cacheprovider \
  tests/kernels/test_fp4_moe.py -k wgmma_kernel_dequantizes
( sleep "$(( ${T_NCU:-90} - 5 ))"; pkill -9 -f experiments.bench_moe_decode ) & wd=$!
TAIL=60 run ncu "${T_NCU:-90}" ncu --clock-control none --kernel-name regex:grouped_matmul \
  --launch-count "${NCU_COUNT:-8}" --metrics \
  gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active \
  python3 -m experiments.bench_moe_decode --experts=64 --batches=64 --projections=gate_up \
  --reps=1 --warmup=0 --inner=1 \
  --cases=dq_ragged_fp4,kernel_fp4_words,kernel_fp4_wgmma,kernel_fp4_wgmma_stream
kill "$wd" 2>/dev/null
I=kernel+unroll4
TAIL=30 run roll "${T_ROLL:-260}" python3 -m experiments.bench_rollout \
  --impls="$I,$I+moewgmma,$I+moewgmma+stream4" --key_impl=$I --policies=bf16,fp4_rtn \
  --batches=64 --reps=3 --budget_gb=0 --transformers=false --json_out="$OUT/roll.json"
T_STREAM=1 T_UNROLL=1 T_EXACT="${T_EXACT:-90}" bash "$(dirname "$0")/gpu_probe14.sh"
stamp done
