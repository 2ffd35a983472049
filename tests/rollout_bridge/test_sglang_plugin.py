"""The `trace_nvfp4` SGLang plugin against SGLang 0.5.23's real classes and the JAX model.

SGLang's GPU kernels cannot be installed on CI; its Python code can (`scripts/
install_sglang_cpu.sh`, `pip install --no-deps`), and that is enough to construct a real
`FusedMoE` on CPU once a single-process gloo "distributed" state exists. So the plugin is
exercised end to end through SGLang's own machinery: registration, `get_quant_method`,
`create_weights` with the layer's weight loader, HF per-expert weights loaded through
`FusedMoE.make_expert_params_mapping` + `weight_loader`, `process_weights_after_loading`,
SGLang's torch-native top-k routing, and `FusedMoE.forward` (standard dispatcher -> our `apply`
-> combine). What needs a GPU and is not run here: SGLang's model runner and attention backends
(the KV hook is tested as a function, not inside RadixAttention), CUDA graphs, and a server.

JAX reference: the JAX model's MoE block and KV site with its own `Precision` taps (the tap
mechanism of `trace_jax.model.forward(..., tap_layers=..., record=True)`), on the same weights
and inputs in float32. Two data sets: random weights from `init_params(tiny)` with random
inputs (quantizer inputs after a matmul differ from JAX's in the last bits, because XLA and
torch accumulate dot products in different orders and compute the sigmoid differently), and
"exact" data on the NVFP4 grid with power-of-two second-level scales, on which every matmul and
SiLU is exact in float32, so every quantizer input and thus every record is bit-identical.
"""

from __future__ import annotations

import argparse
import faulthandler
import functools
import importlib.util
import os
import pkgutil
import signal
import socket
import subprocess
import sys
import types
import warnings
from importlib.metadata import EntryPoint
from pathlib import Path

import numpy as np
import pytest

if importlib.util.find_spec("sglang") is None:
  pytest.skip("sglang is not installed; run scripts/install_sglang_cpu.sh .venv (make test does)",
              allow_module_level=True)

# SGLang imports torchvision at module level (multimodal configs reached from
# sglang.srt.layers.quantization). PyPI's torchvision does not import beside CPU torch 2.13 and an
# unpinned install replaces torch with a CUDA build, so a placeholder package goes first on
# sys.path, in this module only (it affects the rest of this pytest process: transformers then
# sees a "torchvision" whose members are placeholders; nothing in the test suite uses it).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "_stubs"))

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import torch  # noqa: E402
from flax import nnx  # noqa: E402

with warnings.catch_warnings():
  warnings.simplefilter("ignore")  # "Only CUDA ... support AWQ/GGUF" import-time warnings
  from sglang.srt.arg_groups.choices import QUANTIZATION_CHOICES
  from sglang.srt.layers.linear import ReplicatedLinear
  from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
  from sglang.srt.layers.moe.topk import TopKConfig, select_experts
  from sglang.srt.layers.quantization import QUANTIZATION_METHODS
  from sglang.srt.layers.quantization.base_config import (
      FusedMoEMethodBase,
      LinearMethodBase,
      QuantizationConfig,
  )
  from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod
  from sglang.srt.layers.radix_attention import RadixAttention
  from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding
  from sglang.srt.plugins import GENERAL_PLUGINS_GROUP
  from sglang.srt.plugins.hook_registry import HookRegistry, HookType

# SGLang loads tvm_ffi, whose libtvm_ffi.so installs a SIGSEGV handler that walks the stack with
# libgcc's unwinder. A SIGSEGV raised inside that unwinder (seen while XLA's CPU compile threw
# a C++ exception) then deadlocks on the unwinder's own lock: a pytest worker hung for 15+
# minutes in CI twice (WORKSPACE.md, "Traps that still bite"). The default action again, with
# faulthandler's traceback first: such a crash fails loudly instead. `make test` also runs this
# module in a pytest process of its own.
signal.signal(signal.SIGSEGV, signal.SIG_DFL)
if faulthandler.is_enabled():
  faulthandler.enable(file=sys.__stderr__)

from rollout_bridge import launch_sglang  # noqa: E402
from rollout_bridge import torch_quant as tq  # noqa: E402
from rollout_bridge.sglang_plugin import NAME, kv_cache, numerics, register  # noqa: E402
from rollout_bridge.sglang_plugin import options as opts  # noqa: E402
from rollout_bridge.sglang_plugin.quant_method import (  # noqa: E402
    TraceNvfp4Config,
    TraceNvfp4MoEMethod,
)
from trace_jax.guidance import store as guidance_store  # noqa: E402
from trace_jax.guidance.record import Guidance  # noqa: E402
from trace_jax.io import hf  # noqa: E402
from trace_jax.model import graphdef, init_params, tiny  # noqa: E402
from trace_jax.model.precision import Precision  # noqa: E402
from trace_jax.quant import formats, guided  # noqa: E402

LAYER = 1          # the tiny model's second (deepest) layer: guided by default
TOKENS = 24
CFG = tiny(policy="fp4_rtn")   # float32 compute; any FP4 policy quantizes the same sites
E, H, I, K = CFG.num_experts, CFG.hidden_size, CFG.moe_intermediate_size, CFG.num_experts_per_tok
G, D = CFG.num_key_value_heads, CFG.head_dim
PREFIX = f"model.layers.{LAYER}.mlp.experts"


# ------------------------------------------------------------------------------ fixtures


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture(scope="module")
def sgl_dist():
  """World-size-1 gloo process group and published ServerArgs: what SGLang layers read."""
  from sglang.srt.distributed import parallel_state as ps
  from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
  from sglang.srt.server_args import ServerArgs

  os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
  os.environ.setdefault("MASTER_PORT", str(_free_port()))
  if not torch.distributed.is_initialized():
    ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
  reset_context()
  publish(ServerArgs(model_path="dummy", tp_size=1, ep_size=1, pp_size=1, device="cpu"),
          role="test", ranks=SpawnRanks(world_rank=0))
  get_parallel().override_permanently(world_group=ps._WORLD)
  if not ps.model_parallel_is_initialized():
    ps.initialize_model_parallel(backend="gloo")
  yield
  # Not ps.destroy_model_parallel(): it imports sglang's launch server (fastapi, uvicorn,
  # opentelemetry), which the CPU install leaves out. Drop the groups and the context directly.
  for name in ("_TP", "_PP", "_DCP", "_MOE_EP", "_MOE_TP", "_MOE_DP", "_ATTN_CP", "_ATTN_TP",
               "_SHARED_EXPERTS_TP", "_PDMUX_PREFILL_TP_GROUP", "_WORLD"):
    if hasattr(ps, name):
      setattr(ps, name, None)
  if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
  reset_context()


@pytest.fixture(autouse=True)
def _plugin():
  register()
  yield
  opts.deactivate()


def _config(**kw) -> TraceNvfp4Config:
  kw.setdefault("num_layers", CFG.num_hidden_layers)
  return TraceNvfp4Config(opts.TraceOptions(**kw))


def _fused_moe(qc: TraceNvfp4Config, layer: int = LAYER) -> FusedMoE:
  return FusedMoE(num_experts=E, hidden_size=H, intermediate_size=I, layer_id=layer, top_k=K,
                  params_dtype=torch.float32, quant_config=qc,
                  prefix=f"model.layers.{layer}.mlp.experts")


def _load_hf_experts(layer: FusedMoE, gate, up, down) -> None:
  """HF per-expert tensors through SGLang's Qwen3-MoE expert mapping and FusedMoE.weight_loader."""
  mapping = FusedMoE.make_expert_params_mapping("gate_proj", "down_proj", "up_proj", E)
  params = dict(layer.named_parameters(prefix=PREFIX))
  for e in range(E):
    for proj, w in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
      name = f"{PREFIX}.{e}.{proj}.weight"
      param_name, weight_name, expert_id, shard_id = next(
          m for m in mapping if m[1] in name and m[2] == e)
      param = params[name.replace(weight_name, param_name)]
      param.weight_loader(param, torch.as_tensor(w[e]), name, shard_id=shard_id,
                          expert_id=expert_id)


@functools.partial(jax.jit, static_argnums=0)
def _jax_reference(cfg, params, gate, up, down, router, x, k, v):
  """JAX model MoE block + KV site at LAYER with taps, and the exporter's weight NVFP4."""
  model = nnx.merge(graphdef(cfg), params)
  moe = model.layers[LAYER].moe
  moe.gate_proj[...], moe.up_proj[...], moe.down_proj[...] = gate, up, down
  moe.router.kernel[...] = router
  prec = Precision(cfg, tap_layers=(LAYER,), record=True)
  out, router_logits = moe(x[None], prec, LAYER)
  kq, vq = prec.kv_site(LAYER, k.reshape(1, -1, G, D), v.reshape(1, -1, G, D))
  return dict(out=out[0], router_logits=router_logits, taps=prec.taps[LAYER],
              k=kq[0].reshape(k.shape), v=vq[0].reshape(v.shape),
              weights=hf.quantize_experts(cfg, gate, up, down))


def _random_data() -> dict[str, np.ndarray]:
  moe = init_params(CFG, 0)["layers"][LAYER]["moe"]
  rng = np.random.default_rng(1)
  return dict(gate=np.array(moe["gate_proj"][...]), up=np.array(moe["up_proj"][...]),
              down=np.array(moe["down_proj"][...]),
              router=np.array(moe["router"]["kernel"][...]),
              x=rng.standard_normal((TOKENS, H)).astype(np.float32),
              k=rng.standard_normal((TOKENS, G * D)).astype(np.float32),
              v=(rng.standard_normal((TOKENS, G * D)) * 3).astype(np.float32))


def _on_grid(rng, shape, exponent) -> np.ndarray:
  """Values code * 448 * 2**exponent with every 16-block holding +-6 * 448 * 2**exponent: NVFP4
  two-level quantization is then the identity (block scale 448, second-level scale
  2**exponent), and sums of products of such values are exact in float32."""
  grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
  vals = grid[rng.integers(0, 8, shape)] * rng.choice(np.float32([-1, 1]), shape)
  blocks = vals.reshape(*shape[:-1], shape[-1] // 16, 16)
  pos = rng.integers(0, 16, blocks.shape[:-1] + (1,))
  np.put_along_axis(blocks, pos, 6 * rng.choice(np.float32([-1, 1]), pos.shape), axis=-1)
  return (blocks.reshape(shape) * np.float32(448) * np.exp2(exponent)).astype(np.float32)


def _exact_data() -> dict[str, np.ndarray]:
  """Exact-arithmetic data: x and w13 on the grid, so gate/up pre-activations are exact and
  either 0 or at least 196 in magnitude (sigmoid exactly 1 or 0 in both frameworks)."""
  rng = np.random.default_rng(2)
  b = rng.integers(-5, -3, (E, 1, 1)).astype(np.float32)       # per-expert w13 exponent
  gate_up = _on_grid(rng, (E, 2 * I, H), b)
  rand = _random_data()
  return dict(gate=gate_up[:, :I], up=gate_up[:, I:],
              down=_on_grid(rng, (E, H, I), rng.integers(-26, -24, (E, 1, 1)).astype(np.float32)),
              router=(rand["router"] * 1e-3).astype(np.float32),
              x=_on_grid(rng, (TOKENS, H), rng.integers(-3, 1, (TOKENS, 1)).astype(np.float32)),
              k=_on_grid(rng, (TOKENS, G * D), np.float32(-10)), v=rand["v"])


@pytest.fixture(scope="module")
def data():
  return {"random": _random_data(), "exact": _exact_data()}


@pytest.fixture(scope="module")
def reference(data):
  params = init_params(CFG, 0)
  return {name: jax.tree.map(np.array, _jax_reference(CFG, params, **d))
          for name, d in data.items()}


@pytest.fixture(scope="module")
def plugin_run(sgl_dist, data, reference):
  """One real FusedMoE under trace_nvfp4 (recording LAYER), run on both data sets in turn
  (the second load is a weight update: restore, load, process again)."""
  qc = _config(record_capacity=64, guided_layers=(LAYER,))
  layer = _fused_moe(qc)
  runs = {}
  for name in ("random", "exact"):
    d, ref = data[name], reference[name]
    layer.quant_method.restore_weights_before_loading(layer)
    _load_hf_experts(layer, d["gate"], d["up"], d["down"])
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.from_numpy(d["x"])
    logits = torch.from_numpy(ref["router_logits"])
    topk = select_experts(x, logits, TopKConfig(top_k=K, renormalize=True, torch_native=True))
    qc.recorder.reset()
    out = layer(x, topk)
    kq, vq = qc.quantize_kv(LAYER, torch.from_numpy(d["k"]), torch.from_numpy(d["v"]), G, D, D)
    guidance, routing = qc.recorder.snapshot(TOKENS)
    direct = numerics.moe_forward(x, layer.trace_w13.dequantized, layer.trace_w2.dequantized,
                                  topk.topk_ids, topk.topk_weights)
    runs[name] = dict(out=out.numpy(), topk=topk, k=kq.numpy(), v=vq.numpy(), guidance=guidance,
                      routing=routing, direct=direct, w13=layer.trace_w13, w2=layer.trace_w2,
                      master13=layer.w13_weight.detach().clone())
  runs["recorder"] = qc.recorder   # holds the exact run's rows
  return runs


def _bits(a) -> np.ndarray:
  a = np.asarray(a)
  return a.view(np.uint8) if a.dtype == ml_dtypes.float8_e4m3fn else a


def _assert_record_equal(got, want, lead) -> None:
  for field in ("mantissa", "block_scale", "row_scale"):
    g, w = _bits(getattr(got, field)), _bits(getattr(want, field))
    np.testing.assert_array_equal(g, w.reshape(lead + w.shape[-1:]), err_msg=field)


# ------------------------------------------------------------------------------ registration


def test_register_adds_method_and_choice():
  register()  # idempotent
  assert QUANTIZATION_METHODS[NAME] is TraceNvfp4Config
  assert issubclass(TraceNvfp4Config, QuantizationConfig)
  assert issubclass(TraceNvfp4MoEMethod, FusedMoEMethodBase)
  assert QUANTIZATION_CHOICES.count(NAME) == 1
  assert TraceNvfp4Config.get_name() == NAME
  assert TraceNvfp4Config.get_config_filenames() == []


def test_entry_point_stanza_loads_register():
  """The setup.cfg stanza's value resolves to the entry function SGLang's loader calls."""
  ep = EntryPoint(name=NAME, value=launch_sglang.PLUGIN_ENTRY, group=GENERAL_PLUGINS_GROUP)
  assert ep.load() is register
  assert GENERAL_PLUGINS_GROUP == launch_sglang.PLUGIN_GROUP == "sglang.srt.plugins"


def test_sglang_plugin_loader_runs_entry_point(monkeypatch):
  """SGLang's own discovery (`load_plugins_by_group`) finds and loads the stanza's entry point
  (its `entry_points` lookup is pointed at the stanza instead of installed metadata)."""
  import sglang.srt.plugins as plugins

  ep = EntryPoint(name=NAME, value=launch_sglang.PLUGIN_ENTRY, group=GENERAL_PLUGINS_GROUP)
  monkeypatch.setattr(plugins, "entry_points",
                      lambda group: [ep] if group == GENERAL_PLUGINS_GROUP else [])
  monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
  loaded = plugins.load_plugins_by_group(GENERAL_PLUGINS_GROUP)
  assert list(loaded) == [NAME] and loaded[NAME][0] is register
  QUANTIZATION_METHODS.pop(NAME)
  loaded[NAME][0]()
  assert QUANTIZATION_METHODS[NAME] is TraceNvfp4Config


def test_kv_hooks_registered_on_real_targets():
  for target, hook in ((kv_cache.RADIX_ATTENTION_FORWARD, kv_cache.radix_attention_forward),
                       (kv_cache.FUSED_KV_WRITE, kv_cache.fused_kv_write)):
    entries = [(t, h) for t, h, _ in HookRegistry._hooks[target] if h is hook]
    assert entries == [(HookType.AROUND, hook)], target
    owner, attr = target.rsplit(".", 1)
    assert callable(getattr(pkgutil.resolve_name(owner), attr))


def test_server_args_accept_launch_command(tmp_path):
  """SGLang 0.5.23's own argument parser accepts the launcher's command line."""
  from sglang.srt.server_args import ServerArgs

  (tmp_path / "config.json").write_text('{"num_hidden_layers": 4}')
  parser = argparse.ArgumentParser()
  ServerArgs.add_cli_args(parser)
  cfg = launch_sglang.ServerConfig(model_path=str(tmp_path), mem_fraction_static=0.8, port=31001,
                                   record_guidance=True)
  ns = parser.parse_args(launch_sglang.build_command(cfg)[3:])
  assert (ns.quantization, ns.port, ns.host) == (NAME, 31001, "127.0.0.1")
  assert ns.mem_fraction_static == 0.8 and ns.skip_tokenizer_init and ns.disable_radix_cache
  assert ns.cuda_graph_backend_decode == ns.cuda_graph_backend_prefill == "disabled"
  cfg = launch_sglang.ServerConfig(model_path=str(tmp_path), tp_size=2, kv_cache_dtype="bf16")
  ns = parser.parse_args(launch_sglang.build_command(cfg)[3:])
  assert (ns.tp_size, ns.ep_size, ns.kv_cache_dtype) == (2, 2, "bf16")


def test_from_config_and_override(monkeypatch):
  monkeypatch.setenv(opts.ENV_VAR, '{"record_capacity": 8}')
  qc = TraceNvfp4Config.from_config({
      "quant_method": NAME, "guidance_mode": "full", "packed_modules_mapping": {"a": ["b"]},
      "hf_config": types.SimpleNamespace(num_hidden_layers=6)})
  assert qc.options.guidance_mode == "full" and qc.options.record_capacity == 8
  assert qc.options.guided == {3, 4, 5} and qc.recorder.layers == {3, 4, 5}
  assert qc.packed_modules_mapping == {"a": ["b"]}
  assert opts.active() is qc
  assert TraceNvfp4Config.override_quantization_method({"quant_method": NAME}, None) == NAME
  assert TraceNvfp4Config.override_quantization_method({"quant_method": "modelopt"}, None) is None
  with pytest.raises(ValueError, match="unknown option"):
    TraceNvfp4Config.from_config({"quant_method": NAME, "guided": [1]})
  monkeypatch.setenv(opts.ENV_VAR, '{"record_capacity": 8}')
  with pytest.raises(ValueError, match="guided_layers"):
    TraceNvfp4Config()   # recording, but no way to know the layers


# ------------------------------------------------------------------------------ layers


def test_get_quant_method_per_layer(sgl_dist):
  qc = _config()
  moe = _fused_moe(qc)
  assert isinstance(moe.quant_method, TraceNvfp4MoEMethod)
  assert moe.runner_backend is None   # no MoeRunner: apply() is the kernel
  lin = ReplicatedLinear(H, E, bias=False, params_dtype=torch.float32, quant_config=qc,
                         prefix="model.layers.0.mlp.gate")
  assert isinstance(lin.quant_method, UnquantizedLinearMethod)
  assert isinstance(qc.get_quant_method(lin, "model.layers.0.self_attn.qkv_proj"),
                    LinearMethodBase)
  emb = VocabParallelEmbedding(CFG.vocab_size, H, params_dtype=torch.float32, quant_config=qc,
                               prefix="model.embed_tokens")
  assert type(emb.quant_method).__name__ == "UnquantizedEmbeddingMethod"
  attn = RadixAttention(CFG.num_attention_heads, D, D ** -0.5, G, layer_id=0, quant_config=qc)
  assert attn.quant_method is None


def test_create_weights_on_plain_module():
  qc = _config()
  method = qc.get_quant_method(FusedMoE.__new__(FusedMoE), PREFIX)
  assert isinstance(method, TraceNvfp4MoEMethod)

  def loader(*args, **kwargs):
    pass

  layer = torch.nn.Module()
  method.create_weights(layer, num_experts=E, hidden_size=H, intermediate_size_per_partition=I,
                        params_dtype=torch.bfloat16, weight_loader=loader, with_bias=False,
                        moe_intermediate_size=I)
  shapes = {n: (tuple(p.shape), p.dtype, p.requires_grad) for n, p in layer.named_parameters()}
  assert shapes == {"w13_weight": ((E, 2 * I, H), torch.bfloat16, False),
                    "w2_weight": ((E, H, I), torch.bfloat16, False)}
  for p in layer.parameters():
    assert p.weight_loader is loader and p.moe_intermediate_size == I
  with pytest.raises(NotImplementedError, match="bias"):
    method.create_weights(torch.nn.Module(), E, H, I, torch.bfloat16, with_bias=True)
  with pytest.raises(ValueError, match="multiple of the NVFP4 block"):
    method.create_weights(torch.nn.Module(), E, 120, I, torch.bfloat16)
  tp = torch.nn.Module()
  tp.moe_tp_size = 2
  with pytest.raises(ValueError, match="ep-size"):
    method.create_weights(tp, E, H, I, torch.bfloat16)


def test_process_weights_keep_master_false_overwrites(data):
  qc = _config(keep_master=False)
  layer = torch.nn.Module()
  method = TraceNvfp4MoEMethod(qc)
  method.create_weights(layer, E, H, I, torch.float32)
  d = data["random"]
  layer.w13_weight.data.copy_(torch.from_numpy(np.concatenate([d["gate"], d["up"]], axis=1)))
  layer.w2_weight.data.copy_(torch.from_numpy(d["down"]))
  method.process_weights_after_loading(layer)
  assert layer.trace_w13.dequantized.data_ptr() == layer.w13_weight.data_ptr()
  want = tq.nvfp4_dequantize(tq.nvfp4_quantize(torch.from_numpy(d["down"][3]),
                                               tq.nvfp4_tensor_scale(torch.from_numpy(
                                                   d["down"][3]))))
  torch.testing.assert_close(layer.w2_weight.data[3], want, rtol=0, atol=0)


# ------------------------------------------------------------------------------ vs JAX


@pytest.mark.parametrize("name", ["random", "exact"])
def test_weight_codes_bit_identical(plugin_run, reference, data, name):
  run, ref = plugin_run[name], reference[name]
  for q, projs in ((run["w13"], ("gate_proj", "up_proj")), (run["w2"], ("down_proj",))):
    want = [ref["weights"][p] for p in projs]
    np.testing.assert_array_equal(q.codes().numpy(),
                                  np.concatenate([np.asarray(w.codes) for w in want], axis=1))
    np.testing.assert_array_equal(q.packed.numpy(), np.concatenate(
        [np.asarray(formats.pack_fp4(w.codes)) for w in want], axis=1))
    np.testing.assert_array_equal(_bits(q.block_scale.view(torch.uint8).numpy()), np.concatenate(
        [_bits(w.block_scale) for w in want], axis=1))
    for w in want:  # gate and up share their expert's second-level scale
      np.testing.assert_array_equal(q.tensor_scale.numpy(), np.asarray(w.tensor_scale).ravel())
  # keep_master (default): the loaded masters are untouched.
  master = np.concatenate([data[name]["gate"], data[name]["up"]], axis=1)
  np.testing.assert_array_equal(run["master13"].numpy(), master)


@pytest.mark.parametrize("name", ["random", "exact"])
def test_routing_and_moe_in_bit_identical(plugin_run, reference, name):
  run, ref = plugin_run[name], reference[name]
  ids = np.asarray(ref["taps"]["routing"]).reshape(TOKENS, K)
  # SGLang's torch-native top-k (sorted=False) may order a token's experts differently.
  np.testing.assert_array_equal(np.sort(run["topk"].topk_ids.numpy(), axis=1), np.sort(ids, 1))
  _assert_record_equal(run["guidance"][LAYER]["moe_in"], ref["taps"]["moe_in"], (TOKENS,))
  np.testing.assert_array_equal(run["routing"][LAYER], run["topk"].topk_ids.numpy())


@pytest.mark.parametrize("name", ["random", "exact"])
def test_moe_output_close(plugin_run, reference, name):
  out, want = plugin_run[name]["out"], reference[name]["out"]
  scale = np.abs(want).max()
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * scale)
  np.testing.assert_array_equal(out, plugin_run[name]["direct"].out.numpy())


def test_expert_mid_exact_data_bit_identical(plugin_run, reference):
  """Exact data: the plugin's expert_mid record is the JAX model's tap, bit for bit."""
  run, ref = plugin_run["exact"], reference["exact"]
  order = _slot_order(run, ref)
  got = run["guidance"][LAYER]["expert_mid"]
  got = Guidance(**{f: np.take_along_axis(_bits(getattr(got, f)), order[..., None], 1)
                    for f in ("mantissa", "block_scale", "row_scale")})
  _assert_record_equal(got, ref["taps"]["expert_mid"], (TOKENS, K))


def test_expert_mid_random_data(plugin_run, reference):
  """Random data: the record is trace_jax.quant's quantization of the plugin's own expert_mid
  input, bit for bit; against the JAX tap, whose input differs in the last bits (matmul order,
  sigmoid), the row scales agree to float rounding and almost all codes agree."""
  run, ref = plugin_run["random"], reference["random"]
  want = _jax_record(run["direct"].mid.numpy())
  _assert_record_equal(run["guidance"][LAYER]["expert_mid"], want, (TOKENS, K))
  order = _slot_order(run, ref)
  got = run["guidance"][LAYER]["expert_mid"]
  tap = ref["taps"]["expert_mid"]
  rs = np.take_along_axis(np.asarray(got.row_scale), order[..., None], 1)
  np.testing.assert_allclose(rs, np.asarray(tap.row_scale).reshape(rs.shape), rtol=1e-6)
  bits = np.take_along_axis(np.asarray(got.mantissa), order[..., None], 1)
  flips = np.unpackbits(bits ^ np.asarray(tap.mantissa).reshape(bits.shape)).mean()
  assert flips < 0.01, flips


@jax.jit
def _jax_record(x):
  """trace_jax's rollout record of activation rows x (per-row two-level NVFP4, compact)."""
  return guided.record(formats.nvfp4_quantize(x, formats.nvfp4_row_scale(x)), "compact")


def _slot_order(run, ref) -> np.ndarray:
  """For each token, the plugin slot holding the JAX tap's k-th expert."""
  got = run["topk"].topk_ids.numpy()
  want = np.asarray(ref["taps"]["routing"]).reshape(TOKENS, K)
  return np.argmax(got[:, None, :] == want[:, :, None], axis=-1)


@pytest.mark.parametrize("name", ["random", "exact"])
def test_kv_bit_identical(plugin_run, reference, name):
  run, ref = plugin_run[name], reference[name]
  np.testing.assert_array_equal(run["k"], ref["k"])
  np.testing.assert_array_equal(run["v"], ref["v"])
  for site in ("k", "v"):
    _assert_record_equal(run["guidance"][LAYER][site], ref["taps"][site], (TOKENS, G))


def test_bf16_layer_serves(sgl_dist, data, plugin_run):
  """The serving dtype: BF16 masters and compute. Against float32 compute on the same BF16
  masters and inputs, weight and moe_in codes are identical; the output differs by BF16
  rounding, and by expert_mid codes that this rounding moves across a rounding boundary (the
  rollout/trainer mismatch TRACE addresses), a few percent of the output norm here."""
  d = data["random"]
  layer = FusedMoE(num_experts=E, hidden_size=H, intermediate_size=I, layer_id=0, top_k=K,
                   params_dtype=torch.bfloat16, quant_config=_config(), prefix=PREFIX)
  _load_hf_experts(layer, *(torch.from_numpy(d[p]).bfloat16() for p in ("gate", "up", "down")))
  layer.quant_method.process_weights_after_loading(layer)
  w13 = torch.from_numpy(np.concatenate([d["gate"], d["up"]], axis=1)).bfloat16().float()
  w2 = torch.from_numpy(d["down"]).bfloat16().float()
  f13, f2 = numerics.quantize_experts(w13), numerics.quantize_experts(w2)
  assert layer.trace_w13.dequantized.dtype == torch.bfloat16
  assert torch.equal(layer.trace_w13.codes(), f13.codes())
  assert torch.equal(layer.trace_w2.codes(), f2.codes())
  x = torch.from_numpy(d["x"]).bfloat16()
  topk = plugin_run["random"]["topk"]
  out = layer(x, topk)
  ref = numerics.moe_forward(x.float(), f13.dequantized, f2.dequantized, topk.topk_ids,
                             topk.topk_weights)
  got = numerics.moe_forward(x, layer.trace_w13.dequantized, layer.trace_w2.dequantized,
                             topk.topk_ids, topk.topk_weights)
  assert out.dtype == torch.bfloat16 and torch.equal(out, got.out)
  assert torch.equal(got.q_in.codes, ref.q_in.codes)
  assert torch.equal(got.q_in.tensor_scale, ref.q_in.tensor_scale)
  err = torch.linalg.norm(out.float() - ref.out) / torch.linalg.norm(ref.out)
  assert err < 0.1, err


def test_moe_forward_drops_other_rank_experts(data):
  """Expert-parallel ranks get id -1 for experts they do not hold: those slots add nothing."""
  d = data["random"]
  w13 = torch.from_numpy(np.concatenate([d["gate"], d["up"]], axis=1))
  w2 = torch.from_numpy(d["down"])
  x = torch.from_numpy(d["x"])
  ids = torch.from_numpy(np.random.default_rng(3).integers(0, E, (TOKENS, K))).to(torch.int32)
  w = torch.full((TOKENS, K), 0.5)
  full = numerics.moe_forward(x, w13, w2, ids, w)
  masked = ids.clone()
  masked[:, 1] = -1
  part = numerics.moe_forward(x, w13, w2, masked, w)
  only0 = numerics.moe_forward(x, w13, w2, ids[:, :1], w[:, :1])
  torch.testing.assert_close(part.out, only0.out, rtol=0, atol=0)
  assert not torch.equal(part.out, full.out)
  assert torch.equal(part.mid[:, 1], torch.zeros_like(part.mid[:, 1]))


def test_expert_codes_keep_sign_of_zero_and_equal_export(tmp_path):
  """`numerics.quantize_experts` keeps the sign of zero (docs/numerics.md): negative weights
  that round to zero, -0 and negative subnormals are code 8, +0 and positive ones code 0; and
  its packed w13 / w2 bytes equal the `weight` bytes that `save_nvfp4_checkpoint` writes for
  the same weights (gate rows then up rows), so the plugin serves the exported codes."""
  d = _random_data()
  rng = np.random.default_rng(5)
  w = {}
  for proj in ("gate", "up", "down"):
    a = d[proj].copy()
    planted = rng.random(a.shape)
    a[planted < 0.01] = -0.0
    a[(planted >= 0.01) & (planted < 0.02)] = 0.0
    a[(planted >= 0.02) & (planted < 0.025)] = -1e-40  # float32 subnormal: flushed to -0
    w[proj] = a
  q13 = numerics.quantize_experts(torch.from_numpy(np.concatenate([w["gate"], w["up"]], 1)))
  q2 = numerics.quantize_experts(torch.from_numpy(w["down"]))
  for q, a in ((q13, np.concatenate([w["gate"], w["up"]], 1)), (q2, w["down"])):
    codes = q.codes().numpy()
    flushed = np.where(np.abs(a) < 2.0**-126, np.copysign(np.float32(0), a), a)
    zero = (codes & 7) == 0
    np.testing.assert_array_equal(codes[zero], np.where(np.signbit(flushed[zero]), 8, 0))
    assert (codes == 8).sum() > 0.02 * codes.size and (codes == 0).sum() > 0.02 * codes.size
  pure = nnx.to_pure_dict(init_params(CFG, 0))
  moe = pure["layers"][LAYER]["moe"]
  moe["gate_proj"], moe["up_proj"], moe["down_proj"] = w["gate"], w["up"], w["down"]
  hf.save_nvfp4_checkpoint(str(tmp_path), CFG, pure, progress=False)
  from safetensors.torch import load_file

  raw = load_file(str(tmp_path / "model.safetensors"))
  for e in range(E):
    gate, up, down = (raw[f"{PREFIX}.{e}.{p}.weight"] for p in ("gate_proj", "up_proj",
                                                                   "down_proj"))
    assert torch.equal(q13.packed[e], torch.cat([gate, up])), e
    assert torch.equal(q2.packed[e], down), e


# ------------------------------------------------------------------------------ recorder


def test_flush_to_store_roundtrip(plugin_run, reference, tmp_path):
  """flush_to_store writes the GuidanceWriter schema; GuidanceReader gives back the JAX taps.

  The exact run's rows are stored as two sequences, "a" = tokens 10..23 and "b" = tokens 0..9
  (row_index maps each stored token to its recorder row, as for interleaved decode steps)."""
  rec, ref = plugin_run["recorder"], reference["exact"]
  row_index = np.r_[10:TOKENS, 0:10]
  with guidance_store.GuidanceWriter(tmp_path, "policy-hash") as writer:
    handle = rec.flush_to_store(writer, "batch0", ["a", "b"], [TOKENS - 10, 10],
                                row_index=row_index, reset=False)
    assert handle.stats["num_tokens"] == TOKENS
  reader = guidance_store.GuidanceReader(tmp_path, "policy-hash")
  try:
    batch = reader.read("batch0")
  finally:
    reader.close()
  assert batch.valid.all() and list(batch.seq_offsets) == [0, TOKENS - 10, TOKENS]
  assert batch.manifest["mode"] == "compact" and batch.manifest["layers"] == [LAYER]
  taps = ref["taps"]
  for site, lead in (("moe_in", ()), ("k", (G,)), ("v", (G,))):
    want = jax.tree.map(lambda a, lead=lead: np.asarray(a).reshape((TOKENS,) + lead
                                                                   + a.shape[-1:])[row_index],
                        taps[site])
    _assert_record_equal(batch.guidance[LAYER][site], want, (TOKENS,) + lead)
  order = _slot_order(plugin_run["exact"], ref)[row_index]
  got = batch.guidance[LAYER]["expert_mid"]
  got = Guidance(**{f: np.take_along_axis(_bits(getattr(got, f)), order[..., None], 1)
                    for f in ("mantissa", "block_scale", "row_scale")})
  want = jax.tree.map(lambda a: np.asarray(a).reshape((TOKENS, K) + a.shape[-1:])[row_index],
                      taps["expert_mid"])
  _assert_record_equal(got, want, (TOKENS, K))
  np.testing.assert_array_equal(batch.routing[LAYER],
                                plugin_run["exact"]["topk"].topk_ids.numpy()[row_index])


def test_recorder_imports_without_jax():
  """The recorder takes the record's format from trace_jax.guidance's JAX-free modules: a fresh
  interpreter that imports it (and torch) holds no JAX."""
  code = ("import sys, rollout_bridge.sglang_plugin.recorder; bad = sorted(m for m in "
          "sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax')); assert not bad, bad")
  subprocess.run([sys.executable, "-c", code], check=True, timeout=300,
                 cwd=Path(__file__).resolve().parents[2])


def test_recorder_overflow_reported():
  qc = _config(record_capacity=4, guided_layers=(LAYER,))
  x = torch.randn(3, H)
  _, q = numerics.qdq_rows(x)
  qc.recorder.record(LAYER, "moe_in", q)
  qc.recorder.record(LAYER, "moe_in", q)    # 6 rows > capacity 4: spill row, no host sync
  qc.recorder.record(0, "moe_in", q)        # unguided layer: ignored
  assert qc.recorder.rows_recorded() == {(LAYER, "moe_in"): 6}
  with pytest.raises(RuntimeError, match="overflow"):
    qc.recorder.snapshot(4)
  qc.recorder.reset()
  qc.recorder.record(LAYER, "moe_in", q)
  g, _ = qc.recorder.snapshot(3)
  want = tq.guidance_record(q, "compact")
  np.testing.assert_array_equal(g[LAYER]["moe_in"].mantissa, want["mantissa"].numpy())


# ------------------------------------------------------------------------------ KV hook


def test_kv_hook_quantizes_before_attention(data):
  """The RadixAttention.forward wrapper hands NVFP4 K/V to the original and records them; it is
  a pass-through when no trace_nvfp4 config (or kv_cache='none') is active."""
  d = data["random"]
  seen = {}

  def original(layer, q, k, v, forward_batch, *args, **kwargs):
    seen.update(k=k, v=v, kwargs=kwargs)
    return "out"

  layer = types.SimpleNamespace(layer_id=LAYER, tp_k_head_num=G, qk_head_dim=D, v_head_dim=D)
  k, v = torch.from_numpy(d["k"]), torch.from_numpy(d["v"])
  opts.deactivate()
  assert kv_cache.radix_attention_forward(original, layer, None, k, v, None) == "out"
  assert seen["k"] is k and seen["v"] is v
  assert kv_cache.fused_kv_write(lambda fb: True, None) is True
  qc = _config(record_capacity=32, guided_layers=(LAYER,))
  out = kv_cache.radix_attention_forward(original, layer, None, k, v, None, save_kv_cache=True)
  assert out == "out" and seen["kwargs"] == {"save_kv_cache": True}
  want_k, want_v, qk, _ = numerics.qdq_kv(k, v, G, D)
  torch.testing.assert_close(seen["k"], want_k, rtol=0, atol=0)
  torch.testing.assert_close(seen["v"], want_v, rtol=0, atol=0)
  assert not torch.equal(seen["k"], k)
  assert kv_cache.fused_kv_write(lambda fb: True, None) is False
  g, _ = qc.recorder.snapshot(TOKENS)
  np.testing.assert_array_equal(g[LAYER]["k"].mantissa, tq.guidance_record(qk)["mantissa"])
  _config(kv_cache="none")
  kv_cache.radix_attention_forward(original, layer, None, k, v, None)
  assert seen["k"] is k
