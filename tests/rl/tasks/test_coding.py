"""Coding task sandbox: semantics, hostile programs stay inside their bounds, rewards."""

import inspect
import re

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from trace_jax.rl.tasks import coding
from trace_jax.rl.tasks.coding import ERRORS, FAMILIES, CodingTask, Limits, run_program


def _value(src, inputs=()):
  res = run_program(src, inputs)
  assert res.ok, res
  return res.value


def test_semantics():
  assert _value("PUSH 3 PUSH 4 ADD") == 7
  assert _value("SUB", [10, 3]) == 7
  assert _value("SWAP SUB", [10, 3]) == -7
  assert _value("MUL NEG", [6, 7]) == -42
  assert _value("PUSH -7 PUSH 2 DIV") == -4  # floor division
  assert _value("PUSH -7 PUSH 2 MOD") == 1
  assert _value("OVER", [1, 2]) == 1
  assert _value("DUP ADD", [5]) == 10
  assert _value("PUSH 1 POP", [4]) == 4
  assert _value("PUSH 1 PUSH 2 HALT PUSH 3") == 2
  assert _value("PUSH 0 JZ skip PUSH 5 skip: PUSH 6") == 6
  assert _value("PUSH 1 JZ skip PUSH 5 skip:") == 5
  # The shipped loop program: 1 + 2 + ... + x.
  for x in range(13):
    assert _value(coding._LOOP_SUM, [x]) == x * (x + 1) // 2


@pytest.mark.parametrize("src,inputs,error", [
    ("ADD", [1], "stack_underflow"),
    ("POP", [], "stack_underflow"),
    ("POP", [3], "empty_stack"),
    ("PUSH 1 PUSH 0 DIV", [], "div_zero"),
    ("PUSH 1 PUSH 0 MOD", [], "div_zero"),
    ("JMP nowhere", [], "syntax"),
    ("PUSH", [], "syntax"),
    ("PUSH x", [], "syntax"),
    ("PUSH 1.5", [], "syntax"),
    ("push 1", [], "syntax"),
    ("a: a: PUSH 1", [], "syntax"),
    ("Bad-Label: PUSH 1", [], "syntax"),
    ("PUSH 1", [10**12], "bad_input"),
])
def test_errors(src, inputs, error):
  res = run_program(src, inputs)
  assert not res.ok and res.error == error and res.value is None and res.message


def test_infinite_loop_stops_at_step_limit():
  res = run_program("top: JMP top", [], Limits(max_steps=500))
  assert res.error == "step_limit" and res.steps == 500
  res = run_program("top: PUSH 0 JZ top", [])
  assert res.error == "step_limit" and res.steps == Limits().max_steps


def test_stack_bomb_stops_at_stack_limit():
  for src in ["top: DUP JMP top", "top: PUSH 1 JMP top", "top: OVER JMP top"]:
    res = run_program(src, [1, 2], Limits(max_stack=16))
    assert res.error == "stack_overflow", src
    assert res.steps < 100


def test_huge_numbers_stop():
  res = run_program("top: DUP MUL JMP top", [3])  # 3, 9, 81, ... squared without end
  assert res.error == "int_overflow" and res.steps < 30
  assert run_program("PUSH 999999999 PUSH 999999999 ADD", []).error == "int_overflow"
  assert run_program("PUSH 1000000000", []).error == "syntax"  # 10 digits
  assert run_program("PUSH 50 PUSH 50 MUL", [], Limits(max_abs=100)).error == "int_overflow"
  assert run_program("PUSH 500", [], Limits(max_abs=100)).error == "int_overflow"


def test_python_code_is_just_a_syntax_error(monkeypatch, tmp_path):
  def forbidden(*args, **kwargs):
    raise AssertionError("the sandbox must not call eval/exec/compile")

  # Shadow the builtins in the module's namespace: any call from the sandbox would fail.
  for name in ("eval", "exec", "compile", "__import__", "open"):
    monkeypatch.setattr(coding, name, forbidden, raising=False)
  marker = tmp_path / "pwned"
  hostile = [f"__import__('os').system('touch {marker}')", f"open('{marker}', 'w')",
             "exec('1')", "eval", "PUSH 1; ADD", "PUSH 1 JMP __import__", "import os",
             "PUSH 9**9**9", "PUSH 1e9", "\x00\x01"]
  for src in hostile:
    res = run_program(src, [1, 2])
    assert not res.ok and res.error == "syntax", src
  assert _value("PUSH 2 PUSH 3 MUL") == 6  # still works with eval/exec gone
  monkeypatch.undo()
  assert not marker.exists()
  source = inspect.getsource(coding)
  assert not re.search(r"(?<![\w.])(eval|exec|compile|__import__|open|getattr)\(", source)
  assert not re.search(r"import (os|sys|subprocess|importlib)", source)


def test_long_source_is_rejected_before_parsing():
  res = run_program("PUSH 1 " * 1_000_000, [])
  assert res.error == "syntax" and "characters" in res.message
  res = run_program("DUP POP " * 200, [1])  # 400 instructions > 256
  assert res.error == "syntax" and "instructions" in res.message


_TOKENS = sorted(coding.OPCODES) + ["a:", "b:", "a", "b", "0", "1", "-3", "999999999",
                                    "x(", "__import__", "PUSH 7", "JMP a", "JZ b", "\n"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(_TOKENS), max_size=40),
       st.lists(st.integers(-10**9, 10**9), max_size=3))
def test_random_programs_always_terminate_within_bounds(tokens, inputs):
  limits = Limits(max_steps=300, max_stack=16)
  res = run_program(" ".join(tokens), inputs, limits)
  assert res.steps <= limits.max_steps
  if res.ok:
    assert abs(res.value) <= limits.max_abs
  else:
    assert res.error in ERRORS and res.value is None


@pytest.mark.parametrize("level", [1, 2, 3])
def test_demonstrations_pass_all_tests(level):
  task = CodingTask(level=level)
  families = set()
  for p in task.sample(level, 400):
    assert task.reward(p, task.demonstration(p)) == 1.0, p
    families.add(p.meta["family"])
  assert families == {k for k, f in FAMILIES.items() if f.level <= level}


def test_reward_is_fraction_of_hidden_tests():
  task = CodingTask(level=2)
  p = next(p for p in task.sample(0, 100) if p.meta["family"] == "sum2")
  # "ADD" is right; "MUL" is right only where x + y == x * y; hostile code scores 0.
  tests = p.meta["tests"]
  want = sum((x + y) == (x * y) for (x, y), _ in tests) / len(tests)
  assert task.reward(p, "ADD") == 1.0
  assert task.reward(p, "MUL") == want
  assert task.reward(p, "top: JMP top") == 0.0
  assert task.reward(p, "__import__('os')") == 0.0
  # The empty program leaves y on top: right only where x == 0.
  assert task.reward(p, "") == sum(x == 0 for (x, _), _ in tests) / len(tests)
  assert task.sample(3, 5) == task.sample(3, 5)
