r"""Times forward+backward of the model per precision policy, side by side in one run.

  python -m experiments.bench.train_step                     # tiny CPU smoke run
  python -m experiments.bench.train_step --preset=bench_gpu  # matmul-dominated size (H200)

Prints each (MoE grouped-matmul impl, policy)'s median step time, its ratio to the first
impl's `bf16`, and XLA's temporary-buffer plan for the step. `fp4_trace` runs with guidance
recorded by a rollout-side (record=True) forward of the same batch.

  python -m experiments.bench.train_step --preset=bench_gpu --moe_impls=ragged_dot,tiled
"""

from __future__ import annotations

import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments import common
from experiments.bench import profiling
from trace_jax import model as M

_PRESET = flags.DEFINE_enum("preset", "tiny", ["tiny", "small_h200", "bench_gpu", "qwen3_layers"],
                            "model size (small_h200: configs/small_h200.py's model and batch; "
                            "qwen3_layers: 4 Qwen3-30B-A3B-wide layers, 64 experts, 8k tokens)")
_POLICIES = flags.DEFINE_list(
    "policies", ["bf16", "fp8_unified", "fp8_unified@kernel", "fp8_unified@kernel+fp8bwd",
                 "fp4_rtn", "fp4_trace"],
    "forwards to time; `name@impl` sets fp8_gemm (xla, kernel), `+fp8bwd` the FP8 backward, "
    "`+unrolled` scan_layers=False (every layer compiled apart)")
_BATCH = flags.DEFINE_integer("batch", None, "batch size (default per preset)")
_SEQ = flags.DEFINE_integer("seq", None, "sequence length (default per preset)")
_EXPERTS = flags.DEFINE_integer("experts", None, "number of experts (default per preset; the "
                                "real Qwen3-30B-A3B has 128)")
_STEPS = flags.DEFINE_integer("steps", 5, "timed steps per policy (0: compile and report "
                               "XLA's temporary-buffer plan only)")
_PROFILE_DIR = flags.DEFINE_string("profile_dir", "", "profile 2 more steps of every policy into "
                                   "<dir>/<impl>_<policy> and print where the device time goes "
                                   "('' = no profile)")
_MOE_IMPLS = flags.DEFINE_list("moe_impls", ["tiled"],
                               f"grouped-matmul implementations to time, of {M.MOE_IMPLS}")


def _config(preset: str) -> tuple[M.ModelConfig, int, int]:
  if preset == "tiny":
    return M.tiny(num_hidden_layers=2, moe_intermediate_size=128, head_dim=64), 2, 64
  if preset == "small_h200":  # the config's model and one GRPO step's rows
    from configs import small_h200
    from trace_jax.train import rl_loop
    cfg = small_h200.get_config()
    return (rl_loop.model_config(cfg), cfg.rl.prompts_per_step * cfg.rl.group_size,
            cfg.seq_len)
  if preset == "qwen3_layers":  # the FP8 comparison: 8 x 1024 tokens per step
    return M.qwen3_30b_a3b(num_hidden_layers=4, num_experts=64, vocab_size=32768,
                           dtype="bfloat16"), 8, 1024
  # Qwen3-30B-A3B layer width with 32 experts, 2 layers and a 32k vocabulary: matmuls
  # dominate at this batch. (128 experts OOM on the H200 with moe_impl=ragged_dot: its
  # backward materialises ~62 GiB at 2048 tokens; --experts=128 --moe_impls=tiled tries the
  # tiled grouped matmul. 152k-vocab float32 logits alone need 64 GiB at 16k tokens.)
  return M.qwen3_30b_a3b(num_hidden_layers=2, num_experts=32, vocab_size=32768,
                         dtype="bfloat16"), 4, 1024


def _loss(params, config, tokens, guidance, routing):
  out = M.forward(params, config, tokens, guidance=guidance, routing=routing)
  logp = jax.nn.log_softmax(out.logits[:, :-1].astype(jnp.float32))
  nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)
  return jnp.mean(nll) + config.router_aux_loss_coef * M.aux_loss(out, config)


def _time(fn, *args, steps: int) -> float:
  jax.block_until_ready(fn(*args))  # warm-up
  times = []
  for _ in range(steps):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t)
  return float(np.median(times))


def step_flops(c: M.ModelConfig, batch: int, seq: int) -> dict[str, float]:
  """Matmul FLOPs of one forward + backward step (3x the forward's): the decoder blocks'
  linear layers (q/k/v/o and the experts: the GEMMs FP8 linears quantize), the attention
  score/value products, and router + lm_head."""
  t, d, h = batch * seq, c.hidden_size, c.head_dim
  n, g = c.num_attention_heads * h, c.num_key_value_heads * h
  per_layer = 2 * t * d * (n + 2 * g) + 2 * t * n * d                    # q, k, v, o
  per_layer += 2 * t * c.num_experts_per_tok * 3 * d * c.moe_intermediate_size  # experts
  attn = 2 * 2 * batch * seq * seq * n                                  # scores, values
  other = 2 * t * d * (c.num_experts * c.num_hidden_layers + c.vocab_size)  # router, lm_head
  layers = c.num_hidden_layers
  return {"linear": 3.0 * layers * per_layer, "attention": 3.0 * layers * attn,
          "other": 3.0 * other}


def main(argv):
  del argv
  base, batch, seq = _config(_PRESET.value)
  batch, seq = _BATCH.value or batch, _SEQ.value or seq
  if _EXPERTS.value:
    base = base.replace(num_experts=_EXPERTS.value)
  params = M.init_params(base, 0, param_dtype="float32")
  tokens = jax.random.randint(jax.random.key(1), (batch, seq), 0, base.vocab_size)
  print(f"device: {jax.devices()[0].device_kind}  batch {batch} x seq {seq}  "
        f"layers {base.num_hidden_layers}  hidden {base.hidden_size}  experts {base.num_experts}",
        flush=True)
  flops = step_flops(base, batch, seq)
  rate = common.matmul_tflops()["bf16_tflops"] * 1e12
  bound = {k: v / rate * 1e3 for k, v in flops.items()}
  print(f"matmul FLOPs per step: linear layers {flops['linear'] / 1e12:.2f} T, attention "
        f"{flops['attention'] / 1e12:.2f} T, router + lm_head {flops['other'] / 1e12:.2f} T; at "
        f"the BF16 matmul rate measured now ({rate / 1e12:.0f} TFLOP/s): "
        + ", ".join(f"{k} {v:.1f} ms" for k, v in bound.items()), flush=True)
  ref = None  # the first impl's bf16 time; rows print as they finish (a timeout keeps them)
  for impl in _MOE_IMPLS.value:
    for policy in _POLICIES.value:
      name, *opts = policy.split("+")
      if set(opts) - {"fp8bwd", "unrolled"}:
        raise app.UsageError(f"{policy}: options are +fp8bwd and +unrolled")
      name, _, fp8_gemm = name.partition("@")
      config = base.replace(policy=name, moe_impl=impl, fp8_gemm=fp8_gemm or "xla",
                            fp8_backward="fp8bwd" in opts, scan_layers="unrolled" not in opts)
      guidance = routing = None
      if name == "fp4_trace":
        taps = jax.jit(lambda p, t, c=config: M.forward(p, c, t, tap_layers=c.guided_layers,
                                                         record=True).taps)(params, tokens)
        guidance = {i: {s: taps[i][s] for s in M.SITES} for i in config.guided_layers}
        routing = {i: taps[i]["routing"] for i in taps}  # matches expert_mid rows to experts
      step = jax.jit(jax.value_and_grad(functools.partial(_loss, config=config)))
      t0 = time.perf_counter()
      compiled = step.lower(params, tokens=tokens, guidance=guidance,
                            routing=routing).compile()  # once
      compile_s = time.perf_counter() - t0
      gib = compiled.memory_analysis().temp_size_in_bytes / 2**30
      if _STEPS.value == 0:
        print(f"  {impl:10s} {policy:26s} {'-':>9s} ms/step  {'':24s} temp {gib:7.2f} GiB"
              f"  compile {compile_s:.1f} s", flush=True)
        continue
      t = _time(lambda p, t, g, r, f=compiled: f(p, tokens=t, guidance=g, routing=r), params,
                tokens, guidance, routing, steps=_STEPS.value)
      if ref is None and impl == _MOE_IMPLS.value[0] and name == "bf16":
        ref = t
      rel = f"{t / ref:.2f}x {_MOE_IMPLS.value[0]} bf16" if ref else ""
      share = bound["linear"] / (t * 1e3)
      print(f"  {impl:10s} {policy:26s} {t * 1e3:9.2f} ms/step  {rel:24s} temp {gib:7.2f} GiB"
            f"  compile {compile_s:.1f} s  (linear GEMMs at the BF16 rate: {100 * share:.0f}% of "
            "it)", flush=True)
      if _PROFILE_DIR.value:
        log_dir = os.path.join(_PROFILE_DIR.value, f"{impl}_{policy}".replace("@", "_"))
        with profiling.trace(log_dir):
          for _ in range(2):
            jax.block_until_ready(compiled(params, tokens=tokens, guidance=guidance,
                                           routing=routing))
        print(profiling.format_summary(profiling.summarize(log_dir, steps=2),
                                       f"{impl} {policy}"), flush=True)


if __name__ == "__main__":
  app.run(main)
