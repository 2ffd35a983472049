"""Row-invariant reductions: each output row's bits do not depend on how many rows, tokens,
keys or output columns are computed with it (the kernel plan's "invariant" preset).

XLA's CPU dots and reductions choose their summation order by shape: a row of `x @ w`
changes in float32 between M=1 and M=1024 rows, and between N=64 and N=65 output columns;
`jnp.sum(x * w, -1)` changes too (its vectorization follows the outer shape), and so do
`jax.nn.softmax` / `log_softmax` over the vocabulary between [B, V] and [B, S, V]. Elementwise
arithmetic (add, multiply, divide, sqrt: IEEE operations) is the same per element at any
shape; XLA's transcendental functions are not: `exp(x - max(x))` differs by an ulp between
[6, 9, 100] and [6, 100] (its CPU lowering picks an implementation by context). So `exp`,
`log` and `silu` here are polynomials of IEEE operations and exponent bits, and every
reduction is a *chain* of elementwise operations: a float32 accumulator that
adds one term after another, the terms taken along the reduced axis in index order
(`lax.scan` over blocks of `BLOCK` terms, unrolled within a block). The order of a row's sum
is then fixed by the data, never by the shape, and the same in every program (prefill, decode,
training). Maxima are exact in any order (XLA's reduction is kept).

Padding is free: a reduced axis is padded with zeros to whole blocks, and a term of zero
leaves the accumulator unchanged, so attention over a cache of any length (masked keys give
probability exactly 0) sums what the full-sequence forward sums.

Division: XLA turns `x / y` into `x * (1 / y)` where y is a broadcast scalar (a batch of
one row), so a normalization here multiplies by an explicit reciprocal at every shape.

Excess precision: XLA may carry a bf16 value in float32 between fusions (differently in
different programs). Every input here is rounded to its own dtype explicitly
(`lax.reduce_precision`, which XLA keeps) before it enters a float32 chain, and every output
is rounded once from the float32 result.

Training programs: every public operation here is a `jax.custom_vjp` whose residuals are
its inputs and whose gradient is the plain-JAX formula's (`_reference_grad`; the matmuls':
XLA's dots). Only forward values must agree with the rollout, and XLA contracts a multiply
and an add into one FMA where both land in one fused kernel: under autodiff a forward
intermediate saved for the backward changes the fusion, and with it the bits. With the
inputs as the only residuals, the training forward runs the rollout's computation.
Costs: the chains run without a BLAS; see docs/numerics.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.kernels import attention_math
from trace_jax.kernels.attention_math import score_scale

BLOCK = 16  # terms per scan step (unrolled in the step's body)


_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693145751953125)  # ln 2 = _LN2_HI + _LN2_LO, _LN2_HI exact in 16 bits
_LN2_LO = np.float32(1.4286067653302e-06)
_EXP_MIN = np.float32(-87.0)  # below: 0 (exp would leave float32's normal range)
_EXP_MAX = np.float32(88.0)


def exp(x: jax.Array) -> jax.Array:
  """float32 e**x: 2**n (exponent bits) times a degree-8 Taylor polynomial of the remainder
  |r| <= ln2 / 2 (relative error ~1e-7); 0 below -87 (so float32's lowest gives exactly 0)."""
  x = x.astype(jnp.float32)
  z = jnp.clip(x, _EXP_MIN, _EXP_MAX)
  n = jnp.round(z * _LOG2E)
  r = (z - n * _LN2_HI) - n * _LN2_LO
  p = np.float32(1 / 40320)
  for c in (1 / 5040, 1 / 720, 1 / 120, 1 / 24, 1 / 6, 1 / 2, 1.0, 1.0):
    p = p * r + np.float32(c)
  two_n = jax.lax.bitcast_convert_type((n.astype(jnp.int32) + 127) << 23, jnp.float32)
  return jnp.where(x < _EXP_MIN, jnp.float32(0), p * two_n)


def log(x: jax.Array) -> jax.Array:
  """float32 natural log of normal x > 0: e ln2 + 2 atanh((m - 1) / (m + 1)) of x = m 2**e,
  m in [sqrt(1/2), sqrt(2)), the atanh series to s**13 (relative error ~1e-7)."""
  bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
  e = (bits >> 23) - 127
  m = jax.lax.bitcast_convert_type((bits & 0x007FFFFF) | 0x3F800000, jnp.float32)  # [1, 2)
  big = m > np.float32(1.4142135)
  m = jnp.where(big, m * np.float32(0.5), m)
  e = (e + big.astype(jnp.int32)).astype(jnp.float32)
  s = (m - np.float32(1)) / (m + np.float32(1))
  s2 = s * s
  p = np.float32(1 / 13)
  for c in (1 / 11, 1 / 9, 1 / 7, 1 / 5, 1 / 3, 1.0):
    p = p * s2 + np.float32(c)
  return (e * _LN2_HI + e * _LN2_LO) + np.float32(2) * s * p


def _reference_grad(reference: Callable[..., Any], nondiff_argnums: tuple[int, ...] = ()):
  """Decorator: the function's values, `reference`'s gradient (`jax.vjp` of it at the same
  inputs, the inputs the only residuals; see the module docstring)."""
  def wrap(fn):
    f = jax.custom_vjp(fn, nondiff_argnums=nondiff_argnums)

    def fwd(*args):
      return fn(*args), tuple(a for i, a in enumerate(args) if i not in nondiff_argnums)

    def bwd(*args):
      static, (res, g) = args[:-2], args[-2:]
      def ref(*diff):
        it, st = iter(diff), iter(static)
        n = len(diff) + len(static)
        return reference(*(next(st) if i in nondiff_argnums else next(it) for i in range(n)))
      return jax.vjp(ref, *res)[1](g)

    f.defvjp(fwd, bwd)
    return functools.wraps(fn)(f)
  return wrap


@_reference_grad(lambda gate, up: jax.nn.silu(gate) * up)
def silu_mul(gate: jax.Array, up: jax.Array) -> jax.Array:
  """silu(gate) * up in gate's dtype: gate / (1 + exp(-gate)) * up in float32, one rounding."""
  g = exact(gate)
  return rounded(g * reciprocal(np.float32(1) + exp(-g)) * exact(up), gate.dtype)


def exact(x: jax.Array) -> jax.Array:
  """x as float32, holding exactly its own dtype's value (bf16 / f16 rounded explicitly)."""
  if x.dtype in (jnp.bfloat16, jnp.float16):
    info = jnp.finfo(x.dtype)
    return jax.lax.reduce_precision(x.astype(jnp.float32), info.nexp, info.nmant)
  return x.astype(jnp.float32)


def rounded(y: jax.Array, dtype: Any) -> jax.Array:
  """float32 y rounded once to `dtype` (the value `dtype`'s, even if XLA keeps float32)."""
  dtype = jnp.dtype(dtype)
  if dtype in (jnp.bfloat16, jnp.float16):
    info = jnp.finfo(dtype)
    y = jax.lax.reduce_precision(y, info.nexp, info.nmant)
  return y.astype(dtype)


def chain(term: Callable[[Any], jax.Array], xs: Any, shape: tuple[int, ...]) -> jax.Array:
  """sum_i term(xs[i]) in float32, i in index order, one addition after another.

  xs: a pytree of arrays whose leading axis is the reduced one (n terms); term maps one slice
  to a float32 array of `shape`. The axis is padded with zeros to whole blocks: `term` must
  give exact zeros for zero slices (products do)."""
  n = jax.tree.leaves(xs)[0].shape[0]
  nb = -(-n // BLOCK)
  pad = nb * BLOCK - n

  def blocks(a):
    a = jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)) if pad else a
    return a.reshape((nb, BLOCK) + a.shape[1:])

  def step(acc, blk):
    for j in range(BLOCK):
      acc = acc + term(jax.tree.map(lambda a, j=j: a[j], blk))
    return acc, None

  acc, _ = jax.lax.scan(step, jnp.zeros(shape, jnp.float32), jax.tree.map(blocks, xs))
  return acc


def sum_last(x: jax.Array) -> jax.Array:
  """float32 sum of x [..., K] over its last axis, in index order (x taken exactly)."""
  xt = jnp.moveaxis(exact(x), -1, 0)
  return chain(lambda a: a, xt, xt.shape[1:])


def _bmm(x: jax.Array, w: jax.Array) -> jax.Array:
  """float32 x [T, M, K] . w [T, N, K] -> [T, M, N], summed over K in index order."""
  xt = jnp.moveaxis(exact(x), -1, 0)  # [K, T, M]
  wt = jnp.moveaxis(exact(w), -1, 0)  # [K, T, N]
  t, m, n = x.shape[0], x.shape[1], w.shape[1]
  return chain(lambda a: a[0][:, :, None] * a[1][:, None, :], (xt, wt), (t, m, n))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def batched_matmul(x: jax.Array, w: jax.Array, out_dtype: Any = None) -> jax.Array:
  """x [T, M, K] times w [T, N, K] (contracted over K) -> [T, M, N] in `out_dtype` (default
  x's): float32 sums in index order, rounded once. Gradient: XLA's dots."""
  return rounded(_bmm(x, w), x.dtype if out_dtype is None else out_dtype)


def _bmm_fwd(x, w, out_dtype):
  return batched_matmul(x, w, out_dtype), (x, w)


def _bmm_bwd(out_dtype, res, dy):
  x, w = res
  dx = jnp.einsum("tmn,tnk->tmk", dy.astype(x.dtype), w.astype(x.dtype),
                  preferred_element_type=jnp.float32)
  dw = jnp.einsum("tmn,tmk->tnk", dy.astype(x.dtype), x, preferred_element_type=jnp.float32)
  return dx.astype(x.dtype), dw.astype(w.dtype)


batched_matmul.defvjp(_bmm_fwd, _bmm_bwd)


def matmul(x: jax.Array, w: jax.Array, out_dtype: Any = None) -> jax.Array:
  """x [..., K] @ w [N, K]^T -> [..., N] (`batched_matmul` with one batch)."""
  lead, k = x.shape[:-1], x.shape[-1]
  y = batched_matmul(x.reshape(1, -1, k), w[None], out_dtype)
  return y.reshape(lead + (w.shape[0],))


def reciprocal(x: jax.Array) -> jax.Array:
  """1 / x of float32 x, to multiply by (the same bits at every shape; see the docstring)."""
  return jnp.float32(1) / x


@_reference_grad(lambda e: e / jnp.sum(e, axis=-1, keepdims=True))
def normalized(e: jax.Array) -> jax.Array:
  """e [..., K] >= 0 times the reciprocal of its sum over K (in index order)."""
  return e * reciprocal(sum_last(e))[..., None]


@_reference_grad(lambda x: jax.nn.softmax(x.astype(jnp.float32), axis=-1))
def softmax(x: jax.Array) -> jax.Array:
  """float32 softmax of x over its last axis: exp(x - max) times 1 / (their sum, in index
  order)."""
  x = exact(x)
  e = exp(x - jnp.max(x, axis=-1, keepdims=True))
  return e * reciprocal(sum_last(e))[..., None]


@_reference_grad(lambda x: jax.nn.log_softmax(x.astype(jnp.float32), axis=-1))
def log_softmax(x: jax.Array) -> jax.Array:
  """float32 log-softmax of x over its last axis: x - max - log(sum of exp, index order)."""
  x = exact(x)
  shifted = x - jnp.max(x, axis=-1, keepdims=True)
  return shifted - log(sum_last(exp(shifted)))[..., None]


@_reference_grad(lambda y, w: jnp.sum(y * w[..., None], axis=1))
def combine(y: jax.Array, weights: jax.Array) -> jax.Array:
  """sum_k weights[t, k] * y[t, k] of expert outputs y [T, K, D] and combine weights [T, K]
  -> [T, D] in y's dtype: float32 products summed over the K slots in slot order."""
  terms = (jnp.moveaxis(exact(y), 1, 0), jnp.moveaxis(exact(weights), 1, 0))
  out = chain(lambda a: a[0] * a[1][:, None], terms, (y.shape[0], y.shape[2]))
  return rounded(out, y.dtype)


def _rms_norm_reference(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  xf = x.astype(jnp.float32)
  y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + jnp.float32(eps))
  return scale.astype(x.dtype) * y.astype(x.dtype)


@_reference_grad(_rms_norm_reference, nondiff_argnums=(2,))
def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  """`layers.RMSNorm`'s formula, `scale * (x / sqrt(mean(x^2) + eps))`: the mean a chain,
  1 / sqrt an IEEE square root and quotient (XLA's rsqrt may be approximate)."""
  xf = exact(x)
  var = sum_last(xf * xf) * jnp.float32(1 / x.shape[-1])
  y = rounded(xf * reciprocal(jnp.sqrt(var + jnp.float32(eps)))[..., None], x.dtype)
  return rounded(exact(scale.astype(x.dtype)) * exact(y), x.dtype)


@_reference_grad(attention_math.attend)
def attend(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array
           ) -> jax.Array:
  """`attention_math.attend`'s causal GQA with every sum a chain: q [B, S, N, H], k/v
  [B, T, G, H], positions [B, S] / [B, T] -> [B, S, N, H] in q's dtype.

  Scores: float32 sums over H times `score_scale`; masked scores are float32's lowest, so their
  probabilities are exactly 0 and a cache's extra keys add nothing; probabilities rounded
  once to q's dtype; the PV sum over keys in key order, rounded once."""
  b, s, n, h = q.shape
  t, g = k.shape[1], k.shape[2]
  r = n // g
  qt = jnp.transpose(exact(q).reshape(b, s, g, r, h), (4, 0, 2, 3, 1))  # [H, B, G, R, S]
  kt = jnp.transpose(exact(k), (3, 0, 2, 1))                          # [H, B, G, T]
  scores = chain(lambda a: a[0][..., None] * a[1][:, :, None, None, :], (qt, kt),
                 (b, g, r, s, t)) * score_scale(h)
  mask = k_pos[:, None, None, None, :] <= q_pos[:, None, None, :, None]
  scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
  e = exp(scores - jnp.max(scores, axis=-1, keepdims=True))
  probs = exact(rounded(normalized(e), q.dtype))
  pt = jnp.moveaxis(probs, -1, 0)                                       # [T, B, G, R, S]
  vt = jnp.transpose(exact(v), (1, 0, 2, 3))                            # [T, B, G, H]
  out = chain(lambda a: a[0][..., None] * a[1][:, :, None, None, :], (pt, vt),
              (b, g, r, s, h))
  return rounded(jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, s, n, h), q.dtype)
