#!/usr/bin/env bash
# H200 call (device tool, `carry: [".whl"]`), 2026-12-04 (ninth session): where the 60 GB
# fixed-memory case's decode step goes (issue 14: FP4 holds 3.59x the sequences but decodes
# 0.957x bf16's tokens/s). T_PROF: bf16 and fp4_rtn at 8k-token caches, profiled per generated
# token (PROF_NEW new tokens); T_NCU: ncu of the decode-attention kernels of each NCU_POLICIES budget
# case, one process each (time, DRAM bytes and throughput, instructions, registers); T_POOL: gpu_tables.sh's
# pinned-pool step. A limit of 1 skips a step.
source "$(dirname "$0")/gpu_lib.sh"
I="${IMPL:-kernel+unroll4}"
N="${PROF_NEW:-32}"
BUD="python3 -m experiments.bench_rollout --impls=$I --key_impl=$I --budget_impl=$I --cases=none --transformers=false --budget_gb=60"
stamp start
TAIL=70 run prof "${T_PROF:-200}" $BUD --budget_policies="${PROF_POLICIES:-bf16,fp4_rtn}" \
  --new_tokens="$N" --reps=1 --profile_dir=/tmp/prof_kv --profile_top=20 \
  --json_out="$OUT/prof.json"
for P in ${NCU_POLICIES:-fp4_rtn bf16}; do
  TAIL=30 run "ncu_$P" "${T_NCU:-75}" ncu --clock-control none \
    --kernel-name regex:"${NCU_KERNELS:-decode_attention}" --launch-skip "${NCU_SKIP:-16}" \
    --launch-count "${NCU_COUNT:-4}" --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__registers_per_thread,launch__grid_size,launch__block_size,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active,sm__throughput.avg.pct_of_peak_sustained_elapsed \
    $BUD --budget_policies="$P" --new_tokens=4 --reps=1 --budget_max_batch="${NCU_BATCH:-512}"
done
T_L24=1 T_R24=1 T_L8=1 T_POOL="${T_POOL:-150}" bash "$(dirname "$0")/gpu_tables.sh"
stamp done
