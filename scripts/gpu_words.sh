#!/usr/bin/env bash
# One H200 call (device tool, `carry: [".whl"]`): the FP4 "words" decoder (codes held as words
# per block, one table per block) against the byte-layout table decoder: the kernels' bit-exact
# GPU tests, bench_moe_decode side by side (+ a words tile sweep at batch 64), ncu instruction
# counts of both kernels, then bench_rollout with words vs bytes codes. 1 skips a step.
source "$(dirname "$0")/gpu_lib.sh"
stamp start
run words_tests "${T_TESTS:-120}" python3 -m pytest -q -p no:cacheprovider -rf -x \
  tests/kernels/test_fp4_moe.py -k "words or bit_exactly"
run moe_words "${T_MOE:-150}" python3 -m experiments.bench_moe_decode --experts=64 \
  --cases=ragged_bf16,kernel_bf16,kernel_fp4,kernel_fp4_words --json_out="$OUT/moe_words.json"
run moe_sweep "${T_SWEEP:-150}" python3 -m experiments.bench_moe_decode --experts=64 \
  --batches=64 --cases=kernel_fp4_words --sweep --sweep_configs="${SWEEP:-64:256:16:4:3:auto:words,128:256:16:4:3:auto:words,64:128:16:4:3:auto:words,128:128:16:4:2:auto:words,64:256:16:8:3:auto:words,32:256:16:4:3:auto:words}" \
  --json_out="$OUT/moe_sweep.json"
if [ "${T_NCU:-90}" -gt 1 ]; then
  run ncu "${T_NCU:-90}" ncu --clock-control none --kernel-name regex:grouped_matmul_decode_fp4 \
    --launch-count 2 --metrics smsp__inst_executed.sum,dram__bytes_read.sum,gpu__time_duration.sum,launch__registers_per_thread,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active \
    python3 -m experiments.bench_moe_decode --experts=64 --batches=64 --projections=gate_up \
    --cases=kernel_fp4,kernel_fp4_words --reps=1 --inner=1 --warmup=0 --json_out=/tmp/ncu.json
fi
run rollout "${T_ROLLOUT:-200}" python3 -m experiments.bench_rollout --impls=kernel,kernel_bytes \
  --batches=64 --policies=bf16,fp4_rtn,fp4_trace --reps=2 --budget_gb=0 --transformers=false \
  --cases=bf16:kernel:64,fp4_rtn:kernel:64,fp4_trace:kernel:64,fp4_rtn:kernel_bytes:64 \
  --json_out="$OUT/rollout_words.json"
stamp done
