"""Decode attention over a BF16 vs a packed NVFP4 KV cache: XLA reference paths and the Pallas
kernel (`trace_jax.kernels.decode_attention`), side by side in one process.

Per case (context T, batch B; every sequence at full length T, one query token each):
  xla_bf16            `attention.attend` on a BF16 cache (the model's decode path)
  xla_fq_bf16         the same on a BF16 cache of NVFP4 fake-quantized values (today's FP4
                      path: FP4 values, BF16 bytes)
  xla_packed_dequant  XLA dequantizes the packed cache, then `attend` (what XLA does with the
                      packed bytes without a kernel)
  kernel_bf16         the kernel on the BF16 cache
  kernel_packed       the kernel on the packed cache as the engine holds it (reads ~3.4x fewer
                      KV bytes; codes in the kernel plan's default layout: on the GPU words
                      per block, one table per block, `fp4_decode.decode_words`), by the
                      Pallas/Triton kernels (`AttentionConfig(impl="triton")`)
  kernel_packed_wgmma  the same with `wgmma_attention`'s kernels (K decoded into wgmma's A
                      registers for the scores, V into shared memory for PV; GPU only; the
                      plan's `decode_attention="wgmma"`)
  kernel_bf16_fused / kernel_packed_fused  `flash_decode`'s single kernel (scores, online
                      softmax and PV in one pass: no scores in memory;
                      `AttentionConfig(impl="fused")`, the plan's `decode_attention="fused"`)
  kernel_packed_wgmma_fused  the single pass over the packed cache with the wgmma kernels'
                      decoders (`wgmma_flash`, `AttentionConfig(impl="wgmma_fused")`, the
                      plan's on Hopper; GPU only; 64-key tiles whatever `--block_t`)
  <wgmma path>_prefetch<d>  the same with L2 prefetches d tiles ahead of the decode
                      (`--prefetch`; `AttentionConfig.prefetch`)
  kernel_packed_wgmma_splits<s>  the wgmma pair with its PV kernel's keys in s splits
                      (`--pv_splits`; the default `wgmma_attention.default_splits`)
  kernel_packed_bits  the same cache with the codes as bytes (the bit-arithmetic decoder), for
                      the ratio in one process
  copy                `jnp.copy` of the BF16 K cache: the bandwidth reference (read + write)
First (`--decoder_check`), the packed cache's decoders are checked bit for bit on the device:
`decode_attention.dequantize_pallas` (the attention kernels' tile decode, in a kernel of its
own) of a cache holding every code byte under every E4M3 scale byte, with row scales inside and
beyond the fast table's range, against `kv_cache.dequantize` on the CPU (`formats`' values), for
the cache as the engine holds it (its layout's decoder) and as bytes (bits decoder), at key blocks
of 16 and `--block_t`. Before timing, every path is checked against the CPU reference of its
contract on the first `--check_seqs` sequences (`max_err_over_tol` <= 1: within
`decode_attention.output_tolerance`).
Times are medians of `--reps` calls (after `--warmup`), each call `--inner` repetitions in
sequence inside one jitted program (kept apart by `optimization_barrier`, so XLA can neither
share work between them nor overlap them) ended by `jax.block_until_ready`, divided by
`--inner`: small cases take microseconds, below the per-call dispatch cost. GB/s counts the
KV bytes each path must read (the packed cache's codes, block and row scales for the packed
paths); the copy's counts bytes read + written.

  python -m experiments.bench.decode_attention                  # Qwen3-30B-A3B attention (GPU)
  python -m experiments.bench.decode_attention --preset=cpu     # tiny, interpret mode, quick
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any

from absl import flags

from experiments import common

FLAGS = flags.FlagValues()
flags.DEFINE_enum("preset", "qwen3", ["qwen3", "cpu"], "qwen3: Qwen3-30B-A3B attention (32 query "
                  "heads, 4 KV heads, head_dim 128, contexts 1k/8k, batch 8/64/256); cpu: tiny.",
                  flag_values=FLAGS)
flags.DEFINE_list("contexts", [], "Context lengths T (default per preset).", flag_values=FLAGS)
flags.DEFINE_list("batches", [], "Batch sizes B (default per preset).", flag_values=FLAGS)
flags.DEFINE_integer("heads", 0, "Query heads N (0: per preset).", flag_values=FLAGS)
flags.DEFINE_integer("kv_heads", 0, "KV heads G (0: per preset).", flag_values=FLAGS)
flags.DEFINE_integer("head_dim", 0, "Head dim H (0: per preset).", flag_values=FLAGS)
flags.DEFINE_list("impls", [], "Paths to run (default: all); copy always runs.",
                  flag_values=FLAGS)
flags.DEFINE_integer("block_t", 64, "Kernel key block.", flag_values=FLAGS)
flags.DEFINE_integer("num_splits", 0, "Kernel key splits (0: the kernel's default).",
                     flag_values=FLAGS)
flags.DEFINE_integer("num_warps", 4, "Kernel warps per program.", flag_values=FLAGS)
flags.DEFINE_integer("num_stages", 2, "Kernel pipeline stages.", flag_values=FLAGS)
flags.DEFINE_list("prefetch", ["1"], "L2 prefetch distances of the wgmma kernels "
                  "(AttentionConfig.prefetch, in 64-key tiles; its default 1): the first runs "
                  "the wgmma paths, each other adds `<wgmma path>_prefetch<d>` beside them.",
                  flag_values=FLAGS)
flags.DEFINE_list("pv_splits", [], "Key splits of the wgmma PV kernel: each adds "
                  "`kernel_packed_wgmma_splits<s>` beside the wgmma pair (GPU only).",
                  flag_values=FLAGS)
flags.DEFINE_integer("reps", 0, "Timed calls per path (0: 30 on GPU, 3 otherwise).",
                     flag_values=FLAGS)
flags.DEFINE_integer("warmup", 2, "Untimed calls first (compilation).", flag_values=FLAGS)
flags.DEFINE_integer("inner", 0, "Repetitions per timed call (0: 8 on GPU, 1 otherwise).",
                     flag_values=FLAGS)
flags.DEFINE_integer("check_seqs", 4, "Sequences checked against the CPU reference.",
                     flag_values=FLAGS)
flags.DEFINE_integer("seed", 0, "PRNG seed.", flag_values=FLAGS)
flags.DEFINE_bool("decoder_check", True, "Check the packed cache's decoders bit for bit on the "
                  "device first.", flag_values=FLAGS)
flags.DEFINE_string("json_out", "runs/bench_decode_attention/bench.json",
                    "JSON output path ('' = none).", flag_values=FLAGS)

PRESETS = {
    "qwen3": dict(contexts=[1024, 8192], batches=[8, 64, 256], heads=32, kv_heads=4,
                  head_dim=128),
    "cpu": dict(contexts=[64], batches=[2], heads=8, kv_heads=2, head_dim=64),
}
IMPLS = ("xla_bf16", "xla_fq_bf16", "xla_packed_dequant", "kernel_bf16", "kernel_packed",
         "kernel_packed_bits", "kernel_packed_wgmma", "kernel_bf16_fused", "kernel_packed_fused",
         "kernel_packed_wgmma_fused")
GPU_ONLY = ("kernel_packed_wgmma", "kernel_packed_wgmma_fused")  # Mosaic GPU + inline PTX
COPY = "copy"
# The cache each path reads, and the contract its output is checked against.
CACHE_OF = {"xla_bf16": "bf16", "xla_fq_bf16": "fq_bf16", "xla_packed_dequant": "packed",
            "kernel_bf16": "bf16", "kernel_packed": "packed", "kernel_packed_bits": "packed_bytes",
            "kernel_packed_wgmma": "packed",
            "kernel_bf16_fused": "bf16", "kernel_packed_fused": "packed",
            "kernel_packed_wgmma_fused": "packed"}


def _nbytes(tree: Any) -> int:
  import jax
  import numpy as np

  return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


def _repeated(fn: Callable[..., Any], inner: int) -> Callable[..., Any]:
  """jit of `inner` calls fn(*args) in sequence, as decode steps run: each gets its arguments
  through an optimization barrier that also holds the previous call's output (and a distinct
  constant), so XLA can neither merge the calls, nor hoist work on the shared inputs (e.g. a
  cache transpose) out of them, nor overlap them (which would multiply temporary memory)."""
  import jax
  import jax.numpy as jnp

  @jax.jit
  def many(*args):
    prev, outs = jnp.int32(0), []
    for i in range(inner):
      *a, _, _ = jax.lax.optimization_barrier((*args, jnp.int32(i), prev))
      prev = fn(*a)
      outs.append(prev)
    return outs

  return many


def _inputs(b: int, t: int, g: int, n: int, h: int, seed: int) -> dict[str, Any]:
  """q [B, N, H], the caches (BF16, fake-quantized BF16, packed in the engine's codes layout,
  packed with the codes as bytes) and lengths (= T)."""
  import jax
  import jax.numpy as jnp

  from trace_jax.kernels import kv_cache
  from trace_jax.model import plan

  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  shape = (b, t, g, h)
  k = jax.jit(lambda key: jax.random.normal(key, shape, jnp.bfloat16))(kk)
  v = jax.jit(lambda key: jax.random.normal(key, shape, jnp.bfloat16))(kv)
  # Scores of std ~3 (RMS-normed q/k typically give a few units).
  q = jax.jit(lambda key: (3 * jax.random.normal(key, (b, n, h), jnp.float32)
                           ).astype(jnp.bfloat16))(kq)
  packed = jax.block_until_ready(kv_cache.pack_rows(k, v,
                                                   words=plan.default_codes() == "words"))
  fq = jax.block_until_ready(kv_cache.dequantize(packed, jnp.bfloat16))
  return {"q": q, "lengths": jnp.full((b,), t, jnp.int32),
          "bf16": (k, v), "fq_bf16": fq, "packed": packed,
          "packed_bytes": jax.block_until_ready(packed.as_bytes())}


def _cpu_reference(q: Any, cache: Any, lengths: Any, c: int) -> tuple[Any, Any]:
  """The contract's output and tolerance on the first c sequences, computed on the CPU."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from trace_jax.kernels import decode_attention as da
  from trace_jax.kernels import kv_cache

  cpu = jax.devices("cpu")[0]
  args = jax.device_put(jax.tree.map(lambda a: a[:c], (q, cache, lengths)), cpu)
  with jax.default_device(cpu):
    qc, cc, lc = args
    ref = jax.jit(da.decode_attention_reference)(qc, cc, lc).astype(jnp.float32)
    vals = (kv_cache.dequantize(cc, jnp.bfloat16)[1]
            if isinstance(cc, kv_cache.PackedKVCache) else cc[1])
    tol = da.output_tolerance(vals, lc, ref, q.shape[1])
  return np.asarray(ref), np.asarray(tol)


def base_impl(name: str) -> str:
  """The path a variant `<wgmma path>_prefetch<d>` or `kernel_packed_wgmma_splits<s>` varies
  (else the name itself)."""
  return name.split("_prefetch")[0].split("_splits")[0]


def _paths(n_heads: int, block_t: int, num_splits: int, num_warps: int, num_stages: int,
           prefetch: Sequence[int] = (), pv_splits: Sequence[int] = ()
           ) -> dict[str, Callable[..., Any]]:
  """path -> fn(q, cache, lengths); the kernels' `AttentionConfig`s from the flags."""
  from trace_jax.kernels import decode_attention as da
  from trace_jax.kernels import wgmma_decode

  config = functools.partial(da.AttentionConfig, block_t=block_t, num_splits=num_splits or None,
                             num_warps=num_warps, num_stages=num_stages)
  prefetch = tuple(prefetch) or (da.AttentionConfig().prefetch,)
  kernel = lambda impl, d=prefetch[0]: functools.partial(  # the wgmma single pass: 64-key tiles
      da.decode_attention, config=config(impl=impl, prefetch=d, **(
          {"block_t": wgmma_decode.TILE} if impl == "wgmma_fused" else {})))
  ref = da.decode_attention_reference
  variants = {f"{path}_prefetch{d}": kernel(path[len("kernel_packed_"):], d)
              for path in GPU_ONLY for d in prefetch[1:]}
  variants.update({f"kernel_packed_wgmma_splits{sp}": functools.partial(
      da.decode_attention, config=config(impl="wgmma", prefetch=prefetch[0], num_splits=sp))
      for sp in pv_splits})
  return {**variants, "xla_bf16": ref, "xla_fq_bf16": ref, "xla_packed_dequant": ref,
          "kernel_bf16": kernel("triton"), "kernel_packed": kernel("triton"),
          "kernel_packed_bits": kernel("triton"), "kernel_packed_wgmma": kernel("wgmma"),
          "kernel_bf16_fused": kernel("fused"), "kernel_packed_fused": kernel("fused"),
          "kernel_packed_wgmma_fused": kernel("wgmma_fused")}


# The time ratios every case records (impl a's time over impl b's), where both ran.
TIME_RATIOS = (
    ("kernel_packed", "kernel_bf16"), ("kernel_packed_wgmma", "kernel_packed"),
    ("kernel_packed_wgmma", "kernel_bf16"), ("kernel_packed_fused", "kernel_packed_wgmma"),
    ("kernel_packed_fused", "kernel_packed"), ("kernel_bf16_fused", "kernel_bf16"),
    ("kernel_packed_wgmma_fused", "kernel_packed_wgmma"),
    ("kernel_packed_wgmma_fused", "kernel_bf16_fused"),
    ("kernel_packed_fused", "kernel_bf16_fused"), ("kernel_packed_bits", "kernel_bf16"),
    ("kernel_packed", "kernel_packed_bits"), ("kernel_packed", "xla_fq_bf16"),
    ("kernel_bf16", "xla_bf16"), ("xla_packed_dequant", "xla_fq_bf16"))


def _time_paths(case: dict[str, Any], timed: Sequence[tuple[str, Any, tuple, int]],
                warmup: int, reps: int, inner: int) -> None:
  """Times each (name, fn, args, bytes moved) of `timed` into case["impls"][name] (median and
  best ms per call, GB/s; an error recorded instead of raised), printing a line each, then
  each impl's fraction of the copy's GB/s."""
  import jax

  for name, fn, args, nbytes in timed:
    entry = case["impls"].setdefault(name, {"bytes_moved": nbytes})
    try:
      med, best = common.median_seconds(lambda fn=fn, args=args: fn(*args),
                                        jax.block_until_ready, warmup, reps)
      entry.update(median_ms=1e3 * med / inner, min_ms=1e3 * best / inner,
                   gbps=nbytes / (med / inner) / 1e9)
    except Exception as e:
      entry["error"] = f"{type(e).__name__}: {e}"[:800]
    if "median_ms" in entry:
      msg = f"{entry['median_ms']:9.4f} ms {entry['gbps']:8.1f} GB/s"
      if "max_err_over_tol" in entry:
        msg += f"  err/tol {entry['max_err_over_tol']:.3f}"
    else:
      msg = entry["error"][:200]
    print(f"  B={case['batch']:<4d} T={case['context']:<6d} {name:20s} {msg}", flush=True)
  copy_gbps = case["impls"][COPY].get("gbps")
  case["copy_gbps"] = copy_gbps
  for e in case["impls"].values():
    if copy_gbps and "gbps" in e:
      e["frac_copy"] = e["gbps"] / copy_gbps


def run_case(b: int, t: int, g: int, n: int, h: int, impls: Sequence[str], reps: int,
             warmup: int, inner: int, check_seqs: int, seed: int,
             kernel_args: dict[str, Any]) -> dict[str, Any]:
  """One (B, T) case: every selected path checked, then timed; returns its record."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from trace_jax.kernels import decode_attention as da
  from trace_jax.kernels import wgmma_attention, wgmma_decode

  inp = _inputs(b, t, g, n, h, seed)
  paths = _paths(n, **kernel_args)
  kv_bytes = {name: _nbytes(inp[name]) for name in ("bf16", "fq_bf16", "packed",
                                                     "packed_bytes")}
  case: dict[str, Any] = {"batch": b, "context": t, "heads": n, "kv_heads": g, "head_dim": h,
                          "kv_bytes": kv_bytes, "impls": {}}
  if not kernel_args["num_splits"]:
    case["kernel_num_splits"] = da.default_num_splits(b, g, -(-t // kernel_args["block_t"]))
    case["wgmma_num_splits"] = wgmma_attention.default_splits(b, g, t // wgmma_decode.TILE,
                                                               da.SM_COUNT)
  c = min(check_seqs, b)
  refs = {kind: _cpu_reference(inp["q"], inp[kind], inp["lengths"], c)
          for kind in sorted({CACHE_OF[base_impl(i)] for i in impls})}
  copy_fn = _repeated(jnp.copy, inner)
  timed = [(COPY, copy_fn, (inp["bf16"][0],), 2 * _nbytes(inp["bf16"][0]))]
  for name in impls:
    kind = CACHE_OF[base_impl(name)]
    entry: dict[str, Any] = {"cache": kind, "kv_bytes": kv_bytes[kind]}
    case["impls"][name] = entry
    try:
      out = np.asarray(jax.jit(paths[name])(inp["q"], inp[kind], inp["lengths"])
                       [:c]).astype(np.float32)
      ref, tol = refs[kind]
      err = np.abs(out - ref)
      entry.update(max_abs_err=float(err.max()), max_err_over_tol=float((err / tol).max()),
                   check_ok=bool(np.all(err <= tol) and np.all(np.isfinite(out))))
      timed.append((name, _repeated(paths[name], inner),
                    (inp["q"], inp[kind], inp["lengths"]), kv_bytes[kind]))
    except Exception as e:  # keep benchmarking the rest; the error goes into the record
      entry["error"] = f"{type(e).__name__}: {e}"[:800]
  _time_paths(case, timed, warmup, reps, inner)
  ms = {k: e.get("median_ms") for k, e in case["impls"].items()}
  ratio = lambda a, b: ms[a] / ms[b] if ms.get(a) and ms.get(b) else None
  case["ratios"] = {"kv_bytes_packed_over_bf16": kv_bytes["packed"] / kv_bytes["bf16"]}
  case["ratios"].update({f"time_{a}_over_{b}": ratio(a, b) for a, b in TIME_RATIOS})
  for name in impls:
    if base_impl(name) != name:
      case["ratios"][f"time_{name}_over_{base_impl(name)}"] = ratio(name, base_impl(name))
  return case


def every_byte_cache(h: int, seed: int = 0) -> Any:
  """A one-sequence, one-head packed cache [1, T, 1, h] (codes as bytes) holding every code byte
  under every E4M3 scale byte (NaN scales 0x7F/0xFF included): T = 8192 * 16 / h rows; the row
  scales log-normal, one row in 5 exactly 1, the last eighth beyond the fast table's range
  (2**118 .. 2**127: the exact table; no product subnormal, which a CPU reference flushes)."""
  import jax.numpy as jnp
  import numpy as np

  from trace_jax.kernels import kv_cache

  kb = h // 16
  t = 256 * 256 // (8 * kb)  # rows: 256 scale bytes x 256 code bytes, 8 code bytes a block
  j = np.arange(t * 8 * kb)
  codes = (j % 256).astype(np.uint8).reshape(1, t, 1, 8 * kb)
  block = (np.arange(t * kb) // 32 % 256).astype(np.uint8).reshape(1, t, 1, kb)
  rng = np.random.default_rng(seed)
  row = np.exp(rng.standard_normal(t)).astype(np.float32)
  row[::5] = 1.0
  row[t - t // 8:] = np.exp2(rng.uniform(118, 127, t // 8))
  row = row.reshape(1, t, 1)
  rev = lambda a: np.ascontiguousarray(a[:, ::-1])
  return kv_cache.PackedKVCache(
      k_codes=jnp.asarray(codes), v_codes=jnp.asarray(rev(codes)),
      k_block=jnp.asarray(block.view(jnp.float8_e4m3fn)),
      v_block=jnp.asarray(rev(block).view(jnp.float8_e4m3fn)),
      k_row=jnp.asarray(row), v_row=jnp.asarray(rev(row)))


def decoder_check(h: int, block_ts: Sequence[int], words: bool) -> dict[str, Any]:
  """{"<layout>_<decoder>_bt<block_t>": {"bits_equal", "mismatches", "nan_mismatches"}}:
  `dequantize_pallas` on the device vs `kv_cache.dequantize` on the CPU, bf16, for the cache
  of `every_byte_cache` as the engine holds it (`words`: the kernel plan's fp4_codes; its
  default decoder) and as bytes (bits)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from trace_jax.kernels import decode_attention as da
  from trace_jax.kernels import kv_cache

  cache = every_byte_cache(h)
  cpu = jax.devices("cpu")[0]
  with jax.default_device(cpu):
    want = [np.asarray(x) for x in jax.jit(kv_cache.dequantize, static_argnames="dtype")(
        jax.device_put(cache, cpu), dtype=jnp.bfloat16)]
  engine = cache.as_words() if words else cache
  variants = {("words" if engine.words else "bytes") + "_default": engine, "bytes_bits": cache}
  out: dict[str, Any] = {}
  for name, c in variants.items():
    for bt in block_ts:
      key = f"{name}_bt{bt}"
      try:
        got = [np.asarray(x) for x in da.dequantize_pallas(
            c, jnp.bfloat16, config=da.AttentionConfig(block_t=bt))]
      except Exception as e:  # the record keeps the error; the benchmark goes on
        out[key] = {"error": f"{type(e).__name__}: {e}"[:400]}
        continue
      mism = nan_mism = 0
      for w, x in zip(want, got):
        nan = np.isnan(w.astype(np.float32))
        nan_mism += int(np.sum(np.isnan(x.astype(np.float32)) != nan))
        mism += int(np.sum(w.view(np.uint16)[~nan] != x.view(np.uint16)[~nan]))
      out[key] = {"bits_equal": mism == 0 and nan_mism == 0, "mismatches": mism,
                  "nan_mismatches": nan_mism}
  return out


def run_bench(preset: str, contexts: Sequence[int], batches: Sequence[int], n: int, g: int,
              h: int, impls: Sequence[str], reps: int, warmup: int, inner: int,
              check_seqs: int, seed: int, kernel_args: dict[str, Any],
              decoder_checks: bool = False) -> dict[str, Any]:
  import jax

  from trace_jax.model import plan

  unknown = sorted(set(impls) - set(IMPLS))
  if unknown:
    raise ValueError(f"unknown impls {unknown}; known: {list(IMPLS)}")
  on_gpu = jax.default_backend() == "gpu"
  impls = [i for i in IMPLS if i in impls or not impls and (on_gpu or i not in GPU_ONLY)]
  impls += [f"{i}_prefetch{d}" for i in impls if i in GPU_ONLY
            for d in kernel_args.get("prefetch", (0,))[1:]]
  if "kernel_packed_wgmma" in impls:
    impls += [f"kernel_packed_wgmma_splits{sp}" for sp in kernel_args.get("pv_splits", ())]
  reps = reps or (30 if on_gpu else 3)
  inner = inner or (8 if on_gpu else 1)
  dev = common.device_description()
  res: dict[str, Any] = {**dev, "preset": preset, "reps": reps, "warmup": warmup,
                         "inner": inner, "kernel": kernel_args,
                         "interpret": not on_gpu, "cases": []}
  print(f"bench_decode_attention: {dev['backend']} ({dev['device_kind']}), jax {jax.__version__},"
        f" N={n} G={g} H={h}, kernel {kernel_args}, interpret={not on_gpu}", flush=True)
  if decoder_checks:
    res["decoder_check"] = decoder_check(h, sorted({16, kernel_args["block_t"]}),
                                         words=plan.default_codes() == "words")
    for k, v in res["decoder_check"].items():
      msg = (v["error"][:160] if "error" in v else
             f"bits equal {v['bits_equal']} ({v['mismatches']} value, {v['nan_mismatches']} NaN "
             "mismatches)")
      print(f"  decoder check {k}: {msg}", flush=True)
  for t in contexts:
    for b in batches:
      res["cases"].append(run_case(b, t, g, n, h, impls, reps, warmup, inner, check_seqs,
                                   seed, kernel_args))
  return res


def format_bench(res: dict[str, Any]) -> str:
  """The results as one aligned table, then the ratios per case."""
  head = ["B", "T", "path", "ms", "KV MB", "GB/s", "of copy", "err/tol"]
  rows, ratio_lines = [], []
  for c in res["cases"]:
    for name, e in c["impls"].items():
      mb = e.get("kv_bytes", e.get("bytes_moved", 0)) / 1e6
      rows.append([c["batch"], c["context"], name,
                   f"{e['median_ms']:.4f}" if "median_ms" in e else "error",
                   f"{mb:.1f}", f"{e['gbps']:.0f}" if "gbps" in e else "-",
                   f"{100 * e['frac_copy']:.0f}%" if "frac_copy" in e else "-",
                   f"{e['max_err_over_tol']:.3f}" if "max_err_over_tol" in e else "-"])
    r = {k: (f"{v:.3f}" if v is not None else "-") for k, v in c["ratios"].items()}
    ratio_lines.append(f"B={c['batch']} T={c['context']}: " + ", ".join(
        f"{k} {v}" for k, v in r.items()))
  return "\n".join([
      f"bench_decode_attention on {res['backend']} ({res['device_kind']}), median of "
      f"{res['reps']} x {res['inner']} after {res['warmup']} warm-up; copy = read + write",
      common.format_table(head, rows), *ratio_lines])


def main(argv: Sequence[str]) -> dict[str, Any] | None:
  """Parses argv (argv[0] is the program name), benchmarks, prints and writes the JSON."""
  if not common.parse_flags(FLAGS, argv):
    return None
  common.set_gpu_memory_env()
  p = PRESETS[FLAGS.preset]
  kernel_args = dict(block_t=FLAGS.block_t, num_splits=FLAGS.num_splits,
                     num_warps=FLAGS.num_warps, num_stages=FLAGS.num_stages,
                     prefetch=tuple(int(d) for d in FLAGS.prefetch),
                     pv_splits=tuple(int(sp) for sp in FLAGS.pv_splits))
  if any(d < 0 for d in kernel_args["prefetch"]):
    raise ValueError(f"--prefetch: distances must be >= 0, got {FLAGS.prefetch}")
  if any(sp < 1 for sp in kernel_args["pv_splits"]):
    raise ValueError(f"--pv_splits: splits must be >= 1, got {FLAGS.pv_splits}")
  res = run_bench(FLAGS.preset, [int(x) for x in FLAGS.contexts] or p["contexts"],
                  [int(x) for x in FLAGS.batches] or p["batches"], FLAGS.heads or p["heads"],
                  FLAGS.kv_heads or p["kv_heads"], FLAGS.head_dim or p["head_dim"], FLAGS.impls,
                  FLAGS.reps, FLAGS.warmup, FLAGS.inner, FLAGS.check_seqs, FLAGS.seed,
                  kernel_args, decoder_checks=FLAGS.decoder_check)
  return common.finish(res, FLAGS, format_bench(res))


if __name__ == "__main__":
  main(sys.argv)
