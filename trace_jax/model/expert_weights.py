"""Routed-expert weights as the rollout engine's decode reads them, made once per weight update.

Under an NVFP4 forward the decode kernel (`trace_jax.kernels.fp4_moe`) reads packed E2M1 codes,
E4M3 block scales and one FP32 scale per expert, never BF16 copies; under BF16 it reads the
weights in the compute dtype. Gate and up are stacked into one [E, 2F, D] matmul (in NVFP4 they
share one second-level scale per expert, as `Precision.expert_weights` quantizes them). The
values are bit for bit those of the reference forward's (fake-quantized) weights, so a forward
given these weights computes what it computes without them, up to the matmuls' float32
summation order.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from trace_jax.kernels import fp4_moe
from trace_jax.model.config import ModelConfig

DenseOrPacked = jax.Array | fp4_moe.PackedNVFP4Weights


@struct.dataclass
class ExpertWeights:
  """One layer's routed experts: gate and up stacked [E, 2F, D], down [E, D, F]."""
  gate_up: DenseOrPacked
  down: DenseOrPacked

  @property
  def packed(self) -> bool:
    return isinstance(self.down, fp4_moe.PackedNVFP4Weights)


def supported(config: ModelConfig) -> bool:
  """Forwards whose experts the decode kernel can run: BF16 (no expert quantization) and
  NVFP4; FP8 and MXFP4 experts take the reference path."""
  fwd = config.forward
  return not fwd.fp8_linears and fwd.fp4 in (None, "nvfp4")


def prepare(params: Any, config: ModelConfig) -> list[ExpertWeights]:
  """Every layer's ExpertWeights from the model's params (jit it: one program per shape)."""
  if not supported(config):
    raise ValueError(f"policy {config.policy!r}: the decode kernel runs BF16 and NVFP4 experts "
                     "only")
  dtype = jnp.dtype(config.dtype)
  out = []
  for i in range(config.num_hidden_layers):
    moe = params["layers"][i]["moe"]
    gate, up, down = (moe[n][...].astype(dtype) for n in ("gate_proj", "up_proj", "down_proj"))
    gate_up = jnp.concatenate([gate, up], axis=1)
    if config.forward.fp4 == "nvfp4":
      out.append(ExpertWeights(gate_up=fp4_moe.pack_nvfp4(gate_up),
                               down=fp4_moe.pack_nvfp4(down)))
    else:
      out.append(ExpertWeights(gate_up=gate_up, down=down))
  return out


def dense(w: DenseOrPacked, dtype: Any) -> jax.Array:
  """The weights in `dtype` (packed NVFP4 dequantized: the fake-quantized values)."""
  if isinstance(w, fp4_moe.PackedNVFP4Weights):
    return fp4_moe.dequantize(w, dtype)
  return w.astype(dtype)
