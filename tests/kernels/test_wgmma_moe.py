"""The wgmma MoE kernel's weight registers, rebuilt on CPU from its own PTX text.

The kernel (`trace_jax.kernels.wgmma_moe`) runs only on a Hopper GPU (Mosaic GPU, inline PTX;
its outputs are checked there by tests/kernels/test_fp4_moe.py's GPU cases and
`experiments.bench.moe_decode`). Here each thread's chunk of an expert's weights is rebuilt
as the kernel builds it: the code words and scale bytes read at `_load_chunk`'s addresses, the
tensor scale's factors from `wgmma_decode.factors_ptx` and each block from `wgmma_decode.block_ptx`,
both PTX programs executed by a numpy interpreter (`ptx_sim`), the results placed where Mosaic
GPU's WGMMA layout puts them. The tile must equal `fp4_moe.dequantize` in `span_order`, bit for
bit, for quantizer-made weights and for raw bytes under extreme tensor scales (the exact
table), and the interpreter must tell a wrong program apart.
"""

import jax
import jax.numpy as jnp
import numpy as np
import numpy_ref
import ptx_sim
import pytest

from trace_jax.kernels import fp4_decode, fp4_moe, wgmma_decode, wgmma_moe

SPAN, TILE = wgmma_decode.SPAN, wgmma_decode.TILE


def _chunk_as_the_kernel_builds_it(p: fp4_moe.PackedNVFP4Weights, e: int, j: int, c: int,
                                   table: str) -> np.ndarray:
  """uint16 bits [64, SPAN] of the A operand of expert e, feature tile j, K chunk c."""
  words = np.asarray(p.as_words().codes)[e, j * TILE:(j + 1) * TILE]  # [64, K/16, 2]
  bits = np.asarray(jax.lax.bitcast_convert_type(p.block_scale, jnp.uint8))[
      e, j * TILE:(j + 1) * TILE]  # [64, K/16]
  ts = np.asarray(p.tensor_scale)[e:e + 1].view(np.uint32)
  # _load_chunk: thread (row, quad) reads the 16 bytes at quad * 16 of the chunk's row (blocks
  # 8c + 2 quad, + 1: 4 words) and the 16-bit scale pair at quad * 2.
  blk = words[:, 8 * c:8 * c + 8].reshape(TILE, 4, 2, 2)  # [row, quad, block i, word]
  pair = bits[:, 8 * c:8 * c + 8].reshape(TILE, 4, 2).astype(np.uint32)
  pair = pair[..., 0] | pair[..., 1] << 8  # little-endian u16 load
  if table == "fast":
    scale_ops = {11: np.broadcast_to(ts, (TILE, 4))}
  else:
    f = ptx_sim.run(wgmma_decode.factors_ptx(), {6: ts})
    scale_ops = {11 + i: np.broadcast_to(f[i], (TILE, 4)) for i in range(6)}
  out = np.zeros((TILE, SPAN // 8, 4, 2), np.uint16)  # [row, ct, quad, j]
  for i in range(2):
    res = ptx_sim.run(wgmma_decode.block_ptx(i, table),
                      {8: blk[:, :, i, 0], 9: blk[:, :, i, 1], 10: pair, **scale_ops})
    for k in range(2):
      for m in range(4):
        r = res[4 * k + m]
        out[:, 8 * i + 4 * k + m, :, 0] = r & 0xFFFF
        out[:, 8 * i + 4 * k + m, :, 1] = r >> 16
  return out.reshape(TILE, SPAN)  # column 8 ct + 2 quad + j


def _dequantized_ieee(p: fp4_moe.PackedNVFP4Weights) -> np.ndarray:
  """`numpy_ref.dequantize_packed_nvfp4` of packed weights (IEEE float32, subnormals kept)."""
  return numpy_ref.dequantize_packed_nvfp4(
      np.asarray(p.as_bytes().codes),
      np.asarray(jax.lax.bitcast_convert_type(p.block_scale, jnp.uint8)), p.tensor_scale)


def _want(p, e, j, c) -> np.ndarray:
  w = _dequantized_ieee(p)[e, j * TILE:(j + 1) * TILE]
  return w[:, wgmma_decode.span_order(w.shape[-1])[c * SPAN:(c + 1) * SPAN]].view(np.uint16)


def _assert_same_bits(got: np.ndarray, want: np.ndarray, what: str) -> None:
  """Equal bit patterns; NaNs compare by NaN-ness (the GPU's canonical NaN differs)."""
  g, w = got.view(jnp.bfloat16).astype(np.float32), want.view(jnp.bfloat16).astype(np.float32)
  nan = np.isnan(w)
  assert np.array_equal(np.isnan(g), nan), f"{what}: NaNs differ"
  bad = (got != want) & ~nan
  assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.size} weights differ; first at "
                         f"{np.argwhere(bad)[0]}: {g[bad][0]} vs {w[bad][0]}")


def _quantized(seed: int = 0, e: int = 3, n: int = 128, k: int = 256):
  rng = np.random.default_rng(seed)
  w = rng.standard_normal((e, n, k)) * np.exp2(rng.integers(-8, 4, (e, n, 1)))
  w[1] = 0.0  # an all-zero expert: tensor scale 0
  w[2, :, :16] = 0.0
  return fp4_moe.pack_nvfp4(jnp.asarray(w, jnp.bfloat16))


def _raw(ts: list[float], seed: int = 1, n: int = 64, k: int = 256):
  """Random code and scale bytes (every code, every E4M3 byte incl. NaN 0x7F / 0xFF and
  subnormal scales) under the given tensor scales."""
  rng = np.random.default_rng(seed)
  e = len(ts)
  return fp4_moe.PackedNVFP4Weights(
      codes=jnp.asarray(rng.integers(0, 256, (e, n, k // 2)), jnp.uint8),
      block_scale=jax.lax.bitcast_convert_type(
          jnp.asarray(rng.integers(0, 256, (e, n, k // 16)), jnp.uint8), jnp.float8_e4m3fn),
      tensor_scale=jnp.asarray(ts, jnp.float32))


@pytest.mark.parametrize("table", wgmma_decode.TABLES)
def test_quantizer_weights_decode_to_dequantize(table):
  p = _quantized()
  assert bool(jnp.all(fp4_decode.tensor_scale_factors(p.tensor_scale)[0]))  # fast range
  # the numpy reference is the model's dequantization on quantizer-made weights
  np.testing.assert_array_equal(_dequantized_ieee(p).view(np.uint16),
                                np.asarray(fp4_moe.dequantize(p, jnp.bfloat16)).view(np.uint16))
  for e, j, c in [(0, 0, 0), (0, 1, 1), (1, 0, 1), (2, 1, 0)]:
    _assert_same_bits(_chunk_as_the_kernel_builds_it(p, e, j, c, table), _want(p, e, j, c),
                      f"{table} expert {e} tile {j} chunk {c}")


EXTREME = [("ordinary", 2.0**-7), ("tiny_exact_scaled", 2.0**-130), ("below_fast", 2.0**-118),
           ("subnormal", 3e-42), ("huge", 2.0**127), ("big_scaled", 1.5 * 2.0**126),
           ("negative", -0.75), ("zero", 0.0), ("inf", np.inf), ("nan", np.nan)]


@pytest.mark.parametrize("name,ts", EXTREME, ids=[c[0] for c in EXTREME])
def test_exact_table_decodes_raw_bytes_under_any_tensor_scale(name, ts):
  p = _raw([ts])
  for c in range(2):
    _assert_same_bits(_chunk_as_the_kernel_builds_it(p, 0, 0, c, "exact"), _want(p, 0, 0, c),
                      f"{name} chunk {c}")


def test_fast_table_is_wrong_outside_its_range_and_the_check_can_fail():
  """The fast table (a caller's promise) gives other bits under a tensor scale below its
  range: the comparison above can fail, and the kernel's default is the exact table."""
  p = _raw([2.0**-130])
  got = _chunk_as_the_kernel_builds_it(p, 0, 0, 0, "fast")
  assert (got != _want(p, 0, 0, 0)).any()


def test_interpreter_refuses_unknown_instructions():
  with pytest.raises(NotImplementedError, match="fma.rn.f32"):
    ptx_sim.run("fma.rn.f32 $0, $1, $2, $3;", {1: 0, 2: 0, 3: 0})


def test_span_order_permutes_each_chunk():
  k = 3 * SPAN
  order = wgmma_decode.span_order(k)
  assert sorted(order.tolist()) == list(range(k))
  for c in range(3):
    np.testing.assert_array_equal(order[c * SPAN:(c + 1) * SPAN] - c * SPAN,
                                  wgmma_decode.column_order(SPAN))
  with pytest.raises(ValueError, match="multiple"):
    wgmma_decode.span_order(100)


@pytest.mark.parametrize("m,e,want", [(512, 64, 16), (2048, 64, 64), (11656, 64, 128),
                                      (8, 64, 16)])
def test_default_rows(m, e, want):
  assert wgmma_moe.default_rows(m, e) == want


def test_grouped_matmul_decode_refuses_wgmma_where_it_cannot_run():
  p = _quantized().as_words()
  x = jnp.zeros((8, 256), jnp.bfloat16)
  gs = jnp.asarray([8, 0, 0], jnp.int32)
  with pytest.raises(ValueError, match="impl='wgmma' needs packed weights held as words"):
    fp4_moe.grouped_matmul_decode(x, p, gs, config=fp4_moe.DecodeConfig(impl="wgmma",
                                                                        interpret=True))
  with pytest.raises(ValueError, match="impl must be one of"):
    fp4_moe.DecodeConfig(impl="cuda")
  assert not fp4_moe.wgmma_supported(jnp.bfloat16, p)  # no Hopper GPU here
  assert wgmma_moe.supported(128, 256, jnp.bfloat16)
  assert not wgmma_moe.supported(96, 256, jnp.bfloat16)  # N not a multiple of 64
  assert not wgmma_moe.supported(128, 192, jnp.bfloat16)  # K not a multiple of 256
  assert not wgmma_moe.supported(128, 384, jnp.bfloat16)
  assert not wgmma_moe.supported(128, 256, jnp.float16)
