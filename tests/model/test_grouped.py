"""Grouped matmul: the tiled implementation against ragged_dot and a float64 reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax.model import grouped

# float32 cases compare float32 sums: on the GPU that needs float32 products too (its default
# matmul precision takes bfloat16 x3 or TF32 passes, off by ~1e-3).
pytestmark = pytest.mark.usefixtures("float32_matmuls")


@pytest.fixture
def float32_matmuls():
  with jax.default_matmul_precision("highest"):
    yield

# (name, group sizes): empty groups, one group, fewer rows than groups, exact tile multiples.
CASES = [
    ("random", None),
    ("empty_groups", (0, 5, 0, 0, 17, 3, 0, 1)),
    ("one_group", (0, 0, 0, 40, 0, 0, 0, 0)),
    ("fewer_rows_than_groups", (1, 0, 1, 0, 0, 1, 0, 0)),
    ("tile_multiples", (8, 16, 8, 0, 24, 8, 8, 8)),
]


def _inputs(sizes, dtype, seed=0):
  rng = np.random.default_rng(seed)
  if sizes is None:
    ids = rng.integers(0, 8, 300)
    ids[ids == 2] = 5  # and one empty group
    sizes = np.bincount(ids, minlength=8)
  sizes = np.asarray(sizes, np.int32)
  m = int(sizes.sum())
  x = rng.standard_normal((m, 48)).astype(np.float32)
  w = rng.standard_normal((8, 40, 48)).astype(np.float32)
  return jnp.asarray(x, dtype), jnp.asarray(w, dtype), jnp.asarray(sizes)


def _reference(x, w, sizes):
  """float64: each row times its group's weights."""
  x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
  groups = np.repeat(np.arange(len(sizes)), np.asarray(sizes))
  return np.einsum("mk,mnk->mn", x, w[groups])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name,sizes", CASES, ids=[c[0] for c in CASES])
def test_forward(name, sizes, dtype):
  x, w, gs = _inputs(sizes, dtype)
  tiled = grouped.grouped_matmul(x, w, gs, "tiled")
  ragged = grouped.grouped_matmul(x, w, gs, "ragged_dot")
  assert tiled.dtype == x.dtype and tiled.shape == ragged.shape
  # Same products, float32 sums in whatever order each kernel picks: equal up to rounding.
  tol = 1e-5 if dtype == jnp.float32 else 2e-2
  np.testing.assert_allclose(np.asarray(tiled, np.float32), np.asarray(ragged, np.float32),
                             rtol=tol, atol=tol)
  np.testing.assert_allclose(np.asarray(tiled, np.float64), _reference(x, w, gs),
                             rtol=tol, atol=tol * 10)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name,sizes", CASES, ids=[c[0] for c in CASES])
def test_gradients(name, sizes, dtype):
  x, w, gs = _inputs(sizes, dtype, seed=1)
  dy = jnp.asarray(np.random.default_rng(2).standard_normal((x.shape[0], 40)), dtype)

  def grads(impl):
    _, vjp = jax.vjp(lambda a, b: grouped.grouped_matmul(a, b, gs, impl), x, w)
    return vjp(dy)

  (dx_t, dw_t), (dx_r, dw_r) = grads("tiled"), grads("ragged_dot")
  assert dx_t.dtype == x.dtype and dw_t.dtype == w.dtype
  tol = 1e-5 if dtype == jnp.float32 else 2e-2
  np.testing.assert_allclose(np.asarray(dx_t, np.float32), np.asarray(dx_r, np.float32),
                             rtol=tol, atol=tol)
  # Weight gradient: float32 sums then one rounding; against float64 sums over each group.
  groups = np.repeat(np.arange(8), np.asarray(gs))
  dy64, x64 = np.asarray(dy, np.float64), np.asarray(x, np.float64)
  dw_ref = np.zeros((8, 40, 48))
  np.add.at(dw_ref, groups, np.einsum("mn,mk->mnk", dy64, x64))
  tol = 1e-5 if dtype == jnp.float32 else 8e-3
  np.testing.assert_allclose(np.asarray(dw_t, np.float64), dw_ref, rtol=tol, atol=tol)
  np.testing.assert_allclose(np.asarray(dw_t, np.float32), np.asarray(dw_r, np.float32),
                             rtol=tol, atol=tol)


@pytest.mark.parametrize("m,groups,tile", [(81920, 32, 128), (512, 32, 16), (3, 8, 8),
                                           (1000, 8, 128), (100, 8, 16)])
def test_tile_rows(m, groups, tile):
  assert grouped.tile_rows(m, groups) == tile


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA's CPU buffer plan")
def test_tiled_temporaries_do_not_scale_with_groups():
  """ragged_dot's buffer plan grows with E x M; the tiled one stays near M (XLA CPU plan)."""
  m, k, n, e = 8192, 256, 256, 32
  x = jax.ShapeDtypeStruct((m, k), jnp.float32)
  w = jax.ShapeDtypeStruct((e, n, k), jnp.float32)
  gs = jax.ShapeDtypeStruct((e,), jnp.int32)

  def temp_bytes(impl):
    loss = lambda a, b, g: jnp.sum(grouped.grouped_matmul(a, b, g, impl) ** 2)
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w, gs).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  ragged, tiled = temp_bytes("ragged_dot"), temp_bytes("tiled")
  assert ragged >= e * m * k * 4  # at least one [E, M, K] float32 expansion
  assert tiled < ragged / 8, (tiled, ragged)


def test_unknown_impl():
  x, w, gs = _inputs(None, jnp.float32)
  with pytest.raises(ValueError, match="impl"):
    grouped.grouped_matmul(x, w, gs, "dense")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_kernel_impl_and_its_gradients_match_ragged_dot(dtype):
  """moe_impl="kernel" (Pallas grouped GEMMs; the interpreter here) through its custom VJP."""
  rng = np.random.default_rng(3)
  sizes = jnp.asarray((9, 0, 30, 1, 0, 17, 3, 4), jnp.int32)
  x = jnp.asarray(rng.standard_normal((64, 32)), dtype)
  w = jnp.asarray(rng.standard_normal((8, 48, 32)), dtype)
  dy = jnp.asarray(rng.standard_normal((64, 48)), dtype)

  def run(impl):
    y, vjp = jax.vjp(lambda a, b: grouped.grouped_matmul(a, b, sizes, impl), x, w)
    return (y, *vjp(dy))

  tol = 1e-5 if dtype == jnp.float32 else 2e-2
  for got, want in zip(run("kernel"), run("ragged_dot")):
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=tol, atol=tol)


def test_mgpu_impl_sends_float32_rows_to_the_kernel():
  """moe_impl="mgpu" is wgmma's bf16/f16: float32 rows (e.g. dequantized FP8) take "kernel"."""
  rng = np.random.default_rng(3)
  sizes = jnp.asarray((9, 0, 30, 1, 0, 17, 3, 4), jnp.int32)
  x = jnp.asarray(rng.standard_normal((64, 32)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((8, 48, 32)), jnp.float32)
  np.testing.assert_array_equal(grouped.grouped_matmul(x, w, sizes, "mgpu"),
                                grouped.grouped_matmul(x, w, sizes, "kernel"))


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="moe_impl='mgpu' runs on a Hopper "
                    "GPU only (its CPU coverage: tests/kernels/test_mosaic_lowering.py)")
def test_mgpu_impl_and_its_gradients_match_the_kernel_s():
  """JAX's Mosaic GPU grouped GEMM through its custom VJP, bf16, with rows past the groups'
  sum (expert parallelism's case): those come out zero and get no gradient."""
  rng = np.random.default_rng(4)
  sizes = jnp.asarray((9, 0, 30, 1, 0, 17, 3, 4), jnp.int32)  # 64 of 96 rows
  x = jnp.asarray(rng.standard_normal((96, 128)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((8, 192, 128)), jnp.bfloat16)
  dy = jnp.asarray(rng.standard_normal((96, 192)), jnp.bfloat16)

  def run(impl):
    y, vjp = jax.vjp(lambda a, b: grouped.grouped_matmul(a, b, sizes, impl), x, w)
    return (y, *vjp(dy))

  got, want = run("mgpu"), run("kernel")
  assert not np.any(np.asarray(got[0][64:], np.float32)) and \
      not np.any(np.asarray(got[1][64:], np.float32))
  for g, r in zip(got, want):
    assert g.dtype == r.dtype and g.shape == r.shape
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("m", [1, 7, 512], ids=lambda m: f"m{m}")
def test_inverse_permutation_brings_sorted_rows_back(m):
  """The dispatch's stable sort by expert and its inverse: rows[order][inverse] == rows, and
  inverse equals numpy's argsort of the order (an independent reference)."""
  ids = np.random.default_rng(m).integers(0, 8, m).astype(np.int32)
  order = jnp.argsort(jnp.asarray(ids), stable=True)
  inv = grouped.inverse_permutation(order)
  np.testing.assert_array_equal(np.asarray(inv), np.argsort(np.asarray(order)))
  rows = np.arange(m * 3, dtype=np.float32).reshape(m, 3)
  np.testing.assert_array_equal(np.asarray(jnp.asarray(rows)[order][inv]), rows)
  o = np.asarray(order)
  if not np.array_equal(o[o], np.arange(m)):  # control: order itself (not an involution here)
    assert not np.array_equal(np.asarray(jnp.asarray(rows)[order][order]), rows)
  assert m == 1 or not np.array_equal(o[o], np.arange(m))  # the control ran


@pytest.mark.parametrize("tile", [8, 128])
@pytest.mark.parametrize("name,sizes", CASES, ids=[c[0] for c in CASES])
def test_padded_sources_gather_each_group_into_whole_tiles(name, sizes, tile):
  """padded_sources as a gather map lays rows out as numpy does: each group's rows at the start
  of its own whole tiles, groups in order, zeros elsewhere; rows past sum(sizes) (NaN here)
  land nowhere."""
  x, _, gs = _inputs(sizes, jnp.float32)
  extra = 5  # rows that belong to no group
  x = jnp.concatenate([x, jnp.full((extra, x.shape[1]), jnp.nan, x.dtype)])
  m, e = x.shape[0], gs.shape[0]
  rows = (-(-m // tile) + e) * tile
  got = jnp.take(x, grouped.padded_sources(gs, m, tile, rows), axis=0, mode="fill",
                 fill_value=0)
  want, src, dst = np.zeros((rows, x.shape[1]), np.float32), 0, 0
  for n in np.asarray(gs):
    want[dst:dst + n] = np.asarray(x)[src:src + n]
    src, dst = src + n, dst + -(-n // tile) * tile
  np.testing.assert_array_equal(np.asarray(got), want)


def _routing(tokens: int, k: int, experts: int):
  ids = jax.random.randint(jax.random.key(1), (tokens * k,), 0, experts)
  order = jnp.argsort(ids, stable=True)
  return order, grouped.inverse_permutation(order)


def _program(fn, *args) -> str:
  """The jaxpr of fn(*args) as text, nested jaxprs included."""
  return str(jax.make_jaxpr(fn)(*args))


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)],
                         ids=["float32", "bf16"])
def test_dispatch_and_combine_gradients_are_gathers(dtype, tol):
  """dispatch_rows / permute_rows: the forward is the plain gather; the gradients equal
  autodiff's of the plain gathers (float32: exactly up to summation order), with no scatter
  in the backward."""
  t, k, d = 24, 4, 16
  order, inverse = _routing(t, k, 5)
  x = jax.random.normal(jax.random.key(0), (t, d)).astype(dtype)
  y = jax.random.normal(jax.random.key(2), (t * k, d)).astype(dtype)
  w = jax.random.normal(jax.random.key(3), (t * k, d))
  np.testing.assert_array_equal(grouped.dispatch_rows(x, order, inverse, k), x[order // k])
  np.testing.assert_array_equal(grouped.permute_rows(y, inverse, order), y[inverse])
  cases = [(lambda a: grouped.dispatch_rows(a, order, inverse, k), lambda a: a[order // k], x),
           (lambda a: grouped.permute_rows(a, inverse, order), lambda a: a[inverse], y)]
  for fast, plain, a in cases:
    loss = lambda f: (lambda v: jnp.sum(f(v).astype(jnp.float32) * w))
    got, want = jax.grad(loss(fast))(a), jax.grad(loss(plain))(a)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=tol, rtol=tol)
    assert "scatter-add" in _program(jax.grad(loss(plain)), a)
    assert "scatter" not in _program(jax.grad(loss(fast)), a)
