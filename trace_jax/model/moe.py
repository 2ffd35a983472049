"""Sparse MoE block: top-k softmax router and SwiGLU routed experts, grouped by expert.

Routing follows HF Qwen3-MoE: softmax over all experts in float32, top-k, optional
renormalization of the k probabilities (`norm_topk_prob`), weights cast to the compute dtype.
The experts run as grouped matmuls: the (token, slot) rows are sorted by expert and each
projection is one grouped matmul over the stacked weights (`grouped.py`: ragged_dot or padded
tiles, by `ModelConfig.moe_impl`), so there is no Python loop over experts. Expert weights are
stacked in torch order with the contraction axis last: gate/up [E, F, D], down [E, D, F], so
FP4 blocks of 16 run along the contraction axis.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from trace_jax.kernels import fp4_moe, invariant
from trace_jax.model import expert_parallel, expert_weights
from trace_jax.model.config import ModelConfig
from trace_jax.model.grouped import dispatch_rows, grouped_matmul, inverse_permutation, permute_rows
from trace_jax.model.layer_runs import at_layer
from trace_jax.model.layers import Linear, _normal
from trace_jax.model.precision import Precision, swiglu
from trace_jax.quant import formats


def route(router_logits: jax.Array, k: int, norm_topk_prob: bool, dtype: jnp.dtype,
          replay: jax.Array | None = None, fixed_order: bool = False
          ) -> tuple[jax.Array, jax.Array]:
  """Top-k expert ids [T, K] int32 and combine weights [T, K] from router logits [T, E].

  replay: expert ids to use instead of the top-k (rollout routing replayed in training); their
  weights are the router's probabilities for those experts, renormalized likewise.
  fixed_order: the softmax's and the renormalization's sums in index order (the invariant
  plan's, `kernels.invariant`).
  """
  probs = (invariant.softmax(router_logits) if fixed_order
           else jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1))
  if replay is None:
    top_p, top_i = jax.lax.top_k(probs, k)
  else:
    top_i = replay.astype(jnp.int32)
    top_p = jnp.take_along_axis(probs, top_i, axis=-1)
  if norm_topk_prob:
    top_p = (invariant.normalized(top_p) if fixed_order
             else top_p / jnp.sum(top_p, axis=-1, keepdims=True))
  return top_i.astype(jnp.int32), top_p.astype(dtype)


def load_balancing_loss(router_logits: list[jax.Array], num_experts: int, k: int,
                        mask: jax.Array | None = None) -> jax.Array:
  """HF `load_balancing_loss_func`: E * sum_e f_e * P_e over all layers' rows.

  f_e: fraction of (row, slot) assignments to expert e (counts / rows, summing to k);
  P_e: mean router probability of e. Rows of every layer are pooled, as HF concatenates them.
  router_logits: per layer [T, E]; mask: [T] (1 for real tokens) or None.
  """
  logits = jnp.concatenate([r.astype(jnp.float32) for r in router_logits], axis=0)
  probs = jax.nn.softmax(logits, axis=-1)
  _, top_i = jax.lax.top_k(probs, k)
  if mask is None:
    w = jnp.ones((logits.shape[0],), jnp.float32)
  else:
    w = jnp.tile(mask.reshape(-1).astype(jnp.float32), len(router_logits))
  counts = jnp.sum(jax.nn.one_hot(top_i, num_experts, dtype=jnp.float32) * w[:, None, None],
                   axis=(0, 1))
  rows = jnp.sum(w)
  f = counts / rows
  p = jnp.sum(probs * w[:, None], axis=0) / rows
  return jnp.sum(f * p) * num_experts


class MoE(nnx.Module):
  """Router `[E, D]` plus stacked SwiGLU experts."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, param_dtype: jnp.dtype):
    e, f, d = config.num_experts, config.moe_intermediate_size, config.hidden_size
    self.router = Linear(d, e, rngs=rngs, param_dtype=param_dtype)
    self.gate_proj = nnx.Param(_normal(rngs, (e, f, d), param_dtype))
    self.up_proj = nnx.Param(_normal(rngs, (e, f, d), param_dtype))
    self.down_proj = nnx.Param(_normal(rngs, (e, d, f), param_dtype))
    self.num_experts = config.num_experts  # not the weights' shape: an engine may drop them
    self.k = config.num_experts_per_tok
    self.norm_topk_prob = config.norm_topk_prob

  def __call__(self, x: jax.Array, prec: Precision, layer: int,
               rollout_ids: jax.Array | None = None, replay: bool = False,
               experts: Any = None, decode: bool = False) -> tuple[jax.Array, jax.Array]:
    """x [B, S, D] -> (out [B, S, D], router logits [B*S, E]).

    rollout_ids [B, S, K]: the experts the rollout routed each token to. They match
    expert_mid guidance to experts, and with `replay` they replace the router's top-k.
    experts: this layer of the rollout engine's weights (`expert_weights.LayerOf`, made once
    per weight update) instead of the params' expert weights; one-token decode steps then run
    the decode kernel (`trace_jax.kernels.fp4_moe`) when the plan's `decode_impl` is "kernel".
    Traced inside `mesh_context.use_mesh` (a mesh with `expert` > 1), either kind of
    weights runs expert-parallel, each device its own experts (the same local computation);
    on a mesh whose `expert` axis is 1, data-parallel where the tokens split over it.
    """
    b, s, d = x.shape
    e, k = self.num_experts, self.k
    xt = x.reshape(b * s, d)
    router_logits = self.router(xt, prec.matmul)
    if replay and rollout_ids is None:
      raise ValueError(f"layer {layer}: routing replay needs the rollout's expert ids")
    ids, weights = route(router_logits, k, self.norm_topk_prob, x.dtype,
                         rollout_ids.reshape(b * s, k) if replay else None,
                         prec.plan.invariant)
    prec.tap_route(layer, ids.reshape(b, s, k))

    xq = prec.site(layer, "moe_in", x).reshape(b * s, d)
    mesh = expert_parallel.active_mesh(e, b * s)
    ex = self._experts(prec, x.dtype, experts, decode and s == 1, mesh)
    if mesh is not None:  # experts over the mesh's `expert` axis (or data-parallel: one)
      out = expert_parallel.moe(prec, layer, xq, ids, weights, ex,
                                None if rollout_ids is None else rollout_ids.reshape(b * s, k),
                                mesh, (b, s, k))
      return out.reshape(b, s, d), router_logits
    # Dispatch: (token, slot) rows sorted by expert id (stable, so token order within a group).
    flat_ids = ids.reshape(-1)
    order = jnp.argsort(flat_ids, stable=True)
    inverse = inverse_permutation(order)
    group_sizes = jnp.bincount(flat_ids, length=e).astype(jnp.int32)
    rows = dispatch_rows(xq, order, inverse, k)                              # [M, D]
    hidden, down = ex.local(ex.arrays, group_sizes)
    h = prec.site(layer, "expert_mid", hidden(rows), row_order=order, row_inverse=inverse,
                  tap_shape=(b, s, k),
                  experts=ids.reshape(b, s, k), rollout_experts=rollout_ids)
    y = down(h)                                                              # [M, D]
    # Combine: back to (token, slot) order (a gather both ways), weight, sum over slots.
    y = permute_rows(y, inverse, order).reshape(b * s, k, d)
    out = (invariant.combine(y, weights) if prec.plan.invariant
           else jnp.sum(y * weights[..., None], axis=1))
    return out.reshape(b, s, d), router_logits

  def _experts(self, prec: Precision, dtype: Any, experts: Any, one_token: bool,
               mesh: Mesh | None) -> expert_parallel.Experts:
    """The routed experts as the dispatch runs them, on one device or expert-parallel (the same
    local computation): the params' weights, quantized as `Precision` does, or the engine's
    prepared ones (`experts`, a `expert_weights.LayerOf`). Prepared FP8 weights run in
    `Precision.grouped` read in place in the run's stack; one-token decode steps run the decode
    kernel (`fp4_moe`, in place) when the plan's `decode_impl` is "kernel"; the other paths
    (prefill) slice the layer out of the stack and dequantize it. With `mesh`, the arrays'
    PartitionSpecs: the params' by the entered rules, the prepared stacks' split along E."""
    if experts is None:
      arrays = tuple(w[...].astype(dtype) for w in (self.gate_proj, self.up_proj, self.down_proj))

      def local(ws: Any, sizes: jax.Array) -> Any:
        gate, up, down = prec.expert_weights(*ws)
        return (lambda rows: prec.expert_hidden(rows, gate, up, sizes),
                lambda h: prec.grouped(h, down, sizes))

      specs = None if mesh is None else expert_parallel.param_specs(*arrays, mesh)
      return expert_parallel.Experts(arrays, self.num_experts, local, specs)
    plan = prec.plan
    kernel = one_token and plan.decode_impl == "kernel"

    def decode_kernel(a: jax.Array, w: Any, sizes: jax.Array, index: jax.Array) -> jax.Array:
      # the plan's packed experts' kernel where it takes these weights, else Triton's
      impl = plan.decode_moe_kernel if fp4_moe.wgmma_supported(a.dtype, w) else "triton"
      return fp4_moe.grouped_matmul_decode(a, w, sizes, layer=index,
                                           config=fp4_moe.DecodeConfig(impl=impl))

    def local_prepared(ws: Any, sizes: jax.Array) -> Any:
      gate_up, down, index = ws
      if isinstance(down, formats.FP8Tensor):  # quantized once per update, read in place
        mm = lambda a, w: prec.grouped(a, w, sizes, layer=index)
      elif kernel:  # the decode kernel reads this layer's weights in place in the run's stack
        mm = lambda a, w: decode_kernel(a, w, sizes, index)
      else:  # the XLA paths (prefill): the layer's weights sliced out of the stack
        gate_up, down = at_layer((gate_up, down), index)
        mm = lambda a, w: grouped_matmul(a, expert_weights.dense(w, a.dtype), sizes,
                                         plan.grouped)
      return lambda rows: swiglu(mm(rows, gate_up), plan.invariant), lambda h: mm(h, down)

    arrays = (experts.run.gate_up, experts.run.down, experts.index)
    specs = None
    if mesh is not None:
      specs = (*jax.tree.map(lambda _: expert_weights.RUN_EXPERT_SPEC, arrays[:2]),
               PartitionSpec())
    return expert_parallel.Experts(arrays, self.num_experts, local_prepared, specs)
