"""The torch compute path of `trace_nvfp4`: NVFP4 routed experts with FP4 activations emulated
by exact quantize-dequantize, and NVFP4 K/V rows. Plain torch, CPU or GPU; no SGLang import.

Every quantization goes through the torch twin (`rollout_bridge.torch_quant`) and happens at
the places `trace_jax.model` quantizes (precision.py, moe.py, attention.py), so codes and scales
are bit-identical to the JAX side:
- expert weights: NVFP4 two-level, one second-level scale per expert over the whole matrix;
  gate and up share it because SGLang's fused w13 [E, 2I, H] is quantized as one matrix, as
  the JAX model quantizes concat([gate, up]);
- `moe_in`: the token rows entering the routed experts, per-row second-level scale over H;
- `expert_mid`: each (token, top-k slot) row entering the down projection, scale over I;
- `k` / `v`: each (token, kv head) row over head_dim, after RoPE, before the KV cache.
Dequantized values are float32 `code * block_scale * second_level_scale`, cast to the compute
dtype, exactly as the JAX model casts them: this is the Hopper emulation of W4A4 (Hopper has no
FP4 tensor cores; SGLang's own NVFP4 on SM90 is weight-only Marlin). Codes keep the sign of zero
(code 8 for a negative value that rounds to zero, docs/numerics.md), so `NVFP4Experts.packed`
holds the bytes of `trace_jax.io.hf.save_nvfp4_checkpoint` and of ModelOpt checkpoints.

Activation quantization passes `allow_nonfinite=True` to the twin: no host synchronisation per
call (the twin's non-finite check reads a count back), and a non-finite row dequantizes to NaN.
Measured on an H200 (torch 2.11): weight and `moe_in` codes and scales are bit-identical on CUDA
and CPU in float32 and bfloat16. None of this can be captured in a CUDA graph yet: the twin's
`e2m1_encode` copies its grid from pageable host memory on every call (capture raises), and
`moe_forward` reads per-expert row counts on the host.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from rollout_bridge import torch_quant as tq


@dataclasses.dataclass
class NVFP4Experts:
  """A stack of NVFP4 expert matrices [E, N, K] in the ModelOpt layout, plus their dequantized
  compute copy. packed: uint8 [E, N, K/2] (two codes per byte, element 2i low nibble);
  block_scale: float8_e4m3fn [E, N, K/16]; tensor_scale: float32 [E]."""
  dequantized: torch.Tensor
  packed: torch.Tensor
  block_scale: torch.Tensor
  tensor_scale: torch.Tensor

  def codes(self) -> torch.Tensor:
    """One uint8 E2M1 code per element, [E, N, K]."""
    return tq.unpack_fp4(self.packed)

  def quantized(self, expert: int) -> tq.NVFP4Tensor:
    """Expert `expert` as the twin's NVFP4Tensor."""
    return tq.NVFP4Tensor(codes=tq.unpack_fp4(self.packed[expert]),
                          block_scale=self.block_scale[expert],
                          tensor_scale=self.tensor_scale[expert].reshape(1, 1))


def quantize_experts(w: torch.Tensor, dtype: torch.dtype | None = None,
                     out: torch.Tensor | None = None) -> NVFP4Experts:
  """NVFP4-quantizes stacked expert weights w [E, N, K] (contraction axis last), one expert at a
  time (the twin's temporaries are ~32 bytes per element), with one second-level scale per
  expert. The dequantized copy is written to `out` (may be `w` itself) or a new tensor of
  `dtype` (default w's). Raises on non-finite weights."""
  if w.dim() != 3:
    raise ValueError(f"quantize_experts: expected stacked weights [E, N, K], got {tuple(w.shape)}")
  e, n, k = w.shape
  if k % tq.NVFP4_BLOCK:
    raise ValueError(f"quantize_experts: contraction size {k} is not a multiple of "
                     f"{tq.NVFP4_BLOCK}")
  if out is None:
    out = torch.empty(w.shape, dtype=dtype or w.dtype, device=w.device)
  packed = torch.empty((e, n, k // 2), dtype=torch.uint8, device=w.device)
  block_scale = torch.empty((e, n, k // tq.NVFP4_BLOCK), dtype=torch.float8_e4m3fn,
                            device=w.device)
  tensor_scale = torch.empty((e,), dtype=torch.float32, device=w.device)
  for i in range(e):
    ts = tq.nvfp4_tensor_scale(w[i])                       # [1, 1]: amax over the matrix
    q = tq.nvfp4_quantize(w[i], ts)
    packed[i] = tq.pack_fp4(q.codes)
    block_scale[i] = q.block_scale
    tensor_scale[i] = ts.reshape(())
    out[i] = tq.nvfp4_dequantize(q).to(out.dtype)         # after the reads: out may alias w
  return NVFP4Experts(out, packed, block_scale, tensor_scale)


def qdq_rows(x: torch.Tensor) -> tuple[torch.Tensor, tq.NVFP4Tensor]:
  """NVFP4 quantize-dequantize of rows x [..., K] with a per-row second-level scale
  (docs/design.md §3.2,
  activations): the value in x's dtype and the quantization it came from."""
  q = tq.nvfp4_quantize(x, tq.nvfp4_row_scale(x), allow_nonfinite=True)
  return tq.nvfp4_dequantize(q).to(x.dtype), q


def reshape_quantized(q: tq.NVFP4Tensor, lead: tuple[int, ...]) -> tq.NVFP4Tensor:
  """q with its leading (row) dimensions reshaped to `lead`."""
  return tq.NVFP4Tensor(codes=q.codes.reshape(*lead, q.codes.shape[-1]),
                        block_scale=q.block_scale.reshape(*lead, q.block_scale.shape[-1]),
                        tensor_scale=q.tensor_scale.reshape(*lead, 1))


@dataclasses.dataclass
class MoEOutput:
  """out [T, H]; q_in: `moe_in` quantization (rows [T]); q_mid: `expert_mid` quantization
  (rows [T, top_k], token/slot order, as the JAX taps) of mid [T, top_k, I], the SwiGLU output
  before quantization."""
  out: torch.Tensor
  q_in: tq.NVFP4Tensor
  q_mid: tq.NVFP4Tensor
  mid: torch.Tensor


def moe_forward(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> MoEOutput:
  """Routed SwiGLU experts with NVFP4 activations, as `trace_jax.model.moe.MoE` computes them.

  x [T, H] (compute dtype); w13 [E, 2I, H] (gate rows then up rows) and w2 [E, H, I]: the
  dequantized NVFP4 expert weights; topk_ids [T, K] (ids outside [0, E), e.g. SGLang's -1 for
  experts on another expert-parallel rank, contribute nothing); topk_weights [T, K], cast to
  the compute dtype before the weighted sum, as the JAX router's weights are. Rows are grouped
  by expert (one loop over the experts that have rows; their counts are read on the host).
  """
  t, h = x.shape
  k = topk_ids.shape[1]
  e_count, inter = w2.shape[0], w2.shape[2]
  if w13.shape != (e_count, 2 * inter, h):
    raise ValueError(f"moe_forward: w13 {tuple(w13.shape)} does not match w2 {tuple(w2.shape)} "
                     f"and hidden size {h}")
  xq, q_in = qdq_rows(x)
  ids = topk_ids.reshape(-1).to(torch.int64)
  valid = (ids >= 0) & (ids < e_count)
  slot_token = torch.arange(t * k, device=x.device) // k
  order = torch.argsort(torch.where(valid, ids, e_count), stable=True)
  counts = torch.bincount(ids[valid], minlength=e_count).tolist()
  groups, start = [], 0
  for e, n in enumerate(counts):
    if n:
      groups.append((e, order[start:start + n]))
      start += n
  mid = x.new_zeros((t * k, inter))
  for e, rows in groups:
    gate_up = F.linear(xq[slot_token[rows]], w13[e])
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    mid[rows] = gate * torch.sigmoid(gate) * up       # jax.nn.silu(g) * u, same operation order
  midq, q_mid = qdq_rows(mid)
  y = x.new_zeros((t * k, h))
  for e, rows in groups:
    y[rows] = F.linear(midq[rows], w2[e])
  out = (y.reshape(t, k, h) * topk_weights.to(x.dtype).unsqueeze(-1)).sum(dim=1)
  return MoEOutput(out, q_in, reshape_quantized(q_mid, (t, k)), mid.reshape(t, k, inter))


def qdq_kv(k: torch.Tensor, v: torch.Tensor, num_kv_heads: int, head_dim: int,
           v_head_dim: int | None = None
           ) -> tuple[torch.Tensor, torch.Tensor, tq.NVFP4Tensor, tq.NVFP4Tensor]:
  """NVFP4 K/V as the JAX attention stores them in its cache: rows per (token, kv head), blocks
  and the second-level scale along head_dim. k [T, G * D] or [T, G, D] (any layout whose
  element order is token, head, dim); returns k, v in their input shapes and dtypes, and their
  quantizations with rows [T, G]."""
  v_head_dim = head_dim if v_head_dim is None else v_head_dim
  kq, qk = qdq_rows(k.reshape(-1, num_kv_heads, head_dim))
  vq, qv = qdq_rows(v.reshape(-1, num_kv_heads, v_head_dim))
  return kq.reshape(k.shape), vq.reshape(v.shape), qk, qv
