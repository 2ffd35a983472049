"""Single-pass decode attention over a packed NVFP4 KV cache on Hopper's wgmma (flash decoding).

Why: `wgmma_attention`'s exact pair writes float32 scores [B, G, R, T] and reads back bf16
probabilities around XLA's softmax, R x (4 + 4 + 2 + 2) = 96 bytes per key and kv head at R = 8,
next to the packed cache's 152 bytes of K and V at head_dim 128. This kernel keeps them on
chip: `flash_decode`'s arithmetic with `wgmma_attention`'s decoders, both products transposed
so that wgmma's N is the R = 8 query heads of a kv head (wgmma's M is 64 rows: the heads as
rows would pad them 8x):

  per 64-key tile:  K decoded (registers, `wgmma_attention.tile_decoder`) as wgmma's A
                    s^T [64 keys, R] = K @ q^T                       (wgmma, float32)
                    m' = max(m, max_keys s), a = exp(m - m'), p = exp(s - m'), l' = a l + sum p
                    V decoded -> shared memory, read transposed as A; p^T -> shared memory as B
                    acc^T' [H, R] = a acc^T + V^T @ round(p, bf16)^T   (wgmma)

Program (b, g, s) of the grid (B, G, S) walks split s's tiles below sequence b's length and
writes its float32 (acc [R, H], m [R], l [R]); `flash_decode.combine` rescales the splits to
their common maximum and divides once, as it does for `flash_decode`'s splits. Numerics are
`flash_decode`'s (its module docstring: unnormalized probabilities rounded to bf16, the
division after the PV sum), with the GPU's exp and wgmma's float32 summation order.

q's columns come in `wgmma_decode.column_order(H)` (the order K and V are decoded in); the
output's columns are in that order too. Keys at or beyond the length: scores masked to -inf,
V rows decoded as zeros, tiles wholly beyond it not read. Limits: `wgmma_attention.supported`'s.
GPU only (inline PTX): the CPU tests lower it (tests/kernels/test_mosaic_lowering.py) and check
the code around it through a numpy stand-in (tests/kernels/test_wgmma_attention.py); its values
are tested on the GPU (tests/kernels/test_decode_attention.py). On the H100 it took 0.71-0.88x
the exact pair's time at 8k-32k contexts, where the same pass with the heads padded to 64
rows had taken 1.17-1.52x (docs/benchmarks.md); the plan runs it over the packed cache on
Hopper (`decode_attention="fused"`).
"""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.kernels import wgmma_attention, wgmma_decode
from trace_jax.kernels.wgmma_decode import TILE


def _col_reduce(op: str, r: int):
  """inline_mgpu function: (x [64, r] float32 in the WGMMA layout, a [4, r] float32 scratch
  ref in shared memory) -> [64, r] in the WGMMA layout, every row the column's max (op "max")
  or sum ("add") over x's 64 rows: within each thread's two rows, across the 8 row lanes of
  a warp (shuffles), then across the 4 warps through the scratch, read after a warpgroup
  barrier (the caller puts a barrier between these reads and the next call's writes)."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, gpu, llvm
  from jax.experimental.mosaic import gpu as mgpu
  from jax.experimental.mosaic.gpu import utils as mu

  def fn(ctx, x, red):
    del ctx
    i32, f32 = ir.IntegerType.get_signless(32), ir.F32Type.get()
    combine = arith.maximumf if op == "max" else arith.addf
    tid = arith.remui(arith.index_cast(i32, gpu.thread_id(gpu.Dimension.x)), mu.c(128, i32))
    warp, lane = arith.divui(tid, mu.c(32, i32)), arith.remui(tid, mu.c(32, i32))
    quad = arith.remui(lane, mu.c(4, i32))
    writer = arith.extui(i32, arith.cmpi(arith.CmpIPredicate.ult, lane, mu.c(4, i32)))
    base = llvm.ptrtoint(i32, mu.memref_ptr(red))
    regs = x.registers
    assert regs.shape == (1, 1, 1, 1, 2, 1, 1, 1, 1), regs.shape
    col = lambda j: arith.addi(arith.muli(quad, mu.c(2, i32)), mu.c(j, i32))
    for j in range(2):
      v = combine(*(llvm.extractelement(regs[0, 0, 0, 0, hf, 0, 0, 0, 0], mu.c(j, i32))
                    for hf in range(2)))
      for d in (4, 8, 16):  # the lanes of one quad position hold the same columns
        v = combine(v, mu.shfl_bfly(v, d))
      at = arith.addi(base, arith.muli(arith.addi(arith.muli(warp, mu.c(r, i32)), col(j)),
                                       mu.c(4, i32)))
      mu.inline_ptx("{\n.reg .pred p;\nsetp.ne.u32 p, $2, 0;\n@p st.shared.f32 [$0], $1;\n}",
                    at, v, writer)
    mu.warpgroup_barrier()
    vec = ir.VectorType.get((2,), f32)
    out = llvm.mlir_undef(vec)
    for j in range(2):
      v = None
      for w in range(4):
        at = arith.addi(base, arith.muli(arith.addi(mu.c(w * r, i32), col(j)), mu.c(4, i32)))
        # side effects: kept after the barrier (a pure asm load may be moved above it)
        u = mu.inline_ptx("ld.shared.f32 $0, [$1];", at, result_types=f32,
                          has_side_effects=True)
        v = u if v is None else combine(v, u)
      out = llvm.insertelement(out, v, mu.c(j, i32))
    res = np.empty(regs.shape, dtype=object)
    res[0, 0, 0, 0, 0, 0, 0, 0, 0] = res[0, 0, 0, 0, 1, 0, 0, 0, 0] = out
    return mgpu.FragmentedArray(_registers=res, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)

  return fn


def _rows_like(h: int):
  """inline_mgpu function: (x [64, R] float32 in the WGMMA layout, every row the same) ->
  [h, R], every row that row (a thread's registers hold the same columns at any row)."""
  from jax.experimental.mosaic import gpu as mgpu

  def fn(ctx, x):
    del ctx
    layout = mgpu.WGMMA_LAYOUT
    regs = np.empty(layout.registers_shape((h, x.shape[1])), dtype=object)
    regs[...] = x.registers[0, 0, 0, 0, 0, 0, 0, 0, 0]
    return mgpu.FragmentedArray(_registers=regs, _layout=layout, _is_signed=None)

  return fn


def _store_probs_t():
  """inline_mgpu function: (p [64 keys, 8] bf16 in the WGMMA layout, a [8, 64] bf16 ref in
  shared memory tiled (8, 64) with the 128-byte swizzle) -> p^T stored there: element
  (n, k) at byte 128 n + 16 ((k // 8) ^ n) + 2 (k % 8) (the swizzle XORs the 16-byte chunk
  with the row)."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, llvm
  from jax.experimental.mosaic.gpu import utils as mu

  def fn(ctx, p, ref):
    del ctx
    i32, i16 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(16)
    row0, quad = wgmma_decode.thread_coords()
    base = llvm.ptrtoint(i32, mu.memref_ptr(ref))
    regs = p.registers
    assert regs.shape == (1, 1, 1, 1, 2, 1, 1, 1, 1), regs.shape
    for hf in range(2):
      key = arith.addi(row0, mu.c(8 * hf, i32))
      for j in range(2):
        n = arith.addi(arith.muli(quad, mu.c(2, i32)), mu.c(j, i32))
        chunk = arith.xori(arith.divui(key, mu.c(8, i32)), n)
        off = arith.addi(arith.muli(n, mu.c(128, i32)), arith.muli(chunk, mu.c(16, i32)))
        off = arith.addi(off, arith.muli(arith.remui(key, mu.c(8, i32)), mu.c(2, i32)))
        val = mu.bitcast(llvm.extractelement(regs[0, 0, 0, 0, hf, 0, 0, 0, 0], mu.c(j, i32)),
                         i16)
        mu.inline_ptx("st.shared.b16 [$0], $1;", arith.addi(base, off), val)
    return ()

  return fn


def _store_stat():
  """inline_mgpu function: (x [64, R] float32 in the WGMMA layout, every row the same; the
  output's [R] window) -> x's row stored (warp 0's first 4 lanes, 2 columns each)."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, llvm
  from jax.experimental.mosaic.gpu import utils as mu

  def fn(ctx, x, out):
    del ctx
    i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
    row0, quad = wgmma_decode.thread_coords()
    writer = arith.extui(i32, arith.cmpi(arith.CmpIPredicate.eq, row0, mu.c(0, i32)))
    base = llvm.ptrtoint(i64, mu.memref_ptr(out))
    pair = x.registers[0, 0, 0, 0, 0, 0, 0, 0, 0]
    for j in range(2):
      col = arith.addi(arith.muli(quad, mu.c(2, i32)), mu.c(j, i32))
      at = arith.addi(base, arith.extui(i64, arith.muli(col, mu.c(4, i32))))
      mu.inline_ptx("{\n.reg .pred p;\nsetp.ne.u32 p, $2, 0;\n@p st.global.f32 [$0], $1;\n}",
                    at, llvm.extractelement(pair, mu.c(j, i32)), writer)
    return ()

  return fn


def _swizzle() -> tuple:
  """The shared-memory transforms of q, V and p^T: (8, 64) tiles, 128-byte swizzle."""
  from jax.experimental.pallas import mosaic_gpu as plgpu

  return plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)


def _helpers(h: int, g: int, r: int) -> types.SimpleNamespace:
  """The kernel's pieces for head_dim h, g kv heads and r query heads per kv head: the tile
  decoders and prefetcher of `wgmma_attention`, and this module's register-level functions as
  Pallas callables (`plgpu.inline_mgpu`)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu

  wg = plgpu.Layout.WGMMA
  tile = plgpu.ShapeDtypeStruct((TILE, r), jnp.float32, layout=wg)
  col_max, col_sum = (plgpu.inline_mgpu(arg_types=(wg, plgpu.RefType()), return_type=tile)(
      _col_reduce(op, r)) for op in ("max", "add"))
  rows_like = plgpu.inline_mgpu(
      arg_types=(wg,), return_type=plgpu.ShapeDtypeStruct((h, r), jnp.float32, layout=wg))(
          _rows_like(h))
  return types.SimpleNamespace(
      decode_k=wgmma_attention.tile_decoder(h, g, masked=False),
      decode_v=wgmma_attention.tile_decoder(h, g, masked=True),
      ask=wgmma_attention.tile_prefetcher(h, g),
      col_max=col_max, col_sum=col_sum, rows_like=rows_like,
      store_pt=plgpu.inline_mgpu(arg_types=(wg, plgpu.RefType(transforms=_swizzle())))(
          _store_probs_t()),
      store_o=plgpu.inline_mgpu(arg_types=(wg, plgpu.RefType()))(
          wgmma_attention.store_columns(h, partial=True)),
      store_stat=plgpu.inline_mgpu(arg_types=(wg, plgpu.RefType()))(_store_stat()))


def _body(f: types.SimpleNamespace, h: int, r: int, per: int, scale: float, prefetch: int):
  """The program of grid point (b, g, s): split s's tiles of sequence b's kv head g, below the
  length, through the online softmax (the module docstring); writes acc, m and l."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  wg = plgpu.Layout.WGMMA

  def body(layer_ref, len_ref, q_ref, kc, ks, kr, vc, vs, vr, o_ref, m_ref, l_ref,
           q_smem, v_smem, p_smem, red, bar):
    bi, gi, si = (jax.lax.axis_index(n) for n in ("b", "g", "s"))
    lyr = layer_ref[0]
    length = len_ref[bi]
    plgpu.copy_gmem_to_smem(q_ref.at[bi, gi], q_smem, bar)
    plgpu.barrier_wait(bar)
    first = si * per
    last = jnp.minimum(first + per, (length + TILE - 1) // TILE)
    at = lambda ref, i: ref.at[lyr, bi, pl.ds(i * TILE, TILE), gi]

    def ahead(i):  # tile i's K and V lines into L2 (clamped to the split's last tile)
      i = jnp.maximum(jnp.minimum(i, last - 1), 0)
      for c, sc, rs in ((kc, ks, kr), (vc, vs, vr)):
        f.ask(at(c, i), at(sc, i), at(rs, i))

    for d in range(1, prefetch):
      ahead(first + d)

    def step(i, carry):
      acc, m, l = carry
      if prefetch:
        ahead(i + prefetch)
      # The previous tile's PV wgmma is done in every warp before v_smem and p_smem are
      # overwritten (and every warp has read the scratch of its max).
      plgpu.wgmma_wait(0)
      plgpu.commit_smem()
      t0 = pl.multiple_of(i * TILE, TILE)
      keys = pl.ds(t0, TILE)
      kt = f.decode_k(kc.at[lyr, bi, keys, gi], ks.at[lyr, bi, keys, gi],
                      kr.at[lyr, bi, keys, gi])

      def qk(ref):
        plgpu.wgmma(ref, kt, q_smem.T)
        return ref[...]

      s = pl.run_scoped(qk, plgpu.ACC((TILE, r), jnp.float32)) * np.float32(scale)
      v_smem[...] = f.decode_v(vc.at[lyr, bi, keys, gi], vs.at[lyr, bi, keys, gi],
                               vr.at[lyr, bi, keys, gi], length - t0)
      key = plgpu.broadcasted_iota(jnp.int32, (TILE, r), 0, layout=wg)
      s = jnp.where(key < length - t0, s, np.float32(-np.inf))
      m_new = jnp.maximum(m, f.col_max(s, red))
      alpha = jnp.exp(m - m_new)
      p = jnp.exp(s - m_new)
      l = l * alpha + p
      acc = acc * f.rows_like(alpha)
      f.store_pt(p.astype(jnp.bfloat16), p_smem)
      plgpu.commit_smem()  # v and p^T visible to wgmma (async proxy), in every warp

      def pv(ref):
        plgpu.wgmma(ref, v_smem.T, p_smem.T)

      acc = pl.run_state(pv)(plgpu.ACC.init(acc))
      return acc, m_new, l

    init = (plgpu.layout_cast(jnp.zeros((h, r), jnp.float32), wg),
            plgpu.layout_cast(jnp.full((TILE, r), -jnp.inf, jnp.float32), wg),
            plgpu.layout_cast(jnp.zeros((TILE, r), jnp.float32), wg))
    acc, m, l = jax.lax.fori_loop(first, last, step, init)
    plgpu.wgmma_wait(0)
    plgpu.commit_smem()  # every warp has read the scratch of the last max
    f.store_o(acc, o_ref.at[bi, gi, si])
    f.store_stat(m, m_ref.at[bi, gi, si])
    f.store_stat(f.col_sum(l, red), l_ref.at[bi, gi, si])

  return body


@functools.partial(jax.jit, static_argnames=("scale", "splits", "prefetch"))
def partials(q: jax.Array, k: tuple[jax.Array, jax.Array, jax.Array],
             v: tuple[jax.Array, jax.Array, jax.Array], lengths: jax.Array, layer: jax.Array,
             *, scale: float, splits: int, prefetch: int = 0):
  """float32 (acc [B, G, S, R, H], m [B, G, S, R], l [B, G, S, R]) of each key split.

  q: bf16 [B, G, R, H], columns in `column_order(H)`; k, v: (code words uint32
  [L, B, T, G, H/8], scale bytes uint8 [L, B, T, G, H/16], row scales float32 [L, B, T, G]);
  lengths int32 [B] in [0, T]; layer int32 [1]; prefetch: tiles whose K and V lines are asked
  of L2 ahead of the decode (0: none). A split with no key below the length gives acc 0,
  m -inf, l 0. The softmax's max over a tile's keys runs down the scores' rows, across the 4
  warps through shared memory (`_col_reduce`); each thread keeps its rows' partial sums l,
  added up once at the end."""
  from jax.experimental.pallas import mosaic_gpu as plgpu

  b, g, r, h = q.shape
  t = k[0].shape[2]
  if not wgmma_attention.supported(h, r, t, q.dtype):
    raise ValueError(f"wgmma flash: unsupported q {q.shape} {q.dtype}, T={t}")
  per, s_count = wgmma_attention.split_steps(t, TILE, splits)
  body = _body(_helpers(h, g, r), h, r, per, scale, prefetch)
  swz = _swizzle()
  stat = jax.ShapeDtypeStruct((b, g, s_count, r), jnp.float32)
  kernel = plgpu.kernel(
      body, out_type=(jax.ShapeDtypeStruct((b, g, s_count, r, h), jnp.float32), stat, stat),
      grid=(b, g, s_count), grid_names=("b", "g", "s"),
      kernel_name="decode_attention_wgmma_flash",
      scratch_types=[plgpu.SMEM((r, h), jnp.bfloat16, transforms=swz),
                     plgpu.SMEM((TILE, h), jnp.bfloat16, transforms=swz),
                     plgpu.SMEM((r, TILE), jnp.bfloat16, transforms=swz),
                     plgpu.SMEM((4, r), jnp.float32), plgpu.Barrier(num_arrivals=1)],
  )
  return kernel(layer.astype(jnp.int32), lengths.astype(jnp.int32), q, *k, *v)
