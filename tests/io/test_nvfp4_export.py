"""NVFP4 (ModelOpt) export: layout, bit-exact decode, agreement with the forward's quantizer."""

from __future__ import annotations

import glob
import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import load_file

from trace_jax import model as M
from trace_jax.io import hf
from trace_jax.quant import formats, qat


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  config = M.tiny(dtype="bfloat16", num_hidden_layers=1)
  params = M.init_params(config, 0, param_dtype="float32")
  path = str(tmp_path_factory.mktemp("nvfp4"))
  hf.save_nvfp4_checkpoint(path, config, params)
  return config, params, path


def test_layout(exported):
  config, _, path = exported
  with open(os.path.join(path, "hf_quant_config.json")) as f:
    q = json.load(f)["quantization"]
  assert q["quant_algo"] == "NVFP4" and q["group_size"] == 16
  with open(os.path.join(path, "config.json")) as f:
    qc = json.load(f)["quantization_config"]
  assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "NVFP4"
  raw = {}
  from safetensors import safe_open  # uint8/fp8 headers without numpy conversions
  with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
    for k in f.keys():
      raw[k] = f.get_slice(k)
  p = "model.layers.0.mlp.experts.5."
  f_, d = config.moe_intermediate_size, config.hidden_size
  want = {p + "gate_proj.weight": ("U8", [f_, d // 2]),
          p + "gate_proj.weight_scale": ("F8_E4M3", [f_, d // 16]),
          p + "gate_proj.weight_scale_2": ("F32", []),
          p + "gate_proj.input_scale": ("F32", []),
          p + "down_proj.weight": ("U8", [d, f_ // 2]),
          p + "down_proj.weight_scale": ("F8_E4M3", [d, f_ // 16]),
          "model.layers.0.self_attn.q_proj.weight": ("BF16", [128, 128]),
          "model.layers.0.mlp.gate.weight": ("BF16", [8, 128]),
          "lm_head.weight": ("BF16", [256, 128])}
  for name, (dt, shape) in want.items():
    assert raw[name].get_dtype() == dt and raw[name].get_shape() == shape, name


def test_decodes_bit_exactly_and_matches_forward_quantizer(exported):
  config, params, path = exported
  cfg2, loaded, quantized = hf.load_nvfp4_checkpoint(path)
  assert cfg2.shape_fields() == config.shape_fields()
  moe = params["layers"][0]["moe"]
  gate, up, down = (moe[k].get_value().astype(jnp.bfloat16)
                    for k in ("gate_proj", "up_proj", "down_proj"))
  # Export == quantization of the stacked weights, gate and up under one scale per expert.
  tensor_scale = jax.jit(formats.nvfp4_tensor_scale, static_argnames="axes")
  ts = tensor_scale(jnp.concatenate([gate, up], axis=1), axes=(1, 2))
  for proj, w, t in (("gate_proj", gate, ts), ("up_proj", up, ts),
                     ("down_proj", down, tensor_scale(down, axes=(1, 2)))):
    want = jax.jit(formats.nvfp4_quantize)(w, t)
    got = quantized[("layers", 0, "moe", proj)]
    np.testing.assert_array_equal(got.codes, want.codes)
    np.testing.assert_array_equal(np.asarray(got.block_scale).view(np.uint8),
                                  np.asarray(want.block_scale).view(np.uint8))
    np.testing.assert_array_equal(got.tensor_scale, want.tensor_scale)
    deq = loaded["layers"][0]["moe"][proj].get_value()
    np.testing.assert_array_equal(deq, jax.jit(formats.nvfp4_dequantize)(want))
  # ... and equal to what the forward's fake quantizer uses (concatenated gate|up, down).
  fq = jax.jit(qat.fake_quant_weight, static_argnums=1)(jnp.concatenate([gate, up], axis=1),
                                                       "nvfp4")
  np.testing.assert_array_equal(
      fq[:, :config.moe_intermediate_size],
      loaded["layers"][0]["moe"]["gate_proj"].get_value().astype(jnp.bfloat16))
  # Non-expert tensors are BF16 copies.
  np.testing.assert_array_equal(
      loaded["lm_head"]["kernel"].get_value(),
      params["lm_head"]["kernel"].get_value().astype(jnp.bfloat16))
  # Packing: element 2i in the low nibble (SGLang / ModelOpt convention).
  raw = load_file(os.path.join(path, "model.safetensors"))
  byte = raw["model.layers.0.mlp.experts.0.down_proj.weight"][0, 0]
  codes = quantized[("layers", 0, "moe", "down_proj")].codes[0, 0, :2]
  assert int(byte) == int(codes[0]) | (int(codes[1]) << 4)
  scale2 = raw["model.layers.0.mlp.experts.0.down_proj.weight_scale_2"]
  assert scale2.shape == () and scale2.dtype == torch.float32
  assert float(scale2) == float(quantized[("layers", 0, "moe", "down_proj")].tensor_scale[0, 0, 0])
  assert raw["model.layers.0.mlp.experts.0.down_proj.weight_scale"].dtype == torch.float8_e4m3fn


def test_reader_rejects_missing_scale(exported, tmp_path):
  from trace_jax.io import safetensors_util as st
  _, _, path = exported
  reader = st.CheckpointReader(path)
  drop = "model.layers.0.mlp.experts.2.up_proj.weight_scale"
  tensors = [(n, i.dtype, i.shape, lambda n=n: reader.get(n))
             for n, i in reader.infos.items() if n != drop]
  st.write_checkpoint(str(tmp_path), tensors)
  for f in ("config.json", "hf_quant_config.json"):
    with open(os.path.join(path, f)) as src, open(os.path.join(tmp_path, f), "w") as dst:
      dst.write(src.read())
  with pytest.raises(hf.CheckpointError, match=f"missing tensor {drop}"):
    hf.load_nvfp4_checkpoint(str(tmp_path))
  with pytest.raises(hf.CheckpointError, match="quantized checkpoint"):
    hf.load_hf_checkpoint(path)


# ----------------------------------------------------------------------------- reference bytes

F32 = np.float32


def _safetensors_raw(path: str) -> dict[str, tuple[str, list[int], bytes]]:
  """{name: (dtype, shape, raw bytes)} of every tensor in the checkpoint's safetensors files,
  parsed from the file format itself (8-byte header length, JSON header, data)."""
  out = {}
  for fn in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
    with open(fn, "rb") as f:
      header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
      data = f.read()
    for name, info in header.items():
      if name != "__metadata__":
        lo, hi = info["data_offsets"]
        out[name] = (info["dtype"], info["shape"], data[lo:hi])
  return out


def reference_nvfp4(w: np.ndarray, ts: np.float32) -> tuple[np.ndarray, np.ndarray]:
  """ModelOpt's NVFP4 weight quantization of one matrix w [N, K] (float32 values of the
  compute-dtype weight) under its second-level scale ts, in numpy IEEE float32 and ml_dtypes:
  block scale `(amax / 6) / ts` rounded to E4M3 (RNE), y = x * ((1 / ts) / scale), E2M1 code
  by RNE with the sign kept (-0 and negative values that round to zero: code 8, as torchao,
  ml_dtypes and the hardware convert write them), two codes per byte, element 2i in the low
  nibble. Returns (packed uint8 [N, K/2], E4M3 scale bytes [N, K/16]).

  Where our documented numerics (docs/numerics.md) pick one of ModelOpt's variants: the block
  scale is clamped to [2**-6, 448] (ModelOpt keeps E4M3 subnormal scales and writes 1.0 for
  all-zero blocks; no block here reaches either), and elements are multiplied by the IEEE
  quotient (1 / ts) / scale (ModelOpt's torch fallback divides by scale * ts, which rounds
  ~0.02% of the elements of this checkpoint to the other neighbour). ModelOpt's torch fallback
  `_cast_fp4` takes the sign from `x < 0`, so for an input that is exactly -0 it writes 0.
  """
  n, k = w.shape
  xb = w.astype(F32).reshape(n, k // 16, 16)
  amax = np.abs(xb).max(-1)
  bs = np.clip((amax / F32(6)) / ts, F32(2.0**-6), F32(448)).astype(ml_dtypes.float8_e4m3fn)
  inv = (F32(1) / ts) / bs.astype(F32)
  y = np.clip(xb * inv[..., None], F32(-6), F32(6)).reshape(n, k)
  codes = y.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
  packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
  return packed, bs.view(np.uint8)


@pytest.fixture(scope="module")
def exported_with_zeros(tmp_path_factory):
  """A small NVFP4 export whose expert weights also hold -0, +0 and negative subnormals."""
  config = M.tiny(dtype="bfloat16", num_hidden_layers=1)
  pure = nnx.to_pure_dict(M.init_params(config, 0, param_dtype="float32"))
  moe = pure["layers"][0]["moe"]
  rng = np.random.default_rng(3)
  for proj in ("gate_proj", "up_proj", "down_proj"):
    w = np.array(moe[proj], np.float32)
    planted = rng.random(w.shape)
    w[planted < 0.01] = -0.0
    w[(planted >= 0.01) & (planted < 0.02)] = 0.0
    w[(planted >= 0.02) & (planted < 0.025)] = -1e-40
    moe[proj] = jnp.asarray(w)
  path = str(tmp_path_factory.mktemp("nvfp4_zeros"))
  hf.save_nvfp4_checkpoint(path, config, pure)
  return config, pure, path


def test_export_bytes_equal_reference_quantization(exported_with_zeros):
  """Every expert's `weight`, `weight_scale` and `weight_scale_2` bytes equal the independent
  ModelOpt-algorithm reference above, applied to the compute-dtype (bf16) weights with gate and
  up under one second-level scale per expert: negative values that round to zero and -0 are
  code 8 (the old code-0 behaviour differed in 366 of the first matrix's 4096 bytes)."""
  config, pure, path = exported_with_zeros
  raw = _safetensors_raw(path)
  moe = pure["layers"][0]["moe"]
  w = {p: np.asarray(moe[p], np.float32).astype(ml_dtypes.bfloat16).astype(F32)
       for p in ("gate_proj", "up_proj", "down_proj")}
  checked, eights, zeros = 0, 0, 0
  for e in range(config.num_experts):
    ts_gu = F32(max(np.abs(w["gate_proj"][e]).max(), np.abs(w["up_proj"][e]).max())) / F32(2688)
    ts_d = F32(np.abs(w["down_proj"][e]).max()) / F32(2688)
    for proj, ts in (("gate_proj", ts_gu), ("up_proj", ts_gu), ("down_proj", ts_d)):
      base = f"model.layers.0.mlp.experts.{e}.{proj}."
      packed, scale = reference_nvfp4(w[proj][e], ts)
      n, k = w[proj][e].shape
      assert raw[base + "weight"][:2] == ("U8", [n, k // 2])
      assert raw[base + "weight_scale"][:2] == ("F8_E4M3", [n, k // 16])
      assert raw[base + "weight_scale_2"][:2] == ("F32", [])
      got = np.frombuffer(raw[base + "weight"][2], np.uint8).reshape(n, k // 2)
      diff = got != packed
      assert not diff.any(), (
          f"{base}weight: {int(diff.sum())} of {diff.size} bytes differ from the reference, "
          f"first at {np.argwhere(diff)[0].tolist()}: got {got[diff][0]:#04x}, want "
          f"{packed[diff][0]:#04x}")
      np.testing.assert_array_equal(
          np.frombuffer(raw[base + "weight_scale"][2], np.uint8).reshape(n, k // 16), scale,
          err_msg=base + "weight_scale")
      assert raw[base + "weight_scale_2"][2] == ts.tobytes(), base + "weight_scale_2"
      assert raw[base + "input_scale"][2] == F32(1).tobytes()
      nibbles = np.stack([got & 0xF, got >> 4], -1)
      eights += int((nibbles == 8).sum())
      zeros += int((nibbles == 0).sum())
      checked += got.size * 2
  assert eights > 0.02 * checked and zeros > 0.02 * checked, (eights, zeros, checked)
