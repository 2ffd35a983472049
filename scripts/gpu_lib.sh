# Shared set-up of the one-call GPU scripts (sourced): the carried wheels installed, logging to
# $OUT/session.log, and `run NAME SECONDS COMMAND...` (output to $OUT/NAME.log, its last TAIL
# lines to the session log; SECONDS <= 1 skips the step), and FLAGS_OF, the XLA_FLAGS arms.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:.
log() { tee -a "$OUT/session.log"; }
stamp() { echo "[$(date -u +%H:%M:%S)] $*" | log; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | log
quiet() { grep -v -i -E "warn|^[IW][0-9]{4} "; }
run() {
  local name=$1 secs=$2; shift 2
  if [ "$secs" -le 1 ]; then return; fi
  stamp "$name (limit ${secs}s)"
  timeout -k 5 "$secs" "$@" 2>&1 | quiet > "$OUT/$name.log"
  echo "  exit ${PIPESTATUS[0]}" | log
  tail -n "${TAIL:-8}" "$OUT/$name.log" | log
}
# XLA_FLAGS arms of the flag experiments (gpu_flags.sh, gpu_launch.sh): XLA's defaults; while
# loops and conditionals inside command buffers (+ known-trip-count loops unrolled into them);
# dynamic-slice fusion (a GEMM or custom call reads a slice of a stack in place, no copy);
# command buffers of any size; command buffers as one chain of commands (SERIALIZE: CUDA
# launches a straight-line graph in constant time) or with every independent command
# concurrent (CONCURRENT), against XLA's default (LHS: the latency-hiding scheduler's order).
declare -A FLAGS_OF=(
  [base]=""
  [cbwhile]="--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"
  [cbwhile_unroll]="--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL --xla_gpu_command_buffer_unroll_loops=true"
  [dsf]="--xla_gpu_enable_dynamic_slice_fusion=true"
  [mingraph1]="--xla_gpu_graph_min_graph_size=1"
  [serialize]="--xla_gpu_command_buffer_scheduling_mode=SERIALIZE"
  [concurrent]="--xla_gpu_command_buffer_scheduling_mode=CONCURRENT"
)
