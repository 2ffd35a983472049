"""The fused full-sequence attention (`attention_math.fused_attend`) against the model's
attention (`attend`), forward and gradients: the XLA implementation of the same API on CPU, and
cuDNN's flash attention on a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax.kernels import attention_math

ON_GPU = jax.devices()[0].platform in ("gpu", "cuda")


def _qkv(b: int, s: int, n: int, g: int, h: int, dtype) -> tuple[jax.Array, ...]:
  keys = jax.random.split(jax.random.key(7), 3)
  shapes = [(b, s, n, h), (b, s, g, h), (b, s, g, h)]
  return tuple(jax.random.normal(k, shp, jnp.float32).astype(dtype)
               for k, shp in zip(keys, shapes))


def _loss(attn, q, k, v, w):
  return jnp.sum(attn(q, k, v).astype(jnp.float32) * w)


def _reference(q, k, v):
  pos = jnp.broadcast_to(jnp.arange(q.shape[1]), q.shape[:2])
  return attention_math.attend(q, k, v, pos, pos)


_CASES = [
    pytest.param(2, 16, 4, 2, 32, jnp.float32, 2e-5, id="gqa_float32"),
    pytest.param(2, 16, 4, 2, 32, jnp.bfloat16, 3e-2, id="gqa_bf16"),
    pytest.param(1, 24, 2, 2, 64, jnp.bfloat16, 3e-2, id="mha_bf16"),
    pytest.param(2, 16, 8, 1, 16, jnp.bfloat16, 3e-2, id="one_kv_head_bf16"),
]


def _check(impl: str, b, s, n, g, h, dtype, tol):
  q, k, v = _qkv(b, s, n, g, h, dtype)
  w = jax.random.normal(jax.random.key(3), (b, s, n, h))
  fused = lambda *a: attention_math.fused_attend(*a, implementation=impl)
  np.testing.assert_allclose(np.asarray(jax.jit(fused)(q, k, v), np.float32),
                             np.asarray(_reference(q, k, v), np.float32), atol=tol, rtol=tol)
  grads = jax.jit(jax.grad(lambda *a: _loss(fused, *a, w), argnums=(0, 1, 2)))(q, k, v)
  want = jax.grad(lambda *a: _loss(_reference, *a, w), argnums=(0, 1, 2))(q, k, v)
  for name, got, ref in zip("qkv", grads, want):
    ref = np.asarray(ref, np.float32)
    scale = max(1.0, float(np.max(np.abs(ref))))
    np.testing.assert_allclose(np.asarray(got, np.float32), ref, atol=tol * scale, rtol=tol,
                               err_msg=f"d{name}")


@pytest.mark.parametrize("b,s,n,g,h,dtype,tol", _CASES)
def test_fused_attention_api_matches_attend(b, s, n, g, h, dtype, tol):
  """The same API, on XLA: causal by index, GQA head mapping and scale as `attend`'s."""
  _check("xla", b, s, n, g, h, dtype, tol)


@pytest.mark.skipif(not ON_GPU, reason="cuDNN's fused attention runs on a GPU")
@pytest.mark.parametrize("b,s,n,g,h,dtype,tol", [c for c in _CASES if "bf16" in c.id])
def test_cudnn_attention_matches_attend(b, s, n, g, h, dtype, tol):
  _check("cudnn", b, s, n, g, h, dtype, tol)


def test_causal_by_index_ignores_later_keys():
  """Changing the last key and value moves only the last query's output."""
  q, k, v = _qkv(1, 8, 2, 1, 16, jnp.float32)
  fused = lambda *a: attention_math.fused_attend(*a, implementation="xla")
  a = fused(q, k, v)
  b = fused(q, k.at[:, -1].add(1.0), v.at[:, -1].add(1.0))
  np.testing.assert_array_equal(np.asarray(a[:, :-1]), np.asarray(b[:, :-1]))
  assert not np.allclose(np.asarray(a[:, -1]), np.asarray(b[:, -1]))
