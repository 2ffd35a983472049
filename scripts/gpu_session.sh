#!/usr/bin/env bash
# One H200 session (device tool): QAT gradient checks on GPU, the train-step benchmark, and
# the small_h200 RL comparison. Everything it prints and its result files land in $OUT.
#
# The RL comparison runs the SFT warm start once, then the three policies as three processes
# sharing the GPU (the model is small; compiling dominates, and compiles overlap on the host's
# cores), then one more train_rl call that only reads the finished runs and writes the
# summary, table and plot. Throughput figures are therefore measured with the GPU shared.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TRACE_TORCH_DEVICE=cuda
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:.
log() { tee -a "$OUT/session.log"; }
stamp() { echo "[$(date -u +%H:%M:%S)] $*" | log; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | log
stamp start
if [ -z "${SKIP_PYTEST:-}" ]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/quant/test_qat.py 2>&1 | tail -3 | log
fi
if [ "${BENCH_TIMEOUT:-400}" -gt 1 ]; then
  timeout "${BENCH_TIMEOUT:-400}" python3 -m experiments.bench_train_step --preset=bench_gpu \
    --steps=10 ${BENCH_ARGS:---moe_impls=ragged_dot,tiled --policies=bf16,fp4_rtn,fp4_trace} \
    2>&1 | grep -v -i warn | tail -8 | log
fi
if [ "${RL_TIMEOUT:-480}" -le 1 ]; then stamp done; exit 0; fi  # RL_TIMEOUT=1 skips the RL run
W=${RL_WORKDIR:-/tmp/small_h200}
RL="python3 -m experiments.train_rl --config=${RL_CONFIG:-configs/small_h200.py} --workdir=$W \
  --no_progress ${RL_ARGS:-}"
quiet() { grep -v -E "^[IW][0-9]{4} |tpu"; }
mkdir -p /tmp/res
(while sleep 20; do date -u +%T; nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader
 done > /tmp/res/gpu_mem.log 2>&1) &
MEMLOG=$!
stamp "SFT warm start"
timeout "${RL_TIMEOUT:-480}" bash -c "
  $RL --sft_only > /tmp/sft.log 2>&1
  echo \"[\$(date -u +%H:%M:%S)] policies\" >> $OUT/session.log
  for p in ${RL_POLICIES:-fp4_trace fp4_rtn bf16}; do
    JAX_LOG_COMPILES=1 JAX_EXPLAIN_CACHE_MISSES=1 $RL --policies=\$p > /tmp/rl_\$p.log 2>&1 &
  done
  wait"
stamp "summary"
timeout 60 $RL --policies=$(echo ${RL_POLICIES:-fp4_trace fp4_rtn bf16} | tr " " ,) 2>&1 | quiet | tail -6 | log
stamp done
kill $MEMLOG 2>/dev/null
# The device tool returns a few files only: everything but session.log goes in one tarball.
for f in /tmp/sft.log /tmp/rl_*.log; do quiet < "$f" | tail -40 > "/tmp/res/$(basename "$f")"; done
# Which big programs compiled, how often, and why (the GRPO step compiled twice on the H200).
for f in /tmp/rl_*.log; do
  { grep -E "(Compiling|compilation of) jit\((grpo_step|_generate)\)" "$f"
    grep -E -A14 "CACHE MISS at .*(run_rl|_generate_batch)" "$f" | cut -c1-300
  } > "/tmp/res/compiles_$(basename "$f")"
done
cp "$W/summary.json" "$W/sft_history.json" "$W/reward_mismatch.png" /tmp/res/ 2>/dev/null
for p in bf16 fp4_rtn fp4_trace; do
  cp "$W/$p/metrics.csv" "/tmp/res/$p.csv" 2>/dev/null
  cp "$W/$p/evals.csv" "/tmp/res/${p}_evals.csv" 2>/dev/null
  cp "$W/$p/history.json" "/tmp/res/${p}_history.json" 2>/dev/null
done
tar czf "$OUT/small_h200.tgz" -C /tmp/res .
