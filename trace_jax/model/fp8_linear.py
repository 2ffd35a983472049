"""The linear layers of `fp8_unified` (Jet-RL, docs/design.md §3.4) as FP8 GEMMs with gradients.

Forward: the input quantized in 1x128 groups and the weight in 128x128 blocks
(`formats.fp8_quantize_act` / `fp8_quantize_weight`), then one block-scaled FP8 GEMM
(`trace_jax.kernels.fp8_gemm`): float32 accumulation, output in the compute dtype. `impl`
("xla": the GEMM's plain-JAX reference, dequantized float32 operands; "kernel": the Pallas
kernel on FP8 tensor cores; "wgmma": the Mosaic GPU kernel `kernels.wgmma_fp8` where it takes
the operands, else "kernel") changes the summation order and the bits the tensor cores keep
inside a 128-wide group (docs/design.md §3.4).

Backward (straight-through: the gradient of the quantizers is the identity; gradients between
operators are BF16, docs/design.md §3.7):
- backward="bf16" (default): the BF16 GEMMs of the dequantized operands,
  dx = dy @ w_q and dw = dy^T x_q, with w_q, x_q the forward's values in the compute dtype;
  exactly the gradient of a BF16 matmul of the fake-quantized operands.
- backward="fp8" (Jet-RL's full flow): DGrad on FP8 operands, dy in 1x128 groups along N times
  the forward's 128x128 weight blocks transposed; WGrad with dy and the saved input both
  re-quantized in 128x1 groups along the tokens. For the routed experts the 128-token groups
  lie within one expert: each expert's rows of dy and x are padded with zero rows to whole
  128-row tiles (`grouped._layout`, tile 128; a gather by `grouped.padded_sources`) before the
  transpose and quantization, and the WGrad GEMM (`fp8_gemm.grouped_wgrad`, or its reference
  for impl "xla") sums each expert's own tiles only. The operands are made by XLA (a gather, a
  transpose, the quantizer) or (operands "kernel", the plan's `fp8_bwd_operands`) by
  `kernels.fp8_tiles` in one pass: the same bits. The same field picks who transposes the
  weight's codes for the DGrad (XLA, or `fp8_tiles.transpose_codes`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from trace_jax.kernels import fp8_gemm, fp8_tiles, wgmma_fp8
from trace_jax.model import batch_local
from trace_jax.model import grouped as grouped_mm
from trace_jax.model.layer_runs import at_layer
from trace_jax.quant import formats

IMPLS = ("xla", "kernel", "wgmma")
KERNELS = ("kernel", "wgmma")  # the impls that run a kernel (the rest: the reference)
BACKWARDS = ("bf16", "fp8")
OPERANDS = ("xla", "kernel")  # who lays out the FP8 backward's WGrad and DGrad operands
_G = formats.FP8_GROUP


def _check(impl: str, backward: str, operands: str = "xla") -> None:
  if impl not in IMPLS:
    raise ValueError(f"fp8_gemm must be one of {IMPLS}, got {impl!r}")
  if backward not in BACKWARDS:
    raise ValueError(f"fp8 backward must be one of {BACKWARDS}, got {backward!r}")
  if operands not in OPERANDS:
    raise ValueError(f"fp8_bwd_operands must be one of {OPERANDS}, got {operands!r}")


def _gemm(a: formats.FP8Tensor, b: formats.FP8Tensor, impl: str, dtype: Any,
          group_sizes: jax.Array | None = None, moe_impl: str = "tiled",
          layer: jax.Array | None = None) -> jax.Array:
  """layer: b is a stack of layers; the kernel reads that layer in place, the reference
  slices it out."""
  if impl == "wgmma" and wgmma_fp8.supported(a, b):
    if group_sizes is None:
      return wgmma_fp8.matmul(a, b, out_dtype=dtype, layer=layer)
    return wgmma_fp8.grouped_matmul(a, b, group_sizes, out_dtype=dtype, layer=layer)
  if impl in KERNELS:
    if group_sizes is None:
      return fp8_gemm.matmul(a, b, out_dtype=dtype, layer=layer)
    return fp8_gemm.grouped_matmul(a, b, group_sizes, out_dtype=dtype, layer=layer)
  if layer is not None:
    b = at_layer(b, layer)
  if group_sizes is None:
    return fp8_gemm.reference(a, b, out_dtype=dtype)
  av, bv = formats.fp8_dequantize(a), formats.fp8_dequantize(b)
  return grouped_mm.grouped_matmul(av, bv, group_sizes, moe_impl).astype(dtype)


def _pad_rows(a: jax.Array) -> jax.Array:
  """a [M, C] with zero rows appended up to a multiple of 128 (128x1 groups along M)."""
  pad = -a.shape[0] % _G
  return jnp.pad(a, ((0, pad), (0, 0))) if pad else a


def _materialized_t(a: jax.Array) -> jax.Array:
  """a [R, C] -> a^T [C, R], a and its transpose each written out before the WGrad's 128x1
  quantization reads them. Left to itself XLA fuses the row gather, the dequantization and
  the transpose into the quantizer's amax reduction and code fusion, which then read the rows
  across their stride: on the H100 the experts' x operand alone took 3.4 ms a layer that way,
  the step's largest fusion (docs/benchmarks.md; values unchanged: the barriers only bound the
  fusions)."""
  return jax.lax.optimization_barrier(jax.lax.optimization_barrier(a).T)


def _wgrad_fp8(dy: jax.Array, xq: jax.Array, impl: str) -> jax.Array:
  """dy [M, N]^T @ xq [M, K] on FP8 operands quantized in 128x1 groups along M -> [N, K].

  On a mesh whose batch axes split the 128-row groups evenly the kernel runs per device on its
  own groups (float32 partials, summed over the devices: `batch_local`); otherwise whole."""
  dyt = formats.fp8_quantize_act(_materialized_t(_pad_rows(dy)))
  xt = formats.fp8_quantize_act(_materialized_t(_pad_rows(xq)))
  groups = dyt.values.shape[1] // _G
  if impl not in KERNELS or batch_local.batch_axes(groups) is None:
    return _gemm(dyt, xt, impl, dy.dtype)
  return batch_local.summed_over_batch_shards(
      lambda a, b: _gemm(a, b, impl, jnp.float32), (dyt, xt), (1, 1), groups).astype(dy.dtype)


def _forward(x: jax.Array, qw: formats.FP8Tensor, impl: str, group_sizes: jax.Array | None,
             moe_impl: str, layer: jax.Array | None = None
             ) -> tuple[jax.Array, formats.FP8Tensor]:
  """x [..., K] quantized in 1x128 groups times the quantized weight -> (y [..., N], x's codes)."""
  qx = formats.fp8_quantize_act(x.reshape(-1, x.shape[-1]))
  y = _gemm(qx, qw, impl, x.dtype, group_sizes, moe_impl, layer)
  return y.reshape(x.shape[:-1] + (y.shape[-1],)), qx


def apply(x: jax.Array, qw: formats.FP8Tensor, impl: str = "xla",
          group_sizes: jax.Array | None = None, moe_impl: str = "tiled",
          layer: jax.Array | None = None) -> jax.Array:
  """The forward of `linear` (group_sizes None; x [..., K], qw [N, K]) or `grouped` (rows
  [M, K], qw [E, N, K]) with the weight already quantized (the rollout engine's weights, made
  once per update; `expert_weights.prepare`). layer: qw is the stack of a run's layers, read
  at that layer (in place by the kernel). No gradient: rollout only. On a mesh the dense
  kernel runs on each device's own rows (`batch_local`; the grouped one runs in the
  expert-parallel block)."""
  _check(impl, "bf16")
  if group_sizes is None:
    return _dense_forward(x, qw, impl, layer)[0]
  return _forward(x, qw, impl, group_sizes, moe_impl, layer)[0]


def _dense_forward(x: jax.Array, qw: formats.FP8Tensor, impl: str,
                   layer: jax.Array | None = None) -> tuple[jax.Array, formats.FP8Tensor]:
  """`_forward` of a dense layer; on a mesh the kernel runs on each device's own rows
  (`batch_local`: XLA cannot split a kernel call)."""
  if impl not in KERNELS:
    return _forward(x, qw, impl, None, "tiled", layer)
  rows = x.reshape(-1, x.shape[-1])
  y, qx = batch_local.on_batch_shards(lambda r, w, i: _forward(r, w, impl, None, "tiled", i),
                                      (rows, qw, layer), (0, None, None), rows.shape[0])
  return y.reshape(x.shape[:-1] + (y.shape[-1],)), qx


def wgrad_sources(gs: jax.Array, m: int) -> jax.Array:
  """The grouped FP8 WGrad's gather map [rows] of m rows sorted into groups gs: each group's
  rows padded to whole 128-row tiles (`grouped.padded_sources`; rows past sum(gs) in none)."""
  rows = (-(-m // _G) + gs.shape[0]) * _G  # the layout's tile bound (rounded: empty tiles)
  return grouped_mm.padded_sources(gs, m, _G, rows)  # a gather: no scatter of activations


def wgrad_operand(a: jax.Array, src: jax.Array,
                  runs: tuple[jax.Array, jax.Array] | None = None) -> formats.FP8Tensor:
  """a [M, C] -> codes [C, rows] in 128x1 groups of the rows `src` gathers (`wgrad_sources`):
  XLA's gather, transpose and quantizer, or (runs: `fp8_tiles.tile_runs(src, M)`) the
  kernel's one pass; the same bits."""
  if runs is not None:
    return fp8_tiles.quantize_tiles(a, *runs)
  padded = jnp.take(a, src, axis=0, mode="fill", fill_value=0)
  return formats.fp8_quantize_act(_materialized_t(padded))


def _wgrad_fp8_grouped(dy: jax.Array, xq: jax.Array, gs: jax.Array, impl: str,
                       operands: str = "xla") -> jax.Array:
  """Per expert dy [M, N]^T @ xq [M, K] on FP8 operands quantized in 128x1 groups along the rows
  within each expert -> [E, N, K] in dy.dtype. operands: padded, transposed and quantized by
  XLA ("xla") or by `kernels.fp8_tiles` in one pass ("kernel"; the same bits).

  Rows past sum(gs) are zeroed (ragged_dot's contract: they belong to no expert).
  """
  src = wgrad_sources(gs, dy.shape[0])
  runs = fp8_tiles.tile_runs(src, dy.shape[0]) if operands == "kernel" else None
  dyt, xt = wgrad_operand(dy, src, runs), wgrad_operand(xq, src, runs)
  if impl in KERNELS:
    return fp8_gemm.grouped_wgrad(dyt, xt, gs, out_dtype=dy.dtype)
  return fp8_gemm.wgrad_reference(dyt, xt, gs, out_dtype=dy.dtype)


# ----------------------------------------------------------------------------- dense

@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def linear(x: jax.Array, w: jax.Array, impl: str = "xla", backward: str = "bf16",
           operands: str = "xla") -> jax.Array:
  """x [..., K] @ w [N, K]^T on FP8 operands -> [..., N] in x.dtype (w in x.dtype). operands:
  who transposes the weight's codes for the FP8 DGrad (`OPERANDS`)."""
  return _linear_fwd(x, w, impl, backward, operands)[0]


def _linear_fwd(x, w, impl, backward, operands):
  _check(impl, backward, operands)
  qw = formats.fp8_quantize_weight(w)
  y, qx = _dense_forward(x, qw, impl)
  # Dtypes ride along as empty arrays (residuals must be arrays).
  return y, (qx, qw, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))


def _linear_bwd(impl, backward, operands, res, dy):
  qx, qw, xlike, wlike = res
  dtype, wdtype = xlike.dtype, wlike.dtype
  shape = dy.shape[:-1] + (qx.values.shape[-1],)
  dy = dy.reshape(-1, dy.shape[-1]).astype(dtype)
  xq = formats.fp8_dequantize(qx).astype(dtype)
  if backward == "bf16":
    wq = formats.fp8_dequantize(qw).astype(dtype)
    _, vjp = jax.vjp(lambda a, b: jnp.einsum("mk,nk->mn", a, b), xq, wq)
    dx, dw = vjp(dy)
  else:
    dgrad = lambda d, wt: _gemm(formats.fp8_quantize_act(d), wt, impl, dtype)
    wt = fp8_gemm.transpose_weight(qw, operands == "kernel")
    dx = (batch_local.on_batch_shards(dgrad, (dy, wt), (0, None), dy.shape[0])
          if impl in KERNELS else dgrad(dy, wt))
    dw = _wgrad_fp8(dy, xq, impl)
  return dx.reshape(shape), dw.astype(wdtype)


linear.defvjp(_linear_fwd, _linear_bwd)


# ----------------------------------------------------------------------------- grouped (experts)

@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def grouped(rows: jax.Array, w: jax.Array, group_sizes: jax.Array, impl: str = "xla",
            backward: str = "bf16", moe_impl: str = "tiled", operands: str = "xla"
            ) -> jax.Array:
  """Rows [M, K] sorted by expert times w [E, N, K] on FP8 operands -> [M, N] in rows.dtype.

  moe_impl: the grouped matmul of the "xla" forward and of the BF16 backward GEMMs. operands:
  who makes the FP8 WGrad's operands (`OPERANDS`; backward "fp8" only).
  """
  return _grouped_fwd(rows, w, group_sizes, impl, backward, moe_impl, operands)[0]


def _grouped_fwd(rows, w, group_sizes, impl, backward, moe_impl, operands):
  _check(impl, backward, operands)
  qw = formats.fp8_quantize_weight(w)
  y, qx = _forward(rows, qw, impl, group_sizes, moe_impl)
  return y, (qx, qw, group_sizes, jnp.zeros((0,), rows.dtype), jnp.zeros((0,), w.dtype))


def _grouped_bwd(impl, backward, moe_impl, operands, res, dy):
  qx, qw, gs, xlike, wlike = res
  dtype, wdtype = xlike.dtype, wlike.dtype
  dy = dy.astype(dtype)
  xq = formats.fp8_dequantize(qx).astype(dtype)
  if backward == "bf16":
    wq = formats.fp8_dequantize(qw).astype(dtype)
    _, vjp = jax.vjp(lambda a, b: grouped_mm.grouped_matmul(a, b, gs, moe_impl), xq, wq)
    dx, dw = vjp(dy)
  else:
    dx = _gemm(formats.fp8_quantize_act(dy), fp8_gemm.transpose_weight(qw, operands == "kernel"),
               impl, dtype, gs, moe_impl)
    dw = _wgrad_fp8_grouped(dy, xq, gs, impl, operands)
  zero_gs = jnp.zeros(gs.shape, jax.dtypes.float0) if jnp.issubdtype(gs.dtype, jnp.integer) \
      else jnp.zeros_like(gs)
  return dx, dw.astype(wdtype), zero_gs


grouped.defvjp(_grouped_fwd, _grouped_bwd)
