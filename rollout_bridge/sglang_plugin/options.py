"""Options of the `trace_nvfp4` quantization method and the process-wide active config.

SGLang builds a quantization config in two ways: from the checkpoint's `quantization_config`
(`from_config`, when `quant_method` is `trace_nvfp4`), or with no arguments when the checkpoint
has none (a plain BF16 checkpoint served with `--quantization trace_nvfp4`, because the method
lists no config files). Runtime choices therefore also come from the environment variable
`TRACE_NVFP4_CONFIG` (a JSON object, or a path to a JSON file), which `launch_sglang.py` sets
for the server process and which SGLang's scheduler processes inherit; its keys override the
checkpoint's. No SGLang import here.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

from trace_jax.guidance.record import MODES as GUIDANCE_MODES

ENV_VAR = "TRACE_NVFP4_CONFIG"
KV_MODES = ("nvfp4", "none")
# Keys SGLang adds to a checkpoint's quantization config, or that name the method: not options.
_PASSTHROUGH = ("quant_method", "packed_modules_mapping", "hf_config", "requantization_method")


@dataclasses.dataclass(frozen=True)
class TraceOptions:
  """What `trace_nvfp4` quantizes and records (docs/design.md §4 to 6).

  guidance_mode: "compact" (mantissa bits) or "full" (4-bit codes) guidance records.
  guided_layers: layers whose sites are recorded; None means the deepest half of num_layers.
  num_layers: decoder layers of the model (from the HF config when SGLang gives it).
  record_capacity: token rows preallocated per guided (layer, site); 0 disables recording.
  record_routing: also record the routed expert ids of guided layers.
  kv_cache: "nvfp4" emulates the NVFP4 KV cache (per (token, head) rows, exact
    quantize-dequantize before K/V enter SGLang's cache); "none" leaves K/V alone.
  keep_master: keep the loaded BF16 expert weights next to their dequantized NVFP4 copies, so a
    partial weight update re-quantizes from masters; False overwrites them (half the memory,
    and every update must then send all expert weights).
  """
  guidance_mode: str = "compact"
  guided_layers: tuple[int, ...] | None = None
  num_layers: int | None = None
  record_capacity: int = 0
  record_routing: bool = True
  kv_cache: str = "nvfp4"
  keep_master: bool = True

  def __post_init__(self):
    if self.guidance_mode not in GUIDANCE_MODES:
      raise ValueError(f"trace_nvfp4: guidance_mode must be one of {GUIDANCE_MODES}, got "
                       f"{self.guidance_mode!r}")
    if self.kv_cache not in KV_MODES:
      raise ValueError(f"trace_nvfp4: kv_cache must be one of {KV_MODES}, got {self.kv_cache!r}")
    if not isinstance(self.record_capacity, int) or self.record_capacity < 0:
      raise ValueError(f"trace_nvfp4: record_capacity must be an int >= 0, got "
                       f"{self.record_capacity!r}")
    if self.guided_layers is not None:
      object.__setattr__(self, "guided_layers", tuple(int(i) for i in self.guided_layers))

  @property
  def guided(self) -> frozenset[int]:
    """Layer indices whose sites are recorded."""
    if self.guided_layers is not None:
      return frozenset(self.guided_layers)
    if self.num_layers is None:
      return frozenset()
    return frozenset(range(self.num_layers // 2, self.num_layers))

  @classmethod
  def from_mapping(cls, config: Mapping[str, Any] | None = None,
                   env: Mapping[str, str] | None = None) -> TraceOptions:
    """Options from a checkpoint quantization config, overridden by `TRACE_NVFP4_CONFIG`."""
    merged: dict[str, Any] = {}
    config = dict(config or {})
    hf_config = config.get("hf_config")
    layers = getattr(hf_config, "num_hidden_layers", None)
    if layers is not None:
      merged["num_layers"] = int(layers)
    merged.update({k: v for k, v in config.items() if k not in _PASSTHROUGH})
    merged.update(env_options(os.environ if env is None else env))
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(merged) - fields)
    if unknown:
      raise ValueError(f"trace_nvfp4: unknown option(s) {unknown}; options are {sorted(fields)}")
    return cls(**merged)

  def to_env(self) -> str:
    """JSON for `TRACE_NVFP4_CONFIG` (what the launcher passes to the server); unset (None)
    fields are left out, so they do not override the checkpoint's values."""
    return json.dumps({k: v for k, v in dataclasses.asdict(self).items() if v is not None},
                      sort_keys=True)


def env_options(env: Mapping[str, str]) -> dict[str, Any]:
  """The JSON object in `TRACE_NVFP4_CONFIG` (inline, or a path to a file), else {}."""
  raw = env.get(ENV_VAR, "").strip()
  if not raw:
    return {}
  if not raw.startswith("{"):
    with open(raw) as f:
      raw = f.read()
  try:
    value = json.loads(raw)
  except json.JSONDecodeError as e:
    raise ValueError(f"{ENV_VAR} is not valid JSON: {e}") from e
  if not isinstance(value, dict):
    raise ValueError(f"{ENV_VAR} must hold a JSON object, got {type(value).__name__}")
  return value


# The config of the model being served in this process. The KV-cache hook reads it: Qwen3-MoE
# builds its RadixAttention without the quantization config, so attention cannot be reached
# through `get_quant_method`.
_ACTIVE: Any = None


def activate(config: Any) -> None:
  """Makes `config` (a TraceNvfp4Config) the one the attention hook applies."""
  global _ACTIVE
  _ACTIVE = config


def deactivate() -> None:
  global _ACTIVE
  _ACTIVE = None


def active() -> Any:
  """The active TraceNvfp4Config, or None (then the hooks pass K/V through unchanged)."""
  return _ACTIVE
