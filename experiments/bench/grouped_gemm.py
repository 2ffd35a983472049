r"""The experts' grouped GEMMs of a training step, by implementation, side by side.

  python -m experiments.bench.grouped_gemm                 # Qwen3-30B-A3B widths (GPU)
  python -m experiments.bench.grouped_gemm --preset=cpu    # tiny shapes, interpret mode

For gate/up (hidden -> 2 x expert width) and down (expert width -> hidden) at a training
step's rows (tokens x top-k, routed uniformly at random, rows sorted by expert), the median ms
of each pass:
- fprop: y = x @ w[e]^T; dgrad: dx = dy @ w[e]; wgrad: dW[e] = dy_e^T x_e;
- fwd+bwd: one jitted forward and backward of `grouped.grouped_matmul` (what the step runs),
for `moe_impl` tiled (the XLA default), kernel (`trace_jax.kernels.grouped_gemm`), on the GPU
mgpu (JAX's Mosaic GPU grouped GEMM, the plan's on Hopper; `--mgpu` also sweeps its passes
beside ours) and, with --ragged, ragged_dot. The tiled backward computes dgrad and wgrad
together, so only its fwd+bwd is timed. Before timing, each kernel pass is compared with the
tiled path's result: max |diff| / max |ref| is printed. TFLOP/s, and the fraction of the dense
BF16 matmul rate measured in the same process; --sweep times the kernels' tile configs and
keeps the best.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from absl import flags

from experiments import common

FLAGS = flags.FlagValues()
flags.DEFINE_enum("preset", "qwen3_30b", ["qwen3_30b", "cpu"], "shapes", flag_values=FLAGS)
flags.DEFINE_integer("tokens", 0, "tokens per step (0: per preset)", flag_values=FLAGS)
flags.DEFINE_integer("experts", 64, "routed experts", flag_values=FLAGS)
flags.DEFINE_list("only", [], "projections to run: gate_up, down (default both)",
                  flag_values=FLAGS)
flags.DEFINE_bool("sweep", False, "time the kernels' tile configs, report the best",
                  flag_values=FLAGS)
flags.DEFINE_bool("ragged", False, "also time moe_impl=ragged_dot (large temporaries)",
                  flag_values=FLAGS)
flags.DEFINE_bool("mgpu", True, "on the GPU, also time JAX's Mosaic GPU grouped GEMMs "
                  "(jax.experimental.pallas.ops.gpu ragged_dot / transposed_ragged_dot)",
                  flag_values=FLAGS)
flags.DEFINE_integer("reps", 0, "timing samples (0: 10 on GPU, 1 otherwise)", flag_values=FLAGS)
flags.DEFINE_string("json_out", "", "write results as JSON here", flag_values=FLAGS)

# Tile configs the sweep tries per pass (the first is each pass's default).
_MM_CONFIGS = [dict(), dict(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4),
               dict(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3),
               dict(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4),
               dict(block_m=128, block_n=64, block_k=64, num_warps=4, num_stages=4),
               dict(block_m=128, block_n=128, block_k=32, num_warps=4, num_stages=5)]
_WG_CONFIGS = [dict(), dict(block_m=64, block_n=128, block_k=128, num_warps=8, num_stages=4),
               dict(block_m=32, block_n=128, block_k=128, num_warps=8, num_stages=4),
               dict(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4),
               dict(block_m=64, block_n=256, block_k=128, num_warps=8, num_stages=3),
               dict(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3)]

# JAX's Mosaic GPU grouped GEMMs: (block_m, block_n, block_k, max_concurrent_steps,
# grid_block_n) as its own sweep names them; the first is the default.
_MGPU_CONFIGS = [dict(block_m=bm, block_n=bn, block_k=64, max_concurrent_steps=s,
                      grid_block_n=gb)
                 for bm, bn, s, gb in ((128, 128, 4, 1), (128, 256, 4, 1), (64, 128, 4, 2),
                                       (128, 128, 5, 4), (192, 128, 4, 1))]


def _rel_err(got, want) -> float:
  """max |got - want| / max |want|, in float32."""
  import numpy as np

  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def _best_config(name: str, pname: str, make, args, want, configs, timer, flops: float,
                 peak: float) -> dict:
  """Times `make(config)(*args)` for each config (checked against `want` first) and returns
  the fastest one's row fields `kernel_<pass>_*` ({} when none compiled)."""
  best, label = None, f"{name} {pname}"
  for cfg in configs:
    try:
      fn = make(cfg)
      err = _rel_err(fn(*args), want)
      t = timer(fn, *args)
    except Exception as ex:  # a config Triton cannot compile: say so, keep going
      print(f"  {label} config {cfg}: {type(ex).__name__}: {str(ex)[:200]}", flush=True)
      continue
    print(f"  {label} {cfg or 'default'}: {t * 1e3:.3f} ms ({flops / t / 1e12:.0f} TFLOP/s), "
          f"rel err {err:.1e}", flush=True)
    if best is None or t < best[0]:
      best = (t, cfg, err)
  if best is None:
    return {}
  t, cfg, err = best
  return {f"kernel_{pname}_ms": t * 1e3, f"kernel_{pname}_tflops": flops / t / 1e12,
          f"kernel_{pname}_fraction_of_bf16_peak": flops / t / 1e12 / peak,
          f"kernel_{pname}_rel_err": err, f"kernel_{pname}_config": cfg}


def _mgpu_passes(gs, x, w, dy, want) -> dict:
  """JAX's own Mosaic GPU grouped GEMMs (`jax.experimental.pallas.ops.gpu`: `ragged_dot` with
  TMA loads and wgmma, `transposed_ragged_dot` for the weight gradient), as passes beside
  ours: mgpu_fprop, mgpu_dgrad, mgpu_wgrad."""
  import jax
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu

  rd = lambda t: lambda c: jax.jit(lambda a, b: ragged_dot_mgpu.ragged_dot(
      a, b, group_sizes=gs, transpose_rhs=t, **c))
  wg = lambda c: jax.jit(lambda a, b: transposed_ragged_dot_mgpu.transposed_ragged_dot(
      a, b, group_sizes=gs, **c))
  return {"mgpu_fprop": (rd(True), (x, w), want[0], _MGPU_CONFIGS),
          "mgpu_dgrad": (rd(False), (dy, w), want[1], _MGPU_CONFIGS),
          "mgpu_wgrad": (wg, (dy, x), want[2], _MGPU_CONFIGS)}


def _projection(name: str, kk: int, nn: int, gs, rng, timer, peak: float, sweep: bool) -> dict:
  """One projection [m, kk] x [e, nn, kk]: each kernel pass (its best config) and the fwd+bwd
  of every `moe_impl`, as a row of the JSON."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from trace_jax.kernels import grouped_gemm as gg
  from trace_jax.model import grouped

  m, e = int(np.sum(np.asarray(gs))), gs.shape[0]
  x = jnp.asarray(rng.standard_normal((m, kk), np.float32), jnp.bfloat16)
  dy = jnp.asarray(rng.standard_normal((m, nn), np.float32), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((e, nn, kk), np.float32) * 0.02, jnp.bfloat16)
  flops = 2 * m * kk * nn
  row: dict = {"m": m, "k": kk, "n": nn, "gflop_per_pass": flops / 1e9}

  def fwd_bwd(impl):
    def run(a, b, g):
      y, vjp = jax.vjp(lambda a, b: grouped.grouped_matmul(a, b, gs, impl), a, b)
      return y, *vjp(g)
    return jax.jit(run)

  tiled_out = fwd_bwd("tiled")(x, w, dy)
  passes = {
      "fprop": (lambda c: jax.jit(lambda a, b: gg.grouped_matmul(a, b, gs, **c)), (x, w),
                tiled_out[0], _MM_CONFIGS),
      "dgrad": (lambda c: jax.jit(lambda a, b: gg.grouped_matmul(a, b, gs, transpose_w=True,
                                                                 **c)), (dy, w),
                tiled_out[1], _MM_CONFIGS),
      "wgrad": (lambda c: jax.jit(lambda a, b: gg.grouped_wgrad(a, b, gs, **c)), (dy, x),
                tiled_out[2], _WG_CONFIGS),
  }
  if FLAGS.mgpu and jax.default_backend() == "gpu":  # JAX's kernels' passes, swept
    passes.update(_mgpu_passes(gs, x, w, dy, tiled_out))
  for pname, (make, args, want, configs) in passes.items():
    row.update(_best_config(name, pname, make, args, want,
                            configs if sweep else configs[:1], timer, flops, peak))
  mgpu = FLAGS.mgpu and jax.default_backend() == "gpu"  # the plan's moe_impl on Hopper
  for impl in ["tiled", "kernel"] + (["mgpu"] if mgpu else []) + (
      ["ragged_dot"] if FLAGS.ragged else []):
    row[f"{impl}_fwd_bwd_ms"] = timer(fwd_bwd(impl), x, w, dy) * 1e3
  row["kernel_fwd_bwd_over_tiled"] = row["kernel_fwd_bwd_ms"] / row["tiled_fwd_bwd_ms"]
  if mgpu:
    row["mgpu_fwd_bwd_over_kernel"] = row["mgpu_fwd_bwd_ms"] / row["kernel_fwd_bwd_ms"]
  row["fwd_bwd_tflops_kernel"] = 3 * flops / row["kernel_fwd_bwd_ms"] * 1e3 / 1e12
  passes_txt = ", ".join(f"{p} {row[f'kernel_{p}_ms']:.3f} ms "
                         f"({row[f'kernel_{p}_fraction_of_bf16_peak']:.2f} of peak)"
                         for p in passes if f"kernel_{p}_ms" in row)
  print(f"{name:8s} M{m} K{kk} N{nn}: kernel {passes_txt}; fwd+bwd: tiled "
        f"{row['tiled_fwd_bwd_ms']:.3f} ms, kernel {row['kernel_fwd_bwd_ms']:.3f} ms "
        f"({row['kernel_fwd_bwd_over_tiled']:.2f}x tiled, {row['fwd_bwd_tflops_kernel']:.0f} "
        f"TFLOP/s)"
        + (f", mgpu {row['mgpu_fwd_bwd_ms']:.3f} ms ({row['mgpu_fwd_bwd_over_kernel']:.2f}x "
           "kernel)" if mgpu else "")
        + (f", ragged_dot {row['ragged_dot_fwd_bwd_ms']:.3f} ms" if FLAGS.ragged else ""),
        flush=True)
  return row


def main(argv: Sequence[str]) -> dict:
  if not common.parse_flags(FLAGS, argv):
    return {}
  common.set_gpu_memory_env()
  import jax
  import jax.numpy as jnp
  import numpy as np

  gpu = jax.default_backend() == "gpu"
  reps = FLAGS.reps or (10 if gpu else 1)
  cpu = FLAGS.preset == "cpu"
  d, f, e, k_top = (128, 64, 4, 2) if cpu else (2048, 768, FLAGS.experts, 8)
  tokens = FLAGS.tokens or (64 if cpu else 8192)
  m = tokens * k_top
  projections = {"gate_up": (d, 2 * f), "down": (f, d)}  # (K, N)
  names = FLAGS.only or list(projections)
  unknown = set(names) - set(projections)
  if unknown:
    raise ValueError(f"--only: unknown projections {sorted(unknown)}; have {list(projections)}")

  res = {"device": common.device_description(), "bandwidth": common.bandwidth_gbps(),
         "matmul": common.matmul_tflops(), "tokens": tokens, "rows": m, "experts": e,
         "projections": {}}
  peak = res["matmul"]["bf16_tflops"]
  print(f"device {res['device']['device_kind']}: BF16 matmul {peak:.0f} TFLOP/s, copy "
        f"{res['bandwidth']['copy_gbps']:.0f} GB/s; rows {m} ({tokens} tokens x top-{k_top}), "
        f"{e} experts", flush=True)
  timer = lambda fn, *a: common.median_seconds(lambda: fn(*a), jax.block_until_ready, 2,
                                               reps)[0]
  rng = np.random.default_rng(0)
  ids = np.sort(rng.integers(0, e, m))
  gs = jnp.asarray(np.bincount(ids, minlength=e), jnp.int32)
  for name in names:
    res["projections"][name] = _projection(name, *projections[name], gs, rng, timer, peak,
                                           FLAGS.sweep and gpu)
  return common.finish(res, FLAGS)


if __name__ == "__main__":
  main(sys.argv)
