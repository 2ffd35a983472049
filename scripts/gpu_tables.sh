#!/usr/bin/env bash
# H200 calls (device tool, `carry: [".whl"]`), 2026-12-04 (eighth session): issue 14's tables
# in one process per depth, on the session's code (records by pinned host copy; the engine's
# weights written one layer at a time by one program): bf16 / fp4_rtn / fp4_trace at batches
# 8, 64 and 256 with IMPL (default kernel+unroll4), each case's engine set-up and weight update
# timed beside its decode. T_L24: 24 layers; T_R24: 24 layers, fp4_rtn and fp4_trace at
# batches 64 and 256 only; T_L8: 8 layers, HF transformers and the 60 GB fixed-memory case.
# T_POOL: the pinned host pool's growth over 8 calls (below). Run as calls 3 (T_L24=530) and
# 5 (T_R24=170 T_L8=330); call 5 ran a variant since reverted (the records' pinned copy made
# on the consumer threads), which slowed fp4_trace only. Each step stops taking new cases
# after its limit minus 90 s (`--budget_s`); a limit of 1 skips it.
source "$(dirname "$0")/gpu_lib.sh"
I="${IMPL:-kernel+unroll4}"
B="python3 -m experiments.bench_rollout --impls=$I --key_impl=$I --budget_impl=$I --batches=${BATCHES:-8,64,256} --reps=${REPS:-2}"
stamp start
L24="${T_L24:-1}" R24="${T_R24:-1}" L8="${T_L8:-1}"
TAIL=40 run l24 "$L24" $B --layers=24 --budget_gb=0 --transformers=false \
  --budget_s="$((L24 - 90))" --json_out="$OUT/l24.json"
TAIL=16 run r24 "$R24" $B --layers=24 --budget_gb=0 --transformers=false \
  --policies=fp4_rtn,fp4_trace --batches=64,256 --budget_s="$((R24 - 90))" \
  --json_out="$OUT/r24.json"
TAIL=60 run l8 "$L8" $B --layers=8 --budget_s="$((L8 - 90))" --json_out="$OUT/l8.json"
# T_POOL (not run yet): does the pinned host pool keep growing? fp4_trace at 24 layers, batch 64,
# 8 timed calls, the records' start call by call, and XLA's BFC log of each pool extension.
if [ "${T_POOL:-1}" -gt 1 ]; then
  stamp "pool (limit ${T_POOL}s)"
  TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=bfc_allocator=1 timeout -k 5 "$T_POOL" $B --layers=24 \
    --policies=fp4_trace --batches=64 --reps=8 --budget_gb=0 --transformers=false \
    --json_out="$OUT/pool.json" > /tmp/pool.txt 2>&1
  echo "  exit $?" | log
  grep -E "tok/s|records:" /tmp/pool.txt | log
  grep -c "Extending allocation" /tmp/pool.txt | sed 's/^/  pool extensions: /' | log
  grep "Extending allocation" /tmp/pool.txt | grep -i host | tail -n 20 | cut -c1-200 | log
fi
stamp done
