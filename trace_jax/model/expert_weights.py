"""Weights as the rollout engine's decode reads them, made once per weight update.

Under an NVFP4 forward the decode kernel (`trace_jax.kernels.fp4_moe`) reads packed E2M1 codes,
E4M3 block scales and one FP32 scale per expert, never BF16 copies; under BF16 it reads the
weights in the compute dtype. Under a forward with FP8 linears (`fp8_unified`) the experts and
the attention projections are held as E4M3 values + block scales (`formats.FP8Tensor`, half
the bytes of BF16) and the FP8 GEMMs take them as they are, instead of quantizing every weight
at every decode step. Gate and up are stacked into one [E, 2F, D] matmul (in NVFP4 they
share one second-level scale per expert, as `Precision.expert_weights` quantizes them). The
values are bit for bit those of the reference forward's quantized weights, so a forward
given these weights computes what it computes without them, up to the matmuls' float32
summation order (FP8: exactly, the GEMM is the same).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from trace_jax.kernels import fp4_moe
from trace_jax.model.config import ModelConfig
from trace_jax.quant import formats

DenseOrPacked = jax.Array | fp4_moe.PackedNVFP4Weights | formats.FP8Tensor
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@struct.dataclass
class ExpertWeights:
  """One layer's routed experts: gate and up stacked [E, 2F, D], down [E, D, F]; under FP8
  linears also the attention projections [out, in] by name (`ATTENTION`), else None."""
  gate_up: DenseOrPacked
  down: DenseOrPacked
  attention: dict[str, formats.FP8Tensor] | None = None

  @property
  def packed(self) -> bool:
    return isinstance(self.down, fp4_moe.PackedNVFP4Weights)

  @property
  def fp8(self) -> bool:
    return isinstance(self.down, formats.FP8Tensor)


def supported(config: ModelConfig) -> bool:
  """Forwards whose weights the engine prepares: BF16, NVFP4 experts and FP8 linears; MXFP4
  experts take the reference path."""
  return config.forward.fp4 in (None, "nvfp4")


def prepare(params: Any, config: ModelConfig) -> list[ExpertWeights]:
  """Every layer's ExpertWeights from the model's params (jit it: one program per shape)."""
  if not supported(config):
    raise ValueError(f"policy {config.policy!r}: the engine prepares BF16, NVFP4 and FP8 "
                     "weights only")
  dtype = jnp.dtype(config.dtype)
  out = []
  for i in range(config.num_hidden_layers):
    moe = params["layers"][i]["moe"]
    gate, up, down = (moe[n][...].astype(dtype) for n in ("gate_proj", "up_proj", "down_proj"))
    gate_up = jnp.concatenate([gate, up], axis=1)
    if config.forward.fp8_linears:  # as Precision.grouped / Precision.linear quantize them
      attn = params["layers"][i]["attn"]
      out.append(ExpertWeights(
          gate_up=formats.fp8_quantize_weight(gate_up), down=formats.fp8_quantize_weight(down),
          attention={n: formats.fp8_quantize_weight(attn[n]["kernel"][...].astype(dtype))
                     for n in ATTENTION}))
    elif config.forward.fp4 == "nvfp4":
      out.append(ExpertWeights(gate_up=fp4_moe.pack_nvfp4(gate_up),
                               down=fp4_moe.pack_nvfp4(down)))
    else:
      out.append(ExpertWeights(gate_up=gate_up, down=down))
  return out


def drop_prepared(params: Any, config: ModelConfig) -> Any:
  """params with the weights `prepare` holds in another form replaced by empty arrays (the
  routed experts; under FP8 linears also the attention projections), so an engine that runs
  on prepared weights keeps one copy of them. A forward given the prepared weights never reads
  these (`MoE` takes the expert count from the config)."""
  def is_prepared(path: tuple[Any, ...]) -> bool:
    keys = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
    if "moe" in keys:
      return any(k in keys for k in ("gate_proj", "up_proj", "down_proj"))
    return config.forward.fp8_linears and "attn" in keys and any(k in keys for k in ATTENTION)

  return jax.tree_util.tree_map_with_path(
      lambda path, a: jnp.zeros((0,), a.dtype) if is_prepared(path) else a, params)


def dense(w: DenseOrPacked, dtype: Any) -> jax.Array:
  """The weights in `dtype` (packed NVFP4 / FP8 dequantized: the quantized values)."""
  if isinstance(w, fp4_moe.PackedNVFP4Weights):
    return fp4_moe.dequantize(w, dtype)
  if isinstance(w, formats.FP8Tensor):
    return formats.fp8_dequantize(w).astype(dtype)
  return w.astype(dtype)
