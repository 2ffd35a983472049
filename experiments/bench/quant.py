"""Quantize / dequantize throughput of `trace_jax.quant`, against the measured copy bandwidth.

Every op is jitted and timed on one large [rows, K] array (median of `--reps` samples after
`--warmup` calls; on GPU a sample is 10 calls dispatched back to back and ended by one
`block_until_ready`, so a sync's round trip does not count in sub-millisecond ops). For each op
the table gives the time, the throughput in GB/s of input bytes read, the GB/s of bytes moved
(inputs read + outputs written, as the arrays are held: JAX keeps one byte per FP4 code), and
that bandwidth as a fraction of a plain copy (`jnp.copy`, bytes read + written) measured in the
same run (docs/design.md §9: ratios side by side, and the fraction of the limit reached). Where
torch is importable, the torch twin (`rollout_bridge.torch_quant`, eager) is timed on the same
device for the same ops, and the table gives JAX's throughput over torch's. On CPU the twin is
slow, so by default it runs on the first `--torch_max_elements` elements only (throughput is per
element, so the ratio holds).

Default size: 2**28 (256M) elements on GPU, 2**24 (16M) elsewhere. The GPU figures are recorded
by the lead in docs/benchmarks.md; this script records nothing itself except `--json_out`.

`--sites` runs a different comparison instead of the table: an NVFP4 activation site's
quantize-dequantize at the decode site shapes (`--site_shapes`, rows in `--dtype`), XLA's path
(`formats.fp4_quantize_act` + `fp4_dequantize(...).astype`) against the one-kernel
`kernels.nvfp4_act.quantize_rows`, both jitted, in one process. Each timed program chains
`--site_chain` site calls (each call's y is the next call's x) so that host dispatch does not
hide the per-site device cost; the table gives the time per site call, one jitted call's time,
XLA's time over the kernel's, the optimized HLO's entry ops (about the kernels launched on GPU),
and whether both paths' outputs (y, codes, block scales, row scales) are bit-identical.
"""

from __future__ import annotations

import dataclasses
import platform
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

from absl import flags

from experiments import common

FLAGS = flags.FlagValues()
flags.DEFINE_integer("size", 0, "Elements of the input (0: 2**28 on GPU, 2**24 otherwise); "
                     "rounded down to a multiple of --k.", flag_values=FLAGS)
flags.DEFINE_integer("k", 4096, "Contraction size (last axis); a multiple of 128.",
                     flag_values=FLAGS)
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Input dtype.", flag_values=FLAGS)
flags.DEFINE_integer("reps", 0, "Timed calls per op (0: 20 on GPU, 5 otherwise).",
                     flag_values=FLAGS)
flags.DEFINE_integer("warmup", 2, "Untimed calls per op first (compilation, allocation).",
                     flag_values=FLAGS)
flags.DEFINE_bool("torch", True, "Also time the torch twin (if torch imports).", flag_values=FLAGS)
flags.DEFINE_string("torch_device", "", "Torch device ('': cuda when JAX runs on GPU and torch "
                    "sees CUDA, else cpu).", flag_values=FLAGS)
flags.DEFINE_integer("torch_reps", 0, "Timed torch calls per op (0: 10 on GPU, 3 otherwise).",
                     flag_values=FLAGS)
flags.DEFINE_integer("torch_max_elements", -1, "Time torch on at most this many leading elements "
                     "(-1: all on GPU, 2**18 on CPU; 0: all).", flag_values=FLAGS)
flags.DEFINE_list("ops", [], "Ops to run (default: all); the copy reference always runs.",
                  flag_values=FLAGS)
flags.DEFINE_integer("seed", 0, "PRNG seed of the input.", flag_values=FLAGS)
flags.DEFINE_string("json_out", "runs/bench_quant/bench.json", "JSON output path ('' = none).",
                    flag_values=FLAGS)
flags.DEFINE_bool("sites", False, "Instead of the op table: time the decode sites' NVFP4 "
                  "quantize-dequantize, XLA's path against the one-kernel nvfp4_act.quantize_rows, "
                  "and check that their outputs are bit-identical.", flag_values=FLAGS)
flags.DEFINE_list("site_shapes", ["64x2048", "512x768", "512x128"], "--sites: row shapes MxK "
                  "(K a multiple of 16).", flag_values=FLAGS)
flags.DEFINE_integer("site_chain", 8, "--sites: site calls chained in each timed jitted program "
                     "(times are reported per site call).", flag_values=FLAGS)

GPU_SIZE = 2**28
CPU_SIZE = 2**24
COPY = "copy"


@dataclasses.dataclass
class Op:
  """One benchmarked op: a JAX function of named inputs, and optionally its torch twin."""
  name: str
  fn: Callable[..., Any]
  inputs: tuple[str, ...]
  torch_fn: Callable[..., Any] | None = None
  note: str = ""


def _ops() -> list[Op]:
  """The benchmarked ops; inputs name arrays built by `_jax_inputs` / `_torch_inputs`."""
  import jax
  import jax.numpy as jnp

  from trace_jax import quant
  from trace_jax.kernels import nvfp4_act

  def fq_fwd_bwd(x, ct):
    y, vjp = jax.vjp(quant.fake_quant_act, x)
    return y, vjp(ct)[0]

  def fq_guided_fwd_bwd(x, g, ct):
    y, vjp = jax.vjp(lambda v: quant.fake_quant_act_guided(v, g), x)
    return y, vjp(ct)[0]

  try:
    from rollout_bridge import torch_quant as tq
  except ImportError:
    tq = None

  def t(fn_name: str) -> Callable[..., Any] | None:
    return None if tq is None else getattr(tq, fn_name)

  return [
      Op(COPY, jnp.copy, ("x",), None if tq is None else lambda x: x.clone(),
         "reference: bytes read + written"),
      Op("add_one", lambda x: x + jnp.asarray(1, x.dtype), ("x",),
         None if tq is None else lambda x: x + 1, "elementwise, same bytes as copy"),
      Op("nvfp4_quantize_1level", quant.nvfp4_quantize, ("x",), t("nvfp4_quantize")),
      Op("nvfp4_quantize_2level", lambda x: quant.nvfp4_quantize(x, quant.nvfp4_row_scale(x)),
         ("x",), None if tq is None else lambda x: tq.nvfp4_quantize(x, tq.nvfp4_row_scale(x)),
         "per-row second-level scale (activations)"),
      Op("nvfp4_dequantize", quant.nvfp4_dequantize, ("q_nvfp4",), t("nvfp4_dequantize"),
         "two-level, float32 out"),
      Op("mxfp4_quantize", quant.mxfp4_quantize, ("x",), t("mxfp4_quantize")),
      Op("mxfp4_dequantize", quant.mxfp4_dequantize, ("q_mxfp4",), t("mxfp4_dequantize"),
         "float32 out"),
      Op("fp8_quantize_act", quant.fp8_quantize_act, ("x",), t("fp8_quantize_act")),
      Op("fp8_dequantize", quant.fp8_dequantize, ("q_fp8",), t("fp8_dequantize"), "float32 out"),
      Op("nvfp4_record_compact", lambda x: quant.quantize_act_record(x, "compact"), ("x",), None,
         "rollout: quantize-dequantize + compact guidance record"),
      Op("guided_codes_compact", quant.guided_codes, ("x", "g_compact"), t("guided_codes")),
      Op("guided_codes_full", quant.guided_codes, ("x", "g_full"), t("guided_codes")),
      Op("fake_quant_fwd", quant.fake_quant_act, ("x",), None, "NVFP4 RTN qdq, custom_vjp"),
      Op("fake_quant_fwd_bwd", fq_fwd_bwd, ("x", "ct"), None, "forward + straight-through vjp"),
      Op("fake_quant_guided_fwd", quant.fake_quant_act_guided, ("x", "g_compact"), None,
         "compact guidance"),
      Op("fake_quant_guided_fwd_bwd", fq_guided_fwd_bwd, ("x", "g_compact", "ct"), None),
      Op("fake_quant_fp8_fwd", lambda x: quant.fake_quant_act(x, "fp8"), ("x",), None,
         "Jet-RL unified FP8"),
      Op("qdq_rows_xla", nvfp4_act.qdq_reference, ("x", "ts_rows"), None,
         "NVFP4 qdq under given row scales (the weights' fake quantizer), XLA"),
      Op("qdq_rows_kernel", nvfp4_act.qdq_rows, ("x", "ts_rows"), None,
         "the same, one Pallas kernel (fake_quant='kernel')"),
      Op("guided_qdq_rows_kernel", nvfp4_act.guided_qdq_rows, ("x", "g_compact"), None,
         "fake_quant_guided_fwd in one Pallas kernel"),
  ]


def _nbytes(tree: Any) -> int:
  import jax
  import numpy as np

  return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
             for a in jax.tree.leaves(tree))


def _jax_inputs(rows: int, k: int, dtype: str, seed: int, needed: set[str]) -> dict[str, Any]:
  """The input x (Gaussian rows with log-normal row scales) and what the ops derive from it."""
  import jax
  import jax.numpy as jnp

  from trace_jax import quant

  @jax.jit
  def make(key):
    kx, kr, kc = jax.random.split(key, 3)
    x = jax.random.normal(kx, (rows, k), jnp.float32)
    x = x * jnp.exp(jax.random.normal(kr, (rows, 1), jnp.float32))
    ct = jax.random.normal(kc, (rows, k), jnp.float32)
    return x.astype(dtype), ct.astype(jnp.bfloat16)

  x, ct = make(jax.random.key(seed))
  out: dict[str, Any] = {"x": x}
  if "ct" in needed:
    out["ct"] = ct
  del ct
  builders = {
      "q_nvfp4": lambda v: quant.nvfp4_quantize(v, quant.nvfp4_row_scale(v)),
      "ts_rows": lambda v: quant.nvfp4_row_scale(v).reshape(v.shape[0]),
      "q_mxfp4": quant.mxfp4_quantize,
      "q_fp8": quant.fp8_quantize_act,
      "g_compact": lambda v: quant.quantize_act_record(v, "compact")[1],
      "g_full": lambda v: quant.quantize_act_record(v, "full")[1],
  }
  for name, build in builders.items():
    if name in needed:
      out[name] = jax.block_until_ready(jax.jit(build)(x))
  return out


def _torch_inputs(x_np: Any, dtype: str, device: str, needed: set[str]) -> dict[str, Any]:
  """The torch twin's inputs from the same data (first rows of the JAX input)."""
  import numpy as np
  import torch

  from rollout_bridge import torch_quant as tq

  tdt = torch.bfloat16 if dtype == "bfloat16" else torch.float32
  x = torch.from_numpy(np.array(x_np, np.float32)).to(device).to(tdt)
  out: dict[str, Any] = {"x": x}
  if needed & {"q_nvfp4", "g_compact", "g_full"}:
    q = tq.nvfp4_quantize(x, tq.nvfp4_row_scale(x))
    out["q_nvfp4"] = q
    out["g_compact"] = tq.guidance_record(q, "compact")
    out["g_full"] = tq.guidance_record(q, "full")
  if "q_mxfp4" in needed:
    out["q_mxfp4"] = tq.mxfp4_quantize(x)
  if "q_fp8" in needed:
    out["q_fp8"] = tq.fp8_quantize_act(x)
  return out


def _torch_nbytes(obj: Any) -> int:
  import torch

  if isinstance(obj, torch.Tensor):
    return obj.numel() * obj.element_size()
  if isinstance(obj, dict):
    return sum(_torch_nbytes(v) for v in obj.values())
  if isinstance(obj, list | tuple):
    return sum(_torch_nbytes(v) for v in obj)
  if dataclasses.is_dataclass(obj):
    return sum(_torch_nbytes(getattr(obj, f.name)) for f in dataclasses.fields(obj))
  return 0


def _resolve_torch_device(requested: str, backend: str) -> str | None:
  try:
    import torch
  except ImportError:
    return None
  if requested:
    return requested
  return "cuda" if backend == "gpu" and torch.cuda.is_available() else "cpu"


def run_bench(size: int, k: int, dtype: str, reps: int, warmup: int, use_torch: bool,
              torch_device: str, torch_reps: int, torch_max_elements: int, ops: Sequence[str],
              seed: int, json_out: str = "") -> dict[str, Any]:
  """Times the ops and returns the results dict (also what --json_out holds).

  With json_out, the JAX results are written there (marked partial) before the torch twin
  runs, so that a run stopped during the slow twin still leaves them.
  """
  import jax
  import numpy as np

  backend = jax.default_backend()
  on_gpu = backend == "gpu"
  size = size or (GPU_SIZE if on_gpu else CPU_SIZE)
  reps = reps or (20 if on_gpu else 5)
  calls = 10 if on_gpu else 1
  torch_reps = torch_reps or (10 if on_gpu else 3)
  if torch_max_elements < 0:
    torch_max_elements = 0 if on_gpu else 2**18
  if k % 128:
    raise ValueError(f"--k must be a multiple of 128, got {k}")
  rows = max(size // k, 1)
  all_ops = _ops()
  known = [o.name for o in all_ops]
  unknown = sorted(set(ops) - set(known))
  if unknown:
    raise ValueError(f"unknown ops {unknown}; known: {known}")
  selected = [o for o in all_ops if not ops or o.name in ops or o.name == COPY]
  needed = {i for o in selected for i in o.inputs}
  dev = common.device_description()
  res: dict[str, Any] = {
      **dev, "size": rows * k, "rows": rows, "k": k, "dtype": dtype, "reps": reps,
      "calls_per_sample": calls, "warmup": warmup, "python": platform.python_version(), "ops": {},
  }
  print(f"bench_quant: backend {backend}, device {dev['device_kind']} (x{dev['device_count']}), "
        f"jax {jax.__version__}; input [{rows}, {k}] {dtype} = {rows * k / 2**20:.0f} Mi elements",
        flush=True)

  inputs = _jax_inputs(rows, k, dtype, seed, needed)
  for op in selected:
    args = tuple(inputs[i] for i in op.inputs)
    entry: dict[str, Any] = {"inputs": list(op.inputs), "note": op.note}
    try:
      fn = jax.jit(op.fn)
      out_shape = jax.eval_shape(fn, *args)
      entry["bytes_in"] = _nbytes(args)
      entry["bytes_out"] = _nbytes(out_shape)
      med, best = common.median_seconds(lambda fn=fn, args=args: fn(*args),
                                        jax.block_until_ready, warmup, reps, calls)
      entry.update(median_ms=1e3 * med, min_ms=1e3 * best,
                   gbps_in=entry["bytes_in"] / med / 1e9,
                   gbps_moved=(entry["bytes_in"] + entry["bytes_out"]) / med / 1e9)
    except Exception as e:  # keep benchmarking the rest; the error goes into the record
      entry["error"] = f"{type(e).__name__}: {e}"[:500]
    res["ops"][op.name] = entry
    print(f"  jax   {op.name:28s} "
          + (f"{entry['median_ms']:9.3f} ms" if "median_ms" in entry else entry["error"]),
          flush=True)
  copy_bw = res["ops"][COPY].get("gbps_moved")
  res["copy_gbps"] = copy_bw
  for entry in res["ops"].values():
    if copy_bw and "gbps_moved" in entry:
      entry["frac_copy"] = entry["gbps_moved"] / copy_bw

  tdev = _resolve_torch_device(torch_device, backend) if use_torch else None
  res["torch_device"] = tdev
  if json_out and tdev is not None:
    common.write_json(json_out, {**res, "partial": "torch twin not yet timed"})
  if tdev is not None:
    t_rows = rows if not torch_max_elements else max(min(rows, torch_max_elements // k), 1)
    x_np = np.asarray(jax.device_get(inputs["x"][:t_rows].astype(np.float32)))
    del inputs
    _bench_torch(res, selected, x_np, dtype, tdev, warmup, torch_reps, needed)
  return res


def _bench_torch(res: dict[str, Any], selected: list[Op], x_np: Any, dtype: str, device: str,
                 warmup: int, reps: int, needed: set[str]) -> None:
  """Times the torch twin's ops; fills torch_* fields and JAX-over-torch throughput ratios."""
  import torch

  res["torch"] = torch.__version__
  res["torch_device_name"] = (torch.cuda.get_device_name(torch.device(device))
                              if device.startswith("cuda") else platform.processor() or "cpu")
  res["torch_rows"] = x_np.shape[0]
  sync = ((lambda _: torch.cuda.synchronize(torch.device(device)))
          if device.startswith("cuda") else (lambda _: None))
  print(f"torch twin: torch {torch.__version__} on {device} ({res['torch_device_name']}), "
        f"{x_np.shape[0]} rows", flush=True)
  tin = _torch_inputs(x_np, dtype, device, needed)
  n = x_np.size
  for op in selected:
    entry = res["ops"][op.name]
    if op.torch_fn is None or "median_ms" not in entry:
      continue
    args = tuple(tin[i] for i in op.inputs)
    try:
      if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(torch.device(device))
      with torch.inference_mode():
        med, best = common.median_seconds(lambda f=op.torch_fn, a=args: f(*a), sync, warmup,
                                          reps)
      entry.update(torch_median_ms=1e3 * med, torch_min_ms=1e3 * best,
                   torch_gbps_in=_torch_nbytes(args) / med / 1e9)
      if device.startswith("cuda"):
        entry["torch_peak_gb"] = torch.cuda.max_memory_allocated(torch.device(device)) / 1e9
      # Throughput ratio per element: JAX and torch may have run on different sizes (CPU).
      jax_per_elem = entry["median_ms"] / res["size"]
      entry["jax_over_torch"] = (entry["torch_median_ms"] / n) / jax_per_elem
    except Exception as e:  # e.g. out of memory: record and go on
      entry["torch_error"] = f"{type(e).__name__}: {e}"[:500]
    finally:
      if device.startswith("cuda"):
        torch.cuda.empty_cache()
    print(f"  torch {op.name:28s} "
          + (f"{entry['torch_median_ms']:9.3f} ms" if "torch_median_ms" in entry
             else entry["torch_error"]), flush=True)


def format_bench(res: dict[str, Any]) -> str:
  """The results as an aligned table."""
  head = ["op", "median ms", "GB/s in", "GB/s moved", "of copy", "torch ms", "jax/torch"]
  rows = []
  for name, e in res["ops"].items():
    if "median_ms" not in e:
      rows.append([name, "error", "-", "-", "-", "-", "-"])
      continue
    rows.append([
        name, f"{e['median_ms']:.3f}", f"{e['gbps_in']:.1f}", f"{e['gbps_moved']:.1f}",
        f"{100 * e['frac_copy']:.0f}%" if "frac_copy" in e else "-",
        f"{e['torch_median_ms']:.3f}" if "torch_median_ms" in e else "-",
        f"{e['jax_over_torch']:.2f}x" if "jax_over_torch" in e else "-",
    ])
  torch_note = ("torch twin not timed" if not res.get("torch_device") else
                f"torch on {res['torch_device']} ({res.get('torch_device_name')}), "
                f"{res.get('torch_rows')} of {res['rows']} rows; jax/torch = throughput ratio")
  lines = [
      f"bench_quant on {res['backend']} ({res['device_kind']}): [{res['rows']}, {res['k']}] "
      f"{res['dtype']}, median of {res['reps']} samples of {res['calls_per_sample']} calls "
      f"after {res['warmup']} warm-up",
      f"copy bandwidth (read + write): "
      f"{res['copy_gbps'] or float('nan'):.1f} GB/s; {torch_note}",
      common.format_table(head, rows),
  ]
  return "\n".join(lines)


# ----------------------------------------------------------------------------- --sites

_NOT_KERNELS = ("parameter", "constant", "tuple", "get-tuple-element", "bitcast")


def _parse_shape(text: str) -> tuple[int, int]:
  try:
    m, k = (int(v) for v in text.lower().split("x"))
  except ValueError:
    raise ValueError(f"--site_shapes: expected MxK, got {text!r}") from None
  if m < 1 or k < 16 or k % 16:
    raise ValueError(f"--site_shapes: M >= 1 and K a positive multiple of 16, got {text!r}")
  return m, k


def entry_ops(hlo_text: str) -> int:
  """Instructions of an optimized HLO module's ENTRY computation other than parameters,
  constants, tuples and bitcasts: about the kernels one call launches on the GPU."""
  lines = hlo_text.splitlines()
  start = next((i for i, ln in enumerate(lines) if ln.startswith("ENTRY")), None)
  if start is None:
    return 0
  n = 0
  for ln in lines[start + 1:]:
    if ln.startswith("}"):
      break
    m = re.search(r"=\s.*?\s([a-z][a-z0-9\-]*)\(", ln)
    if m and m.group(1) not in _NOT_KERNELS:
      n += 1
  return n


def _site_fields(out: Any) -> list[Any]:
  """(y, q) as a list of numpy arrays of raw bits (float NaNs made canonical)."""
  import jax
  import numpy as np

  fields = []
  for a in jax.tree.leaves(jax.device_get(out)):
    a = np.asarray(a)
    b = a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize]).copy()
    if a.dtype.kind == "f":
      b[np.isnan(a.astype(np.float32))] = 0x7F
    fields.append(b)
  return fields


def run_sites(shapes: Sequence[str], dtype: str, chain: int, reps: int, warmup: int,
              seed: int) -> dict[str, Any]:
  """--sites: XLA's NVFP4 site path against `nvfp4_act.quantize_rows` per shape (see the module
  docstring); returns the results dict."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from trace_jax.kernels import nvfp4_act

  if chain < 1:
    raise ValueError(f"--site_chain must be >= 1, got {chain}")
  parsed = [_parse_shape(t) for t in shapes]
  on_gpu = jax.default_backend() == "gpu"
  reps = reps or (20 if on_gpu else 5)
  dev = common.device_description()
  res: dict[str, Any] = {**dev, "mode": "sites", "dtype": dtype, "chain": chain, "reps": reps,
                         "warmup": warmup, "python": platform.python_version(), "sites": {}}
  print(f"bench_quant --sites: backend {res['backend']}, device {dev['device_kind']}, jax "
        f"{jax.__version__}; {dtype} rows, {chain} chained site calls per timed program",
        flush=True)
  paths = {"xla": nvfp4_act.reference, "kernel": nvfp4_act.quantize_rows}

  def chained(site, n):
    def f(x):
      out = site(x)
      for _ in range(n - 1):
        out = site(out[0])
      return out
    return f

  for m, k in parsed:
    key = f"{m}x{k}"
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)) * np.exp2(rng.integers(-4, 5, (m, 1)))
    x = jnp.asarray(x, dtype)
    entry: dict[str, Any] = {"m": m, "k": k}
    outs = {}
    for path, site in paths.items():
      one = jax.jit(chained(site, 1)).lower(x).compile()
      many = jax.jit(chained(site, chain)).lower(x).compile()
      outs[path] = (one(x), many(x))
      entry[f"{path}_entry_ops"] = entry_ops(one.as_text())
      med1, _ = common.median_seconds(lambda f=one, x=x: f(x), jax.block_until_ready, warmup, reps)
      med, best = common.median_seconds(lambda f=many, x=x: f(x), jax.block_until_ready,
                                        warmup, reps)
      entry[f"{path}_call_ms"] = 1e3 * med1
      entry[f"{path}_us"] = 1e6 * med / chain
      entry[f"{path}_min_us"] = 1e6 * best / chain
    entry["xla_over_kernel"] = entry["xla_us"] / entry["kernel_us"]
    entry["bit_identical"] = all(
        all(np.array_equal(a, b) for a, b in zip(_site_fields(outs["xla"][i]),
                                                 _site_fields(outs["kernel"][i]), strict=True))
        for i in range(2))
    res["sites"][key] = entry
    print(f"  {key:12s} xla {entry['xla_us']:9.1f} us  kernel {entry['kernel_us']:9.1f} us  "
          f"xla/kernel {entry['xla_over_kernel']:.2f}x  bit-identical "
          f"{'yes' if entry['bit_identical'] else 'NO'}", flush=True)
  res["bit_identical"] = all(e["bit_identical"] for e in res["sites"].values())
  return res


def format_sites(res: dict[str, Any]) -> str:
  """--sites results as an aligned table."""
  head = ["M x K", "xla us/site", "kernel us/site", "xla/kernel", "xla call ms",
          "kernel call ms", "entry ops xla/kernel", "bit-identical"]
  rows = [[key, f"{e['xla_us']:.1f}", f"{e['kernel_us']:.1f}", f"{e['xla_over_kernel']:.2f}x",
           f"{e['xla_call_ms']:.3f}", f"{e['kernel_call_ms']:.3f}",
           f"{e['xla_entry_ops']}/{e['kernel_entry_ops']}", "yes" if e["bit_identical"] else "NO"]
          for key, e in res["sites"].items()]
  lines = [
      f"bench_quant --sites on {res['backend']} ({res['device_kind']}): NVFP4 site "
      f"quantize-dequantize of {res['dtype']} rows, XLA (formats) vs nvfp4_act.quantize_rows; "
      f"us/site: median of {res['reps']} programs of {res['chain']} chained calls after "
      f"{res['warmup']} warm-up",
      common.format_table(head, rows),
      f"all outputs bit-identical: {'yes' if res['bit_identical'] else 'NO'}",
  ]
  return "\n".join(lines)


def main(argv: Sequence[str]) -> dict[str, Any] | None:
  """Parses argv (argv[0] is the program name), benchmarks, prints and writes the JSON."""
  if not common.parse_flags(FLAGS, argv):
    return None
  common.set_gpu_memory_env()
  if FLAGS.sites:
    res = run_sites(FLAGS.site_shapes, FLAGS.dtype, FLAGS.site_chain, FLAGS.reps, FLAGS.warmup,
                    FLAGS.seed)
    return common.finish(res, FLAGS, format_sites(res))
  res = run_bench(FLAGS.size, FLAGS.k, FLAGS.dtype, FLAGS.reps, FLAGS.warmup, FLAGS.torch,
                  FLAGS.torch_device, FLAGS.torch_reps, FLAGS.torch_max_elements, FLAGS.ops,
                  FLAGS.seed, FLAGS.json_out)
  return common.finish(res, FLAGS, format_bench(res))


if __name__ == "__main__":
  main(sys.argv)
