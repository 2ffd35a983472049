"""Fake-quantization operators (`trace_jax.quant.qat`): forward, transformations, gradients.

One jitted program per (format, dtype) evaluates every transformation at once (jit, vmap,
grad, remat, value_and_grad, per-example grads), so each format compiles once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import cases
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import trace_jax.quant as quant
from trace_jax.quant import qat

FORMATS = ["nvfp4", "mxfp4", "fp8"]
DTYPES = ["float32", "bfloat16"]


def _explicit(x: jax.Array, fmt: str, kind: str) -> jax.Array:
  """quantize -> dequantize through the public format API, in x's dtype."""
  if fmt == "nvfp4":
    ts = quant.nvfp4_row_scale(x) if kind == "act" else quant.nvfp4_tensor_scale(x, (-2, -1))
    out = quant.nvfp4_dequantize(quant.nvfp4_quantize(x, ts))
  elif fmt == "mxfp4":
    out = quant.mxfp4_dequantize(quant.mxfp4_quantize(x))
  else:
    q = quant.fp8_quantize_act(x) if kind == "act" else quant.fp8_quantize_weight(x)
    out = quant.fp8_dequantize(q)
  return out.astype(x.dtype)


def _program(fmt: str, with_vmap: bool) -> Callable:
  """Everything the tests check, for activations [2, R, K] and stacked weights [2, N, K]
  (vmap of the forward only where asked: it is a second copy of the quantizer to compile)."""
  fq = {"act": lambda v: quant.fake_quant_act(v, fmt),
        "weight": lambda v: quant.fake_quant_weight(v, fmt)}

  def run(xs, cs, ds):
    out = {}
    for kind, f in fq.items():
      x, c, d = xs[kind], cs[kind], ds[kind]
      loss = lambda v, f=f, c=c: jnp.sum((f(v) * c).astype(jnp.float32))
      out[kind] = {
          "forward": f(x),
          "explicit": _explicit(x, fmt, kind),
          "grad": jax.grad(loss)(x),
          "remat_grad": jax.grad(jax.checkpoint(loss))(x),
          "remat_op_grad": jax.grad(
              lambda v, f=f, c=c: jnp.sum((jax.checkpoint(f)(v) * c).astype(jnp.float32)))(x),
          "value": jax.value_and_grad(loss)(x)[0],
          "fanout_grad": jax.grad(lambda v, f=f, c=c, d=d: jnp.sum(
              (f(v) * c + v * d).astype(jnp.float32)))(x),
          "per_example_grad": jax.vmap(jax.grad(
              lambda v, ci, f=f: jnp.sum((f(v[None])[0] * ci).astype(jnp.float32))))(x, c),
      }
      if with_vmap:
        out[kind]["vmap"] = jax.vmap(f)(x)
    return out

  return jax.jit(run)


@functools.cache
def _inputs(dtype: str) -> tuple[dict, dict, dict]:
  arr, _ = cases.stacked()
  rng = np.random.default_rng(12)
  xs = {"act": arr[0:2], "weight": arr[2:4]}
  cs = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in xs.items()}
  ds = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in xs.items()}
  conv = (lambda a: cases.to_bf16(a)) if dtype == "bfloat16" else (lambda a: np.asarray(a))
  return ({k: conv(v) for k, v in xs.items()}, {k: conv(v) for k, v in cs.items()},
          {k: conv(v) for k, v in ds.items()})


@functools.cache
def _results(fmt: str, dtype: str) -> dict:
  xs, cs, ds = _inputs(dtype)
  out = _program(fmt, dtype == "float32")(*(jax.tree.map(jnp.asarray, t) for t in (xs, cs, ds)))
  return jax.tree.map(np.asarray, out)


def _bf16_round(a: np.ndarray) -> np.ndarray:
  return np.asarray(a).astype(ml_dtypes.bfloat16).astype(np.asarray(a).dtype)


CASES = [(f, d, k) for f in FORMATS for d in DTYPES for k in ("act", "weight")]
IDS = [f"{f}-{d}-{k}" for f, d, k in CASES]


@pytest.mark.parametrize(("fmt", "dtype", "kind"), CASES, ids=IDS)
def test_forward_is_quantize_dequantize(fmt: str, dtype: str, kind: str) -> None:
  r = _results(fmt, dtype)[kind]
  xs, _, _ = _inputs(dtype)
  assert r["forward"].dtype == np.dtype(dtype)
  cases.assert_bits_equal(r["forward"], r["explicit"], f"{fmt} {kind} forward vs qdq",
                          {"x": xs[kind]})
  if "vmap" in r:
    cases.assert_bits_equal(r["vmap"], r["forward"], f"{fmt} {kind} vmap vs batched")
  terms = r["forward"].astype(np.float64) * _inputs(dtype)[1][kind].astype(np.float64)
  tol = 1e-5 if dtype == "float32" else 2.0**-8  # XLA may or may not round products to bf16
  np.testing.assert_allclose(r["value"], terms.sum(), rtol=0, atol=tol * np.abs(terms).sum())
  assert np.mean(r["forward"] != xs[kind]) > 0.5  # the forward really quantizes


@pytest.mark.parametrize(("fmt", "dtype", "kind"), CASES, ids=IDS)
def test_gradient_is_straight_through_bf16(fmt: str, dtype: str, kind: str) -> None:
  """grad of sum(f(x) * c) is c rounded to bf16, in x's dtype; also under remat, fan-out
  (the cotangents of one dtype add up) and vmap of per-example grads."""
  r = _results(fmt, dtype)[kind]
  _, cs, ds = _inputs(dtype)
  c = np.asarray(cs[kind])
  want = _bf16_round(c)
  for name in ("grad", "remat_grad", "remat_op_grad", "per_example_grad"):
    assert r[name].dtype == np.dtype(dtype), (name, r[name].dtype)
    cases.assert_bits_equal(r[name], want, f"{fmt} {kind} {name}", {"c": c})
  d = np.asarray(ds[kind])
  fan = (want.astype(np.float32) + d.astype(np.float32)).astype(want.dtype)
  assert r["fanout_grad"].dtype == np.dtype(dtype)
  cases.assert_bits_equal(r["fanout_grad"], fan, f"{fmt} {kind} fan-out grad")
  if dtype == "float32":
    assert np.any(want != c)  # the rounding to bf16 is visible


# ----------------------------------------------------------------------------- guided

@functools.cache
def _guided_results(mode: str) -> dict:
  arr, _ = cases.stacked()
  x_r, x_t = jnp.asarray(arr[0:2]), jnp.asarray(cases.stacked_train()[0:2])
  c = jnp.asarray(np.random.default_rng(13).standard_normal(x_t.shape).astype(np.float32))

  def run(x_r, x_t, c):
    _, g = quant.quantize_act_record(x_r, mode)
    loss = lambda v, rs, bs: jnp.sum(quant.fake_quant_act_guided(
        v, g.replace(row_scale=rs, block_scale=bs)) * c)
    grads = jax.grad(loss, argnums=(0, 1, 2))(x_t, g.row_scale, g.block_scale)
    vm = jax.vmap(lambda v, gg: quant.fake_quant_act_guided(v, gg))(x_t, g)
    remat = jax.grad(lambda v: jnp.sum(jax.checkpoint(
        lambda u: quant.fake_quant_act_guided(u, g))(v) * c))(x_t)
    return {"forward": quant.fake_quant_act_guided(x_t, g),
            "explicit": quant.nvfp4_dequantize(quant.guided_quantize(x_t, g)),
            "vmap": vm, "grad_x": grads[0], "grad_row_scale": grads[1],
            "grad_block_scale": grads[2], "remat_grad": remat}

  return jax.tree.map(np.asarray, jax.jit(run)(x_r, x_t, c)) | {"c": np.asarray(c)}


@pytest.mark.parametrize("mode", ["compact", "full"])
def test_guided_fake_quant(mode: str) -> None:
  """Forward equals guided_quantize -> dequantize (also under vmap); the gradient is
  straight-through bf16 for x (also under remat) and nothing flows to the guidance."""
  r = _guided_results(mode)
  cases.assert_bits_equal(r["forward"], r["explicit"], f"guided {mode} forward")
  cases.assert_bits_equal(r["vmap"], r["forward"], f"guided {mode} vmap")
  want = _bf16_round(r["c"])
  cases.assert_bits_equal(r["grad_x"], want, f"guided {mode} grad x")
  cases.assert_bits_equal(r["remat_grad"], want, f"guided {mode} remat grad x")
  assert np.all(r["grad_row_scale"] == 0)
  assert np.all(r["grad_block_scale"].astype(np.float32) == 0)


def test_grad_dtype_constant() -> None:
  assert qat.GRAD_DTYPE == jnp.bfloat16
