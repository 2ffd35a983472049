#!/usr/bin/env bash
# H200 calls (device tool, `carry: [".whl"]`), 2026-12-04 (ninth session): the packed KV
# cache's attention kernels, and where the 60 GB fixed-memory case's decode step goes (issue
# 14: FP4 holds 3.59x the sequences but decoded 0.957x bf16's tokens/s).
# T_TESTS: the packed cache's bit-exactness tests on the GPU (no attention references, which
#   compile slowly on the CPU device); T_ATTN: bench_decode_attention at 8k contexts, the
#   kernel on the packed cache as the engine holds it (codes as words) beside the bytes'
#   bits decoder and the BF16 cache (call 2 ran the bytes' table decoder, since removed); T_PROF: the fixed-memory case (bf16, fp4_rtn), timed and
#   profiled per generated token; T_NCU (off by default): ncu of the decode-attention kernels
#   per NCU_POLICIES budget case; T_STEADY (below); T_POOL: gpu_tables.sh's pinned-pool step.
# Call 1 ran T_PROF=190 T_NCU=80 T_POOL=150 on the bytes layout: the profile came back, ncu
# held the call until the 600 s limit (timeout's SIGTERM did not stop it: use -k). Call 6 also
# ran a T_ORDER step (the 60 GB case with `decode_attention.WORDS_ORDER` set to mma or natural,
# a module switch since removed: natural was no faster; `kernel_packed_natural` here compares
# the orders at the kernel).
source "$(dirname "$0")/gpu_lib.sh"
I="${IMPL:-kernel+unroll4}"
N="${PROF_NEW:-128}"
BUD="python3 -m experiments.bench_rollout --impls=$I --key_impl=$I --budget_impl=$I --cases=none --transformers=false --budget_gb=60"
stamp start
TAIL=12 run tests "${T_TESTS:-120}" python3 -m pytest -q -x -p no:cacheprovider \
  tests/kernels/test_decode_attention.py -k "bit_equal or every_code or pack_rows"
TAIL=30 run attn "${T_ATTN:-150}" python3 -m experiments.bench_decode_attention \
  --contexts="${ATTN_CONTEXTS:-8192}" --batches="${ATTN_BATCHES:-64,256}" \
  --impls="${ATTN_IMPLS:-kernel_bf16,kernel_packed,kernel_packed_natural,kernel_packed_bits}" --reps=10 --inner=4 \
  --json_out="$OUT/attn.json"
# T_SWEEP: the packed kernels' tiles (block_t:num_warps:num_stages per SWEEP entry), one
# process each, kernel_packed beside kernel_bf16 at one batch and context.
for C in ${SWEEP:-}; do
  [ "${T_SWEEP:-1}" -gt 1 ] || break
  IFS=: read -r BT NW NS <<< "$C"
  TAIL=4 run "sweep_${BT}_${NW}_${NS}" "$T_SWEEP" python3 -m experiments.bench_decode_attention \
    --contexts="${ATTN_CONTEXTS:-8192}" --batches="${SWEEP_BATCH:-256}" \
    --impls="${SWEEP_IMPLS:-kernel_bf16,kernel_packed}" --reps=10 --inner=4 --block_t="$BT" \
    --num_warps="$NW" --num_stages="$NS" --json_out="/tmp/sweep_${BT}_${NW}_${NS}.json"
done
TAIL=70 run prof "${T_PROF:-150}" $BUD --budget_policies="${PROF_POLICIES:-bf16,fp4_rtn}" \
  --new_tokens="$N" --reps=2 --profile_dir=/tmp/prof_kv --profile_top=12 \
  --json_out="$OUT/prof.json"
for P in ${NCU_POLICIES:-fp4_rtn bf16}; do
  [ "${T_NCU:-1}" -gt 1 ] || break
  TAIL=30 run "ncu_$P" "${T_NCU}" timeout -k 5 "$((T_NCU - 10))" ncu --clock-control none \
    --kernel-name regex:"${NCU_KERNELS:-decode_attention}" --launch-skip "${NCU_SKIP:-16}" \
    --launch-count "${NCU_COUNT:-4}" --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__registers_per_thread,launch__grid_size,launch__block_size,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active,sm__throughput.avg.pct_of_peak_sustained_elapsed \
    $BUD --budget_policies="$P" --new_tokens=4 --reps=1 --budget_max_batch="${NCU_BATCH:-512}"
done
# T_STEADY: fp4_rtn and fp4_trace at 24 layers, batch 64, REPS_STEADY timed calls (call 2's
# pool step: XLA's pinned host pool grows over the first two calls only).
TAIL=20 run steady "${T_STEADY:-1}" python3 -m experiments.bench_rollout --impls=$I --key_impl=$I \
  --layers=24 --policies=fp4_rtn,fp4_trace --batches=64 --reps="${REPS_STEADY:-5}" \
  --budget_gb=0 --transformers=false --json_out="$OUT/steady.json"
T_L24=1 T_R24=1 T_L8=1 T_POOL="${T_POOL:-150}" bash "$(dirname "$0")/gpu_tables.sh"
stamp done
