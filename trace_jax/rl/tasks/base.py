"""The task interface shared by every RL task: sample problems, score completions, demonstrate.

A task samples `Problem`s from an explicit numpy Generator (or an int seed), so the same seed
gives the same problems. `reward(problem, completion)` is a pure function of the problem and
the policy's completion text, in [0, 1]. `demonstration(problem)` is a completion that earns
reward 1, used for the SFT warm start.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np

Seed = int | np.random.Generator


@dataclasses.dataclass(frozen=True)
class Problem:
  """One prompt of a task.

  prompt: the text the policy sees. answer: the hidden reference (as text; its meaning is the
  task's). meta: whatever else the verifier or demonstration needs (hidden test cases, ...).
  """
  prompt: str
  answer: str
  meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@runtime_checkable
class Task(Protocol):
  """A task: `name`, `sample`, `reward` and `demonstration`."""

  name: str

  def sample(self, rng: Seed, n: int) -> list[Problem]:
    """n problems drawn with `rng` (a Generator, or an int seed)."""
    ...

  def reward(self, problem: Problem, completion: str) -> float:
    """Score in [0, 1] of `completion` as an answer to `problem`."""
    ...

  def demonstration(self, problem: Problem) -> str:
    """A completion with reward 1 (the SFT target)."""
    ...


def as_rng(rng: Seed) -> np.random.Generator:
  """A Generator from a Generator (returned as is) or an int seed."""
  if isinstance(rng, np.random.Generator):
    return rng
  if isinstance(rng, (int, np.integer)) and not isinstance(rng, bool):
    return np.random.default_rng(int(rng))
  raise TypeError(f"expected a numpy Generator or an int seed, got {type(rng).__name__}")


def check_count(n: int) -> int:
  if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 0:
    raise ValueError(f"number of problems must be a non-negative int, got {n!r}")
  return int(n)
