#!/usr/bin/env bash
# One H200 session (device tool): QAT gradient checks on GPU, the train-step benchmark, and
# the small_h200 RL comparison. Everything it prints and its result files land in $OUT.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TRACE_TORCH_DEVICE=cuda
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/session.log"
date -u | tee -a "$OUT/session.log"
if [ -z "${SKIP_PYTEST:-}" ]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/quant/test_qat.py 2>&1 | tail -3 \
    | tee -a "$OUT/session.log"
fi
timeout "${BENCH_TIMEOUT:-200}" python3 -m experiments.bench_train_step --preset=bench_gpu \
  --steps=10 ${BENCH_ARGS:-} 2>&1 | grep -v -i warn | tail -8 | tee -a "$OUT/session.log"
timeout "${RL_TIMEOUT:-330}" python3 -m experiments.train_rl --config=configs/small_h200.py \
  --workdir=/tmp/small_h200 --no_progress 2>&1 | grep -v -E "^I1|^W1|tpu" | tail -8 \
  | tee -a "$OUT/session.log"
cp /tmp/small_h200/summary.json "$OUT/small_h200_summary.json" 2>/dev/null
cp /tmp/small_h200/reward_mismatch.png "$OUT/small_h200_reward_mismatch.png" 2>/dev/null
for p in bf16 fp4_rtn fp4_trace; do
  cp "/tmp/small_h200/$p/metrics.csv" "$OUT/small_h200_$p.csv" 2>/dev/null
done
