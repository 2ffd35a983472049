r"""The FP8 backward's operand layouts: XLA's against `kernels.fp8_tiles`, side by side.

  python -m experiments.bench.fp8_layouts                 # Qwen3-30B-A3B layer shapes (GPU)
  python -m experiments.bench.fp8_layouts --preset=cpu    # tiny shapes, interpret mode

Per shape, median ms of:
- wgrad (the experts' FP8 WGrad operands: rows [M, C] sorted by expert, each expert's run
  padded to whole 128-row tiles, transposed to [C, rows], quantized in 128x1 groups; the
  shapes of `fp8_linear`'s backward at top-8 routing drawn at random):
  xla (`fp8_linear.wgrad_operand`: a gather, a transpose, the quantizer) and the kernel
  (`fp8_tiles.quantize_tiles`) at each launch config of the sweep;
- transpose (the DGrad's weight codes [E, N, K] -> [E, K, N]): xla (`jnp.swapaxes`) and the
  kernel (`fp8_tiles.transpose_codes`) at each config.
Every kernel output is checked bit for bit against XLA's first. Bytes moved: wgrad reads the
rows' bf16 and writes the codes and scales; transpose reads and writes the codes. GB/s and
the fraction of the copy bandwidth (read + write) measured in the same process.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

from absl import flags

from experiments import common

FLAGS = flags.FlagValues()
flags.DEFINE_enum("preset", "qwen3_30b", ["qwen3_30b", "cpu"], "shapes", flag_values=FLAGS)
flags.DEFINE_bool("sweep", True, "time every launch config of the kernels (else the default)",
                  flag_values=FLAGS)
flags.DEFINE_integer("reps", 0, "timing samples (0: 20 on GPU, 2 otherwise)", flag_values=FLAGS)
flags.DEFINE_string("json_out", "", "write results as JSON here", flag_values=FLAGS)

# name -> (kind, dims): wgrad (M rows, C columns, E experts), transpose (E, N, K).
PRESETS = {
    "qwen3_30b": {"wgrad_x": ("wgrad", (65536, 2048, 64)),
                  "wgrad_dy_gate_up": ("wgrad", (65536, 1536, 64)),
                  "wgrad_hidden": ("wgrad", (65536, 768, 64)),
                  "transpose_gate_up": ("transpose", (64, 1536, 2048)),
                  "transpose_down": ("transpose", (64, 2048, 768))},
    "cpu": {"wgrad_x": ("wgrad", (512, 64, 4)), "transpose_gate_up": ("transpose", (2, 256, 128))},
}
# Launch configs of the sweep, the kernels' defaults first (--nosweep: those alone).
WGRAD_CONFIGS = [dict(block_c=bc, num_warps=nw) for bc, nw in
                 ((64, 4), (64, 8), (32, 4), (32, 8), (128, 4), (128, 8))]
TRANSPOSE_CONFIGS = [dict(block=b, num_warps=nw) for b, nw in ((128, 4), (128, 8), (64, 4),
                                                                (64, 8))]


def _wgrad_case(m: int, c: int, e: int, rng) -> tuple[Callable, Callable, int]:
  """(xla(), kernel(config)) of one WGrad operand and the bytes it moves."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from trace_jax.kernels import fp8_tiles
  from trace_jax.model import fp8_linear

  a = jnp.asarray(rng.standard_normal((m, c), np.float32), jnp.bfloat16)
  gs = jnp.asarray(np.bincount(rng.integers(0, e, m), minlength=e), jnp.int32)
  src = fp8_linear.wgrad_sources(gs, m)
  runs = jax.jit(fp8_tiles.tile_runs, static_argnums=1)(src, m)
  xla = jax.jit(fp8_linear.wgrad_operand)
  rows = src.shape[0]
  nbytes = m * c * 2 + c * rows + c * (rows // fp8_tiles.TILE) * 4
  return (lambda: xla(a, src),
          lambda cfg: fp8_tiles.quantize_tiles(a, *runs, **cfg), nbytes)


def _transpose_case(e: int, n: int, k: int, rng) -> tuple[Callable, Callable, int]:
  import jax
  import jax.numpy as jnp

  from trace_jax.kernels import fp8_tiles

  bits = jnp.asarray(rng.integers(0, 256, (e, n, k)), jnp.uint8)
  codes = jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn)
  xla = jax.jit(lambda v: jnp.swapaxes(v, -1, -2))
  return (lambda: xla(codes), lambda cfg: fp8_tiles.transpose_codes(codes, **cfg),
          2 * e * n * k)


def _bits(out: Any) -> list[Any]:
  import jax
  import numpy as np
  return [np.asarray(x).view(np.uint8) if x.dtype.itemsize == 1 else np.asarray(x).view(
      np.uint32) for x in jax.tree.leaves(out)]


def run_shape(name: str, kind: str, dims: Sequence[int], configs: Sequence[dict[str, int]],
              reps: int, calls: int, copy_gbps: float, rng) -> dict[str, Any]:
  """One shape's timings (xla and each config), bit-checked, with GB/s and fraction of copy."""
  import jax
  import numpy as np

  make = _wgrad_case if kind == "wgrad" else _transpose_case
  xla, kernel, nbytes = make(*dims, rng)
  want = _bits(xla())
  res = {"kind": kind, "dims": list(dims), "bytes": nbytes, "paths": {}}

  def timed(label, fn):
    t, _ = common.median_seconds(fn, jax.block_until_ready, 2, reps, calls=calls)
    gbps = nbytes / t / 1e9
    res["paths"][label] = {"ms": t * 1e3, "gbps": gbps, "frac_copy": gbps / copy_gbps}

  timed("xla", xla)
  for cfg in configs:
    label = "kernel_" + "_".join(f"{k}{v}" for k, v in cfg.items())
    got = _bits(kernel(cfg))
    if len(got) != len(want) or not all(np.array_equal(g, w) for g, w in zip(got, want)):
      raise AssertionError(f"{name}: {label} differs from XLA's bits")
    timed(label, lambda cfg=cfg: kernel(cfg))
  best = min((k for k in res["paths"] if k != "xla"), key=lambda k: res["paths"][k]["ms"])
  res["best_kernel"] = best
  res["kernel_over_xla"] = res["paths"][best]["ms"] / res["paths"]["xla"]["ms"]
  return res


def main(argv: Sequence[str]) -> dict[str, Any]:
  common.parse_flags(FLAGS, argv)
  import jax
  import numpy as np

  on_gpu = jax.default_backend() == "gpu"
  reps = FLAGS.reps or (20 if on_gpu else 2)
  calls = 5 if on_gpu else 1
  bw = common.bandwidth_gbps()
  rng = np.random.default_rng(0)
  res = {"device": common.device_description(), "bandwidth": bw, "shapes": {}}
  rows = []
  for name, (kind, dims) in PRESETS[FLAGS.preset].items():
    configs = WGRAD_CONFIGS if kind == "wgrad" else TRANSPOSE_CONFIGS
    configs = configs if FLAGS.sweep else configs[:1]
    r = run_shape(name, kind, dims, configs, reps, calls, bw["copy_gbps"], rng)
    res["shapes"][name] = r
    for label, p in r["paths"].items():
      rows.append([name, label, f"{p['ms']:.4f}", f"{p['gbps']:.0f}", f"{p['frac_copy']:.0%}"])
    print(f"{name}: best {r['best_kernel']}, {r['kernel_over_xla']:.3f}x XLA's time", flush=True)
  text = (f"fp8_layouts on {jax.default_backend()}; copy {bw['copy_gbps']:.0f} GB/s; bits "
          "checked against XLA's\n" + common.format_table(
              ["shape", "path", "ms", "GB/s", "of copy"], rows))
  return common.finish(res, FLAGS, text)


if __name__ == "__main__":
  main(sys.argv)
