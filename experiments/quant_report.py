"""Quantization report: FP4/FP8 code flips between a rollout pass and a drifted training pass.

The project's main job until the RL loop exists (`make run`). A small randomly initialised
residual MLP (pre-norm SwiGLU or GELU blocks) runs one batch of token activations twice:
- rollout: activations in `--rollout_dtype`, each matmul one dot with float32 accumulation;
- training: activations in `--train_dtype`, each matmul split along K into `--split_k` partial
  products rounded to the activation dtype and summed in reverse order (another kernel's
  accumulation order), and a relative Gaussian perturbation `--noise` on every layer's input
  (and optionally `--weight_noise` on the weights).
Each layer's normalized input is a quantization site. Per format (NVFP4 two-level with per-row
second-level scales, MXFP4, FP8 1x128) the report gives the fraction of elements whose code
differs between training (round-to-nearest with its own scales: vanilla QAT) and rollout; for
NVFP4 also under TRACE guided rounding (compact: 1 mantissa bit, full: 4-bit codes, both with
the rollout's scales, from `quantize_act_record`), and the guidance bytes per element.

With `--closed_loop` (default) every pass feeds its quantize-dequantized activations forward,
as rollout and QAT do, so upstream flips enlarge the drift downstream; without it, both passes
run unquantized and the sites are only measured.

Outputs: a table on stdout, JSON (`--json_out`) and a bar plot of flip rates (`--plot_out`).
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from experiments import common
from trace_jax import quant
from trace_jax.quant import formats
from trace_jax.quant.formats import E2M1_GRID, NVFP4_BLOCK

FLAGS = flags.FlagValues()
flags.DEFINE_integer("batch", 512, "Token rows in the batch.", flag_values=FLAGS)
flags.DEFINE_integer("width", 512, "Model width K (the quantized contraction size); a multiple "
                     "of 128.", flag_values=FLAGS)
flags.DEFINE_integer("hidden", 1024, "MLP hidden size.", flag_values=FLAGS)
flags.DEFINE_integer("layers", 6, "Number of residual MLP blocks (one quantization site each).",
                     flag_values=FLAGS)
flags.DEFINE_enum("mlp", "swiglu", ["swiglu", "gelu"], "Block type.", flag_values=FLAGS)
flags.DEFINE_integer("seed", 0, "PRNG seed (weights, inputs and noise use fold_in of it).",
                     flag_values=FLAGS)
flags.DEFINE_enum("rollout_dtype", "bfloat16", ["bfloat16", "float32"],
                  "Activation dtype of the rollout pass.", flag_values=FLAGS)
flags.DEFINE_enum("train_dtype", "bfloat16", ["bfloat16", "float32"],
                  "Activation dtype of the training pass.", flag_values=FLAGS)
flags.DEFINE_integer("split_k", 4, "Training matmuls sum this many K-chunks, each rounded to the "
                     "activation dtype, in reverse order (1: same as rollout).", flag_values=FLAGS)
flags.DEFINE_float("noise", 1e-3, "Relative Gaussian noise on each training-side site input.",
                   flag_values=FLAGS)
flags.DEFINE_float("weight_noise", 0.0, "Relative Gaussian noise on the training-side weights.",
                   flag_values=FLAGS)
flags.DEFINE_bool("closed_loop", True, "Feed quantize-dequantized activations forward (as "
                  "rollout and QAT do); otherwise measure unquantized passes.", flag_values=FLAGS)
flags.DEFINE_integer("guided_layers", -1, "Deepest layers that carry guidance, for the bytes per "
                     "token figure (-1: the latter half). Flip rates are given at every layer.",
                     flag_values=FLAGS)
flags.DEFINE_string("json_out", "runs/quant_report/report.json", "JSON report path ('' = none).",
                    flag_values=FLAGS)
flags.DEFINE_string("plot_out", "runs/quant_report/flip_rates.png", "PNG bar plot path "
                    "('' = none).", flag_values=FLAGS)
flags.DEFINE_bool("progress", True, "Show a progress bar.", flag_values=FLAGS)

FORMATS = ("nvfp4", "mxfp4", "fp8")
# (method name, format, guidance mode or None for round-to-nearest with own scales)
METHODS = (
    ("nvfp4_rtn", "nvfp4", None),
    ("nvfp4_guided_compact", "nvfp4", "compact"),
    ("nvfp4_guided_full", "nvfp4", "full"),
    ("mxfp4_rtn", "mxfp4", None),
    ("fp8_rtn", "fp8", None),
)
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
FULL_CACHE_BYTES_PER_ELEMENT = 4.5 / 8  # 4-bit code + one E4M3 byte per 16 elements


# ----------------------------------------------------------------------------- model

@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def init_params(key: jax.Array, layers: int, width: int, hidden: int, mlp: str) -> dict:
  """Random MLP weights stacked over layers; layer l draws from fold_in(key, l)."""
  per_layer = []
  for l in range(layers):
    k_in, k_up, k_out, k_gain = jax.random.split(jax.random.fold_in(key, l), 4)
    p = {
        "w_in": jax.random.normal(k_in, (width, hidden), jnp.float32) / np.sqrt(width),
        # Residual projections scaled by 1/sqrt(2 * layers) (GPT-2 init), so that each block
        # adds a modest update to the residual stream, as in a trained LM.
        "w_out": jax.random.normal(k_out, (hidden, width), jnp.float32)
                 / np.sqrt(hidden * 2 * layers),
        "gain": 1.0 + 0.1 * jax.random.normal(k_gain, (width,), jnp.float32),
    }
    if mlp == "swiglu":
      p["w_up"] = jax.random.normal(k_up, (width, hidden), jnp.float32) / np.sqrt(width)
    per_layer.append(p)
  return jax.tree.map(lambda *a: jnp.stack(a), *per_layer)


@functools.partial(jax.jit, static_argnums=(1, 2))
def token_inputs(key: jax.Array, batch: int, width: int) -> jax.Array:
  """Token activations: Gaussian rows with log-normal row norms and a few outlier channels."""
  k_x, k_row, k_ch = jax.random.split(key, 3)
  x = jax.random.normal(k_x, (batch, width), jnp.float32)
  row = jnp.exp(0.5 * jax.random.normal(k_row, (batch, 1), jnp.float32))
  outlier = jax.random.bernoulli(k_ch, 0.02, (width,))
  return x * row * jnp.where(outlier, 8.0, 1.0)


def _rmsnorm(h: jax.Array, gain: jax.Array) -> jax.Array:
  hf = h.astype(jnp.float32)
  return (hf * jax.lax.rsqrt(jnp.mean(hf * hf, axis=-1, keepdims=True) + 1e-6) * gain)


def _matmul(a: jax.Array, w: jax.Array, split_k: int) -> jax.Array:
  """a @ w in a's dtype: one float32-accumulated dot, or split-K partials in reverse order."""
  w = w.astype(a.dtype)
  if split_k <= 1:
    return jnp.dot(a, w, preferred_element_type=jnp.float32).astype(a.dtype)
  k = a.shape[-1]
  if k % split_k:
    raise ValueError(f"split_k={split_k} does not divide the contraction size {k}")
  c = k // split_k
  parts = [jnp.dot(a[:, i * c:(i + 1) * c], w[i * c:(i + 1) * c],
                   preferred_element_type=jnp.float32).astype(a.dtype) for i in range(split_k)]
  acc = jnp.zeros(parts[0].shape, jnp.float32)
  for p in reversed(parts):
    acc = acc + p.astype(jnp.float32)
  return acc.astype(a.dtype)


def _block(p: dict, s: jax.Array, mlp: str, split_k: int) -> jax.Array:
  """The MLP of one residual block applied to its (quantized) normalized input s."""
  if mlp == "swiglu":
    u = jax.nn.silu(_matmul(s, p["w_in"], split_k)) * _matmul(s, p["w_up"], split_k)
  else:
    u = jax.nn.gelu(_matmul(s, p["w_in"], split_k))
  return _matmul(u.astype(s.dtype), p["w_out"], split_k)


# ----------------------------------------------------------------------------- quant sites

def _bits8(a: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(a, jnp.uint8)


def _quantize_rtn(s: jax.Array, fmt: str) -> tuple[jax.Array, dict]:
  """Round-to-nearest with the input's own scales: (dequantized s, codes and scale bits)."""
  if fmt == "nvfp4":
    q = quant.nvfp4_quantize(s, quant.nvfp4_row_scale(s))
    return quant.nvfp4_dequantize(q), {"codes": q.codes, "scales": _bits8(q.block_scale)}
  if fmt == "mxfp4":
    q = quant.mxfp4_quantize(s)
    return quant.mxfp4_dequantize(q), {"codes": q.codes, "scales": _bits8(q.block_scale)}
  q = quant.fp8_quantize_act(s)
  scale_bits = jax.lax.bitcast_convert_type(q.scale, jnp.uint32)
  return quant.fp8_dequantize(q), {"codes": _bits8(q.values), "scales": scale_bits}


def make_pass(cfg: dict, role: str, fmt: str | None, mode: str | None) -> Callable[..., Any]:
  """A jitted forward pass over all layers (lax.scan); role 'rollout' or 'train'.

  Called as f(params, x0, records=None) -> (per-layer dict stacked over layers, final
  residual stream). The dict holds "site" (the layer input before quantization, float32) and,
  unless fmt is None (no quantization), "codes" and "scales" (bit patterns); the NVFP4 rollout
  also returns its guidance records "rec_compact" and "rec_full". records: the rollout's
  stacked guidance, consumed by a guided training pass (mode 'compact' or 'full').
  """
  dtype = DTYPES[cfg["rollout_dtype"] if role == "rollout" else cfg["train_dtype"]]
  split_k = 1 if role == "rollout" else cfg["split_k"]
  noise = 0.0 if role == "rollout" else cfg["noise"]
  weight_noise = 0.0 if role == "rollout" else cfg["weight_noise"]
  noise_key = jax.random.fold_in(jax.random.key(cfg["seed"]), 2)
  mlp, closed = cfg["mlp"], cfg["closed_loop"]

  def layer(h, xs):
    p, l, rec = xs
    if weight_noise:
      wk = jax.random.fold_in(jax.random.fold_in(noise_key, 1_000_000), l)
      p = {n: v * (1.0 + weight_noise * jax.random.normal(jax.random.fold_in(wk, i), v.shape))
           if v.ndim == 2 else v for i, (n, v) in enumerate(sorted(p.items()))}
    s = _rmsnorm(h, p["gain"])
    if noise:
      s = s * (1.0 + noise * jax.random.normal(jax.random.fold_in(noise_key, l), s.shape))
    s = s.astype(dtype)
    out: dict[str, Any] = {"site": s.astype(jnp.float32)}
    sq = s
    res: dict[str, Any] = {}
    if fmt is not None:
      if mode is not None:
        q = quant.guided_quantize(s, rec)
        deq = quant.nvfp4_dequantize(q)
        res = {"codes": q.codes, "scales": _bits8(q.block_scale)}
      elif role == "rollout" and fmt == "nvfp4":
        # The rollout's records, as a TRACE rollout leaves them; its codes are the full record's.
        deq, res["rec_full"] = quant.quantize_act_record(s, "full")
        _, res["rec_compact"] = quant.quantize_act_record(s, "compact")
        res.update(codes=quant.unpack_fp4(res["rec_full"].codes),
                   scales=_bits8(res["rec_full"].block_scale))
      else:
        deq, res = _quantize_rtn(s, fmt)
      out.update(res)
      if closed:
        sq = deq.astype(dtype)
    h = h + _block(p, sq, mlp, split_k).astype(jnp.float32)
    return h, out

  def run(params, x0, records=None):
    n = params["gain"].shape[0]
    h, outs = jax.lax.scan(layer, x0.astype(jnp.float32), (params, jnp.arange(n), records))
    return outs, h

  return jax.jit(run)


# ----------------------------------------------------------------------------- measurements

def _guided_reach(site: np.ndarray, rec_codes: np.ndarray, block_scale: np.ndarray,
                  row_scale: np.ndarray) -> np.ndarray:
  """True where the rollout code is one of the two E2M1 neighbours of the training value.

  z = clip(x_train * ((1 / row_scale) / block_scale), -6, 6) in IEEE float32 (as docs/design.md §3.5
  and both twins compute it); the rollout code is reachable when its magnitude is the grid
  point just below or just above |z| and its sign is z's (or it is zero). Guided rounding must
  reproduce every reachable rollout code.
  """
  x = site.astype(np.float32)
  x = np.where(np.abs(x) < np.float32(2.0**-126), np.float32(0.0) * np.sign(x), x)
  bs = block_scale.astype(np.float32)
  inv = (np.float32(1.0) / row_scale.astype(np.float32)) / bs
  xb = x.reshape(x.shape[:-1] + (x.shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK))
  z = np.clip(xb * inv[..., None], -6.0, 6.0).astype(np.float32).reshape(x.shape)
  a = np.abs(z)
  lo_i = np.searchsorted(E2M1_GRID, a, side="right") - 1
  hi_i = np.where(E2M1_GRID[lo_i] == a, lo_i, np.minimum(lo_i + 1, 7))
  mag = rec_codes & 7
  neg = (rec_codes & 8) != 0
  same_sign = (mag == 0) | (neg == np.signbit(z))
  return ((mag == lo_i) | (mag == hi_i)) & same_sign


def code_flip_rate(train: np.ndarray, rollout: np.ndarray, fmt: str) -> float:
  """Fraction of elements whose quantized value differs between training and rollout.

  FP4 codes are compared as E2M1 values (`formats.e2m1_values_equal`): codes keep the sign of
  zero, and +0 (code 0) vs -0 (code 8) is no flip. FP8 values never hold -0, so their bytes
  compare directly.
  """
  train, rollout = np.asarray(train), np.asarray(rollout)
  if fmt == "fp8":
    return float(np.mean(train != rollout))
  return float(np.mean(~formats.e2m1_values_equal(train, rollout)))


def _rel(a: np.ndarray, b: np.ndarray) -> float:
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def guidance_bytes(k: int, rows: int, rec_compact: Any, rec_full: Any, layers: int,
                   guided_layers: int) -> dict[str, Any]:
  """Guidance bytes per element and per token, from `bytes_per_row` and the records' nbytes."""
  per_row = {m: quant.bytes_per_row(k, m) for m in ("compact", "full")}
  nbytes = {"compact": rec_compact.nbytes, "full": rec_full.nbytes}
  for m in per_row:  # the records hold exactly what bytes_per_row counts
    if nbytes[m] != per_row[m] * rows:
      raise AssertionError(f"{m}: Guidance.nbytes {nbytes[m]} != bytes_per_row * rows "
                           f"{per_row[m] * rows}")
  per_token = {
      "compact_guided_layers": per_row["compact"] * guided_layers,
      "full_guided_layers": per_row["full"] * guided_layers,
      "full_cache_guided_layers": FULL_CACHE_BYTES_PER_ELEMENT * k * guided_layers,
      "full_cache_all_layers": FULL_CACHE_BYTES_PER_ELEMENT * k * layers,
  }
  compact = max(per_token["compact_guided_layers"], 1e-30)
  # docs/design.md §5: compact guidance of the guided layers vs caching every layer's 4.5-bit codes.
  per_token["full_cache_over_compact"] = per_token["full_cache_all_layers"] / compact
  per_token["full_cache_same_sites_over_compact"] = (per_token["full_cache_guided_layers"]
                                                     / compact)
  return {
      "bytes_per_element": {
          "compact": per_row["compact"] / k,
          "full": per_row["full"] / k,
          "full_cache_4p5bit": FULL_CACHE_BYTES_PER_ELEMENT,
      },
      "bytes_per_row": per_row,
      "record_nbytes_per_site": nbytes,
      "guided_layers": guided_layers,
      "bytes_per_token": per_token,
  }


def run_report(cfg: dict, progress: bool = False) -> dict[str, Any]:
  """Runs all passes and returns the report dict (see module docstring)."""
  from tqdm import tqdm

  validate(cfg)
  t_start = time.perf_counter()
  key = jax.random.key(cfg["seed"])
  params = init_params(jax.random.fold_in(key, 0), cfg["layers"], cfg["width"], cfg["hidden"],
                       cfg["mlp"])
  x0 = token_inputs(jax.random.fold_in(key, 1), cfg["batch"], cfg["width"])
  n_layers, k = cfg["layers"], cfg["width"]
  guided_layers = n_layers // 2 if cfg["guided_layers"] < 0 else min(cfg["guided_layers"],
                                                                        n_layers)
  jobs: list[tuple[str, str | None, str | None]] = [("rollout", f, None) for f in FORMATS]
  jobs += [("train", f, m) for _, f, m in METHODS]
  rollouts: dict[str, Any] = {}
  trains: dict[str, Any] = {}
  for role, fmt, mode in tqdm(jobs, desc="passes", disable=not progress, leave=False):
    fwd = make_pass(cfg, role, fmt, mode)
    if role == "rollout":
      rollouts[fmt] = jax.device_get(fwd(params, x0))
    else:
      outs_r = rollouts[fmt][0]
      recs = None if mode is None else jax.device_put(outs_r[f"rec_{mode}"])
      name = f"{fmt}_rtn" if mode is None else f"{fmt}_guided_{mode}"
      trains[name] = jax.device_get(fwd(params, x0, recs))

  flip, scale_flip, reach_miss, drift, out_diff = {}, {}, {}, {}, {}
  for name, fmt, mode in METHODS:
    (outs_t, h_t), (outs_r, h_r) = trains[name], rollouts[fmt]
    flip[name] = [code_flip_rate(outs_t["codes"][l], outs_r["codes"][l], fmt)
                  for l in range(n_layers)]
    drift[name] = [_rel(outs_t["site"][l], outs_r["site"][l]) for l in range(n_layers)]
    out_diff[name] = _rel(h_t, h_r)
    if mode is None:
      scale_flip[name] = [float(np.mean(outs_t["scales"][l] != outs_r["scales"][l]))
                          for l in range(n_layers)]
    else:
      rec = outs_r[f"rec_{mode}"]
      bs = np.asarray(rec.block_scale).astype(np.float32)
      reach_miss[name] = [
          float(np.mean(~_guided_reach(outs_t["site"][l], outs_r["codes"][l], bs[l],
                                       np.asarray(rec.row_scale[l]))))
          for l in range(n_layers)]

  rec_c = jax.tree.map(lambda a: a[0], rollouts["nvfp4"][0]["rec_compact"])
  rec_f = jax.tree.map(lambda a: a[0], rollouts["nvfp4"][0]["rec_full"])
  report: dict[str, Any] = {
      "config": dict(cfg),
      "backend": jax.default_backend(),
      "device": jax.devices()[0].device_kind,
      "layers": list(range(n_layers)),
      "elements_per_site": cfg["batch"] * k,
      "methods": [m for m, _, _ in METHODS],
      "flip_rate": flip,
      "flip_rate_mean": {m: float(np.mean(v)) for m, v in flip.items()},
      "scale_flip_rate": scale_flip,
      "beyond_one_code_rate": reach_miss,
      "site_rel_drift": drift,
      "output_rel_diff": out_diff,
  }
  report.update(guidance_bytes(k, cfg["batch"], rec_c, rec_f, n_layers, guided_layers))
  report["elapsed_s"] = time.perf_counter() - t_start
  return report


# ----------------------------------------------------------------------------- output

def _pct(v: float) -> str:
  return f"{100 * v:.3f}%"


def format_report(r: dict[str, Any]) -> str:
  """The report as aligned text tables."""
  cfg = r["config"]
  methods = r["methods"]
  lines = [
      f"quant_report: {r['backend']} ({r['device']}), {cfg['layers']} x {cfg['mlp']} blocks, "
      f"width {cfg['width']}, hidden {cfg['hidden']}, batch {cfg['batch']} "
      f"({r['elements_per_site']} elements per site)",
      f"drift: rollout {cfg['rollout_dtype']} vs training {cfg['train_dtype']} with split_k="
      f"{cfg['split_k']}, input noise {cfg['noise']:g}, weight noise {cfg['weight_noise']:g}, "
      f"{'closed' if cfg['closed_loop'] else 'open'} loop",
      "",
      "code flip rate, training vs rollout (per layer input):",
  ]
  rows = [[f"layer {l}"] + [_pct(r["flip_rate"][m][l]) for m in methods] for l in r["layers"]]
  rows.append(["mean"] + [_pct(r["flip_rate_mean"][m]) for m in methods])
  lines.append(common.format_table(["site"] + methods, rows))
  lines += ["", "diagnostics (mean over layers):"]
  diag = []
  for m in methods:
    sf = r["scale_flip_rate"].get(m)
    bo = r["beyond_one_code_rate"].get(m)
    diag.append([m, _pct(float(np.mean(sf))) if sf is not None else "-",
                 _pct(float(np.mean(bo))) if bo is not None else "-",
                 f"{np.mean(r['site_rel_drift'][m]):.2e}", f"{r['output_rel_diff'][m]:.2e}"])
  lines.append(common.format_table(
      ["method", "scale flips", "beyond 1 code", "site drift", "output drift"], diag))
  bpe, bpt = r["bytes_per_element"], r["bytes_per_token"]
  lines += ["", f"NVFP4 guidance bytes (K = {cfg['width']}):"]
  lines.append(common.format_table(
      ["record", "bytes/element", "bits/element", "bytes/row"],
      [["compact (mantissa bit + scales)", f"{bpe['compact']:.6f}", f"{8 * bpe['compact']:.4f}",
        f"{r['bytes_per_row']['compact']}"],
       ["full (4-bit code + scales)", f"{bpe['full']:.6f}", f"{8 * bpe['full']:.4f}",
        f"{r['bytes_per_row']['full']}"],
       ["4.5-bit full cache (reference)", f"{bpe['full_cache_4p5bit']:.6f}",
        f"{8 * bpe['full_cache_4p5bit']:.4f}", "-"]]))
  lines.append(
      f"per token: compact on the deepest {r['guided_layers']} of {cfg['layers']} layers "
      f"{bpt['compact_guided_layers']:.1f} B, full cache of all layers "
      f"{bpt['full_cache_all_layers']:.1f} B: {bpt['full_cache_over_compact']:.2f}x smaller "
      f"({bpt['full_cache_same_sites_over_compact']:.2f}x vs a full cache of the same sites)")
  lines.append(f"elapsed {r['elapsed_s']:.1f} s")
  return "\n".join(lines)


def plot_report(r: dict[str, Any], path: str) -> None:
  """Grouped bar plot of flip rates per layer per method (percent)."""
  import os

  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  methods, layers = r["methods"], r["layers"]
  width = 0.8 / len(methods)
  fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(layers) + 2), 4.0))
  for i, m in enumerate(methods):
    xs = np.arange(len(layers)) + (i - (len(methods) - 1) / 2) * width
    vals = 100 * np.asarray(r["flip_rate"][m])
    ax.bar(xs, vals, width, label=m)
    for x, v in zip(xs, vals):  # a zero bar is invisible: mark it
      if v == 0:
        ax.annotate("0", (x, 0), ha="center", va="bottom", fontsize=7)
  ax.set_xticks(np.arange(len(layers)), [f"L{l}" for l in layers])
  ax.set_xlabel("layer (input site)")
  ax.set_ylabel("code flip rate vs rollout (%)")
  cfg = r["config"]
  ax.set_title(f"training vs rollout code flips ({cfg['train_dtype']} split_k={cfg['split_k']}, "
               f"noise {cfg['noise']:g})", fontsize=9)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def config_from_flags(fv: flags.FlagValues = FLAGS) -> dict[str, Any]:
  keys = ("batch", "width", "hidden", "layers", "mlp", "seed", "rollout_dtype", "train_dtype",
          "split_k", "noise", "weight_noise", "closed_loop", "guided_layers")
  return {k: fv[k].value for k in keys}


def validate(cfg: dict[str, Any]) -> None:
  """Raises ValueError naming every flag out of range (before anything is computed): a batch
  of 0 rows would report NaN rates."""
  errors = []
  for name in ("batch", "layers", "hidden", "split_k"):
    if cfg[name] < 1:
      errors.append(f"--{name} must be >= 1, got {cfg[name]}")
  if cfg["width"] < 128 or cfg["width"] % 128:
    errors.append(f"--width must be a positive multiple of 128 (FP8 groups), got {cfg['width']}")
  for name in ("width", "hidden"):
    if cfg["split_k"] >= 1 and cfg[name] % cfg["split_k"]:
      errors.append(f"--split_k={cfg['split_k']} must divide --{name}={cfg[name]}")
  for name in ("noise", "weight_noise"):
    if not (np.isfinite(cfg[name]) and cfg[name] >= 0):
      errors.append(f"--{name} must be a finite number >= 0, got {cfg[name]}")
  if not -1 <= cfg["guided_layers"] <= cfg["layers"]:
    errors.append(f"--guided_layers must be -1 (the latter half) or in [0, --layers="
                  f"{cfg['layers']}], got {cfg['guided_layers']}")
  if errors:
    raise ValueError("; ".join(errors))


def main(argv: Sequence[str]) -> dict[str, Any] | None:
  """Parses argv (argv[0] is the program name), runs the report, prints and writes it. A bad
  flag ends in one line, `error: ...`, exit status 2; a fault in one line, exit status 1."""
  from trace_jax.train import run_guard
  try:
    if not common.parse_flags(FLAGS, argv):
      return None
  except flags.Error as e:
    run_guard.fail(e, 2)
  with run_guard.exit_on_errors():
    cfg = config_from_flags()
    with run_guard.user_input():
      validate(cfg)
    report = run_report(cfg, progress=FLAGS.progress)
    print(format_report(report))
    common.write_json(FLAGS.json_out, report)
    if FLAGS.json_out:
      print(f"wrote {FLAGS.json_out}")
    if FLAGS.plot_out:
      plot_report(report, FLAGS.plot_out)
      print(f"wrote {FLAGS.plot_out}")
    return report


if __name__ == "__main__":
  main(sys.argv)
