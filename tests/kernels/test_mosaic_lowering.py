"""The Mosaic GPU kernels (`wgmma_attention`: scores and PV; `wgmma_moe`; JAX's grouped GEMM
of moe_impl "mgpu") lower for CUDA on this CPU: the Pallas program of each kernel (its shapes,
layouts, wgmma operands, shared-memory refs, loops, reductions) goes through Pallas's Mosaic
GPU lowering without a GPU. What needs the GPU (PTX compilation, the values) is tested there
(test_decode_attention, test_fp4_moe, test_grouped).

A jax without `mosaic.gpu.utils.inline_ptx` (this machine's 0.10; the GPU image has 0.11) gets a
stand-in for the lowering only: each inline PTX statement becomes constants of its result
types, and an `inline_mgpu` function's empty result is given as None, as that jax expects."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from trace_jax.kernels import wgmma_attention, wgmma_decode, wgmma_flash, wgmma_moe

SDS = jax.ShapeDtypeStruct


def _stub_inline_ptx(asm, *args, result_types=None, **kwargs):
  """Constants of the result types in place of an inline PTX statement."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, llvm

  def const(ty):
    if isinstance(ty, ir.IntegerType):
      return arith.constant(ty, 0)
    if isinstance(ty, ir.F32Type):
      return arith.constant(ty, 0.0)
    return llvm.mlir_undef(ty)

  del asm, args, kwargs
  if result_types is None:
    return None
  if isinstance(result_types, (list, tuple)):
    return [const(t) for t in result_types]
  return const(result_types)


@pytest.fixture
def lowering(monkeypatch):
  """lower(fn, *shapes) -> the StableHLO text of fn lowered for CUDA."""
  if not wgmma_decode.available():
    from jax.experimental.mosaic.gpu import utils as mu
    from jax.experimental.pallas import mosaic_gpu as plgpu

    monkeypatch.setattr(mu, "inline_ptx", _stub_inline_ptx, raising=False)
    inline_mgpu = plgpu.inline_mgpu

    def inline_mgpu_none_for_empty(**kwargs):
      def wrap(fn):
        def fn2(*a):
          out = fn(*a)
          return None if isinstance(out, tuple) and not out else out
        return inline_mgpu(**kwargs)(fn2)
      return wrap

    monkeypatch.setattr(plgpu, "inline_mgpu", inline_mgpu_none_for_empty)

  def lower(fn, *shapes):
    return jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()

  return lower


B, G, R, H, T, L = 2, 2, 8, 128, 256, 2
Q = SDS((B, G, R, H), jnp.bfloat16)
KV = (SDS((L, B, T, G, H // 8), jnp.uint32), SDS((L, B, T, G, H // 16), jnp.uint8),
      SDS((L, B, T, G), jnp.float32))
LENGTHS, LAYER = SDS((B,), jnp.int32), SDS((1,), jnp.int32)


@pytest.mark.parametrize("prefetch,splits", [(0, 1), (3, 1), (1, 2)],
                         ids=["no_prefetch", "three_tiles_ahead", "pv_two_splits"])
def test_scores_and_pv_lower(lowering, prefetch, splits):
  text = lowering(lambda q, *a: wgmma_attention.scores(q, *a, scale=0.088, prefetch=prefetch),
                  Q, *KV, LENGTHS, LAYER)
  assert "decode_attention_scores_wgmma" in text
  probs = SDS((B, G, R, T), jnp.bfloat16)
  pv = lambda *a: wgmma_attention.pv(*a, prefetch=prefetch, splits=splits)
  text = lowering(pv, probs, *KV, LENGTHS, LAYER)
  assert "decode_attention_pv_wgmma" in text
  # one split: the bf16 output; two: each split's float32 partial sums
  out = f"tensor<{B}x{G}x2x{R}x{H}xf32>" if splits > 1 else f"tensor<{B}x{G}x{R}x{H}xbf16>"
  assert out in text


@pytest.mark.parametrize("splits,prefetch", [(1, 0), (2, 2)],
                         ids=["one_split", "two_splits_prefetch_2"])
def test_wgmma_flash_lowers(lowering, splits, prefetch):
  q = SDS((B, G, R, H), jnp.bfloat16)
  fn = lambda q, *a: wgmma_flash.partials(
      q, a[:3], a[3:6], *a[6:], scale=0.088, splits=splits, prefetch=prefetch)
  text = lowering(fn, q, *KV, *KV, LENGTHS, LAYER)
  assert "decode_attention_wgmma_flash" in text
  assert f"tensor<{B}x{G}x{splits}x{R}x{H}xf32>" in text


def test_wgmma_moe_lowers(lowering):
  m, e, n, k = 64, 4, 128, 256
  text = lowering(lambda *a: wgmma_moe.grouped_matmul(*a, rows=16),
                  SDS((m, k), jnp.bfloat16), SDS((L, e, n, k // 16, 2), jnp.uint32),
                  SDS((L, e, n, k // 16), jnp.float8_e4m3fn), SDS((L, e), jnp.float32),
                  SDS((e,), jnp.int32), SDS((), jnp.int32))
  assert "grouped_matmul_fp4_wgmma" in text


def test_mgpu_grouped_matmul_lowers(lowering):
  """moe_impl="mgpu": JAX's Mosaic GPU grouped GEMM, forward and DGrad."""
  from trace_jax.model import grouped

  m, k, n, e = 1024, 256, 256, 4
  shapes = (SDS((m, k), jnp.bfloat16), SDS((e, n, k), jnp.bfloat16), SDS((e,), jnp.int32))
  fwd = lambda x, w, gs: grouped.grouped_matmul(x, w, gs, "mgpu")
  dgrad = lambda x, w, gs: jax.vjp(lambda a: fwd(a, w, gs), x)[1](
      jnp.ones((m, n), jnp.bfloat16))[0]
  for fn in (fwd, dgrad):
    assert "mosaic" in lowering(fn, *shapes).lower()


@pytest.mark.parametrize("m,k,layers,opts", [
    (256, 512, None, {}), (200, 128, 2, {}), (256, 512, None, dict(group_k=2)),
    (200, 512, 2, dict(warpgroups=2))],
    ids=["whole_blocks_four_k_groups", "ragged_rows_one_k_group_stacked", "two_k_groups_a_step",
         "two_compute_warpgroups_ragged_stacked"])
def test_wgmma_fp8_lowers(lowering, m, k, layers, opts):
  """The FP8 GEMM's e4m3 wgmma (K-major operands from 128-byte swizzled tiles) and its TMA
  ring; one K group runs with one slot."""
  from trace_jax.kernels import wgmma_fp8
  from trace_jax.quant import formats

  e, n = 4, 256
  lead = () if layers is None else (layers,)

  def fn(av, asc, bv, bsc, gs):
    a = formats.FP8Tensor(values=av, scale=asc, block_rows=1)
    b = formats.FP8Tensor(values=bv, scale=bsc, block_rows=128)
    return wgmma_fp8.grouped_matmul(a, b, gs, layer=None if layers is None else jnp.int32(1),
                                    **opts)

  text = lowering(fn, SDS((m, k), jnp.float8_e4m3fn), SDS((m, k // 128), jnp.float32),
                  SDS(lead + (e, n, k), jnp.float8_e4m3fn),
                  SDS(lead + (e, n // 128, k // 128), jnp.float32), SDS((e,), jnp.int32))
  assert "fp8_grouped_gemm_wgmma" in text
  assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in text
