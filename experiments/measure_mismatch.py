"""Rollout/trainer mismatch under FP4: RTN QAT against TRACE guided rounding.

Generates with the embedded engine (FP4 rollout, recording the full 4-bit codes of every
layer and site plus routing), then scores the same tokens with the training forward under
`fp4_rtn` and under `fp4_trace` (guidance at the guided layers, compact mode by default,
expert_mid rows matched to experts by the rollout's ids) and compares, per layer and site, the
trainer's FP4 codes with the rollout's (as E2M1 values), the routing, and the log-probabilities
of the sampled tokens. --format=mxfp4 runs the MXFP4 pair (`mxfp4_rtn`, `mxfp4_trace`).

  python -m experiments.measure_mismatch --json_out=/tmp/mismatch.json [--format=mxfp4]

With no flag but --json_out it uses the tiny CPU config. Writes JSON and a per-layer PNG.
The rollout decodes on the config's kernel plan (`auto`: the kernels on a Hopper GPU, the XLA
reference elsewhere; the report's `kernel_plan` says which ran). --decode_impls=xla,kernel
measures each rollout decode path on its own rollout (the report is the first one's) and adds
`by_decode_impl` and `fp4_trace_dlogp_kernel_over_xla`: the fast path's rollout/trainer mean
|dlogp| under fp4_trace over the reference path's (the target is <= 1.2, docs/benchmarks.md).
--plan_fields=decode_attention=fused (or layer_loop=scan, any plan field) sets kernel plan
fields on the config: what one plan choice does to the mismatch, by a run with and one without.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from trace_jax import model as model_lib
from trace_jax.guidance.record import bytes_per_row
from trace_jax.model import plan as plan_lib
from trace_jax.model import policies
from trace_jax.model.config import DECODE_IMPLS, SITES, ModelConfig
from trace_jax.quant import guided
from trace_jax.rl import losses
from trace_jax.rollout.engine import InProcessEngine
from trace_jax.rollout.protocol import SamplingParams
from trace_jax.train import guidance_budget, mismatch, rl_loop, run_guard, scoring

_JSON_OUT = flags.DEFINE_string("json_out", None, "Where to write the JSON report.",
                                required=True)
_PNG_OUT = flags.DEFINE_string("png_out", None, "Per-layer plot (default: next to the JSON).")
_CONFIG = flags.DEFINE_string("config", None, "Config .py (get_config() with a `model` dict of "
                              "ModelConfig fields and optional `mismatch` settings); default: "
                              "the tiny CPU model.")
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 8, "Prompts to generate from.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 12, "Prompt length (random token ids).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 16, "Tokens generated per prompt.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed for weights, prompts and sampling.")
_MODE = flags.DEFINE_enum("guidance_mode", "compact", ["compact", "full"],
                          "Guidance kept for the fp4_trace training forward.")
_REPLAY = flags.DEFINE_bool("routing_replay", False, "Replay the rollout's routing in training.")
_FORMAT = flags.DEFINE_enum("format", "nvfp4", list(policies.FP4_RUNS),
                            "FP4 format of the rollout and both training forwards.")
_DECODE_IMPLS = flags.DEFINE_list(
    "decode_impls", None, f"Rollout decode paths (`decode_impl`: auto or one of {DECODE_IMPLS}; "
    "default: the config's, which is `auto`, the kernels on a Hopper GPU and the XLA "
    "reference elsewhere), each "
    "measured on its own rollout; the report is the first one's.")
_PLAN_FIELDS = flags.DEFINE_list(
    "plan_fields", [], "Kernel plan fields set on the config, as field=value (e.g. "
    "decode_attention=fused: the rollout's single-pass attention; layer_loop=scan: the "
    "rollout's and the trainer's layers under `lax.scan`), to measure what a plan choice "
    "does to the mismatch.")
_BUDGET = flags.DEFINE_float(
    "guidance_budget", None, "Bytes of guidance per token: choose the guided layers by greedy "
    "selection on a calibration rollout of other prompts (trace_jax.train.guidance_budget), "
    "and report them on this run's prompts against the deepest layers of the same bytes, the "
    "deeper half (the default rule) and no guidance.")
_SWEEP = flags.DEFINE_bool(
    "guidance_budget_sweep", False, "Report held-out |dlogp|, K3 and flips against guidance "
    "bytes per token for the greedy selection and the deepest-k rule at every size (JSON and "
    "a plot, <json_out>_budget.png).")
flags.register_validator(
    "decode_impls", lambda v: v is None or (bool(v) and set(v) <= {"auto", *DECODE_IMPLS}),
    f"--decode_impls takes a non-empty list of auto, {', '.join(DECODE_IMPLS)}")


def tiny_config() -> ModelConfig:
  """The default: the tiny model in bfloat16, whose prefill/decode drift is realistic."""
  return model_lib.tiny(dtype="bfloat16")


def load_config(path: str | None) -> ModelConfig:
  """The `model` section of a config file (as train_rl reads it), or the tiny default."""
  if path is None:
    return tiny_config()
  import importlib.util
  spec = importlib.util.spec_from_file_location("mismatch_config", path)
  if spec is None or spec.loader is None:
    raise ValueError(f"cannot load config file {path}")
  mod = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(mod)
  except OSError as e:
    raise ValueError(f"--config={path}: cannot load the config file: {e.strerror}") from e
  return rl_loop.model_config(mod.get_config())


def measure(params: Any, config: ModelConfig, prompts: Sequence[Sequence[int]],
            sampling: Sequence[SamplingParams], guidance_mode: str = "compact",
            routing_replay: bool = False, keep_records: bool = False,
            fmt: str = "nvfp4") -> dict[str, Any]:
  """Runs rollout and both training policies of FP4 format `fmt`; returns the report dict.

  The rollout records the training record (`guidance_mode`, guided layers), every layer's
  routing, and full codes of every layer and site (audit) for all sequences; flips are counted
  by `trace_jax.train.mismatch` (E2M1 values, expert_mid rows matched by expert id).
  keep_records: also return the raw records under "records" (rollout, and per policy the
  trainer's taps), for checks; not JSON.
  """
  n_layers = config.num_hidden_layers
  all_layers = tuple(range(n_layers))
  guided_layers = tuple(config.guided_layers)
  runs = [policies.POLICIES[p] for p in policies.FP4_RUNS[fmt]]  # (RTN, TRACE)
  rollout_cfg = dataclasses.replace(config, policy=runs[1].rollout.name,
                                    guidance_mode=guidance_mode)
  engine = InProcessEngine(params, rollout_cfg, audit_fraction=1.0)
  t0 = time.perf_counter()
  samples = engine.generate(prompts, sampling)
  rollout_s = time.perf_counter() - t0
  rec = engine.last_guidance
  seqs = [s.prompt + s.tokens for s in samples]
  n_new = sum(len(s.tokens) for s in samples)
  kernel_plan = plan_lib.resolve(rollout_cfg)
  print(f"[decode_impl={kernel_plan.decode_impl}] rollout ({runs[1].rollout.name}): "
        f"{len(samples)} sequences, {n_new} tokens in {rollout_s:.1f} s (compile included)",
        flush=True)

  report: dict[str, Any] = {
      "config": {k: v for k, v in dataclasses.asdict(config).items()},
      "num_sequences": len(samples), "generated_tokens": n_new,
      "guided_layers": list(guided_layers), "guidance_mode": guidance_mode, "format": fmt,
      "routing_replay": routing_replay, "rollout_seconds": rollout_s,
      "kernel_plan": kernel_plan.as_dict(), "policies": {},
  }
  for run in runs:
    policy = run.name
    cfg = dataclasses.replace(config, policy=run.train.name, guidance_mode=guidance_mode)
    t0 = time.perf_counter()
    g = rec["guidance"] if run.guided else None
    used = all_layers if routing_replay else guided_layers if g else ()
    out = scoring.score(params, cfg, seqs, guidance=g,
                        routing={layer: rec["routing"][layer] for layer in used} or None,
                        replay=routing_replay, tap_layers=all_layers, tap_mode="full")
    train_routing = {layer: t.pop("routing") for layer, t in out["taps"].items()}
    print(f"[decode_impl={kernel_plan.decode_impl}] {policy}: trainer scored in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    if keep_records:
      report.setdefault("records", {"rollout": rec})[policy] = {
          "taps": out["taps"], "routing": train_routing}
    counts = mismatch.compare(out["taps"], rec["audit"]["guidance"], train_routing,
                              rec["routing"], guided_layers)
    report["policies"][policy] = _policy_report(counts, out["logprobs"], samples, n_layers)
  rtn, trace = (report["policies"][r.name] for r in runs)
  report["flip_rate_rtn"] = rtn["flip_rate_guided_sites"]
  report["flip_rate_trace"] = trace["flip_rate_guided_sites"]
  report["routing_flip_rate"] = {p: v["routing_flip_rate"] for p, v in report["policies"].items()}
  report["mean_abs_dlogp"] = {p: v["mean_abs_dlogp"] for p, v in report["policies"].items()}
  report["k3_kl"] = {p: v["k3_kl"] for p, v in report["policies"].items()}
  report.update(_guidance_bytes(rec, config, fmt))
  return report


def _policy_report(counts: mismatch.MismatchReport, trainer_logp: Sequence[np.ndarray],
                   samples: Sequence[Any], n_layers: int) -> dict[str, Any]:
  """One training policy's figures: code and routing flips (per layer and overall) from
  `counts`, and the log-prob mismatch of the completion tokens against the rollout's."""
  per_layer: dict[str, dict[str, float | None]] = {}
  for layer in range(n_layers):
    row = {site: counts.flips[(layer, site)].rate for site in SITES}
    row["routing"] = counts.routing[layer].flip_rate
    row["routing_order_swaps"] = counts.routing[layer].order_swap_rate
    per_layer[str(layer)] = row
  # Completion tokens: rows P-1 .. P+n-2 of each sequence's scores.
  lt = np.concatenate([lp[len(s.prompt) - 1:] for lp, s in zip(trainer_logp, samples)])
  lr = np.concatenate([np.asarray(s.logprobs, np.float32) for s in samples])
  m = losses.mismatch_metrics(jnp.asarray(lt), jnp.asarray(lr), jnp.ones_like(jnp.asarray(lt)))
  summary = counts.metrics()
  return {
      "flip_rate_guided_sites": summary["flip_rate_guided"],
      "flip_rate_all_sites": counts.total().rate,
      "flip_one_apart_share": summary["flip_one_apart_share"],
      "scale_flip_rate_guided": summary["scale_flip_rate_guided"],
      "per_layer": per_layer,
      "routing_flip_rate": summary["routing_flip_rate"],
      "routing_order_swap_rate": summary["routing_order_swap_rate"],
      "expert_unmatched_rate": summary["expert_unmatched_rate"],
      "mean_abs_dlogp": float(m["mean_abs_dlogp"]), "k3_kl": float(m["k3_kl"]),
      "max_abs_dp": float(m["max_abs_dp"]),
  }


def _guidance_bytes(rec: dict[str, Any], config: ModelConfig, fmt: str) -> dict[str, Any]:
  """The rollout's guidance bytes per token: what fp4_trace consumes (the compact record of
  the guided layers and the expert ids that place it) against full codes of every layer, and
  the per-row formula."""
  guided_layers = tuple(config.guided_layers)
  tokens = sum(rec["token_counts"])
  audit = rec["audit"]["guidance"]
  comp = sum(guided.compact(jax.tree.map(jnp.asarray, audit[layer][site])).nbytes
             for layer in guided_layers for site in SITES)
  ids = sum(rec["routing"][layer].nbytes for layer in guided_layers)
  full_all = sum(audit[layer][site].nbytes for layer in range(config.num_hidden_layers)
                 for site in SITES)
  return {
      "guidance_bytes_per_token": (comp + ids) / tokens,
      "full_guidance_bytes_per_token_all_layers": full_all / tokens,
      "compact_vs_full_ratio": full_all / max(comp + ids, 1),
      "guidance_bytes_per_row_formula": {
          f"{mode}_K{k}": bytes_per_row(k, mode, fmt) for mode in ("compact", "full")
          for k in (config.hidden_size, config.head_dim, config.moe_intermediate_size)},
  }


def by_decode_impl(reports: dict[str, dict[str, Any]]) -> dict[str, Any]:
  """The first report with every decode path's summary beside it: `by_decode_impl` (mean
  |dlogp|, k3 KL and guided-site flip rates per policy) and, with both paths, each policy's
  `<policy>_dlogp_kernel_over_xla`."""
  first = dict(next(iter(reports.values())))
  first["by_decode_impl"] = {
      impl: {"mean_abs_dlogp": r["mean_abs_dlogp"], "k3_kl": r["k3_kl"],
             "flip_rate_rtn": r["flip_rate_rtn"], "flip_rate_trace": r["flip_rate_trace"]}
      for impl, r in reports.items()}
  if {"xla", "kernel"} <= set(reports):
    for policy, x in reports["xla"]["mean_abs_dlogp"].items():
      k = reports["kernel"]["mean_abs_dlogp"][policy]
      first[f"{policy}_dlogp_kernel_over_xla"] = k / x if x else (1.0 if k == x else np.inf)
  return first


def plot(report: dict[str, Any], path: str) -> None:
  """Per-layer flip rates (all sites pooled) for both policies, guided layers shaded."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  names = list(report["policies"])  # (RTN, TRACE) of the report's format
  layers = sorted(int(k) for k in report["policies"][names[0]]["per_layer"])
  fig, axes = plt.subplots(1, len(SITES), figsize=(4 * len(SITES), 3.2), sharey=True)
  for ax, site in zip(axes, SITES):
    for j, policy in enumerate(names):
      vals = [report["policies"][policy]["per_layer"][str(i)][site] for i in layers]
      ax.bar(np.asarray(layers) + (j - 0.5) * 0.38, vals, width=0.38, label=policy)
    for i in report["guided_layers"]:
      ax.axvspan(i - 0.5, i + 0.5, color="0.92", zorder=0)
    ax.set_title(site)
    ax.set_xlabel("layer (shaded: guided)")
    ax.set_xticks(layers)
  axes[0].set_ylabel("FP4 code flip rate vs rollout")
  axes[0].legend()
  fig.suptitle(f"Rollout/trainer {report['format'].upper()} code flips per layer")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def check_flags(config: ModelConfig) -> None:
  """Raises ValueError naming every flag out of range for `config`."""
  errors = [f"--{f.name} must be >= 1, got {f.value}" for f in (_NUM_PROMPTS, _PROMPT_LEN, _MAX_NEW)
            if f.value < 1]
  if _PROMPT_LEN.value + _MAX_NEW.value > config.max_position_embeddings:
    errors.append(f"--prompt_len + --max_new_tokens = {_PROMPT_LEN.value + _MAX_NEW.value} "
                  f"exceeds the model's max_position_embeddings={config.max_position_embeddings}")
  if _BUDGET.value is not None:
    trace = policies.POLICIES[policies.FP4_RUNS[_FORMAT.value][1]]
    one = guidance_budget.layer_bytes(config.replace(policy=trace.rollout.name,
                                                     guidance_mode=_MODE.value))
    try:
      guidance_budget.check_budget(_BUDGET.value, {0: one})
    except guidance_budget.BudgetError as e:
      errors.append(f"--guidance_budget: {e}")
  if errors:
    raise ValueError("; ".join(errors))


def plan_fields(items: Sequence[str]) -> dict[str, str]:
  """`--plan_fields` entries field=value -> {field: value}, each a kernel plan field
  (`plan.FIELDS`) and one of its choices or "auto"; else ValueError naming the entry."""
  out = {}
  for item in items:
    name, sep, value = item.partition("=")
    if not sep or name not in plan_lib.FIELDS:
      raise ValueError(f"--plan_fields entry {item!r}: want field=value with field one of "
                       f"{sorted(plan_lib.FIELDS)}")
    if value not in (plan_lib.AUTO, *plan_lib.FIELDS[name]):
      raise ValueError(f"--plan_fields entry {item!r}: {name} is one of "
                       f"{[plan_lib.AUTO, *plan_lib.FIELDS[name]]}")
    out[name] = value
  return out


def main(argv: Sequence[str]) -> None:
  del argv
  with run_guard.exit_on_errors(log_dir=os.path.dirname(os.path.abspath(_JSON_OUT.value))):
    with run_guard.user_input():
      config = dataclasses.replace(load_config(_CONFIG.value), **plan_fields(_PLAN_FIELDS.value))
      check_flags(config)
    _main(config)


def _main(config: ModelConfig) -> None:
  key = jax.random.key(_SEED.value)
  params = model_lib.init_params(config, jax.random.fold_in(key, 0))
  rng = np.random.default_rng(_SEED.value)
  prompts = rng.integers(0, config.vocab_size, (_NUM_PROMPTS.value, _PROMPT_LEN.value)).tolist()
  sampling = [SamplingParams(max_new_tokens=_MAX_NEW.value, seed=_SEED.value * 1000 + i)
              for i in range(_NUM_PROMPTS.value)]
  report = by_decode_impl({
      impl: measure(params, dataclasses.replace(config, decode_impl=impl), prompts, sampling,
                    _MODE.value, _REPLAY.value, fmt=_FORMAT.value)
      for impl in dict.fromkeys(_DECODE_IMPLS.value or [config.decode_impl])})
  report["plan_fields"] = plan_fields(_PLAN_FIELDS.value)
  os.makedirs(os.path.dirname(os.path.abspath(_JSON_OUT.value)), exist_ok=True)
  if _BUDGET.value is not None or _SWEEP.value:
    report["guidance_budget"] = budget_report(params, config, prompts, sampling)
  with open(_JSON_OUT.value, "w") as f:
    json.dump(report, f, indent=1)
  png = _PNG_OUT.value or os.path.splitext(_JSON_OUT.value)[0] + ".png"
  plot(report, png)
  print(f"{'policy':<10} {'flips@guided':>13} {'flips@all':>10} {'routing':>8} "
        f"{'|dlogp|':>9} {'k3_kl':>10}")
  for p, v in report["policies"].items():
    print(f"{p:<10} {v['flip_rate_guided_sites']:>13.5f} {v['flip_rate_all_sites']:>10.5f} "
          f"{v['routing_flip_rate']:>8.4f} {v['mean_abs_dlogp']:>9.5f} {v['k3_kl']:>10.2e}")
  print(f"guidance bytes/token: {report['guidance_bytes_per_token']:.1f} (compact, guided "
        f"layers) vs {report['full_guidance_bytes_per_token_all_layers']:.1f} (full codes, all "
        f"layers): {report['compact_vs_full_ratio']:.2f}x smaller")
  if len(report["by_decode_impl"]) > 1:
    for impl, v in report["by_decode_impl"].items():
      print(f"decode_impl={impl}: mean |dlogp| " + ", ".join(
          f"{p} {d:.5f}" for p, d in v["mean_abs_dlogp"].items()))
    for k, v in report.items():
      if k.endswith("_dlogp_kernel_over_xla"):
        print(f"{k}: {v:.3f}")
  if "guidance_budget" in report:
    print_budget(report["guidance_budget"])
  print(f"wrote {_JSON_OUT.value} and {png}")


def budget_report(params: Any, config: ModelConfig, prompts: list[list[int]],
                  sampling: list[SamplingParams]) -> dict[str, Any]:
  """The guided layers chosen under --guidance_budget (or the whole greedy path with
  --guidance_budget_sweep) on a calibration rollout of other prompts, measured on `prompts`."""
  trace = policies.POLICIES[policies.FP4_RUNS[_FORMAT.value][1]]
  rollout_cfg = config.replace(policy=trace.rollout.name, guidance_mode=_MODE.value)
  train_cfg = config.replace(policy=trace.train.name, guidance_mode=_MODE.value)
  rng = np.random.default_rng(_SEED.value + 1)  # prompts the measurement does not see
  cal_prompts = rng.integers(0, config.vocab_size, np.shape(prompts)).tolist()
  cal_sampling = [dataclasses.replace(sp, seed=sp.seed + 500) for sp in sampling]
  cal = guidance_budget.calibration_rollout(params, rollout_cfg, cal_prompts, cal_sampling)
  layers = tuple(range(config.num_hidden_layers))
  unit_bytes = guidance_budget.layer_bytes_per_token(cal, layers)
  budget = _BUDGET.value
  path = guidance_budget.greedy_path(guidance_budget.LayerScorer(params, train_cfg, cal),
                                     unit_bytes, None if _SWEEP.value else budget, progress=True)
  held = guidance_budget.LayerScorer(
      params, train_cfg, guidance_budget.calibration_rollout(params, rollout_cfg, prompts,
                                                             sampling))
  half = config.guided_layers
  out: dict[str, Any] = {
      "unit": "layer", "unit_bytes_per_token": {str(k): v for k, v in unit_bytes.items()},
      "calibration_path": path, "none": held.metrics(()),
      "deeper_half": {"layers": list(half), "bytes_per_token": sum(unit_bytes[i] for i in half),
                      **held.metrics(half)}}
  if budget is not None:
    chosen = guidance_budget.select(path, budget)
    same = guidance_budget.deepest(len(chosen), len(layers))
    out.update(budget_bytes_per_token=budget, selected={
        "layers": list(chosen), "bytes_per_token": sum(unit_bytes[i] for i in chosen),
        **held.metrics(chosen)}, deepest_same_bytes={"layers": list(same), **held.metrics(same)})
  if _SWEEP.value:
    out["curve"] = guidance_budget.curve(held, path, unit_bytes)
    png = os.path.splitext(_JSON_OUT.value)[0] + "_budget.png"
    guidance_budget.plot_curve(out["curve"], f"guided layers by measured mismatch "
                               f"({len(layers)} layers, held-out prompts)", png)
    out["plot"] = png
  return out


def print_budget(b: dict[str, Any]) -> None:
  rows = [("no guidance", b["none"]), (f"deeper half {b['deeper_half']['layers']}",
                                       b["deeper_half"])]
  if "selected" in b:
    rows += [(f"budget {b['budget_bytes_per_token']:g} B: {b['selected']['layers']}",
              b["selected"]),
             (f"deepest, same bytes {b['deepest_same_bytes']['layers']}",
              b["deepest_same_bytes"])]
  for p in b.get("curve", []):
    rows += [(f"greedy k={p['k']} {p['budgeted']['layers']}", p["budgeted"]),
             (f"deepest k={p['k']} {p['deepest']['layers']}", p["deepest"])]
  print(f"{'held-out prompts':<40} {'|dlogp|':>9} {'k3_kl':>10} {'flips guided':>12} "
        f"{'unguided':>9}")
  fmt = lambda v: "-" if v is None else f"{v:.5f}"
  for name, m in rows:
    print(f"{name:<40} {m['mean_abs_dlogp']:>9.5f} {m['k3_kl']:>10.2e} "
          f"{fmt(m['flip_rate_guided']):>12} {fmt(m['flip_rate_unguided']):>9}")


if __name__ == "__main__":
  app.run(main, flags_parser=run_guard.flags_parser())
