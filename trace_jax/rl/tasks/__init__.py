"""RL tasks shipped with the code (docs/design.md §8), and a registry by name.

reasoning: multi-step arithmetic word problems with an exact verifier.
coding: programs in a small sandboxed stack language, rewarded by running hidden tests.
long_horizon: a multi-turn number-guessing game, reward at the end, env tokens masked.
gsm8k: GSM8K-style JSONL data (bring your own file) with a numeric math verifier.
"""

from __future__ import annotations

from collections.abc import Callable

from trace_jax.rl.tasks.base import Problem, Task, as_rng
from trace_jax.rl.tasks.coding import CodingTask
from trace_jax.rl.tasks.gsm8k import GSM8KTask
from trace_jax.rl.tasks.long_horizon import Episode, NumberGuessTask
from trace_jax.rl.tasks.reasoning import ReasoningTask

TASKS: dict[str, Callable[..., Task]] = {
    "reasoning": ReasoningTask,
    "coding": CodingTask,
    "long_horizon": NumberGuessTask,
    "gsm8k": GSM8KTask,
}


def get_task(name: str, **kwargs) -> Task:
  """The task registered as `name`, built with `kwargs` (e.g. difficulty=1, level=3)."""
  if name not in TASKS:
    raise ValueError(f"unknown task {name!r}; known tasks: {sorted(TASKS)}")
  return TASKS[name](**kwargs)


__all__ = ["TASKS", "CodingTask", "Episode", "GSM8KTask", "NumberGuessTask", "Problem",
           "ReasoningTask", "Task", "as_rng", "get_task"]
