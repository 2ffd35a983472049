"""Reasoning task: problems are consistent, demonstrations verify, the verifier is exact."""

import re

import pytest

from trace_jax.rl.tasks.base import Problem
from trace_jax.rl.tasks.reasoning import DIFFICULTY, ReasoningTask, parse_final_answer

_EQ = re.compile(r"(\d+)([-+*/])(\d+)=(\d+)")


@pytest.mark.parametrize("difficulty", sorted(DIFFICULTY))
def test_worked_answers_are_correct_arithmetic(difficulty):
  task = ReasoningTask(difficulty)
  cfg = task.config
  for p in task.sample(difficulty, 300):
    steps = p.meta["steps"]
    assert cfg.min_steps <= len(steps) <= cfg.max_steps
    assert p.prompt.count(".") == len(steps) + 1 and p.prompt.endswith("now?\n")
    value = int(re.search(r"has (\d+) ", p.prompt).group(1))
    for eq in steps:
      a, op, b, c = _EQ.fullmatch(eq).groups()
      a, b, c = int(a), int(b), int(c)
      assert a == value
      assert c == {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op]
      assert op != "/" or a % 2 == 0
      assert 0 <= c <= cfg.max_value
      value = c
    assert str(value) == p.answer
    assert task.reward(p, task.demonstration(p)) == 1.0


def test_seeded_sampling_is_deterministic():
  task = ReasoningTask()
  assert task.sample(7, 20) == task.sample(7, 20)
  assert task.sample(7, 20) != task.sample(8, 20)


def test_verifier():
  task = ReasoningTask()
  p = Problem(prompt="", answer="18", meta={"steps": ("9*2=18",)})
  assert task.demonstration(p) == "9*2=18\n#### 18"
  for good in ["#### 18", "9*2=18\n#### 18\n", "####18", "#### 18  \nmore text", "#### +18",
               "#### 3\n#### 18"]:
    assert task.reward(p, good) == 1.0, good
  for bad in ["#### 17", "#### 18\n#### 3", "18", "", "####", "#### eighteen", "#### 18.0",
              "#### 18.", "#### 1 8", "#### 0x12", "#### " + "9" * 40, "## 18"]:
    assert task.reward(p, bad) == 0.0, bad
  assert parse_final_answer("#### -4") == -4
  assert parse_final_answer("no marker") is None


def test_bad_config():
  with pytest.raises(ValueError, match="difficulty"):
    ReasoningTask(difficulty=7)
  with pytest.raises(ValueError, match="min_steps"):
    ReasoningTask(min_steps=3, max_steps=2)
  with pytest.raises(ValueError, match="multipliers"):
    ReasoningTask(multipliers=(5,))
