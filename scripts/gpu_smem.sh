#!/usr/bin/env bash
# H200 calls (device tool, `carry: [".whl"]`), 2026-12-04 (tenth session): where the packed
# KV cache's attention kernels spend the L1/shared-memory pipe (ncu: 84-93% of it, DRAM 31-33%),
# and what helps. Steps (a limit of 1 skips one):
# T_ATTN: bench_decode_attention at 8k contexts (its --decoder_check first: the packed cache's
#   decoders bit for bit on the device); T_NCU: ncu's shared-memory wavefronts and bank
#   conflicts per kernel at batch 256 (KIMPLS); T_SASS: the packed kernels' SASS with
#   per-instruction counts (ncu SourceCounters, gzipped); T_OLD: the bytes' table decoder of
#   4074c55 (extracted to old/ beforehand: `mkdir old && git archive 4074c55 trace_jax
#   experiments | tar -x -C old`; OLD_SHAPE for other head shapes); T_STEADY: fp4_rtn vs
#   fp4_trace at 24 layers, batches 8 and 256, after bench_rollout's warm-up call; T_GPUTEST:
#   the decode-attention kernels' pytest file on the GPU.
# Calls 1 and 3 (commit ae697a2) also timed `keys_lhs` (the scores' dot as K q^T) and `v_order`
# (V decoded in the MMA column order) as kernel impls, call 4 (commit 2da97ec) a T_SB loop of
# one process per `--score_blocks` value (1, 2, 4, 8, 16: key blocks per scores program, q
# staged once): none faster for the packed cache; all three removed.
source "$(dirname "$0")/gpu_lib.sh"
I="${IMPL:-kernel+unroll4}"
ATTN="python3 -m experiments.bench_decode_attention"
KIMPLS="${KIMPLS:-kernel_bf16,kernel_packed}"
stamp start
TAIL=40 run attn "${T_ATTN:-200}" $ATTN --contexts="${ATTN_CONTEXTS:-8192}" \
  --batches="${ATTN_BATCHES:-64,256}" --impls="${ATTN_IMPLS:-$KIMPLS,kernel_packed_bits}" \
  --reps=10 --inner=4 ${ATTN_EXTRA:-} --json_out="$OUT/attn${ATTN_TAG:-}.json"
TAIL=60 run ncu "${T_NCU:-150}" timeout -k 5 "$(( ${T_NCU:-150} - 10 ))" ncu --clock-control none \
  --kernel-name regex:decode_attention --launch-count "${NCU_COUNT:-12}" --metrics \
gpu__time_duration.sum,smsp__inst_executed.sum,smsp__inst_executed_op_shared_ld.sum,smsp__inst_executed_op_shared_st.sum,smsp__inst_executed_op_ldsm.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,l1tex__throughput.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__registers_per_thread \
  $ATTN --contexts=8192 --batches="${NCU_BATCH:-256}" --impls="$KIMPLS" --reps=1 --warmup=0 \
  --inner=1 --check_seqs=1 --decoder_check=false --json_out=/tmp/ncu_run.json
# T_SASS: the packed kernels' SASS with per-instruction executed counts, shared-memory
# wavefronts and bank conflicts (ncu's SourceCounters), gzipped.
if [ "${T_SASS:-1}" -gt 1 ]; then
  TAIL=4 run sass "$T_SASS" timeout -k 5 "$((T_SASS - 10))" ncu --clock-control none \
    --kernel-name regex:"${SASS_KERNELS:-decode_attention_(scores|pv)_nvfp4}" --launch-count 2 \
    --section SourceCounters --page source --print-source sass \
    $ATTN --contexts=8192 --batches="${NCU_BATCH:-256}" --impls=kernel_packed --reps=1 \
    --warmup=0 --inner=1 --check_seqs=1 --decoder_check=false --json_out=/tmp/sass_run.json
  gzip -c "$OUT/sass.log" > "$OUT/sass.log.gz" && rm "$OUT/sass.log"
fi
if [ "${T_OLD:-1}" -gt 1 ] && [ -d old ]; then
  (cd old && TAIL=20 run old "$T_OLD" $ATTN --contexts=1024,8192 --batches=8,64 \
    --impls=kernel_bf16,kernel_packed --reps=3 --inner=2 ${OLD_SHAPE:-} \
    --json_out="$OUT/old_attn${OLD_TAG:-}.json")
fi
TAIL=24 run steady "${T_STEADY:-1}" python3 -m experiments.bench_rollout --impls=$I \
  --key_impl=$I --layers=24 --policies=fp4_rtn,fp4_trace --batches="${STEADY_BATCHES:-8,256}" \
  --reps="${REPS_STEADY:-5}" --budget_gb=0 --transformers=false --json_out="$OUT/steady.json"
TAIL=30 run gputest "${T_GPUTEST:-1}" python3 -m pytest -q -x -p no:cacheprovider \
  --durations=10 ${GPUTEST_FILES:-tests/kernels/test_decode_attention.py}
stamp done
