"""Policy strings of the training-step benchmark (`experiments.bench.train_step`): the model
config each one times, the headline ratios of its rows, and the floors FP8 GEMMs could reach."""

from __future__ import annotations

from typing import Any

from absl import app

from trace_jax import model as M
from trace_jax.model import plan as plan_lib


def train_variant(base: M.ModelConfig, impl: str, attention: str, policy: str) -> M.ModelConfig:
  """The config `experiments.bench.train_step` times for a policy string `name[@fp8_gemm]`
  with options `+fp8bwd`, one of `+scan` / `+unrolled`, and `+FIELD=VALUE` plan fields, on
  the given grouped-matmul impl and full-sequence attention. Kept apart from the benchmark's
  module, whose absl flags are global (tests import this without them)."""
  name, *opts = policy.split("+")
  fields = dict(opt.split("=", 1) for opt in opts if "=" in opt)
  flags_ = {opt for opt in opts if "=" not in opt}
  if flags_ - {"fp8bwd", "scan", "unrolled"} or {"scan", "unrolled"} <= flags_:
    raise app.UsageError(f"{policy}: options are +fp8bwd, one of +scan, +unrolled, and "
                         "+FIELD=VALUE plan fields")
  unknown = set(fields) - set(plan_lib.FIELDS) | set(fields) & {"moe_impl", "seq_attention"}
  if unknown:
    raise app.UsageError(f"{policy}: {sorted(unknown)} are not plan fields a policy sets "
                         "(moe_impl and seq_attention have their own flags)")
  name, _, fp8_gemm = name.partition("@")
  layers = "scan" if "scan" in flags_ else "unrolled" if "unrolled" in flags_ else "auto"
  return base.replace(policy=name, moe_impl=impl, fp8_gemm=fp8_gemm or "auto",
                      fp8_backward="fp8bwd" in flags_, layer_loop=layers,
                      seq_attention=attention, **fields)


def headline_ratios(rows: dict[str, dict[str, Any]], first: str, flop: float, rate: float
                    ) -> dict[str, float]:
  """The benchmark's headline figures from its rows ("IMPL ATTENTION POLICY" -> ms_per_step,
  policy, fp8_gemm as the plan resolved it, fp8_backward), against `first` ("IMPL ATTENTION",
  the first of each)'s bf16 step (flop: its matmul FLOPs; rate: the BF16 matmul rate); the FP8
  ones from the first `first` row of fp8_unified whose plan ran the wgmma FP8 GEMMs (the
  plan's on Hopper), else Triton's (`name@wgmma` / `name@kernel`, or a plain name where the
  plan's "auto" takes them)."""
  mine = {label[len(first) + 1:]: row for label, row in rows.items()
          if label.startswith(first + " ") and row.get("ms_per_step")}
  out = {}
  if "bf16" not in mine:
    return out
  bf16 = mine["bf16"]["ms_per_step"]
  out["bf16_mfu"] = flop / (bf16 * 1e-3) / rate

  def fp8(backward: bool) -> float | None:
    return next((r["ms_per_step"] for gemm in ("wgmma", "kernel") for r in mine.values()
                 if r.get("policy") == "fp8_unified" and r.get("fp8_gemm") == gemm
                 and r.get("fp8_backward") == backward), None)

  for key, ms in (("fp8_unified_over_bf16", fp8(False)), ("fp8_full_over_bf16", fp8(True)),
                  ("fp4_trace_over_bf16", mine.get("fp4_trace", {}).get("ms_per_step"))):
    if ms:
      out[key] = ms / bf16
  return out


def fp8_floors(step_ms: float, forward_ms: float, gemm_ms: float | None, bf16_tflops: float,
               fp8_tflops: float) -> dict[str, float | str]:
  """Amdahl's floors of the FP8 policies' step time over the bf16 step's (step_ms): FP8 speeds
  a GEMM at most by fp8_tflops / bf16_tflops, and the rest of the step not at all.

  fp8_unified quantizes the forward's GEMMs only, whose time the forward alone (forward_ms)
  bounds; +fp8bwd quantizes every GEMM, whose time gemm_ms (a profile's GEMM kernels) or else
  the whole step bounds. Each bound is capped at step_ms, and an FP8 rate below the BF16 one
  counts as no speed-up (floor 1): with upper bounds on the GEMM time, that keeps both floors
  lower bounds.
  """
  for name, v in (("step_ms", step_ms), ("forward_ms", forward_ms),
                  ("bf16_tflops", bf16_tflops), ("fp8_tflops", fp8_tflops)):
    if not v > 0:
      raise ValueError(f"fp8_floors: {name} must be > 0, got {v}")
  if gemm_ms is not None and not gemm_ms >= 0:
    raise ValueError(f"fp8_floors: gemm_ms must be >= 0 or None, got {gemm_ms}")
  saved = max(0.0, 1.0 - bf16_tflops / fp8_tflops)  # the fraction of a GEMM's time FP8 saves
  floor = lambda ms: 1.0 - min(ms, step_ms) / step_ms * saved
  return {"fp8_unified_floor": floor(forward_ms),
          "fp8_full_floor": floor(step_ms if gemm_ms is None else gemm_ms),
          "fp8_full_floor_gemm_bound": "step" if gemm_ms is None else "profile"}
