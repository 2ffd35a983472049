"""Packed NVFP4 decoded straight into Hopper wgmma's A registers: the pieces the Mosaic GPU
kernels share (`wgmma_attention`: K and V of the packed cache; `wgmma_moe`: expert weights).

wgmma (Mosaic GPU lowering) takes its A operand [64, K] from registers in the layout Mosaic
documents (`WGMMA_LAYOUT`): thread (warp w, lane l) of the warpgroup holds rows 16 w + l // 4
and that + 8, and in each the column pairs 8 ct + 2 (l % 4) + {0, 1}, ct = 0 .. K / 8 - 1.
For every SPAN = 128 columns of a row (8 NVFP4 blocks of 16), thread quad c = l % 4 decodes
the two whole blocks 2 c, 2 c + 1 (16 contiguous code bytes, one 128-bit load): one table per
(row, block), codes decoded by byte permutes with `fp4_decode`'s PTX programs (bit for bit
the Triton kernels' words decoder). Each register holds whichever elements its lookups
produce, so the A operand's columns are a permutation of the row's (`column_order`); the B
operand (q, x) takes the same permutation outside the kernel and the products are the same.

Tables (`block_ptx`): "fast" (bf16, per row or tensor scale in `fp4_decode.
tensor_scale_factors`' fast range: every scale the quantizers make; 2 float32 products per
block) or "exact" (any tensor scale: the 8 entries from `fp4_decode.exact_entries`' factors,
which the kernel computes once per call from the tensor scale, `factors_ptx`).
The kernels run on a Hopper GPU only (inline PTX, no interpret mode); the CPU tests rebuild
every thread's registers (tests/kernels/test_wgmma_attention.py, test_wgmma_moe.py).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from trace_jax.kernels import fp4_decode

TILE = 64  # rows of the A operand (wgmma's M)
SPAN = 128  # columns of 4 threads x 2 blocks (one 16-byte code load per thread and row)
TABLES = ("fast", "exact")


def available() -> bool:
  """Whether this jax has the Mosaic GPU API the kernels are written against (jax 0.11:
  `plgpu.kernel(out_type=...)`, `inline_mgpu`, `mosaic.gpu.utils.inline_ptx`; jax 0.10.2 has
  the first two only)."""
  try:
    import inspect

    from jax.experimental.mosaic.gpu import utils as mu
    from jax.experimental.pallas import mosaic_gpu as plgpu
  except ImportError:  # pragma: no cover
    return False
  return (hasattr(plgpu, "inline_mgpu") and hasattr(mu, "inline_ptx")
          and "out_type" in inspect.signature(plgpu.kernel).parameters)


# ----------------------------------------------------------------------------- the layout

def _lookup_pairs() -> tuple[tuple[int, int], ...]:
  """Elements (within a word's 8) of the 4 results of `fp4_decode.lookup_program`, in order:
  each a 16-bit pair [low half, high half]."""
  return ((0, 2), (4, 6), (1, 3), (5, 7))


@functools.cache
def column_order(h: int) -> np.ndarray:
  """A operand column n holds row element `column_order(h)[n]` (a permutation of range(h)),
  for a row of h columns (a multiple of SPAN) decoded by one call.

  Thread c (= lane % 4) of a row owns the nb = h/64 blocks nb c + i, i < nb (its contiguous
  8 nb code bytes); its register ct = 8i + 4k + m is result m of the lookup of word k
  (elements 8k .. 8k+7) of block i."""
  nb = 2 * h // SPAN  # blocks per thread
  order = np.empty(h, np.int64)
  pairs = _lookup_pairs()
  for c in range(4):
    for i in range(nb):
      for k in range(2):
        for m in range(4):
          ct = 8 * i + 4 * k + m
          for jj in range(2):
            order[8 * ct + 2 * c + jj] = 16 * (nb * c + i) + 8 * k + pairs[m][jj]
  if sorted(order.tolist()) != list(range(h)):  # pragma: no cover - a bug in the map above
    raise AssertionError("column_order is not a permutation")
  return order


@functools.cache
def span_order(k: int) -> np.ndarray:
  """`column_order(SPAN)` applied to every SPAN columns of a row of k: the column order of a
  row decoded SPAN columns per call (`wgmma_moe`'s K chunks)."""
  if k % SPAN:
    raise ValueError(f"span_order: {k} columns are not a multiple of {SPAN}")
  return (np.arange(0, k, SPAN)[:, None] + column_order(SPAN)[None, :]).reshape(-1)


# ----------------------------------------------------------------------------- PTX

def factors_ptx() -> str:
  """PTX: tensor scale $6 -> `fp4_decode.tensor_scale_factors`' exact-table factors (inv, t0,
  t_half, t1, t2, t4) as $0..$5, with the same operations (each product exact)."""
  return "\n".join([
      "{", ".reg .f32 %a, %s, %t;", ".reg .pred %p, %sm, %bg;",
      "abs.f32 %a, $6;",
      "setp.gt.f32 %p, %a, 0f00000000;",
      "setp.lt.and.f32 %sm, %a, 0f01000000, %p;",  # 0 < |ts| < 2**-125
      "setp.ge.f32 %p, %a, 0f7E800000;",
      "setp.lt.and.f32 %bg, %a, 0f7F800000, %p;",  # 2**126 <= |ts| < inf
      "selp.f32 %s, 0f4B800000, 0f3F800000, %sm;",  # 2**24 or 1
      "selp.f32 %s, 0f3E800000, %s, %bg;",  # or 0.25
      "selp.f32 $0, 0f33800000, 0f3F800000, %sm;",  # inv: 2**-24 or 1
      "selp.f32 $0, 0f40800000, $0, %bg;",  # or 4
      "mul.rn.f32 %t, $6, %s;",  # t1 = ts * scale
      "mul.rn.f32 $1, %t, 0f00000000;",
      "mul.rn.f32 $2, %t, 0f3F000000;",
      "mov.b32 $3, %t;",
      "mul.rn.f32 $4, %t, 0f40000000;",
      "mul.rn.f32 $5, %t, 0f40800000;",
      "}"])


def block_ptx(half: int, table: str = "fast") -> str:
  """PTX: one row's block -> its 16 values as 8 bf16 pairs, in `_lookup_pairs` order per word.

  Operands: $0..$7 the results (word 0's 4, word 1's 4), $8, $9 the block's code words, $10
  the 16-bit pair of scale bytes holding this block's in byte `half`; then "fast": $11 the row
  (tensor) scale; "exact": $11..$16 its factors (`factors_ptx`)."""
  if table not in TABLES:
    raise ValueError(f"table must be one of {TABLES}, got {table!r}")
  o = fp4_decode.PtxOps(jnp.bfloat16)
  y = [f"%y{i}" for i in range(8)]
  floats = "%P, %Q, %b15" if table == "fast" else "%b, %i15, %b15, " + ", ".join(y)
  head = [f".reg .f32 %bs, {floats};", ".reg .b32 %sc;", ".reg .b16 %s0, %s1;",
          "cvt.rn.f16x2.e4m3x2 %sc, $10;",  # both scale bytes, exactly (NaN stays NaN)
          "mov.b32 {%s0, %s1}, %sc;",
          f"cvt.f32.f16 %bs, %s{half};"]
  if table == "fast":
    tabs = fp4_decode.fast_table_program(o, "%P", "%Q")
    head += ["mul.rn.f32 %P, %bs, $11;",  # P = RN(bs * ts)
             "mul.rn.f32 %b15, %bs, 0f3FC00000;",  # 1.5 bs, exact
             "mul.rn.f32 %Q, %b15, $11;"]  # Q = RN(1.5 bs * ts)
  else:  # fp4_decode.exact_entries: b = bs * inv, b15 = bs * (inv * 1.5), then 8 products
    tabs = fp4_decode.exact_table_program(o, *y)
    head += ["mul.rn.f32 %b, %bs, $11;",
             "mul.rn.f32 %i15, $11, 0f3FC00000;",
             "mul.rn.f32 %b15, %bs, %i15;"]
    for i, (base, t) in enumerate([("%b", 12), ("%b", 13), ("%b", 14), ("%b15", 14),
                                   ("%b", 15), ("%b15", 15), ("%b", 16), ("%b15", 16)]):
      head.append(f"mul.rn.f32 {y[i]}, {base}, ${t};")
  out = [*fp4_decode.lookup_program(o, "$8", tabs, tabs),
         *fp4_decode.lookup_program(o, "$9", tabs, tabs)]
  return "{\n" + "\n".join(head) + "\n" + o.render([f"${i}" for i in range(8)], out) + "\n}"


# ----------------------------------------------------------------------------- MLIR pieces
# (called inside `plgpu.inline_mgpu` functions)

def thread_coords():
  """(row0, quad) of this thread in its warpgroup (int32): its WGMMA-layout rows are
  row0 = 16 warp + lane // 4 and row0 + 8, its column pairs 8 ct + 2 quad, quad = lane % 4."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, gpu
  from jax.experimental.mosaic.gpu import utils as mu

  i32 = ir.IntegerType.get_signless(32)
  c32 = lambda v: mu.c(v, i32)
  tid = arith.remui(arith.index_cast(i32, gpu.thread_id(gpu.Dimension.x)), c32(128))
  warp, lane = arith.divui(tid, c32(32)), arith.remui(tid, c32(32))
  return arith.addi(arith.muli(warp, c32(16)), arith.divui(lane, c32(4))), \
      arith.remui(lane, c32(4))


def decode_block(regs: np.ndarray, half: int, i: int, w0, w1, scale_pair, scale_args,
                 table: str = "fast") -> None:
  """Decodes block i of this thread's row `half` (code words w0, w1; the 16-bit scale bytes
  pair holding it, in byte i % 2) into `regs[0, 8i + 4k + m, 0, 0, half]` (bf16 pairs), the
  registers of a WGMMA-layout bf16 array. scale_args: (row scale,) for "fast", the six
  `factors_ptx` factors for "exact"."""
  from jax._src.lib.mlir import ir
  from jax.experimental.mosaic.gpu import utils as mu

  i32 = ir.IntegerType.get_signless(32)
  pair_ty = ir.VectorType.get((2,), ir.BF16Type.get())
  res = mu.inline_ptx(block_ptx(i % 2, table), w0, w1, scale_pair, *scale_args,
                      result_types=[i32] * 8)
  for k in range(2):
    for m in range(4):
      regs[0, 8 * i + 4 * k + m, 0, 0, half] = mu.bitcast(res[4 * k + m], pair_ty)
