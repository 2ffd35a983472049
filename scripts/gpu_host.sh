#!/usr/bin/env bash
# One H200 call (device tool, `carry: [".whl"]`), 2026-12-04 (seventh session): fp4_trace's
# host-side costs. Profiles of 2026-12-04 found fp4_rtn and fp4_trace running the same kernels
# per decode step (busy 2.24 vs 2.27 ms) and two host costs on fp4_trace alone: the engine's
# caller held back 15-25 ms after every generate call while a background thread copied the
# records to the host (jax.device_get: a staged copy holding the GIL per array; now
# `guidance_layout.start_host_copy`, pinned host memory), and with 4 layers per scan iteration
# each guided run is one iteration, so the whole decode step is one CUDA graph whose launch the
# device waits for every step. Steps (a limit of 1 skips one):
#  T_TIMED  bf16 / fp4_rtn / fp4_trace at IMPLS side by side, records in flight during the
#           next call as in a rollout loop (`generate calls alone` per case);
#  T_EACH   fp4_rtn / fp4_trace with every call's records drained before the next call;
#  T_PROF   profiles (command buffers on) with the host events per step and a timeline
#           around the TIMELINE anchor;
#  T_VLOG   XLA's command-buffer and while-loop logs (TF_CPP_VMODULE), as message templates
#           with counts, one call per policy.
source "$(dirname "$0")/gpu_lib.sh"
B="python3 -m experiments.bench_rollout --batches=64 --budget_gb=0 --transformers=false"
P="${POLICIES:-fp4_rtn,fp4_trace}" T_VLOG="${T_VLOG:-1}"
U4="--impls=kernel+unroll4 --key_impl=kernel+unroll4"
stamp start
TAIL=30 run timed "${T_TIMED:-260}" $B --impls="${IMPLS:-kernel,kernel+unroll2,kernel+unroll4}" \
  --key_impl=kernel+unroll4 --policies=bf16,fp4_rtn,fp4_trace --reps="${REPS:-5}" \
  --json_out="$OUT/timed.json"
TAIL=12 run each "${T_EACH:-110}" $B $U4 --policies="$P" --reps="${REPS:-5}" \
  --records_drain=each --json_out="$OUT/each.json"
XLA_FLAGS="--xla_enable_command_buffers_during_profiling=true" TAIL=40 run prof "${T_PROF:-150}" \
  $B $U4 --policies="$P" --reps=3 --profile_dir=/tmp/prof_host --profile_top=16 \
  --profile_timeline="${TIMELINE:-cuGraphLaunch:40}" --json_out="$OUT/prof.json"
if [ "$T_VLOG" -gt 1 ]; then
  for policy in ${P//,/ }; do
    stamp "vlog $policy"
    TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE="${VMODULE:-command_buffer_thunk=3,command_buffer_cmd=2,command_executor=2,gpu_command_buffer=2,cuda_command_buffer=2,while_thunk=2}" \
      timeout "$((T_VLOG / 2))" $B $U4 --policies="$policy" --reps=1 > /tmp/vlog_$policy.txt 2>&1
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
