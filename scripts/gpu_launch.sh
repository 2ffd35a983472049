#!/usr/bin/env bash
# One H200 call (device tool, `carry: [".whl"]`), written 2026-12-03 (sixth session), run
# 2026-12-04 (seventh; docs/benchmarks.md): how does the host launch a decode step? Profiles of
# PROF_POLICIES (default fp4_rtn, fp4_trace) at batch 64 (IMPL, default kernel+unroll4) with
# command buffers on while profiling, one process per XLA_FLAGS arm of gpu_lib.sh's FLAGS_OF
# (ARMS, default "base dsf"), PROF_REPS timed calls each, every summary listing the host's
# events per step (`command_buffer::execute`, `cuGraphLaunch (CudaGraph:N)`, ...). Then the
# same arms timed without the profiler (T_ARM). Then (T_DUMP) XLA's optimized HLO and thunk
# sequence of fp4_trace's programs at IMPL, as $OUT/hlo_dump.tgz (which kernels and copies
# sit in which command buffer). A limit of 1 skips a step.
source "$(dirname "$0")/gpu_lib.sh"
B="python3 -m experiments.bench_rollout --impls=${IMPL:-kernel+unroll4} --key_impl=${IMPL:-kernel+unroll4} --batches=64 --budget_gb=0 --transformers=false"
stamp start
for arm in ${ARMS:-base dsf}; do
  XLA_FLAGS="--xla_enable_command_buffers_during_profiling=true ${FLAGS_OF[$arm]}" \
    TAIL=40 run "launch_$arm" "${T_PROF:-130}" $B --policies="${PROF_POLICIES:-fp4_rtn,fp4_trace}" \
    --reps="${PROF_REPS:-1}" --profile_dir="/tmp/prof_$arm" --profile_top=16 \
    --json_out="$OUT/launch_$arm.json"
done
for arm in ${ARMS:-base dsf}; do
  XLA_FLAGS="${FLAGS_OF[$arm]}" run "timed_$arm" "${T_ARM:-1}" $B \
    --policies="${POLICIES:-bf16,fp4_rtn,fp4_trace}" --reps="${REPS:-3}" \
    --json_out="$OUT/timed_$arm.json"
done
XLA_FLAGS="--xla_dump_to=/tmp/hlo_dump --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*generate.*" \
  run dump "${T_DUMP:-1}" $B \
  --policies=fp4_trace --reps=1
if [ "${T_DUMP:-1}" -gt 1 ]; then
  (cd /tmp/hlo_dump && ls -S | head -n 30 &&
   tar -czf "$OUT/hlo_dump.tgz" $(ls | grep -E "after_optimizations(-buffer-assignment)?\.txt$|thunk" |
     grep -i -E "generate|extend|decode" | head -n 12)) 2>&1 | log
fi
# The device tool returns at most 8 files: past that, everything but the session log and the
# dump goes into one tarball.
if [ "$(ls "$OUT" | wc -l)" -gt 8 ]; then
  (cd "$OUT" && tar -czf results.tgz $(ls | grep -v -E "^(session\.log|hlo_dump\.tgz)$") &&
   ls | grep -v -E "^(session\.log|hlo_dump\.tgz|results\.tgz)$" | xargs rm -f)
fi
ls -la "$OUT" | log
stamp done
