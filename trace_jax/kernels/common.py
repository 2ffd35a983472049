"""Pallas pieces the kernels share: masked loads and stores, launch parameters, tile sizes.

Every kernel module takes these from here (none reaches into another kernel's private names).
The Triton-specific names moved between jax versions; the guards below keep one spelling for
the kernels.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:  # Triton-specific Pallas names (masked load/store, compiler params)
  from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover - every jax with Pallas ships it
  plgpu = None

# Programs a decode launch should have at least (two per SM of an H100/H200, 132 SMs): with
# fewer, a few SMs stream the weights and the rest idle (one 4096-row projection in 64-row
# tiles is 64 programs).
MIN_PROGRAMS = 256


def default_interpret() -> bool:
  """Kernels run as Triton / Mosaic GPU on a GPU and in the Pallas interpreter elsewhere."""
  return jax.default_backend() != "gpu"


def dot_precision(dtype: Any) -> Any:
  """float32 operands multiply in full precision (Triton would pick TF32 by default)."""
  return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def masked_load(ref: Any, idx: tuple[Any, ...], mask: jax.Array | None = None,
                other: Any = None) -> jax.Array:
  """ref[idx] where `mask` holds; `other` (or undefined values, where None) elsewhere. A None
  mask loads the whole window (`other` unused)."""
  if mask is None:
    other = None
  if plgpu is not None and hasattr(plgpu, "load"):  # jax >= 0.7: pallas.triton.load
    return plgpu.load(ref.at[idx], mask=mask, other=other)
  return pl.load(ref, idx, mask=mask, other=other)  # pragma: no cover - older jax


def masked_store(ref: Any, idx: tuple[Any, ...], val: jax.Array,
                 mask: jax.Array | None = None) -> None:
  """ref[idx] = val where `mask` holds."""
  if plgpu is not None and hasattr(plgpu, "store"):
    plgpu.store(ref.at[idx], val, mask=mask)
  else:  # pragma: no cover - older jax
    pl.store(ref, idx, val, mask=mask)


def compiler_params(num_warps: int, num_stages: int) -> Any:
  """Triton launch parameters of a `pl.pallas_call`."""
  cls = (getattr(plgpu, "CompilerParams", None) or getattr(plgpu, "TritonCompilerParams", None)
         if plgpu is not None else None)
  if cls is not None:
    return cls(num_warps=num_warps, num_stages=num_stages)
  return {"triton": {"num_warps": num_warps, "num_stages": num_stages}}  # pragma: no cover


def pow2_divisor(n: int, cap: int) -> int:
  """The largest power of two that divides n and is at most cap."""
  b = 1
  while b * 2 <= cap and n % (b * 2) == 0:
    b *= 2
  return b


def next_pow2(n: int) -> int:
  """The smallest power of two >= n (1 for n <= 1)."""
  return 1 << max(0, int(n) - 1).bit_length()


def check_block(name: str, value: int, lo: int) -> None:
  """Raises ValueError naming `name` unless value is a power of two >= lo."""
  if value < lo or value & (value - 1):
    raise ValueError(f"{name} must be a power of two >= {lo}, got {value}")


def default_block_n(n: int, num_experts: int, cap: int = 64, floor: int = 16) -> int:
  """Output tile rows: the largest power of two <= cap dividing n, halved (not below floor)
  while the grid (num_experts x n / block_n) has fewer than `MIN_PROGRAMS` programs."""
  bn = pow2_divisor(n, cap)
  while bn > floor and num_experts * (n // bn) < MIN_PROGRAMS and n % (bn // 2) == 0:
    bn //= 2
  return bn


def zero_rows_past(o_ref: Any, total: jax.Array, m: int, bm: int, n0: jax.Array,
                   bn: int) -> None:
  """Zeros output rows total..m of columns n0..n0+bn (rows no group holds, as ragged_dot
  gives them), in masked blocks of bm rows: for one program per output tile to call."""
  rows = jnp.arange(bm, dtype=jnp.int32)[:, None]

  def zero_block(i, carry):
    row0 = total + i * bm
    valid = jnp.broadcast_to((row0 + rows) < m, (bm, bn))
    masked_store(o_ref, (pl.ds(row0, bm), pl.ds(n0, bn)), jnp.zeros((bm, bn), o_ref.dtype),
                 valid)
    return carry

  jax.lax.fori_loop(0, jax.lax.div(m - total + (bm - 1), bm), zero_block, 0)
