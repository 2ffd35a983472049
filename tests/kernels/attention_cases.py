"""Shared cases and checks of the decode-attention kernel tests (`test_decode_attention`, the exact
pair; `test_flash_decode`, the single-pass kernel): the shapes, K/V rows from one quantized pool,
caches written at permuted positions, `attend` on the CPU device as the reference, and the
stated tolerance."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.kernels import decode_attention as da
from trace_jax.kernels import kv_cache
from trace_jax.quant import formats

CPU = jax.devices("cpu")[0]
# The packed cache's codes layout where a test does not choose one: the kernel plan's default
# here (words on the GPU, bytes in interpret mode).
DEFAULT_WORDS = jax.default_backend() == "gpu"


def on_cpu(fn, *args):
  """fn(*args) computed on the CPU backend (numpy results)."""
  with jax.default_device(CPU):
    out = fn(*jax.device_put(args, CPU))
  return jax.tree.map(np.asarray, out)


def bits(x) -> np.ndarray:
  x = np.asarray(x)
  return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


quantize_rows = jax.jit(kv_cache.quantize_rows)


# name: (B, T, G, N, H, lengths, block_t, num_splits); R = N // G in {1, 2, 4, 8, 16}.
ATTN_CASES = {
    "len1_r4": (2, 64, 2, 8, 64, [1, 1], 16, 1),
    "nonmultiple_mqa_r1": (2, 50, 1, 1, 32, [37, 50], 16, 2),
    "full_r8": (2, 128, 4, 32, 128, [128, 128], 64, 1),
    "mixed_lengths_r2_split3": (4, 100, 2, 4, 64, [1, 37, 64, 100], 32, 3),
    "mqa_r16_unpadded": (2, 40, 1, 16, 64, [40, 17], 16, 1),
}


POOL = 1024  # rows per head_dim, quantized once (CPU compiles of the quantizer are slow)


@functools.cache
def pool(h: int) -> tuple[np.ndarray, formats.NVFP4Tensor]:
  """Raw bf16 K/V rows [2, POOL, h] and their NVFP4, as numpy (rows quantize independently,
  so slices of it are what `kv_cache.write` would store; numpy slicing compiles nothing)."""
  rng = np.random.default_rng(h)
  raw = jnp.asarray(rng.standard_normal((2, POOL, h)), jnp.bfloat16)
  return np.asarray(raw), jax.tree.map(np.asarray, quantize_rows(raw))


def attn_inputs(b, t, g, n, h, seed=0, q_scale=3.0):
  """q [B, N, H] (scores of std ~q_scale), K/V rows [B, T, G, H] as (raw, NVFP4) from the
  pool (a seed-dependent window), and per-sequence permuted write positions [B, T]."""
  rng = np.random.default_rng(seed)
  raw, q4 = pool(h)
  start = int(rng.integers(0, POOL - b * t * g + 1))
  take = lambda a, i: a[i, start:start + b * t * g].reshape((b, t, g) + a.shape[2:])
  kv = [(take(raw, i), jax.tree.map(lambda a, i=i: take(a, i), q4)) for i in (0, 1)]
  q = jnp.asarray(rng.standard_normal((b, n, h)) * q_scale, jnp.bfloat16)
  pos = np.stack([rng.permutation(t) for _ in range(b)])
  return q, kv, pos


def make_cache(kind, kv, pos, words: bool | None = None):
  """The cache holding rows kv (from `attn_inputs`) written at positions pos: "bf16" (raw
  values), "packed" (NVFP4; codes as words or bytes, None: the default here)."""
  (k, qk), (v, qv) = kv
  b, t, g, h = k.shape
  if kind == "bf16":
    bidx = np.arange(b)[:, None]
    ck, cv = np.zeros_like(k), np.zeros_like(v)
    ck[bidx, pos], cv[bidx, pos] = k, v
    return jnp.asarray(ck), jnp.asarray(cv)
  qk, qv = (jax.tree.map(jnp.asarray, x) for x in (qk, qv))
  words = DEFAULT_WORDS if words is None else words
  return kv_cache.write_quantized(kv_cache.init_packed_cache(b, t, g, h, words=words), qk, qv,
                                  jnp.asarray(pos))


def values_of(cache):
  """V as the kernel reads it (bf16)."""
  return (kv_cache.dequantize(cache, jnp.bfloat16)[1] if isinstance(cache, kv_cache.PackedKVCache)
          else cache[1])


@jax.jit
def _reference_f32(q, cache, lengths):
  return da.decode_attention_reference(q, cache, lengths).astype(jnp.float32)


def reference(q, cache, lengths):
  return on_cpu(_reference_f32, q, cache, lengths)


tolerance = jax.jit(da.output_tolerance, static_argnames=("num_heads",))


def check_within_tolerance(out, ref, v, lengths, n):
  out = np.asarray(out).astype(np.float32)
  assert np.all(np.isfinite(out))
  tol = on_cpu(lambda *a: tolerance(*a, num_heads=n), v, lengths, ref)
  err = np.abs(out - ref)
  worst = np.unravel_index(np.argmax(err / tol), err.shape)
  assert np.all(err <= tol), (f"max |err| / tol = {np.max(err / tol):.3g} at {worst}: "
                              f"out {out[worst]}, ref {ref[worst]}, tol {tol[worst]}")
  return float(np.max(err / tol))
