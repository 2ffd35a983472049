"""Precision policies of an RL run, as data: what the rollout runs, what the trainer runs.

A run policy pairs two forward precisions (`ModelConfig.policy`: how one forward quantizes,
`trace_jax/model/precision.py`) with whether the trainer rounds under the rollout's guidance.
Adding a policy is one entry in `POLICIES`. A run may add options after "+":
`fp4_trace+r3` replays the rollout's routing in the training forward (R3).

| policy        | rollout forward               | training forward          | guidance |
|---------------|-------------------------------|---------------------------|----------|
| `bf16`        | BF16                          | BF16                      | -        |
| `fp8_unified` | FP8 linear layers (Jet-RL)    | the same FP8 quantization | -        |
| `fp4_rollout` | NVFP4 W/A + KV                | BF16 (off-policy baseline)| -        |
| `fp4_rtn`     | NVFP4 W/A + KV                | NVFP4 QAT, own scales, RTN| -        |
| `fp4_trace`   | NVFP4 W/A + KV, records       | NVFP4, guided rounding    | trains   |
"""

from __future__ import annotations

import dataclasses

from trace_jax.model.config import FP4_POLICIES

OPTIONS = {"r3": "replay the rollout's routing (expert ids of every layer) in training"}


@dataclasses.dataclass(frozen=True)
class PrecisionPolicy:
  """One run policy: the rollout's and the trainer's forward precision, and guidance use."""
  name: str
  rollout: str  # ModelConfig.policy of the rollout engine
  train: str    # ModelConfig.policy of the training forward
  guided: bool  # the trainer rounds under the rollout's guidance (TRACE)
  doc: str

  @property
  def fp4_rollout(self) -> bool:
    """Rollout in NVFP4: the engine records routing (and audits codes) for the mismatch."""
    return self.rollout in FP4_POLICIES

  @property
  def fp4_train(self) -> bool:
    """The training forward quantizes to NVFP4, so its codes can flip against the rollout's."""
    return self.train in FP4_POLICIES


POLICIES: dict[str, PrecisionPolicy] = {p.name: p for p in (
    PrecisionPolicy("bf16", "bf16", "bf16", False, "BF16 rollout and training"),
    PrecisionPolicy("fp8_unified", "fp8_unified", "fp8_unified", False,
                    "Jet-RL: the same FP8 quantization in rollout and training"),
    PrecisionPolicy("fp4_rollout", "fp4_trace", "bf16", False,
                    "NVFP4 rollout, BF16 training: the off-policy baseline"),
    PrecisionPolicy("fp4_rtn", "fp4_trace", "fp4_rtn", False,
                    "NVFP4 rollout, NVFP4 QAT with the trainer's own scales (vanilla QAT)"),
    PrecisionPolicy("fp4_trace", "fp4_trace", "fp4_trace", True,
                    "TRACE: NVFP4 rollout records guidance; training rounds under it"),
)}


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """A run's policy and options, parsed from its name ("fp4_trace+r3")."""
  name: str
  policy: PrecisionPolicy
  replay: bool = False


def parse(name: str) -> RunSpec:
  """The RunSpec of a run name; unknown policies or options raise with the known ones."""
  base, *opts = str(name).split("+")
  if base not in POLICIES:
    raise ValueError(f"unknown precision policy {base!r}; known: {sorted(POLICIES)} (options "
                     f"after '+': {sorted(OPTIONS)})")
  bad = [o for o in opts if o not in OPTIONS]
  if bad or len(set(opts)) != len(opts):
    raise ValueError(f"run {name!r}: unknown or repeated options {bad or opts}; options: "
                     + "; ".join(f"{k}: {v}" for k, v in OPTIONS.items()))
  spec = RunSpec(name=str(name), policy=POLICIES[base], replay="r3" in opts)
  if spec.replay and not spec.policy.fp4_rollout:
    raise ValueError(f"run {name!r}: +r3 replays the routing an FP4 rollout records; policy "
                     f"{base!r} records none")
  return spec
