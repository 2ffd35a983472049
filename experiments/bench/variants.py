"""Policy strings of the training-step benchmark (`experiments.bench.train_step`): the model
config each one times, and the headline ratios of its rows."""

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
  ones from the first `first` row of fp8_unified whose plan ran the FP8 GEMM kernels
  (`name@kernel`, or a plain name where the plan's "auto" takes them)."""
  mine = {label[len(first) + 1:]: row for label, row in rows.items()
          if label.startswith(first + " ") and row.get("ms_per_step")}
  out = {}
  if "bf16" not in mine:
    return out
  bf16 = mine["bf16"]["ms_per_step"]
  out["bf16_mfu"] = flop / (bf16 * 1e-3) / rate

  def fp8(backward: bool) -> float | None:
    return next((r["ms_per_step"] for r in mine.values()
                 if r.get("policy") == "fp8_unified" and r.get("fp8_gemm") == "kernel"
                 and r.get("fp8_backward") == backward), None)

  for key, ms in (("fp8_unified_over_bf16", fp8(False)), ("fp8_full_over_bf16", fp8(True)),
                  ("fp4_trace_over_bf16", mine.get("fp4_trace", {}).get("ms_per_step"))):
    if ms:
      out[key] = ms / bf16
  return out
