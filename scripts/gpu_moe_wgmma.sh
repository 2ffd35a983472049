#!/usr/bin/env bash
# H200 calls (device tool, `carry: [".whl"]`), 2026-12-04 (twelfth session): the decode MoE
# grouped matmul with the packed NVFP4 weights decoded into wgmma's A registers
# (`kernels/wgmma_moe.py`, Mosaic GPU) against the Triton words kernel. Steps (a limit of 1
# skips one):
# T_TEST: the kernels' GPU tests (TEST_ARGS: the wgmma MoE cases, bit-exact one-hot rows and
#   ragged groups against float64; the attention's wgmma cases after the shared decode moved to
#   `wgmma_decode`);
# T_MOE: bench_moe_decode at 64 experts, batches MOE_BATCHES, MOE_CASES side by side (each
#   checked against dequantize + ragged_dot first);
# T_NCU: ncu per MoE kernel at batch NCU_BATCH (gate/up);
# T_ROLL: bench_rollout's 8-layer decode at fixed batches (the engine's default: wgmma experts);
# T_BUDGET: the 60 GB case (8k contexts).
source "$(dirname "$0")/gpu_lib.sh"
MOE="python3 -m experiments.bench_moe_decode"
stamp start
TAIL=40 run test "${T_TEST:-240}" python3 -m pytest -q -p no:cacheprovider --durations=8 \
  ${TEST_ARGS:-tests/kernels/test_fp4_moe.py -k "wgmma or stacked" tests/kernels/test_decode_attention.py}
TAIL=60 run moe "${T_MOE:-200}" $MOE --experts=64 --batches="${MOE_BATCHES:-64,256}" \
  --cases="${MOE_CASES:-ragged_bf16,kernel_bf16,dq_ragged_fp4,kernel_fp4_words,kernel_fp4_wgmma,kernel_fp4_wgmma_fast}" \
  --reps="${MOE_REPS:-20}" ${MOE_EXTRA:-} --json_out="$OUT/moe${MOE_TAG:-}.json"
TAIL=40 run ncu "${T_NCU:-1}" timeout -k 5 "$(( ${T_NCU:-1} - 10 ))" ncu --clock-control none \
  --kernel-name regex:"${NCU_KERNELS:-grouped_matmul}" --launch-count "${NCU_COUNT:-4}" \
  --metrics gpu__time_duration.sum,smsp__inst_executed.sum,l1tex__throughput.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active \
  $MOE --experts=64 --batches="${NCU_BATCH:-64}" --projections=gate_up \
  --cases="${NCU_CASES:-kernel_fp4_words,kernel_fp4_wgmma}" --reps=1 --warmup=0 --inner=1
I="${IMPL:-kernel+unroll4}"
TAIL=30 run roll "${T_ROLL:-1}" python3 -m experiments.bench_rollout --impls=$I --key_impl=$I \
  --policies=bf16,fp4_rtn,fp4_trace --batches="${ROLL_BATCHES:-64,256}" --reps=3 \
  --budget_gb=0 --transformers=false --json_out="$OUT/roll.json"
TAIL=30 run budget "${T_BUDGET:-1}" python3 -m experiments.bench_rollout --impls=$I --key_impl=$I \
  --budget_impl=$I --cases=none --transformers=false --budget_gb=60 \
  --budget_policies="${BUDGET_POLICIES:-bf16,fp4_rtn}" --reps="${BUDGET_REPS:-3}" \
  --json_out="$OUT/budget${BUDGET_TAG:-}.json"
stamp done
