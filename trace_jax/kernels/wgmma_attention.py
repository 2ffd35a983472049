"""Decode attention over a packed NVFP4 KV cache with Hopper's wgmma, K and V decoded for it.

Why: the Pallas/Triton kernels (`decode_attention`) decode each K/V tile into shared memory to
reach mma.sync's operand layout; on the H200 they are bound by that L1/shared-memory traffic
(ncu, batch 256, 8k: 93% / 84% of the pipe, DRAM 31-33%; the git history of
docs/benchmarks.md). wgmma (Mosaic GPU lowering) takes its A operand from registers in a layout
Mosaic documents (`WGMMA_LAYOUT`) and its B operand from shared memory, read by the
instruction itself:

  scores: scores^T [64 keys, R] = K [64 keys, H] @ q^T [H, R]   (K decoded into A registers)
  PV:     out^T [H, R] = V^T [H, 64 keys] @ P^T [64 keys, R]   (V decoded into shared memory,
          read transposed as A; P by TMA into shared memory as B)

with R = 8 query heads per kv head. K and V rows are decoded as `wgmma_decode` lays them out
(each thread two key rows of a tile and, in each, H / 64 whole NVFP4 blocks; one table per
(row, block), `fp4_decode`'s PTX programs, the fast table). The decoded columns are a
permutation of head_dim (`wgmma_decode.column_order`): q's columns are put in the same order
outside the kernel, and PV's output columns are put back, so the dots have the same terms
(summed in the tensor cores' float32 order). H200, 8k contexts, against the Triton pair: the
attention 0.81x / 0.66x the time at batch 64 / 256 (docs/benchmarks.md, decode attention); the
scores kernel 316 us at batch 256, 59% of DRAM peak (docs/benchmarks/rollout.json,
`wgmma_scores_ncu_256x8k`), against the Triton scores kernel's 585 (the git history of
docs/benchmarks.md).

Limits (checked by `supported`): bf16, head_dim a multiple of 128, R = 8 (the scores' wgmma N),
a context that is a multiple of the 64-key tile, the fast table (exact for every row scale the
quantizer makes: `fp4_decode.tensor_scale_factors`' `fast`, tested), GPU only (no interpret
mode: the decode is inline PTX; `tests/kernels/test_wgmma_attention.py` rebuilds the
registers on CPU and `test_mosaic_lowering.py` lowers the kernels there). Scores of keys at or
beyond a sequence's length are computed like any other (the softmax masks them); PV decodes
those V rows as zeros; tiles wholly beyond it are skipped.
PV waits for each tile's wgmma before the next tile's V overwrites its shared memory.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.kernels.wgmma_decode import SPAN, TILE, decode_block, thread_coords

ROWS = 8  # query heads per kv head (the wgmma N)
# 64-key tiles per scores program: on the H200 (batch 256 x 8k) 1, 2, 4, 8 and 16 tiles took
# 1.289, 1.254, 1.239, 1.251 and 1.257 ms of attention (git history of docs/benchmarks.md).
TILES_PER_PROGRAM = 4
MIN_TILES_PER_SPLIT = 8  # key splits of the kernels that walk a sequence's tiles in turn


def supported(h: int, r: int, t: int, dtype) -> bool:
  """Whether the kernel runs this shape: see the module docstring."""
  return (jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16) and h % SPAN == 0 and r == ROWS
          and t % TILE == 0)


def default_splits(batch: int, num_kv_heads: int, num_tiles: int, sm_count: int) -> int:
  """Key splits of a kernel that walks a (sequence, kv head)'s tiles one after another (PV,
  the single pass): about 4 programs per SM (two resident per SM wait on memory while two
  compute), with at least MIN_TILES_PER_SPLIT tiles in each."""
  want = -(-4 * sm_count // max(batch * num_kv_heads, 1))
  return int(max(1, min(want, num_tiles // MIN_TILES_PER_SPLIT)))


def split_steps(t: int, block_t: int, splits: int) -> tuple[int, int]:
  """(steps of block_t keys per split, splits) for a context of t keys: every split non-empty
  at full length."""
  n_steps = t // block_t
  per = -(-n_steps // max(1, min(splits, n_steps)))
  return per, -(-n_steps // per)


# ----------------------------------------------------------------------------- the kernel

def _decode_tile(h: int, g: int, masked: bool = False):
  """inline_mgpu function: (codes words [.., T, G, H/8], scale bytes [.., T, G, H/16], row
  scales [.., T, G] refs, already indexed to (layer, sequence) and the tile's first key ...[,
  valid: int32 scalar]) -> the tile's K (or V) [64, h] bf16 in the WGMMA layout, columns in
  `column_order`. masked: rows at or beyond `valid` decode to +-0 (their scales taken as 0, so
  no NaN or inf of an unwritten or stale row reaches a product)."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, llvm
  from jax.experimental.mosaic import gpu as mgpu
  from jax.experimental.mosaic.gpu import utils as mu

  nb = 2 * h // SPAN  # blocks per thread and row (even: 16-byte code loads)

  def fn(ctx, codes, scales, rows, *valid):
    del ctx
    assert len(valid) == int(masked)
    i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
    i16, f32 = ir.IntegerType.get_signless(16), ir.F32Type.get()
    c32 = lambda v: mu.c(v, i32)
    c64 = lambda v: mu.c(v, i64)
    row0, quad = thread_coords()
    addr = lambda ref: llvm.ptrtoint(i64, mu.memref_ptr(ref))
    base_c, base_s, base_r = addr(codes), addr(scales), addr(rows)
    layout = mgpu.WGMMA_LAYOUT
    regs = np.empty(layout.registers_shape((TILE, h)), dtype=object)
    assert regs.shape[1] == h // 8 and regs.shape[4] == 2, regs.shape  # (1, ct, 1, 1, half..)
    for half in range(2):
      row32 = arith.addi(row0, c32(8 * half))
      row = arith.extui(i64, row32)
      q64 = arith.extui(i64, quad)
      # codes: row pitch g * h/2 bytes; this thread's 8 nb bytes at quad * 8 nb
      a_c = arith.addi(base_c, arith.addi(arith.muli(row, c64(g * h // 2)),
                                          arith.muli(q64, c64(8 * nb))))
      words = []
      for v in range(nb // 2):  # 16-byte loads
        a = arith.addi(a_c, c64(16 * v))
        words += list(mu.inline_ptx("ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4];", a,
                                    result_types=[i32] * 4))
      a_s = arith.addi(base_s, arith.addi(arith.muli(row, c64(g * h // 16)),
                                          arith.muli(q64, c64(nb))))
      a_r = arith.addi(base_r, arith.muli(row, c64(4 * g)))
      ts = mu.inline_ptx("ld.global.nc.f32 $0, [$1];", a_r, result_types=f32)
      ok = None
      if masked:
        ok = arith.cmpi(arith.CmpIPredicate.slt, row32, valid[0].registers.item())
        ts = arith.select(ok, ts, mu.c(0.0, f32))
      for i in range(nb):
        if i % 2 == 0:  # two scale bytes per 16-bit load
          sp = mu.inline_ptx("ld.global.nc.u16 $0, [$1];", arith.addi(a_s, c64(i)),
                             result_types=i16)
          if masked:
            sp = arith.select(ok, sp, mu.c(0, i16))
        decode_block(regs, half, i, words[2 * i], words[2 * i + 1], sp, (ts,))
    return mgpu.FragmentedArray(_registers=regs, _layout=layout, _is_signed=None)

  return fn


def _prefetch_tile(h: int, g: int):
  """inline_mgpu function: (codes, scale bytes, row scales refs as `_decode_tile` takes them)
  -> () after asking L2 for the lines this thread's rows of the tile will load
  (`prefetch.global.L2`: no registers, no wait; a later `ld.global.nc` of them finds them in
  L2, unless evicted)."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, llvm
  from jax.experimental.mosaic.gpu import utils as mu

  nb = 2 * h // SPAN

  def fn(ctx, codes, scales, rows):
    del ctx
    i64 = ir.IntegerType.get_signless(64)
    c64 = lambda v: mu.c(v, i64)
    row0, quad = thread_coords()
    addr = lambda ref: llvm.ptrtoint(i64, mu.memref_ptr(ref))
    base_c, base_s, base_r = addr(codes), addr(scales), addr(rows)
    q64 = arith.extui(i64, quad)
    for half in range(2):
      row = arith.extui(i64, arith.addi(row0, mu.c(8 * half, row0.type)))
      for a in (arith.addi(base_c, arith.addi(arith.muli(row, c64(g * h // 2)),
                                              arith.muli(q64, c64(8 * nb)))),
                arith.addi(base_s, arith.addi(arith.muli(row, c64(g * h // 16)),
                                              arith.muli(q64, c64(nb)))),
                arith.addi(base_r, arith.muli(row, c64(4 * g)))):
        mu.inline_ptx("prefetch.global.L2 [$0];", a)
    return ()

  return fn


def tile_prefetcher(h: int, g: int):
  """`_prefetch_tile` as a Pallas function of (codes, scale bytes, row scales refs) -> ()."""
  from jax.experimental.pallas import mosaic_gpu as plgpu

  return plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * 3)(_prefetch_tile(h, g))


def tile_decoder(h: int, g: int, masked: bool):
  """`_decode_tile` as a Pallas function of (codes, scale bytes, row scales refs[, valid]) ->
  the tile [64, h] bf16 in the WGMMA layout (also `wgmma_flash`'s decoder)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu

  refs = (plgpu.RefType(),) * 3
  return plgpu.inline_mgpu(
      arg_types=refs + ((plgpu.Layout.WG_SPLAT(shape=()),) if masked else ()),
      return_type=plgpu.ShapeDtypeStruct((TILE, h), jnp.bfloat16, layout=plgpu.Layout.WGMMA),
  )(_decode_tile(h, g, masked=masked))


def _store_transposed(t: int):
  """inline_mgpu function: (scores^T [64, R] float32 in the WGMMA layout, the output's [R, 64]
  window of a [R, T] row-major array) -> stores it transposed, straight from registers (8
  consecutive keys per head and warp: whole 32-byte sectors)."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, llvm
  from jax.experimental.mosaic.gpu import utils as mu

  def fn(ctx, acc, out):
    del ctx
    i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
    row0, quad = thread_coords()
    col0 = arith.muli(quad, mu.c(2, i32))
    base = llvm.ptrtoint(i64, mu.memref_ptr(out))
    regs = acc.registers
    assert regs.shape == (1, 1, 1, 1, 2, 1, 1, 1, 1), regs.shape
    for half in range(2):
      row = arith.addi(row0, mu.c(8 * half, i32))
      for j in range(2):
        col = arith.addi(col0, mu.c(j, i32))
        off = arith.extui(i64, arith.muli(arith.addi(arith.muli(col, mu.c(t, i32)), row),
                                          mu.c(4, i32)))
        val = llvm.extractelement(regs[0, 0, 0, 0, half, 0, 0, 0, 0], mu.c(j, i32))
        mu.inline_ptx("st.global.f32 [$0], $1;", arith.addi(base, off), val)
    return ()

  return fn


def store_columns(h: int, partial: bool = False):
  """inline_mgpu function: (the transposed PV accumulator [h, R] float32 in the WGMMA layout,
  R = 8, the output's [R, h] window) -> out[c, n] = acc[n, c], rounded to bf16 (nearest
  even) or with `partial` as they are, float32. A thread holds rows 64 mt + row0 + 8 half
  and columns 2 quad + j."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, llvm
  from jax.experimental.mosaic.gpu import utils as mu

  itemsize = 4 if partial else 2

  def fn(ctx, acc, out):
    del ctx
    i32, i64, i16 = (ir.IntegerType.get_signless(w) for w in (32, 64, 16))
    row0, quad = thread_coords()
    base = llvm.ptrtoint(i64, mu.memref_ptr(out))
    regs = acc.registers
    assert regs.shape[0] == h // TILE and regs.shape[1:] == (1, 1, 1, 2, 1, 1, 1, 1), regs.shape
    for mt in range(h // TILE):
      for half in range(2):
        n = arith.addi(row0, mu.c(TILE * mt + 8 * half, i32))
        pair = regs[mt, 0, 0, 0, half, 0, 0, 0, 0]
        for j in range(2):
          c = arith.addi(arith.muli(quad, mu.c(2, i32)), mu.c(j, i32))
          at = arith.addi(base, arith.extui(i64, arith.muli(
              arith.addi(arith.muli(c, mu.c(h, i32)), n), mu.c(itemsize, i32))))
          val = llvm.extractelement(pair, mu.c(j, i32))
          if partial:
            mu.inline_ptx("st.global.f32 [$0], $1;", at, val)
          else:
            bits = mu.inline_ptx("cvt.rn.bf16.f32 $0, $1;", val, result_types=i16)
            mu.inline_ptx("st.global.b16 [$0], $1;", at, bits)
    return ()

  return fn


def _pv_body(h: int, g: int, r: int, per: int, prefetch: int, partial: bool):
  """`pv`'s program at grid point (b, g, s): split s's tiles of sequence b's kv head g below
  the length, V decoded into shared memory, the probabilities by TMA (two slots), summed by
  wgmma into a float32 accumulator that `store_columns` writes."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  decode = tile_decoder(h, g, masked=True)
  ask = tile_prefetcher(h, g)
  store = plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()))(
      store_columns(h, partial=partial))

  def body(layer_ref, len_ref, p_ref, c_ref, s_ref, r_ref, o_ref, v_smem, p_smem, bars):
    bi, gi, si = (jax.lax.axis_index(n) for n in ("b", "g", "s"))
    lyr = layer_ref[0]
    length = len_ref[bi]
    first = si * per
    last = jnp.minimum(first + per, (length + TILE - 1) // TILE)
    at = lambda ref, i: ref.at[lyr, bi, pl.ds(i * TILE, TILE), gi]

    def fetch_probs(i):  # tile i's probabilities into slot i % 2
      keys = pl.ds(pl.multiple_of(i * TILE, TILE), TILE)
      plgpu.copy_gmem_to_smem(p_ref.at[bi, gi, :, keys], p_smem.at[i % 2], bars.at[i % 2])

    def ahead(i):  # tile i's lines into L2 (clamped to the split's last: a repeat is harmless)
      i = jnp.maximum(jnp.minimum(i, last - 1), 0)
      ask(at(c_ref, i), at(s_ref, i), at(r_ref, i))

    def run(acc_ref):
      pl.when(first < last)(functools.partial(fetch_probs, first))
      for i in range(1, prefetch):
        ahead(first + i)

      def step(i, carry):
        if prefetch:
          ahead(i + prefetch)
        # slot (i + 1) % 2 was read by tile i - 1's wgmma, done in every warp (below)
        pl.when(i + 1 < last)(functools.partial(fetch_probs, i + 1))
        t0 = pl.multiple_of(i * TILE, TILE)
        keys = pl.ds(t0, TILE)
        v_smem[...] = decode(c_ref.at[lyr, bi, keys, gi], s_ref.at[lyr, bi, keys, gi],
                             r_ref.at[lyr, bi, keys, gi], length - t0)
        plgpu.commit_smem()  # the stores visible to wgmma (async proxy), in every warp
        plgpu.barrier_wait(bars.at[i % 2])
        plgpu.wgmma(acc_ref, v_smem.T, p_smem.at[i % 2].T)
        # v_smem and the slot are overwritten after this tile's wgmma is done in every warp
        plgpu.wgmma_wait(0)
        plgpu.commit_smem()
        return carry

      jax.lax.fori_loop(first, last, step, 0)
      return acc_ref[...]

    acc = pl.run_scoped(run, plgpu.ACC((h, r), jnp.float32))
    store(acc, o_ref.at[bi, gi, si] if partial else o_ref.at[bi, gi])

  return body


@functools.partial(jax.jit, static_argnames=("prefetch", "splits"))
def pv(probs: jax.Array, codes: jax.Array, scale_bits: jax.Array, rows: jax.Array,
       lengths: jax.Array, layer: jax.Array, *, prefetch: int = 0, splits: int = 1
       ) -> jax.Array:
  """bf16 [B, G, R, H] (columns in `column_order(H)`): probabilities x V summed in float32 over
  each sequence's keys below its length (wgmma's order), rounded once. splits > 1: the float32
  partial sums [B, G, S, R, H] of S contiguous runs of tiles (`split_steps`; the caller sums
  them and rounds), S the splits that `split_steps` makes of `splits`.

  probs: bf16 [B, G, R, T] (zero beyond each length, as the softmax makes them); codes,
  scale_bits, rows: V's, as `scores` takes K's. V rows at or beyond the length are decoded as
  zeros; tiles beyond it are not read (a split wholly beyond it writes zeros). One program per
  (sequence, kv head, split), walking its tiles one after another (`default_splits` gives a
  batch of long sequences enough programs). prefetch: tiles asked of L2 ahead of the decode
  (0: none).

  Per tile the sum is out^T [H, R] = V^T [H, 64 keys] @ P^T [64 keys, R]: V decoded into
  shared memory and read transposed as wgmma's A operand (M = H, every row used), the
  probabilities [R, 64] by TMA into shared memory as its B operand (N = R = 8). The form
  out [64, H] = P [64, 64 keys] @ V (P in A registers, M = 64 for R = 8 rows: 8x the tensor
  work) gave the same bits and took 1.06-1.14x this one's attention time on the H100
  (docs/benchmarks.md, decode attention)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu

  b, g, r, t = probs.shape
  h = 16 * scale_bits.shape[-1]
  if not supported(h, r, t, probs.dtype):
    raise ValueError(f"wgmma PV: unsupported shape/dtype {probs.shape} {probs.dtype}, H={h}")
  per, s_count = split_steps(t, TILE, splits)
  partial = s_count > 1
  body = _pv_body(h, g, r, per, prefetch, partial)
  swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  out_type = (jax.ShapeDtypeStruct((b, g, s_count, r, h), jnp.float32) if partial else
              jax.ShapeDtypeStruct((b, g, r, h), jnp.bfloat16))
  kernel = plgpu.kernel(
      body, out_type=out_type, grid=(b, g, s_count), grid_names=("b", "g", "s"),
      kernel_name="decode_attention_pv_wgmma",
      scratch_types=[plgpu.SMEM((TILE, h), jnp.bfloat16, transforms=swizzled),
                     plgpu.SMEM((2, r, TILE), jnp.bfloat16, transforms=swizzled),
                     plgpu.Barrier(num_arrivals=1, num_barriers=2)],
  )
  return kernel(layer.astype(jnp.int32), lengths.astype(jnp.int32), probs, codes, scale_bits,
                rows)


@functools.partial(jax.jit, static_argnames=("scale", "prefetch"))
def scores(q: jax.Array, codes: jax.Array, scale_bits: jax.Array, rows: jax.Array,
           lengths: jax.Array, layer: jax.Array, *, scale: float, prefetch: int = 0
           ) -> jax.Array:
  """float32 scores [B, G, R, T]: (q . K) * scale for every key of every sequence.

  q: bf16 [B, G, R, H] with its columns in `column_order(H)`; codes: uint32 [L, B, T, G, H/8]
  (the cache's words, `PackedKVCache.as_words` reshaped); scale_bits: uint8 [L, B, T, G, H/16];
  rows: float32 [L, B, T, G]; layer: int32 [1]. Tiles at or beyond a sequence's length are
  skipped (their scores are left unwritten, as the Triton kernel leaves them). prefetch: a
  program's tiles asked of L2 ahead of the one it decodes (0: none)."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  b, g, r, h = q.shape
  t = codes.shape[2]
  if not supported(h, r, t, q.dtype):
    raise ValueError(f"wgmma scores: unsupported shape/dtype {q.shape} {q.dtype}, T={t}")
  n_tiles = t // TILE
  per = max(1, min(TILES_PER_PROGRAM, n_tiles))
  while n_tiles % per:
    per -= 1
  decode = tile_decoder(h, g, masked=False)
  ask = tile_prefetcher(h, g)
  swz = 128
  q_transforms = (plgpu.TilingTransform((8, swz // 2)), plgpu.SwizzleTransform(swz))

  store = plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()))(
      _store_transposed(t))

  def body(layer_ref, len_ref, q_ref, c_ref, s_ref, r_ref, o_ref, q_smem, bar):
    bi, gi, ji = (jax.lax.axis_index(n) for n in ("b", "g", "j"))
    lyr = layer_ref[0]
    length = len_ref[bi]
    plgpu.copy_gmem_to_smem(q_ref.at[bi, gi], q_smem, bar)
    plgpu.barrier_wait(bar)

    def tile(t0):
      keys = pl.ds(t0, TILE)
      k = decode(c_ref.at[lyr, bi, keys, gi], s_ref.at[lyr, bi, keys, gi],
                 r_ref.at[lyr, bi, keys, gi])

      def mma(acc_ref):
        plgpu.wgmma(acc_ref, k, q_smem.T)
        return acc_ref[...]

      acc = pl.run_scoped(mma, plgpu.ACC((TILE, r), jnp.float32))
      store(acc * np.float32(scale), o_ref.at[bi, gi, :, keys])

    def ahead(t0):
      keys = pl.ds(t0, TILE)
      ask(c_ref.at[lyr, bi, keys, gi], s_ref.at[lyr, bi, keys, gi], r_ref.at[lyr, bi, keys, gi])

    asked = 1
    for i in range(per):
      for j in range(asked, min(per, i + prefetch + 1)):
        t_j = (ji * per + j) * TILE
        pl.when(t_j < length)(functools.partial(ahead, t_j))
      asked = max(asked, min(per, i + prefetch + 1))
      t0 = (ji * per + i) * TILE
      pl.when(t0 < length)(functools.partial(tile, t0))

  kernel = plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((b, g, r, t), jnp.float32),
      grid=(b, g, n_tiles // per), grid_names=("b", "g", "j"),
      kernel_name="decode_attention_scores_wgmma",
      scratch_types=[plgpu.SMEM((r, h), jnp.bfloat16, transforms=q_transforms),
                     plgpu.Barrier(num_arrivals=1)],
  )
  return kernel(layer.astype(jnp.int32), lengths.astype(jnp.int32), q, codes, scale_bits, rows)
