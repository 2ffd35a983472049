r"""Times forward+backward of the model per precision policy, side by side in one run.

  python -m experiments.bench.train_step                     # tiny CPU smoke run
  python -m experiments.bench.train_step --preset=bench_gpu  # matmul-dominated size (H200)

Prints each (MoE grouped-matmul impl, full-sequence attention, policy)'s median step time, its
ratio to the first impl and attention's `bf16`, its matmul FLOPs' fraction of the BF16 matmul
rate measured in the same process (MFU), and XLA's temporary-buffer plan for the step.
`fp4_trace` runs with guidance recorded by a rollout-side (record=True) forward of the same
batch. Attention FLOPs count the whole S x S product (the causal half is not subtracted).

  python -m experiments.bench.train_step --preset=bench_gpu --moe_impls=ragged_dot,tiled

With bf16 among the policies it prints the floors FP8 GEMMs could reach (Amdahl: FP8 speeds a
GEMM at most by r8 / r16, the dense FP8 over BF16 matmul rate measured in the same process):
fp8_unified's step over bf16's T is >= 1 - (t_fwd / T)(1 - r16 / r8), t_fwd the bf16 forward
alone (it bounds the forward's GEMMs); +fp8bwd's >= 1 - (T_gemm / T)(1 - r16 / r8), T_gemm the
GEMM + Pallas kernels of the --profile_dir profile, else T.
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
from experiments.bench import profiling, variants
from trace_jax import model as M

_PRESET = flags.DEFINE_enum("preset", "tiny", ["tiny", "small_h200", "bench_gpu", "qwen3_layers"],
                            "model size (small_h200: configs/small_h200.py's model and batch; "
                            "qwen3_layers: 4 Qwen3-30B-A3B-wide layers, 64 experts, 8k tokens)")
_POLICIES = flags.DEFINE_list(
    "policies", ["bf16", "fp8_unified@kernel", "fp8_unified@kernel+fp8bwd", "fp4_rtn",
                 "fp4_trace"],
    "forwards to time; `name@impl` sets fp8_gemm (xla, kernel; default: the plan's), "
    "`+fp8bwd` the FP8 backward, `+scan` / `+unrolled` the plan's layer_loop (default: the "
    "plan's; unrolled on Hopper up to 16 layers), `+FIELD=VALUE` any other plan field "
    "(e.g. `fp4_trace+fake_quant=kernel`)")
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
_ATTENTIONS = flags.DEFINE_list("seq_attentions", ["auto"],
                                "full-sequence attentions to time (the plan's seq_attention: "
                                "auto, xla, cudnn); the first impl and attention's bf16 is the "
                                "reference of the ratios")
_LAYERS = flags.DEFINE_integer("layers", None, "decoder layers (default per preset)")
flags.DEFINE_string("json_out", "", "JSON output path ('' = none): every variant's step time, "
                    "temporaries, compile time and MFU, and bf16_mfu, fp8_unified_over_bf16, "
                    "fp8_full_over_bf16, fp4_trace_over_bf16, and with bf16 the FP8 floors "
                    "(fp8_unified_floor, fp8_full_floor and their inputs)")


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


def _time(fn, steps: int) -> float:
  jax.block_until_ready(fn())  # warm-up
  times = []
  for _ in range(steps):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t)
  return float(np.median(times))


def _forward_ms(config: M.ModelConfig, params, tokens) -> float:
  """Median ms of the step's loss alone (jitted without grad): bounds the forward's GEMMs."""
  loss = jax.jit(functools.partial(_loss, config=config, guidance=None, routing=None))
  return 1e3 * _time(lambda: loss(params, tokens=tokens), steps=_STEPS.value)


def _floors(row: dict, bf16_tflops: float, fp8_tflops: float) -> dict:
  """The FP8 floors of a bf16 row (with its forward_ms), and their inputs."""
  cats = row.get("profile", {}).get("categories")
  gemm = cats.get("gemm", 0.0) + cats.get("pallas", 0.0) if cats else None
  return {"fp8_matmul_tflops_same_process": fp8_tflops, "bf16_forward_ms": row["forward_ms"],
          **variants.fp8_floors(row["ms_per_step"], row["forward_ms"], gemm, bf16_tflops,
                                fp8_tflops)}


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


def _run_one(config: M.ModelConfig, params, tokens, label: str, forward: bool = False
             ) -> dict[str, float]:
  """Compiles and times one variant's step (and with `forward` its loss alone); profiles the
  step with --profile_dir."""
  guidance = routing = None
  if config.policy == "fp4_trace":
    taps = jax.jit(lambda p, t, c=config: M.forward(p, c, t, tap_layers=c.guided_layers,
                                                     record=True).taps)(params, tokens)
    guidance = {i: {s: taps[i][s] for s in M.SITES} for i in config.guided_layers}
    routing = {i: taps[i]["routing"] for i in taps}  # matches expert_mid rows to experts
  step = jax.jit(jax.value_and_grad(functools.partial(_loss, config=config)))
  t0 = time.perf_counter()
  compiled = step.lower(params, tokens=tokens, guidance=guidance, routing=routing).compile()
  row = {"compile_s": time.perf_counter() - t0,
         "temp_gib": compiled.memory_analysis().temp_size_in_bytes / 2**30,
         "policy": config.policy, "fp8_backward": config.fp8_backward,
         "fp8_gemm": M.resolve_plan(config).fp8_gemm}
  if _STEPS.value == 0:
    return row
  run = lambda: compiled(params, tokens=tokens, guidance=guidance, routing=routing)
  row["ms_per_step"] = 1e3 * _time(lambda: run(), steps=_STEPS.value)
  if forward:
    row["forward_ms"] = _forward_ms(config, params, tokens)
  if _PROFILE_DIR.value:
    log_dir = os.path.join(_PROFILE_DIR.value, label.replace("@", "_").replace(" ", "_"))
    with profiling.trace(log_dir):
      for _ in range(2):
        jax.block_until_ready(run())
    summary = profiling.summarize(log_dir, steps=2)
    print(profiling.format_summary(summary, label), flush=True)
    row["profile"] = {k: summary[k] for k in ("kernels", "wall_ms", "busy_ms", "categories")}
  return row


def _print_floors(res: dict) -> None:
  profile = res["fp8_full_floor_gemm_bound"] == "profile"
  r = res["fp8_matmul_tflops_same_process"] / res["bf16_matmul_tflops_same_process"]
  print(f"  FP8 floors (FP8 matmul rate {r:.2f}x BF16's): fp8_unified >= "
        f"{res['fp8_unified_floor']:.3f}x bf16 (GEMMs bounded by the forward alone, "
        f"{res['bf16_forward_ms']:.2f} ms), +fp8bwd >= {res['fp8_full_floor']:.3f}x bf16 (GEMMs "
        f"bounded by {'the profile' if profile else 'the whole step'})", flush=True)


def main(argv):
  del argv
  base, batch, seq = _config(_PRESET.value)
  batch, seq = _BATCH.value or batch, _SEQ.value or seq
  if _EXPERTS.value:
    base = base.replace(num_experts=_EXPERTS.value)
  if _LAYERS.value:
    base = base.replace(num_hidden_layers=_LAYERS.value, guided_layers=None)
  params = M.init_params(base, 0, param_dtype="float32")
  tokens = jax.random.randint(jax.random.key(1), (batch, seq), 0, base.vocab_size)
  print(f"device: {jax.devices()[0].device_kind}  batch {batch} x seq {seq}  "
        f"layers {base.num_hidden_layers}  hidden {base.hidden_size}  experts {base.num_experts}",
        flush=True)
  flops = step_flops(base, batch, seq)
  matmul = common.matmul_tflops()
  rate = matmul["bf16_tflops"] * 1e12
  floors = "bf16" in _POLICIES.value and _STEPS.value > 0
  fp8_tflops = common.fp8_matmul_tflops(matmul["n"]) if floors else None
  bound = {k: v / rate * 1e3 for k, v in flops.items()}
  print(f"matmul FLOPs per step: linear layers {flops['linear'] / 1e12:.2f} T, attention "
        f"{flops['attention'] / 1e12:.2f} T, router + lm_head {flops['other'] / 1e12:.2f} T; at "
        f"the BF16 matmul rate measured now ({rate / 1e12:.0f} TFLOP/s"
        + (f"; FP8 {fp8_tflops:.0f}" if floors else "") + "): "
        + ", ".join(f"{k} {v:.1f} ms" for k, v in bound.items()), flush=True)
  total = sum(flops.values())
  first = f"{_MOE_IMPLS.value[0]} {_ATTENTIONS.value[0]}"
  rows: dict[str, dict[str, float]] = {}
  res = {"device": jax.devices()[0].device_kind, "batch": batch, "seq": seq,
         "layers": base.num_hidden_layers, "bf16_matmul_tflops_same_process": rate / 1e12,
         "matmul_tflop_per_step": {k: v / 1e12 for k, v in flops.items()}, "steps": rows}
  # Rows print, and the JSON is rewritten, as each variant finishes (a timeout keeps them).
  for impl in _MOE_IMPLS.value:
    for attention in _ATTENTIONS.value:
      for policy in _POLICIES.value:
        label = f"{impl} {attention} {policy}"
        config = variants.train_variant(base, impl, attention, policy)
        row = rows[label] = _run_one(config, params, tokens, label,
                                     forward=floors and label == f"{first} bf16")
        ref = rows.get(f"{first} bf16", {}).get("ms_per_step")
        t = row.get("ms_per_step")
        if t:
          row["mfu"] = total / (t * 1e-3) / rate
        rel = f"{t / ref:.2f}x {first} bf16" if t and ref else ""
        print(f"  {label:44s} {t or float('nan'):9.2f} ms/step  {rel:24s} temp "
              f"{row['temp_gib']:7.2f} GiB  compile {row['compile_s']:.1f} s  (matmul FLOPs at "
              f"{100 * row.get('mfu', float('nan')):.0f}% of the BF16 rate)", flush=True)
        if "forward_ms" in row:
          res.update(_floors(row, rate / 1e12, fp8_tflops))
          _print_floors(res)
        ratios = variants.headline_ratios(rows, first, total, rate)
        common.write_json(flags.FLAGS.json_out,
                          {**res, **ratios, "flags": common.flag_dict(flags.FLAGS)})
  res.update(variants.headline_ratios(rows, first, total, rate))
  common.finish(res, flags.FLAGS, "  ".join(f"{k} {v:.3f}" for k, v in res.items()
                                            if k.endswith(("_mfu", "_over_bf16", "_floor"))))


if __name__ == "__main__":
  app.run(main)
