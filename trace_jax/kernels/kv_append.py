"""New K/V rows quantized to NVFP4 and written into the packed KV cache, in one kernel.

On the packed cache a decode step's `k`/`v` sites otherwise run the site kernel
(`nvfp4_act.quantize_rows`), an XLA fusion packing its codes into the cache's layout, and six
scatters (codes, block scales and row scales of K and of V): about eight launches per layer
for ~300 bytes per sequence and kv head. `append` is one launch, writing the cache in place
(`input_output_aliases`: the cache's buffers are the kernel's outputs).

Contract: `append(cache, k, v, positions, layer)` is the cache stack with `kv_cache.write`'s
rows written into layer `layer`, bit for bit, for k, v [B, S, G, H] in bf16,
f16 or float32 (the quantizer is `nvfp4_act.quantize_tile`, the site kernel's: RTN two-level
NVFP4 per (token, kv head) row, `formats`' numerics). Like XLA's scatter, a position p < 0 is
p + T, and a position still outside [0, T) (or a layer outside [0, L)) writes nothing. The
quantized values themselves are not returned: the kernel decode's attention reads the cache.
With `tap` the kernel also writes the sites' guidance record (`guided.record`'s fields, compact
or full: the rollout's records and audits), so a tapped layer takes the same one launch.

Kernel design (`pl.pallas_call`, Triton lowering on GPU, `interpret=True` elsewhere):
- grid (B, S): one program per (sequence, token), writing its G rows of K and of V.
- Each row of H elements is loaded as [nb, W, C] (nb = H // 16 blocks; W code units per block:
  2 uint32 words or 8 bytes, as the cache holds them; C = 16 // W codes per unit), a free
  reshape outside. A block's amax reduces the last two axes; a unit is the sum of its C codes
  shifted by 4 bits each (distinct bits), so the packing needs no in-kernel reshape. G is
  padded to a power of two (Triton tiles) and masked.
- The cache's block scales are stored as their E4M3 bytes through a uint8 view of the same
  buffer (a bitcast outside, no copy).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from trace_jax.guidance.record import MODES, Guidance
from trace_jax.kernels import common, kv_cache, nvfp4_act
from trace_jax.kernels.kv_cache import PackedKVCache
from trace_jax.quant import exact, formats, guided

BLOCK = formats.NVFP4_BLOCK


def _mask(rows: jax.Array, *shape: int) -> jax.Array:
  """Per-row flags [gp] broadcast over a tile [gp, *shape]."""
  return jnp.broadcast_to(rows.reshape(rows.shape + (1,) * len(shape)), rows.shape + shape)


def _units(words: bool) -> int:
  """Code units per block in the cache: two uint32 words, or eight bytes."""
  return 2 if words else BLOCK // 2


def _kernel(layer_ref, pos_ref, k_ref, v_ref, *refs, num_layers: int, length: int, g: int,
            gp: int, nb: int, w: int, tap: str | None):
  """One program: sequence b's token s, its K and V rows quantized and written at
  (layer, b, positions[b, s]). refs: the aliased cache inputs (unread), the outputs k_codes,
  v_codes, k_block, v_block, k_row, v_row, then (with `tap`) the record's block scale bytes,
  row scales and payload, each [2 (K, V), B, S, G, ...]."""
  out, rec = refs[6:12], refs[12:]
  b, s = pl.program_id(0), pl.program_id(1)
  layer = layer_ref[0]
  layer = jnp.where(layer < 0, layer + num_layers, layer)
  pos = pos_ref[b, s]
  pos = jnp.where(pos < 0, pos + length, pos)
  inside = (layer >= 0) & (layer < num_layers) & (pos >= 0) & (pos < length)
  c = BLOCK // w
  g_real = jnp.arange(gp, dtype=jnp.int32) < g                           # [gp]
  g_ok = g_real & inside
  shifts = (4 * jnp.arange(c, dtype=jnp.int32))[None, None, None, :]
  at = (layer, b, pos, pl.ds(0, gp))
  for kv, (x_ref, codes_ref, block_ref, row_ref) in enumerate(
      ((k_ref, out[0], out[2], out[4]), (v_ref, out[1], out[3], out[5]))):
    x = common.masked_load(x_ref, (b, s, pl.ds(0, gp), pl.ds(0, nb), pl.ds(0, w), pl.ds(0, c)),
                           _mask(g_real, nb, w, c), 0).astype(jnp.float32)
    codes, bs, ts = nvfp4_act.quantize_tile(x)
    units = jnp.sum(codes.astype(jnp.int32) << shifts, axis=3)          # [gp, nb, w]
    scale_bytes = exact.e4m3_to_bits(bs)
    common.masked_store(codes_ref, at + (pl.ds(0, nb), pl.ds(0, w)),
                        units.astype(codes_ref.dtype), _mask(g_ok, nb, w))
    common.masked_store(block_ref, at + (pl.ds(0, nb),), scale_bytes, _mask(g_ok, nb))
    common.masked_store(row_ref, at, ts, g_ok)
    if tap:
      _store_record(rec, (jnp.int32(kv), b, s, pl.ds(0, gp)), g_real, codes, units, scale_bytes,
                    ts, tap)


def _store_record(rec, at, g_real, codes, units, scale_bytes, ts, tap: str) -> None:
  """The guidance record of one (K or V) tile (`guided.record`'s fields): block scale bytes,
  row scales, and the payload: `tap` "full" the codes as `formats.pack_fp4` bytes (each code
  unit's bytes, little-endian), "compact" the codes' low bits as `guided.pack_bits` bytes
  (bit j of a block's 16: element j's)."""
  _, nb, w, c = codes.shape
  block_ref, row_ref, payload_ref = rec
  ok = functools.partial(_mask, g_real)
  common.masked_store(block_ref, at + (pl.ds(0, nb),), scale_bytes, ok(nb))
  common.masked_store(row_ref, at, ts, g_real)
  if tap == "full":
    per = c // 2                                                         # bytes per unit
    byte_shifts = (8 * jnp.arange(per, dtype=jnp.int32))[None, None, None, :]
    payload = (units[..., None] >> byte_shifts) & 0xFF                    # [gp, nb, w, per]
    common.masked_store(payload_ref, at + (pl.ds(0, nb), pl.ds(0, w), pl.ds(0, per)),
                        payload.astype(jnp.uint8), ok(nb, w, per))
  else:
    low = (codes & 1).astype(jnp.int32) << jnp.arange(c, dtype=jnp.int32)[None, None, None, :]
    unit_bits = jnp.sum(low, axis=3) << (c * jnp.arange(w, dtype=jnp.int32))[None, None, :]
    bits16 = jnp.sum(unit_bits, axis=2)                                  # [gp, nb]
    payload = (bits16[:, :, None] >> (8 * jnp.arange(2, dtype=jnp.int32))[None, None, :]) & 0xFF
    common.masked_store(payload_ref, at + (pl.ds(0, nb), pl.ds(0, 2)),
                        payload.astype(jnp.uint8), ok(nb, 2))


@functools.partial(jax.jit, static_argnames=("interpret", "num_warps", "tap"))
def _append(cache: PackedKVCache, k: jax.Array, v: jax.Array, positions: jax.Array,
            layer: jax.Array, *, interpret: bool, num_warps: int, tap: str | None
            ) -> tuple[PackedKVCache, Guidance | None]:
  num_layers, length, g, h = cache.shape[0], cache.shape[2], cache.shape[3], cache.shape[4]
  b, s = positions.shape
  nb, w = h // BLOCK, _units(cache.words)
  c = BLOCK // w
  view = lambda a: a.reshape(a.shape[:4] + (nb, w))                      # codes [L, B, T, G, nb, w]
  as_bytes = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint8)
  arrays = (view(cache.k_codes), view(cache.v_codes), as_bytes(cache.k_block),
            as_bytes(cache.v_block), cache.k_row, cache.v_row)
  rows = lambda x: x.reshape(b, s, g, nb, w, c)
  lead = (2, b, s, g)
  records = () if tap is None else (
      jax.ShapeDtypeStruct(lead + (nb,), jnp.uint8), jax.ShapeDtypeStruct(lead, jnp.float32),
      jax.ShapeDtypeStruct(lead + ((nb, w, c // 2) if tap == "full" else (nb, 2)), jnp.uint8))
  kernel = functools.partial(_kernel, num_layers=num_layers, length=length, g=g,
                             gp=common.next_pow2(g), nb=nb, w=w, tap=tap)
  out = pl.pallas_call(
      kernel,
      out_shape=tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays) + records,
      grid=(b, s), input_output_aliases={4 + i: i for i in range(6)}, interpret=interpret,
      name="nvfp4_kv_append",
      compiler_params=None if interpret else common.compiler_params(num_warps, 1),
  )(jnp.reshape(layer, (1,)).astype(jnp.int32), positions.astype(jnp.int32), rows(k), rows(v),
    *arrays)
  k_codes, v_codes, k_block, v_block, k_row, v_row = out[:6]
  as_scales = lambda a: jax.lax.bitcast_convert_type(a, jnp.float8_e4m3fn)
  cache = PackedKVCache(k_codes=k_codes.reshape(cache.k_codes.shape),
                        v_codes=v_codes.reshape(cache.v_codes.shape),
                        k_block=as_scales(k_block), v_block=as_scales(v_block),
                        k_row=k_row, v_row=v_row)
  if tap is None:
    return cache, None
  block, row, payload = out[6:]
  payload = payload.reshape(lead + (-1,))
  rec = Guidance(block_scale=as_scales(block), row_scale=row[..., None],
                 **{"codes" if tap == "full" else "mantissa": payload})
  return cache, rec


def append(cache: PackedKVCache, k: jax.Array, v: jax.Array, positions: jax.Array,
           layer: jax.Array | int, *, tap: str | None = None, interpret: bool | None = None,
           num_warps: int = 1) -> PackedKVCache | tuple[PackedKVCache, Guidance]:
  """Quantizes K/V rows k, v [B, S, G, H] and writes them at positions [B, S] of layer `layer`
  (an int32 scalar, may be traced) of the cache stack `cache` ([L, B, T, G, H] K and V), in
  place where the caller's buffers allow: `kv_cache.write`'s rows, bit for bit (module
  docstring). tap: also return the sites' guidance record in that mode ("compact" or
  "full"; `guided.record`'s, bit for bit), K and V stacked on a leading axis of 2:
  (cache, record). interpret: None runs the Triton kernel on GPU and the Pallas interpreter
  elsewhere."""
  shape = cache.shape
  if len(shape) != 5:
    raise ValueError(f"append: a cache stack of K/V shape [L, B, T, G, H] expected, got {shape}")
  if tap is not None and tap not in MODES:
    raise ValueError(f"append: tap must be None or one of {MODES}, got {tap!r}")
  for name, x in (("k", k), ("v", v)):
    if getattr(x, "dtype", None) not in nvfp4_act.DTYPES:
      raise TypeError(f"append: {name} must be bf16, f16 or float32, got "
                      f"{getattr(x, 'dtype', type(x).__name__)}")
  b, _, g, h = shape[1:]
  if k.shape != v.shape or k.ndim != 4 or (k.shape[0], *k.shape[2:]) != (b, g, h):
    raise ValueError(f"append: k {k.shape} and v {v.shape} must both be [B, S, G, H] with "
                     f"(B, G, H) = {(b, g, h)} of the cache")
  if positions.shape != k.shape[:2]:
    raise ValueError(f"append: positions of shape {positions.shape}, expected {k.shape[:2]}")
  if interpret is None:
    interpret = common.default_interpret()
  out, rec = _append(cache, k, v, positions, jnp.asarray(layer, jnp.int32),
                     interpret=bool(interpret), num_warps=int(num_warps), tap=tap)
  return out if tap is None else (out, rec)


def reference(cache: PackedKVCache, k: jax.Array, v: jax.Array, positions: jax.Array,
              layer: jax.Array | int, tap: str | None = None
              ) -> PackedKVCache | tuple[PackedKVCache, Guidance]:
  """The kernel's contract in XLA: `kv_cache.write_quantized` of `kv_cache.quantize_rows`
  (and `guided.record` of the same quantization, with `tap`)."""
  q = kv_cache.quantize_rows(jnp.stack([k, v]))
  qk, qv = (jax.tree.map(lambda a, i=i: a[i], q) for i in (0, 1))
  out = kv_cache.write_quantized(cache, qk, qv, positions, layer=layer)
  return out if tap is None else (out, guided.record(q, tap))
