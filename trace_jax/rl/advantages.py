"""Group-normalised advantages for GRPO (docs/design.md §8).

Rewards arrive flat, [num_prompts * G], with each prompt's G samples contiguous. A sample's
advantage is its reward minus its group's mean, divided by the group's standard deviation plus
eps (GRPO), or not divided (Dr. GRPO, which avoids up-weighting near-uniform groups). A group
whose rewards are all equal gets advantage 0 everywhere: it carries no learning signal.

Which standard deviation (`ADV_STDS`): "population" (ddof 0), "unbiased" (ddof 1, the sample
std that verl's and TRL's GRPO divide by), or "none" (centred only, Dr. GRPO).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

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

  ddof: 0 for the population std (default), 1 for the sample std (adv_std "unbiased").
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
# The standard deviations an advantage may divide by, as group_advantages' arguments.
ADV_STDS: dict[str, dict[str, Any]] = {
    "population": {"normalize_std": True, "ddof": 0},
    "unbiased": {"normalize_std": True, "ddof": 1},
    "none": {"normalize_std": False},
}
# Each estimator's own std when none is named.
DEFAULT_ADV_STD = {"grpo": "population", "dr_grpo": "none"}


def get_advantage_fn(name: str, adv_std: str | None = None) -> Callable[..., jax.Array]:
  """`fn(rewards, group_size, **kw)` of estimator `name` ("grpo" or "dr_grpo") dividing by
  `adv_std` (`ADV_STDS`; None: the estimator's own, `DEFAULT_ADV_STD`).

  "dr_grpo" is centred only: with a std other than "none" it is a contradiction (ValueError);
  "grpo" with "none" is the Dr. GRPO advantage.
  """
  if name not in ADVANTAGE_FNS:
    raise ValueError(f"unknown advantage estimator {name!r}; known: {sorted(ADVANTAGE_FNS)}")
  if adv_std is None:
    return ADVANTAGE_FNS[name]
  if adv_std not in ADV_STDS:
    raise ValueError(f"unknown adv_std {adv_std!r}; expected one of {tuple(ADV_STDS)}")
  if name == "dr_grpo" and adv_std != "none":
    raise ValueError(f"adv_std {adv_std!r} contradicts advantage 'dr_grpo', which does not "
                     "divide by a std (use adv_std 'none', or advantage 'grpo')")
  if adv_std == DEFAULT_ADV_STD[name]:
    return ADVANTAGE_FNS[name]
  return functools.partial(group_advantages, **ADV_STDS[adv_std])
