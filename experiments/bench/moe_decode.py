"""Decode-shaped MoE grouped matmuls: XLA paths against the Pallas kernel, BF16 and packed FP4.

For each (experts, decode batch) and each projection of a Qwen3-MoE-like layer (gate/up fused
as one [E, 2F, D] matmul, down [E, D, F]), with top-k routing drawn uniformly at random, times
side by side in one process:

- ragged_bf16: `grouped.grouped_matmul(..., "ragged_dot")` on BF16 weights;
- tiled_bf16: `grouped.grouped_matmul(..., "tiled")` on BF16 weights;
- kernel_bf16: `fp4_moe.grouped_matmul_decode` on BF16 weights;
- fq_ragged_fp4: today's FP4 path, `qat.fake_quant_weight(w, "nvfp4")` of the BF16 weights
  every call, then ragged_dot (as `Precision.expert_weights` + `MoE` run it);
- dq_ragged_fp4: XLA dequantization of the packed weights, then ragged_dot;
- kernel_fp4: `fp4_moe.grouped_matmul_decode` on the packed weights (`PackedNVFP4Weights`)
  with the codes as bytes (the float16 decoder; the kernel plan's `fp4_codes="bytes"`);
- kernel_fp4_words: the same kernel on the codes held as words per block
  (`PackedNVFP4Weights.as_words`, prepared once): one table per block (the plan's
  `fp4_codes="words"`, `decode_moe_kernel="triton"`);
- kernel_fp4_wgmma (GPU only): the words on Hopper's wgmma (`wgmma_moe`, impl="wgmma", the
  exact table; rows per pass `--block_m` or its default; the plan's
  `decode_moe_kernel="wgmma"`);
- kernel_fp4_wgmma_fast (GPU only): the same with the fast table.
Each case runs a `fp4_moe.DecodeConfig` (`kernel_opts` in the JSON: the flags' tiles).

Before timing, each kernel case's output is checked against its reference (kernel_bf16 against
ragged_bf16, the FP4 kernels against dq_ragged_fp4 and fq_ragged_fp4) within the float32-summation
+ one-ulp bound of tests/kernels/test_fp4_moe.py, and dequantize(pack(w)) against
fake_quant_weight(w) bit for bit, on the machine the benchmark runs on.

Per case: median ms per call (each sample: `--inner` calls back to back, then
`block_until_ready`, divided by `--inner`; median of `--reps` samples), bytes of weights touched
per call (experts with rows only, in the case's stored format: BF16, or codes + block scales +
tensor scale), the achieved GB/s of those bytes, that as a fraction of a jitted copy's
bandwidth (bytes read + written, measured in the same process), and the time relative to
ragged_bf16. Also per shape: the time of a trivial jitted call with the same arguments (the
dispatch floor: a case timed near it is bounded by the host, not the device). `--sweep` also
times the Triton kernel over `--sweep_configs` and reports the best.
The GPU figures are recorded by the lead in docs/benchmarks.md; this script records nothing
itself except `--json_out`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

from absl import flags

from experiments import common

FLAGS = flags.FlagValues()
flags.DEFINE_enum("preset", "qwen3_30b", ["qwen3_30b", "cpu"],
                  "qwen3_30b: hidden 2048, expert width 768, 64 and 128 experts, top-8, decode "
                  "batches 8/64/256. cpu: a tiny layer for a quick interpret-mode run.",
                  flag_values=FLAGS)
flags.DEFINE_list("experts", [], "Override the preset's expert counts.", flag_values=FLAGS)
flags.DEFINE_list("batches", [], "Override the preset's decode batches (tokens per step).",
                  flag_values=FLAGS)
flags.DEFINE_integer("hidden", 0, "Override the hidden size D.", flag_values=FLAGS)
flags.DEFINE_integer("width", 0, "Override the expert width F.", flag_values=FLAGS)
flags.DEFINE_integer("top_k", 0, "Override the experts per token.", flag_values=FLAGS)
flags.DEFINE_list("cases", [], "Cases to run (default: all).", flag_values=FLAGS)
flags.DEFINE_list("projections", ["gate_up", "down"], "Projections to run.", flag_values=FLAGS)
flags.DEFINE_integer("reps", 0, "Timing samples per case (0: 50 on GPU, 2 otherwise).",
                     flag_values=FLAGS)
flags.DEFINE_integer("inner", 0, "Calls per sample (0: 20 on GPU, 1 otherwise).",
                     flag_values=FLAGS)
flags.DEFINE_integer("warmup", 2, "Untimed samples first (compilation).", flag_values=FLAGS)
flags.DEFINE_integer("block_m", 0, "Kernel rows per block (0: default_block_m).",
                     flag_values=FLAGS)
flags.DEFINE_integer("block_n", 64, "Kernel output tile.", flag_values=FLAGS)
flags.DEFINE_integer("block_k", 256, "Kernel contraction tile.", flag_values=FLAGS)
flags.DEFINE_integer("num_warps", 4, "Triton warps.", flag_values=FLAGS)
flags.DEFINE_integer("num_stages", 3, "Triton pipeline stages.", flag_values=FLAGS)
flags.DEFINE_bool("sweep", False, "Also time the kernel cases over --sweep_configs.",
                  flag_values=FLAGS)
flags.DEFINE_list("sweep_configs",
                  ["64:256:16:4:3", "64:256:16:4:2", "128:128:16:4:2", "128:256:16:8:2",
                   "256:128:16:8:2", "128:256:16:4:3", "64:128:16:4:3", "64:256:32:4:2",
                   "64:256:16:4:3:bytes", "32:256:16:4:4:bytes"],
                  "block_n:block_k:block_m:num_warps:num_stages[:codes] entries of the Triton "
                  "kernel (codes: words, the default, or bytes; packed weights only).",
                  flag_values=FLAGS)
flags.DEFINE_integer("seed", 0, "PRNG seed.", flag_values=FLAGS)
flags.DEFINE_integer("copy_mib", 0, "Bandwidth-reference array size in MiB (0: "
                     "common.bandwidth_gbps' default, 4096 on GPU).",
                     flag_values=FLAGS)
flags.DEFINE_string("json_out", "runs/bench_moe_decode/bench.json",
                    "JSON output path ('' = none).", flag_values=FLAGS)


PRESETS = {
    "qwen3_30b": dict(experts=(64, 128), batches=(8, 64, 256), hidden=2048, width=768, top_k=8),
    "cpu": dict(experts=(8,), batches=(4,), hidden=128, width=64, top_k=2),
}
CASES = ("ragged_bf16", "tiled_bf16", "kernel_bf16", "fq_ragged_fp4", "dq_ragged_fp4",
         "kernel_fp4", "kernel_fp4_words", "kernel_fp4_wgmma", "kernel_fp4_wgmma_fast")
GPU_ONLY = ("kernel_fp4_wgmma", "kernel_fp4_wgmma_fast")  # Mosaic GPU with inline PTX
BASELINE = "ragged_bf16"
# kernel case -> the cases whose outputs it must match (same weights, float32 sums).
VERIFY = {"kernel_bf16": ("ragged_bf16",), "kernel_fp4": ("dq_ragged_fp4", "fq_ragged_fp4"),
          "kernel_fp4_words": ("dq_ragged_fp4", "kernel_fp4"),
          "kernel_fp4_wgmma": ("dq_ragged_fp4", "kernel_fp4_words"),
          "kernel_fp4_wgmma_fast": ("dq_ragged_fp4", "kernel_fp4_wgmma")}


def _kernel_opts(spec: str | None = None) -> tuple[dict[str, Any], str]:
  """(the Triton kernel's `DecodeConfig` fields, the packed codes' layout) from the flags, or
  from a sweep entry n:k:m:warps:stages[:codes] (codes: "words", the default, or "bytes")."""
  if spec is None:
    n, k, m, warps, stages = (FLAGS.block_n, FLAGS.block_k, FLAGS.block_m, FLAGS.num_warps,
                              FLAGS.num_stages)
    codes = "words"
  else:
    n, k, m, warps, stages, *rest = spec.split(":")
    codes = rest[0] if rest else "words"
    if codes not in ("words", "bytes"):
      raise ValueError(f"sweep entry {spec!r}: codes must be words or bytes, got {codes!r}")
  return dict(block_n=int(n), block_k=int(k), block_m=int(m) or None, num_warps=int(warps),
              num_stages=int(stages)), codes


def _fns(opts: dict[str, Any]) -> dict[str, Callable[..., Any]]:
  """case -> jitted fn(x, weights, group_sizes); weights is (bf16, packed, packed as words)."""
  import jax

  from trace_jax.kernels import fp4_moe
  from trace_jax.model import grouped
  from trace_jax.quant import qat

  triton = fp4_moe.DecodeConfig(**opts)
  wgmma = fp4_moe.DecodeConfig(impl="wgmma", block_m=opts["block_m"])
  wgmma_fast = fp4_moe.DecodeConfig(impl="wgmma", block_m=opts["block_m"], table="fast")
  return {
      "ragged_bf16": jax.jit(lambda x, w, gs: grouped.grouped_matmul(x, w[0], gs, "ragged_dot")),
      "tiled_bf16": jax.jit(lambda x, w, gs: grouped.grouped_matmul(x, w[0], gs, "tiled")),
      "kernel_bf16": jax.jit(lambda x, w, gs: fp4_moe.grouped_matmul_decode(
          x, w[0], gs, config=triton)),
      "fq_ragged_fp4": jax.jit(lambda x, w, gs: grouped.grouped_matmul(
          x, qat.fake_quant_weight(w[0], "nvfp4"), gs, "ragged_dot")),
      "dq_ragged_fp4": jax.jit(lambda x, w, gs: fp4_moe.grouped_matmul_reference(x, w[1], gs)),
      "kernel_fp4": jax.jit(lambda x, w, gs: fp4_moe.grouped_matmul_decode(
          x, w[1], gs, config=triton)),
      "kernel_fp4_words": jax.jit(lambda x, w, gs: fp4_moe.grouped_matmul_decode(
          x, w[2], gs, config=triton)),
      "kernel_fp4_wgmma": jax.jit(lambda x, w, gs: fp4_moe.grouped_matmul_decode(
          x, w[2], gs, config=wgmma)),
      "kernel_fp4_wgmma_fast": jax.jit(lambda x, w, gs: fp4_moe.grouped_matmul_decode(
          x, w[2], gs, config=wgmma_fast)),
  }


def _time(fn: Callable[[], Any], warmup: int, reps: int, inner: int) -> tuple[float, float]:
  """Median and min seconds per call; each sample is `inner` back-to-back calls."""
  import jax

  med, best = common.median_seconds(lambda: [fn() for _ in range(inner)],
                                    jax.block_until_ready, warmup, reps)
  return med / inner, best / inner


def _layer(e: int, d: int, f: int, seed: int) -> dict[str, Any]:
  """BF16 weights of one layer (gate/up fused [E, 2F, D], down [E, D, F]) and their packing
  (codes as bytes, and as words)."""
  import jax
  import jax.numpy as jnp

  from trace_jax.kernels import fp4_moe

  k1, k2 = jax.random.split(jax.random.key(seed))
  gate_up = (jax.random.normal(k1, (e, 2 * f, d), jnp.float32) * 0.02).astype(jnp.bfloat16)
  down = (jax.random.normal(k2, (e, d, f), jnp.float32) * 0.02).astype(jnp.bfloat16)
  pack = jax.jit(fp4_moe.pack_nvfp4)
  words = jax.jit(lambda p: p.as_words())
  out = {}
  for name, w in (("gate_up", gate_up), ("down", down)):
    p = jax.block_until_ready(pack(w))
    out[name] = (w, p, jax.block_until_ready(words(p)))
  return out


def _routing(b: int, e: int, top_k: int, seed: int) -> Any:
  """Group sizes [E] of b tokens each routed to top_k distinct uniformly random experts."""
  import jax
  import jax.numpy as jnp

  u = jax.random.uniform(jax.random.key(seed), (b, e))
  ids = jax.lax.top_k(u, top_k)[1].reshape(-1)
  return jnp.bincount(ids, length=e).astype(jnp.int32)


def _verify(outs: dict[str, Any], x: Any, w: tuple[Any, Any], gs: Any) -> dict[str, Any]:
  """Each kernel output against its references: max |diff| and the worst diff / bound."""
  import jax
  import jax.numpy as jnp

  from trace_jax.kernels import fp4_moe
  from trace_jax.model import grouped
  from trace_jax.quant import qat

  res: dict[str, Any] = {}
  k = x.shape[1]

  @jax.jit
  def bound_of(x, wd, gs):  # 2**-7 |r| + 2 K 2**-22 sum_k |x_k w_k| (see the test's docstring)
    s = grouped.grouped_matmul(jnp.abs(x).astype(jnp.float32), jnp.abs(wd).astype(jnp.float32),
                               gs, "ragged_dot")
    return s * (2 * k * 2.0**-22)

  for case, refs in VERIFY.items():
    if case not in outs:
      continue
    wd = w[0] if case == "kernel_bf16" else fp4_moe.dequantize(w[1], x.dtype)
    slack = bound_of(x, wd, gs)
    for ref in refs:
      if ref not in outs:
        continue
      y, r = outs[case].astype(jnp.float32), outs[ref].astype(jnp.float32)
      diff = jnp.abs(y - r)
      ratio = jnp.max(diff / (2.0**-7 * jnp.abs(r) + slack + 1e-30))
      res[f"{case}_vs_{ref}"] = {"max_abs_err": float(jnp.max(diff)),
                                 "worst_over_bound": float(ratio), "ok": bool(ratio <= 1.0)}
  fq = jax.jit(qat.fake_quant_weight)(w[0])
  dq = jax.jit(fp4_moe.dequantize, static_argnums=1)(w[1], w[0].dtype)
  same = jax.lax.bitcast_convert_type(fq, jnp.uint16) == jax.lax.bitcast_convert_type(dq,
                                                                                      jnp.uint16)
  res["dequant_bits_equal_fake_quant"] = bool(jnp.all(same))
  return res


def run_bench(seed: int = 0) -> dict[str, Any]:
  """Runs every (experts, batch, projection, case) and returns the results dict."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from trace_jax.kernels import fp4_moe

  backend = jax.default_backend()
  on_gpu = backend == "gpu"
  preset = dict(PRESETS[FLAGS.preset])
  experts = [int(v) for v in FLAGS.experts] or list(preset["experts"])
  batches = [int(v) for v in FLAGS.batches] or list(preset["batches"])
  d, f = FLAGS.hidden or preset["hidden"], FLAGS.width or preset["width"]
  top_k = FLAGS.top_k or preset["top_k"]
  reps, inner = FLAGS.reps or (50 if on_gpu else 2), FLAGS.inner or (20 if on_gpu else 1)
  cases = list(FLAGS.cases) or [c for c in CASES if on_gpu or c not in GPU_ONLY]
  unknown = sorted(set(cases) - set(CASES))
  if unknown:
    raise ValueError(f"unknown cases {unknown}; known: {CASES}")
  if not on_gpu and set(cases) & set(GPU_ONLY):
    raise ValueError(f"cases {sorted(set(cases) & set(GPU_ONLY))} run on a Hopper GPU only")
  opts, _ = _kernel_opts()
  dev = common.device_description()
  res: dict[str, Any] = {**dev, "preset": FLAGS.preset, "hidden": d, "width": f,
                         "top_k": top_k, "reps": reps, "inner": inner, "warmup": FLAGS.warmup,
                         "kernel_opts": opts, "shapes": []}
  print(f"bench_moe_decode: backend {backend}, device {dev['device_kind']}, jax "
        f"{jax.__version__}; D={d} F={f} top-{top_k}, experts {experts}, batches {batches}",
        flush=True)
  bw = common.bandwidth_gbps(FLAGS.copy_mib or None)
  res.update(bw)
  copy_bw = bw["copy_gbps"]
  print(f"copy bandwidth (read + write): {copy_bw:.1f} GB/s, read {bw['read_gbps']:.1f} GB/s",
        flush=True)
  fns = _fns(opts)
  for e in experts:
    if top_k > e:
      raise ValueError(f"top_k {top_k} > experts {e}")
    layer = _layer(e, d, f, seed)
    for b in batches:
      gs = _routing(b, e, top_k, seed + b)
      touched = int(np.sum(np.asarray(gs) > 0))
      m = b * top_k
      for proj in FLAGS.projections:
        w = layer[proj]
        k_in = w[0].shape[2]
        x = jax.random.normal(jax.random.key(seed + 7), (m, k_in), jnp.float32)
        x = x.astype(jnp.bfloat16)
        shape: dict[str, Any] = {"experts": e, "batch": b, "rows": m, "projection": proj,
                                 "n": int(w[0].shape[1]), "k": k_in, "touched": touched,
                                 "cases": {}}
        outs = {c: jax.block_until_ready(fns[c](x, w, gs)) for c in cases}
        shape["verify"] = _verify(outs, x, w, gs)
        del outs
        for c in cases:
          stored = w[1] if "fp4" in c and c != "fq_ragged_fp4" else w[0]
          nbytes = touched * fp4_moe.weight_bytes_per_expert(stored)
          med, best = _time(lambda c=c, x=x, w=w, gs=gs: fns[c](x, w, gs), FLAGS.warmup, reps,
                            inner)
          gbps = nbytes / med / 1e9
          shape["cases"][c] = {"median_ms": 1e3 * med, "min_ms": 1e3 * best,
                               "weight_bytes": nbytes, "gbps": gbps,
                               "frac_copy": gbps / copy_bw}
        # Per-call host cost of a jitted call with the same arguments: a case timed near it is
        # bounded by dispatch, not by the device (a whole decode step is one program).
        floor = jax.jit(lambda x, w, gs: x[0, 0])
        shape["dispatch_floor_ms"] = 1e3 * _time(lambda f=floor, x=x, w=w, gs=gs: f(x, w, gs),
                                                 FLAGS.warmup, reps, inner)[0]
        base = shape["cases"].get(BASELINE)
        for entry in shape["cases"].values():
          if base:
            entry["time_over_ragged_bf16"] = entry["median_ms"] / base["median_ms"]
        if FLAGS.sweep:
          shape["sweep"] = _sweep(x, w, gs, reps, inner, touched)
        res["shapes"].append(shape)
        print(format_shape(shape), flush=True)
  return res


def _sweep(x: Any, w: tuple[Any, Any], gs: Any, reps: int, inner: int,
           touched: int) -> dict[str, Any]:
  """Kernel timings over --sweep_configs; errors (e.g. a tile that does not compile) recorded."""
  import jax

  from trace_jax.kernels import fp4_moe

  out: dict[str, Any] = {}
  for kind in ("bf16", "fp4"):
    rows = {}
    for spec in FLAGS.sweep_configs:
      opts, codes = _kernel_opts(spec)
      if kind == "bf16" and codes != "words":
        continue  # a packed-only entry
      wk = w[0] if kind == "bf16" else w[2] if codes == "words" else w[1]
      try:
        config = fp4_moe.DecodeConfig(**opts)
        fn = jax.jit(lambda x, wk, gs, c=config: fp4_moe.grouped_matmul_decode(x, wk, gs,
                                                                               config=c))
        med, _ = _time(lambda fn=fn, wk=wk: fn(x, wk, gs), FLAGS.warmup, reps, inner)
        rows[spec] = {"median_ms": 1e3 * med,
                      "gbps": touched * fp4_moe.weight_bytes_per_expert(wk) / med / 1e9}
      except Exception as err:  # keep sweeping; the error goes into the record
        rows[spec] = {"error": f"{type(err).__name__}: {err}"[:300]}
    timed = {s: r for s, r in rows.items() if "median_ms" in r}
    best = min(timed, key=lambda s: timed[s]["median_ms"]) if timed else None
    out[kind] = {"configs": rows, "best": best}
  return out


def format_shape(shape: dict[str, Any]) -> str:
  """One shape's cases as an aligned table, with the verification and the headline ratios."""
  head = ["case", "median ms", "weight MB", "GB/s", "of copy", "t / t(ragged_bf16)"]
  rows = []
  for c, e in shape["cases"].items():
    rows.append([c, f"{e['median_ms']:.4f}", f"{e['weight_bytes'] / 1e6:.2f}",
                 f"{e['gbps']:.0f}", f"{100 * e['frac_copy']:.0f}%",
                 f"{e['time_over_ragged_bf16']:.3f}" if "time_over_ragged_bf16" in e else "-"])
  v = shape["verify"]
  checks = ", ".join(f"{name}: max|d| {r['max_abs_err']:.3g} ({'ok' if r['ok'] else 'FAIL'})"
                     for name, r in v.items() if isinstance(r, dict))
  lines = [f"E={shape['experts']} batch={shape['batch']} rows={shape['rows']} "
           f"{shape['projection']} [{shape['n']}x{shape['k']}], {shape['touched']} experts "
           f"touched",
           f"  verify: {checks}; dequant == fake_quant bits: "
           f"{v['dequant_bits_equal_fake_quant']}",
           f"  dispatch floor (a trivial jitted call, same arguments): "
           f"{shape.get('dispatch_floor_ms', float('nan')):.4f} ms",
           common.format_table(head, rows)]
  cs = shape["cases"]
  for num in ("kernel_fp4", "kernel_fp4_words", "kernel_fp4_wgmma", "kernel_fp4_wgmma_fast",
              "kernel_bf16"):
    if num in cs and BASELINE in cs:
      r = cs[num]["median_ms"] / cs[BASELINE]["median_ms"]
      lines.append(f"  {num} / {BASELINE} time: {r:.3f} (speed-up {1 / r:.2f}x)")
  for num in ("kernel_fp4", "kernel_fp4_words", "kernel_fp4_wgmma", "kernel_fp4_wgmma_fast"):
    if num in cs and "kernel_bf16" in cs:
      r = cs[num]["median_ms"] / cs["kernel_bf16"]["median_ms"]
      lines.append(f"  {num} / kernel_bf16 time: {r:.3f} (FP4 kernel {1 / r:.2f}x the BF16 "
                   f"kernel's speed)")
  if "kernel_fp4_wgmma" in cs and "kernel_fp4_words" in cs:
    r = cs["kernel_fp4_wgmma"]["median_ms"] / cs["kernel_fp4_words"]["median_ms"]
    lines.append(f"  kernel_fp4_wgmma / kernel_fp4_words time: {r:.3f} (wgmma {1 / r:.2f}x "
                 f"the Triton words kernel's speed)")
  for kind, s in shape.get("sweep", {}).items():
    if s["best"]:
      best = s["configs"][s["best"]]
      lines.append(f"  sweep {kind}: best {s['best']} {best['median_ms']:.4f} ms "
                   f"({best['gbps']:.0f} GB/s)")
  return "\n".join(lines)


def main(argv: Sequence[str]) -> dict[str, Any] | None:
  """Parses argv (argv[0] is the program name), benchmarks, prints and writes the JSON."""
  if not common.parse_flags(FLAGS, argv):
    return None
  common.set_gpu_memory_env()
  res = run_bench(FLAGS.seed)
  return common.finish(res, FLAGS)


if __name__ == "__main__":
  main(sys.argv)
