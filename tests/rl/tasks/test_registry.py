"""Task registry; every task follows the protocol and its demonstrations earn reward 1."""

import pytest

from trace_jax.rl import tasks
from trace_jax.rl.tasks.base import Task, as_rng


@pytest.mark.parametrize("name", sorted(tasks.TASKS))
def test_demonstrations_get_full_reward_on_many_seeds(name):
  task = tasks.get_task(name)
  assert isinstance(task, Task) and task.name == name
  for seed in range(20):
    for p in task.sample(seed, 10):
      assert 0.0 <= task.reward(p, "nonsense ####") <= 1.0
      assert task.reward(p, task.demonstration(p)) == 1.0, (seed, p)


@pytest.mark.parametrize("name", sorted(tasks.TASKS))
def test_same_seed_same_problems(name):
  task = tasks.get_task(name)
  assert task.sample(5, 8) == task.sample(5, 8)
  assert task.sample(5, 0) == []


def test_get_task_kwargs_and_errors():
  assert tasks.get_task("reasoning", difficulty=1).config.max_steps == 2
  assert tasks.get_task("coding", level=3).level == 3
  assert tasks.get_task("long_horizon", max_number=63).max_turns == 7
  with pytest.raises(ValueError, match="known tasks"):
    tasks.get_task("chess")
  with pytest.raises(ValueError, match="non-negative"):
    tasks.get_task("reasoning").sample(0, -1)
  with pytest.raises(TypeError, match="Generator or an int"):
    as_rng(1.5)
