"""Pallas kernels for the rollout's decode hot paths (Triton lowering on GPU, interpret on CPU).

XLA neither fuses FP4 weight dequantization into matmuls nor reads packed FP4 bytes inside a
GEMM (shared/reference/platform_notes.md §2), so decode speed with packed weights needs kernels.
`fp4_moe`: packed NVFP4 expert weights and the decode-time MoE grouped matmul.
`kv_cache` + `decode_attention`: packed NVFP4 KV cache and split-K decode attention.
`fp4_decode`: the in-register NVFP4 decoder both kernels use on the GPU (byte tables + prmt).
"""
