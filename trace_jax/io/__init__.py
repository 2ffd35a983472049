"""Checkpoint I/O: HF safetensors (bf16/f32 and ModelOpt NVFP4) and orbax.

Submodules are imported on use (`trace_jax.io.hf`, `trace_jax.io.orbax_ckpt`), so importing
one format does not pull in the others' dependencies.
"""
