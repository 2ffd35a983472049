"""Integrity of arrays at rest and in memory: content digests and finite-value checks.

A checkpoint records `tree_digests` of everything it saves when it commits; a restore
recomputes them and `verify_digests` refuses a tree whose bits changed on disk (a garbled file
that still decodes). `nonfinite_flags` is the finite-values guard: one reduction per leaf,
traceable inside a jitted step, so a training step reports whether its new state holds NaN or
Inf at almost no cost; `first_nonfinite` names the first such leaf.

Digests are computed on the device, over each array's bit pattern as uint32 words, with integer
arithmetic only (wrapping sums are exact and independent of the reduction order), so the same
bits give the same digest on any backend, sharding or host count.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# Bumped whenever the digest arithmetic changes: a stored digest of another version is not
# compared (it would mismatch for no fault of the data).
DIGEST_VERSION = "w32fmix-1"


class IntegrityError(ValueError):
  """Arrays whose content differs from their recorded digest, or holds non-finite values."""


def leaf_paths(tree: Any) -> list[str]:
  """The leaves' key paths (`['params']['layers']...`), in `jax.tree.leaves` order."""
  return [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(tree)]


def _words(x: jax.Array) -> jax.Array:
  """The bit pattern of `x` as a flat uint32 vector (one word per element of 1, 2 or 4 bytes;
  two per 8-byte element)."""
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.uint8)
  size = jnp.dtype(x.dtype).itemsize
  if size == 4:
    w = jax.lax.bitcast_convert_type(x, jnp.uint32)
  elif size in (1, 2):
    w = jax.lax.bitcast_convert_type(x, jnp.uint8 if size == 1 else jnp.uint16)
    w = w.astype(jnp.uint32)
  elif size == 8:
    w = jax.lax.bitcast_convert_type(x, jnp.uint32)  # [..., 2]
  else:
    raise TypeError(f"no digest for dtype {x.dtype}")
  return w.reshape(-1)


def _fmix32(h: jax.Array) -> jax.Array:
  """MurmurHash3's 32-bit finalizer: a bijection of uint32 that mixes every input bit."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _digest_words(x: jax.Array) -> jax.Array:
  """Two uint32 sums over the words: of fmix32(word ^ position key), and of that times an odd
  position weight. A single changed word always changes the first (the map is a bijection per
  position); random changes of many words pass both with probability about 2^-64."""
  w = _words(x)
  i = jax.lax.iota(jnp.uint32, w.shape[0])
  h = _fmix32(w ^ (i * jnp.uint32(0x9E3779B1)))
  s1 = jnp.sum(h, dtype=jnp.uint32)
  s2 = jnp.sum(h * (i * jnp.uint32(2) + jnp.uint32(1)), dtype=jnp.uint32)
  return jnp.stack([s1, s2])


@jax.jit
def _all_digests(leaves: list[jax.Array]) -> list[jax.Array]:
  return [_digest_words(x) for x in leaves]


def tree_digests(tree: Any) -> dict[str, str]:
  """{leaf path: "<dtype>[<shape>]:<16 hex digits>"} of every array leaf of `tree`."""
  leaves = [jnp.asarray(x) for x in jax.tree.leaves(tree)]
  sums = jax.device_get(_all_digests(leaves)) if leaves else []
  return {p: f"{jnp.dtype(x.dtype).name}{list(x.shape)}:{int(s[0]):08x}{int(s[1]):08x}"
          for p, x, s in zip(leaf_paths(tree), leaves, sums)}


def verify_digests(tree: Any, expected: Mapping[str, str]) -> None:
  """Raises IntegrityError naming the first leaf (and how many) whose digest differs from
  `expected` or that one side lacks."""
  got = tree_digests(tree)
  bad = [p for p in dict.fromkeys([*expected, *got]) if expected.get(p) != got.get(p)]
  if bad:
    first = bad[0]
    more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
    if first not in got or first not in expected:
      why = "is missing" if first not in got else "has no recorded digest"
      raise IntegrityError(f"array {first}{more} {why}")
    raise IntegrityError(f"the content of {first}{more} differs from its recorded digest "
                         f"(stored {expected[first]}, read {got[first]})")


def nonfinite_flags(tree: Any) -> jax.Array:
  """bool [leaves]: True where a leaf holds a NaN or an Inf (integer leaves: False). Traceable:
  inside a jitted step it is one reduction per leaf."""
  flags = [jnp.logical_not(jnp.all(jnp.isfinite(x)))
           if jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact) else jnp.zeros((), bool)
           for x in jax.tree.leaves(tree)]
  return jnp.stack(flags) if flags else jnp.zeros((0,), bool)


@jax.jit
def _nonfinite_flags(tree: Any) -> jax.Array:
  return nonfinite_flags(tree)


def first_nonfinite(tree: Any, flags: Any = None) -> str | None:
  """The path of the first leaf holding NaN/Inf (None when all are finite). flags: the leaves'
  `nonfinite_flags` if already computed (e.g. returned by a step), else computed here."""
  flags = np.asarray(jax.device_get(_nonfinite_flags(tree) if flags is None else flags))
  if not flags.any():
    return None
  return leaf_paths(tree)[int(np.argmax(flags))]


def check_finite(tree: Any, what: str) -> None:
  """Raises IntegrityError naming the first non-finite leaf of `tree` (`what` names the tree in
  the message, e.g. "the checkpoint at /x")."""
  bad = first_nonfinite(tree)
  if bad is not None:
    raise IntegrityError(f"{what} holds non-finite values (NaN or Inf) in {bad}")
