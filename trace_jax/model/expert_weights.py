"""Weights as the rollout engine's decode reads them, made once per weight update.

Under an NVFP4 forward the decode kernel (`trace_jax.kernels.fp4_moe`) reads packed E2M1 codes,
E4M3 block scales and one FP32 scale per expert, never BF16 copies; under BF16 it reads the
weights in the compute dtype. Under a forward with FP8 linears (`fp8_unified`) the experts and
the attention projections are held as E4M3 values + block scales (`formats.FP8Tensor`, half
the bytes of BF16) and the FP8 GEMMs take them as they are, instead of quantizing every weight
at every decode step. Gate and up are stacked into one [E, 2F, D] matmul (in NVFP4 they
share one second-level scale per expert, as `Precision.expert_weights` quantizes them). The
values are bit for bit those of the reference forward's quantized weights, so a forward
given these weights computes what it computes without them, up to the matmuls' float32
summation order (FP8: exactly, the GEMM is the same). The attention projections are held
here too (compute dtype, or FP8), q, k and v stacked into one [(N + 2G) H, D] matrix ("qkv"):
one-token decode steps run qkv and o through the same decode kernel as one "expert" each,
reading them in place in the run's stack, one call for the three input projections (FP8: the
128 x 128 blocks of the stack are those of q, k and v apart, as `Precision.linears` uses).

Held per run of layers (`layer_runs`), stacked [n, ...]; a scan over the run's layers gives
each layer a `LayerOf` (the stack and the layer's index), so the kernel reads the layer's
weights where they lie instead of a per-step copy of a slice. On a mesh (`shardings`) the
experts' stacks are split along E over the mesh's `expert` axis, which the expert-parallel
MoE block (`expert_parallel`) reads as they lie; the attention projections are replicated.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from trace_jax.kernels import fp4_moe
from trace_jax.model.config import ModelConfig
from trace_jax.model.layer_runs import at_layer, layer_runs, stack
from trace_jax.model.plan import KernelPlan, resolve
from trace_jax.quant import formats

DenseOrPacked = jax.Array | fp4_moe.PackedNVFP4Weights | formats.FP8Tensor
# Every field of a run's expert stacks is [L, E, ...]: E split over the mesh's `expert` axis.
RUN_EXPERT_SPEC = PartitionSpec(None, "expert")
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")  # the params' attention projections
PREPARED_ATTENTION = ("qkv", "o_proj")  # as `ExpertWeights.attention` holds them


@struct.dataclass
class ExpertWeights:
  """One layer's routed experts: gate and up stacked [E, 2F, D], down [E, D, F]; and its
  attention projections [out, in] by name (`PREPARED_ATTENTION`: q, k, v stacked as "qkv",
  and "o_proj"): FP8 under FP8 linears, else in the compute dtype (the decode kernel reads
  them in place, as the experts)."""
  gate_up: DenseOrPacked
  down: DenseOrPacked
  attention: dict[str, jax.Array | formats.FP8Tensor] | None = None

  @property
  def packed(self) -> bool:
    return isinstance(self.down, fp4_moe.PackedNVFP4Weights)

  @property
  def fp8(self) -> bool:
    return isinstance(self.down, formats.FP8Tensor)


@struct.dataclass
class LayerOf:
  """Layer `index` (int32 scalar, traced inside a scan) of a run's stacked ExpertWeights: the
  decode kernel reads it in place from the stack (`fp4_moe.grouped_matmul_decode(layer=)`);
  `layer()` slices it out (a copy) for the other paths."""
  run: ExpertWeights
  index: jax.Array

  def layer(self) -> ExpertWeights:
    return at_layer(self.run, self.index)

  @property
  def attention(self) -> dict[str, jax.Array | formats.FP8Tensor] | None:
    return None if self.run.attention is None else at_layer(self.run.attention, self.index)

  @property
  def packed(self) -> bool:
    return self.run.packed

  @property
  def fp8(self) -> bool:
    return self.run.fp8


def supported(config: ModelConfig) -> bool:
  """Forwards whose weights the engine prepares: BF16, NVFP4 experts and FP8 linears; MXFP4
  experts take the reference path."""
  return config.forward.fp4 in (None, "nvfp4")


def prepare(params: Any, config: ModelConfig,
            plan: KernelPlan | None = None) -> list[ExpertWeights]:
  """Each layer run's ExpertWeights (`layer_runs`), stacked [n, ...] as the
  forward's `experts` takes them, from the model's params (jit it: one program per shape);
  packed NVFP4 codes in the plan's `fp4_codes` layout (None: the config's plan)."""
  if not supported(config):
    raise ValueError(f"policy {config.policy!r}: the engine prepares BF16, NVFP4 and FP8 "
                     "weights only")
  layers = [prepare_layer(params["layers"][i], config, plan)
            for i in range(config.num_hidden_layers)]
  return [stack(layers[a:b]) for a, b in layer_runs(config)]


def run_structs(params: Any, config: ModelConfig,
                plan: KernelPlan | None = None) -> list[ExpertWeights]:
  """The shapes and dtypes (`jax.ShapeDtypeStruct`s) of `prepare`'s runs, nothing computed."""
  one = jax.eval_shape(functools.partial(prepare_layer, config=config, plan=plan),
                       params["layers"][0])
  return [jax.tree.map(lambda s, n=b - a: jax.ShapeDtypeStruct((n, *s.shape), s.dtype), one)
          for a, b in layer_runs(config)]


def write_layer(run: ExpertWeights, layer: Any, index: jax.Array, config: ModelConfig,
                plan: KernelPlan | None = None) -> ExpertWeights:
  """`run` with entry `index` of its stacks replaced by `prepare_layer(layer)`.

  Jitted with `run` donated, this is `prepare` one layer at a time: one program, compiled once
  whatever the depth (the whole `prepare` in one program compiles every layer's quantizer:
  25-35 s at 8 layers and 93-103 s at 24 on the H200 for NVFP4), updating the stack in place.
  """
  return jax.tree.map(lambda s, x: jax.lax.dynamic_update_index_in_dim(s, x, index, 0), run,
                      prepare_layer(layer, config, plan))


def shardings(runs: Any, mesh: Mesh) -> Any:
  """Where an engine on `mesh` holds `prepare`'s runs (arrays or `jax.eval_shape` structs):
  the experts' fields split along E over `expert` (`RUN_EXPERT_SPEC`; replicated when the
  axis does not divide E, a mesh the expert-parallel block refuses), the attention
  projections replicated."""
  replicated = NamedSharding(mesh, PartitionSpec())

  def expert(a: Any) -> NamedSharding:
    ep = mesh.shape.get("expert", 1)
    return NamedSharding(mesh, RUN_EXPERT_SPEC) if a.shape[1] % ep == 0 else replicated

  return [r.replace(gate_up=jax.tree.map(expert, r.gate_up), down=jax.tree.map(expert, r.down),
                    attention=jax.tree.map(lambda _: replicated, r.attention))
          for r in runs]


def prepare_layer(layer: Any, config: ModelConfig,
                  plan: KernelPlan | None = None) -> ExpertWeights:
  """One decoder layer's params (`params["layers"][i]`) as the engine holds them (packed NVFP4
  codes in the plan's `fp4_codes` layout; None: the config's plan)."""
  dtype = jnp.dtype(config.dtype)
  moe = layer["moe"]
  gate, up, down = (moe[n][...].astype(dtype) for n in ("gate_proj", "up_proj", "down_proj"))
  gate_up = jnp.concatenate([gate, up], axis=1)
  w = {n: layer["attn"][n]["kernel"][...].astype(dtype) for n in ATTENTION}
  attention = {"qkv": jnp.concatenate([w["q_proj"], w["k_proj"], w["v_proj"]], axis=0),
               "o_proj": w["o_proj"]}
  if config.forward.fp8_linears:  # as Precision.grouped / Precision.linear(s) quantize them
    return ExpertWeights(
        gate_up=formats.fp8_quantize_weight(gate_up), down=formats.fp8_quantize_weight(down),
        attention={n: formats.fp8_quantize_weight(a) for n, a in attention.items()})
  if config.forward.fp4 == "nvfp4":
    words = (resolve(config) if plan is None else plan).words
    return ExpertWeights(gate_up=fp4_moe.pack_for_kernel(gate_up, words),
                         down=fp4_moe.pack_for_kernel(down, words),
                         attention=attention)
  return ExpertWeights(gate_up=gate_up, down=down, attention=attention)


def drop_prepared(params: Any, config: ModelConfig) -> Any:
  """params with the weights `prepare` holds in another form replaced by empty arrays (the
  routed experts and the attention projections), so an engine that runs
  on prepared weights keeps one copy of them. A forward given the prepared weights never reads
  these (`MoE` takes the expert count from the config)."""
  def is_prepared(path: tuple[Any, ...]) -> bool:
    keys = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
    if "moe" in keys:
      return any(k in keys for k in ("gate_proj", "up_proj", "down_proj"))
    return "attn" in keys and any(k in keys for k in ATTENTION)

  return empty_where(params, is_prepared)


def empty_where(params: Any, pred: Any) -> Any:
  """params with each leaf whose key path `pred` accepts replaced by an empty array of its
  dtype, all made by one program: one eager `jnp.zeros` per leaf (~100-250 of them) took most
  of an engine's weight update."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  hit = [i for i, (path, _) in enumerate(leaves) if pred(path)]
  made = dict(zip(hit, _empties(tuple(jnp.dtype(leaves[i][1].dtype).name for i in hit))))
  return jax.tree_util.tree_unflatten(
      treedef, [made.get(i, a) for i, (_, a) in enumerate(leaves)])


@functools.partial(jax.jit, static_argnums=0)
def _empties(dtypes: tuple[str, ...]) -> list[jax.Array]:
  return [jnp.zeros((0,), d) for d in dtypes]


def dense(w: DenseOrPacked, dtype: Any) -> jax.Array:
  """The weights in `dtype` (packed NVFP4 / FP8 dequantized: the quantized values)."""
  if isinstance(w, fp4_moe.PackedNVFP4Weights):
    return fp4_moe.dequantize(w, dtype)
  if isinstance(w, formats.FP8Tensor):
    return formats.fp8_dequantize(w).astype(dtype)
  return w.astype(dtype)
