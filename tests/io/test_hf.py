"""HF checkpoint interop: logits parity with transformers, bit-exact round trips, clear errors."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from trace_jax import model as M
from trace_jax.io import hf
from trace_jax.io import safetensors_util as st

SEQ = 16


def tiny_hf_config(dtype: str = "float32") -> Qwen3MoeConfig:
  c = M.tiny()
  return Qwen3MoeConfig(
      vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
      num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
      head_dim=c.head_dim, num_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
      moe_intermediate_size=c.moe_intermediate_size, norm_topk_prob=True,
      rope_parameters={"rope_theta": c.rope_theta, "rope_type": "default"},
      max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
      dtype=dtype)


def random_hf_model(seed: int, dtype: torch.dtype = torch.float32) -> Qwen3MoeForCausalLM:
  """A tiny HF model with every weight random (norm weights around 1, router spread out)."""
  torch.manual_seed(seed)
  model = Qwen3MoeForCausalLM(tiny_hf_config()).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      elif "mlp.gate" in name:
        p.copy_(0.5 * torch.randn_like(p))
      else:
        p.copy_(0.08 * torch.randn_like(p))
  return model.to(dtype)


def tokens(batch: int = 2, seed: int = 1) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, M.tiny().vocab_size, (batch, SEQ), np.int32)


def hf_logits(model: Qwen3MoeForCausalLM, toks: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return model(torch.from_numpy(toks.astype(np.int64))).logits.float().numpy()


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def assert_same_tensors(dir_a: str, dir_b: str) -> None:
  """Every tensor of two HF checkpoints (single or sharded) equal bit for bit, same names."""
  def load(d):
    out = {}
    for f in os.listdir(d):
      if f.endswith(".safetensors"):
        out.update(load_file(os.path.join(d, f)))
    return out
  a, b = load(dir_a), load(dir_b)
  assert sorted(a) == sorted(b), set(a) ^ set(b)
  for name in a:
    assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
    ia = a[name].contiguous().view(torch.uint8) if a[name].dim() else a[name].reshape(1)
    ib = b[name].contiguous().view(torch.uint8) if b[name].dim() else b[name].reshape(1)
    assert torch.equal(ia, ib), f"tensor {name} differs"


@pytest.fixture(scope="module")
def hf_f32(tmp_path_factory):
  """(HF model, its save_pretrained dir, our (config, params) loaded from it)."""
  model = random_hf_model(0)
  path = str(tmp_path_factory.mktemp("hf_f32"))
  model.save_pretrained(path)
  return model, path, hf.load_hf_checkpoint(path)


def test_config_read_from_transformers(hf_f32):
  _, _, (config, params) = hf_f32
  want = M.tiny()
  assert config.shape_fields() == want.shape_fields()
  assert config.dtype == "float32" and config.norm_topk_prob and config.rope_theta == 10000.0
  assert config.num_experts_per_tok == want.num_experts_per_tok
  assert all(x.dtype == np.float32 for x in jax.tree.leaves(params))


def test_logits_match_transformers(hf_f32):
  model, _, (config, params) = hf_f32
  toks = tokens()
  ours = np.asarray(M.logits(params, config, toks))
  ref = hf_logits(model, toks)
  err = rel_err(ours, ref)
  print(f"float32 logits relative error vs transformers: {err:.3e}")
  assert ours.shape == ref.shape and ours.dtype == np.float32
  assert err < 1e-5, err


def test_aux_loss_matches_transformers(hf_f32):
  model, _, (config, params) = hf_f32
  toks = tokens()
  with torch.no_grad():
    ref = model(torch.from_numpy(toks.astype(np.int64)), output_router_logits=True).aux_loss
  out = jax.jit(M.forward, static_argnames="config")(params, config, toks)
  ours = float(M.aux_loss(out, config))
  np.testing.assert_allclose(ours, float(ref), rtol=1e-5)


@pytest.mark.parametrize("shard", [pytest.param(None, id="single_file"),
                                   pytest.param(40_000, id="sharded")])
def test_round_trip_bit_exact_and_reloads_in_transformers(hf_f32, tmp_path, shard):
  model, src, (config, params) = hf_f32
  dst = str(tmp_path / "export")
  files = hf.save_hf_checkpoint(dst, config, params, max_shard_bytes=shard)
  assert (st.INDEX_FILE in files) == (shard is not None)
  assert_same_tensors(src, dst)
  with open(os.path.join(dst, "config.json")) as f:
    cfg = json.load(f)
  for key in ("num_experts", "num_local_experts", "rope_theta", "rope_parameters", "head_dim",
              "norm_topk_prob", "dtype", "torch_dtype"):
    assert key in cfg, key
  assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["model_type"] == "qwen3_moe"
  reloaded = Qwen3MoeForCausalLM.from_pretrained(dst).eval()
  toks = tokens()
  np.testing.assert_array_equal(hf_logits(reloaded, toks), hf_logits(model, toks))


def test_bf16_sharded_round_trip(tmp_path):
  model = random_hf_model(3, torch.bfloat16)
  src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
  model.save_pretrained(src, max_shard_size="100KB")
  assert os.path.exists(os.path.join(src, st.INDEX_FILE))
  config, params = hf.load_hf_checkpoint(src)
  assert config.dtype == "bfloat16"
  assert {str(x.dtype) for x in jax.tree.leaves(params)} == {"bfloat16"}
  hf.save_hf_checkpoint(dst, config, params, max_shard_bytes=100_000)
  assert_same_tensors(src, dst)


def _rewrite(src: str, dst: str, edit) -> None:
  """Copies an HF checkpoint with `edit(tensors)` applied to its (single-file) tensors."""
  os.makedirs(dst)
  tensors = load_file(os.path.join(src, st.SINGLE_FILE))
  edit(tensors)
  save_file(tensors, os.path.join(dst, st.SINGLE_FILE), metadata={"format": "pt"})
  with open(os.path.join(src, "config.json")) as f:
    cfg = f.read()
  with open(os.path.join(dst, "config.json"), "w") as f:
    f.write(cfg)


_EXPERT = "model.layers.1.mlp.experts.3.down_proj.weight"


@pytest.mark.parametrize("edit,pattern", [
    pytest.param(lambda t: t.pop(_EXPERT), f"missing tensor {_EXPERT}", id="missing_tensor"),
    pytest.param(lambda t: t.update({_EXPERT: t[_EXPERT][:, :32].contiguous()}),
                 rf"tensor {_EXPERT} has shape \[128, 32\]", id="misshapen_tensor"),
    pytest.param(lambda t: t.update({"model.layers.9.mlp.gate.weight": t["lm_head.weight"] * 1}),
                 "unexpected tensors", id="unexpected_tensor"),
])
def test_load_errors(hf_f32, tmp_path, edit, pattern):
  dst = str(tmp_path / "bad")
  _rewrite(hf_f32[1], dst, edit)
  with pytest.raises(hf.CheckpointError, match=pattern):
    hf.load_hf_checkpoint(dst)


def test_config_mismatch_error(hf_f32, tmp_path):
  dst = str(tmp_path / "bad")
  _rewrite(hf_f32[1], dst, lambda t: None)
  with open(os.path.join(dst, "config.json")) as f:
    cfg = json.load(f)
  cfg["moe_intermediate_size"] = 96
  with open(os.path.join(dst, "config.json"), "w") as f:
    json.dump(cfg, f)
  with pytest.raises(hf.CheckpointError, match=r"config.json implies \[96, 128\]"):
    hf.load_hf_checkpoint(dst)


def test_save_rejects_params_of_another_config(hf_f32, tmp_path):
  _, _, (config, params) = hf_f32
  with pytest.raises(hf.CheckpointError, match="shape"):
    hf.save_hf_checkpoint(str(tmp_path / "x"), config.replace(moe_intermediate_size=96), params)
