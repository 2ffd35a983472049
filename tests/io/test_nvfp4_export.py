"""NVFP4 (ModelOpt) export: layout, bit-exact decode, agreement with the forward's quantizer."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
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
