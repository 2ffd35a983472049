"""SGLang quantization method `trace_nvfp4`: TRACE's NVFP4 rollout numerics for Qwen3-MoE.

Follows SGLang 0.5.23's contracts (`sglang/srt/layers/quantization/base_config.py`):
- `TraceNvfp4Config(QuantizationConfig)`: FusedMoE layers (routed experts) get
  `TraceNvfp4MoEMethod`; linear layers and lm_head get SGLang's `UnquantizedLinearMethod`
  (attention projections, router and lm_head stay BF16, docs/design.md §4); everything else
  (embedding, attention) gets None, i.e. SGLang's default.
- `TraceNvfp4MoEMethod(FusedMoEMethodBase)`: `create_weights` registers the BF16 master
  weights under SGLang's unquantized names and layout (w13_weight [E, 2I, H], gate rows first;
  w2_weight [E, H, I]) with the layer's weight loader attributes, so HF checkpoints load through
  `FusedMoE.make_expert_params_mapping` unchanged; `process_weights_after_loading` quantizes
  them once to NVFP4 (torch twin, per-expert second-level scale shared by gate and up) and keeps
  the dequantized copies; `apply` computes the experts in plain torch with FP4 activations
  emulated at `moe_in` and `expert_mid` (`numerics.moe_forward`), from the top-k ids and weights
  the dispatcher hands it, and records guidance for guided layers.

No MoE runner (`create_moe_runner` leaves `runner` None): SGLang then treats the method as a
direct kernel consuming the standard top-k output with local expert ids (base class contract).
Restrictions, checked at layer creation: gated SiLU experts without bias (Qwen3-MoE), the
standard dispatcher (no `--moe-a2a-backend`), no expert tensor parallelism (`moe_tp_size == 1`:
a TP shard of I would change the `expert_mid` row scale and the per-expert weight scale; use
`--ep-size` for several GPUs). Not CUDA-graph capturable (measured on an H200: the torch twin
copies its E2M1 grid from host memory per call, which capture refuses, and `moe_forward` reads
expert row counts on the host): serve with CUDA graphs off, as `launch_sglang.py` does.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.layers.moe import get_moe_a2a_backend
from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput
from sglang.srt.layers.moe.topk import TopKOutputChecker
from sglang.srt.layers.quantization.base_config import (
    FusedMoEMethodBase,
    QuantizationConfig,
    QuantizeMethodBase,
)
from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod
from sglang.srt.utils import set_weight_attrs

from rollout_bridge.sglang_plugin import numerics
from rollout_bridge.sglang_plugin import options as opts
from rollout_bridge.sglang_plugin.recorder import GuidanceRecorder

NAME = "trace_nvfp4"


class TraceNvfp4Config(QuantizationConfig):
  """`--quantization trace_nvfp4`: NVFP4 routed experts (W4A4 emulated) and NVFP4 KV cache."""

  def __init__(self, options: opts.TraceOptions | None = None):
    super().__init__()
    self.options = options or opts.TraceOptions.from_mapping({})
    self.recorder: GuidanceRecorder | None = None
    if self.options.record_capacity:
      if not self.options.guided:
        raise ValueError("trace_nvfp4: recording needs guided_layers, or num_layers to default "
                         f"to the deepest half (set them in {opts.ENV_VAR}); got {self.options}")
      self.recorder = GuidanceRecorder(self.options.record_capacity, self.options.guidance_mode,
                                       sorted(self.options.guided), self.options.record_routing)
    # The attention hook (kv_cache.py) finds the served model's options here.
    opts.activate(self)

  def __repr__(self) -> str:
    return f"TraceNvfp4Config({self.options})"

  @classmethod
  def get_name(cls) -> str:
    return NAME

  @classmethod
  def get_supported_act_dtypes(cls) -> list[torch.dtype]:
    return [torch.bfloat16, torch.float16, torch.float32]

  @classmethod
  def get_min_capability(cls) -> int:
    # Plain torch; BF16 needs Ampere. No FP4 hardware is used (Hopper emulation).
    return 80

  @staticmethod
  def get_config_filenames() -> list[str]:
    # None: a BF16 checkpoint without quantization_config then gets `TraceNvfp4Config()`
    # (options from TRACE_NVFP4_CONFIG) instead of "Cannot find the config file".
    return []

  @classmethod
  def from_config(cls, config: dict[str, Any]) -> TraceNvfp4Config:
    """From a checkpoint's quantization_config (`quant_method: trace_nvfp4` plus options)."""
    out = cls(opts.TraceOptions.from_mapping(config))
    if config.get("packed_modules_mapping"):
      out.packed_modules_mapping = config["packed_modules_mapping"]
    return out

  @classmethod
  def override_quantization_method(cls, hf_quant_cfg, user_quant) -> str | None:
    """A checkpoint whose quantization_config names trace_nvfp4 selects it."""
    if (hf_quant_cfg or {}).get("quant_method") == NAME and user_quant in (None, NAME):
      return NAME
    return None

  def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
    from sglang.srt.layers.linear import LinearBase
    from sglang.srt.layers.moe.fused_moe_triton import FusedMoE
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead

    if isinstance(layer, FusedMoE):
      return TraceNvfp4MoEMethod(self)
    if isinstance(layer, (LinearBase, ParallelLMHead)):
      return UnquantizedLinearMethod()
    return None

  def get_scaled_act_names(self) -> list[str]:
    return []

  def quantize_kv(self, layer_id: int, k: torch.Tensor, v: torch.Tensor, num_kv_heads: int,
                  head_dim: int, v_head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 K/V of one attention call (kv_cache.py's hook), recorded for guided layers."""
    kq, vq, qk, qv = numerics.qdq_kv(k, v, num_kv_heads, head_dim, v_head_dim)
    if self.recorder is not None:
      self.recorder.record(layer_id, "k", qk)
      self.recorder.record(layer_id, "v", qv)
    return kq, vq


class TraceNvfp4MoEMethod(FusedMoEMethodBase):
  """Routed experts of one FusedMoE layer in TRACE NVFP4 (see the module docstring)."""

  def __init__(self, quant_config: TraceNvfp4Config):
    super().__init__()
    self.quant_config = quant_config
    self.runner = None
    self.moe_runner_config = None

  def create_weights(self, layer: torch.nn.Module, num_experts: int, hidden_size: int,
                     intermediate_size_per_partition: int, params_dtype: torch.dtype,
                     **extra_weight_attrs) -> None:
    """Registers BF16 (params_dtype) masters w13_weight [E, 2I, H] and w2_weight [E, H, I]."""
    if extra_weight_attrs.pop("with_bias", False):
      raise NotImplementedError("trace_nvfp4: experts with bias are not supported")
    if getattr(layer, "moe_tp_size", 1) != 1:
      raise ValueError(f"trace_nvfp4: expert tensor parallelism (moe_tp_size="
                       f"{layer.moe_tp_size}) would split each expert's intermediate rows and "
                       "change its NVFP4 scales; serve with --ep-size equal to --tp-size")
    runner_config = getattr(layer, "moe_runner_config", None)
    if runner_config is not None and not runner_config.is_gated:
      raise NotImplementedError("trace_nvfp4: only gated (SwiGLU) experts are supported")
    for name, size in (("hidden_size", hidden_size),
                       ("moe_intermediate_size", intermediate_size_per_partition)):
      if size % 16:
        raise ValueError(f"trace_nvfp4: {name} = {size} is not a multiple of the NVFP4 block 16")
    w13 = torch.nn.Parameter(torch.empty(num_experts, 2 * intermediate_size_per_partition,
                                         hidden_size, dtype=params_dtype), requires_grad=False)
    layer.register_parameter("w13_weight", w13)
    set_weight_attrs(w13, extra_weight_attrs)
    w2 = torch.nn.Parameter(torch.empty(num_experts, hidden_size,
                                        intermediate_size_per_partition, dtype=params_dtype),
                            requires_grad=False)
    layer.register_parameter("w2_weight", w2)
    set_weight_attrs(w2, extra_weight_attrs)
    layer.trace_w13 = layer.trace_w2 = None
    recorder = self.quant_config.recorder
    layer_id = getattr(layer, "layer_id", None)
    if recorder is not None and recorder.guided(layer_id):
      if getattr(layer, "moe_ep_size", 1) != 1:
        raise NotImplementedError("trace_nvfp4: guidance recording runs on one GPU (tp = ep = 1): "
                                  "expert-parallel ranks see local expert ids and partial "
                                  "expert_mid rows, and merging ranks' records is not "
                                  "implemented")
      # Now, before SGLang sizes its KV cache from the free memory; else at the first apply().
      recorder.allocate_site(layer_id, "moe_in", (), hidden_size, w13.device)
      top_k = getattr(layer, "top_k", None) or getattr(runner_config, "top_k", None)
      if top_k:
        recorder.allocate_site(layer_id, "expert_mid", (top_k,),
                               intermediate_size_per_partition, w13.device)
        recorder.allocate_routing(layer_id, top_k, w13.device)

  def create_moe_runner(self, layer: torch.nn.Module, moe_runner_config: Any) -> None:
    """No runner: `apply` is the kernel. Rejects features the torch path does not implement."""
    c = moe_runner_config
    unsupported = {"activation": c.activation != "silu",
                   "apply_router_weight_on_input": c.apply_router_weight_on_input,
                   "gemm1_alpha": c.gemm1_alpha is not None,
                   "gemm1_clamp_limit": c.gemm1_clamp_limit is not None,
                   "swiglu_limit": getattr(c, "swiglu_limit", None) is not None,
                   "moe_a2a_backend": not get_moe_a2a_backend().is_none()}
    bad = sorted(k for k, v in unsupported.items() if v)
    if bad:
      raise NotImplementedError(f"trace_nvfp4: MoE features {bad} are not supported (Qwen3-MoE "
                                "experts are plain SwiGLU, dispatched by the standard dispatcher; "
                                "no --moe-a2a-backend)")
    self.moe_runner_config = c
    self.runner = None

  def get_moe_runner_backend(self, layer: torch.nn.Module) -> None:
    return None

  def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
    """NVFP4-quantizes the loaded experts once (re-run after every weight update)."""
    keep = self.quant_config.options.keep_master
    for name in ("w13", "w2"):
      master = getattr(layer, f"{name}_weight").data
      q = numerics.quantize_experts(master, out=None if keep else master)
      setattr(layer, f"trace_{name}", q)

  def apply(self, layer: torch.nn.Module, dispatch_output: Any) -> StandardCombineInput:
    """Experts of the dispatched tokens: standard dispatch output in, standard combine out."""
    if layer.trace_w13 is None:
      raise RuntimeError("trace_nvfp4: apply() before process_weights_after_loading()")
    if getattr(dispatch_output, "hidden_states_scale", None) is not None:
      raise NotImplementedError("trace_nvfp4: pre-quantized dispatch (FP4/FP8 all-gather) is not "
                                "supported; the plugin quantizes activations itself")
    x = dispatch_output.hidden_states
    topk = dispatch_output.topk_output
    if TopKOutputChecker.format_is_bypassed(topk):
      topk = topk.to_standard()
    if not TopKOutputChecker.format_is_standard(topk):
      raise NotImplementedError(f"trace_nvfp4: top-k output {type(topk).__name__} is not "
                                "supported (needs topk_ids / topk_weights)")
    res = numerics.moe_forward(x, layer.trace_w13.dequantized, layer.trace_w2.dequantized,
                               topk.topk_ids, topk.topk_weights)
    out = res.out
    factor = self.moe_runner_config.routed_scaling_factor if self.moe_runner_config else None
    if factor is not None and not getattr(layer, "should_fuse_routed_scaling_factor_in_topk",
                                          False):
      out = out * factor
    recorder = self.quant_config.recorder
    layer_id = getattr(layer, "layer_id", None)
    if recorder is not None and recorder.guided(layer_id):
      recorder.record(layer_id, "moe_in", res.q_in)
      recorder.record(layer_id, "expert_mid", res.q_mid)
      recorder.record_routing_ids(layer_id, topk.topk_ids)
    return StandardCombineInput(hidden_states=out)
