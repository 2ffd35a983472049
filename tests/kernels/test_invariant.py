"""Row-invariant reductions (`trace_jax.kernels.invariant`): a row's bits are the same
whatever else is computed with it (rows 1..N, other output columns, longer sequences, a
padded KV cache), and its value is the reduction's (float64 numpy references)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax.kernels import invariant
from trace_jax.kernels.attention_math import attend
from trace_jax.model.grouped import grouped_matmul

RNG = np.random.default_rng(0)
BF16 = jnp.bfloat16


def _f64(a) -> np.ndarray:
  return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def _bits(a) -> np.ndarray:
  """An array's bytes, so equality is bitwise (signed zeros, NaN) rather than numeric."""
  return np.ascontiguousarray(a).view(np.uint8)


def _assert_bitwise(got, want, what: str) -> None:
  assert got.shape == want.shape and np.array_equal(_bits(got), _bits(want)), what


@pytest.mark.parametrize("dtype,k", [(jnp.float32, 128), (BF16, 72)],
                         ids=["float32_k128", "bfloat16_k72_padded"])
def test_matmul_rows_and_columns_are_invariant(dtype, k):
  """The first 1..8 of 24 rows, one row alone and a subset of the output columns give the
  full product's bits; the values are the float64 product's to float32 summation."""
  x = jnp.asarray(RNG.standard_normal((24, k)), dtype)
  w = jnp.asarray(RNG.standard_normal((100, k)) * 0.1, dtype)
  mm = jax.jit(invariant.matmul)
  full = np.asarray(mm(x, w))
  for m in range(1, 9):
    _assert_bitwise(np.asarray(mm(x[:m], w)), full[:m], f"rows 1..{m}")
  _assert_bitwise(np.asarray(mm(x[5:6], w)), full[5:6], "one row from the middle")
  _assert_bitwise(np.asarray(mm(x, w[:37])), full[:, :37], "37 of 100 columns")
  _assert_bitwise(np.asarray(mm(x.reshape(4, 6, k), w)).reshape(24, -1), full, "[4, 6, K]")
  tol = 1e-5 if dtype == jnp.float32 else 1e-2
  np.testing.assert_allclose(_f64(full), _f64(x) @ _f64(w).T, rtol=tol, atol=tol)


def test_matmul_gradient_is_the_dot_gradient():
  """The custom VJP gives XLA's dot gradients (training's backward is not row-invariant, nor
  needs to be)."""
  x = jnp.asarray(RNG.standard_normal((3, 5, 32)), jnp.float32)
  w = jnp.asarray(RNG.standard_normal((7, 32)), jnp.float32)
  dy = jnp.asarray(RNG.standard_normal((3, 5, 7)), jnp.float32)
  got = jax.grad(lambda x, w: jnp.sum(invariant.matmul(x, w) * dy), argnums=(0, 1))(x, w)
  want = jax.grad(lambda x, w: jnp.sum((x @ w.T) * dy), argnums=(0, 1))(x, w)
  for g, r in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5)


REDUCTIONS = {
    "sum_last": (invariant.sum_last, lambda x: x.sum(-1)),
    "softmax": (invariant.softmax,
                lambda x: np.exp(x - x.max(-1, keepdims=True))
                / np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)),
    "log_softmax": (invariant.log_softmax,
                    lambda x: x - x.max(-1, keepdims=True) - np.log(np.exp(
                        x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))),
}


@pytest.mark.parametrize("name", list(REDUCTIONS))
def test_reductions_over_the_last_axis_are_invariant(name):
  """Logits [B, S, V] (the trainer's) and each position's [B, V] (the sampler's) give the same
  row bits, for every batch size; values as float64's."""
  fn, ref = REDUCTIONS[name]
  x = jnp.asarray(RNG.standard_normal((6, 9, 100)) * 3, jnp.float32)
  f = jax.jit(fn)
  full = np.asarray(f(x))
  for s in (0, 4, 8):
    for b in (1, 2, 6):
      _assert_bitwise(np.asarray(f(x[:b, s])), full[:b, s], f"{name} [B={b}, V] at s={s}")
  np.testing.assert_allclose(full, ref(_f64(x)), rtol=1e-5, atol=1e-5)


def test_rms_norm_is_invariant_and_is_the_formula():
  x = jnp.asarray(RNG.standard_normal((5, 7, 128)), BF16)
  scale = jnp.asarray(1 + 0.1 * RNG.standard_normal(128), BF16)
  f = jax.jit(invariant.rms_norm, static_argnums=2)
  full = np.asarray(f(x, scale, 1e-6))
  for b, s in ((1, 0), (3, 6), (5, 2)):
    _assert_bitwise(np.asarray(f(x[:b, s:s + 1], scale, 1e-6)), full[:b, s:s + 1], (b, s))
  xf = _f64(x)
  want = _f64(scale) * xf / np.sqrt((xf * xf).mean(-1, keepdims=True) + 1e-6)
  np.testing.assert_allclose(_f64(full), want, rtol=2e-2, atol=2e-2)


def test_combine_is_invariant_and_weighs_the_slots():
  y = jnp.asarray(RNG.standard_normal((12, 2, 64)), BF16)
  wts = jnp.asarray(RNG.uniform(size=(12, 2)), BF16)
  f = jax.jit(invariant.combine)
  full = np.asarray(f(y, wts))
  for m in (1, 5, 12):
    _assert_bitwise(np.asarray(f(y[:m], wts[:m])), full[:m], f"{m} tokens")
  np.testing.assert_allclose(_f64(full), (_f64(y) * _f64(wts)[..., None]).sum(1),
                             rtol=1e-2, atol=1e-2)


B, S, N, G, H = 3, 20, 4, 2, 32


def _qkv(dtype=BF16):
  q = jnp.asarray(RNG.standard_normal((B, S, N, H)), dtype)
  k = jnp.asarray(RNG.standard_normal((B, S, G, H)), dtype)
  v = jnp.asarray(RNG.standard_normal((B, S, G, H)), dtype)
  return q, k, v, jnp.broadcast_to(jnp.arange(S), (B, S))


@pytest.mark.parametrize("cache_len", [45], ids=["cache_45"])
def test_decode_attention_equals_the_full_sequence_rows(cache_len):
  """One query at position s over a cache of cache_len keys (zeros past the sequence: the
  engine's cache) gives the full-sequence forward's row s bit for bit, for every s and for
  batches of 1 and B."""
  q, k, v, pos = _qkv()
  f = jax.jit(invariant.attend)
  full = np.asarray(f(q, k, v, pos, pos))
  pad = [(0, 0), (0, cache_len - S), (0, 0), (0, 0)]
  kc, vc = jnp.pad(k, pad), jnp.pad(v, pad)
  kpos = jnp.broadcast_to(jnp.arange(cache_len), (B, cache_len))
  for s in range(S):
    one = np.asarray(f(q[:, s:s + 1], kc, vc, pos[:, s:s + 1], kpos))
    _assert_bitwise(one[:, 0], full[:, s], f"position {s}")
  _assert_bitwise(np.asarray(f(q[1:2], k[1:2], v[1:2], pos[1:2], pos[1:2])), full[1:2],
                  "batch of one")


def test_attention_values_are_attend_s():
  """The same causal GQA as the model's `attend` (float32 inputs: equal to summation order;
  the reference's dots in full float32, which a GPU's default precision, TF32, is not)."""
  q, k, v, pos = _qkv(jnp.float32)
  with jax.default_matmul_precision("highest"):
    want = np.asarray(attend(q, k, v, pos, pos))
  np.testing.assert_allclose(np.asarray(invariant.attend(q, k, v, pos, pos)), want, rtol=2e-5,
                             atol=2e-5)


def test_grouped_matmul_rows_do_not_depend_on_their_group():
  """A token's expert rows give the same bits whichever other rows share the batch and the
  expert groups (sizes, tiles); values as float64's per-row product."""
  e, d, f = 4, 64, 48
  w = jnp.asarray(RNG.standard_normal((e, f, d)) * 0.1, BF16)
  x = jnp.asarray(RNG.standard_normal((40, d)), BF16)
  ids = RNG.integers(0, e, 40)
  gm = jax.jit(grouped_matmul, static_argnums=3)

  def run(rows):
    order = np.argsort(ids[rows], kind="stable")
    sizes = jnp.asarray(np.bincount(ids[rows][order], minlength=e), jnp.int32)
    y = np.asarray(gm(x[rows][order], w, sizes, "invariant"))
    out = np.empty_like(y)
    out[order] = y
    return out

  full = run(np.arange(40))
  for rows in (np.arange(1), np.arange(7, 9), np.arange(3, 40, 3)):
    _assert_bitwise(run(rows), full[rows], f"rows {rows.tolist()}")
  want = np.einsum("md,mfd->mf", _f64(x), _f64(w)[ids])
  np.testing.assert_allclose(_f64(full), want, rtol=1e-2, atol=1e-2)


def test_exp_log_silu_are_accurate_and_invariant():
  """The polynomial exp/log (XLA's `exp(x - max(x))` changes by an ulp with the shape on
  CPU) are float64's to ~1e-7; exp of float32's lowest (a masked score) is exactly 0;
  values at any shape and in a softmax's context are the elementwise ones."""
  x = np.linspace(-87, 88, 20001).astype(np.float32)
  np.testing.assert_allclose(np.asarray(invariant.exp(x)), np.exp(x.astype(np.float64)),
                             rtol=2e-7)
  assert float(invariant.exp(jnp.float32(np.finfo(np.float32).min))) == 0.0
  y = np.exp(np.linspace(-80, 80, 20001)).astype(np.float32)
  np.testing.assert_allclose(np.asarray(invariant.log(y)), np.log(y.astype(np.float64)),
                             rtol=2e-7, atol=1e-6)
  g = jnp.asarray(RNG.standard_normal((6, 9, 64)) * 4, BF16)
  u = jnp.asarray(RNG.standard_normal((6, 9, 64)), BF16)
  gf, uf = _f64(g), _f64(u)
  np.testing.assert_allclose(_f64(invariant.silu_mul(g, u)), gf / (1 + np.exp(-gf)) * uf,
                             rtol=1e-2, atol=1e-2)
  z = jnp.asarray(RNG.standard_normal((6, 9, 100)) * 3, jnp.float32)
  f = jax.jit(lambda z: invariant.exp(z - jnp.max(z, -1, keepdims=True)))
  full = np.asarray(f(z))
  for sl in (np.s_[:1], np.s_[:2, 0], np.s_[:, 1:2]):
    _assert_bitwise(np.asarray(f(z[sl])), full[sl], f"exp(z - max) of z{sl}")
  sm = jax.jit(invariant.silu_mul)(g, u)
  _assert_bitwise(np.asarray(jax.jit(invariant.silu_mul)(g[2:3, 4], u[2:3, 4])),
                  np.asarray(sm)[2:3, 4], "silu_mul of one row")


def _optimized(fn, *args):
  """fn compiled at XLA's optimization level 3 (the suite runs at 0, where XLA's CPU backend
  contracts no multiply-add into an FMA; runs use the default level, which does)."""
  return jax.jit(fn).lower(*args).compile(
      compiler_options={"xla_backend_optimization_level": "3"})(*args)


def _pos(b, s):
  return jnp.broadcast_to(jnp.arange(s), (b, s))


TRAINING_CASES = {  # op, its arguments: the shapes of a training batch
    "rms_norm": (lambda f: lambda x, s: f(x, s, 1e-6),
                 lambda: (RNG.standard_normal((8, 128, 128)), 1 + 0.1 * RNG.standard_normal(128)),
                 BF16, invariant.rms_norm),
    "attend": (lambda f: lambda q, k, v: f(q, k, v, _pos(4, 64), _pos(4, 64)),
               lambda: (RNG.standard_normal((4, 64, 4, 32)), RNG.standard_normal((4, 64, 2, 32)),
                        RNG.standard_normal((4, 64, 2, 32))), BF16, invariant.attend),
    "log_softmax": (lambda f: f, lambda: (RNG.standard_normal((8, 128, 100)) * 3,),
                    jnp.float32, invariant.log_softmax),
    "silu_mul": (lambda f: f, lambda: (RNG.standard_normal((1024, 64)) * 3,
                                       RNG.standard_normal((1024, 64))), BF16, invariant.silu_mul),
}


@pytest.mark.parametrize("name", list(TRAINING_CASES))
def test_values_inside_a_training_program_are_the_forward_s(name):
  """An op's values in a program that also runs its backward (`jax.vjp`) are the plain
  program's bit for bit, at XLA's full optimization: its residuals are its inputs, so no
  intermediate saved for the backward changes the forward's fusions and FMAs. Control: the
  same formula without the custom VJP (rms_norm's, on the CPU; the GPU's fusions happen to
  keep its bits) changes bits there."""
  bind, make, dtype, op = TRAINING_CASES[name]
  args = [jnp.asarray(a, dtype) for a in make()]

  def forward_and_backward(*a, fn=None):
    out, vjp = jax.vjp(fn, *a)
    return out, vjp(out)  # the backward runs, so the forward's residuals are kept

  def values(fn):
    plain = _optimized(fn, *args)
    with_backward = _optimized(lambda *a: forward_and_backward(*a, fn=fn), *args)
    return np.asarray(plain), np.asarray(with_backward[0])

  plain, trained = values(bind(op))
  _assert_bitwise(trained, plain, f"{name} inside a vjp")
  if name == "rms_norm" and jax.default_backend() == "cpu":
    plain, trained = values(bind(op.__wrapped__))
    assert not np.array_equal(_bits(plain), _bits(trained))
