#!/usr/bin/env bash
# H200 calls (device tool, `carry: [".whl"]`), 2026-12-04 (eleventh session): the packed
# cache's attention scores with K decoded into wgmma's A registers (`kernels/wgmma_attention.py`,
# Mosaic GPU) against the Pallas/Triton scores kernel. Steps (a limit of 1 skips one):
# T_ATTN: bench_decode_attention at 8k contexts (decoder check first), every path checked
#   against the CPU reference, then timed side by side (ATTN_IMPLS);
# T_NCU: ncu per attention kernel (duration, DRAM and L1 throughput, instructions, registers) at
#   batch 256 (NCU_IMPLS);
# T_BUDGET: bench_rollout's 60 GB case (8k contexts, BUDGET_POLICIES) with the engine's default
#   decode attention (the wgmma kernels where they run; calls 6-12 passed
#   --budget_max_batch=1536, the GPU preset's cap is 2048 now: every sequence FP4 fits);
#   T_ROLL: 8-layer decode at fixed batches; T_GPUTEST: pytest files on the GPU
#   (GPUTEST_FILES).
source "$(dirname "$0")/gpu_lib.sh"
ATTN="python3 -m experiments.bench_decode_attention"
stamp start
TAIL=40 run attn "${T_ATTN:-200}" $ATTN --contexts="${ATTN_CONTEXTS:-8192}" \
  --batches="${ATTN_BATCHES:-64,256}" \
  --impls="${ATTN_IMPLS:-kernel_bf16,kernel_packed,kernel_packed_wgmma_scores,kernel_packed_wgmma}" \
  --reps=10 --inner=4 ${ATTN_EXTRA:-} --json_out="$OUT/attn${ATTN_TAG:-}.json"
TAIL=60 run ncu "${T_NCU:-1}" timeout -k 5 "$(( ${T_NCU:-1} - 10 ))" ncu --clock-control none \
  --kernel-name regex:"${NCU_KERNELS:-decode_attention}" --launch-count "${NCU_COUNT:-4}" \
  --metrics gpu__time_duration.sum,smsp__inst_executed.sum,l1tex__throughput.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum \
  $ATTN --contexts=8192 --batches="${NCU_BATCH:-256}" \
  --impls="${NCU_IMPLS:-kernel_packed,kernel_packed_wgmma}" --reps=1 --warmup=0 \
  --inner=1 --check_seqs=1 --decoder_check=false --json_out=/tmp/ncu_run.json
I="${IMPL:-kernel+unroll4}"
TAIL=30 run budget "${T_BUDGET:-1}" python3 -m experiments.bench_rollout --impls=$I --key_impl=$I \
  --budget_impl=$I --cases=none --transformers=false --budget_gb=60 \
  --budget_policies="${BUDGET_POLICIES:-bf16,fp4_rtn}" --reps="${BUDGET_REPS:-3}" \
  --json_out="$OUT/budget${BUDGET_TAG:-}.json"
# T_ROLL: the 8-layer decode at batches ROLL_BATCHES, every policy (the engine's default
# attention: the wgmma scores at the issue model's 32/4 heads of 128).
TAIL=30 run roll "${T_ROLL:-1}" python3 -m experiments.bench_rollout --impls=$I --key_impl=$I \
  --policies=bf16,fp4_rtn,fp4_trace --batches="${ROLL_BATCHES:-64,256}" --reps=3 \
  --budget_gb=0 --transformers=false --json_out="$OUT/roll.json"
TAIL=30 run gputest "${T_GPUTEST:-1}" python3 -m pytest -q -p no:cacheprovider \
  --durations=10 ${GPUTEST_FILES:-tests/kernels/test_decode_attention.py}
stamp done
