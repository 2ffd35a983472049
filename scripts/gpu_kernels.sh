#!/usr/bin/env bash
# One H200 call (device tool, `carry: [".whl"]`, timeout_s 600): the Pallas kernels' tests on
# the GPU (Triton lowering, interpret=False), the MXFP4 guided-rounding tests on the GPU, and
# the kernels' benchmarks. Logs and JSON land in $OUT; each step has its own time limit, so a
# slow step cuts only itself (T_TESTS, T_MOE, T_ATTN seconds; 1 skips a step).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:.
log() { tee -a "$OUT/session.log"; }
stamp() { echo "[$(date -u +%H:%M:%S)] $*" | log; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | log
quiet() { grep -v -i -E "warn|^[IW][0-9]{4} "; }
run() {  # run NAME SECONDS COMMAND...: output to $OUT/NAME.log, its tail to the session log
  local name=$1 secs=$2; shift 2
  if [ "$secs" -le 1 ]; then return; fi
  stamp "$name (limit ${secs}s)"
  timeout "$secs" "$@" 2>&1 | quiet > "$OUT/$name.log"
  echo "  exit ${PIPESTATUS[0]}" | log
  tail -n "${TAIL:-6}" "$OUT/$name.log" | log
}
stamp start
run kernel_tests "${T_TESTS:-200}" python3 -m pytest -q -p no:cacheprovider -rf \
  tests/kernels tests/quant/test_guided_mxfp4.py
run bench_moe_e64 "${T_MOE:-170}" python3 -m experiments.bench_moe_decode --experts=64 \
  --json_out="$OUT/bench_moe_decode_e64.json"
run bench_moe_e128 "${T_MOE:-170}" python3 -m experiments.bench_moe_decode --experts=128 \
  --json_out="$OUT/bench_moe_decode_e128.json"
run bench_attn "${T_ATTN:-150}" python3 -m experiments.bench_decode_attention \
  --json_out="$OUT/bench_decode_attention.json"
stamp done
