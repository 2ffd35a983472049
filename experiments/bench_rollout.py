"""Decode speed of the embedded rollout engine: BF16 vs FP4 (and FP8: `--policies=bf16,
fp8_unified,...`) policies, XLA vs kernel decode.

  python -m experiments.bench_rollout --json_out=/tmp/rollout.json          # GPU preset
  python -m experiments.bench_rollout --preset=cpu                          # a minute on CPU

For each (policy, decode_impl, batch): one `InProcessEngine.generate` call compiles (its wall
time is the program's compile plus one run: `first_call_s`), then `--reps` timed calls of
greedy decoding of `--new_tokens` tokens after `--prompt_len`-token prompts. Reported: decode
tokens/s (batch * new tokens / median call time, prefill included), the bytes a decode step
must read (the touched experts' weights as stored, attention and lm_head weights, the KV cache
at the mean length) and their rate against the device's read bandwidth measured in the same
process (`common.bandwidth_gbps`), and ratios side by side: FP4 over BF16 at each batch, the
kernel decode over XLA's.

Model (GPU preset): a random Qwen3-MoE of hidden 2048, 32 query / 4 KV heads of 128, 64
experts top-8 of width 768, vocab 32768, `--layers` decoder layers (8: 2.70B parameters).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from absl import flags

from experiments import common

FLAGS = flags.FlagValues()
flags.DEFINE_enum("preset", "h200", ["h200", "cpu"], "Model and batch sizes.", flag_values=FLAGS)
flags.DEFINE_list("policies", ["bf16", "fp4_rtn", "fp4_trace"], "Forwards of the rollout.",
                  flag_values=FLAGS)
flags.DEFINE_list("impls", ["xla", "kernel"],
                  "decode_impl values (and fp8_gemm's, for fp8_unified).", flag_values=FLAGS)
flags.DEFINE_list("batches", [], "Batch sizes (default per preset).", flag_values=FLAGS)
flags.DEFINE_list("cases", [], "Only these policy:impl:batch cases (default: all).",
                  flag_values=FLAGS)
flags.DEFINE_integer("layers", 0, "Decoder layers (0: per preset).", flag_values=FLAGS)
flags.DEFINE_integer("prompt_len", 128, "Prompt tokens.", flag_values=FLAGS)
flags.DEFINE_integer("new_tokens", 128, "Generated tokens per sequence.", flag_values=FLAGS)
flags.DEFINE_integer("reps", 3, "Timed calls per case.", flag_values=FLAGS)
flags.DEFINE_float("budget_s", 0, "Skip the remaining cases after this many seconds (0: none).",
                   flag_values=FLAGS)
flags.DEFINE_string("json_out", "", "JSON output path ('' = none).", flag_values=FLAGS)

PRESETS = {
    "h200": dict(model=dict(vocab_size=32768, hidden_size=2048, num_hidden_layers=8,
                            num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                            num_experts=64, num_experts_per_tok=8, moe_intermediate_size=768,
                            max_position_embeddings=4096), batches=(8, 64, 256)),
    "cpu": dict(model=dict(vocab_size=256, hidden_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                           num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                           max_position_embeddings=512), batches=(4,)),
}


def step_bytes(config: Any, batch: int, context: float, touched: float) -> float:
  """Bytes one decode step must read: `touched` experts per layer (weights as stored: BF16,
  packed NVFP4, or FP8 under FP8 linears), the attention projections (FP8 under FP8 linears),
  lm_head, and the KV cache at `context` tokens per sequence."""
  c, fwd = config, config.forward
  d, f, h = c.hidden_size, c.moe_intermediate_size, c.head_dim
  fp8 = 1 + 4 / 128**2  # E4M3 byte + a float32 scale per 128 x 128 block
  expert = 3 * f * d * (0.5 + 1 / 16) + 8 if fwd.fp4 else 3 * f * d * (fp8 if fwd.fp8_linears
                                                                       else 2)
  attn = ((c.num_attention_heads * h * d * 2 + 2 * c.num_key_value_heads * h * d)
          * (fp8 if fwd.fp8_linears else 2))
  kv_row = 2 * c.num_key_value_heads * h * 2  # BF16 cache (the FP4 cache is fake-quantized)
  per_layer = touched * expert + attn + batch * context * kv_row
  return c.num_hidden_layers * per_layer + c.vocab_size * d * 2


def expected_touched(num_experts: int, top_k: int, batch: int) -> float:
  """Mean experts touched per layer by `batch` tokens routed uniformly at random."""
  return num_experts * (1 - (1 - top_k / num_experts) ** batch)


def run_case(params: Any, config: Any, batch: int, reps: int) -> dict[str, Any]:
  from trace_jax.rollout.engine import InProcessEngine
  from trace_jax.rollout.protocol import SamplingParams

  engine = InProcessEngine(params, config, max_batch=batch,
                           record_guidance=config.forward.guided,
                           record_routing=config.forward.guided)
  rng = np.random.default_rng(0)
  prompts = rng.integers(1, config.vocab_size, (batch, FLAGS.prompt_len)).tolist()
  sp = SamplingParams(max_new_tokens=FLAGS.new_tokens, temperature=0.0)
  t0 = time.perf_counter()
  engine.generate(prompts, sp)
  first = time.perf_counter() - t0
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    out = engine.generate(prompts, sp)
    times.append(time.perf_counter() - t0)
  tokens = sum(len(s.tokens) for s in out)
  med = float(np.median(times))
  return {"first_call_s": first, "median_s": med, "tokens": tokens,
          "tokens_per_s": tokens / med, "tokens_per_seq": tokens / batch}


def run_bench() -> dict[str, Any]:
  import jax

  from trace_jax import model as model_lib

  p = PRESETS[FLAGS.preset]
  fields = dict(p["model"], dtype="bfloat16")
  if FLAGS.layers:
    fields["num_hidden_layers"] = FLAGS.layers
  base = model_lib.tiny(**fields)
  batches = [int(b) for b in FLAGS.batches] or list(p["batches"])
  res: dict[str, Any] = {**common.device_description(), **common.bandwidth_gbps(),
                         "model": fields, "prompt_len": FLAGS.prompt_len,
                         "new_tokens": FLAGS.new_tokens, "cases": {}}
  print(f"bench_rollout: {res['backend']} {res['device_kind']}, copy {res['copy_gbps']:.0f} "
        f"GB/s, read {res['read_gbps']:.0f} GB/s; {base.num_hidden_layers} layers", flush=True)
  params = model_lib.init_params(base, jax.random.key(0), param_dtype="bfloat16")
  n_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))
  res["parameters"] = n_params
  start = time.perf_counter()
  for policy in FLAGS.policies:
    for impl in FLAGS.impls:
      for batch in batches:
        name = f"{policy}:{impl}:{batch}"
        if FLAGS.cases and name not in FLAGS.cases:
          continue
        if FLAGS.budget_s and time.perf_counter() - start > FLAGS.budget_s:
          res["cases"][name] = {"skipped": "budget"}
          continue
        # "kernel": the decode kernels, and FP8 GEMMs on the Pallas kernel with FP8 weights
        # made once per update; "xla": the references.
        config = base.replace(policy=policy, decode_impl=impl, fp8_gemm=impl)
        r = run_case(params, config, batch, FLAGS.reps)
        ctx = FLAGS.prompt_len + r["tokens_per_seq"] / 2
        touched = expected_touched(base.num_experts, base.num_experts_per_tok, batch)
        nbytes = step_bytes(config, batch, ctx, touched)
        steps_per_s = r["tokens_per_s"] / batch
        r.update(step_bytes=nbytes, read_fraction=nbytes * steps_per_s / 1e9 / res["read_gbps"])
        res["cases"][name] = r
        print(f"  {name:<22} {r['tokens_per_s']:>10,.0f} tok/s  first call "
              f"{r['first_call_s']:6.1f} s  {nbytes / 1e9:5.2f} GB/step -> "
              f"{100 * r['read_fraction']:4.1f}% of read bandwidth", flush=True)
  res["ratios"] = ratios(res["cases"])
  for k, v in res["ratios"].items():
    print(f"  {k}: {v:.3f}")
  return res


def ratios(cases: dict[str, Any]) -> dict[str, float]:
  """tokens/s ratios side by side: each FP4 case over BF16 (same impl, batch), kernel over
  XLA (same policy, batch)."""
  out = {}
  tps = {k: v["tokens_per_s"] for k, v in cases.items() if "tokens_per_s" in v}
  for k, v in tps.items():
    policy, impl, batch = k.split(":")
    bf16 = tps.get(f"bf16:{impl}:{batch}")
    if policy != "bf16" and bf16:
      out[f"{policy}_over_bf16_{impl}_b{batch}"] = v / bf16
    xla = tps.get(f"{policy}:xla:{batch}")
    if impl == "kernel" and xla:
      out[f"kernel_over_xla_{policy}_b{batch}"] = v / xla
  return out


def main(argv: Sequence[str]) -> dict[str, Any] | None:
  if not common.parse_flags(FLAGS, argv):
    return None
  common.set_gpu_memory_env()
  return common.finish(run_bench(), FLAGS)


if __name__ == "__main__":
  main(sys.argv)
