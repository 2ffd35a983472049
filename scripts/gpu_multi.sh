#!/usr/bin/env bash
# One call on a multi-GPU kind (device tool, kind nvidia-h200-x2 or larger, `carry: [".whl"]`),
# issue 16: the expert-parallel tests on real devices, then bench_multi_gpu at the Qwen3 layer
# width with 128 experts on 1 vs 2 (DEVICES) GPUs: decode, then the GRPO step on the one-GPU
# rollout, under bf16 (T_MULTI; the speed ratios) and fp4_trace (T_TRACE; the records' and the
# guided step's agreement with one GPU), then bf16 with the GPUs along `data` instead (T_DP:
# every GPU all experts, its own sequences; the MoE block data-parallel). 1 skips a step. The
# limits add up past one call's 600 s: two calls, `T_TRACE=1 T_DP=1 bash scripts/gpu_multi.sh`
# then `T_TESTS=1 T_MULTI=1 bash scripts/gpu_multi.sh`.
source "$(dirname "$0")/gpu_lib.sh"
stamp start
nvidia-smi topo -m | log
run ep_tests "${T_TESTS:-150}" python3 -m pytest -q -p no:cacheprovider -rf \
  tests/model/test_expert_parallel.py tests/rollout/test_engine_mesh.py
run multi "${T_MULTI:-300}" python3 -m experiments.bench_multi_gpu --preset=h200 \
  --devices="${DEVICES:-1,2}" ${MULTI_ARGS:-} --json_out="$OUT/multi_gpu.json"
run multi_trace "${T_TRACE:-240}" python3 -m experiments.bench_multi_gpu --preset=h200 \
  --devices="${DEVICES:-1,2}" --policy=fp4_trace --reps=2 ${MULTI_ARGS:-} \
  --json_out="$OUT/multi_gpu_fp4_trace.json"
run multi_dp "${T_DP:-240}" python3 -m experiments.bench_multi_gpu --preset=h200 \
  --devices="${DEVICES:-1,2}" --mesh_axis=data --reps=2 ${MULTI_ARGS:-} \
  --json_out="$OUT/multi_gpu_data.json"
stamp done
