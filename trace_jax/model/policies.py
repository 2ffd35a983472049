"""Precision policies as data (docs/design.md §4): what one forward quantizes, and what an RL
run's rollout and trainer each run.

A `Forward` says how one forward pass quantizes; `ModelConfig.policy` names one and
`trace_jax/model/precision.py` reads its fields at every site. A run `PrecisionPolicy` pairs
a rollout forward with a training forward. Adding either is one entry below. A run may add
options after "+": `fp4_trace+r3` replays the rollout's routing in the training forward (R3);
`fp8_unified+fp8bwd` runs the training backward's GEMMs in FP8 too (Jet-RL's full flow).

Forwards (FP4 quantizes the routed experts' weights, their inputs `moe_in` and `expert_mid`,
and the KV cache `k`/`v`; FP8 runs the attention projections and the experts as block-scaled
FP8 GEMMs, `model/fp8_linear.py`; the router, embeddings, norms and lm_head stay in the
compute dtype):

| forward       | FP4 sites | FP8 linears | rounds under rollout guidance |
|---------------|-----------|-------------|-------------------------------|
| `bf16`        | -         | -           | -                             |
| `fp8_unified` | -         | E4M3        | -                             |
| `fp4_rtn`     | NVFP4     | -           | no (own scales, RTN)          |
| `fp4_trace`   | NVFP4     | -           | yes, where guidance is given  |
| `mxfp4_rtn`   | MXFP4     | -           | no                            |
| `mxfp4_trace` | MXFP4     | -           | yes                           |

Run policies:

| policy          | rollout forward             | training forward              |
|-----------------|-----------------------------|-------------------------------|
| `bf16`          | bf16                        | bf16                          |
| `fp8_unified`   | fp8_unified (Jet-RL)        | fp8_unified                   |
| `fp8_rollout`   | fp8_unified                 | bf16 (off-policy baseline)    |
| `fp4_rollout`   | fp4_trace                   | bf16 (off-policy baseline)    |
| `fp4_rtn`       | fp4_trace                   | fp4_rtn (vanilla QAT)         |
| `fp4_trace`     | fp4_trace, records guidance | fp4_trace (TRACE)             |
| `mxfp4_rollout` / `mxfp4_rtn` / `mxfp4_trace` | the same with MXFP4 | |
"""

from __future__ import annotations

import dataclasses

from trace_jax.quant.formats import FP4_BLOCKS, FP8_GROUP

OPTIONS = {"r3": "replay the rollout's routing (expert ids of every layer) in training",
           "fp8bwd": "FP8 DGrad/WGrad GEMMs in training (Jet-RL's full flow; FP8 linears only)"}


@dataclasses.dataclass(frozen=True)
class Forward:
  """How one forward pass quantizes.

  fp4: the FP4 format ("nvfp4", "mxfp4") of the TRACE sites (routed-expert weights, their
    inputs, the KV cache), or None.
  fp8_linears: FP8 E4M3 on the inputs and weights of every linear layer in the decoder blocks
    (attention projections and experts), Jet-RL granularity (1x128 / 128x128).
  guided: the forward rounds its FP4 sites under rollout guidance where it is given (the
    training side of TRACE; on the rollout side, the engine records that guidance).
  """
  name: str
  fp4: str | None = None
  fp8_linears: bool = False
  guided: bool = False
  doc: str = ""

  def __post_init__(self):
    if self.fp4 is not None and self.fp4 not in FP4_BLOCKS:
      raise ValueError(f"forward {self.name!r}: unknown FP4 format {self.fp4!r}")
    if self.guided and self.fp4 is None:
      raise ValueError(f"forward {self.name!r}: guided rounding needs an FP4 format")
    if self.fp4 is not None and self.fp8_linears:
      raise ValueError(f"forward {self.name!r}: FP4 sites and FP8 linears are not combined")

  @property
  def quantized(self) -> bool:
    return self.fp4 is not None or self.fp8_linears

  @property
  def fp4_block(self) -> int | None:
    return None if self.fp4 is None else FP4_BLOCKS[self.fp4]

  def block_errors(self, sizes: dict[str, int]) -> list[str]:
    """Messages for the sizes (name -> value) this forward cannot quantize in blocks."""
    block, what = ((self.fp4_block, f"{self.fp4.upper()} blocks") if self.fp4 is not None
                   else (FP8_GROUP, "FP8 blocks") if self.fp8_linears else (None, ""))
    if block is None:
      return []
    return [f"policy {self.name!r} quantizes along {name} in {what} of {block}, but {name} = "
            f"{v}" for name, v in sizes.items() if v % block]


FORWARDS: dict[str, Forward] = {f.name: f for f in (
    Forward("bf16", doc="BF16 (the compute dtype) everywhere"),
    Forward("fp8_unified", fp8_linears=True,
            doc="Jet-RL: FP8 E4M3 inputs and weights of every linear layer"),
    Forward("fp4_rtn", fp4="nvfp4", doc="NVFP4 experts and KV cache, own scales, RTN"),
    Forward("fp4_trace", fp4="nvfp4", guided=True,
            doc="NVFP4 experts and KV cache; guided rounding where rollout guidance is given"),
    Forward("mxfp4_rtn", fp4="mxfp4", doc="MXFP4 experts and KV cache, own scales, RTN"),
    Forward("mxfp4_trace", fp4="mxfp4", guided=True,
            doc="MXFP4 experts and KV cache; guided rounding where rollout guidance is given"),
)}


def forward_of(name: str) -> Forward:
  """The Forward named `name`; unknown names raise with the known ones."""
  if name not in FORWARDS:
    raise ValueError(f"unknown precision policy {name!r}; expected one of {tuple(FORWARDS)}")
  return FORWARDS[name]


@dataclasses.dataclass(frozen=True)
class PrecisionPolicy:
  """One run policy: the rollout's and the trainer's forward. The backward's GEMMs are BF16
  unless the run adds `+fp8bwd` (`RunSpec.fp8_backward`); gradients between operators are
  BF16 always."""
  name: str
  rollout: Forward
  train: Forward
  doc: str

  def __post_init__(self):
    if self.train.guided and self.rollout.fp4 != self.train.fp4:
      raise ValueError(f"policy {self.name!r}: guided training needs a rollout in its format")

  @property
  def guided(self) -> bool:
    """The trainer rounds under the rollout's guidance (TRACE); the rollout records it."""
    return self.train.guided

  @property
  def fp4_rollout(self) -> bool:
    """Rollout in FP4: the engine records routing (and audits codes) for the mismatch."""
    return self.rollout.fp4 is not None

  @property
  def fp4_train(self) -> bool:
    """The training forward quantizes to FP4, so its codes can flip against the rollout's."""
    return self.train.fp4 is not None


def _run(name: str, rollout: str, train: str, doc: str) -> PrecisionPolicy:
  return PrecisionPolicy(name, FORWARDS[rollout], FORWARDS[train], doc)


POLICIES: dict[str, PrecisionPolicy] = {p.name: p for p in (
    _run("bf16", "bf16", "bf16", "BF16 rollout and training"),
    _run("fp8_unified", "fp8_unified", "fp8_unified",
         "Jet-RL: the same FP8 quantization in rollout and training"),
    _run("fp8_rollout", "fp8_unified", "bf16",
         "FP8 rollout, BF16 training: the off-policy baseline Jet-RL argues against"),
    _run("fp4_rollout", "fp4_trace", "bf16",
         "NVFP4 rollout, BF16 training: the off-policy baseline"),
    _run("fp4_rtn", "fp4_trace", "fp4_rtn",
         "NVFP4 rollout, NVFP4 QAT with the trainer's own scales (vanilla QAT)"),
    _run("fp4_trace", "fp4_trace", "fp4_trace",
         "TRACE: NVFP4 rollout records guidance; training rounds under it"),
    _run("mxfp4_rollout", "mxfp4_trace", "bf16",
         "MXFP4 rollout, BF16 training: the off-policy baseline"),
    _run("mxfp4_rtn", "mxfp4_trace", "mxfp4_rtn",
         "MXFP4 rollout, MXFP4 QAT with the trainer's own scales"),
    _run("mxfp4_trace", "mxfp4_trace", "mxfp4_trace",
         "TRACE in MXFP4: the rollout records guidance; training rounds under it"),
)}


# The vanilla-QAT and the TRACE run policy of each FP4 format (measure_mismatch, tests).
FP4_RUNS = {"nvfp4": ("fp4_rtn", "fp4_trace"), "mxfp4": ("mxfp4_rtn", "mxfp4_trace")}


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """A run's policy and options, parsed from its name ("fp4_trace+r3")."""
  name: str
  policy: PrecisionPolicy
  replay: bool = False
  fp8_backward: bool = False


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
  spec = RunSpec(name=str(name), policy=POLICIES[base], replay="r3" in opts,
                 fp8_backward="fp8bwd" in opts)
  if spec.replay and not spec.policy.fp4_rollout:
    raise ValueError(f"run {name!r}: +r3 replays the routing an FP4 rollout records; policy "
                     f"{base!r} records none")
  if spec.fp8_backward and not spec.policy.train.fp8_linears:
    raise ValueError(f"run {name!r}: +fp8bwd runs the FP8 linears' backward GEMMs in FP8; "
                     f"policy {base!r} trains without FP8 linears")
  return spec
