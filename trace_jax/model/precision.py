"""Where and how the forward quantizes, per precision policy (docs/design.md §4 and 5).

One `Precision` object lives for one traced forward. The model calls it at every quantization
site; it applies the fake quantizer its `Forward` (`trace_jax/model/policies.py`) names
(`trace_jax.quant.qat`: quantize-dequantize with a straight-through BF16 gradient), rounds
under rollout guidance where a guided forward is given it, and collects "taps" (the
quantization outcome per layer and site) when asked.

Sites (TRACE): `moe_in` (a token's input to the routed experts, row = token), `expert_mid`
(input to a selected expert's down projection, row = (token, top-k slot)), `k` and `v`
(entering the KV cache, row = (token, kv head), blocks along head_dim), plus the routed
expert weights (in NVFP4 one second-level scale per expert; gate and up share it, as SGLang's
fused w13 does), all in the forward's FP4 format (NVFP4 or MXFP4). `fp8_unified` (Jet-RL)
instead runs every linear layer in the decoder blocks (q/k/v/o projections and experts) as an
FP8 GEMM (`linear`, `grouped`: `trace_jax.model.fp8_linear`); the router, embeddings, norms
and lm_head stay in the compute dtype in every policy.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.guidance import byte_rows
from trace_jax.guidance.record import Guidance
from trace_jax.kernels import invariant, kv_append, nvfp4_act
from trace_jax.kernels.kv_cache import PackedKVCache
from trace_jax.model import batch_local, fp8_linear, mesh_context
from trace_jax.model.config import SITES, ModelConfig
from trace_jax.model.grouped import grouped_matmul
from trace_jax.model.plan import KernelPlan, resolve
from trace_jax.quant import formats, guided, qat


def dtype_rounded(x: jax.Array) -> jax.Array:
  """x rounded to its own dtype's precision (bf16 / f16) by an op XLA keeps.

  With `--xla_allow_excess_precision` (XLA's default) a fusion may carry a bf16 value in
  float32, so the same expression feeds a quantizer different bits in different programs
  (docs/numerics.md: seen at expert_mid, h = silu(gate) * up, between a one-device and an
  expert-parallel program). Every TRACE site quantizes what this returns: the dtype's value."""
  if x.dtype not in (jnp.bfloat16, jnp.float16):
    return x
  info = jnp.finfo(x.dtype)
  return jax.lax.reduce_precision(x.astype(jnp.float32), info.nexp, info.nmant).astype(x.dtype)


# guidance[layer][site] -> Guidance; routing[layer] -> int32 [B, S, K].
GuidanceTree = Mapping[int, Mapping[str, Guidance]]


class Precision:
  """Per-forward quantization context.

  guidance: rollout records for guided training (rows laid out as the taps are).
  tap_layers: layers whose site outcomes are returned as Guidance records (mode `tap_mode`).
  tap_routing: also return every layer's routed expert ids (default: when tap_layers is set).
  record: rollout side; quantize with `quantize_act_record` semantics (no gradient rule).
  plan: the kernel plan of the forward (`trace_jax.model.plan`), which the model's modules
    read (None: the config's, resolved here).
  index_positions: the forward's positions are 0..S-1 in every row, so full-sequence
    attention is causal by index (the plan's `seq_attention` may then fuse it).
  """

  def __init__(self, config: ModelConfig, guidance: GuidanceTree | None = None,
               tap_layers: tuple[int, ...] = (), tap_mode: str | None = None,
               record: bool = False, tap_routing: bool | None = None,
               plan: KernelPlan | None = None, index_positions: bool = False):
    self.config = config
    self.index_positions = index_positions
    self.plan = resolve(config) if plan is None else plan
    fwd = config.forward
    self.fmt = fwd.fp4  # the FP4 format of the TRACE sites, or None
    self.fp4 = fwd.fp4 is not None
    self.fp8 = fwd.fp8_linears
    self.guidance = guidance or {}
    if self.guidance and not fwd.guided:
      raise ValueError(f"guidance given, but policy {config.policy!r} takes none (guided "
                       "forwards round under rollout guidance: fp4_trace, mxfp4_trace)")
    wrong = {g.format for sites in self.guidance.values() for g in sites.values()} - {self.fmt}
    if wrong:
      raise ValueError(f"guidance in {sorted(wrong)} for policy {config.policy!r}, which "
                       f"quantizes in {self.fmt}")
    unknown = {(layer, s) for layer, sites in self.guidance.items() for s in sites
               if s not in SITES}
    if unknown:
      raise ValueError(f"guidance for unknown sites {sorted(unknown)}; sites are {SITES}")
    self.tap_layers = frozenset(tap_layers)
    self.tap_mode = tap_mode or config.guidance_mode
    self.tap_routing = bool(tap_layers) if tap_routing is None else tap_routing
    self.record = record
    # Rollout forwards quantize NVFP4 sites without guidance in one Pallas kernel per site
    # where the plan says so (`kernels.nvfp4_act`, the same bits as `formats`).
    self.site_kernel = record and self.fmt == "nvfp4" and self.plan.nvfp4_sites == "kernel"
    self.taps: dict[int, dict[str, Any]] = {}

  def guided_sites(self, layer: int) -> tuple[str, ...]:
    """The sites of `layer` that round under guidance in this forward (sorted)."""
    if layer in self.config.guided_layers:
      return tuple(sorted(self.guidance.get(layer, {})))
    return ()

  def view(self, layer: int, guidance: Mapping[str, Guidance] | None) -> Precision:
    """This context for one layer inside a scan over layers alike: `layer` stands for each of
    them, `guidance` is the current layer's (a slice of the stacked records), and the taps
    start empty (the scan stacks them)."""
    v = copy.copy(self)
    v.guidance = {} if guidance is None else {layer: guidance}
    v.taps = {}
    return v

  # --------------------------------------------------------------------------- activations

  def site_guidance(self, layer: int, name: str) -> Guidance | None:
    """The guidance of `layer`'s site `name` in this forward, or None."""
    if layer in self.config.guided_layers:
      return self.guidance.get(layer, {}).get(name)
    return None

  def _kernel_site(self, x: jax.Array, tap: bool
                   ) -> tuple[jax.Array, Guidance | None, formats.NVFP4Tensor]:
    """An unguided NVFP4 site on the site kernel (`site_kernel`): (y, record or None, q). A
    compact record takes its mantissa bits from the kernel."""
    compact = tap and self.tap_mode == "compact"
    y, q, *bits = quantize_rows(x, mantissa=compact)
    return y, guided.record(q, self.tap_mode, *bits) if tap else None, q

  def _quantize(self, x: jax.Array, g: Guidance | None, tap: bool,
                guided_rows: jax.Array | None = None) -> tuple[jax.Array, Guidance | None]:
    """FP4 quantize-dequantize of rows x [..., K] (guided where g is given) and its record.

    guided_rows [...]: rows that take the guidance; the others round RTN with their own
    scales (expert_mid slots whose expert the rollout did not select).
    Without a tap this is the `qat` operator itself (or, by the plan's `fake_quant`, the
    kernels: `rtn_kernel_site`, or a compact record's rounding in `guided_kernel_site`; the
    same bits). With a tap, one quantization feeds both the output and the record (the
    quantizers are costly to compile); its output equals the `qat` operator's bit for bit and
    has the same straight-through BF16 gradient.
    """
    fmt = self.fmt
    if g is None and self.site_kernel:
      return self._kernel_site(x, tap)[:2]
    if not tap:
      if g is None:
        if self.record:
          return qat.qdq_act(x, fmt).astype(x.dtype), None
        if self.plan.fake_quant == "kernel" and fmt == "nvfp4":
          return rtn_kernel_site(x), None
        return qat.fake_quant_act(x, fmt), None
      if self.plan.fake_quant == "kernel" and g.format == "nvfp4" and g.mantissa is not None:
        return guided_kernel_site(x, g, guided_rows), None
      y = qat.fake_quant_act_guided(x, g)
      if guided_rows is not None:
        y = jnp.where(guided_rows[..., None], y, qat.fake_quant_act(x, fmt))
      return y, None
    xs = jax.lax.stop_gradient(x)
    rtn = lambda: formats.fp4_quantize_act(xs, fmt)
    q = rtn() if g is None else guided.guided_quantize(xs, g)
    if g is not None and guided_rows is not None:
      pick = lambda a, b: jnp.where(
          guided_rows.reshape(guided_rows.shape + (1,) * (a.ndim - guided_rows.ndim)), a, b)
      q = jax.tree.map(pick, q, rtn())
    y = formats.fp4_dequantize(q).astype(x.dtype)
    return (y if self.record else qat.straight_through(x, y)), guided.record(q, self.tap_mode)

  def site(self, layer: int, name: str, x: jax.Array, row_order: jax.Array | None = None,
           row_inverse: jax.Array | None = None, tap_shape: tuple[int, ...] | None = None,
           experts: jax.Array | None = None,
           rollout_experts: jax.Array | None = None) -> jax.Array:
    """Quantizes activation rows x [..., K] at a TRACE site (identity unless an FP4 policy).

    row_order: x's rows are the tap layout's rows gathered by `row_order` (expert_mid is
    computed sorted by expert, its guidance and taps are in token/slot order); x is then
    [M, K] and tap_shape the tap layout's leading shape. row_inverse: its inverse
    (`grouped.inverse_permutation`, which the dispatch already has for its own way back), to
    put the record back; given with row_order.
    experts / rollout_experts: for expert_mid, this forward's and the rollout's expert ids
    [B, S, top_k] (tap_shape). Guidance rows belong to the rollout's (token, expert) pairs, so
    each slot takes the rollout slot that routed the same expert; a slot whose expert the
    rollout did not select rounds RTN with its own scales.
    """
    if (row_order is None) != (row_inverse is None):
      raise ValueError(f"layer {layer}: {name}: row_order and row_inverse go together")
    if not self.fp4:
      return x
    x = dtype_rounded(x)
    g = self.site_guidance(layer, name)
    guided_rows = None
    if g is not None and experts is not None:
      if rollout_experts is None:
        raise ValueError(f"layer {layer}: {name} guidance needs the rollout's expert ids "
                         "(`routing`), to match guidance rows to experts")
      src, guided_rows = match_experts(experts, rollout_experts)
      g = jax.tree.map(lambda a: jnp.take_along_axis(
          a, src.reshape(src.shape + (1,) * (a.ndim - src.ndim)), axis=src.ndim - 1), g)
    if g is not None and row_order is not None:
      g = jax.tree.map(lambda a: a.reshape((-1,) + a.shape[len(tap_shape):])[row_order], g)
      if guided_rows is not None:
        guided_rows = guided_rows.reshape(-1)[row_order]
    y, rec = self._quantize(x, g, layer in self.tap_layers, guided_rows)
    if rec is not None:
      if row_order is not None:  # back to token/slot order: one gather
        rows, layout = byte_rows.pack(rec, lead=1)
        rows = rows[row_inverse]
        rec = byte_rows.unpack(rows.reshape(tap_shape + rows.shape[1:]), layout)
      self.taps.setdefault(layer, {})[name] = rec
    return y

  def kv_site(self, layer: int, k: jax.Array, v: jax.Array, codes: bool = False
              ) -> tuple[jax.Array, ...]:
    """Sites `k` and `v` ([B, S, G, H], rows per (token, kv head)) quantized in one call.

    codes: also return their NVFP4 quantization (qk, qv), what a packed KV cache stores
    (`kernels.kv_cache`); NVFP4 forwards without guidance only. The values returned are its
    dequantization either way, bit for bit."""
    if not self.fp4:
      return k, v
    gk, gv = self.site_guidance(layer, "k"), self.site_guidance(layer, "v")
    if (gk is None) != (gv is None):
      raise ValueError(f"layer {layer}: guidance for one of k/v only; give both or neither")
    g = None if gk is None else jax.tree.map(lambda a, b: jnp.stack([a, b]), gk, gv)
    x = dtype_rounded(jnp.stack([k, v]))
    if codes:
      if self.fmt != "nvfp4" or g is not None:
        raise ValueError("kv_site(codes=True): NVFP4 forwards without guidance only")
      if self.site_kernel:
        y, rec, q = self._kernel_site(jax.lax.stop_gradient(x), layer in self.tap_layers)
      else:
        q = formats.fp4_quantize_act(jax.lax.stop_gradient(x), self.fmt)
        y = formats.fp4_dequantize(q).astype(x.dtype)  # `_quantize`'s values, bit for bit
        rec = guided.record(q, self.tap_mode) if layer in self.tap_layers else None
      y = y if self.record else qat.straight_through(x, y)
    else:
      y, rec = self._quantize(x, g, layer in self.tap_layers)
    if rec is not None:
      taps = self.taps.setdefault(layer, {})
      taps["k"], taps["v"] = (jax.tree.map(lambda a, i=i: a[i], rec) for i in (0, 1))
    if codes:
      qk, qv = (jax.tree.map(lambda a, i=i: a[i], q) for i in (0, 1))
      return y[0], y[1], qk, qv
    return y[0], y[1]

  def kv_append(self, layer: int, k: jax.Array, v: jax.Array, cache: PackedKVCache,
                positions: jax.Array, index: jax.Array) -> PackedKVCache | None:
    """Sites `k` and `v` of a one-token kernel decode step fused with the packed cache's
    write (the plan's kv_write="kernel", `kernels.kv_append`): the run's cache stack `cache`
    with k, v [B, 1, G, H] quantized and written at positions [B, 1] of layer `index`, in
    place, and the sites' records where the layer is tapped; the same bits as
    `kv_site(codes=True)` then `kv_cache.write_quantized`. None where the layer takes that
    path instead: another plan, or guidance at the layer."""
    fused = (self.plan.kv_write == "kernel" and self.fmt == "nvfp4"
             and self.site_guidance(layer, "k") is None
             and self.site_guidance(layer, "v") is None)
    if not fused:
      return None
    tap = self.tap_mode if layer in self.tap_layers else None
    k, v = dtype_rounded(k), dtype_rounded(v)
    out = batch_local.on_batch_shards(
        lambda c, a, b, p, i: kv_append.append(c, a, b, p, i, tap=tap),
        (cache, k, v, positions, index), (1, 0, 0, 0, None), k.shape[0], out_dim=1)
    if tap is None:
      return out
    out, rec = out
    taps = self.taps.setdefault(layer, {})
    taps["k"], taps["v"] = (jax.tree.map(lambda a, i=i: a[i], rec) for i in (0, 1))
    return out

  def tap_route(self, layer: int, ids: jax.Array) -> None:
    """Records a layer's routed expert ids [B, S, top_k] (every layer, when tap_routing)."""
    if self.tap_routing:
      self.taps.setdefault(layer, {})["routing"] = ids

  # --------------------------------------------------------------------------- weights

  def expert_weights(self, gate: jax.Array, up: jax.Array,
                     down: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """FP4 fake-quantized routed expert weights [E, F, D], [E, F, D], [E, D, F] (the FP8
    linears quantize their weights inside `grouped`), gate and up under one second-level
    scale per expert: XLA's quantizer or, by the plan's `fake_quant`, one kernel per weight
    (`fake_quant_weights_kernel`, the same bits)."""
    if not self.fp4:
      return gate, up, down
    if self.fmt == "nvfp4" and self.plan.fake_quant == "kernel" and _weights_local():
      return fake_quant_weights_kernel((gate, up)) + fake_quant_weights_kernel((down,))
    f = gate.shape[1]
    gate_up = qat.fake_quant_weight(jnp.concatenate([gate, up], axis=1), self.fmt)
    return gate_up[:, :f], gate_up[:, f:], qat.fake_quant_weight(down, self.fmt)

  def expert_hidden(self, rows: jax.Array, gate: jax.Array, up: jax.Array,
                    group_sizes: jax.Array) -> jax.Array:
    """silu(rows @ gate^T) * (rows @ up^T) of expert rows [M, D] sorted by expert, with the
    (already `expert_weights`-quantized) gate, up [E, F, D]: under FP8 linears one grouped GEMM
    of gate and up stacked (the same 128x128 blocks as two), else two, as the recorded BF16 and
    FP4 results ran them."""
    if self.fp8:
      gu = self.grouped(rows, jnp.concatenate([gate, up], axis=1), group_sizes)
      return swiglu(gu)
    if self.plan.invariant:
      return invariant.silu_mul(self.grouped(rows, gate, group_sizes),
                                self.grouped(rows, up, group_sizes))
    return jax.nn.silu(self.grouped(rows, gate, group_sizes)) * self.grouped(rows, up,
                                                                            group_sizes)

  def linear(self, x: jax.Array, w: jax.Array | formats.FP8Tensor,
             layer: jax.Array | None = None) -> jax.Array:
    """x [..., in] @ w [out, in]^T of an attention projection: an FP8 GEMM (1x128 input groups,
    128x128 weight blocks) in forwards with FP8 linears, else the compute dtype's matmul.
    w may be the rollout engine's already quantized weight (`expert_weights.prepare`); with
    `layer`, the stack of its run's layers [L, out, in], read at that layer."""
    p = self.plan
    if isinstance(w, formats.FP8Tensor):
      return fp8_linear.apply(x, w, p.fp8_gemm, layer=layer)
    if layer is not None:
      raise ValueError("Precision.linear: layer= is for the engine's FP8 weights")
    if not self.fp8:
      return self.matmul(x, w)
    return fp8_linear.linear(x, w, p.fp8_gemm, "fp8" if self.config.fp8_backward else "bf16",
                             p.fp8_bwd_operands)

  def matmul(self, x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., in] @ w [out, in]^T in x's dtype, the compute dtype's matmul of the plan (the
    invariant plan's sums in K order, `kernels.invariant`)."""
    if self.plan.invariant:
      return invariant.matmul(x, w)
    return jnp.einsum("...i,oi->...o", x, w)

  def linears(self, x: jax.Array, ws: list[jax.Array | formats.FP8Tensor]) -> list[jax.Array]:
    """Several projections [out_i, in] of one input (q, k, v): under FP8 linears one GEMM of
    the stacked weights (x quantized once; every out_i is a multiple of 128, so the weight
    blocks are those of each apart, and each output the same sum), else one matmul each. The
    engine's weights, quantized apart once per update, run apart (stacking them would copy
    them at every step)."""
    if not self.fp8 or any(isinstance(w, formats.FP8Tensor) for w in ws):
      return [self.linear(x, w) for w in ws]
    ends = np.cumsum([w.shape[0] for w in ws])[:-1].tolist()
    return jnp.split(self.linear(x, jnp.concatenate(ws, axis=0)), ends, axis=-1)

  def grouped(self, rows: jax.Array, w: jax.Array | formats.FP8Tensor,
              group_sizes: jax.Array, layer: jax.Array | None = None) -> jax.Array:
    """Expert rows [M, in] sorted by expert times w [E, out, in]: FP8 in forwards with FP8
    linears (w possibly already quantized, as `linear`, also with `layer`), else the compute
    dtype's grouped matmul (the plan's `moe_impl`)."""
    p = self.plan
    if isinstance(w, formats.FP8Tensor):
      return fp8_linear.apply(rows, w, p.fp8_gemm, group_sizes, p.moe_impl, layer)
    if layer is not None:
      raise ValueError("Precision.grouped: layer= is for the engine's FP8 weights")
    if not self.fp8:
      return grouped_matmul(rows, w, group_sizes, p.grouped)
    return fp8_linear.grouped(rows, w, group_sizes, p.fp8_gemm,
                              "fp8" if self.config.fp8_backward else "bf16", p.moe_impl,
                              p.fp8_bwd_operands)


def _weights_local() -> bool:
  """Whether the weights are this device's whole arrays: off a mesh, or inside a shard_map
  body (the expert-parallel block's). A kernel is one custom call, which the SPMD partitioner
  would gather to every device."""
  return mesh_context.entered() is None or mesh_context.in_manual_body()


def fake_quant_weights_kernel(ws: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
  """NVFP4 fake quantization of expert weights ws [E, N_i, K] under one second-level scale
  per expert shared by all of them (`formats.nvfp4_shared_tensor_scale`), each weight by one
  kernel (`kernels.nvfp4_act.qdq_rows`) with `qat.straight_through`'s gradient: bit for bit
  `qat.fake_quant_weight` of the weights joined along N, without joining them."""
  consts = tuple(jax.lax.stop_gradient(w) for w in ws)
  ts = formats.nvfp4_shared_tensor_scale(consts, axes=(1, 2))          # [E, 1, 1]
  out = []
  for w, c in zip(ws, consts, strict=True):
    e, n, k = w.shape
    rows_ts = jnp.broadcast_to(ts.reshape(e, 1), (e, n)).reshape(e * n)
    y = nvfp4_act.qdq_rows(c.reshape(e * n, k), rows_ts).reshape(w.shape)
    out.append(qat.straight_through(w, y))
  return tuple(out)


def _kernel_rows(x: jax.Array, kernel: Any, *row_args: Any) -> jax.Array:
  """kernel(rows, *row_args) over x's rows [..., K] (row_args: per-row operands, leading axis
  the rows), one call per batch shard, with `qat.straight_through`'s gradient."""
  rows = jax.lax.stop_gradient(x).reshape(-1, x.shape[-1])
  args = (rows,) + row_args
  y = batch_local.on_batch_shards(kernel, args, (0,) * len(args), rows.shape[0])
  return qat.straight_through(x, y.reshape(x.shape))


def rtn_kernel_site(x: jax.Array) -> jax.Array:
  """`qat.fake_quant_act(x, "nvfp4")` of rows x [..., K] (an unguided site) on one kernel per
  batch shard (`kernels.nvfp4_act.qdq_rows` under the rows' own scales): the same bits and
  straight-through gradient as XLA's quantizer."""
  return _kernel_rows(x, lambda r: nvfp4_act.qdq_rows(r))


def guided_kernel_site(x: jax.Array, g: Guidance, guided_rows: jax.Array | None = None
                       ) -> jax.Array:
  """`qat.fake_quant_act_guided(x, g)` of rows x [..., K] under a compact NVFP4 record, RTN on
  the rows outside `guided_rows` [...] where given, on one kernel per batch shard
  (`kernels.nvfp4_act.guided_qdq_rows`) with `qat.straight_through`'s gradient: the same bits
  and gradient as `Precision._quantize`'s XLA path."""
  lead = x.shape[:-1]
  n = int(np.prod(lead))
  g = jax.tree.map(lambda a: a.reshape((n,) + a.shape[len(lead):]), g)
  rtn = () if guided_rows is None else (~guided_rows.reshape(n),)
  return _kernel_rows(x, lambda r, gg, *t: nvfp4_act.guided_qdq_rows(r, gg, *t), g, *rtn)


def quantize_rows(x: jax.Array, mantissa: bool = False) -> tuple[Any, ...]:
  """`kernels.nvfp4_act.quantize_rows` of rows x [..., K] (the kernel takes [M, K]):
  (y, q) or, with `mantissa`, (y, q, bits), every field in x's leading shape."""
  lead, k = x.shape[:-1], x.shape[-1]
  rows = x.reshape(-1, k)  # on a mesh: each device its own rows (`batch_local`)
  y, *rest = batch_local.on_batch_shards(
      lambda r: nvfp4_act.quantize_rows(r, mantissa=mantissa), (rows,), (0,), rows.shape[0])
  return (y.reshape(x.shape),) + tuple(
      jax.tree.map(lambda a: a.reshape(lead + a.shape[-1:]), r) for r in rest)


def swiglu(gu: jax.Array, fixed_order: bool = False) -> jax.Array:
  """silu(gate) * up of gate and up stacked on the last axis [..., 2F] (fixed_order: the
  invariant plan's `kernels.invariant.silu_mul`)."""
  f = gu.shape[-1] // 2
  if fixed_order:
    return invariant.silu_mul(gu[..., :f], gu[..., f:])
  return jax.nn.silu(gu[..., :f]) * gu[..., f:]


def match_experts(experts: jax.Array, rollout_experts: jax.Array
                  ) -> tuple[jax.Array, jax.Array]:
  """Per slot [..., K]: the rollout slot that routed the same expert, and whether one did."""
  eq = experts[..., :, None] == rollout_experts[..., None, :].astype(experts.dtype)
  return jnp.argmax(eq, axis=-1), jnp.any(eq, axis=-1)
