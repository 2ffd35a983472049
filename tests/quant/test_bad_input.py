"""Defined behaviour for bad input (docs/numerics.md): clear errors, never garbage.

Eager calls on concrete arrays raise; under `jit` non-finite input poisons exactly its block
(its row under per-row scaling, its tensor under per-tensor scaling).
"""

from __future__ import annotations

import cases
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import trace_jax.quant as quant
from trace_jax.guidance import record
from trace_jax.quant import guided

F32 = cases.F32


def _x(shape: tuple[int, ...] = (128, 256)) -> np.ndarray:
  return cases.random_mixed(shape[0], shape[1], seed=11)


EAGER = {
    "nvfp4": lambda x: quant.nvfp4_quantize(x),
    "nvfp4_two_level": lambda x: quant.nvfp4_quantize(x, jnp.ones(x.shape[:-1] + (1,))),
    "mxfp4": lambda x: quant.mxfp4_quantize(x),
    "fp8_act": lambda x: quant.fp8_quantize_act(x),
    "fp8_weight": lambda x: quant.fp8_quantize_weight(x),
}
BAD_VALUES = {"nan": np.nan, "+inf": np.inf, "-inf": -np.inf}


# ----------------------------------------------------------------------------- non-finite

@pytest.mark.parametrize("value", list(BAD_VALUES))
@pytest.mark.parametrize("fn", list(EAGER))
def test_eager_nonfinite_raises(fn: str, value: str) -> None:
  x = _x()
  x[5, 17] = BAD_VALUES[value]
  with pytest.raises(ValueError, match="non-finite"):
    EAGER[fn](jnp.asarray(x))


def _poisoned() -> tuple[np.ndarray, list[tuple[int, int, int]]]:
  """`stacked()` with NaN / +Inf / -Inf planted at (chunk, row, col) positions."""
  arr, _ = cases.stacked()
  arr = arr.copy()
  spots = [(0, 3, 40), (0, 7, 200), (2, 64, 0), (cases.RANDOM_CHUNKS + 1, 100, 255)]
  for (c, r, k), v in zip(spots, [np.nan, np.inf, -np.inf, np.nan], strict=True):
    arr[c, r, k] = v
  return arr, spots


def _poison_mask(fmt: str, shape: tuple[int, ...], spots) -> np.ndarray:
  """Elements that a non-finite input at `spots` must poison, in `stacked()` layout."""
  m = np.zeros(shape, bool)
  for c, r, k in spots:
    if fmt in ("nvfp4", "mxfp4", "fp8_act"):
      b = {"nvfp4": 16, "mxfp4": 32, "fp8_act": 128}[fmt]
      m[c, r, k // b * b:(k // b + 1) * b] = True
    elif fmt == "nvfp4_row":
      m[c, r] = True
    elif fmt == "nvfp4_tensor":
      m[c] = True
    elif fmt == "nvfp4_expert":
      e = r // (cases.ROWS // cases.EXPERTS) * (cases.ROWS // cases.EXPERTS)
      m[c, e:e + cases.ROWS // cases.EXPERTS] = True
    else:  # fp8_weight: the 128 x 128 block
      m[c, r // 128 * 128:(r // 128 + 1) * 128, k // 128 * 128:(k // 128 + 1) * 128] = True
  return m


@pytest.mark.parametrize("fmt", list(cases.FORMATS))
def test_jit_nonfinite_poisons_its_block_only(fmt: str) -> None:
  """Under jit: NaN scale where the input is not finite, codes 0 there, dequantized NaN in
  exactly the poisoned blocks (row / tensor / expert under two-level scaling); every other
  value equals the clean run bit for bit."""
  arr, spots = _poisoned()
  got = {k: cases.to_numpy(v) for k, v in cases.jax_op(fmt)(jnp.asarray(arr)).items()}
  clean = cases.jax_results(fmt, "float32")
  mask = _poison_mask(fmt, arr.shape, spots)
  block_rows = cases.FORMATS[fmt][1]
  nan_byte = 0xFF if fmt == "mxfp4" else 0x7F
  for name in ("tensor_scale", "scale", "block_scale"):
    if name not in got:
      continue
    is_nan = (lambda a: a == nan_byte) if name == "block_scale" else np.isnan
    want_bad = cases.block_view(mask.astype(F32), got[name].shape, block_rows).any(-1)
    np.testing.assert_array_equal(is_nan(got[name]), want_bad, f"{fmt}: NaN {name} positions")
    assert not np.any(is_nan(clean[name])), f"{fmt}: clean data has NaN {name}"
  deq = got["dequant"].reshape(arr.shape)
  assert np.all(np.isnan(deq[mask])), f"{fmt}: poisoned values are not all NaN"
  assert not np.any(np.isnan(deq[~mask])), f"{fmt}: NaN leaked outside the poisoned blocks"
  cases.assert_bits_equal(deq[~mask], clean["dequant"].reshape(arr.shape)[~mask],
                          f"{fmt}: dequant outside the poisoned blocks")
  field = "values" if "values" in got else "codes"
  codes = got[field].reshape(arr.shape)
  assert np.all(codes[mask] == 0), f"{fmt}: codes of poisoned blocks are not 0"
  cases.assert_bits_equal(codes[~mask], clean[field].reshape(arr.shape)[~mask],
                          f"{fmt}: {field} outside the poisoned blocks")


def test_jit_second_level_scale_of_nan_input_is_nan() -> None:
  """nvfp4_tensor_scale / nvfp4_row_scale under jit: NaN wherever the reduced part holds a NaN
  (at any position), as eager calls and the torch twin give."""
  x = _x()
  cols = np.arange(128) * 2 + 1  # one NaN per row, at every other column
  x[np.arange(128), cols] = np.nan
  got = jax.jit(lambda v: (quant.nvfp4_row_scale(v), quant.nvfp4_tensor_scale(v)))(jnp.asarray(x))
  rows = np.asarray(got[0])[:, 0]
  assert np.all(np.isnan(rows)), (
      f"{int((~np.isnan(rows)).sum())} of 128 rows holding a NaN got a finite row scale, e.g. "
      f"row {int(np.argmin(np.isnan(rows)))} (NaN at column "
      f"{int(cols[np.argmin(np.isnan(rows))])}): {rows[np.argmin(np.isnan(rows))]!r}")
  assert np.isnan(np.asarray(got[1])).all(), "tensor scale of an input with NaN is not NaN"


@pytest.mark.parametrize("mode", record.MODES)
def test_jit_nonfinite_guided(mode: str) -> None:
  """NaN in the training input zeroes the guided codes of its block (NaN block scale, NaN
  dequant); NaN in the rollout input poisons the guidance of its row."""
  arr, _ = cases.stacked()
  train = cases.stacked_train().copy()
  rollout = arr.copy()
  train[0, 3, 40] = np.nan
  rollout[1, 9, 100] = np.inf
  out = {k: cases.to_numpy(v) for k, v in cases.jax_guided(mode)(jnp.asarray(rollout),
                                                                  jnp.asarray(train)).items()}
  clean = cases.jax_guided_results(mode, "float32")
  assert np.all(out["guided_codes"][0, 3, 32:48] == 0)
  assert np.all(np.isnan(out["guided_dequant"][0, 3, 32:48]))
  assert out["guided_block_scale"][0, 3, 2] == 0x7F
  assert np.isnan(out["row_scale"][1, 9, 0]) and np.all(out["block_scale"][1, 9] == 0x7F)
  assert np.all(out["guided_codes"][1, 9] == 0) and np.all(np.isnan(out["guided_dequant"][1, 9]))
  keep = np.ones(arr.shape, bool)
  keep[0, 3, 32:48] = False
  keep[1, 9] = False
  cases.assert_bits_equal(out["guided_codes"][keep], clean["guided_codes"][keep],
                          "guided codes outside the poisoned blocks")
  assert not np.any(np.isnan(out["guided_dequant"][keep]))


# ----------------------------------------------------------------------------- shapes

SIZES = {"nvfp4": (lambda x: quant.nvfp4_quantize(x), 24, 16),
         "mxfp4": (lambda x: quant.mxfp4_quantize(x), 48, 32),
         "fp8_act": (lambda x: quant.fp8_quantize_act(x), 64, 128),
         "fp8_weight": (lambda x: quant.fp8_quantize_weight(x), 192, 128),
         "nvfp4_row_scale_jit": (jax.jit(lambda x: quant.nvfp4_quantize(
             x, quant.nvfp4_row_scale(x))), 40, 16),
         "fake_quant_act_jit": (jax.jit(lambda x: quant.fake_quant_act(x, "mxfp4")), 80, 32)}


@pytest.mark.parametrize("fn", list(SIZES))
def test_contraction_size_not_divisible(fn: str) -> None:
  f, k, block = SIZES[fn]
  x = jnp.ones((128, k), jnp.float32)
  with pytest.raises(ValueError, match=rf"contraction size {k}\b.*block size {block}"):
    f(x)


def test_fp8_weight_rows_not_divisible() -> None:
  with pytest.raises(ValueError, match=r"N and K multiples of 128.*\(64, 128\)"):
    quant.fp8_quantize_weight(jnp.ones((64, 128), jnp.float32))
  with pytest.raises(ValueError, match="N and K multiples of 128"):
    quant.fp8_quantize_weight(jnp.ones((128,), jnp.float32))


def test_scalar_input() -> None:
  with pytest.raises(ValueError, match="at least 1 dimension"):
    quant.nvfp4_quantize(jnp.float32(1.0))


def test_pack_odd_length() -> None:
  with pytest.raises(ValueError, match="even"):
    quant.pack_fp4(jnp.zeros((3, 5), jnp.uint8))
  with pytest.raises(ValueError, match="multiple of 8"):
    guided.pack_bits(jnp.zeros((3, 12), jnp.uint8))


# ----------------------------------------------------------------------------- dtypes

BAD_DTYPES = {"int32": np.arange(256, dtype=np.int32).reshape(2, 128),
              "uint8": np.zeros((2, 128), np.uint8),
              "bool": np.zeros((2, 128), bool),
              "float64": np.ones((2, 128), np.float64),
              "complex64": np.ones((2, 128), np.complex64)}
QUANTIZERS = {"nvfp4": quant.nvfp4_quantize, "mxfp4": quant.mxfp4_quantize,
              "fp8_act": quant.fp8_quantize_act, "fp8_weight": quant.fp8_quantize_weight}


@pytest.mark.parametrize("dtype", list(BAD_DTYPES))
@pytest.mark.parametrize("fn", list(QUANTIZERS))
def test_wrong_dtype_raises_type_error(fn: str, dtype: str) -> None:
  """Integer, bool, complex and float64 inputs are rejected with a TypeError naming the dtype
  (float64: pass float32 explicitly; under jit with x64 off JAX itself narrows it)."""
  x = BAD_DTYPES[dtype]
  if fn == "fp8_weight":
    x = np.resize(x, (128, 128))
  with pytest.raises(TypeError, match=dtype):
    QUANTIZERS[fn](x)


def test_non_array_input_raises_type_error() -> None:
  with pytest.raises(TypeError):
    quant.nvfp4_quantize([[1.0] * 16])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_accepted_dtypes(dtype: str) -> None:
  x = jax.ShapeDtypeStruct((4, 128), jnp.dtype(dtype))
  for fn in QUANTIZERS.values():
    jax.eval_shape(fn, x if fn is not quant.fp8_quantize_weight else
                   jax.ShapeDtypeStruct((128, 128), jnp.dtype(dtype)))


# ----------------------------------------------------------------------------- guidance

def _guidance(mode: str, rows: tuple[int, ...] = (4,), k: int = 64) -> guided.Guidance:
  g = guided.Guidance(block_scale=jnp.zeros(rows + (k // 16,), jnp.float8_e4m3fn),
                      row_scale=jnp.ones(rows + (1,), jnp.float32))
  if mode == "compact":
    return g.replace(mantissa=jnp.zeros(rows + (k // 8,), jnp.uint8))
  return g.replace(codes=jnp.zeros(rows + (k // 2,), jnp.uint8))


BAD_GUIDANCE = {
    "block_scale_shape": ("compact", lambda g: g.replace(block_scale=g.block_scale[:, :2]),
                          "block_scale has shape"),
    "block_scale_rows": ("full", lambda g: g.replace(block_scale=g.block_scale[:3]),
                         "block_scale has shape"),
    "row_scale_shape": ("compact", lambda g: g.replace(row_scale=g.row_scale[:, 0]),
                        "row_scale has shape"),
    "mantissa_shape": ("compact", lambda g: g.replace(mantissa=g.mantissa[:, :4]),
                       "mantissa has shape"),
    "codes_shape": ("full", lambda g: g.replace(codes=jnp.zeros((4, 64), jnp.uint8)),
                    "codes has shape"),
    "both_payloads": ("compact", lambda g: g.replace(codes=jnp.zeros((4, 32), jnp.uint8)),
                      "exactly one of mantissa"),
    "no_payload": ("compact", lambda g: g.replace(mantissa=None), "exactly one of mantissa"),
    "block_scale_dtype": ("compact", lambda g: g.replace(block_scale=g.block_scale.astype(
        jnp.float32)), "block_scale has dtype float32"),
    "row_scale_dtype": ("full", lambda g: g.replace(row_scale=g.row_scale.astype(jnp.bfloat16)),
                        "row_scale has dtype bfloat16"),
    "mantissa_dtype": ("compact", lambda g: g.replace(mantissa=g.mantissa.astype(jnp.int32)),
                       "mantissa has dtype int32"),
    "codes_dtype": ("full", lambda g: g.replace(codes=g.codes.astype(jnp.float32)),
                    "codes has dtype float32"),
}
GUIDED_FNS = {"validate": guided.validate, "guided_codes": quant.guided_codes,
              "guided_quantize": quant.guided_quantize,
              "fake_quant_act_guided": quant.fake_quant_act_guided}


@pytest.mark.parametrize("fn", list(GUIDED_FNS))
@pytest.mark.parametrize("case", list(BAD_GUIDANCE))
def test_bad_guidance_raises(case: str, fn: str) -> None:
  mode, mutate, message = BAD_GUIDANCE[case]
  x = jnp.ones((4, 64), jnp.float32)
  g = mutate(_guidance(mode))
  with pytest.raises(ValueError, match=message):
    GUIDED_FNS[fn](x, g)


def test_valid_guidance_passes_validate() -> None:
  for mode in record.MODES:
    guided.validate(jnp.ones((2, 3, 64)), _guidance(mode, rows=(2, 3)))


def test_guidance_for_wrong_contraction_size() -> None:
  with pytest.raises(ValueError, match="contraction size 40"):
    guided.validate(jnp.ones((4, 40)), _guidance("compact"))


# ----------------------------------------------------------------------------- scales, names

BAD_TS = {"rows_mismatch": (3, 1), "per_block": (4, 2), "extra_rank": (1, 4, 1),
          "full_shape": (4, 32)}


@pytest.mark.parametrize("case", list(BAD_TS))
def test_tensor_scale_that_does_not_broadcast(case: str) -> None:
  x = jnp.ones((4, 32), jnp.float32)
  with pytest.raises(ValueError, match="tensor_scale of shape"):
    quant.nvfp4_quantize(x, jnp.ones(BAD_TS[case], jnp.float32))


def test_mxfp4_rejects_tensor_scale() -> None:
  with pytest.raises(ValueError, match="no second-level scale"):
    quant.mxfp4_quantize(jnp.ones((4, 32)), jnp.ones((4, 1)))


UNKNOWN = {
    "fake_quant_act": lambda: quant.fake_quant_act(jnp.ones((2, 128)), "int4"),
    "fake_quant_weight": lambda: quant.fake_quant_weight(jnp.ones((128, 128)), "nf4"),
    "qdq_act": lambda: quant.qdq_act(jnp.ones((2, 128)), "fp16"),
    "qdq_weight": lambda: quant.qdq_weight(jnp.ones((128, 128)), "NVFP4"),
    "bytes_per_row": lambda: quant.bytes_per_row(64, "half"),
    "record": lambda: quant.record(quant.NVFP4Tensor(
        codes=jnp.zeros((4, 64), jnp.uint8), block_scale=jnp.zeros((4, 4), jnp.float8_e4m3fn),
        tensor_scale=jnp.ones((4, 1))), "half"),
    "quantize_act_record_jit": lambda: jax.jit(
        lambda x: quant.quantize_act_record(x, "bogus"))(jnp.ones((2, 64))),
}


@pytest.mark.parametrize("case", list(UNKNOWN))
def test_unknown_format_or_mode(case: str) -> None:
  with pytest.raises(ValueError, match="unknown"):
    UNKNOWN[case]()


def test_record_needs_two_level_scaling() -> None:
  q = quant.NVFP4Tensor(codes=jnp.zeros((4, 64), jnp.uint8),
                        block_scale=jnp.zeros((4, 4), jnp.float8_e4m3fn))
  with pytest.raises(ValueError, match="two-level"):
    quant.record(q, "compact")


def test_qdq_weight_needs_two_dims() -> None:
  with pytest.raises(ValueError, match=r"\[\.\.\., N, K\]"):
    quant.qdq_weight(jnp.ones((128,)), "nvfp4")
