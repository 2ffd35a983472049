"""Fake-quantization operators for quantization-aware training (docs/design.md §3.7).

Each operator is a `jax.custom_vjp`: the forward returns the quantize-dequantize value in the
input's dtype (computed with the exact-arithmetic quantizers, so it survives XLA on GPU), the
backward is straight-through with the cotangent rounded explicitly to BF16, the precision of
gradients between operators (Jet-RL: FP4/FP8 gradients diverge), and returned in the
primal's dtype (JAX must add cotangents of one dtype where a value fans out). In the model,
activations are BF16, so these cotangents are BF16 tensors. They compose with `jit`, `vmap`,
`grad` and `remat`.

Formats: "nvfp4" (two-level: per-row scale for activations, per-tensor scale over the last
two axes for weights, i.e. per expert for stacked [E, N, K] weights), "mxfp4", "fp8" (1x128
activation groups, 128x128 weight blocks). The contraction axis is always the last axis.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from trace_jax.guidance.record import Guidance
from trace_jax.quant import exact, formats, guided

FORMATS = ("nvfp4", "mxfp4", "fp8")
GRAD_DTYPE = jnp.bfloat16


def _check_fmt(fmt: str) -> None:
  if fmt not in FORMATS:
    raise ValueError(f"unknown quantization format {fmt!r}; expected one of {FORMATS}")


def qdq_act(x: jax.Array, fmt: str = "nvfp4") -> jax.Array:
  """Quantize-dequantize of activations [..., K], float32 result (no gradient rule)."""
  _check_fmt(fmt)
  if fmt == "fp8":
    return formats.fp8_dequantize(formats.fp8_quantize_act(x))
  return formats.fp4_dequantize(formats.fp4_quantize_act(x, fmt))


def qdq_weight(w: jax.Array, fmt: str = "nvfp4") -> jax.Array:
  """Quantize-dequantize of weights [..., N, K], float32 result (no gradient rule)."""
  _check_fmt(fmt)
  if w.ndim < 2:
    raise ValueError(f"qdq_weight: expected weights [..., N, K], got shape {w.shape}")
  if fmt == "nvfp4":
    ts = formats.nvfp4_tensor_scale(w, axes=(-2, -1))
    return formats.nvfp4_dequantize(formats.nvfp4_quantize(w, ts))
  if fmt == "mxfp4":
    return formats.mxfp4_dequantize(formats.mxfp4_quantize(w))
  return formats.fp8_dequantize(formats.fp8_quantize_weight(w))


def _round_cotangent(g: jax.Array, dtype: jnp.dtype) -> jax.Array:
  """g rounded to BF16 precision, in `dtype`.

  For float32 primals the rounding is integer RNE on the bits: an `astype(bf16).astype(f32)`
  round trip is removed by XLA on GPU (excess precision), which left the gradients unrounded
  on the H200.
  """
  if dtype == jnp.float32:
    return exact.round_mantissa(g.astype(jnp.float32), 7)
  return g.astype(GRAD_DTYPE).astype(dtype)


@jax.custom_vjp
def straight_through(x: jax.Array, y: jax.Array) -> jax.Array:
  """y in the forward (x's fake-quantized value); the cotangent goes to x unchanged but
  rounded to BF16 (`_round_cotangent`), none to y. The one straight-through rule of the
  project: the fake-quant ops below and the model's tapped sites (`model/precision.py`)."""
  return y


def _st_fwd(x, y):
  return y, jnp.zeros((), x.dtype)


def _st_bwd(like, g):
  return _round_cotangent(g, like.dtype), None


straight_through.defvjp(_st_fwd, _st_bwd)


def _straight_through(qdq: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
  """qdq(x, *aux) with `straight_through`'s gradient for x and none for aux."""

  def op(x, *aux):
    return straight_through(x, qdq(jax.lax.stop_gradient(x), *aux).astype(x.dtype))

  return op


_FQ_ACT = {fmt: _straight_through(lambda x, f=fmt: qdq_act(x, f)) for fmt in FORMATS}
_FQ_WEIGHT = {fmt: _straight_through(lambda w, f=fmt: qdq_weight(w, f)) for fmt in FORMATS}


def _fq_guided_impl(x, block_scale, row_scale, mantissa, codes):
  g = Guidance(block_scale=block_scale, row_scale=row_scale, mantissa=mantissa, codes=codes)
  return formats.fp4_dequantize(guided.guided_quantize(x, g))


_FQ_GUIDED = _straight_through(_fq_guided_impl)


def fake_quant_act(x: jax.Array, fmt: str = "nvfp4") -> jax.Array:
  """Round-to-nearest fake quantization of activations, straight-through BF16 gradient."""
  _check_fmt(fmt)
  return _FQ_ACT[fmt](x)


def fake_quant_weight(w: jax.Array, fmt: str = "nvfp4") -> jax.Array:
  """Round-to-nearest fake quantization of weights [..., N, K], straight-through BF16 gradient."""
  _check_fmt(fmt)
  return _FQ_WEIGHT[fmt](w)


def fake_quant_act_guided(x: jax.Array, g: Guidance) -> jax.Array:
  """FP4 fake quantization of activations, rounded under rollout guidance (TRACE) in the
  record's format."""
  guided.validate(x, g)
  return _FQ_GUIDED(x, g.block_scale, g.row_scale, g.mantissa, g.codes)


def quantize_act_record(x: jax.Array, mode: str = "compact", fmt: str = "nvfp4"
                        ) -> tuple[jax.Array, Guidance]:
  """Rollout side: FP4 activations (NVFP4 two-level per row, or MXFP4) and the guidance
  record they leave.

  Returns the dequantized activations in x's dtype and the record (compact or full).
  """
  q = formats.fp4_quantize_act(x, fmt)
  return formats.fp4_dequantize(q).astype(x.dtype), guided.record(q, mode)
