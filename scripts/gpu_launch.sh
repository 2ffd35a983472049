#!/usr/bin/env bash
# One H200 call (device tool, `carry: [".whl"]`), written 2026-12-03 (sixth session), not run
# yet: how does the host launch a decode step? Profiles of fp4_rtn and fp4_trace at batch 64
# (IMPL, default kernel+unroll4) with command buffers on while profiling, one process per
# XLA_FLAGS arm (ARMS, default "base dsf": XLA's defaults; dynamic-slice fusion, which lets a
# GEMM or custom call read a slice of the stacked layer params in place instead of a copy;
# also cbwhile: while loops in command buffers; mingraph1: command buffers of any size), each
# summary listing the host's CUDA driver calls per step (`cuLaunchKernel*`: kernels launched
# one by one, e.g. Pallas calls left out of the CUDA graphs; `cuGraphLaunch`: command
# buffers). Then the same arms timed without the profiler (T_ARM). Then (T_DUMP) XLA's optimized
# HLO of fp4_trace's programs at IMPL, as $OUT/hlo_dump.tgz: what the 8-12 `memcpy32_post`
# copies per layer-scan iteration are (copy insertion around the loop carry, or the router's
# param slice?) and which calls sit inside command buffers. A limit of 1 skips a step.
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
