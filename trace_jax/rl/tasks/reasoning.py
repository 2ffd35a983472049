"""Multi-step arithmetic word problems with a worked answer and an exact verifier.

A problem starts a person with some items and applies 2-4 templated steps (buy, give away,
double, halve, ...) on small non-negative integers. The demonstration writes one equation per
step and ends with the final answer after the marker "#### ", e.g.

  Ava has 7 apples. She buys 5 more. She gives 3 to Ben. How many apples does Ava have now?
  7+5=12
  12-3=9
  #### 9

The verifier reads the integer after the last "####" (rest of that line) and compares it
exactly; anything else (no marker, not an integer) scores 0.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from trace_jax.rl.tasks.base import Problem, Seed, as_rng, check_count

MARKER = "####"
_INT_RE = re.compile(r"[+-]?\d{1,18}")

_PEOPLE = (("Ava", "She", "her"), ("Ben", "He", "his"), ("Cleo", "She", "her"),
           ("Dev", "He", "his"), ("Eli", "He", "his"), ("Fay", "She", "her"),
           ("Gus", "He", "his"), ("Ivy", "She", "her"))
_ITEMS = ("apples", "coins", "books", "stickers", "marbles", "cards", "pens", "shells")
_OTHERS = ("a friend", "Sam", "Mia", "Tom", "Zoe")
_ADD = ("{P} buys {n} more.", "{P} finds {n} more.", "{P} gets {n} more.")
_SUB = ("{P} gives {n} to {o}.", "{P} loses {n}.", "{P} sells {n}.")
_MUL = {2: "{P} doubles {h} {items}.", 3: "{P} triples {h} {items}.",
        4: "{P} makes 4 times as many {items}."}
_HALF = "{P} gives half of {h} {items} away."


@dataclasses.dataclass(frozen=True)
class ReasoningConfig:
  """Problem size. Steps count the operations after the starting amount."""
  min_steps: int = 2
  max_steps: int = 3
  max_start: int = 20
  max_operand: int = 20
  multipliers: tuple[int, ...] = (2, 3)
  max_value: int = 200
  # Share of "sloppy" demonstrations: correct working, but the answer line repeats the
  # starting amount ("7+5=12\n#### 7", reward 0). SFT on them gives a start that is wrong in
  # one systematic way the verifier's reward can teach away (the quickstart uses it).
  sloppy_demos: float = 0.0

  def __post_init__(self):
    if not 1 <= self.min_steps <= self.max_steps:
      raise ValueError(f"need 1 <= min_steps <= max_steps, got {self.min_steps}, {self.max_steps}")
    if self.max_start < 2 or self.max_operand < 1:
      raise ValueError("need max_start >= 2 and max_operand >= 1")
    if any(m not in _MUL for m in self.multipliers):
      raise ValueError(f"multipliers must be among {tuple(_MUL)}, got {self.multipliers}")
    if self.max_value < max(self.max_start, self.max_operand):
      raise ValueError("max_value must be at least max_start and max_operand")
    if not 0.0 <= self.sloppy_demos <= 1.0:
      raise ValueError(f"sloppy_demos must be in [0, 1], got {self.sloppy_demos}")


DIFFICULTY = {
    1: ReasoningConfig(2, 2, 9, 9, (2,), 99),
    2: ReasoningConfig(2, 3, 20, 20, (2, 3), 200),
    3: ReasoningConfig(2, 4, 50, 50, (2, 3, 4), 999),
}


def parse_final_answer(text: str) -> int | None:
  """The integer after the last "####" on its line, or None if absent or not an integer."""
  idx = text.rfind(MARKER)
  if idx < 0:
    return None
  tail = text[idx + len(MARKER):].split("\n", 1)[0].strip()
  if not _INT_RE.fullmatch(tail):
    return None
  return int(tail)


def _step(rng: np.random.Generator, value: int, cfg: ReasoningConfig) -> tuple[str, int, str]:
  """One operation on `value`: (sentence template, operand, equation). Keeps 0 <= value <= max."""
  muls = [m for m in cfg.multipliers if 0 < value * m <= cfg.max_value]
  kinds = [k for k, ok in (("add", value < cfg.max_value), ("sub", value > 0), ("mul", muls),
                           ("half", value > 0 and value % 2 == 0)) if ok]
  kind = kinds[rng.integers(len(kinds))]
  if kind == "add":
    n = int(rng.integers(1, min(cfg.max_operand, cfg.max_value - value) + 1))
    return _ADD[rng.integers(len(_ADD))], n, f"{value}+{n}={value + n}"
  if kind == "sub":
    n = int(rng.integers(1, min(cfg.max_operand, value) + 1))
    return _SUB[rng.integers(len(_SUB))], n, f"{value}-{n}={value - n}"
  if kind == "mul":
    m = muls[rng.integers(len(muls))]
    return _MUL[m], m, f"{value}*{m}={value * m}"
  return _HALF, 2, f"{value}/2={value // 2}"


def make_problem(rng: np.random.Generator, cfg: ReasoningConfig) -> Problem:
  """One word problem; its worked solution (one equation per step) goes in meta["steps"]."""
  name, pron, poss = _PEOPLE[rng.integers(len(_PEOPLE))]
  items = _ITEMS[rng.integers(len(_ITEMS))]
  value = int(rng.integers(2, cfg.max_start + 1))
  sentences = [f"{name} has {value} {items}."]
  equations = []
  for _ in range(int(rng.integers(cfg.min_steps, cfg.max_steps + 1))):
    template, n, eq = _step(rng, value, cfg)
    other = _OTHERS[rng.integers(len(_OTHERS))]
    sentences.append(template.format(P=pron, h=poss, items=items, n=n, o=other))
    equations.append(eq)
    value = int(eq.rsplit("=", 1)[1])
  sentences.append(f"How many {items} does {name} have now?")
  meta = {"steps": tuple(equations), "start": sentences[0].split()[2]}
  if cfg.sloppy_demos > 0:  # drawn only when used, so the problems of other configs stay put
    meta["sloppy"] = bool(rng.random() < cfg.sloppy_demos)
  return Problem(prompt=" ".join(sentences) + "\n", answer=str(value), meta=meta)


class ReasoningTask:
  """Templated arithmetic word problems; reward 1 iff the "####" answer is exactly right."""

  name = "reasoning"

  def __init__(self, difficulty: int = 2, **overrides):
    if difficulty not in DIFFICULTY:
      raise ValueError(f"difficulty must be one of {sorted(DIFFICULTY)}, got {difficulty!r}")
    self.config = dataclasses.replace(DIFFICULTY[difficulty], **overrides)

  def sample(self, rng: Seed, n: int) -> list[Problem]:
    rng = as_rng(rng)
    return [make_problem(rng, self.config) for _ in range(check_count(n))]

  def reward(self, problem: Problem, completion: str) -> float:
    got = parse_final_answer(completion)
    return float(got is not None and got == int(problem.answer))

  def demonstration(self, problem: Problem) -> str:
    """The worked solution; a `sloppy_demos` problem's answer line has the starting amount."""
    answer = problem.meta["start"] if problem.meta.get("sloppy") else problem.answer
    return "".join(eq + "\n" for eq in problem.meta["steps"]) + f"{MARKER} {answer}"
