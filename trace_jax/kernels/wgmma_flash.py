"""Single-pass decode attention over a packed NVFP4 KV cache on Hopper's wgmma (flash decoding).

Why: `wgmma_attention`'s exact pair writes float32 scores [B, G, R, T] and reads back bf16
probabilities around XLA's softmax, R x (4 + 4 + 2 + 2) = 96 bytes per key and kv head at R = 8,
next to the packed cache's 152 bytes of K and V at head_dim 128.
`flash_decode` keeps them on chip, but its Triton tiles reach the MMA through shared memory
twice. This kernel is `flash_decode`'s arithmetic with `wgmma_attention`'s decoders:

  per 64-key tile:  K decoded (registers, `wgmma_attention.tile_decoder`) -> shared memory
                    s [64, 64] = q_pad [64, H] @ K^T             (wgmma, float32; rows >= R zero)
                    m' = max(m, max_j s_j), a = exp(m - m'), p = exp(s - m'), l' = a l + sum p
                    V decoded -> shared memory; acc' = a acc + round(p, bf16) @ V   (wgmma)

Program (b, g, s) of the grid (B, G, S) walks split s's tiles below sequence b's length and
writes its float32 (acc [R, H], m [R], l [R]); `flash_decode.combine` rescales the splits to
their common maximum and divides once, as it does for `flash_decode`'s splits. Numerics are
`flash_decode`'s (its module docstring: unnormalized probabilities rounded to bf16, the
division after the PV sum), with the GPU's exp and wgmma's float32 summation order.

q comes with its columns in `wgmma_decode.column_order(H)` (the order K and V are decoded in)
and padded to 64 rows (wgmma's M); the output's columns are in that order too. Keys at or
beyond the length: scores masked to -inf, V rows decoded as zeros, tiles wholly beyond it not
read. Limits: `wgmma_attention.supported`'s. GPU only (inline PTX): the CPU tests lower it
(tests/kernels/test_mosaic_lowering.py) and check the code around it through a numpy stand-in
(tests/kernels/test_wgmma_attention.py); its values are tested on the GPU
(tests/kernels/test_decode_attention.py). On the H200 it took 0.83-0.92x the Triton single
pass's time and 1.15-1.35x the exact pair's (docs/benchmarks.md): each program is one
warpgroup that decodes a step's K and V, then waits on its wgmmas, with no loads in flight
across steps; the plan runs it for a forced `decode_attention="fused"` over the packed cache.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.kernels import wgmma_attention
from trace_jax.kernels.wgmma_decode import TILE

ROWS = wgmma_attention.ROWS


def supported(h: int, r: int, t: int, dtype, block_t: int = TILE) -> bool:
  """`wgmma_attention.supported`'s shapes, with contexts a multiple of block_t (64 or 128
  keys a step)."""
  return (block_t in (TILE, 2 * TILE) and t % block_t == 0
          and wgmma_attention.supported(h, r, t, dtype))


@functools.partial(jax.jit, static_argnames=("r", "scale", "splits", "block_t", "prefetch"))
def partials(q: jax.Array, k: tuple[jax.Array, jax.Array, jax.Array],
             v: tuple[jax.Array, jax.Array, jax.Array], lengths: jax.Array, layer: jax.Array,
             *, r: int, scale: float, splits: int, block_t: int = TILE, prefetch: int = 0):
  """float32 (acc [B, G, S, r, H], m [B, G, S, r], l [B, G, S, r]) of each key split.

  q: bf16 [B, G, 64, H], rows >= r zero, columns in `column_order(H)`; k, v: (code words
  uint32 [L, B, T, G, H/8], scale bytes uint8 [L, B, T, G, H/16], row scales float32
  [L, B, T, G]); lengths int32 [B] in [0, T]; layer int32 [1]; block_t: keys a step (64 or
  128: one or two tiles decoded before each pair of wgmmas); prefetch: steps whose K and V
  lines are asked of L2 ahead of the decode (0: none). A split with no key below the length
  gives acc 0, m -inf, l 0."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  b, g, rows, h = q.shape
  t = k[0].shape[2]
  if rows != TILE or not supported(h, r, t, q.dtype, block_t):
    raise ValueError(f"wgmma flash: unsupported q {q.shape} {q.dtype}, r={r}, T={t}, "
                     f"block_t={block_t}")
  per, s_count = wgmma_attention.split_steps(t, block_t, splits)
  n_tiles = block_t // TILE
  decode_k = wgmma_attention.tile_decoder(h, g, masked=False)
  decode_v = wgmma_attention.tile_decoder(h, g, masked=True)
  ask = wgmma_attention.tile_prefetcher(h, g)
  swz = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  row_layout = plgpu.Layout.WGMMA.reduce(1)

  def body(layer_ref, len_ref, q_ref, kc, ks, kr, vc, vs, vr, o_ref, m_ref, l_ref,
           q_smem, k_smem, v_smem, o_smem, m_smem, l_smem, bar):
    bi, gi, si = (jax.lax.axis_index(n) for n in ("b", "g", "s"))
    lyr = layer_ref[0]
    length = len_ref[bi]
    plgpu.copy_gmem_to_smem(q_ref.at[bi, gi], q_smem, bar)
    plgpu.barrier_wait(bar)
    first = si * per
    last = jnp.minimum(first + per, (length + block_t - 1) // block_t)

    def ahead(i):  # step i's K and V lines into L2 (clamped to the split's last step)
      t0 = jnp.maximum(jnp.minimum(i, last - 1), 0) * block_t
      for j in range(n_tiles):
        keys = pl.ds(t0 + j * TILE, TILE)
        for c, sc, rs in ((kc, ks, kr), (vc, vs, vr)):
          ask(c.at[lyr, bi, keys, gi], sc.at[lyr, bi, keys, gi], rs.at[lyr, bi, keys, gi])

    for d in range(1, prefetch):
      ahead(first + d)

    def step(i, carry):
      acc, m, l = carry
      if prefetch:
        ahead(i + prefetch)
      # Every warp's wgmmas of the previous tile are done before its K and V are overwritten.
      plgpu.wgmma_wait(0)
      plgpu.commit_smem()
      t0 = pl.multiple_of(i * block_t, block_t)
      for j in range(n_tiles):
        keys, rows = pl.ds(t0 + j * TILE, TILE), pl.ds(j * TILE, TILE)
        k_smem.at[rows][...] = decode_k(kc.at[lyr, bi, keys, gi], ks.at[lyr, bi, keys, gi],
                                        kr.at[lyr, bi, keys, gi])
      for j in range(n_tiles):
        keys, rows = pl.ds(t0 + j * TILE, TILE), pl.ds(j * TILE, TILE)
        v_smem.at[rows][...] = decode_v(vc.at[lyr, bi, keys, gi], vs.at[lyr, bi, keys, gi],
                                        vr.at[lyr, bi, keys, gi], length - t0 - j * TILE)
      plgpu.commit_smem()  # the stores visible to wgmma (async proxy), in every warp

      def qk(ref):
        plgpu.wgmma(ref, q_smem, k_smem.T)
        return ref[...]

      s = pl.run_scoped(qk, plgpu.ACC((TILE, block_t), jnp.float32)) * np.float32(scale)
      key = plgpu.broadcasted_iota(jnp.int32, (TILE, block_t), 1, layout=plgpu.Layout.WGMMA)
      s = jnp.where(key < length - t0, s, np.float32(-np.inf))
      m_new = jnp.maximum(m, s.max(axis=1))
      alpha = jnp.exp(m - m_new)
      p = jnp.exp(s - jax.lax.broadcast_in_dim(m_new, s.shape, [0]))
      l = l * alpha + p.sum(axis=1)
      acc = acc * jax.lax.broadcast_in_dim(alpha, acc.shape, [0])
      p16 = p.astype(jnp.bfloat16)

      def pv(ref):
        plgpu.wgmma(ref, p16, v_smem)

      acc = pl.run_state(pv)(plgpu.ACC.init(acc))
      return acc, m_new, l

    init = (plgpu.layout_cast(jnp.zeros((TILE, h), jnp.float32), plgpu.Layout.WGMMA),
            plgpu.layout_cast(jnp.full((TILE,), -jnp.inf, jnp.float32), row_layout),
            plgpu.layout_cast(jnp.zeros((TILE,), jnp.float32), row_layout))
    acc, m, l = jax.lax.fori_loop(first, last, step, init)
    o_smem[...] = acc
    m_smem[...] = m
    l_smem[...] = l
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, r)], o_ref.at[bi, gi, si])
    plgpu.copy_smem_to_gmem(m_smem.at[pl.ds(0, r)], m_ref.at[bi, gi, si])
    plgpu.copy_smem_to_gmem(l_smem.at[pl.ds(0, r)], l_ref.at[bi, gi, si])
    plgpu.wait_smem_to_gmem(0)

  stat = jax.ShapeDtypeStruct((b, g, s_count, r), jnp.float32)
  kernel = plgpu.kernel(
      body, out_type=(jax.ShapeDtypeStruct((b, g, s_count, r, h), jnp.float32), stat, stat),
      grid=(b, g, s_count), grid_names=("b", "g", "s"), kernel_name="decode_attention_wgmma_flash",
      scratch_types=[plgpu.SMEM((TILE, h), jnp.bfloat16, transforms=swz)]
      + [plgpu.SMEM((block_t, h), jnp.bfloat16, transforms=swz)] * 2
      + [plgpu.SMEM((TILE, h), jnp.float32), plgpu.SMEM((TILE,), jnp.float32),
         plgpu.SMEM((TILE,), jnp.float32), plgpu.Barrier(num_arrivals=1)],
  )
  return kernel(layer.astype(jnp.int32), lengths.astype(jnp.int32), q, *k, *v)
