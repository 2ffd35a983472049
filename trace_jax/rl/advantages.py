"""Group-normalised advantages for GRPO (docs/design.md §8).

Rewards arrive flat, [num_prompts * G], with each prompt's G samples contiguous. A sample's
advantage is its reward minus its group's mean, divided by the group's standard deviation plus
eps (GRPO), or not divided (Dr. GRPO, which avoids up-weighting near-uniform groups). A group
whose rewards are all equal gets advantage 0 everywhere: it carries no learning signal.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp


def _grouped(rewards: jax.Array, group_size: int) -> jax.Array:
  rewards = jnp.asarray(rewards)
  if rewards.ndim != 1:
    raise ValueError(f"rewards must be flat [num_prompts * G], got shape {rewards.shape}")
  if group_size < 1 or rewards.shape[0] % group_size:
    raise ValueError(f"{rewards.shape[0]} rewards do not split into groups of {group_size}")
  return rewards.astype(jnp.float32).reshape(-1, group_size)


def group_advantages(rewards: jax.Array, group_size: int, *, normalize_std: bool = True,
                     eps: float = 1e-6, ddof: int = 0) -> jax.Array:
  """Advantages float32 [num_prompts * G]: (r - mean_g) / (std_g + eps), or r - mean_g.

  ddof: 0 for the population std (default), 1 for the sample std some GRPO codes use.
  """
  r = _grouped(rewards, group_size)
  if ddof not in (0, 1) or (ddof == 1 and group_size < 2):
    raise ValueError(f"ddof must be 0, or 1 with G >= 2; got ddof={ddof}, G={group_size}")
  centred = r - jnp.mean(r, axis=1, keepdims=True)
  if normalize_std:
    centred = centred / (jnp.std(r, axis=1, keepdims=True, ddof=ddof) + eps)
  return centred.reshape(-1)


def group_stats(rewards: jax.Array, group_size: int) -> dict[str, jax.Array]:
  """Reward summary: mean, std over groups' means, and the fraction of uniform groups."""
  r = _grouped(rewards, group_size)
  uniform = jnp.all(r == r[:, :1], axis=1)
  return {"reward_mean": jnp.mean(r), "reward_group_mean_std": jnp.std(jnp.mean(r, axis=1)),
          "frac_uniform_groups": jnp.mean(uniform.astype(jnp.float32))}


ADVANTAGE_FNS: dict[str, Callable[..., jax.Array]] = {
    "grpo": group_advantages,
    "dr_grpo": functools.partial(group_advantages, normalize_std=False),
}


def get_advantage_fn(name: str) -> Callable[..., jax.Array]:
  """`fn(rewards, group_size, **kw)` registered under `name` ("grpo" or "dr_grpo")."""
  if name not in ADVANTAGE_FNS:
    raise ValueError(f"unknown advantage estimator {name!r}; known: {sorted(ADVANTAGE_FNS)}")
  return ADVANTAGE_FNS[name]
