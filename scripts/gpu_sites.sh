#!/usr/bin/env bash
# One H200 call (device tool, `carry: [".whl"]`), 2026-12-03 (third session): the NVFP4 site
# kernel (`kernels/nvfp4_act.py`) bit for bit against `formats` on the GPU (its tests, then
# `bench_quant --sites` at the decode shapes, timed against XLA's quantizers), then
# bench_rollout at batch 64 (the engine's sites on the kernel; fp4_trace's records copied to
# the host while the next batch decodes). 1 skips a step.
source "$(dirname "$0")/gpu_lib.sh"
stamp start
run site_tests "${T_TESTS:-150}" python3 -m pytest -q -p no:cacheprovider -rf -x \
  tests/kernels/test_nvfp4_act.py -k "${TESTS_K:-random or adversarial or control}"
run sites "${T_SITES:-90}" python3 -m experiments.bench_quant --sites --json_out="$OUT/sites.json"
run rollout "${T_ROLLOUT:-220}" python3 -m experiments.bench_rollout --impls=kernel \
  --batches=64 --policies="${POLICIES:-bf16,fp4_rtn,fp4_trace}" --reps=3 --budget_gb=0 \
  --transformers=false --json_out="$OUT/rollout.json"
run rollout24 "${T_R24:-100}" python3 -m experiments.bench_rollout --impls=kernel \
  --batches=64 --layers=24 --policies=fp4_trace --reps=1 --budget_gb=0 --transformers=false \
  --json_out="$OUT/rollout24.json"
stamp done
