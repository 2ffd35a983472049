r"""Block-scaled FP8 GEMMs (`trace_jax.kernels.fp8_gemm`) against BF16 and XLA's FP8, side by side.

  python -m experiments.bench.fp8_gemm                 # Qwen3-30B-A3B layer shapes (GPU)
  python -m experiments.bench.fp8_gemm --preset=cpu    # tiny shapes, interpret mode

Per shape (dense: tokens x hidden -> projection; grouped: the experts' gate_up and down at
training and decode row counts, top-8 routing drawn at random), median ms of:
- bf16: the BF16 GEMM the `bf16` policy runs (`jnp.dot` / `grouped.grouped_matmul` tiled);
- fake_fp8: the old fake-quantized path (quantize-dequantize both operands to BF16, BF16 GEMM);
- xla_fp8_tensor (dense only): XLA's cuBLASLt FP8 GEMM of the same E4M3 operands with no block
  scales (what XLA offers; not the block-scaled sum);
- kernel: the Pallas block-scaled FP8 GEMM on quantized operands;
- kernel_q: the same plus quantizing the input (and the weight), as the training forward runs;
- wgmma (Hopper): the Mosaic GPU block-scaled FP8 GEMM (`trace_jax.kernels.wgmma_fp8`, the
  plan's `fp8_gemm="wgmma"`) on the same operands, its error against the reference beside it;
  and for the grouped shapes bf16_mgpu, JAX's Mosaic GPU grouped GEMM (the BF16 policy's
  `moe_impl="mgpu"` on Hopper).
Before timing, the kernel's output is compared with `fp8_gemm.reference` (float32, HIGHEST):
max |diff| / max |ref| is printed. TFLOP/s and the fraction of the BF16 matmul rate measured
in the same process (and of the dense FP8 rate on a GPU); `--sweep` times the kernel's tile
configs and keeps the best.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from absl import flags

from experiments import common

FLAGS = flags.FlagValues()
flags.DEFINE_enum("preset", "qwen3_30b", ["qwen3_30b", "cpu"], "shapes", flag_values=FLAGS)
flags.DEFINE_integer("tokens", 0, "tokens per training step (0: per preset)", flag_values=FLAGS)
flags.DEFINE_integer("experts", 64, "routed experts", flag_values=FLAGS)
flags.DEFINE_list("only", [], "shape names to run (default all)", flag_values=FLAGS)
flags.DEFINE_bool("sweep", True, "time the kernel's tile configs, report the best",
                  flag_values=FLAGS)
flags.DEFINE_integer("reps", 0, "timing samples (0: 20 on GPU, 2 otherwise)", flag_values=FLAGS)
flags.DEFINE_string("json_out", "", "write results as JSON here", flag_values=FLAGS)

_CONFIGS = [dict(block_m=bm, block_n=bn, num_warps=nw, num_stages=ns, group_k=gk)
            for bm, bn, nw, ns, gk in
            ((128, 64, 4, 4, 2), (128, 128, 8, 3, 2), (128, 64, 4, 3, 4), (128, 128, 8, 3, 4),
             (64, 64, 4, 4, 2), (128, 64, 4, 4, 1))]

# The wgmma kernel's (stages, group_k, warpgroups) timed on Hopper, the best reported.
_WGMMA_CONFIGS = ((4, 1, 1), (2, 2, 1), (4, 1, 2), (2, 1, 2))


def _operands(kind: str, m: int, kk: int, nn: int, e: int, rng):
  """(w, qw, gs, bf16, fake, xla8, run) of one shape: the BF16 weight and its FP8
  quantization, the group sizes (grouped), the BF16 and fake-FP8 matmuls, XLA's FP8 matmul
  (dense only, else None) and run(qa, config): the kernel."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from trace_jax.kernels import fp8_gemm
  from trace_jax.model import grouped
  from trace_jax.quant import formats, qat

  qdq = lambda a, b: (qat.qdq_act(a, "fp8").astype(a.dtype),
                      qat.qdq_weight(b, "fp8").astype(b.dtype))
  if kind == "dense":
    w = jnp.asarray(rng.standard_normal((nn, kk), np.float32) * 0.02, jnp.bfloat16)
    qw = formats.fp8_quantize_weight(w)
    mm = lambda a, b: jnp.einsum("mk,nk->mn", a, b)
    xla8 = jax.jit(lambda a, b: jnp.einsum("mk,nk->mn", a, b,
                                           preferred_element_type=jnp.float32
                                           ).astype(jnp.bfloat16))
    return (w, qw, None, jax.jit(mm), jax.jit(lambda a, b: mm(*qdq(a, b))), xla8,
            lambda qa, cfg: fp8_gemm.matmul(qa, qw, **cfg))
  w = jnp.asarray(rng.standard_normal((e, nn, kk), np.float32) * 0.02, jnp.bfloat16)
  qw = formats.fp8_quantize_weight(w)
  gs = jnp.asarray(np.bincount(np.sort(rng.integers(0, e, m)), minlength=e), jnp.int32)
  mm = lambda a, b: grouped.grouped_matmul(a, b, gs, "tiled")
  return (w, qw, gs, jax.jit(mm), jax.jit(lambda a, b: mm(*qdq(a, b))), None,
          lambda qa, cfg: fp8_gemm.grouped_matmul(qa, qw, gs, **cfg))


def _shape(name: str, kind: str, m: int, kk: int, nn: int, e: int, rng, timer, peak: float,
           sweep: bool) -> dict | None:
  """One shape's row: the kernel at its best config against BF16, fake FP8 and XLA's FP8
  (None when no kernel config ran)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from trace_jax.kernels import fp8_gemm
  from trace_jax.quant import formats

  x = jnp.asarray(rng.standard_normal((m, kk), np.float32), jnp.bfloat16)
  w, qw, gs, bf16, fake, xla8, run = _operands(kind, m, kk, nn, e, rng)
  qa = formats.fp8_quantize_act(x)
  ref = fp8_gemm.reference(qa, qw, gs, out_dtype=jnp.float32)
  best = None
  for cfg in [{}] + (_CONFIGS if sweep else []):
    if kind == "grouped" and m // e < 64 and cfg.get("block_m", 0) >= 64:
      cfg = dict(cfg, block_m=16 if cfg["block_m"] == 64 else 32)
    try:
      fn = jax.jit(lambda qa, c=cfg: run(qa, c))
      t = timer(fn, qa)
      out = run(qa, dict(cfg, out_dtype=jnp.float32))
    except Exception as ex:  # a config Triton cannot compile: say so, keep going
      print(f"  {name} config {cfg}: {type(ex).__name__}: {str(ex)[:200]}", flush=True)
      continue
    err = float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))
    if best is None or t < best[0]:
      best = (t, cfg, err)
  if best is None:
    print(f"{name}: no kernel config ran", flush=True)
    return None
  t_kernel, cfg, err = best
  quant_x = jax.jit(lambda a, c=cfg: run(formats.fp8_quantize_act(a), c))
  row = dict(m=m, k=kk, n=nn, bf16_ms=timer(bf16, x, w) * 1e3,
             fake_fp8_ms=timer(fake, x, w) * 1e3, kernel_ms=t_kernel * 1e3,
             kernel_q_ms=timer(quant_x, x) * 1e3, best_config=cfg, kernel_rel_err=err)
  if xla8 is not None:
    row["xla_fp8_tensor_ms"] = timer(xla8, qa.values, qw.values) * 1e3
  row.update(_hopper_kernels(kind, x, w, qa, qw, gs, ref, timer))
  row["kernel_tflops"] = 2 * m * kk * nn / t_kernel / 1e12
  row["kernel_fraction_of_bf16_peak"] = row["kernel_tflops"] / peak
  row["kernel_over_bf16"] = row["kernel_ms"] / row["bf16_ms"]
  row["kernel_q_over_bf16"] = row["kernel_q_ms"] / row["bf16_ms"]
  print(f"{name:24s} M{m} K{kk} N{nn}: bf16 {row['bf16_ms']:.3f} ms, "
        f"fake {row['fake_fp8_ms']:.3f}"
        + (f", xla fp8/tensor {row['xla_fp8_tensor_ms']:.3f}" if xla8 is not None else "")
        + f", kernel {t_kernel * 1e3:.3f} ({row['kernel_over_bf16']:.2f}x bf16, "
        f"{row['kernel_tflops']:.0f} TFLOP/s = {row['kernel_fraction_of_bf16_peak']:.2f} of "
        f"bf16 peak), +quant {row['kernel_q_ms']:.3f} ({row['kernel_q_over_bf16']:.2f}x); "
        f"rel err {err:.2e}; {cfg}", flush=True)
  return row


def _hopper_kernels(kind: str, x, w, qa, qw, gs, ref, timer) -> dict:
  """On a Hopper GPU: the wgmma FP8 GEMM's time and error, and (grouped) JAX's BF16 Mosaic
  GPU grouped GEMM's time; elsewhere nothing."""
  import jax
  import jax.numpy as jnp

  from trace_jax.kernels import grouped_gemm, wgmma_fp8
  from trace_jax.model import plan

  if not (plan.Backend.current().hopper and wgmma_fp8.supported(qa, qw)):
    return {}

  def run(a, dtype=jnp.bfloat16, **cfg):
    if kind == "dense":
      return wgmma_fp8.matmul(a, qw, out_dtype=dtype, **cfg)
    return wgmma_fp8.grouped_matmul(a, qw, gs, out_dtype=dtype, **cfg)

  times, configs = {}, {}
  for st, gk, wg in _WGMMA_CONFIGS:
    name = f"stages{st}_group_k{gk}_warpgroups{wg}"
    configs[name] = dict(stages=st, group_k=gk, warpgroups=wg)
    try:
      times[name] = timer(jax.jit(lambda a, c=configs[name]: run(a, **c)), qa) * 1e3
    except Exception as ex:  # a config that does not compile: say so, keep going
      print(f"  wgmma {name}: {type(ex).__name__}: {str(ex)[:300]}", flush=True)
  if not times:
    return {}
  best = min(times, key=times.get)
  out = run(qa, jnp.float32, **configs[best])
  row = dict(wgmma_ms=times[best], wgmma_config=best, wgmma_configs_ms=times,
             wgmma_rel_err=float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref))))
  if kind == "grouped":
    row["bf16_mgpu_ms"] = timer(jax.jit(lambda a, b: grouped_gemm.mgpu_matmul(a, b, gs)),
                                x, w) * 1e3
  print(f"  wgmma {row['wgmma_ms']:.3f} ms ({best}; {times}; rel err {row['wgmma_rel_err']:.2e})"
        + (f", bf16 mgpu {row['bf16_mgpu_ms']:.3f} ms" if "bf16_mgpu_ms" in row else ""),
        flush=True)
  return row


def main(argv: Sequence[str]) -> dict:
  if not common.parse_flags(FLAGS, argv):
    return {}
  common.set_gpu_memory_env()
  import jax
  import numpy as np

  gpu = jax.default_backend() == "gpu"
  reps = FLAGS.reps or (20 if gpu else 2)
  cpu = FLAGS.preset == "cpu"
  d, f, e, k_top = (256, 128, 4, 2) if cpu else (2048, 768, FLAGS.experts, 8)
  heads = 4 * 128 if cpu else 32 * 128
  tokens = FLAGS.tokens or (256 if cpu else 8192)
  dense = {"qkv": (tokens, d, heads + 2 * (heads // 8)), "o": (tokens, heads, d)}
  groups = {"gate_up": (2 * f, d), "down": (d, f)}
  shapes = [("dense_" + n, "dense", (m, kk, nn)) for n, (m, kk, nn) in dense.items()]
  for rows_name, t in (("train", tokens), ("decode64", 64)):
    shapes += [(f"grouped_{n}_{rows_name}", "grouped", (t * k_top, kk, nn))
               for n, (nn, kk) in groups.items()]
  if FLAGS.only:
    shapes = [s for s in shapes if s[0] in FLAGS.only]

  res = {"device": common.device_description(), "bandwidth": common.bandwidth_gbps(),
         "matmul": common.matmul_tflops(), "shapes": {}}
  peak = res["matmul"]["bf16_tflops"]
  if gpu:
    res["fp8_matmul_tflops"] = common.fp8_matmul_tflops(8192)
  print(f"device {res['device']['device_kind']}: BF16 matmul {peak:.0f} TFLOP/s, copy "
        f"{res['bandwidth']['copy_gbps']:.0f} GB/s", flush=True)
  timer = lambda fn, *a: common.median_seconds(lambda: fn(*a), jax.block_until_ready, 3,
                                               reps)[0]
  rng = np.random.default_rng(0)
  for name, kind, (m, kk, nn) in shapes:
    row = _shape(name, kind, m, kk, nn, e, rng, timer, peak, FLAGS.sweep and gpu)
    if row is not None:
      if "wgmma_ms" in row:
        flop = 2 * m * kk * nn
        row["wgmma_fraction_of_fp8_rate"] = flop / (row["wgmma_ms"] * 1e-3) / 1e12 / res[
            "fp8_matmul_tflops"]
        row["wgmma_over_kernel"] = row["wgmma_ms"] / row["kernel_ms"]
      res["shapes"][name] = row
  return common.finish(res, FLAGS)


if __name__ == "__main__":
  main(sys.argv)
