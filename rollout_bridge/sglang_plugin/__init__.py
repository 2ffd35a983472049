"""SGLang plugin (torch): the `trace_nvfp4` quantization method for Qwen3-MoE (docs/design.md §6).

NVFP4 routed experts with FP4 activations emulated by exact quantize-dequantize (Hopper has no
FP4 tensor cores), NVFP4 KV cache emulation, and a guidance recorder that writes the trainer's
TensorStore schema. All numerics come from the torch twin `rollout_bridge.torch_quant`, so codes
and scales are bit-identical to the JAX model's.

Modules: `numerics` (torch compute, no SGLang), `recorder` (guidance buffers and flush),
`options` (method options, `TRACE_NVFP4_CONFIG`), `quant_method` (SGLang classes), `kv_cache`
(attention hook). Only `register` is imported eagerly; it imports SGLang when called, so this
package imports without SGLang installed.

Registration: SGLang runs every `sglang.srt.plugins` entry point in each of its processes
(launch_server before argument parsing, the engine, schedulers, detokenizer); setup.cfg:

  [options.entry_points]
  sglang.srt.plugins =
      trace_nvfp4 = rollout_bridge.sglang_plugin:register
"""

from __future__ import annotations

NAME = "trace_nvfp4"


def register() -> None:
  """Entry point: adds `trace_nvfp4` to SGLang's quantization registry and `--quantization`
  choices, and registers the NVFP4 KV-cache hooks. Idempotent."""
  from sglang.srt.arg_groups.choices import QUANTIZATION_CHOICES, add_quantization_method_choices
  from sglang.srt.layers.quantization import QUANTIZATION_METHODS

  from rollout_bridge.sglang_plugin import kv_cache
  from rollout_bridge.sglang_plugin.quant_method import TraceNvfp4Config

  QUANTIZATION_METHODS[NAME] = TraceNvfp4Config
  if NAME not in QUANTIZATION_CHOICES:
    add_quantization_method_choices([NAME])
  kv_cache.install_hooks()
