"""Policy strings of the training-step benchmark (`experiments.bench.train_step`): the model
config each one times."""

from __future__ import annotations

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
