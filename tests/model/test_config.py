"""ModelConfig: validation messages, HF config.json spellings, presets."""

from __future__ import annotations

import dataclasses

import pytest

from tests.config_files import CONFIG_FILES, parsed
from trace_jax.model import config as cfg
from trace_jax.model.policies import FORWARDS


def test_presets():
  t = cfg.tiny()
  assert t.guided_layers == (1,) and t.dtype == "float32"
  q = cfg.qwen3_30b_a3b()
  assert (q.hidden_size, q.num_hidden_layers, q.num_attention_heads, q.num_key_value_heads,
          q.head_dim, q.num_experts, q.num_experts_per_tok, q.moe_intermediate_size,
          q.vocab_size) == (2048, 48, 32, 4, 128, 128, 8, 768, 151936)
  assert q.guided_layers == tuple(range(24, 48)) and q.norm_topk_prob
  hash(q)  # static jit argument
  assert dataclasses.replace(q, dtype="float32").dtype == "float32"
  for policy in FORWARDS:
    cfg.qwen3_30b_a3b(policy=policy)  # the real shape is valid in every policy


@pytest.mark.parametrize("overrides,pattern", [
    pytest.param({"num_key_value_heads": 3}, "divisible by num_key_value_heads", id="gqa"),
    pytest.param({"policy": "fp4"}, "unknown precision policy 'fp4'", id="policy"),
    pytest.param({"policy": "fp4_rtn", "moe_intermediate_size": 40},
                 "moe_intermediate_size = 40", id="nvfp4_block"),
    pytest.param({"policy": "mxfp4_trace", "head_dim": 48}, "MXFP4 blocks of 32, but head_dim "
                 "= 48", id="mxfp4_block"),
    pytest.param({"policy": "fp8_unified"}, "FP8 blocks of 128", id="fp8_block"),
    pytest.param({"num_experts_per_tok": 9}, "exceeds num_experts", id="topk"),
    pytest.param({"guided_layers": (5,)}, r"guided_layers \[5\] outside", id="guided_layers"),
    pytest.param({"dtype": "float16"}, "dtype must be one of", id="dtype"),
    pytest.param({"guidance_mode": "bits"}, "guidance_mode", id="guidance_mode"),
    pytest.param({"tie_word_embeddings": True}, "untied lm_head", id="tied"),
    pytest.param({"hidden_size": 0}, "hidden_size must be a positive int", id="positive"),
    pytest.param({"moe_impl": "kernel", "moe_intermediate_size": 40},
                 'moe_impl="kernel" needs', id="kernel_multiple_of_16"),
    pytest.param({"moe_impl": "pallas"}, "moe_impl must be one of", id="moe_impl"),
    pytest.param({"decode_moe_kernel": "cuda"}, "decode_moe_kernel must be one of",
                 id="decode_moe_kernel"),
])
def test_validation_errors(overrides, pattern):
  with pytest.raises(ValueError, match=pattern):
    cfg.tiny(**overrides)


def test_fp8_unified_valid_with_128_multiples():
  cfg.tiny(policy="fp8_unified", moe_intermediate_size=128, head_dim=64)


def test_hf_dict_round_trip_and_both_spellings():
  q = cfg.qwen3_30b_a3b()
  d = q.to_hf_dict()
  assert d["num_experts"] == d["num_local_experts"] == 128
  assert d["rope_theta"] == d["rope_parameters"]["rope_theta"] == 1e6
  assert d["dtype"] == d["torch_dtype"] == "bfloat16"
  assert d["head_dim"] == 128 and d["norm_topk_prob"] is True
  assert cfg.ModelConfig.from_hf_dict(d) == q
  v4 = {k: v for k, v in d.items() if k not in ("num_local_experts", "rope_parameters", "dtype")}
  v5 = {k: v for k, v in d.items() if k not in ("num_experts", "rope_theta", "torch_dtype")}
  assert cfg.ModelConfig.from_hf_dict(v4) == q == cfg.ModelConfig.from_hf_dict(v5)
  assert cfg.ModelConfig.from_hf_dict(d, policy="fp4_trace").policy == "fp4_trace"


@pytest.mark.parametrize("edit,pattern", [
    pytest.param({"model_type": "llama"}, "model_type", id="model_type"),
    pytest.param({"mlp_only_layers": [0]}, "mlp_only_layers", id="dense_layers"),
    pytest.param({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}}, "rope_type",
                 id="rope_type"),
    pytest.param({"num_experts": None, "num_local_experts": None}, "positive int",
                 id="no_experts"),
])
def test_hf_dict_errors(edit, pattern):
  d = cfg.tiny().to_hf_dict()
  d.update(edit)
  with pytest.raises(ValueError, match=pattern):
    cfg.ModelConfig.from_hf_dict(d)


def test_hf_dict_missing_key():
  d = cfg.tiny().to_hf_dict()
  del d["hidden_size"]
  with pytest.raises(ValueError, match="missing required keys"):
    cfg.ModelConfig.from_hf_dict(d)


# ----------------------------------------------------------------------------- config files

@pytest.mark.filterwarnings("ignore:the load_module:DeprecationWarning")  # ml_collections' loader
@pytest.mark.parametrize("name", CONFIG_FILES)
def test_every_config_file_exposes_every_model_field(name):
  """Any ModelConfig field, the kernel plan's included, is settable from the command line of
  any config file; the section resolves (`config.resolve`) as the file means it."""
  fields = {f.name for f in dataclasses.fields(cfg.ModelConfig)}
  plain = parsed(name)
  assert fields <= set(plain.model), sorted(fields - set(plain.model))
  base = cfg.resolve(plain.model)
  c = parsed(name, "--config.model.decode_impl=kernel", "--config.model.plan=reference",
              "--config.model.kv_cache=dense", "--config.model.guided_layers=(0,)",
              "--config.model.scan_unroll=2")
  got = cfg.resolve(c.model)
  assert (got.decode_impl, got.plan, got.kv_cache, got.guided_layers, got.scan_unroll) == (
      "kernel", "reference", "dense", (0,), 2)
  assert dataclasses.replace(got, decode_impl=base.decode_impl, plan=base.plan,
                             kv_cache=base.kv_cache, guided_layers=base.guided_layers,
                             scan_unroll=base.scan_unroll) == base
  with pytest.raises(ValueError, match="decode_impl must be one of"):
    cfg.resolve(parsed(name, "--config.model.decode_impl=cuda").model)


def test_section_is_the_preset_with_the_files_choices():
  """`section` holds every field at the preset's value but for the choices; guided_layers
  stays the default (the deepest half) of whatever depth resolves."""
  s = cfg.section("tiny", num_hidden_layers=4, dtype="bfloat16")
  assert s["preset"] == "tiny" and s["guided_layers"] is None
  assert cfg.resolve(s) == cfg.tiny(num_hidden_layers=4, dtype="bfloat16")
  assert cfg.resolve(s).guided_layers == (2, 3)
  assert cfg.resolve(dict(s, num_hidden_layers=6)).guided_layers == (3, 4, 5)
  assert cfg.section("tiny", guided_layers=(1,))["guided_layers"] == (1,)
  with pytest.raises(ValueError, match="unknown model fields"):
    cfg.section("tiny", hidden=3)
  with pytest.raises(ValueError, match="unknown model preset"):
    cfg.section("llama")
