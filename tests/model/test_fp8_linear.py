"""FP8 linear layers (`trace_jax.model.fp8_linear`): forward against the GEMM's reference,
gradients against the BF16 matmul of the fake-quantized operands, the FP8 backward (the
experts' FP8 WGrad included) against the BF16 one, and the kernel against the reference, also
inside the model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import pallas_calls

from trace_jax import model as M
from trace_jax.kernels import fp8_gemm
from trace_jax.model import fp8_linear, grouped, mesh_context, sharding
from trace_jax.quant import formats, qat

T, D, N, E = 200, 256, 384, 4  # T: not a multiple of 128 (the WGrad's 128x1 groups pad it)
GROUP_SIZES = (60, 0, 90, 50)


def _inputs(dtype=jnp.bfloat16, e=None):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((T, D)), dtype)
  shape = (N, D) if e is None else (e, N, D)
  w = jnp.asarray(rng.standard_normal(shape) * 0.05, dtype)
  dy = jnp.asarray(rng.standard_normal((T, N)), dtype)
  return x, w, dy


def _fake(x, w, gs=None):
  """The BF16 matmul of the fake-quantized operands (straight-through gradients)."""
  xq, wq = qat.fake_quant_act(x, "fp8"), qat.fake_quant_weight(w, "fp8")
  if gs is None:
    return jnp.einsum("mk,nk->mn", xq, wq)
  return grouped.grouped_matmul(xq, wq, gs, "tiled")


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("kind", ["dense", "grouped"])
def test_forward_is_the_gemm_and_bf16_backward_is_the_fake_quant_gradient(kind):
  gs = None if kind == "dense" else jnp.asarray(GROUP_SIZES, jnp.int32)
  x, w, dy = _inputs(e=None if kind == "dense" else E)
  op = ((lambda a, b: fp8_linear.linear(a, b, "xla")) if gs is None
        else (lambda a, b: fp8_linear.grouped(a, b, gs, "xla")))
  y, vjp = jax.vjp(op, x, w)
  qx, qw = formats.fp8_quantize_act(x), formats.fp8_quantize_weight(w)
  want = fp8_gemm.reference(qx, qw, gs, out_dtype=jnp.float32) if gs is None else \
      grouped.grouped_matmul(formats.fp8_dequantize(qx), formats.fp8_dequantize(qw), gs,
                             "tiled")
  np.testing.assert_array_equal(np.asarray(y, np.float32),
                                np.asarray(want.astype(jnp.bfloat16), np.float32))
  dx, dw = vjp(dy)
  _, fake_vjp = jax.vjp(lambda a, b: _fake(a, b, gs), x, w)
  fdx, fdw = fake_vjp(dy)
  np.testing.assert_array_equal(np.asarray(dx, np.float32), np.asarray(fdx, np.float32))
  np.testing.assert_array_equal(np.asarray(dw, np.float32), np.asarray(fdw, np.float32))


@pytest.mark.parametrize("kind", ["dense", "grouped"])
def test_kernel_matches_reference_and_shares_the_backward(kind):
  gs = None if kind == "dense" else jnp.asarray(GROUP_SIZES, jnp.int32)
  x, w, dy = _inputs(jnp.float32, e=None if kind == "dense" else E)
  outs = {}
  for impl in ("xla", "kernel"):  # "wgmma" runs on a Hopper GPU only
    op = ((lambda a, b, i=impl: fp8_linear.linear(a, b, i)) if gs is None
          else (lambda a, b, i=impl: fp8_linear.grouped(a, b, gs, i)))
    y, vjp = jax.vjp(op, x, w)
    outs[impl] = (y, *vjp(dy))
  (y0, dx0, dw0), (y1, dx1, dw1) = outs["xla"], outs["kernel"]
  assert _rel(y1, y0) < 1e-6  # float32 summation order only
  np.testing.assert_array_equal(np.asarray(dx1), np.asarray(dx0))
  np.testing.assert_array_equal(np.asarray(dw1), np.asarray(dw0))


@pytest.mark.parametrize("kind", ["dense", "grouped"])
def test_fp8_backward_is_near_the_bf16_backward_but_quantized(kind):
  gs = None if kind == "dense" else jnp.asarray(GROUP_SIZES, jnp.int32)
  x, w, dy = _inputs(e=None if kind == "dense" else E)
  grads = {}
  for bwd in fp8_linear.BACKWARDS:
    op = ((lambda a, b, k=bwd: fp8_linear.linear(a, b, "xla", k)) if gs is None
          else (lambda a, b, k=bwd: fp8_linear.grouped(a, b, gs, "xla", k)))
    _, vjp = jax.vjp(op, x, w)
    grads[bwd] = vjp(dy)
  (dx0, dw0), (dx1, dw1) = grads["bf16"], grads["fp8"]
  assert dx1.dtype == dx0.dtype == jnp.bfloat16 and dw1.dtype == dw0.dtype
  # E4M3 keeps 3 mantissa bits: relative errors of a few percent, not more.
  assert 1e-3 < _rel(dx1, dx0) < 0.08, _rel(dx1, dx0)
  assert 1e-3 < _rel(dw1, dw0) < 0.08, _rel(dw1, dw0)
  if gs is not None:  # an expert with no rows gets no gradient
    assert not np.any(np.asarray(dw1[1], np.float32))


def test_fp8_grouped_backward_kernel_matches_reference():
  """The experts' FP8 DGrad and WGrad: the kernels' gradients are the reference's up to float32
  summation order (float32 operands, so no output rounding hides or adds a difference)."""
  gs = jnp.asarray(GROUP_SIZES, jnp.int32)
  x, w, dy = _inputs(jnp.float32, e=E)
  grads = {}
  for impl in ("xla", "kernel"):  # "wgmma" runs on a Hopper GPU only
    _, vjp = jax.vjp(lambda a, b, i=impl: fp8_linear.grouped(a, b, gs, i, "fp8"), x, w)
    grads[impl] = vjp(dy)
  (dx0, dw0), (dx1, dw1) = grads["xla"], grads["kernel"]
  assert dw1.shape == w.shape and dw1.dtype == jnp.float32
  assert _rel(dx1, dx0) < 1e-6, _rel(dx1, dx0)
  assert _rel(dw1, dw0) < 1e-6, _rel(dw1, dw0)


@pytest.mark.parametrize("kind", ["dense", "grouped"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_fp8_backward_operands_kernel_changes_no_bit(dtype, kind):
  """The FP8 backward's operands made by `kernels.fp8_tiles` (operands "kernel": the experts'
  WGrad tiles in one pass, the DGrad's weight codes transposed by a kernel) give the gradients
  of XLA's gathers, transposes and quantizer bit for bit (an expert with no rows, rows past the
  groups); an unknown value is refused."""
  gs = None if kind == "dense" else jnp.asarray(GROUP_SIZES, jnp.int32)
  x, w, dy = _inputs(dtype, e=None if kind == "dense" else E)
  op = ((lambda a, b, o: fp8_linear.linear(a, b, "xla", "fp8", o)) if gs is None
        else (lambda a, b, o: fp8_linear.grouped(a, b, gs, "xla", "fp8", "tiled", o)))
  grads = {}
  for ops in fp8_linear.OPERANDS:
    _, vjp = jax.vjp(lambda a, b, o=ops: op(a, b, o), x, w)
    grads[ops] = vjp(dy)
  for want, got in zip(grads["xla"], grads["kernel"]):
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  with pytest.raises(ValueError, match="fp8_bwd_operands"):
    op(x, w, "transposed")


def test_fp8_grouped_backward_lays_out_the_wgrad_rows_by_gather():
  """The experts' FP8 backward on the kernels (the GPU path) pads each expert's rows of dy and x
  to whole 128-row tiles with gathers: no scatter of whole activations in its program, as in
  the BF16 backward's."""
  gs = jnp.asarray(GROUP_SIZES, jnp.int32)
  x, w, dy = _inputs(e=E)
  for bwd in fp8_linear.BACKWARDS:
    def backward(a, b, d, k=bwd):
      return jax.vjp(lambda u, v: fp8_linear.grouped(u, v, gs, "kernel", k, "kernel"), a, b)[1](d)

    program = str(jax.make_jaxpr(backward)(x, w, dy))
    assert "pallas_call" in program and "scatter" not in program, bwd


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices: run with "
                    "XLA_FLAGS=--xla_force_host_platform_device_count=8")
def test_dense_kernel_on_a_mesh_runs_on_each_devices_rows():
  """On a mesh (data 2 x expert 2, the rows split 4 ways: 128 each) the dense FP8 kernels run
  per device (forward, DGrad on its rows; WGrad on its own 128-row groups, float32 partials
  summed over the devices): every kernel inside a shard_map, y and dx the one-device kernel's
  bit for bit (each row's sum is the same), dw up to float32 summation order."""
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((512, D)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((N, D)) * 0.05, jnp.float32)
  dy = jnp.asarray(rng.standard_normal((512, N)), jnp.float32)

  def fwd_bwd(a, b, d):  # a new function per use: jit's trace cache does not see the mesh
    y, vjp = jax.vjp(lambda u, v: fp8_linear.linear(u, v, "kernel", "fp8"), a, b)
    return (y, *vjp(d))

  want = jax.jit(fwd_bwd)(x, w, dy)
  mesh = sharding.make_mesh(dict(data=2, expert=2), jax.devices()[:4])
  rows = lambda a: jax.device_put(a, sharding.activation_sharding(mesh, a.shape))
  on_mesh = lambda *a: fwd_bwd(*a)
  with mesh_context.use_mesh(mesh):
    calls = pallas_calls(jax.make_jaxpr(on_mesh)(x, w, dy).jaxpr)
    got = jax.jit(on_mesh)(rows(x), w, rows(dy))
  assert len(calls) == 3 and all(inside for _, inside in calls), calls
  for name, g, r in zip(("y", "dx"), got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(r), err_msg=name)
  assert _rel(got[2], want[2]) < 1e-6, _rel(got[2], want[2])


def test_fp8_backward_detects_a_wrong_gradient():
  """The closeness bound above fails for a gradient of the wrong operand (it can fail)."""
  x, w, dy = _inputs()
  _, vjp = jax.vjp(lambda a, b: fp8_linear.linear(a, b, "xla", "fp8"), x, w)
  dx, _ = vjp(dy)
  _, vjp2 = jax.vjp(lambda a, b: fp8_linear.linear(a, b, "xla", "fp8"), x, w)
  dx_other, _ = vjp2(jnp.roll(dy, 1, axis=0))
  assert _rel(dx_other, dx) > 0.5


@pytest.mark.slow
def test_model_kernel_matches_reference():
  """fp8_unified on the tiny model: the kernel's logits and gradients near the reference's."""
  shape = dict(num_hidden_layers=1, moe_intermediate_size=128, head_dim=64)
  toks = np.random.default_rng(1).integers(0, 256, (2, 64), np.int32)
  res = {}
  for impl in ("xla", "kernel"):
    config = M.tiny(policy="fp8_unified", fp8_gemm=impl, **shape)
    params = M.init_params(config, 0, param_dtype="float32")

    def loss(p, c=config):
      return jnp.mean(M.forward(p, c, toks).logits.astype(jnp.float32) ** 2)

    res[impl] = jax.jit(jax.value_and_grad(loss))(params)
  (v0, g0), (v1, g1) = res["xla"], res["kernel"]
  assert abs(float(v1) - float(v0)) < 1e-5 * abs(float(v0))
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
    assert _rel(a, b) < 1e-3


@pytest.mark.parametrize("field,value", [("fp8_gemm", "cublas"), ("fp8_backward", "yes")])
def test_bad_fp8_fields_raise(field, value):
  with pytest.raises(ValueError, match=field):
    M.tiny(policy="fp8_unified", **{field: value})
