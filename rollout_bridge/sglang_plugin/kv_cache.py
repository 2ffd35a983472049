"""NVFP4 KV cache, emulated on Hopper: the hook point where K/V enter SGLang's cache.

SGLang's own `--kv-cache-dtype nvfp4` needs Blackwell (SM100/SM120, trtllm_mha decode), and
its `fp4_mx_block16` is a different recipe (one scale per 16 values, no second-level scale). The
JAX model stores K/V quantize-dequantized in NVFP4 with per-(token, kv head) rows over head_dim
(`trace_jax.model.attention`: `prec.kv_site` after RoPE). The plugin does the same in front of
SGLang's cache, which keeps BF16 values (exact dequantized codes cast to the compute dtype):

- Hook point: `sglang.srt.layers.radix_attention.RadixAttention.forward(q, k, v,
  forward_batch, save_kv_cache=...)`, wrapped AROUND through SGLang's `HookRegistry`. Qwen3-MoE
  calls it with K after q/k-norm and RoPE, exactly where the JAX model quantizes; the wrapper
  replaces k and v by their NVFP4 quantize-dequantize before the attention backend stores and
  reads them (and records them for guided layers).
- Qwen3-MoE otherwise writes K/V into the cache inside its rotary kernel on CUDA with a BF16
  pool (`sglang.srt.models.utils.enable_fused_set_kv_buffer`), bypassing the wrapper; the
  second hook makes that function return False while NVFP4 KV is active, so K/V always go
  through RadixAttention.

Both hooks are inert (call the original) unless a `TraceNvfp4Config` with `kv_cache="nvfp4"` is
active in the process. They take effect when SGLang's `load_plugins()` applies registered hooks,
i.e. in every server process once the plugin's entry point ran.
"""

from __future__ import annotations

from typing import Any

from rollout_bridge.sglang_plugin import options as opts

RADIX_ATTENTION_FORWARD = "sglang.srt.layers.radix_attention.RadixAttention.forward"
FUSED_KV_WRITE = "sglang.srt.models.utils.enable_fused_set_kv_buffer"


def _kv_config() -> Any:
  cfg = opts.active()
  return cfg if cfg is not None and cfg.options.kv_cache == "nvfp4" else None


def radix_attention_forward(original, layer, q, k, v, forward_batch, *args, **kwargs):
  """AROUND hook of RadixAttention.forward: NVFP4 K/V (per token and kv head) before the cache."""
  cfg = _kv_config()
  if (cfg is None or k is None or v is None or "k_rope" in kwargs
      or getattr(layer, "is_cross_attention", False)):
    return original(layer, q, k, v, forward_batch, *args, **kwargs)
  k, v = cfg.quantize_kv(layer.layer_id, k, v, layer.tp_k_head_num, layer.qk_head_dim,
                         layer.v_head_dim)
  return original(layer, q, k, v, forward_batch, *args, **kwargs)


def fused_kv_write(original, *args, **kwargs) -> bool:
  """AROUND hook of enable_fused_set_kv_buffer: off while NVFP4 KV is emulated."""
  if _kv_config() is not None:
    return False
  return original(*args, **kwargs)


def install_hooks() -> None:
  """Registers both hooks with SGLang's HookRegistry (once per process)."""
  from sglang.srt.plugins.hook_registry import HookRegistry, HookType

  for target, hook in ((RADIX_ATTENTION_FORWARD, radix_attention_forward),
                       (FUSED_KV_WRITE, fused_kv_write)):
    if not any(h is hook for _, h, _ in HookRegistry._hooks.get(target, [])):
      HookRegistry.register(target, hook, HookType.AROUND)
