"""HF `Qwen3MoeForCausalLM` safetensors <-> params, and the ModelOpt NVFP4 export.

(docs/design.md §6, 7, 10.)

Our linear weights already use the torch `[out, in]` layout, so conversion is renaming plus
stacking the per-expert tensors `model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`
into [E, out, in] (and splitting them on export); values and dtypes pass through bit for bit.
Loading checks every tensor name, shape and dtype against `config.json` before reading any
data, and raises one error listing every problem: a model is never half-loaded.

NVFP4 export (`save_nvfp4_checkpoint`): routed experts in the ModelOpt layout that SGLang's
`modelopt_fp4` loader reads (`weight` uint8 [N, K/2] with element 2i in the low nibble,
`weight_scale` E4M3 [N, K/16], `weight_scale_2` FP32 scalar, `input_scale` FP32 scalar), with
the same algorithm as the training forward (two-level NVFP4 of the weights in the compute
dtype, one second-level scale per expert shared by gate and up, as SGLang's fused w13 needs);
everything else BF16. E2M1 codes keep the sign of zero (a negative weight that rounds to zero,
or -0, is code 8; docs/numerics.md), as ModelOpt, torchao and the hardware's E2M1 convert write
it, so the packed bytes equal theirs. `load_nvfp4_checkpoint` decodes it back bit-exactly.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx, traverse_util
from tqdm.auto import tqdm

from trace_jax.io import safetensors_util as st
from trace_jax.model import abstract_params
from trace_jax.model.config import ModelConfig
from trace_jax.model.sharding import param_shardings
from trace_jax.quant.formats import NVFP4_BLOCK

CONFIG_FILE = "config.json"
HF_QUANT_CONFIG = "hf_quant_config.json"
PROGRESS_MIN_BYTES = 256 << 20  # show a progress bar from this checkpoint size on (auto mode)
# Tensors that HF checkpoints may carry and that hold nothing to load.
_IGNORABLE = ("rotary_emb.inv_freq",)
_EXPERT_PROJ = ("gate_proj", "up_proj", "down_proj")
# Modules that stay BF16 in the NVFP4 export (SGLang matches these against its module names).
NVFP4_EXCLUDE = ["lm_head", "model.embed_tokens", "*self_attn*", "*mlp.gate"]

Path = tuple[Any, ...]
_FLOAT_DTYPES = {np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16),
                 np.dtype(np.float64)}


class CheckpointError(ValueError):
  """A checkpoint that does not match its config (missing, misshapen or unexpected tensors)."""


# ----------------------------------------------------------------------------- name map

@dataclass(frozen=True)
class Entry:
  """One parameter: our path, its HF tensor name(s) (E names for stacked experts), shapes."""
  path: Path
  hf_names: tuple[str, ...]
  shape: tuple[int, ...]  # ours; HF per tensor is shape[1:] when stacked
  stacked: bool = False

  @property
  def hf_shape(self) -> tuple[int, ...]:
    return self.shape[1:] if self.stacked else self.shape


def param_entries(config: ModelConfig) -> list[Entry]:
  """Every parameter of `config` with its HF name(s), in HF checkpoint order."""
  c = config
  d, v, e, f = c.hidden_size, c.vocab_size, c.num_experts, c.moe_intermediate_size
  nh, gh, h = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.head_dim
  out = [Entry(("embed", "embedding"), ("model.embed_tokens.weight",), (v, d))]
  for i in range(c.num_hidden_layers):
    p = f"model.layers.{i}."
    L = ("layers", i)
    out += [
        Entry(L + ("input_norm", "scale"), (p + "input_layernorm.weight",), (d,)),
        Entry(L + ("attn", "q_proj", "kernel"), (p + "self_attn.q_proj.weight",), (nh, d)),
        Entry(L + ("attn", "k_proj", "kernel"), (p + "self_attn.k_proj.weight",), (gh, d)),
        Entry(L + ("attn", "v_proj", "kernel"), (p + "self_attn.v_proj.weight",), (gh, d)),
        Entry(L + ("attn", "o_proj", "kernel"), (p + "self_attn.o_proj.weight",), (d, nh)),
        Entry(L + ("attn", "q_norm", "scale"), (p + "self_attn.q_norm.weight",), (h,)),
        Entry(L + ("attn", "k_norm", "scale"), (p + "self_attn.k_norm.weight",), (h,)),
        Entry(L + ("post_attn_norm", "scale"), (p + "post_attention_layernorm.weight",), (d,)),
        Entry(L + ("moe", "router", "kernel"), (p + "mlp.gate.weight",), (e, d)),
    ]
    for proj, shape in (("gate_proj", (e, f, d)), ("up_proj", (e, f, d)),
                        ("down_proj", (e, d, f))):
      names = tuple(f"{p}mlp.experts.{j}.{proj}.weight" for j in range(e))
      out.append(Entry(L + ("moe", proj), names, shape, stacked=True))
  out += [Entry(("final_norm", "scale"), ("model.norm.weight",), (d,)),
          Entry(("lm_head", "kernel"), ("lm_head.weight",), (v, d))]
  return out


def flatten_params(params: Any) -> dict[Path, Any]:
  """{path: array} of an NNX state (or pure dict) of model parameters."""
  pure = nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params
  return traverse_util.flatten_dict(pure)


def params_from_flat(config: ModelConfig, flat: dict[Path, Any]) -> nnx.State:
  """NNX state of `config` holding the arrays of `flat` (checked for completeness and shape)."""
  state = abstract_params(config)
  want = flatten_params(state)
  missing = sorted(map(_fmt, set(want) - set(flat)))
  extra = sorted(map(_fmt, set(flat) - set(want)))
  bad = [f"{_fmt(k)}: {tuple(flat[k].shape)} != {want[k].shape}" for k in want
         if k in flat and tuple(flat[k].shape) != tuple(want[k].shape)]
  if missing or extra or bad:
    raise CheckpointError(f"params do not match the config: missing {missing}, unexpected "
                          f"{extra}, misshapen {bad}")
  nnx.replace_by_pure_dict(state, traverse_util.unflatten_dict(dict(flat)))
  return state


def _fmt(path: Path) -> str:
  return ".".join(str(p) for p in path)


# ----------------------------------------------------------------------------- config.json

def read_config(path: str, **overrides: Any) -> ModelConfig:
  cfg_path = os.path.join(path, CONFIG_FILE)
  if not os.path.isfile(cfg_path):
    raise FileNotFoundError(f"{path}: no {CONFIG_FILE}")
  with open(cfg_path) as f:
    d = json.load(f)
  try:
    return ModelConfig.from_hf_dict(d, **overrides)
  except (ValueError, TypeError) as e:
    raise CheckpointError(f"{cfg_path}: {e}") from e


def _write_json(path: str, obj: dict[str, Any]) -> None:
  with open(path, "w") as f:
    json.dump(obj, f, indent=2, sort_keys=True)
    f.write("\n")


@contextlib.contextmanager
def _progress(total_bytes: int, desc: str,
              progress: bool | None) -> Iterator[Callable[[int], None]]:
  show = total_bytes >= PROGRESS_MIN_BYTES if progress is None else progress
  with tqdm(total=total_bytes, desc=desc, unit="B", unit_scale=True, disable=not show) as bar:
    yield bar.update


# ----------------------------------------------------------------------------- load

def _check_tensors(reader: st.CheckpointReader, entries: list[Entry], path: str,
                   config: ModelConfig) -> None:
  """Raises CheckpointError listing every missing, misshapen, non-float or unexpected tensor."""
  problems = []
  expected = set()
  for ent in entries:
    for name in ent.hf_names:
      expected.add(name)
      if name not in reader:
        problems.append(f"missing tensor {name} (expected shape {list(ent.hf_shape)})")
        continue
      info = reader.infos[name]
      if info.shape != ent.hf_shape:
        problems.append(f"tensor {name} has shape {list(info.shape)}, but config.json implies "
                        f"{list(ent.hf_shape)}")
      elif info.dtype not in _FLOAT_DTYPES:
        problems.append(f"tensor {name} has dtype {info.dtype}, expected a float dtype "
                        "(a quantized checkpoint? use load_nvfp4_checkpoint)")
  extra = [n for n in reader.infos if n not in expected and not n.endswith(_IGNORABLE)]
  if extra:
    problems.append(f"{len(extra)} unexpected tensors, e.g. {sorted(extra)[:5]}")
  if problems:
    head = f"{path}: checkpoint does not match its config ({config.shape_fields()}):\n  "
    more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
    raise CheckpointError(head + "\n  ".join(problems[:20]) + more)


def _place(flat: dict[Path, np.ndarray], config: ModelConfig,
           mesh: jax.sharding.Mesh | None) -> nnx.State:
  if mesh is None:
    arrays = {k: jnp.asarray(v) for k, v in flat.items()}
  else:
    shardings = flatten_params(param_shardings(nnx.to_pure_dict(abstract_params(config)), mesh))
    arrays = {k: jax.device_put(v, shardings[k]) for k, v in flat.items()}
  return params_from_flat(config, arrays)


def _finite(arr: np.ndarray, name: str, path: str) -> np.ndarray:
  """`arr`, or CheckpointError when the tensor holds NaN or Inf (garbled or diverged weights
  would otherwise load and serve NaN log-probs)."""
  bad = np.size(arr) - int(np.count_nonzero(np.isfinite(arr)))
  if bad:
    raise CheckpointError(f"{path}: tensor {name} holds non-finite values (NaN or Inf) in {bad} "
                          f"of its {np.size(arr)} elements")
  return arr


def load_hf_checkpoint(path: str, *, mesh: jax.sharding.Mesh | None = None,
                       progress: bool | None = None,
                       **config_overrides: Any) -> tuple[ModelConfig, nnx.State]:
  """(ModelConfig, params) of an HF Qwen3-MoE checkpoint (single file or sharded with index).

  Parameters keep each tensor's stored dtype; `config.dtype` (the compute dtype) is the
  checkpoint's `dtype`/`torch_dtype`. With `mesh`, each parameter is placed by the sharding
  rules as it is read. `config_overrides` set our own fields (policy, guided_layers, ...).
  A tensor holding NaN or Inf raises CheckpointError naming it.
  """
  config = read_config(path, **config_overrides)
  with open(os.path.join(path, CONFIG_FILE)) as f:
    qc = json.load(f).get("quantization_config")
  if qc:
    raise CheckpointError(f"{path}: a quantized checkpoint ({qc.get('quant_algo', qc)}); use "
                          "load_nvfp4_checkpoint for NVFP4")
  reader = st.CheckpointReader(path)
  entries = param_entries(config)
  _check_tensors(reader, entries, path, config)
  total = sum(reader.infos[n].nbytes for ent in entries for n in ent.hf_names)
  flat: dict[Path, np.ndarray] = {}
  with _progress(total, f"load {os.path.basename(os.path.normpath(path))}", progress) as tick:
    for ent in entries:
      if ent.stacked:
        dts = {reader.infos[n].dtype for n in ent.hf_names}
        if len(dts) > 1:
          raise CheckpointError(f"{path}: experts of {_fmt(ent.path)} mix dtypes "
                                f"{sorted(map(str, dts))}")
        arr = np.empty(ent.shape, dts.pop())
        for j, name in enumerate(ent.hf_names):
          arr[j] = _finite(reader.get(name), name, path)
          tick(reader.infos[name].nbytes)
      else:
        arr = _finite(reader.get(ent.hf_names[0]), ent.hf_names[0], path)
        tick(arr.nbytes)
      flat[ent.path] = arr
  return config, _place(flat, config, mesh)


# ----------------------------------------------------------------------------- save

def _np(x: Any, dtype: np.dtype | None) -> np.ndarray:
  a = np.asarray(jax.device_get(x))
  return a if dtype is None else a.astype(dtype)


def _hf_tensors(config: ModelConfig, params: Any,
                dtype: np.dtype | None) -> list[st.LazyTensor]:
  flat = flatten_params(params)
  out: list[st.LazyTensor] = []
  for ent in param_entries(config):
    if ent.path not in flat:
      raise CheckpointError(f"params lack {_fmt(ent.path)}")
    x = flat[ent.path]
    if tuple(x.shape) != ent.shape:
      raise CheckpointError(f"param {_fmt(ent.path)} has shape {tuple(x.shape)}, config "
                            f"implies {ent.shape}")
    dt = np.dtype(x.dtype if dtype is None else dtype)
    if ent.stacked:
      host = {}  # the stacked array is fetched once, then sliced per expert

      def make(j, x=x, host=host):
        if "a" not in host:
          host["a"] = _np(x, dtype)
        return host["a"][j]
      out += [(n, dt, ent.hf_shape, lambda j=j, make=make: make(j))
              for j, n in enumerate(ent.hf_names)]
    else:
      out.append((ent.hf_names[0], dt, ent.shape, lambda x=x: _np(x, dtype)))
  return out


def save_hf_checkpoint(path: str, config: ModelConfig, params: Any, *,
                       dtype: str | np.dtype | None = None, max_shard_bytes: int | None = None,
                       progress: bool | None = None) -> list[str]:
  """Writes an HF checkpoint (safetensors + config.json) that transformers and SGLang load.

  dtype: cast every tensor to it (e.g. "bfloat16"); None keeps each parameter's dtype.
  max_shard_bytes: split into shards with `model.safetensors.index.json` above this size.
  """
  np_dtype = None if dtype is None else np.dtype(jnp.dtype(dtype))
  tensors = _hf_tensors(config, params, np_dtype)
  total = sum(int(np.prod(s, dtype=np.int64)) * np.dtype(d).itemsize for _, d, s, _ in tensors)
  with _progress(total, f"save {os.path.basename(os.path.normpath(path))}", progress) as tick:
    files = st.write_checkpoint(path, tensors, max_shard_bytes, on_tensor=tick)
  hf = config.to_hf_dict()
  if dtype is not None:
    hf["dtype"] = hf["torch_dtype"] = jnp.dtype(dtype).name
  _write_json(os.path.join(path, CONFIG_FILE), hf)
  return files + [CONFIG_FILE]


# ----------------------------------------------------------------------------- NVFP4 (ModelOpt)

def nvfp4_quant_config() -> dict[str, Any]:
  """`quantization_config` for config.json (SGLang `modelopt_fp4`)."""
  return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": NVFP4_BLOCK,
          "kv_cache_quant_algo": None, "exclude_modules": list(NVFP4_EXCLUDE),
          "ignore": list(NVFP4_EXCLUDE)}


@functools.partial(jax.jit, static_argnums=0)
def quantize_experts(config: ModelConfig, gate: jax.Array, up: jax.Array,
                     down: jax.Array) -> dict[str, Any]:
  """NVFP4 of one layer's stacked expert weights, as the forward quantizes them.

  The weights are cast to the compute dtype first; gate and up share one second-level scale
  per expert. Returns {proj: NVFP4Tensor} with tensor_scale [E, 1, 1].
  """
  from trace_jax.quant import formats  # the quant package is only needed for FP4 export

  cdt = jnp.dtype(config.dtype)
  gate, up, down = (jnp.asarray(w).astype(cdt) for w in (gate, up, down))
  ts_gu = formats.nvfp4_tensor_scale(jnp.concatenate([gate, up], axis=1), axes=(1, 2))
  ts_d = formats.nvfp4_tensor_scale(down, axes=(1, 2))
  return {"gate_proj": formats.nvfp4_quantize(gate, ts_gu),
          "up_proj": formats.nvfp4_quantize(up, ts_gu),
          "down_proj": formats.nvfp4_quantize(down, ts_d)}


def save_nvfp4_checkpoint(path: str, config: ModelConfig, params: Any, *,
                          max_shard_bytes: int | None = None,
                          progress: bool | None = None) -> list[str]:
  """Writes the ModelOpt NVFP4 layout: routed experts NVFP4 (two-level), everything else BF16.

  `input_scale` is written as 1.0: activations are quantized dynamically per token row
  (docs/design.md §3.2), Marlin (Hopper, W4A16) ignores it, and there is no calibration set.
  `weight` packs two E2M1 codes per byte, element 2i in the low nibble, negative zeros as code 8.
  """
  from trace_jax.quant import formats

  flat = flatten_params(params)
  bf16 = np.dtype(ml_dtypes.bfloat16)
  tensors: list[st.LazyTensor] = []
  layer_q: dict[Path, dict[str, tuple[np.ndarray, ...]]] = {}
  for ent in param_entries(config):
    if ent.path not in flat:
      raise CheckpointError(f"params lack {_fmt(ent.path)}")
    if tuple(flat[ent.path].shape) != ent.shape:
      raise CheckpointError(f"param {_fmt(ent.path)} has shape {tuple(flat[ent.path].shape)}, "
                            f"config implies {ent.shape}")
    if not ent.stacked:
      tensors.append((ent.hf_names[0], bf16, ent.shape, lambda x=flat[ent.path]: _np(x, bf16)))
      continue
    proj, layer = ent.path[-1], ent.path[:-1]

    def get(proj=proj, layer=layer):
      if layer not in layer_q:  # quantize a layer's three projections once, on first use
        q = quantize_experts(config, *(flat[layer + (p,)] for p in _EXPERT_PROJ))
        layer_q.clear()  # keep one layer on the host at a time (tensors are written in order)
        layer_q[layer] = {p: (np.asarray(formats.pack_fp4(t.codes)), np.asarray(t.block_scale),
                              np.asarray(t.tensor_scale).reshape(-1)) for p, t in q.items()}
      return layer_q[layer][proj]

    n, k = ent.hf_shape
    for j, name in enumerate(ent.hf_names):
      base = name[: -len(".weight")]
      tensors += [
          (name, np.dtype(np.uint8), (n, k // 2), lambda j=j, g=get: g()[0][j]),
          (base + ".weight_scale", np.dtype(ml_dtypes.float8_e4m3fn), (n, k // NVFP4_BLOCK),
           lambda j=j, g=get: g()[1][j]),
          (base + ".weight_scale_2", np.dtype(np.float32), (), lambda j=j, g=get: g()[2][j]),
          (base + ".input_scale", np.dtype(np.float32), (), lambda: np.float32(1.0)),
      ]
  total = sum(int(np.prod(s, dtype=np.int64)) * np.dtype(d).itemsize for _, d, s, _ in tensors)
  with _progress(total, f"save nvfp4 {os.path.basename(os.path.normpath(path))}",
                 progress) as tick:
    files = st.write_checkpoint(path, tensors, max_shard_bytes, on_tensor=tick)
  hf = config.to_hf_dict()
  hf["dtype"] = hf["torch_dtype"] = "bfloat16"
  hf["quantization_config"] = nvfp4_quant_config()
  _write_json(os.path.join(path, CONFIG_FILE), hf)
  qc = nvfp4_quant_config()
  _write_json(os.path.join(path, HF_QUANT_CONFIG), {
      "producer": {"name": "modelopt", "version": "trace_jax"},
      "quantization": {"quant_algo": "NVFP4", "group_size": NVFP4_BLOCK,
                       "kv_cache_quant_algo": None,
                       "exclude_modules": qc["exclude_modules"]}})
  return files + [CONFIG_FILE, HF_QUANT_CONFIG]



def load_nvfp4_checkpoint(path: str, *, progress: bool | None = None,
                          **config_overrides: Any) -> tuple[ModelConfig, nnx.State,
                                                            dict[Path, Any]]:
  """Reads a ModelOpt NVFP4 checkpoint written by `save_nvfp4_checkpoint`.

  Returns (config, params, quantized): params hold the BF16 tensors as stored and the routed
  experts dequantized to float32 (`code * block_scale * weight_scale_2`, exact); quantized
  maps each stacked expert path to its NVFP4Tensor (codes, E4M3 block scales, [E, 1, 1]
  second-level scales), bit-identical to what was exported.
  """
  from trace_jax.quant import formats

  with open(os.path.join(path, CONFIG_FILE)) as f:
    qc = json.load(f).get("quantization_config") or {}
  if qc.get("quant_algo") != "NVFP4" or qc.get("group_size") != NVFP4_BLOCK:
    raise CheckpointError(f"{path}: config.json has no NVFP4 quantization_config (group_size "
                          f"{NVFP4_BLOCK}); got {qc}")
  config = read_config(path, **config_overrides)
  reader = st.CheckpointReader(path)
  problems, expected = [], set()

  def need(name, dtype, shape):
    expected.add(name)
    if name not in reader:
      problems.append(f"missing tensor {name}")
    elif reader.infos[name].shape != shape or reader.infos[name].dtype != np.dtype(dtype):
      i = reader.infos[name]
      problems.append(f"tensor {name} is {i.dtype} {list(i.shape)}, expected "
                      f"{np.dtype(dtype)} {list(shape)}")

  entries = param_entries(config)
  for ent in entries:
    if not ent.stacked:
      need(ent.hf_names[0], ml_dtypes.bfloat16, ent.shape)
      continue
    n, k = ent.hf_shape
    for name in ent.hf_names:
      base = name[: -len(".weight")]
      need(name, np.uint8, (n, k // 2))
      need(base + ".weight_scale", ml_dtypes.float8_e4m3fn, (n, k // NVFP4_BLOCK))
      need(base + ".weight_scale_2", np.float32, ())
      need(base + ".input_scale", np.float32, ())
  extra = sorted(set(reader.infos) - expected)
  if extra:
    problems.append(f"{len(extra)} unexpected tensors, e.g. {extra[:5]}")
  if problems:
    raise CheckpointError(f"{path}: NVFP4 checkpoint does not match its config:\n  " +
                          "\n  ".join(problems[:20]))
  flat: dict[Path, Any] = {}
  quantized: dict[Path, Any] = {}
  total = sum(i.nbytes for i in reader.infos.values())
  with _progress(total, "load nvfp4", progress) as tick:
    for ent in entries:
      if not ent.stacked:
        flat[ent.path] = jnp.asarray(_finite(reader.get(ent.hf_names[0]), ent.hf_names[0], path))
        tick(reader.infos[ent.hf_names[0]].nbytes)
        continue
      bases = [n[: -len(".weight")] for n in ent.hf_names]
      packed = np.stack([reader.get(b + ".weight") for b in bases])
      scale = np.stack([_finite(reader.get(b + ".weight_scale"), b + ".weight_scale", path)
                        for b in bases])
      ts = np.stack([_finite(reader.get(b + ".weight_scale_2"), b + ".weight_scale_2", path)
                     for b in bases]).reshape(-1, 1, 1)
      tick(sum(reader.infos[b + s].nbytes for b in bases
               for s in (".weight", ".weight_scale", ".weight_scale_2", ".input_scale")))
      q = formats.NVFP4Tensor(codes=formats.unpack_fp4(jnp.asarray(packed)),
                              block_scale=jnp.asarray(scale), tensor_scale=jnp.asarray(ts))
      quantized[ent.path] = q
      flat[ent.path] = formats.nvfp4_dequantize(q)
  return config, params_from_flat(config, flat), quantized
