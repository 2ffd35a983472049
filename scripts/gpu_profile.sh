#!/usr/bin/env bash
# One H200 call (device tool, `carry: [".whl"]`): where a decode step's time goes, per policy.
# The site-rounding test on the GPU backend, then bench_rollout at batch 64 (bf16, fp4_rtn,
# fp4_trace) with a per-kernel profile and the optimized HLO of each rollout program
# (`hlo.tgz`), the 24-layer case (compile time) and HF transformers. 1 skips a step.
source "$(dirname "$0")/gpu_lib.sh"
stamp start
run rounding "${T_ROUND:-90}" python3 -m pytest -q -p no:cacheprovider -rf \
  tests/model/test_precision.py -k rounded
XLA_FLAGS="--xla_dump_to=/tmp/hlo --xla_dump_hlo_as_text --xla_dump_hlo_module_re=generate" \
  run rollout8 "${T_R8:-240}" python3 -m experiments.bench_rollout --impls=kernel --batches=64 \
  --policies="${POLICIES:-bf16,fp4_rtn,fp4_trace}" --reps=2 --budget_gb=0 --transformers=false \
  --profile_dir=/tmp/prof --profile_top=60 --json_out="$OUT/rollout8.json"
(cd /tmp/hlo 2>/dev/null && tar czf "$OUT/hlo.tgz" $(ls | grep -E "after_optimizations.txt$" | head -20)) || true
run rollout24 "${T_R24:-200}" python3 -m experiments.bench_rollout --impls=kernel --batches=64 \
  --layers=24 --policies=bf16,fp4_rtn,fp4_trace --reps=1 --budget_gb=0 --transformers=false \
  --json_out="$OUT/rollout24.json"
run transformers "${T_HF:-150}" python3 -m experiments.bench_rollout --impls=kernel --batches=64 \
  --policies=bf16 --reps=1 --budget_gb=0 --transformers=true --json_out="$OUT/rollout_hf.json"
stamp done
