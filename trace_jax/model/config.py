"""`ModelConfig`: the Qwen3-MoE shape (HF field names) plus this project's precision fields.

A frozen, hashable dataclass: it is passed to jitted functions as a static argument, and
`dataclasses.replace(config, dtype="float32")` switches the compute dtype. `from_hf_dict` and
`to_hf_dict` translate to and from HF `config.json`, reading both spellings that transformers
4.x/SGLang and transformers 5.x use and writing both (docs/design.md §7).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from trace_jax.guidance.record import MODES as GUIDANCE_MODES
from trace_jax.guidance.record import SITES as SITES  # re-exported: the model's sites
from trace_jax.model import plan as plan_lib
from trace_jax.model.policies import Forward, forward_of

DTYPES = ("float32", "bfloat16")
# The implementations a config may force per operation (`trace_jax.model.plan`).
MOE_IMPLS = plan_lib.FIELDS["moe_impl"]  # trace_jax.model.grouped
DECODE_IMPLS = plan_lib.FIELDS["decode_impl"]  # the rollout's one-token decode steps
FP8_GEMMS = plan_lib.FIELDS["fp8_gemm"]  # FP8 linears' GEMMs (trace_jax.model.fp8_linear)

# HF keys that carry no information for this model but are written for SGLang / transformers.
_HF_CONSTANTS = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "use_sliding_window": False,
    "sliding_window": None,
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Qwen3-MoE decoder shape (HF names) and the precision policy of docs/design.md §4.

  guided_layers: indices of the decoder layers whose quantization sites take rollout guidance
    in a guided policy (`fp4_trace`, `mxfp4_trace`); None means the deepest half
    (`num_hidden_layers // 2 ..`).
  plan: the kernel plan's preset (`trace_jax.model.plan.PRESETS`: "auto", the fastest measured
    implementations on the backend, "reference", XLA everywhere, or "invariant", the reference
    with every sum in a fixed order, row-invariant); the per-operation fields
    below, "auto" by default, force one operation's implementation over it. `plan.resolve`
    turns the config into the `KernelPlan` its programs run; docs of every field there.
  moe_impl: the experts' grouped matmuls of training and prefill (`trace_jax.model.grouped`):
    "tiled" (XLA), "ragged_dot" (XLA) or "kernel" (Pallas grouped GEMMs reading the stacked
    weights in place; N and K multiples of 16).
  decode_impl: the rollout engine's one-token decode steps: "xla" (dequantize + moe_impl,
    XLA attention) or "kernel" (the decode kernels: experts, attention projections and lm_head
    through `kernels.fp4_moe` reading packed NVFP4 / BF16 / FP8 weights in place, attention
    through `kernels.decode_attention`); training never uses it.
  decode_moe_kernel: under decode_impl="kernel", the packed NVFP4 experts' kernel: "triton" or
    "wgmma" (Hopper; shapes it does not take run Triton); the same weights, sums in another
    float32 order.
  fp4_codes: packed NVFP4 codes (the engine's experts, the packed KV cache) held as "bytes"
    (`formats.pack_fp4`'s layout) or "words" per block (the GPU kernels' decoder).
  decode_attention: the kernel decode's attention over its cache: "triton", "wgmma" (Hopper) or
    "fused" (`kernels.flash_decode`: one pass, online softmax, not `attend`'s bits).
  kv_cache: under NVFP4 forwards, the KV cache "dense" (fake-quantized values) or "packed"
    (NVFP4 codes and scales, `kernels.kv_cache`).
  nvfp4_sites: the rollout's unguided NVFP4 activation sites: "xla" or "kernel"
    (`kernels.nvfp4_act`, one Pallas kernel per site).
  kv_write: a one-token kernel decode step's k/v sites on the packed cache: "xla" (the site
    kernel, then XLA packs and scatters) or "kernel" (`kernels.kv_append`: quantized, with the
    sites' records where tapped, and written in place in one kernel; the same bits).
  fake_quant: NVFP4 training forwards' fake quantizers of the routed expert weights and the
    activation sites, guided and RTN: "xla" (`qat`'s) or "kernel"
    (`kernels.nvfp4_act.qdq_rows` and `guided_qdq_rows`, one read and one write per
    element); the same bits.
  fp8_gemm: how forwards with FP8 linears (`fp8_unified`) run their block-scaled FP8 GEMMs
    (`trace_jax.model.fp8_linear`): "xla" (the plain-JAX reference: dequantized float32
    operands) or "kernel" (Pallas on the FP8 tensor cores); the same sums up to order.
  fp8_bwd_operands: who makes `fp8_backward`'s operands (the experts' WGrad rows padded to
    128-row tiles, transposed, quantized in 128x1 groups; the DGrad's weight codes
    transposed): "xla" (a gather, transposes, the quantizer) or "kernel" (`kernels.fp8_tiles`,
    one pass each); the same bits.
  seq_attention: attention of full-sequence forwards over positions 0..S-1 (training,
    scoring, prefill): "xla" (`attention_math.attend`, the [S, S] float32 scores in memory) or
    "cudnn" (cuDNN's fused flash attention through `jax.nn.dot_product_attention`: float32
    softmax statistics, no scores in memory; bf16, head_dim a multiple of 8 up to 128,
    a GPU). Decode steps never use it; the same values up to float32 order and where the
    probabilities are rounded.
  layer_loop: every forward's layer loop (the rollout's and the trainer's alike, as their
    agreement needs): "scan" (each run of `scan_layers` one `lax.scan`, `scan_unroll` layers
    per iteration) or "unrolled" (each such scan unrolled whole: no stacked weights, slices
    or carried copies on the GPU, compile time growing with depth; `model.plan`).
  fp8_backward: those forwards' DGrad/WGrad GEMMs on FP8 operands too (Jet-RL's full flow);
    False: BF16 backward GEMMs. Gradients between operators are BF16 either way.
  scan_layers: run layers the forward treats alike as one `lax.scan` (compile time flat in
    depth; `layer_runs.layer_runs`); False unrolls every layer (the reference).
  scan_unroll: layers per iteration of those scans (`lax.scan(unroll=)`): on the GPU every
    iteration is a host round of launches, so fewer iterations cost the host less, for a
    body (and compile time) that many layers large.
  decode_steps_per_sync: decode steps the rollout engine runs between two checks of its loop
    condition (is every row done?): on the GPU each check is a device-to-host copy the host
    waits on, so the GPU idles while the host queues the next step. Outputs are the same for
    any value; a call runs up to this many minus one steps past its last live one.
  logits_fp32: the LM head in float32 (the final norm's output and lm_head's weight, both at
    `dtype`, multiplied with float32 accumulation and output) in the rollout and the trainer
    alike, so the log-probs are not rounded to `dtype` before the log-softmax; False: the LM
    head in `dtype` like every other matmul.
  """
  vocab_size: int
  hidden_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  num_experts: int
  num_experts_per_tok: int
  moe_intermediate_size: int
  norm_topk_prob: bool = True
  rms_norm_eps: float = 1e-6
  rope_theta: float = 1e6
  max_position_embeddings: int = 32768
  router_aux_loss_coef: float = 0.001
  tie_word_embeddings: bool = False
  dtype: str = "bfloat16"
  policy: str = "bf16"
  guided_layers: tuple[int, ...] | None = None
  guidance_mode: str = "compact"
  plan: str = "auto"
  moe_impl: str = "auto"
  decode_impl: str = "auto"
  decode_moe_kernel: str = "auto"
  fp4_codes: str = "auto"
  decode_attention: str = "auto"
  kv_cache: str = "auto"
  nvfp4_sites: str = "auto"
  kv_write: str = "auto"
  fake_quant: str = "auto"
  fp8_gemm: str = "auto"
  fp8_bwd_operands: str = "auto"
  seq_attention: str = "auto"
  layer_loop: str = "auto"
  fp8_backward: bool = False
  scan_layers: bool = True
  scan_unroll: int = 1
  decode_steps_per_sync: int = 1
  logits_fp32: bool = False

  def __post_init__(self):
    if self.guided_layers is None:
      n = self.num_hidden_layers
      object.__setattr__(self, "guided_layers", tuple(range(n // 2, n)))
    elif not isinstance(self.guided_layers, tuple):
      object.__setattr__(self, "guided_layers", tuple(int(i) for i in self.guided_layers))
    self._validate()

  def _validate(self) -> None:
    errors = []
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok",
                 "moe_intermediate_size", "max_position_embeddings"):
      v = getattr(self, name)
      if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        errors.append(f"{name} must be a positive int, got {v!r}")
    if errors:
      raise ValueError("ModelConfig: " + "; ".join(errors))
    if self.num_attention_heads % self.num_key_value_heads:
      errors.append(f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                    f"num_key_value_heads ({self.num_key_value_heads}) for grouped-query attention")
    if self.head_dim % 2:
      errors.append(f"head_dim ({self.head_dim}) must be even for rotary embeddings")
    if self.num_experts_per_tok > self.num_experts:
      errors.append(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts "
                    f"({self.num_experts})")
    if self.tie_word_embeddings:
      errors.append("tie_word_embeddings=True is not supported: Qwen3-MoE has an untied lm_head "
                    "(SGLang does not tie it either)")
    if self.dtype not in DTYPES:
      errors.append(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
    try:
      fwd = forward_of(self.policy)
    except ValueError as e:
      errors.append(str(e))
      fwd = None
    if self.guidance_mode not in GUIDANCE_MODES:
      errors.append(f"guidance_mode must be one of {GUIDANCE_MODES}, got {self.guidance_mode!r}")
    errors += plan_lib.check(self)
    if not isinstance(self.fp8_backward, bool):
      errors.append(f"fp8_backward must be a bool, got {self.fp8_backward!r}")
    for name in ("scan_layers", "logits_fp32"):
      if not isinstance(getattr(self, name), bool):
        errors.append(f"{name} must be a bool, got {getattr(self, name)!r}")
    for name in ("scan_unroll", "decode_steps_per_sync"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        errors.append(f"{name} must be an int >= 1, got {v!r}")
    bad = [i for i in self.guided_layers if not 0 <= i < self.num_hidden_layers]
    if bad:
      errors.append(f"guided_layers {bad} outside [0, {self.num_hidden_layers})")
    if len(set(self.guided_layers)) != len(self.guided_layers):
      errors.append(f"guided_layers has duplicates: {self.guided_layers}")
    if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
      errors.append("rms_norm_eps and rope_theta must be positive")
    if fwd is not None and fwd.fp4 is not None:
      errors += fwd.block_errors({n: getattr(self, n) for n in
                                  ("hidden_size", "moe_intermediate_size", "head_dim")})
    if fwd is not None and fwd.fp8_linears:
      errors += fwd.block_errors({
          "hidden_size": self.hidden_size, "moe_intermediate_size": self.moe_intermediate_size,
          "num_attention_heads * head_dim": self.num_attention_heads * self.head_dim,
          "num_key_value_heads * head_dim": self.num_key_value_heads * self.head_dim})
    if errors:
      raise ValueError("ModelConfig: " + "; ".join(errors))

  # --------------------------------------------------------------------------- derived

  @property
  def num_kv_groups(self) -> int:
    return self.num_attention_heads // self.num_key_value_heads

  @property
  def forward(self) -> Forward:
    """The precision policy of this forward, as data (`trace_jax.model.policies`)."""
    return forward_of(self.policy)

  def replace(self, **changes: Any) -> ModelConfig:
    return dataclasses.replace(self, **changes)

  # --------------------------------------------------------------------------- HF config.json

  @classmethod
  def from_hf_dict(cls, d: dict[str, Any], **overrides: Any) -> ModelConfig:
    """Reads an HF Qwen3-MoE `config.json` dict (4.x or 5.x spelling)."""
    model_type = d.get("model_type")
    if model_type not in (None, "qwen3_moe"):
      raise ValueError(f"config.json: model_type {model_type!r} is not 'qwen3_moe'")
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                           "num_attention_heads", "moe_intermediate_size",
                           "num_experts_per_tok") if k not in d]
    if "num_experts" not in d and "num_local_experts" not in d:
      missing.append("num_experts (or num_local_experts)")
    if missing:
      raise ValueError(f"config.json: missing required keys {missing}")
    if d.get("mlp_only_layers"):
      raise ValueError("config.json: mlp_only_layers is not supported (every layer is MoE, as "
                       f"in SGLang), got {d['mlp_only_layers']}")
    if d.get("decoder_sparse_step", 1) != 1:
      raise ValueError(f"config.json: decoder_sparse_step must be 1, got "
                       f"{d['decoder_sparse_step']}")
    if d.get("attention_bias", False):
      raise ValueError("config.json: attention_bias=True is not supported")
    if d.get("hidden_act", "silu") != "silu":
      raise ValueError(f"config.json: hidden_act must be 'silu', got {d['hidden_act']!r}")
    rope = d.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", (d.get("rope_scaling") or {}).get("rope_type", "default"))
    if rope_type != "default":
      raise ValueError(f"config.json: only default RoPE is supported, got rope_type {rope_type!r}")
    theta = rope.get("rope_theta", d.get("rope_theta", 1e6))
    dtype = d.get("dtype") or d.get("torch_dtype") or "bfloat16"
    kwargs = dict(
        vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
        num_hidden_layers=d["num_hidden_layers"], num_attention_heads=d["num_attention_heads"],
        num_key_value_heads=d.get("num_key_value_heads", d["num_attention_heads"]),
        head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
        num_experts=d.get("num_experts", d.get("num_local_experts")),
        num_experts_per_tok=d["num_experts_per_tok"],
        moe_intermediate_size=d["moe_intermediate_size"],
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
        max_position_embeddings=d.get("max_position_embeddings", 32768),
        router_aux_loss_coef=float(d.get("router_aux_loss_coef", 0.001)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        dtype=str(dtype))
    kwargs.update(overrides)
    return cls(**kwargs)

  def to_hf_dict(self) -> dict[str, Any]:
    """HF `config.json` with both key spellings and `head_dim` / `norm_topk_prob` explicit."""
    d = dict(_HF_CONSTANTS)
    d.update(
        vocab_size=self.vocab_size, hidden_size=self.hidden_size,
        num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
        num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
        num_experts=self.num_experts, num_local_experts=self.num_experts,
        num_experts_per_tok=self.num_experts_per_tok,
        moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
        rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
        rope_parameters={"rope_theta": self.rope_theta, "rope_type": "default"},
        max_position_embeddings=self.max_position_embeddings,
        router_aux_loss_coef=self.router_aux_loss_coef,
        tie_word_embeddings=self.tie_word_embeddings, dtype=self.dtype, torch_dtype=self.dtype)
    return d

  def shape_fields(self) -> dict[str, Any]:
    """The fields that fix parameter shapes and routing (policy and dtype may differ between
    checkpoints); used to check checkpoint/config agreement."""
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok",
            "moe_intermediate_size")
    return {k: getattr(self, k) for k in keys}

  def compute_fields(self) -> dict[str, Any]:
    """The fields that fix what given weights compute: the shapes and routing
    (`shape_fields`), the routing normalisation, the norms' epsilon, RoPE's base and the
    compute dtype. Loading weights made under another value of any of them would serve or
    train another function, so every load path compares them (`compute_differences`); the
    precision policy and the kernels are the loader's own choice."""
    keys = ("norm_topk_prob", "rms_norm_eps", "rope_theta", "dtype")
    return {**self.shape_fields(), **{k: getattr(self, k) for k in keys}}


def compute_differences(have: ModelConfig, want: ModelConfig) -> dict[str, tuple[Any, Any]]:
  """{field: (have's, want's)} for every `compute_fields` field whose values differ."""
  a, b = have.compute_fields(), want.compute_fields()
  return {k: (a[k], b[k]) for k in a if a[k] != b[k]}


# ----------------------------------------------------------------------------- presets

def tiny(**overrides: Any) -> ModelConfig:
  """A CPU-sized model for tests: every size a multiple of 16 (NVFP4 blocks)."""
  kwargs = dict(vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=64, norm_topk_prob=True, rms_norm_eps=1e-6,
                rope_theta=10000.0, max_position_embeddings=512, dtype="float32")
  kwargs.update(overrides)
  return ModelConfig(**kwargs)


def qwen3_30b_a3b(**overrides: Any) -> ModelConfig:
  """The Qwen3-30B-A3B shape (config.json of the official checkpoint)."""
  kwargs = dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=48,
                num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960,
                dtype="bfloat16")
  kwargs.update(overrides)
  return ModelConfig(**kwargs)


PRESETS = {"tiny": tiny, "qwen3_30b_a3b": qwen3_30b_a3b}


def section(preset: str = "tiny", **choices: Any) -> dict[str, Any]:
  """A config file's `model` section holding every ModelConfig field: the preset's values with
  the file's `choices` over them, and "preset", so that any field (shape, precision, the kernel
  plan's) can be overridden on the command line (`--config.model.decode_impl=kernel`);
  `resolve` reads it back to the same ModelConfig as `resolve({"preset": preset, **choices})`.
  guided_layers stays None (the deepest half of whatever depth the run has) unless chosen.
  Unknown presets or fields, or invalid values, raise ValueError naming them."""
  if preset not in PRESETS:
    raise ValueError(f"unknown model preset {preset!r}; known: {sorted(PRESETS)}")
  names = [f.name for f in dataclasses.fields(ModelConfig)]
  unknown = sorted(set(choices) - set(names))
  if unknown:
    raise ValueError(f"unknown model fields {unknown}; ModelConfig has {sorted(names)}")
  config = PRESETS[preset](**choices)
  fields = {name: getattr(config, name) for name in names}
  fields["guided_layers"] = choices.get("guided_layers")
  return {"preset": preset, **fields}


def resolve(section: Any, **overrides: Any) -> ModelConfig:
  """The ModelConfig of a config file's `model` section: a preset name, or a mapping
  {"preset": name (default "tiny"), **ModelConfig field overrides}; `overrides` win.

  The one resolver of model sections (the RL launchers, the server, measure_mismatch); an
  unknown preset or field raises ValueError naming it.
  """
  fields = {"preset": section} if isinstance(section, str) else dict(section or {})
  preset = fields.pop("preset", "tiny")
  if preset not in PRESETS:
    raise ValueError(f"unknown model preset {preset!r}; known: {sorted(PRESETS)}")
  fields.update(overrides)
  names = {f.name for f in dataclasses.fields(ModelConfig)}
  unknown = sorted(set(fields) - names)
  if unknown:
    raise ValueError(f"unknown model fields {unknown}; ModelConfig has {sorted(names)}")
  if fields.get("guided_layers") is not None:
    fields["guided_layers"] = tuple(fields["guided_layers"])
  return PRESETS[preset](**fields)
