"""The decode MoE grouped matmul on Hopper's wgmma, packed NVFP4 weights decoded into its A
registers (Mosaic GPU lowering).

Why: the Triton kernel (`fp4_moe`, decoder "words") reaches mma.sync's operand layout through
shared memory and streams the packed weights at ~1.45 TB/s on the H200 (docs/benchmarks.md,
MoE decode); the attention kernels gained 1.5-1.9x from decoding into wgmma's registers
instead (`wgmma_attention`). Here each program computes one expert's output tile transposed:

  out^T [64 features, R rows] = W [64 features, K] @ x^T [K, R]   (W decoded into A registers)

K in chunks of SPAN = 128 columns (`wgmma_decode`: each thread two weight rows and, in each,
two whole NVFP4 blocks per chunk), x's rows of the expert the B operand in shared memory (TMA,
a ring of `STAGES` chunks; a pass's window of R + 8 rows starts at its first row rounded down
to a multiple of 8, as TMA into the tiled shared layout needs, and the columns outside the
expert's rows are not stored), x's columns put in the decoded order
(`wgmma_decode.span_order`) outside the kernel. The codes go through a shared-memory ring of
`RING` chunks by TMA and the pass's scales by one TMA (K a multiple of 256), so the loads run
ahead of the decode without holding registers. wgmma reads its A registers while in flight:
each chunk waits for its wgmma before the next chunk's registers are made (as
`wgmma_attention`'s PV kernel).

Grid (E, N / 64); an expert with no rows returns before reading anything; one with more than R
rows runs several passes over its weights (the later ones from L2). Weights: the tables
"exact" (default: exact for any tensor scale, `fp4_decode.exact_entries`' factors computed in
the kernel) or "fast" (the caller's promise that every tensor scale is in the fast range).
Rows past sum(group_sizes) come out zero (the last expert's programs write them), as
ragged_dot's. Runs on a Hopper GPU only (inline PTX; `tests/kernels/test_wgmma_moe.py`
rebuilds every thread's registers on CPU).

H200 (docs/benchmarks.md, MoE decode): with the codes carried in registers (loads 2 chunks
ahead) the kernel was correct but no faster than the Triton words kernel (gate/up at batch 64
under ncu: 79.7 / 78.8 us against 79.3 / 76.9; ~3 programs per SM waiting on the
load-and-decode latency); that variant is gone.
With the codes through the shared ring (96 registers a thread against 142), 61.5-61.7 us
against the Triton kernel's 76.9-79.3 in one process, and the 8-layer engine's fp4_rtn decode
1.054x its tokens/s at batch 64: the kernel plan's `decode_moe_kernel="wgmma"` on Hopper
(`fp4_moe`; shapes with K not a multiple of 256 run the Triton kernel). Decoding two chunks
before their wgmmas are waited for did not complete on the H200.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from trace_jax.kernels import wgmma_decode
from trace_jax.kernels.wgmma_decode import SPAN, TILE

STAGES = 4  # x chunks in shared memory (TMA ring)
RING = 4  # code chunks in shared memory (TMA ring)
MAX_ROWS = 128  # rows per pass at most (wgmma N; the accumulator is R / 2 registers)
_RAW_COLS = 24  # the loaded chunk carried as a [64, 24] int32 WGMMA-layout array: per row 6


def supported(n: int, k: int, dtype) -> bool:
  """Whether the kernel runs this shape: bf16 rows, N a multiple of 64, K of 256 (the codes'
  and scales' TMA rows)."""
  return jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16) and n % TILE == 0 and k % 256 == 0


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

@dataclasses.dataclass(frozen=True)
class _Call:
  """One call's static shape and its inline Mosaic GPU functions."""
  rows: int  # rows per pass
  width: int  # the x window's rows per pass (rows + 8)
  nk: int  # K chunks
  stages: int  # x chunks in flight
  num_experts: int
  load: Any
  decode: Any
  store: Any
  zero: Any


@dataclasses.dataclass(frozen=True)
class _Refs:
  """One program's refs and indices (expert ei, feature tile `feats`, layer lyr)."""
  x: Any
  codes: Any
  scales: Any
  ts: Any
  x_smem: Any
  bars: Any
  c_smem: Any
  s_smem: Any
  cbars: Any
  sbar: Any
  lyr: Any
  ei: Any
  feats: Any


def _start(c: Any, size: int) -> Any:
  """Chunk c's first index along an axis of `size` per chunk."""
  return c * size if isinstance(c, int) else pl.multiple_of(c * size, size)


def _fetch_x(r: _Refs, call: _Call, row_a: Any, c: Any) -> None:
  """x's window of the pass, chunk c, into x slot c % stages."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # Hopper only: loaded on use

  cols = pl.ds(_start(c, SPAN), SPAN)
  plgpu.copy_gmem_to_smem(r.x.at[pl.ds(row_a, call.width), cols], r.x_smem.at[c % call.stages],
                          r.bars.at[c % call.stages])


def _fetch_codes(r: _Refs, c: Any) -> None:
  """Chunk c's codes into ring slot c % RING."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # Hopper only: loaded on use

  plgpu.copy_gmem_to_smem(
      r.codes.at[r.lyr, r.ei, r.feats, pl.ds(_start(c, SPAN // 8), SPAN // 8)],
      r.c_smem.at[c % RING], r.cbars.at[c % RING])


def _refill(r: _Refs, call: _Call, row_a: Any, c: Any) -> None:
  """After chunk c: its slots refilled with chunks c + RING (codes) and c + stages (x), every
  warp's reads of them done first."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # Hopper only: loaded on use

  plgpu.commit_smem()
  pl.when(c + RING < call.nk)(functools.partial(_fetch_codes, r, c + RING))
  pl.when(c + call.stages < call.nk)(functools.partial(_fetch_x, r, call, row_a,
                                                       c + call.stages))


def _mma(acc_ref: Any, r: _Refs, call: _Call, row_a: Any) -> jax.Array:
  """One pass's sums [64 features, width rows]: the pass's scales by one TMA, the codes
  through the ring, each chunk decoded into A registers and multiplied by its x chunk."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # Hopper only: loaded on use

  plgpu.copy_gmem_to_smem(r.scales.at[r.lyr, r.ei, r.feats], r.s_smem, r.sbar)
  for c in range(min(RING, call.nk)):
    _fetch_codes(r, c)
  plgpu.barrier_wait(r.sbar)
  ts = r.ts.at[r.lyr, pl.ds(r.ei, 1)]

  def step(c, carry):
    plgpu.barrier_wait(r.cbars.at[c % RING])
    raw = call.load(r.c_smem.at[c % RING],
                    r.s_smem.at[:, pl.ds(_start(c, SPAN // 16), SPAN // 16)])
    w = call.decode(raw, ts)
    plgpu.barrier_wait(r.bars.at[c % call.stages])
    plgpu.wgmma(acc_ref, w, r.x_smem.at[c % call.stages].T)
    # wgmma reads its A registers and the x chunk while in flight: wait before the next
    # chunk's registers are made and before a slot is refilled.
    plgpu.wgmma_wait(0)
    pl.when(c + min(RING, call.stages) < call.nk)(
        functools.partial(_refill, r, call, row_a, c))
    return carry

  jax.lax.fori_loop(0, call.nk, step, 0)
  return acc_ref[...]


def _one_pass(p: Any, carry: Any, *, r: _Refs, call: _Call, start: Any, size: Any,
              out: Any) -> Any:
  """Rows start + p * rows .. of the expert: its x window fetched, the sums, the store."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # Hopper only: loaded on use

  row0 = start + p * call.rows
  row_a = pl.multiple_of(row0 - row0 % 8, 8)
  plgpu.commit_smem()  # the previous pass's wgmma reads done in every warp
  for c in range(call.stages):
    _fetch_x(r, call, row_a, c)
  acc = pl.run_scoped(functools.partial(_mma, r=r, call=call, row_a=row_a),
                      plgpu.ACC((TILE, call.width), jnp.float32))
  lo = row0 - row_a
  call.store(acc, out.at[pl.ds(row_a, call.width), r.feats], lo,
             lo + jnp.minimum(call.rows, start + size - row0))
  return carry


def _body(layer_ref, offs_ref, sizes_ref, x_ref, c_ref, s_ref, ts_ref, o_ref, x_smem, bars,
          c_smem, s_smem, cbars, sbar, *, call: _Call):
  """Program (expert e, feature tile j): the expert's passes; the last expert's programs zero
  the rows no group holds."""
  ei, ji = jax.lax.axis_index("e"), jax.lax.axis_index("j")
  feats = pl.ds(pl.multiple_of(ji * TILE, TILE), TILE)
  r = _Refs(x=x_ref, codes=c_ref, scales=s_ref, ts=ts_ref, x_smem=x_smem, bars=bars,
            c_smem=c_smem, s_smem=s_smem, cbars=cbars, sbar=sbar, lyr=layer_ref[0], ei=ei,
            feats=feats)
  start, size = offs_ref[ei], sizes_ref[ei]
  jax.lax.fori_loop(0, (size + call.rows - 1) // call.rows,
                    functools.partial(_one_pass, r=r, call=call, start=start, size=size,
                                      out=o_ref), 0)
  e = call.num_experts
  total = offs_ref[e - 1] + sizes_ref[e - 1]
  pl.when(ei == e - 1)(lambda: call.zero(o_ref.at[:, feats], total))


def _inline_functions(n: int, m: int, k: int, table: str) -> dict[str, Any]:
  """The call's Mosaic GPU functions: load, decode, store, zero."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # Hopper only: loaded on use

  raw = plgpu.ShapeDtypeStruct((TILE, _RAW_COLS), jnp.int32, layout=plgpu.Layout.WGMMA)
  tile = plgpu.ShapeDtypeStruct((TILE, SPAN), jnp.bfloat16, layout=plgpu.Layout.WGMMA)
  scalar = plgpu.Layout.WG_SPLAT(shape=())
  return dict(
      load=plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * 2, return_type=raw)(
          _load_chunk(SPAN // 2, k // 16, True)),
      decode=plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()),
                               return_type=tile)(_decode_chunk(table)),
      store=plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType(), scalar, scalar))(
          _store_transposed(n)),
      zero=plgpu.inline_mgpu(arg_types=(plgpu.RefType(), scalar))(_zero_rows(n, m)))


@functools.partial(jax.jit, static_argnames=("rows", "table"))
def grouped_matmul(x: jax.Array, codes: jax.Array, block_scale: jax.Array,
                   tensor_scale: jax.Array, group_sizes: jax.Array, layer: jax.Array, *,
                   rows: int, table: str = "exact") -> jax.Array:
  """bf16 [M, N]: rows x [M, K] (sorted by expert) times each group's expert weights,
  products summed in float32 (wgmma's order), rounded once.

  codes: uint32 [L, E, N, K/16, 2] (`PackedNVFP4Weights.as_words`); block_scale:
  float8_e4m3fn [L, E, N, K/16] (read as its bytes); tensor_scale: float32 [L, E]; group_sizes:
  int [E]; layer: int32 scalar. rows: rows per pass (`default_rows`); table: "exact" or
  "fast" (the caller's promise that every tensor scale is in the fast range)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # Hopper only: loaded on use

  m, k = x.shape
  num_layers, e, n = codes.shape[:3]
  if not supported(n, k, x.dtype) or rows % 8 or not 8 <= rows <= MAX_ROWS:
    raise ValueError(f"wgmma MoE: unsupported x {x.shape} {x.dtype}, N={n}, rows={rows} (bf16, "
                     f"N a multiple of {TILE}, K of 256, rows a multiple of 8 up to "
                     f"{MAX_ROWS})")
  if table not in wgmma_decode.TABLES:
    raise ValueError(f"table must be one of {wgmma_decode.TABLES}, got {table!r}")
  gs = group_sizes.astype(jnp.int32)
  # A pass reads rows row0 .. row0 + rows - 1 through a TMA window of `width` rows from row0
  # rounded down to a multiple of 8 (the shared tile's rows: TMA windows start on them). x's
  # columns go in the decoded order, and `width` zero rows after the last keep every window
  # inside the array.
  width = rows + 8
  nk = k // SPAN
  stages = min(STAGES, nk)
  call = _Call(rows=rows, width=width, nk=nk, stages=stages, num_experts=e,
               **_inline_functions(n, m, k, table))
  x_transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  kernel = plgpu.kernel(
      functools.partial(_body, call=call), out_type=jax.ShapeDtypeStruct((m, n), jnp.bfloat16),
      grid=(e, n // TILE), grid_names=("e", "j"), kernel_name="grouped_matmul_fp4_wgmma",
      scratch_types=[plgpu.SMEM((stages, width, SPAN), jnp.bfloat16, transforms=x_transforms),
                     plgpu.Barrier(num_arrivals=1, num_barriers=stages),
                     plgpu.SMEM((RING, TILE, SPAN // 8), jnp.uint32),
                     plgpu.SMEM((TILE, k // 16), jnp.uint8),
                     plgpu.Barrier(num_arrivals=1, num_barriers=RING),
                     plgpu.Barrier(num_arrivals=1)])
  xs = jnp.pad(jnp.take(x, wgmma_decode.span_order(k), axis=1), ((0, width), (0, 0)))
  return kernel(jnp.reshape(layer, (1,)).astype(jnp.int32), jnp.cumsum(gs) - gs, gs, xs,
                codes.reshape(num_layers, e, n, k // 8),
                jax.lax.bitcast_convert_type(block_scale, jnp.uint8), tensor_scale)
