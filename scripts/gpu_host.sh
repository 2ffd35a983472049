#!/usr/bin/env bash
# One H200 call (device tool, `carry: [".whl"]`), 2026-12-04 (seventh session): what the host
# does between two decode steps. fp4_rtn and fp4_trace run the same kernels (busy 2.24 vs
# 2.27 ms per step, 2026-12-04 profile) but fp4_trace's device waits 0.3-0.7 ms more per step
# before the loop body's command buffer starts. Steps (limit 1 skips one):
#  T_PROF  profiles at IMPL (default kernel+unroll4) with command buffers on, listing the host
#          events per step (runtime annotations, CUDA calls), records drained as in a rollout;
#  T_EACH  the same cases timed with every call's records drained before the next call
#          (--records_drain=each): does the records' copy to the host slow the next decode?
#  T_VLOG  XLA's command-buffer and while-loop logs (TF_CPP_VMODULE) of one call of each
#          policy, as message templates with counts: is the body's command buffer updated or
#          re-recorded every step?
source "$(dirname "$0")/gpu_lib.sh"
B="python3 -m experiments.bench_rollout --impls=${IMPL:-kernel+unroll4} --key_impl=${IMPL:-kernel+unroll4} --batches=64 --budget_gb=0 --transformers=false"
P="${POLICIES:-fp4_rtn,fp4_trace}" T_VLOG="${T_VLOG:-150}"
stamp start
XLA_FLAGS="--xla_enable_command_buffers_during_profiling=true" TAIL=60 run prof "${T_PROF:-150}" \
  $B --policies="$P" --reps=3 --profile_dir=/tmp/prof_host --profile_top=12 \
  --json_out="$OUT/prof.json"
TAIL=12 run each "${T_EACH:-100}" $B --policies="$P" --reps=3 --records_drain=each \
  --json_out="$OUT/each.json"
if [ "$T_VLOG" -gt 1 ]; then
  for policy in ${P//,/ }; do
    stamp "vlog $policy"
    TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE="${VMODULE:-command_buffer_thunk=3,command_buffer_cmd=2,command_executor=2,gpu_command_buffer=2,cuda_command_buffer=2,while_thunk=2}" \
      timeout "$((T_VLOG / 2))" $B --policies="$policy" --reps=1 > /tmp/vlog_$policy.txt 2>&1
    echo "  exit $?, $(wc -l < /tmp/vlog_$policy.txt) lines" | log
    # Message templates (numbers and addresses blanked) by count: 128 decode steps per call.
    sed -E 's/^[IWE][0-9]{4} [0-9:.]+ +[0-9]+ //; s/0x[0-9a-f]+/X/g; s/[0-9]+/N/g' \
      /tmp/vlog_$policy.txt | sort | uniq -c | sort -rn | head -n 45 | cut -c1-240 \
      > "$OUT/vlog_$policy.txt"
    head -n 25 "$OUT/vlog_$policy.txt" | log
  done
fi
ls -la "$OUT" | log
stamp done
