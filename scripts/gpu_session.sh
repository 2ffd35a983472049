#!/usr/bin/env bash
# One H200 session (device tool): QAT gradient checks on GPU, the train-step benchmark, and
# the small_h200 RL comparison. Everything it prints and its result files land in $OUT.
#
# The RL comparison runs the SFT warm start once (deterministic GPU ops, checksum printed, so a
# later call can rebuild the same start), then one process per policy sharing the GPU, each
# running its RL seeds one after the other (the model is small; compiling dominates, compiles
# overlap on the host's cores, and a process compiles its programs once for all its seeds).
# The table is made afterwards from the runs' CSVs (`trace_jax.train.compare.report`), so a
# call cut short by RL_TIMEOUT still reports every step it reached. Throughput figures are
# measured with the GPU shared.
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
POLICIES=${RL_POLICIES:-fp4_trace fp4_trace+r3 fp4_rtn fp4_rollout bf16}
RL="python3 -m experiments.train_rl --config=${RL_CONFIG:-configs/small_h200.py} --workdir=$W \
  --no_progress ${RL_ARGS:-}"
quiet() { grep -v -E "^[IW][0-9]{4} |tpu"; }
mkdir -p /tmp/res
(while sleep 20; do date -u +%T; nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader
 done > /tmp/res/gpu_mem.log 2>&1) &
MEMLOG=$!
stamp "SFT warm start"
timeout "${RL_TIMEOUT:-480}" bash -c "
  XLA_FLAGS=--xla_gpu_deterministic_ops=true $RL --sft_only > /tmp/sft.log 2>&1
  python3 -c 'import sys, hashlib, numpy as np, jax; from trace_jax.io import orbax_ckpt; \
p = orbax_ckpt.load_orbax(sys.argv[1])[1]; h = hashlib.sha256(); \
[h.update(np.asarray(a).tobytes()) for a in jax.tree.leaves(p)]; print(\"sft sha256\", h.hexdigest()[:16])' \
    $W/sft 2>&1 | tail -1 >> $OUT/session.log
  echo \"[\$(date -u +%H:%M:%S)] policies: $POLICIES\" >> $OUT/session.log
  for p in $POLICIES; do
    JAX_LOG_COMPILES=1 $RL --policies=\$p > /tmp/rl_\$p.log 2>&1 &
  done
  wait"
stamp "runs stopped"
kill $MEMLOG 2>/dev/null
# The device tool returns a few files only: the runs' CSVs, histories and logs in one tarball.
for f in /tmp/sft.log /tmp/rl_*.log; do quiet < "$f" | tail -40 > "/tmp/res/$(basename "$f")"; done
for f in /tmp/rl_*.log; do
  grep -o -E "Finished XLA compilation of jit\([a-z_]+\) in [0-9.]+" "$f" \
    > "/tmp/res/compiles_$(basename "$f")"
done
cp "$W/sft_history.json" "$W/posthoc_fp4.json" /tmp/res/ 2>/dev/null
(cd "$W" && find . -path '*/seed*' \( -name '*.csv' -o -name history.json \) -print0 |
  xargs -0 tar cf /tmp/res/runs.tar)
tar czf "$OUT/small_h200.tgz" -C /tmp/res .
stamp done
