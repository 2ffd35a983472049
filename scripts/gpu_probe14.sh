#!/usr/bin/env bash
# One H200 call (device tool, `carry: [".whl"]`, ~8 min), issue 14's open questions after the
# twelfth session (written 2026-12-04, thirteenth session, which was lent no device). Steps (a
# limit of 1 skips one):
# T_STREAM: ncu of wgmma_moe's stream variant (codes through a TMA ring in shared memory) at
#   STREAM_CFGS ("stages group" pairs) against the Triton words kernel's 77.9 us (gate/up,
#   batch 64); its verify line checks the outputs first. None faster: remove the variant.
# T_EXACT: the one GPU test failure left (test_kernel_matches_reference[len1_r4-
#   packed_words_exact]: head_dim 64, key blocks of 16, the Triton words decoder's exact table,
#   V rows 2x / 0 on the H200) across num_warps and block_t: a tile of 16 x 4 code words has
#   fewer words than 4 warps have threads (64 < 128), and the passing exact cases all have
#   >= 128 (block_t 32 x 4, 64 x 8). If only the < 1-word-per-thread tiles fail, decode_attention
#   should cap num_warps by the words per tile.
# T_UNROLL: the engine with every layer in one scan iteration (+unroll8 at 8 layers: the layer
#   loop's host round trips gone) beside +unroll4, bf16 and fp4_rtn at batch 64 (ROLL_IMPLS;
#   `+stream4`: the wgmma experts' codes through a ring of 4 chunks).
source "$(dirname "$0")/gpu_lib.sh"
stamp start
for cfg in ${STREAM_CFGS:-"4:1" "4:2" "8:2"}; do
  s=${cfg%:*}; g=${cfg#*:}
  TAIL=14 run "stream_s${s}_g${g}" "${T_STREAM:-110}" timeout -k 5 100 ncu --clock-control none \
    --kernel-name regex:grouped_matmul --launch-count 2 --metrics \
    gpu__time_duration.sum,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active \
    python3 -m experiments.bench_moe_decode --experts=64 --batches=64 --projections=gate_up,down \
    --reps=1 --warmup=0 --inner=1 --cases=kernel_fp4_wgmma_stream --wgmma_stream="$s" \
    --wgmma_group="$g"
done
TAIL=20 run exact "${T_EXACT:-150}" python3 - <<'PY'
import sys
sys.path[:0] = ["tests/quant", "tests/kernels"]
import jax.numpy as jnp
import numpy as np
import test_decode_attention as t
from trace_jax.kernels import decode_attention as da

for name in ("len1_r4", "mixed_lengths_r2_split3"):
  b, tt, g, n, h, lengths, _, splits = t.ATTN_CASES[name]
  q, kv, pos = t._attn_inputs(b, tt, g, n, h)
  cache = t._cache("packed", kv, pos, words=True)
  lens = jnp.asarray(lengths, jnp.int32)
  ref = t._reference(q, cache, lens)
  vals = t._on_cpu(t._values, cache)
  for table in ("exact", None):
    for block_t in (16, 32):
      for warps in (1, 2, 4):
        out = da.decode_attention(q, cache, lens, block_t=block_t, num_splits=splits,
                                  num_warps=warps, decoder="words", table=table)
        try:
          r = f"ok, err/tol {t._check_within_tolerance(out, ref, vals, lens, n):.3f}"
        except AssertionError as e:
          r = "FAIL " + str(e).splitlines()[0]
        words = block_t * h // 16
        print(f"{name} table={table} block_t={block_t} num_warps={warps} words/tile={words} "
              f"threads={32 * warps}: {r}", flush=True)
PY
TAIL=12 run unroll "${T_UNROLL:-240}" python3 -m experiments.bench_rollout \
  --impls="${ROLL_IMPLS:-kernel+unroll4,kernel+unroll8}" --key_impl=kernel+unroll4 --policies=bf16,fp4_rtn \
  --batches=64 --reps=3 --budget_gb=0 --transformers=false --json_out="$OUT/unroll.json"
stamp done
