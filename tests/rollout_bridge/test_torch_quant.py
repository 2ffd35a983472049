"""JAX quantizers (jitted, default backend) against the torch twin, bit for bit.

The torch device is env TRACE_TORCH_DEVICE (default "cpu"); the same tests run on the H200
with torch on CUDA and JAX on the GPU. Data: `cases.stacked()`, i.e. 2**20 random elements of
magnitudes 2**-20..2**20 (varying per row, per block and within blocks) plus every adversarial
case of `tests/quant/cases.py`, in float32 and bfloat16.
"""

from __future__ import annotations

import functools

import cases
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
tq = pytest.importorskip("rollout_bridge.torch_quant")

import trace_jax.quant as quant  # noqa: E402
from trace_jax.quant import formats  # noqa: E402

F32 = cases.F32


def _to_torch(x: np.ndarray, dtype: str, device) -> torch.Tensor:
  """torch tensor holding exactly the values `cases.jnp_input(x, dtype)` holds."""
  t = torch.from_numpy(np.array(cases.input_as_f32(x, dtype), copy=True)).to(device)
  return t.to(torch.bfloat16) if dtype == "bfloat16" else t


def _nvfp4_fields(q) -> dict:
  out = {"codes": q.codes, "block_scale": q.block_scale, "dequant": tq.nvfp4_dequantize(q)}
  if q.tensor_scale is not None:
    out["tensor_scale"] = q.tensor_scale
  return out


def _mxfp4_fields(q) -> dict:
  return {"codes": q.codes, "block_scale": q.block_scale, "dequant": tq.mxfp4_dequantize(q)}


def _fp8_fields(q) -> dict:
  return {"values": q.values, "scale": q.scale, "dequant": tq.fp8_dequantize(q)}


def _experts(x: torch.Tensor) -> torch.Tensor:
  return x.reshape(x.shape[0], cases.EXPERTS, x.shape[1] // cases.EXPERTS, x.shape[2])


# The torch twin of cases.FORMATS, on chunked input [C, ROWS, K] (scales per chunk where the
# JAX op is vmapped over chunks).
TORCH_FORMATS = {
    "nvfp4": lambda x, **kw: _nvfp4_fields(tq.nvfp4_quantize(x, **kw)),
    "nvfp4_row": lambda x, **kw: _nvfp4_fields(tq.nvfp4_quantize(x, tq.nvfp4_row_scale(x), **kw)),
    "nvfp4_tensor": lambda x, **kw: _nvfp4_fields(
        tq.nvfp4_quantize(x, tq.nvfp4_tensor_scale(x, dims=(1, 2)), **kw)),
    "nvfp4_expert": lambda x, **kw: _nvfp4_fields(
        tq.nvfp4_quantize(_experts(x), tq.nvfp4_tensor_scale(_experts(x), dims=(2, 3)), **kw)),
    "mxfp4": lambda x, **kw: _mxfp4_fields(tq.mxfp4_quantize(x, **kw)),
    "fp8_act": lambda x, **kw: _fp8_fields(tq.fp8_quantize_act(x, **kw)),
    "fp8_weight": lambda x, **kw: _fp8_fields(tq.fp8_quantize_weight(x, **kw)),
}
assert set(TORCH_FORMATS) == set(cases.FORMATS)


@functools.cache
def torch_results(fmt: str, dtype: str, device: str) -> dict[str, np.ndarray]:
  arr, _ = cases.stacked()
  out = TORCH_FORMATS[fmt](_to_torch(arr, dtype, device))
  return {k: cases.to_numpy(v) for k, v in out.items()}


def _torch_guided(x_r: torch.Tensor, x_t: torch.Tensor, mode: str) -> dict:
  q = tq.nvfp4_quantize(x_r, tq.nvfp4_row_scale(x_r))
  rec = tq.guidance_record(q, mode)
  codes = tq.guided_codes(x_t, rec)
  deq = tq.nvfp4_dequantize(tq.NVFP4Tensor(codes=codes, block_scale=rec["block_scale"],
                                           tensor_scale=rec["row_scale"]))
  return {"rollout_codes": q.codes, "guided_codes": codes, "guided_dequant": deq} | rec


@functools.cache
def torch_guided_results(mode: str, dtype: str, device: str) -> dict[str, np.ndarray]:
  arr, _ = cases.stacked()
  out = _torch_guided(_to_torch(arr, dtype, device), _to_torch(cases.stacked_train(), dtype,
                                                               device), mode)
  return {k: cases.to_numpy(v) for k, v in out.items()}


def _shown(fmt: str, x: np.ndarray) -> np.ndarray:
  if fmt == "nvfp4_expert":
    return x.reshape(x.shape[0], cases.EXPERTS, -1, x.shape[-1])
  return x


# ----------------------------------------------------------------------------- parity

@pytest.mark.parametrize("dtype", cases.DTYPES)
@pytest.mark.parametrize("data", cases.DATA)
@pytest.mark.parametrize("fmt", list(cases.FORMATS))
def test_parity(fmt: str, data: str, dtype: str, torch_device) -> None:
  """Codes, block scales (uint8 views), row/tensor scales and dequantized values (bit
  patterns) of JAX and torch agree exactly."""
  arr, index = cases.stacked()
  sl = index[data]
  want = {k: v[sl] for k, v in torch_results(fmt, dtype, str(torch_device)).items()}
  got = {k: v[sl] for k, v in cases.jax_results(fmt, dtype).items()}
  assert set(got) == set(want), (sorted(got), sorted(want))
  x = _shown(fmt, cases.input_as_f32(arr[sl], dtype))
  cases.assert_fields_equal(got, want, f"jax vs torch {fmt} on {data} ({dtype})", x,
                            cases.FORMATS[fmt][1])


@pytest.mark.parametrize("dtype", cases.DTYPES)
@pytest.mark.parametrize("data", cases.DATA)
@pytest.mark.parametrize("mode", ["compact", "full"])
def test_guided_parity(mode: str, data: str, dtype: str, torch_device) -> None:
  """Rollout codes, the guidance record (block scales, row scales, packed mantissa bits or
  codes) and the guided codes of a drifted training input agree exactly."""
  arr, index = cases.stacked()
  sl = index[data]
  want = {k: v[sl] for k, v in torch_guided_results(mode, dtype, str(torch_device)).items()}
  got = {k: v[sl] for k, v in cases.jax_guided_results(mode, dtype).items()
         if k != "guided_block_scale"}
  assert set(got) == set(want), (sorted(got), sorted(want))
  what = f"jax vs torch guided {mode} on {data} ({dtype})"
  trained = {k for k in got if k.startswith("guided")}
  x_r = cases.input_as_f32(arr[sl], dtype)
  x_t = cases.input_as_f32(cases.stacked_train()[sl], dtype)
  cases.assert_fields_equal({k: got[k] for k in set(got) - trained},
                            {k: want[k] for k in set(got) - trained}, f"{what}, rollout", x_r)
  cases.assert_fields_equal({k: got[k] for k in trained}, {k: want[k] for k in trained},
                            f"{what}, training", x_t)


@pytest.mark.parametrize("dtype", cases.DTYPES)
@pytest.mark.parametrize("fmt", ["nvfp4", "nvfp4_row", "nvfp4_expert", "mxfp4"])
def test_torch_codes_keep_sign_of_zero(fmt: str, dtype: str, torch_device) -> None:
  """The twin's E2M1 codes keep the sign of zero (docs/numerics.md): where the magnitude rounds
  to zero the code is 8 exactly where the input is negative, -0 or a negative subnormal, as
  ModelOpt, torchao and ml_dtypes write it (the parity tests then hold JAX to the same bytes)."""
  arr, index = cases.stacked()
  x = cases.input_as_f32(arr, dtype)
  x = np.where(np.abs(x) < 2.0**-126, np.copysign(F32(0), x), x)
  if fmt == "nvfp4_expert":
    x = x.reshape(x.shape[0], cases.EXPERTS, -1, x.shape[-1])
  codes = torch_results(fmt, dtype, str(torch_device))["codes"]
  zero = (codes & 7) == 0
  cases.assert_bits_equal(codes[zero], np.where(np.signbit(x[zero]), 8, 0).astype(np.uint8),
                          f"torch {fmt} ({dtype}): sign of zero", {"x": x[zero]})
  assert np.sum(codes[index["negative_zero"]] == 8) > 5_000


def test_guided_no_drift_keeps_sign_of_zero(torch_device) -> None:
  """Torch guided rounding without drift equals the rollout codes bit for bit, negative zeros
  (code 8) included (JAX: tests/quant/test_guided.py; the twins agree: test_guided_parity)."""
  arr, index = cases.stacked()
  x = arr[index["negative_zero"]][0]
  t = torch.from_numpy(np.array(x)).to(torch_device)
  q = tq.nvfp4_quantize(t, tq.nvfp4_row_scale(t))
  assert int((q.codes == 8).sum()) > 5_000
  for mode in ("compact", "full"):
    rec = tq.guidance_record(q, mode)
    got = tq.guided_codes(t, rec)
    cases.assert_bits_equal(got, q.codes, f"torch guided {mode} without drift", {"x": x})


def test_values_equal_helper_on_torch(torch_device) -> None:
  """`e2m1_values_equal` (twin and JAX helper) treats codes 0 and 8 as one value, on tensors."""
  a = torch.tensor([0, 8, 8, 1, 9, 7], dtype=torch.uint8, device=torch_device)
  b = torch.tensor([8, 0, 8, 9, 1, 7], dtype=torch.uint8, device=torch_device)
  want = [True, True, True, False, False, True]
  assert tq.e2m1_values_equal(a, b).cpu().tolist() == want
  assert formats.e2m1_values_equal(a, b).cpu().tolist() == want


def test_parity_covers_a_million_random_elements() -> None:
  arr, index = cases.stacked()
  rnd = arr[index["random_1M"]]
  assert rnd.size >= 10**6
  mags = np.log2(np.abs(rnd[rnd != 0]))
  assert mags.min() < -19.5 and mags.max() > 19.5
  per_block = np.log2(np.abs(rnd).reshape(-1, 16).max(-1) + 1e-30)
  assert per_block.std() > 5  # magnitudes vary per block ...
  spread = np.ptp(np.log2(np.abs(rnd.reshape(-1, 16)) + 2.0**-40), axis=-1)
  assert np.median(spread) > 3  # ... and within blocks


# ----------------------------------------------------------------------------- elements

def test_e2m1_encode_every_bf16_pattern(torch_device) -> None:
  """All 65536 bf16 bit patterns (NaN included: code 0) encode identically."""
  bits = np.arange(1 << 16, dtype=np.uint16)
  got = np.asarray(jax.jit(quant.e2m1_encode)(jnp.asarray(bits.view(cases.BF16))))
  t = torch.from_numpy(bits.view(np.int16)).to(torch_device).view(torch.bfloat16)
  want = cases.to_numpy(tq.e2m1_encode(t))
  cases.assert_bits_equal(got, want, "e2m1_encode bf16", {"x": bits.view(cases.BF16)})


def test_e2m1_decode_pack_unpack(torch_device) -> None:
  codes = np.random.default_rng(0).integers(0, 16, (3, 64), dtype=np.uint8)
  tc = torch.from_numpy(codes).to(torch_device)
  cases.assert_bits_equal(jax.jit(quant.e2m1_decode)(codes), tq.e2m1_decode(tc), "decode")
  packed = jax.jit(quant.pack_fp4)(codes)
  cases.assert_bits_equal(packed, tq.pack_fp4(tc), "pack_fp4")
  cases.assert_bits_equal(tq.unpack_fp4(tq.pack_fp4(tc)), codes, "torch unpack(pack)")
  bits = (codes & 1).astype(np.uint8)
  from trace_jax.quant import guided

  cases.assert_bits_equal(jax.jit(guided.pack_bits)(bits), tq.pack_bits(
      torch.from_numpy(bits).to(torch_device)), "pack_bits")
  cases.assert_bits_equal(tq.unpack_bits(tq.pack_bits(torch.from_numpy(bits).to(torch_device))),
                          bits, "torch unpack_bits(pack_bits)")


# ----------------------------------------------------------------------------- non-finite

@pytest.mark.parametrize("fmt", list(cases.FORMATS))
def test_nonfinite_parity(fmt: str, torch_device) -> None:
  """NaN/Inf input: JAX under jit and torch with allow_nonfinite=True poison the same blocks
  (row / tensor / expert under two-level scaling) with the same bits."""
  arr, _ = cases.stacked()
  arr = arr.copy()
  arr[0, 3, 40] = np.nan
  arr[0, 7, 200] = np.inf
  arr[2, 64, 0] = -np.inf
  arr[5, 10, 10] = np.nan  # a chunk (tensor) whose only non-finite value is a NaN
  got = {k: cases.to_numpy(v) for k, v in cases.jax_op(fmt)(jnp.asarray(arr)).items()}
  want = TORCH_FORMATS[fmt](torch.from_numpy(arr).to(torch_device), allow_nonfinite=True)
  for field in ("tensor_scale", "scale", "block_scale", "codes", "values", "dequant"):
    if field in want:
      cases.assert_bits_equal(got[field], want[field], f"non-finite {fmt}: {field}")


def test_torch_eager_nonfinite_raises(torch_device) -> None:
  x = torch.ones(128, 256, device=torch_device)
  x[1, 2] = float("nan")
  for fn in TORCH_FORMATS.values():
    with pytest.raises(ValueError, match="non-finite"):
      fn(x.reshape(1, 128, 256))


def test_torch_bad_dtype_and_size(torch_device) -> None:
  with pytest.raises(TypeError):
    tq.nvfp4_quantize(torch.ones(4, 32, dtype=torch.float64, device=torch_device))
  with pytest.raises(TypeError):
    tq.mxfp4_quantize(torch.ones(4, 32, dtype=torch.int32, device=torch_device))
  with pytest.raises(ValueError, match="contraction size 24"):
    tq.nvfp4_quantize(torch.ones(4, 24, device=torch_device))
  with pytest.raises(ValueError, match="unknown guidance mode"):
    q = tq.nvfp4_quantize(torch.ones(4, 32, device=torch_device),
                          torch.ones(4, 1, device=torch_device))
    tq.guidance_record(q, "half")


# ----------------------------------------------------------------------------- API

def test_torch_public_api(torch_device) -> None:
  """docs/design.md §10: the same four functions on torch tensors: fields, dtypes, shapes."""
  x = torch.from_numpy(cases.random_mixed(6, 64, seed=2)).to(torch_device).reshape(2, 3, 64)
  q = tq.nvfp4_quantize(x)
  assert q.codes.dtype == torch.uint8 and tuple(q.codes.shape) == (2, 3, 64)
  assert q.block_scale.dtype == torch.float8_e4m3fn and tuple(q.block_scale.shape) == (2, 3, 4)
  assert q.tensor_scale is None and tq.nvfp4_dequantize(q).dtype == torch.float32
  q2 = tq.nvfp4_quantize(x, tq.nvfp4_row_scale(x))
  assert q2.tensor_scale.dtype == torch.float32 and tuple(q2.tensor_scale.shape) == (2, 3, 1)
  m = tq.mxfp4_quantize(x)
  assert m.block_scale.dtype == torch.float8_e8m0fnu and tuple(m.block_scale.shape) == (2, 3, 2)
  assert m.tensor_scale is None and tq.mxfp4_dequantize(m).dtype == torch.float32
  assert q.codes.device == x.device and m.block_scale.device == x.device
