"""The decode MoE grouped matmul on Hopper's wgmma, packed NVFP4 weights decoded into its A
registers (Mosaic GPU lowering).

Why: the Triton kernel (`fp4_moe`, decoder "words") reaches mma.sync's operand layout through
shared memory and streams the packed weights at ~1.45 TB/s on the H200 (docs/benchmarks.md,
2026-12-03); the attention kernels gained 1.5-1.9x from decoding into wgmma's registers
instead (`wgmma_attention`). Here each program computes one expert's output tile transposed:

  out^T [64 features, R rows] = W [64 features, K] @ x^T [K, R]   (W decoded into A registers)

K in chunks of SPAN = 128 columns (`wgmma_decode`: each thread two weight rows and, in each,
two whole NVFP4 blocks per chunk), x's rows of the expert the B operand in shared memory (TMA,
a ring of `STAGES` chunks; a pass's window of R + 8 rows starts at its first row rounded down
to a multiple of 8, as TMA into the tiled shared layout needs, and the columns outside the
expert's rows are not stored), x's columns put in the decoded order
(`wgmma_decode.span_order`) outside the kernel. The codes and scales of the chunks `PREFETCH`
ahead are loaded before a chunk is decoded (the carry of a loop over chunks), so their latency
overlaps the decode. wgmma reads its A registers while in flight: each chunk waits for its
wgmma before the next chunk's registers are made (as `wgmma_attention`'s PV kernel).

Grid (E, N / 64); an expert with no rows returns before reading anything; one with more than R
rows runs several passes over its weights (the later ones from L2). Weights: the tables
"exact" (default: exact for any tensor scale, `fp4_decode.exact_entries`' factors computed in
the kernel) or "fast" (the caller's promise that every tensor scale is in the fast range).
Rows past sum(group_sizes) come out zero (the last expert's programs write them), as
ragged_dot's. Runs on a Hopper GPU only (inline PTX; `tests/kernels/test_wgmma_moe.py`
rebuilds every thread's registers on CPU).

H200 (docs/benchmarks.md): with the codes in registers, correct but no faster than the Triton
words kernel (2026-12-04, gate/up at batch 64: 80.5 vs 77.9 us; both ~31% of DRAM's peak with
~3 programs per SM, waiting on the load-and-decode latency). With the codes through a shared
ring of `STREAM` = 4 chunks (2026-12-05; 96 registers a thread against 142), 61.5-61.7 us against
the Triton kernel's 76.9-79.3 in one process, and the 8-layer engine's fp4_rtn decode 1.054x its
tokens/s at batch 64, so `fp4_moe` picks it on Hopper where K is a multiple of 256.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.kernels import wgmma_decode
from trace_jax.kernels.wgmma_decode import SPAN, TILE

STAGES = 4  # x chunks in shared memory (TMA ring)
PREFETCH = 2  # chunks whose codes and scales are loaded ahead of the decode
STREAM = 4  # `grouped_matmul_decode`'s stream (codes through a shared ring; 0: registers)
GROUP = 1  # and its group (2 has not completed on the H200: its first run hung the call)
MAX_ROWS = 128  # rows per pass at most (wgmma N; the accumulator is R / 2 registers)
_RAW_COLS = 24  # the loaded chunk carried as a [64, 24] int32 WGMMA-layout array: per row 6


def supported(n: int, k: int, dtype) -> bool:
  """Whether the kernel runs this shape: bf16 rows, N a multiple of 64, K of 128."""
  return jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16) and n % TILE == 0 and k % SPAN == 0


def default_rows(m: int, num_experts: int) -> int:
  """Rows per pass (wgmma N): about twice the mean group size, a multiple of 8 in [16,
  MAX_ROWS] (at decode nearly every expert takes one pass)."""
  mean = -(-m // max(num_experts, 1))
  return int(min(MAX_ROWS, max(16, -(-2 * mean // 8) * 8)))


# ----------------------------------------------------------------------------- inline pieces

def _load_chunk(code_pitch: int, scale_pitch: int, shared: bool = False):
  """inline_mgpu function: (codes words window at the chunk, scale bytes window at the chunk,
  rows `code_pitch` / `scale_pitch` bytes apart, in global or `shared` memory) -> this
  thread's raw chunk as a [64, 24] int32 WGMMA-layout array: per row half, its 4 code words
  (2 blocks) and its 16-bit pair of scale bytes."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, llvm
  from jax.experimental.mosaic import gpu as mgpu
  from jax.experimental.mosaic.gpu import utils as mu

  def fn(ctx, codes, scales):
    del ctx
    i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
    i16 = ir.IntegerType.get_signless(16)
    at = i32 if shared else i64  # shared-memory addresses are 32-bit
    space = "shared" if shared else "global.nc"
    ca = lambda v: mu.c(v, at)
    row0, quad = wgmma_decode.thread_coords()
    base_c = llvm.ptrtoint(at, mu.memref_ptr(codes))
    base_s = llvm.ptrtoint(at, mu.memref_ptr(scales))
    layout = mgpu.WGMMA_LAYOUT
    regs = np.empty(layout.registers_shape((TILE, _RAW_COLS)), dtype=object)
    vec = ir.VectorType.get((2,), i32)
    qa = quad if shared else arith.extui(i64, quad)
    for half in range(2):
      row = arith.addi(row0, mu.c(8 * half, i32))
      row = row if shared else arith.extui(i64, row)
      a_c = arith.addi(base_c, arith.addi(arith.muli(row, ca(code_pitch)), arith.muli(qa, ca(16))))
      w = mu.inline_ptx(f"ld.{space}.v4.u32 {{$0, $1, $2, $3}}, [$4];", a_c,
                        result_types=[i32] * 4)
      a_s = arith.addi(base_s, arith.addi(arith.muli(row, ca(scale_pitch)), arith.muli(qa, ca(2))))
      sp = mu.inline_ptx(f"ld.{space}.u16 $0, [$1];", a_s, result_types=i16)
      vals = [*w, arith.extui(i32, sp), mu.c(0, i32)]
      for ct in range(3):
        v = llvm.mlir_undef(vec)
        for j in range(2):
          v = llvm.insertelement(v, vals[2 * ct + j], mu.c(j, i32))
        regs[0, ct, 0, 0, half] = v
    return mgpu.FragmentedArray(_registers=regs, _layout=layout, _is_signed=True)

  return fn


def _decode_chunk(table: str):
  """inline_mgpu function: (a `_load_chunk` array, the expert's tensor scale ref [1]) -> the
  chunk's weights [64, SPAN] bf16 in the WGMMA layout, columns in `column_order(SPAN)`."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, llvm
  from jax.experimental.mosaic import gpu as mgpu
  from jax.experimental.mosaic.gpu import utils as mu

  def fn(ctx, raw, ts_ref):
    del ctx
    i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
    i16, f32 = ir.IntegerType.get_signless(16), ir.F32Type.get()
    ts = mu.inline_ptx("ld.global.nc.f32 $0, [$1];",
                       llvm.ptrtoint(i64, mu.memref_ptr(ts_ref)), result_types=f32)
    scale_args = (ts,) if table == "fast" else \
        mu.inline_ptx(wgmma_decode.factors_ptx(), ts, result_types=[f32] * 6)
    layout = mgpu.WGMMA_LAYOUT
    regs = np.empty(layout.registers_shape((TILE, SPAN)), dtype=object)
    rr = raw.registers
    for half in range(2):
      vals = [llvm.extractelement(rr[0, ct, 0, 0, half].item(), mu.c(j, i32))
              for ct in range(3) for j in range(2)]
      sp = arith.trunci(i16, vals[4])
      for i in range(2):
        wgmma_decode.decode_block(regs, half, i, vals[2 * i], vals[2 * i + 1], sp, scale_args,
                                  table)
    return mgpu.FragmentedArray(_registers=regs, _layout=layout, _is_signed=None)

  return fn


def _store_transposed(n: int):
  """inline_mgpu function: (out^T [64 features, W rows] float32 in the WGMMA layout, the
  output's [W, 64] bf16 window of a row-major [M, n] array, lo, hi: int32) -> rows lo .. hi - 1
  of the window rounded to bf16 (nearest even) and stored."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, llvm
  from jax.experimental.mosaic.gpu import utils as mu

  def fn(ctx, acc, out, lo, hi):
    del ctx
    i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
    i16 = ir.IntegerType.get_signless(16)
    row0, quad = wgmma_decode.thread_coords()
    base = llvm.ptrtoint(i64, mu.memref_ptr(out))
    lo, hi = lo.registers.item(), hi.registers.item()
    regs = acc.registers
    for half in range(2):
      feat = arith.addi(row0, mu.c(8 * half, i32))
      for ct in range(regs.shape[1]):
        pair = regs[0, ct, 0, 0, half].item()
        for j in range(2):
          col = arith.addi(arith.muli(quad, mu.c(2, i32)), mu.c(8 * ct + j, i32))
          ok = arith.extui(i32, arith.andi(arith.cmpi(arith.CmpIPredicate.sge, col, lo),
                                           arith.cmpi(arith.CmpIPredicate.slt, col, hi)))
          off = arith.extui(i64, arith.muli(arith.addi(arith.muli(col, mu.c(n, i32)), feat),
                                            mu.c(2, i32)))
          val = llvm.extractelement(pair, mu.c(j, i32))
          bits = mu.inline_ptx("cvt.rn.bf16.f32 $0, $1;", val, result_types=i16)
          mu.inline_ptx("{\n.reg .pred p;\nsetp.ne.u32 p, $2, 0;\n@p st.global.b16 [$0], $1;\n}",
                        arith.addi(base, off), bits, ok)
    return ()

  return fn


def _zero_rows(n: int, m: int):
  """inline_mgpu function: (the output's [M, 64] column window of a row-major [M, n] bf16
  array, the first row no group holds: int32) -> rows from it to M zeroed (16 bytes a
  thread, 16 rows per step of the warpgroup)."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, gpu, llvm
  from jax.experimental.mosaic.gpu import utils as mu

  def fn(ctx, out, total):
    del ctx
    i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
    tid = arith.remui(arith.index_cast(i32, gpu.thread_id(gpu.Dimension.x)), mu.c(128, i32))
    base = llvm.ptrtoint(i64, mu.memref_ptr(out))
    first = total.registers.item()
    steps = arith.divui(arith.addi(arith.subi(mu.c(m, i32), first), mu.c(15, i32)),
                        mu.c(16, i32))
    steps = arith.select(arith.cmpi(arith.CmpIPredicate.slt, first, mu.c(m, i32)), steps,
                         mu.c(0, i32))

    @mu.fori(steps, ())
    def _(s, carry):
      row = arith.addi(first, arith.addi(arith.muli(s, mu.c(16, i32)),
                                         arith.divui(tid, mu.c(8, i32))))
      ok = arith.extui(i32, arith.cmpi(arith.CmpIPredicate.slt, row, mu.c(m, i32)))
      col = arith.muli(arith.remui(tid, mu.c(8, i32)), mu.c(8, i32))
      off = arith.extui(i64, arith.muli(arith.addi(arith.muli(row, mu.c(n, i32)), col),
                                        mu.c(2, i32)))
      mu.inline_ptx("{\n.reg .pred p;\nsetp.ne.u32 p, $1, 0;\n"
                    "@p st.global.v4.b32 [$0], {0, 0, 0, 0};\n}", arith.addi(base, off), ok)
      return carry

    return ()

  return fn


# ----------------------------------------------------------------------------- the kernel

@functools.partial(jax.jit, static_argnames=("rows", "table", "prefetch", "stream", "group"))
def grouped_matmul(x: jax.Array, codes: jax.Array, block_scale: jax.Array,
                   tensor_scale: jax.Array, group_sizes: jax.Array, layer: jax.Array, *,
                   rows: int, table: str = "exact", prefetch: int = PREFETCH,
                   stream: int = 0, group: int = 1) -> jax.Array:
  """bf16 [M, N]: rows x [M, K] (sorted by expert) times each group's expert weights,
  products summed in float32 (wgmma's order), rounded once.

  codes: uint32 [L, E, N, K/16, 2] (`PackedNVFP4Weights.as_words`); block_scale:
  float8_e4m3fn [L, E, N, K/16] (read as its bytes); tensor_scale: float32 [L, E]; group_sizes:
  int [E]; layer: int32 scalar. rows: rows per pass (`default_rows`); prefetch: K chunks whose
  codes and scales are loaded ahead of the decode (>= 0; the carry of the loop over chunks:
  unrolled, the loop took 213 registers a thread against 142 and ran no faster on the H200).
  stream > 0: the codes go through a ring of that many chunks in shared memory by TMA and the
  scales of the pass by one TMA (K a multiple of 256), instead of into registers (prefetch
  then does not apply); group (stream only, dividing K / 128): chunks decoded before their
  wgmmas are issued and waited for together (only 1 has run to completion on a GPU)."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  m, k = x.shape
  num_layers, e, n = codes.shape[:3]
  if not supported(n, k, x.dtype) or rows % 8 or not 8 <= rows <= MAX_ROWS:
    raise ValueError(f"wgmma MoE: unsupported x {x.shape} {x.dtype}, N={n}, rows={rows}")
  if table not in wgmma_decode.TABLES:
    raise ValueError(f"table must be one of {wgmma_decode.TABLES}, got {table!r}")
  if stream and k % 256:
    raise ValueError(f"wgmma MoE: stream needs K a multiple of 256 (TMA rows of 16-byte "
                     f"multiples of scale bytes), got {k}")
  nk = k // SPAN
  stages = min(STAGES, nk)
  if stream and (nk % group or group > min(stream, stages)):
    raise ValueError(f"wgmma MoE: group {group} must divide K / 128 = {nk} and fit the rings")
  gs = group_sizes.astype(jnp.int32)
  offs = jnp.cumsum(gs) - gs
  # A pass reads rows row0 .. row0 + rows - 1 through a TMA window of `width` rows from row0
  # rounded down to a multiple of 8 (the shared tile's rows: TMA windows start on them). x's
  # columns go in the decoded order, and `width` zero rows after the last keep every window
  # inside the array.
  width = rows + 8
  xs = jnp.pad(jnp.take(x, wgmma_decode.span_order(k), axis=1), ((0, width), (0, 0)))
  words = codes.reshape(num_layers, e, n, k // 8)
  scale_bits = jax.lax.bitcast_convert_type(block_scale, jnp.uint8)
  load = plgpu.inline_mgpu(
      arg_types=(plgpu.RefType(),) * 2,
      return_type=plgpu.ShapeDtypeStruct((TILE, _RAW_COLS), jnp.int32,
                                         layout=plgpu.Layout.WGMMA))(
          _load_chunk(SPAN // 2, k // 16, True) if stream else _load_chunk(k // 2, k // 16))
  decode = plgpu.inline_mgpu(
      arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()),
      return_type=plgpu.ShapeDtypeStruct((TILE, SPAN), jnp.bfloat16,
                                         layout=plgpu.Layout.WGMMA))(_decode_chunk(table))
  store = plgpu.inline_mgpu(
      arg_types=(plgpu.Layout.WGMMA, plgpu.RefType(), plgpu.Layout.WG_SPLAT(shape=()),
                 plgpu.Layout.WG_SPLAT(shape=())))(
          _store_transposed(n))
  zero = plgpu.inline_mgpu(
      arg_types=(plgpu.RefType(), plgpu.Layout.WG_SPLAT(shape=())))(_zero_rows(n, m))
  x_transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

  def body(layer_ref, offs_ref, sizes_ref, x_ref, c_ref, s_ref, ts_ref, o_ref, x_smem, bars,
           *ring):
    ei, ji = jax.lax.axis_index("e"), jax.lax.axis_index("j")
    lyr = layer_ref[0]
    start, size = offs_ref[ei], sizes_ref[ei]
    feats = pl.ds(pl.multiple_of(ji * TILE, TILE), TILE)
    ts = ts_ref.at[lyr, pl.ds(ei, 1)]

    def start_of(c, size):  # chunk c's first index along an axis of `size` per chunk
      return c * size if isinstance(c, int) else pl.multiple_of(c * size, size)

    def load_chunk(c):
      cw = pl.ds(start_of(c, SPAN // 8), SPAN // 8)
      sw = pl.ds(start_of(c, SPAN // 16), SPAN // 16)
      return load(c_ref.at[lyr, ei, feats, cw], s_ref.at[lyr, ei, feats, sw])

    def fetch(row_a, c):
      cols = pl.ds(start_of(c, SPAN), SPAN)
      plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(row_a, width), cols], x_smem.at[c % stages],
                              bars.at[c % stages])

    def fetch_codes(c):  # stream: chunk c's codes into ring slot c % stream
      c_smem, cbars = ring[0], ring[2]
      plgpu.copy_gmem_to_smem(c_ref.at[lyr, ei, feats, pl.ds(start_of(c, SPAN // 8), SPAN // 8)],
                              c_smem.at[c % stream], cbars.at[c % stream])

    def chunks_mma(acc_ref, chunks):
      """Decodes [(chunk c, its raw load)], then issues their wgmmas and waits for them."""
      ws = [decode(raw, ts) for _, raw in chunks]
      for (c, _), w in zip(chunks, ws):
        plgpu.barrier_wait(bars.at[c % stages])
        plgpu.wgmma(acc_ref, w, x_smem.at[c % stages].T)
      # wgmma reads its A registers and the x chunk while in flight: wait before the next
      # chunk's registers are made and before a slot is refilled.
      plgpu.wgmma_wait(0)

    def one_pass(p, carry):
      row0 = start + p * rows
      row_a = pl.multiple_of(row0 - row0 % 8, 8)
      plgpu.commit_smem()  # the previous pass's wgmma reads done in every warp
      for c in range(stages):
        fetch(row_a, c)

      def refill(cs):  # after chunks cs: their slots refilled, every warp's reads done first
        plgpu.commit_smem()
        for c in cs:
          if stream:  # the caller checked cs[0] only
            pl.when(c + stream < nk)(functools.partial(fetch_codes, c + stream))
            pl.when(c + stages < nk)(functools.partial(fetch, row_a, c + stages))
          else:  # the caller checked c + stages < nk
            fetch(row_a, c + stages)

      def mma(acc_ref):
        if stream:  # codes by TMA through a ring of `stream` chunks; scales once per pass
          c_smem, s_smem, cbars, sbar = ring
          plgpu.copy_gmem_to_smem(s_ref.at[lyr, ei, feats], s_smem, sbar)
          for c in range(min(stream, nk)):
            fetch_codes(c)
          plgpu.barrier_wait(sbar)

          def raw_of(c):
            plgpu.barrier_wait(cbars.at[c % stream])
            return load(c_smem.at[c % stream],
                        s_smem.at[:, pl.ds(start_of(c, SPAN // 16), SPAN // 16)])

          def step(g, carry):
            cs = [g * group + i for i in range(group)]
            chunks_mma(acc_ref, [(c, raw_of(c)) for c in cs])
            pl.when(cs[0] + min(stream, stages) < nk)(functools.partial(refill, cs))
            return carry

          jax.lax.fori_loop(0, nk // group, step, 0)
        else:  # chunks 0 .. prefetch - 1 loaded first, then c + prefetch in step c
          def step(c, raws):
            nxt = load_chunk(jnp.minimum(c + prefetch, nk - 1)) if prefetch else None
            chunks_mma(acc_ref, [(c, raws[0] if prefetch else load_chunk(c))])
            pl.when(c + stages < nk)(functools.partial(refill, [c]))
            return (*raws[1:], nxt) if prefetch else raws

          jax.lax.fori_loop(0, nk, step, tuple(load_chunk(i) for i in range(min(prefetch, nk))))
        return acc_ref[...]

      acc = pl.run_scoped(mma, plgpu.ACC((TILE, width), jnp.float32))
      lo = row0 - row_a
      store(acc, o_ref.at[pl.ds(row_a, width), feats], lo,
            lo + jnp.minimum(rows, start + size - row0))
      return carry

    jax.lax.fori_loop(0, (size + rows - 1) // rows, one_pass, 0)
    total = offs_ref[e - 1] + sizes_ref[e - 1]
    pl.when(ei == e - 1)(lambda: zero(o_ref.at[:, feats], total))

  kernel = plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((m, n), jnp.bfloat16),
      grid=(e, n // TILE), grid_names=("e", "j"), kernel_name="grouped_matmul_fp4_wgmma",
      scratch_types=[plgpu.SMEM((stages, width, SPAN), jnp.bfloat16, transforms=x_transforms),
                     plgpu.Barrier(num_arrivals=1, num_barriers=stages),
                     *([plgpu.SMEM((stream, TILE, SPAN // 8), jnp.uint32),
                        plgpu.SMEM((TILE, k // 16), jnp.uint8),
                        plgpu.Barrier(num_arrivals=1, num_barriers=stream),
                        plgpu.Barrier(num_arrivals=1)] if stream else [])],
  )
  return kernel(jnp.reshape(layer, (1,)).astype(jnp.int32), offs, gs, xs, words, scale_bits,
                tensor_scale)
