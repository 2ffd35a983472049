"""Pallas kernels of the rollout's decode and of training's grouped and FP8 GEMMs (Triton and
Mosaic GPU lowerings on the GPU, `interpret=True` on CPU).

XLA neither fuses FP4 weight dequantization into matmuls nor reads packed FP4 bytes inside a
GEMM (docs/numerics.md), so decode speed with packed weights needs kernels. The kernels import
no model code and keep no switches: which of them a program runs is the model's kernel plan
(`trace_jax.model.plan`), and the caller passes each kernel its options.
`fp4_moe`: packed NVFP4 expert weights and the decode-time MoE grouped matmul (`DecodeConfig`).
`kv_cache` + `decode_attention`: packed NVFP4 KV cache and split-K decode attention
  (`AttentionConfig`), with `attention_math`, the attention numerics shared with the model.
`fp4_decode`: the in-register NVFP4 decoder of the Triton kernels (byte tables + prmt);
  `wgmma_decode`, `wgmma_moe`, `wgmma_attention`: Hopper's wgmma kernels (Mosaic GPU).
`nvfp4_act`: an NVFP4 activation site in one kernel. `grouped_gemm`: training's grouped GEMMs.
`fp8_gemm`: block-scaled FP8 GEMMs. `common`: the Pallas helpers the kernels share.
`invariant`: plain-JAX operations whose rows do not depend on the batch, sequence or cache
  length (the kernel plan's "invariant" preset: sums in a fixed order).
"""
