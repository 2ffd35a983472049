#!/usr/bin/env bash
# The GPU runbook: named steps for the device machine, each one function writing its logs and
# JSON under $OUT. `bash scripts/gpu_runbook.sh STEP...` runs the steps in the order given
# (no step: `check`); carry the wheels the image lacks (`carry: [".whl"]`, see WORKSPACE.md).
#
# Steps:
#   check       bit-exactness on the GPU (`experiments.bench.gpu_check`: the quantizers' tests
#               on the device, exhaustive on-GPU checks, the quantizer benchmark)
#   kernels     the kernels' tests on the GPU (Triton and Mosaic GPU; the wgmma cases run only
#               there), then the decode experts' and the decode attention's benchmarks
#   rollout     the engine's decode on the kernels: BF16 vs FP4 policies at batch 64 (context
#               128 + 128), the 60 GB fixed-memory cases at 8k and 32k contexts (36 GB on a
#               GPU of less than 100 GB), and batch 64 at 32k context
#               (`experiments.bench.rollout`'s GPU preset)
#   attention   the decode attention without scores in memory (one pass, online softmax:
#               `decode_attention="fused"`, the plan's; `kernels.wgmma_flash` over the packed
#               cache, impl "wgmma_fused") against the exact pair (Triton, wgmma): the kernels
#               at 8k (batch 64 and 256) and 32k (batch 16 and 64: the wgmma PV's key splits
#               against one split) contexts (and the Triton single pass with 128-key blocks)
#   attention_ncu  what bounds the single pass over the packed cache: Nsight Compute over
#               `kernels.wgmma_flash` at 64 x 32k (throughput, memory, warp stalls, occupancy;
#               `experiments.bench.ncu`)
#   attention_budget  the 8k fixed-memory decode (bf16, fp4_rtn) with the plan's decode
#               attention (the single pass: Triton's over BF16, wgmma's over FP4), the wgmma
#               pair and the Triton pair, one process per impl
#   kv_write    the k/v sites written into the packed KV cache by one kernel
#               (`kv_write="kernel"`, `kernels.kv_append`, the plan's on Hopper): its tests on
#               the GPU (bit for bit against the site kernel and XLA's scatters), then the
#               decode at batch 64 and 256 (128 + 128, 8 layers; fp4_rtn, fp4_trace) with it
#               and with the site kernel and XLA's scatters (`+kvxla`), side by side in one
#               process, profiled (kernels and time per step)
#   command_buffers  the fixed-batch decode (batch 64, 128 + 128, 8 layers; bf16, fp4_rtn,
#               fp4_trace) under XLA's default command buffers (CUDA graphs) and with the decode's
#               while loop and conditionals captured as well (`--xla_gpu_enable_command_buffer`
#               with WHILE and CONDITIONAL: no host round trip for the loop's predicate), one
#               process each
#   mismatch    the rollout/trainer mismatch of the kernel plan against the reference plan
#               (`experiments.measure_mismatch`; fp4_trace's |dlogp| ratio), then the kernel
#               plan with the exact pair's decode attention over the packed cache instead of
#               the single pass (`--plan_fields=decode_attention=wgmma`)
#   excess_precision  XLA's excess precision (`--xla_allow_excess_precision`, on by default) off:
#               the kernel plan's rollout/trainer mismatch with every forward's layers scanned
#               (with and without the flag) and unrolled (with it; on CPU the flag halved
#               fp4_rtn's |dlogp|), then the BF16 train step scanned and unrolled under it
#               (what it costs in speed)
#   train_step  the training step at Qwen3 layer width, 4 layers, on the plan's kernels (grouped
#               GEMMs `moe_impl="mgpu"`, cuDNN's attention, wgmma FP8 GEMMs, the layer loop):
#               bf16, fp8_unified, fp8_unified+fp8bwd, fp4_trace, fp4_rtn (the JSON's headline
#               keys), and +fp8bwd with its backward's operands laid out by XLA
#               (`fp8_bwd_operands=xla`, the plan's alternative to the layout kernels)
#   train_step_12  the same at 12 layers (bf16, the FP8 policies, fp4_trace; the FP8
#               backward's compile alone takes minutes)
#   train_step_variants  4 layers, what the plan chooses against its alternatives: cuDNN's
#               attention against XLA's, the FP8 step on Triton's GEMMs (`@kernel`), fp4_trace's
#               fake quantizers on XLA (`fake_quant=xla`), the BF16 step scanned
#   fp8_layouts the FP8 backward's operand layouts (the experts' WGrad tiles, the DGrad's
#               transposed weight codes) by XLA and by `kernels.fp8_tiles` at each launch config,
#               bit-checked, with the fraction of the copy bandwidth
#   rl          the RL loop (`experiments.train_rl`, RL_CONFIG, default configs/small_h200.py)
#               with the config's kernel plan, one process per policy (RL_POLICIES), sharing
#               the GPU (RL_SEQUENTIAL=1: one after another, each policy's tokens/s its own);
#               its summary, CSVs and plot in rl.tar.gz (RL_ARGS: every process's extra
#               arguments; RL_SFT_ARGS, where set, the SFT warm start's instead)
#   profile     where the device time goes: the train step (bf16, fp8_unified, +fp8bwd) and the 8k
#               fixed-memory decode (bf16, fp4_rtn), per kernel and category; the train step's
#               kernels traced to our source lines (`experiments.bench.hlo_sources`)
#   multi_gpu   expert parallelism on a multi-GPU kind: its tests, then 1 vs 2 GPUs
#   tests       the test suite's GPU-marked and kernel files on the GPU (no `-x`; more than one
#               call's 10 minutes on an H100: TESTS_SHARD=i/n runs every n-th file from the i-th)
#
# Every step has a time limit in seconds (T_<STEP>, e.g. T_ROLLOUT=300; 0 or 1 skips it) and
# takes extra arguments from <STEP>_ARGS (e.g. ROLLOUT_ARGS="--layers=24"). The kernel plan of
# every run is its config's (`ModelConfig.plan`, "auto": the kernels on Hopper); a step that
# compares plans says so. tests/scripts/test_gpu_runbook.py checks the script on CPU (every
# step runs through under `set -u` with its commands stubbed).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false

log() { tee -a "$OUT/runbook.log"; }
stamp() { echo "[$(date -u +%H:%M:%S)] $*" | log; }

setup() {
  if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  fi
  export PYTHONPATH=/tmp/site:.
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | log
  fi
}

# run NAME SECONDS CMD...: CMD's output to $OUT/NAME.log (its last TAIL lines to the runbook
# log), stopped after SECONDS (`timeout -k 5`: a plain timeout did not stop ncu once).
run() {
  local name=$1 secs=$2
  shift 2
  if [ "$secs" -le 1 ]; then
    stamp "$name skipped"
    return 0
  fi
  stamp "$name (limit ${secs}s)"
  timeout -k 5 "$secs" "$@" > "$OUT/$name.log" 2>&1
  echo "  exit $?" | log
  tail -n "${TAIL:-8}" "$OUT/$name.log" | log
}

step_check() {
  run check "${T_CHECK:-300}" python3 -m experiments.bench.gpu_check --out="$OUT/check" \
    ${CHECK_ARGS:-}
}

step_kernels() {
  local t=${T_KERNELS:-540}
  TAIL=20 run kernel_tests "$((t / 2))" python3 -m pytest -q -p no:cacheprovider -rf \
    tests/kernels
  run moe_decode "$((t / 4))" python3 -m experiments.bench.moe_decode --experts=64 \
    --json_out="$OUT/moe_decode.json" ${KERNELS_ARGS:-}
  run decode_attention "$((t / 4))" python3 -m experiments.bench.decode_attention \
    --json_out="$OUT/decode_attention.json"
}

# The GPU's memory in MiB (0 where nvidia-smi is missing).
gpu_mib() {
  nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1 || echo 0
}

# Smaller cases on a GPU of less than 100 GB (an H100's 80): the preset's 60 GB budget ran out
# of its memory when bf16's keys were made, and the 12-layer train step asked for a 42 GiB buffer.
small_gpu() { local mib; mib=$(gpu_mib); [ "${mib:-0}" -gt 0 ] && [ "$mib" -lt 100000 ]; }

step_rollout() {
  local t=${T_ROLLOUT:-540} budget=()
  small_gpu && budget=(--budget_gb=36)
  TAIL=40 run rollout "$t" python3 -m experiments.bench.rollout --impls=kernel+unroll4 \
    --key_impl=kernel+unroll4 --budget_impl=kernel+unroll4 --batches=64 --reps=3 \
    --transformers=false --budget_s="$((t - 90))" --json_out="$OUT/rollout.json" \
    ${budget[@]+"${budget[@]}"} ${ROLLOUT_ARGS:-}
}

step_attention() {
  local t=${T_ATTENTION:-420}
  local impls=kernel_bf16,kernel_packed,kernel_packed_wgmma,kernel_bf16_fused,kernel_packed_fused
  impls+=,kernel_packed_wgmma_fused
  TAIL=30 run attention_kernels "$((t * 4 / 9))" python3 -m experiments.bench.decode_attention \
    --contexts=8192 --batches=64,256 --decoder_check=false --impls="$impls" \
    --json_out="$OUT/attention_kernels.json"
  TAIL=20 run attention_kernels_32k "$((t / 3))" python3 -m experiments.bench.decode_attention \
    --contexts=32768 --batches=16,64 --decoder_check=false \
    --impls="$impls" --pv_splits=1 \
    --json_out="$OUT/attention_kernels_32k.json"
  TAIL=12 run attention_kernels_bt128 "$((t * 2 / 9))" python3 -m \
    experiments.bench.decode_attention --contexts=8192 --batches=256 --decoder_check=false \
    --block_t=128 --impls=kernel_bf16_fused,kernel_packed_fused \
    --json_out="$OUT/attention_kernels_bt128.json"
}

step_attention_ncu() {
  local t=${T_ATTENTION_NCU:-240}
  TAIL=120 run attention_ncu "$((t + 15))" python3 -m experiments.bench.ncu --kernel=wgmma_flash \
    --seconds="$t" -- python3 -m experiments.bench.decode_attention --contexts=32768 \
    --batches=64 --decoder_check=false --impls=kernel_packed_wgmma_fused --reps=1 --warmup=1 \
    --inner=1 --json_out= ${ATTENTION_NCU_ARGS:-}
}

step_attention_budget() {
  local t=${T_ATTENTION_BUDGET:-540} budget=(--budget_gb=60) impl name
  small_gpu && budget=(--budget_gb=36)
  for impl in kernel+unroll4 kernel+unroll4+attnwgmma kernel+unroll4+attntriton; do
    name=attention_budget_${impl##*+}
    TAIL=20 run "$name" "$((t / 3))" python3 -m experiments.bench.rollout --impls="$impl" \
      --budget_impl="$impl" --cases=none --budget_context=8192 --budget_policies=bf16,fp4_rtn \
      --long_context=0 --reps=2 --transformers=false "${budget[@]}" --json_out="$OUT/$name.json"
  done
}

step_kv_write() {
  local t=${T_KV_WRITE:-420}
  TAIL=12 run kv_write_tests "$((t / 4))" python3 -m pytest -q -p no:cacheprovider -rf \
    tests/kernels/test_kv_append.py tests/kernels/test_nvfp4_act.py
  TAIL=40 run kv_write_rollout "$((t * 3 / 4))" python3 -m experiments.bench.rollout \
    --impls=kernel+unroll4+kvxla,kernel+unroll4 --key_impl=kernel+unroll4 \
    --policies=fp4_rtn,fp4_trace --batches=64,256 --reps=3 --budget_gb=0 --long_context=0 \
    --transformers=false --budget_s="$((t * 3 / 4 - 90))" --profile_dir=/tmp/profile_kv_write \
    --json_out="$OUT/kv_write_rollout.json" ${KV_WRITE_ARGS:-}
}

COMMAND_BUFFER_TYPES=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL

step_command_buffers() {
  local t=${T_COMMAND_BUFFERS:-420} xla=${XLA_FLAGS:-} tag flags
  for tag in default while; do
    flags=$xla
    [ "$tag" = while ] && flags+=" --xla_gpu_enable_command_buffer=$COMMAND_BUFFER_TYPES"
    XLA_FLAGS="$flags" TAIL=20 run "command_buffers_$tag" "$((t / 2))" python3 -m \
      experiments.bench.rollout --impls=kernel+unroll4 --key_impl=kernel+unroll4 \
      --policies=bf16,fp4_rtn,fp4_trace --batches=64 --reps=3 --budget_gb=0 --long_context=0 \
      --transformers=false --json_out="$OUT/command_buffers_$tag.json" ${COMMAND_BUFFERS_ARGS:-}
  done
}

step_mismatch() {
  local t=${T_MISMATCH:-420}
  TAIL=20 run mismatch "$((t * 2 / 3))" python3 -m experiments.measure_mismatch \
    --config=configs/small_h200.py --decode_impls=xla,kernel --num_prompts=64 \
    --max_new_tokens=64 --json_out="$OUT/mismatch.json" ${MISMATCH_ARGS:-}
  TAIL=12 run mismatch_pair "$((t / 3))" python3 -m experiments.measure_mismatch \
    --config=configs/small_h200.py --decode_impls=kernel --num_prompts=64 \
    --max_new_tokens=64 --plan_fields=decode_attention=wgmma \
    --json_out="$OUT/mismatch_pair.json" --png_out=/tmp/mismatch_pair.png ${MISMATCH_ARGS:-}
}

step_excess_precision() {
  local t=${T_EXCESS_PRECISION:-560} v layers tag flags part
  for v in scan:default::6 scan:noexcess:--xla_allow_excess_precision=false:6 \
           unrolled:noexcess:--xla_allow_excess_precision=false:3; do
    IFS=: read -r layers tag flags part <<< "$v"
    XLA_FLAGS="$flags" TAIL=6 run "excess_${tag}_$layers" "$((t / part))" python3 -m \
      experiments.measure_mismatch --config=configs/small_h200.py --decode_impls=kernel \
      --num_prompts=32 --max_new_tokens=64 --plan_fields=layer_loop="$layers" \
      --json_out="$OUT/excess_${tag}_$layers.json" --png_out="/tmp/excess_${tag}_$layers.png"
  done
  XLA_FLAGS=--xla_allow_excess_precision=false TAIL=8 run excess_train_step "$((t / 4))" \
    python3 -m experiments.bench.train_step --preset=qwen3_layers --moe_impls=mgpu --steps=5 \
    --seq_attentions=cudnn --policies=bf16+scan,bf16+unrolled \
    --json_out="$OUT/excess_train_step.json"
}

FP8BWD_XLA_OPERANDS=fp8_unified+fp8bwd+fp8_bwd_operands=xla

step_train_step() {
  local t=${T_TRAIN_STEP:-420}
  TAIL=20 run train_step "$t" python3 -m experiments.bench.train_step --preset=qwen3_layers \
    --moe_impls=mgpu --steps=5 --seq_attentions=cudnn \
    --policies=bf16,fp8_unified,fp8_unified+fp8bwd,fp4_trace,fp4_rtn,$FP8BWD_XLA_OPERANDS \
    --json_out="$OUT/train_step.json" ${TRAIN_STEP_ARGS:-}
}

step_train_step_12() {
  TAIL=12 run train_step_12 "${T_TRAIN_STEP_12:-540}" python3 -m experiments.bench.train_step \
    --preset=qwen3_layers --moe_impls=mgpu --layers=12 --steps=3 --seq_attentions=cudnn \
    --policies=bf16,fp8_unified,fp8_unified+fp8bwd,fp4_trace \
    --json_out="$OUT/train_step_12.json" ${TRAIN_STEP_12_ARGS:-}
}

step_fp8_layouts() {
  TAIL=40 run fp8_layouts "${T_FP8_LAYOUTS:-240}" python3 -m experiments.bench.fp8_layouts \
    --json_out="$OUT/fp8_layouts.json" ${FP8_LAYOUTS_ARGS:-}
}

step_train_step_variants() {
  local fp4=fp4_trace,fp4_trace+fake_quant=xla,fp4_rtn
  TAIL=20 run train_step_variants "${T_TRAIN_STEP_VARIANTS:-540}" python3 -m \
    experiments.bench.train_step --preset=qwen3_layers --moe_impls=mgpu --steps=5 \
    --seq_attentions=cudnn,xla --policies="bf16,fp8_unified,fp8_unified@kernel,$fp4,bf16+scan" \
    --json_out="$OUT/train_step_variants.json" ${TRAIN_STEP_VARIANTS_ARGS:-}
}

# The RL loop on the GPU with the config's kernel plan: the SFT warm start once, then one
# train_rl process per policy sharing the GPU (seeds in turn), then the report; the runs'
# summary, CSVs and plot come back in $OUT/rl.tar.gz (checkpoints and guidance stay).
step_rl() {
  # A fresh workdir: a newly started machine's /tmp can hold an earlier run under the same pid.
  local t=${T_RL:-540} w start=$SECONDS
  w=$(mktemp -d /tmp/rl_XXXXXX)
  local cfg=${RL_CONFIG:-configs/small_h200.py}
  XLA_FLAGS=--xla_gpu_deterministic_ops=true run rl_sft "$((t / 4))" python3 -m \
    experiments.train_rl --config="$cfg" --workdir="$w" --sft_only ${RL_SFT_ARGS-${RL_ARGS:-}}
  local left=$((t - (SECONDS - start) - 65)) pids=() policies
  policies=(${RL_POLICIES:-bf16 fp4_rollout fp4_rtn fp4_trace})
  for p in "${policies[@]}"; do
    if [ -n "${RL_SEQUENTIAL:-}" ]; then  # each policy alone on the GPU: its own tokens/s
      TAIL=4 run "rl_$p" "$((left / ${#policies[@]}))" python3 -m experiments.train_rl \
        --config="$cfg" --workdir="$w" --policies="$p" ${RL_ARGS:-}
      continue
    fi
    TAIL=4 run "rl_$p" "$left" python3 -m experiments.train_rl --config="$cfg" \
      --workdir="$w" --policies="$p" ${RL_ARGS:-} &
    pids+=($!)
  done
  [ ${#pids[@]} -eq 0 ] || wait "${pids[@]}"
  TAIL=30 run rl_report 60 python3 -m experiments.train_rl --config="$cfg" --workdir="$w" \
    --policies="$(echo ${RL_POLICIES:-bf16 fp4_rollout fp4_rtn fp4_trace} | tr ' ' ,)" \
    --report_only ${RL_ARGS:-}
  if [ -d "$w" ]; then
    (cd "$w" && find . -maxdepth 4 \( -name '*.csv' -o -name '*.json' -o -name '*.png' \) \
      -not -path '*/guidance/*' -not -path '*/ckpt/*' -not -path './sft/*' -print0 \
      | tar -czf "$OUT/rl.tar.gz" --null -T -)
  fi
}

step_multi_gpu() {
  local t=${T_MULTI_GPU:-540}
  run ep_tests "$((t / 4))" python3 -m pytest -q -p no:cacheprovider -rf \
    tests/model/test_expert_parallel.py tests/rollout/test_engine_mesh.py
  TAIL=20 run multi_gpu "$((3 * t / 4))" python3 -m experiments.bench.multi_gpu --preset=h200 \
    --devices="${DEVICES:-1,2}" --json_out="$OUT/multi_gpu.json" ${MULTI_GPU_ARGS:-}
}

# Where the device time goes: the bf16 and FP8 train steps (cuDNN attention) and the fixed-memory
# decode at 8k (bf16, fp4_rtn), each summed per kernel and category (`--profile_dir`).
step_profile() {
  local t=${T_PROFILE:-400} budget=(--budget_gb=60) hlo=/tmp/hlo_train_step xla=${XLA_FLAGS:-}
  small_gpu && budget=(--budget_gb=36)
  # The train step's optimized HLO, so that the profile's kernels can be traced to our lines.
  rm -rf "$hlo"
  export XLA_FLAGS="$xla --xla_dump_to=$hlo --xla_dump_hlo_as_text \
--xla_dump_hlo_module_re=.*loss.*"
  TAIL=70 run profile_train_step "$((t / 2 - 20))" python3 -m experiments.bench.train_step \
    --preset=qwen3_layers --moe_impls=mgpu --seq_attentions=cudnn \
    --policies=bf16,fp8_unified,fp8_unified+fp8bwd --steps=2 \
    --profile_dir=/tmp/profile_train_step \
    --json_out="$OUT/profile_train_step.json" ${PROFILE_ARGS:-}
  export XLA_FLAGS="$xla"
  TAIL=30 run profile_train_step_sources 20 python3 -m experiments.bench.hlo_sources \
    --hlo_dir="$hlo" --log="$OUT/profile_train_step.log"
  TAIL=70 run profile_rollout "$((t / 2))" python3 -m experiments.bench.rollout \
    --impls=kernel+unroll4 --budget_impl=kernel+unroll4 --cases=none --budget_context=8192 \
    --budget_policies=bf16,fp4_rtn --long_context=0 --reps=1 --transformers=false \
    "${budget[@]}" --profile_dir=/tmp/profile_rollout --json_out="$OUT/profile_rollout.json"
}

# -v: each test's name and outcome as it ends, so a step cut by its limit still names its
# failures (its summary never prints).
# TESTS_ARGS' options (whatever is not a path, in order), then its test files (directories
# expanded, sorted), every n-th from the i-th with TESTS_SHARD=i/n: the whole list takes more
# than one call's 10 minutes on an H100.
test_files() {
  local args=(${TESTS_ARGS:-tests/kernels tests/quant tests/model/test_plan.py
              tests/model/test_grouped.py}) shard=${TESTS_SHARD:-1/1} a files i=0
  if ! [[ $shard =~ ^[0-9]+/[0-9]+$ ]] || [ "${shard%/*}" -lt 1 ] ||
      [ "${shard%/*}" -gt "${shard#*/}" ]; then
    echo "TESTS_SHARD must be i/n with 1 <= i <= n, got '$shard'" >&2
    return 2
  fi
  for a in "${args[@]}"; do [ -e "$a" ] || echo "$a"; done
  files=$(for a in "${args[@]}"; do
            if [ -d "$a" ]; then find "$a" -name 'test_*.py'; elif [ -e "$a" ]; then echo "$a"; fi
          done | sort)
  for a in $files; do
    [ $((i % ${shard#*/})) -eq $((${shard%/*} - 1)) ] && echo "$a"
    i=$((i + 1))
  done
  return 0
}

step_tests() {
  local files
  files=$(test_files) || exit 2
  TAIL=30 run tests "${T_TESTS:-540}" python3 -m pytest -v -p no:cacheprovider -rf \
    --durations=10 ${files:-tests/kernels}
}

main() {
  local steps=("$@")
  if [ ${#steps[@]} -eq 0 ]; then
    steps=(check)
  fi
  for s in "${steps[@]}"; do
    if ! declare -F "step_$s" > /dev/null; then
      echo "unknown step '$s'; steps: check kernels rollout attention attention_ncu" \
        "attention_budget" \
        "kv_write command_buffers mismatch" \
        "excess_precision train_step fp8_layouts train_step_12 train_step_variants rl profile" \
        "multi_gpu tests" >&2
      exit 2
    fi
  done
  setup
  rm -rf "$PACKED"  # a machine keeps /tmp between calls
  stamp "steps: ${steps[*]}"
  for s in "${steps[@]}"; do
    "step_$s"
    pack
  done
  stamp done
}

# The device tool returns at most 8 files from $OUT, and what is there when the call ends (a call
# cut by its limit ends mid-step): after every step, once more than 7 files besides the
# runbook's log are there, every one of them moves to $PACKED and $OUT/out.tar.gz is made anew
# from all that moved so far (extract it into a fresh folder).
PACKED=${PACKED:-/tmp/runbook_packed}
pack() {
  local loose=()
  mapfile -d '' loose < <(cd "$OUT" && find . -maxdepth 1 -type f ! -name runbook.log \
    ! -name 'out.tar.gz*' -print0)
  [ ${#loose[@]} -gt 0 ] && { [ ${#loose[@]} -gt 7 ] || [ -f "$OUT/out.tar.gz" ]; } || return 0
  mkdir -p "$PACKED"
  (cd "$OUT" && mv -t "$PACKED" "${loose[@]}")
  tar -czf "$OUT/out.tar.gz.part" -C "$PACKED" . && mv "$OUT/out.tar.gz.part" "$OUT/out.tar.gz"
}

main "$@"
