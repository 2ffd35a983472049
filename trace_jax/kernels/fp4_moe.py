"""MoE grouped matmul at decode: each touched expert's weights read once, packed NVFP4 or BF16.

Contract (the same as `trace_jax.model.grouped.grouped_matmul`): rows x [M, K] sorted by
expert, `group_sizes` [E] (int, summing to M), weights w [E, N, K] (torch [out, in] order,
contraction axis last) -> [M, N] in x.dtype, products summed in float32. Rows past
sum(group_sizes) come out zero, as with ragged_dot.

Weights are either a dense array (BF16 or the compute dtype) or `PackedNVFP4Weights`: the
two-level NVFP4 quantization of `qat.fake_quant_weight(w, "nvfp4")` stored as it is read,
two E2M1 codes per byte (`formats.pack_fp4` nibble order), E4M3 block scales per 16 elements
and one float32 second-level scale per expert. The kernel dequantizes in registers with the
operations and rounding order of `formats.nvfp4_dequantize` (code value * block scale, exact;
then * tensor scale, one float32 rounding; then one rounding to x.dtype), so the weights it
multiplies are bit for bit those of the fake-quantized path, without materialising them.

Two kernels (`DecodeConfig.impl`; the model passes its kernel plan's `decode_moe_kernel`):
"triton" (below; `pl.pallas_call`, Triton lowering on GPU, `interpret=True` elsewhere) and
"wgmma" (`wgmma_moe`: packed words on a Hopper GPU, decoded into wgmma's A registers).

The Triton kernel:
- grid (E, N // block_n): one program per (expert, output tile). A program reads its
  expert's row offset and size; an expert with no rows returns before loading anything, so
  untouched experts' weights are never read.
- Each program loops over its expert's rows in blocks of `block_m` (masked loads/stores, so
  M needs no padding), and for each row block over K in tiles of `block_k`: load the weight
  tile (packed codes + block scales, or BF16), dequantize, dot with the x tile (float32
  accumulator), store the row block's output tile once.
- Loop order: row blocks outside, K inside. The accumulator must be a static-size register
  tile while the number of row blocks is dynamic, so the K loop cannot be outermost with
  every row block's accumulator live. The first row block reads the expert's [block_n, K]
  weight slab from HBM; further row blocks (only experts holding more than `block_m` rows)
  re-read the same slab right after, from L2. `block_m` defaults to about twice the mean
  group size (16..64), so at decode nearly every expert fits one row block and its weights
  cross HBM once per step.
- Decoding never uses float8/float4 conversions in jnp (which XLA or Triton may rewrite). The
  codes' layout picks the decoder:
  - codes as words (`PackedNVFP4Weights.as_words`, the kernel plan's `fp4_codes="words"`, the
    GPU's layout): `fp4_decode.decode_words`, per-block tables of the 8 results
    dtype(RN(v * bs * ts)) and byte-permute (`prmt`) lookups in PTX inline assembly (jnp
    integer ops in interpret mode), one table per block built by the thread that decodes it.
    The 16 results of a block are laid out in the MMA operand order (`fp4_decode.mma_order`,
    x's columns permuted alike outside the kernel, where the K tile is a multiple of 64) so no
    element changes thread on its way to the MMA, and the next K tile's codes and scales are
    loaded before the current one is decoded. The tensor scale picks the table per program:
    the fast one (every scale the quantizer makes) or the exact one (extreme tensor scales,
    f16): two copies of the loops, one runs. H200, gate/up at batch 64: 1.13x faster than
    the bytes' table decoder it replaced (the git history of docs/benchmarks.md).
  - codes as bytes (the interpreter's layout): the block scale from its E4M3 bits
    (`exact.e4m3_value`), each byte's two E2M1 codes placed into float16 bit patterns by two
    integer multiplies and masks (`e2m1_pair_scaled`: the float16 is the code's value times
    2**-14, folded back exactly into the block scale), then the two float32 products per
    weight; the nibbles re-interleaved with a 2-way stack + reshape.
  Both give `formats.nvfp4_dequantize`'s bits (`fp4_decode`'s docstring proves the tables').
- Packed weights are the MMA's first operand (each tile computed transposed: at decode the
  weight tile is the large side); dense weights the second.
- Rows past sum(group_sizes) are zeroed by the programs of the last expert.
Timings need the GPU (`experiments/bench/moe_decode.py`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.experimental import pallas as pl

from trace_jax.kernels import common, fp4_decode, grouped_gemm, wgmma_decode, wgmma_moe
from trace_jax.quant import exact, formats

NVFP4_BLOCK = formats.NVFP4_BLOCK
_BYTES_PER_BLOCK = NVFP4_BLOCK // 2  # packed code bytes under one block scale


# ----------------------------------------------------------------------------- packed weights

@struct.dataclass
class PackedNVFP4Weights:
  """Two-level NVFP4 stacked expert weights [E, N, K] as the decode kernel reads them.

  codes: uint8 [E, N, K // 2], two E2M1 codes per byte, element 2i in the low nibble; or
    the same bytes as uint32 words [E, N, K // 16, 2] (`as_words`: each block's 8 bytes as two
    little-endian words), the layout the GPU kernel's "words" decoder reads.
  block_scale: float8_e4m3fn [E, N, K // 16].
  tensor_scale: float32 [E], one second-level scale per expert.
  """
  codes: jax.Array
  block_scale: jax.Array
  tensor_scale: jax.Array

  @property
  def words(self) -> bool:
    """Whether the codes are held as uint32 words per block (`as_words`)."""
    return self.codes.dtype == jnp.uint32

  @property
  def shape(self) -> tuple[int, ...]:
    """The logical weight shape (E, N, K), or (L, E, N, K) for a stack of layers."""
    if self.words:
      *lead, kb, _ = self.codes.shape
      return (*lead, NVFP4_BLOCK * kb)
    *lead, half = self.codes.shape
    return (*lead, 2 * half)

  def as_words(self) -> PackedNVFP4Weights:
    """The same weights with the codes as uint32 words per block (no-op if they are)."""
    if self.words:
      return self
    return self.replace(codes=fp4_decode.to_words(self.codes))

  def as_bytes(self) -> PackedNVFP4Weights:
    """The same weights with the codes as bytes (the ModelOpt layout; no-op if they are)."""
    return self.replace(codes=fp4_decode.from_words(self.codes)) if self.words else self

  def slice_n(self, start: int, stop: int | None = None) -> PackedNVFP4Weights:
    """Output rows [start:stop] of every expert (the tensor scales are shared, not copied)."""
    return PackedNVFP4Weights(codes=self.codes[:, start:stop],
                              block_scale=self.block_scale[:, start:stop],
                              tensor_scale=self.tensor_scale)


def check_packed(p: PackedNVFP4Weights, stacked: bool = False) -> None:
  """Raises ValueError/TypeError if the fields' shapes or dtypes disagree (works on tracers).
  stacked: every field has a leading layer axis L."""
  lead = ("L, " if stacked else "")
  if p.words:
    if p.codes.ndim != 4 + stacked or p.codes.shape[-1] != 2:
      raise TypeError(f"PackedNVFP4Weights.codes as words must be uint32 [{lead}E, N, K // 16, "
                      f"2], got {p.codes.shape}")
  elif p.codes.ndim != 3 + stacked or p.codes.dtype != jnp.uint8:
    raise TypeError(f"PackedNVFP4Weights.codes must be uint8 [{lead}E, N, K // 2] (or uint32 "
                    f"words), got {p.codes.dtype} {p.codes.shape}")
  *layers, e, n, k = p.shape
  if k % NVFP4_BLOCK:
    raise ValueError(f"PackedNVFP4Weights: K={k} is not a multiple of {NVFP4_BLOCK}")
  want = (*layers, e, n, k // NVFP4_BLOCK)
  if p.block_scale.shape != want or p.block_scale.dtype != jnp.float8_e4m3fn:
    raise ValueError(f"PackedNVFP4Weights.block_scale must be float8_e4m3fn {want}, got "
                     f"{p.block_scale.dtype} {p.block_scale.shape}")
  if p.tensor_scale.shape != (*layers, e) or p.tensor_scale.dtype != jnp.float32:
    raise ValueError(f"PackedNVFP4Weights.tensor_scale must be float32 {(*layers, e)}, got "
                     f"{p.tensor_scale.dtype} {p.tensor_scale.shape}")


def pack_nvfp4(w: jax.Array) -> PackedNVFP4Weights:
  """Packs stacked expert weights w [E, N, K] exactly as `qat.fake_quant_weight(w, "nvfp4")`
  quantizes them: one second-level scale per expert (`nvfp4_tensor_scale` over axes 1, 2).

  Pass w in the dtype the model quantizes it in (the compute dtype: `Precision.expert_weights`
  receives the weights already cast to x.dtype), so the codes match its fake quantization.
  """
  if w.ndim != 3:
    raise ValueError(f"pack_nvfp4: expected stacked expert weights [E, N, K], got {w.shape}")
  ts = formats.nvfp4_tensor_scale(w, axes=(1, 2))
  q = formats.nvfp4_quantize(w, ts)
  return PackedNVFP4Weights(codes=formats.pack_fp4(q.codes), block_scale=q.block_scale,
                            tensor_scale=ts.reshape(w.shape[0]))


def pack_for_kernel(w: jax.Array, words: bool) -> PackedNVFP4Weights:
  """`pack_nvfp4` with the codes as words per block (`as_words`, the GPU kernels' decoder) or
  as bytes (the interpreter's faster path): the same values either way."""
  p = pack_nvfp4(w)
  return p.as_words() if words else p


def pack_nvfp4_gate_up(gate: jax.Array, up: jax.Array
                       ) -> tuple[PackedNVFP4Weights, PackedNVFP4Weights]:
  """Gate and up [E, F, D] packed with one shared tensor scale per expert, as
  `Precision.expert_weights` quantizes them (concatenated along N, quantized, split).

  For one fused gate/up matmul, `pack_nvfp4(jnp.concatenate([gate, up], axis=1))` holds the
  same bytes.
  """
  if gate.shape != up.shape:
    raise ValueError(f"pack_nvfp4_gate_up: gate {gate.shape} and up {up.shape} differ")
  f = gate.shape[1]
  both = pack_nvfp4(jnp.concatenate([gate, up], axis=1))
  return both.slice_n(0, f), both.slice_n(f)


def dequantize(p: PackedNVFP4Weights, dtype: Any = jnp.float32) -> jax.Array:
  """[E, N, K] values in `dtype`; equals `qat.fake_quant_weight(w, "nvfp4")` bit for bit
  when dtype is w's dtype (the same `formats.nvfp4_dequantize`, then one rounding)."""
  check_packed(p)
  q = formats.NVFP4Tensor(codes=formats.unpack_fp4(p.as_bytes().codes), block_scale=p.block_scale,
                          tensor_scale=p.tensor_scale.reshape(-1, 1, 1))
  return formats.nvfp4_dequantize(q).astype(dtype)


def weight_bytes_per_expert(w: jax.Array | PackedNVFP4Weights) -> int:
  """Bytes of one expert's weights as stored (what the kernel reads for a touched expert)."""
  if isinstance(w, PackedNVFP4Weights):
    _, n, k = w.shape
    return n * k // 2 + n * k // NVFP4_BLOCK + 4
  _, n, k = w.shape
  return n * k * jnp.dtype(w.dtype).itemsize


# ----------------------------------------------------------------------------- reference

def grouped_matmul_reference(x: jax.Array, w: jax.Array | PackedNVFP4Weights,
                             group_sizes: jax.Array) -> jax.Array:
  """The kernel's contract in plain JAX: dequantize (or cast) to x.dtype, then ragged_dot."""
  wd = dequantize(w, x.dtype) if isinstance(w, PackedNVFP4Weights) else w.astype(x.dtype)
  return grouped_gemm.ragged_dot(x, wd, group_sizes.astype(jnp.int32))


# ----------------------------------------------------------------------------- config

IMPLS = ("triton", "wgmma")
TABLES = (None, *fp4_decode.TABLES)


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """How `grouped_matmul_decode` runs.

  impl: "triton" (the Pallas kernel of the module docstring) or "wgmma" (`wgmma_moe`: packed
    words on a Hopper GPU, bf16 rows; `wgmma_supported` says where it runs).
  table: packed words: None picks the fast or exact table per expert from its tensor scale;
    "exact" always takes the exact one (any scale; for tests); "fast" always the fast one
    (exact only for tensor scales in `fp4_decode.tensor_scale_factors`' fast range). wgmma:
    None or "exact" the exact table, "fast" the fast one.
  block_m: rows per block (None: `default_block_m`); wgmma: rows per pass, a multiple of 8 up
    to `wgmma_moe.MAX_ROWS` (None: `wgmma_moe.default_rows`).
  block_n / block_k: Triton's output / contraction tile caps, each reduced to the largest power
    of two dividing N / K (N and K must be multiples of 16); block_n None: 64 in interpret
    mode, on the GPU `common.default_block_n` (smaller for few experts).
  num_warps / num_stages: Triton launch parameters.
  interpret: None runs the kernel on the GPU and the Pallas interpreter elsewhere.
  """
  impl: str = "triton"
  table: str | None = None
  block_m: int | None = None
  block_n: int | None = None
  block_k: int = 256
  num_warps: int = 4
  num_stages: int = 3
  interpret: bool | None = None

  def __post_init__(self):
    if self.impl not in IMPLS:
      raise ValueError(f"DecodeConfig: impl must be one of {IMPLS}, got {self.impl!r}")
    if self.table not in TABLES:
      raise ValueError(f"DecodeConfig: table must be one of {TABLES}, got {self.table!r}")
    for name in ("block_n", "block_k"):
      value = getattr(self, name)
      if value is not None:
        common.check_block(f"DecodeConfig: {name}", value, 16)


def default_block_m(m: int, num_experts: int) -> int:
  """Rows per block: about twice the mean group size, a power of two in [16, 64]."""
  return min(64, max(16, common.next_pow2(2 * -(-m // num_experts))))


def wgmma_supported(dtype: Any, w: Any) -> bool:
  """Whether impl="wgmma" takes rows of `dtype` times `w` here: packed weights held as words
  on a GPU with the Mosaic GPU API, bf16 rows, shapes `wgmma_moe.supported` takes. On the
  H200 (docs/benchmarks.md) its gate/up at batch 64 ran in 61.5-61.7 us against the Triton
  words kernel's 76.9-79.3, the 8-layer engine's fp4_rtn decode 1.054x faster."""
  if not isinstance(w, PackedNVFP4Weights) or not w.words:
    return False
  _, n, k = w.shape[-3:]
  return (jax.default_backend() == "gpu" and wgmma_decode.available()
          and wgmma_moe.supported(n, k, dtype))


# ----------------------------------------------------------------------------- decoding

_DECODE_SHIFT = np.float32(2.0**14)  # E2M1 bits placed in float16 read as value * 2**-14


def e2m1_pair_scaled(p: jax.Array) -> tuple[jax.Array, jax.Array]:
  """float32 values * 2**-14 of the low and high E2M1 nibbles of packed bytes p (uint8).

  Each nibble's magnitude bits go to float16 bits 11..9 (the two low exponent bits and the top
  mantissa bit) and its sign to bit 15, so the float16 is the E2M1 value times 2**-14 exactly
  (code 1, 0.5, becomes the float16 subnormal 2**-15) and float16 -> float32 is exact on every
  backend. Both halves come from two integer multiplies and masks on the byte (the shifted
  copies never overlap, so no carries): no int -> float conversion (quarter rate on Hopper) and
  no table. The 2**-14 is folded into the block scale (`e4m3_value_scaled`), so the products
  stay exact. Equals `formats.e2m1_decode(formats.unpack_fp4(p)) * 2**-14` bit for bit,
  signed zeros included.
  """
  t = p.astype(jnp.uint32)
  # low nibble -> bits 9..11 and 15, high nibble -> bits 25..27 and 31
  r = (((t * np.uint32(0x00200200)) & np.uint32(0x0E000E00))
       | ((t * np.uint32(0x01001000)) & np.uint32(0x80008000)))
  as_f32 = lambda b: jax.lax.bitcast_convert_type(b.astype(jnp.uint16),
                                                  jnp.float16).astype(jnp.float32)
  return as_f32(r), as_f32(r >> 16)


def e4m3_value_scaled(scale: jax.Array) -> jax.Array:
  """`exact.e4m3_value(scale) * 2**14` (exact: a power-of-two product of a value in
  [2**-9, 448]); pairs with `e2m1_pair_scaled`."""
  return exact.e4m3_value(scale) * _DECODE_SHIFT


# ----------------------------------------------------------------------------- kernel



# ----------------------------------------------------------------------------- kernel

def _weight_tiles(w_refs: tuple[Any, ...], kind: str, lyr: jax.Array, e: jax.Array,
                  n0: jax.Array, bn: int, bk: int, dt: Any, asm: bool, order: str):
  """(load, load_raw, decode) of one program's weight tiles [bn, bk] in dt, K tile t:
  load(t, ts, table) loads and decodes; with codes as words, load_raw(t) loads the tile's
  codes [bn, kb, 2] and scale bytes [bn, kb] and decode(raw, ts, table) decodes them (the
  prefetch's two halves); else both None. ts: the tensor scale (bytes) or its
  `tensor_scale_factors` (words); unused for dense weights."""
  if kind == "dense":
    (w_ref,) = w_refs
    load = lambda t, ts, table: w_ref[lyr, e, pl.ds(n0, bn),
                                      pl.ds(pl.multiple_of(t * bk, bk), bk)].astype(dt)
    return load, None, None
  codes_ref, bs_ref, _ = w_refs
  kb = bk // NVFP4_BLOCK  # scale blocks per K tile
  start = lambda t, size: t * size if isinstance(t, int) else pl.multiple_of(t * size, size)

  def scale_bytes(t):
    return bs_ref[lyr, e, pl.ds(n0, bn), pl.ds(start(t, kb), kb)]

  if kind == "words":  # [bn, kb, 2] words: each block's 8 bytes, in the scales' [bn, kb] shape
    def load_raw(t):
      return (codes_ref[lyr, e, pl.ds(n0, bn), pl.ds(start(t, kb), kb), :],
              jax.lax.bitcast_convert_type(scale_bytes(t), jnp.uint8))

    def decode(raw, factors, table):
      w0, w1 = jnp.unstack(raw[0], axis=-1)
      return fp4_decode.decode_words(w0, w1, raw[1], dt, asm=asm, factors=factors, table=table,
                                     order=order)

    return (lambda t, ts, table: decode(load_raw(t), ts, table)), load_raw, decode

  def load_bytes(t, ts, table):
    # A 2-D tile of whole contiguous rows (coalesced loads), viewed as [bn, kb, 8]: the bytes
    # under each block scale on their own axis, so the scales broadcast over it.
    p = codes_ref[lyr, e, pl.ds(n0, bn), pl.ds(start(t, bk // 2), bk // 2)]
    p = p.reshape(bn, kb, _BYTES_PER_BLOCK)
    s = e4m3_value_scaled(scale_bytes(t))[:, :, None]
    lo, hi = e2m1_pair_scaled(p)  # elements 2i, 2i+1
    # formats.nvfp4_dequantize's order: code value * block scale, exact (the 2**-14 and 2**14
    # factors cancel exactly), then * tensor scale, one float32 rounding; then dt.
    lo, hi = ((lo * s) * ts).astype(dt), ((hi * s) * ts).astype(dt)
    return jnp.stack([lo.reshape(bn, bk // 2), hi.reshape(bn, bk // 2)], axis=-1
                     ).reshape(bn, bk)

  return load_bytes, None, None


def _row_blocks(x_ref, o_ref, tiles, ts, table, *, start, size, end, n0, bm: int, bn: int,
                bk: int, nk: int, swap_ab: bool) -> None:
  """The program's matmul: its expert's rows in blocks of bm, each over K in nk tiles of bk
  (with codes as words, tile t + 1's loads issued before tile t's decode and dot)."""
  load, load_raw, decode = tiles
  dt = o_ref.dtype
  rows = jnp.arange(bm, dtype=jnp.int32)[:, None]  # [bm, 1]

  def row_block(r, carry):
    row0 = start + r * bm
    valid = (row0 + rows) < end  # [bm, 1]
    x_mask = jnp.broadcast_to(valid, (bm, bk))

    def k_step(t, acc, wt):
      k0 = pl.multiple_of(t * bk, bk)
      xt = common.masked_load(x_ref, (pl.ds(row0, bm), pl.ds(k0, bk)), x_mask, 0).astype(dt)
      a, b = (wt, xt) if swap_ab else (xt, wt)
      return acc + jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                                       precision=common.dot_precision(dt),
                                       preferred_element_type=jnp.float32)

    zeros = jnp.zeros((bn, bm) if swap_ab else (bm, bn), jnp.float32)
    if load_raw is not None:
      def prefetched(t, carry):
        acc, raw = carry
        nxt = load_raw(jnp.minimum(t + 1, nk - 1))
        return k_step(t, acc, decode(raw, ts, table)), nxt

      acc, _ = jax.lax.fori_loop(0, nk, prefetched, (zeros, load_raw(0)))
    else:
      acc = jax.lax.fori_loop(0, nk, lambda t, acc: k_step(t, acc, load(t, ts, table)), zeros)
    acc = acc.T if swap_ab else acc
    common.masked_store(o_ref, (pl.ds(row0, bm), pl.ds(n0, bn)), acc.astype(dt),
                        jnp.broadcast_to(valid, (bm, bn)))
    return carry

  jax.lax.fori_loop(0, jax.lax.div(size + (bm - 1), bm), row_block, 0)


def _kernel(offs_ref, sizes_ref, layer_ref, x_ref, *refs, kind: str, order: str, asm: bool,
            table: str | None, m: int, k: int, num_experts: int, bm: int, bn: int, bk: int):
  """One (expert, N tile) program: see the module docstring. The weights carry a leading
  layer axis; layer_ref [1] names the layer read (in place: no copy of a layer's slice).
  kind: "dense", "bytes" or "words" (packed codes' layout)."""
  *w_refs, o_ref = refs
  dt = o_ref.dtype
  e, lyr = pl.program_id(0), layer_ref[0]
  n0 = pl.multiple_of(pl.program_id(1) * bn, bn)
  start, size = offs_ref[e], sizes_ref[e]
  tiles = _weight_tiles(tuple(w_refs), kind, lyr, e, n0, bn, bk, dt, asm, order)
  run = functools.partial(_row_blocks, x_ref, o_ref, tiles, start=start, size=size,
                          end=jnp.minimum(start + size, m), n0=n0, bm=bm, bn=bn, bk=bk,
                          nk=k // bk, swap_ab=kind != "dense")

  @pl.when(size > 0)
  def _matmul():
    if kind == "dense":
      run(None, None)
    elif kind == "bytes":
      run(w_refs[2][lyr, e], None)
    else:  # the tensor scale's exact factors, once per program
      factors = fp4_decode.tensor_scale_factors(w_refs[2][lyr, e])
      if jnp.dtype(dt) != jnp.dtype(jnp.bfloat16) or table is not None:
        run(factors, table or "exact")
      else:  # two copies of the loops: the fast table (every quantizer scale), or the exact
        pl.when(factors[0])(lambda: run(factors, "fast"))
        pl.when(jnp.logical_not(factors[0]))(lambda: run(factors, "exact"))

  total = offs_ref[num_experts - 1] + sizes_ref[num_experts - 1]
  pl.when((e == num_experts - 1) & (total < m))(
      lambda: common.zero_rows_past(o_ref, total, m, bm, n0, bn))


@functools.partial(jax.jit, static_argnames=("interpret", "bm", "bn", "bk", "num_warps",
                                             "num_stages", "table"))
def _triton(x, w, group_sizes, layer, *, interpret, bm, bn, bk, num_warps, num_stages, table):
  m, k = x.shape
  packed = isinstance(w, PackedNVFP4Weights)
  if layer is None:  # one layer: a leading axis of 1 (a free reshape)
    w = jax.tree.map(lambda a: a[None], w)
    layer = jnp.zeros((), jnp.int32)
  e, n = (w.codes if packed else w).shape[1:3]
  if m == 0:
    return jnp.zeros((0, n), x.dtype)
  gs = group_sizes.astype(jnp.int32)
  kind = ("words" if w.words else "bytes") if packed else "dense"
  # words: the tile's columns in the MMA operand order (`fp4_decode.mma_order`) where the K
  # tile allows it, x's columns permuted alike (one small XLA copy of x per call).
  order = "mma" if kind == "words" and bk % fp4_decode.MMA_ORDER_SPAN == 0 else "natural"
  xs = fp4_decode.mma_order_columns(x) if order == "mma" else x
  weights = (w.codes, w.block_scale, w.tensor_scale) if packed else (w,)
  kernel = functools.partial(_kernel, kind=kind, order=order, asm=not interpret, table=table,
                             m=m, k=k, num_experts=e, bm=bm, bn=bn, bk=bk)
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((m, n), x.dtype), grid=(e, n // bn),
      interpret=interpret,
      name="grouped_matmul_decode_fp4" if packed else "grouped_matmul_decode",
      compiler_params=None if interpret else common.compiler_params(num_warps, num_stages),
  )(jnp.cumsum(gs) - gs, gs, jnp.reshape(layer, (1,)).astype(jnp.int32), xs, *weights)


def _wgmma(x: jax.Array, w: PackedNVFP4Weights, group_sizes: jax.Array,
           layer: jax.Array | None, config: DecodeConfig) -> jax.Array:
  e, n, k = w.shape[-3:]
  if not wgmma_supported(x.dtype, w) or config.interpret:
    raise ValueError("impl='wgmma' needs packed weights held as words on a Hopper GPU, bf16 "
                     f"rows, N a multiple of {wgmma_decode.TILE} and K of 256; got x "
                     f"{x.shape} {x.dtype}, w {w.shape}")
  rows = wgmma_moe.default_rows(x.shape[0], e) if config.block_m is None else config.block_m
  if rows % 8 or not 8 <= rows <= wgmma_moe.MAX_ROWS:
    raise ValueError(f"impl='wgmma' takes block_m (rows per pass) a multiple of 8 in "
                     f"[8, {wgmma_moe.MAX_ROWS}], got {rows}")
  if x.shape[0] == 0:
    return jnp.zeros((0, n), x.dtype)
  if layer is None:  # one layer: a leading axis of 1 (a free reshape)
    w, layer = jax.tree.map(lambda a: a[None], w), jnp.zeros((), jnp.int32)
  return wgmma_moe.grouped_matmul(x, w.codes, w.block_scale, w.tensor_scale, group_sizes,
                                  layer, rows=rows, table=config.table or "exact")


def _check_operands(x: jax.Array, w: jax.Array | PackedNVFP4Weights, group_sizes: jax.Array,
                    layer: jax.Array | None) -> tuple[int, int, int]:
  """(E, N, K) of valid operands; raises ValueError/TypeError naming what is wrong."""
  if x.ndim != 2:
    raise ValueError(f"grouped_matmul_decode: x must be [M, K], got {x.shape}")
  if x.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
    raise TypeError(f"grouped_matmul_decode: x dtype must be bf16, f16 or f32, got {x.dtype}")
  lead = 0 if layer is None else 1
  if isinstance(w, PackedNVFP4Weights):
    check_packed(w, stacked=layer is not None)
  elif w.ndim != 3 + lead:
    raise ValueError(f"grouped_matmul_decode: w must be [{'L, ' * lead}E, N, K], got {w.shape}")
  if layer is not None and jnp.shape(layer) != ():
    raise ValueError(f"grouped_matmul_decode: layer must be a scalar, got {jnp.shape(layer)}")
  e, n, k = w.shape[lead:]
  if k != x.shape[1]:
    raise ValueError(f"grouped_matmul_decode: x {x.shape} and w {w.shape} disagree on K")
  if group_sizes.shape != (e,):
    raise ValueError(f"grouped_matmul_decode: group_sizes must be [{e}], got "
                     f"{group_sizes.shape}")
  if n % 16 or k % 16:
    raise ValueError(f"grouped_matmul_decode: N={n} and K={k} must be multiples of 16")
  return e, n, k


def grouped_matmul_decode(x: jax.Array, w: jax.Array | PackedNVFP4Weights,
                          group_sizes: jax.Array, *, layer: jax.Array | None = None,
                          config: DecodeConfig = DecodeConfig()) -> jax.Array:
  """Rows x [M, K] sorted by expert times w [E, N, K] (dense or packed NVFP4) -> [M, N].

  layer: with it, w holds a stack of layers ([L, E, N, K]; packed: every field with a leading
  L) and the kernel reads layer `layer` (int32 scalar, may be traced: a scan over layers) in
  place, where slicing the stack first would copy the layer's weights at every call.
  config: the kernel and its tiles (`DecodeConfig`).
  """
  e, n, k = _check_operands(x, w, group_sizes, layer)
  if config.impl == "wgmma":
    return _wgmma(x, w, group_sizes, layer, config)
  interpret = common.default_interpret() if config.interpret is None else config.interpret
  if isinstance(w, PackedNVFP4Weights) and w.words:
    if not fp4_decode.supported_dtype(x.dtype):
      raise ValueError(f"codes held as words decode to bf16/f16 rows, got {x.dtype}")
    if not interpret and not fp4_decode.ASM_AVAILABLE:
      raise ValueError("codes held as words need Pallas' Triton inline assembly on the GPU")
  block_m = default_block_m(x.shape[0], e) if config.block_m is None else config.block_m
  common.check_block("block_m", block_m, 16)
  if config.block_n is None:  # the interpreter runs programs one by one: fewer, larger tiles
    block_n = 64 if interpret else common.default_block_n(n, e)
  else:
    block_n = config.block_n
  return _triton(x, w, group_sizes, layer, interpret=bool(interpret), bm=block_m,
                 bn=common.pow2_divisor(n, block_n), bk=common.pow2_divisor(k, config.block_k),
                 num_warps=config.num_warps, num_stages=config.num_stages, table=config.table)


def matmul_decode(x: jax.Array, w: jax.Array, *, layer: jax.Array | None = None,
                  config: DecodeConfig = DecodeConfig()) -> jax.Array:
  """x [M, K] times one dense weight w [N, K] -> [M, N], as one "expert" of
  `grouped_matmul_decode` (its grid spreads N over the GPU); with `layer`, w is a stack
  [L, N, K] read at that layer in place."""
  stacked = jnp.expand_dims(w, 0 if layer is None else 1)
  return grouped_matmul_decode(x, stacked, jnp.full((1,), x.shape[0], jnp.int32), layer=layer,
                               config=config)
