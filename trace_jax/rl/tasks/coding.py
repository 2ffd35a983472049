"""Coding task: write a program in a tiny stack language that we interpret in a sandbox.

The language (whitespace-separated tokens, case-sensitive):

  PUSH n        push the integer literal n (at most 9 digits, optional leading '-')
  POP           drop the top            DUP    duplicate the top
  SWAP          swap the top two        OVER   copy the second onto the top
  ADD SUB MUL   a b -> a+b, a-b, a*b
  DIV MOD       a b -> a // b, a % b (Python floor semantics; b == 0 is an error)
  NEG           a -> -a
  name:         define label `name` ([a-z_][a-z0-9_]*, at most 16 chars)
  JMP name      jump to the label
  JZ name       pop; jump to the label if it was 0
  HALT          stop

A program starts with its inputs on the stack in order (f(x, y): x pushed first, y on top) and
its result is the top of the stack when it halts or runs off the end.

The interpreter is a plain loop over parsed (opcode, argument) pairs; it never calls Python's
eval/exec/compile or touches I/O. Every run is bounded: source length, instruction count,
executed steps, stack depth and integer magnitude; crossing a bound ends the run with an
`ExecResult` naming the error (never an exception, never a hang). A program's reward is the
fraction of hidden test cases it passes; a program that does not parse gets 0.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence

import numpy as np

from trace_jax.rl.tasks.base import Problem, Seed, as_rng, check_count

OPCODES = frozenset({"PUSH", "POP", "DUP", "SWAP", "OVER", "ADD", "SUB", "MUL", "DIV", "MOD",
                     "NEG", "JMP", "JZ", "HALT"})
_BINARY = frozenset({"ADD", "SUB", "MUL", "DIV", "MOD"})
_LITERAL_RE = re.compile(r"-?\d{1,9}")
_LABEL_RE = re.compile(r"[a-z_][a-z0-9_]{0,15}")
# Error kinds an ExecResult can carry.
ERRORS = ("syntax", "step_limit", "stack_overflow", "stack_underflow", "int_overflow",
          "div_zero", "empty_stack", "bad_input")


@dataclasses.dataclass(frozen=True)
class Limits:
  """Bounds on one program and one run."""
  max_source_chars: int = 2000
  max_instructions: int = 256
  max_steps: int = 2000
  max_stack: int = 64
  max_abs: int = 10**9


DEFAULT_LIMITS = Limits()


@dataclasses.dataclass(frozen=True)
class ExecResult:
  """Outcome of a run: ok and value, or error (one of ERRORS) and a message."""
  ok: bool
  value: int | None = None
  error: str | None = None
  message: str = ""
  steps: int = 0


class SandboxError(Exception):
  """A program broke a rule of the language or a bound; `kind` is one of ERRORS."""

  def __init__(self, kind: str, message: str):
    super().__init__(message)
    self.kind = kind


Program = tuple[tuple[str, int], ...]  # (opcode, argument: literal or jump target, else 0)


def _short(tok: str) -> str:
  return repr(tok if len(tok) <= 24 else tok[:21] + "...")


def parse(source: str, limits: Limits = DEFAULT_LIMITS) -> Program:
  """Source -> instructions with resolved jump targets; raises SandboxError("syntax")."""
  if not isinstance(source, str):
    raise SandboxError("syntax", f"source must be a string, got {type(source).__name__}")
  if len(source) > limits.max_source_chars:
    raise SandboxError("syntax", f"source has {len(source)} characters, more than the limit "
                       f"{limits.max_source_chars}")
  tokens = source.split()
  labels: dict[str, int] = {}
  raw: list[tuple[str, str | int]] = []
  i = 0
  while i < len(tokens):
    tok = tokens[i]
    if tok.endswith(":"):
      name = tok[:-1]
      if not _LABEL_RE.fullmatch(name):
        raise SandboxError("syntax", f"bad label name {_short(name)} at token {i}")
      if name in labels:
        raise SandboxError("syntax", f"label {name!r} defined twice")
      labels[name] = len(raw)
      i += 1
      continue
    if tok not in OPCODES:
      raise SandboxError("syntax", f"unknown instruction {_short(tok)} at token {i}")
    if tok in ("PUSH", "JMP", "JZ"):
      if i + 1 >= len(tokens):
        raise SandboxError("syntax", f"{tok} at token {i} needs an argument")
      arg = tokens[i + 1]
      if tok == "PUSH":
        if not _LITERAL_RE.fullmatch(arg):
          raise SandboxError("syntax", f"PUSH needs an integer of at most 9 digits, got "
                             f"{_short(arg)} at token {i + 1}")
        raw.append((tok, int(arg)))
      else:
        if not _LABEL_RE.fullmatch(arg):
          raise SandboxError("syntax", f"{tok} needs a label name, got {_short(arg)}")
        raw.append((tok, arg))
      i += 2
    else:
      raw.append((tok, 0))
      i += 1
    if len(raw) > limits.max_instructions:
      raise SandboxError("syntax", f"more than {limits.max_instructions} instructions")
  program = []
  for op, arg in raw:
    if op in ("JMP", "JZ"):
      if arg not in labels:
        raise SandboxError("syntax", f"{op} to undefined label {arg!r}")
      arg = labels[arg]
    program.append((op, arg))
  return tuple(program)


def _pop(stack: list[int], op: str, n: int) -> list[int]:
  if len(stack) < n:
    raise SandboxError("stack_underflow", f"{op} needs {n} values, the stack has {len(stack)}")
  out = stack[-n:]
  del stack[-n:]
  return out


def _arith(op: str, a: int, b: int) -> int:
  if op == "ADD":
    return a + b
  if op == "SUB":
    return a - b
  if op == "MUL":
    return a * b
  if b == 0:
    raise SandboxError("div_zero", f"{op} by zero")
  return a // b if op == "DIV" else a % b


def execute(program: Program, inputs: Sequence[int], limits: Limits = DEFAULT_LIMITS) -> ExecResult:
  """Runs a parsed program on `inputs` within `limits`; never raises for program errors."""
  steps = 0
  try:
    stack = []
    for x in inputs:
      if not isinstance(x, (int, np.integer)) or abs(int(x)) > limits.max_abs:
        raise SandboxError("bad_input", f"input {x!r} is not an int within +-{limits.max_abs}")
      stack.append(int(x))
    if len(stack) > limits.max_stack:
      raise SandboxError("bad_input", f"{len(stack)} inputs exceed the stack limit")
    pc = 0
    while pc < len(program):
      if steps >= limits.max_steps:
        raise SandboxError("step_limit", f"stopped after {limits.max_steps} steps")
      steps += 1
      op, arg = program[pc]
      pc += 1
      if op == "HALT":
        break
      if op == "JMP":
        pc = arg
      elif op == "JZ":
        if _pop(stack, op, 1)[0] == 0:
          pc = arg
      elif op == "POP":
        _pop(stack, op, 1)
      elif op == "NEG":
        stack.append(-_pop(stack, op, 1)[0])
      elif op == "SWAP":
        a, b = _pop(stack, op, 2)
        stack += [b, a]
      elif op in _BINARY:
        a, b = _pop(stack, op, 2)
        value = _arith(op, a, b)
        if abs(value) > limits.max_abs:
          raise SandboxError("int_overflow", f"{op} gave a value beyond +-{limits.max_abs}")
        stack.append(value)
      else:  # PUSH, DUP, OVER grow the stack
        if len(stack) >= limits.max_stack:
          raise SandboxError("stack_overflow", f"stack deeper than {limits.max_stack}")
        if op == "PUSH":
          if abs(arg) > limits.max_abs:
            raise SandboxError("int_overflow", f"literal {arg} is beyond +-{limits.max_abs}")
          stack.append(arg)
        elif op == "DUP":
          stack.append(_pop(stack, op, 1)[0])
          stack.append(stack[-1])
        else:  # OVER
          a, b = _pop(stack, op, 2)
          stack += [a, b, a]
    if not stack:
      raise SandboxError("empty_stack", "the program ended with an empty stack")
    return ExecResult(ok=True, value=stack[-1], steps=steps)
  except SandboxError as e:
    return ExecResult(ok=False, error=e.kind, message=str(e), steps=steps)


def run_program(source: str, inputs: Sequence[int], limits: Limits = DEFAULT_LIMITS) -> ExecResult:
  """Parses and runs `source`; a parse error is an ExecResult with error "syntax"."""
  try:
    program = parse(source, limits)
  except SandboxError as e:
    return ExecResult(ok=False, error=e.kind, message=str(e))
  return execute(program, inputs, limits)


def score_program(source: str, tests: Sequence[tuple[Sequence[int], int]],
                  limits: Limits = DEFAULT_LIMITS) -> float:
  """Fraction of (inputs, expected) cases the program passes; 0 if it does not parse."""
  if not tests:
    raise ValueError("score_program needs at least one test case")
  try:
    program = parse(source, limits)
  except SandboxError:
    return 0.0
  passed = 0
  for inputs, expected in tests:
    res = execute(program, inputs, limits)
    passed += int(res.ok and res.value == expected)
  return passed / len(tests)


# ------------------------------------------------------------------------------ task families

@dataclasses.dataclass(frozen=True)
class _Family:
  """A target function: formula text, reference, correct program, input domain, level."""
  level: int
  arity: int
  formula: Callable[[int, int], str]
  reference: Callable[[int, int, Sequence[int]], int]
  program: Callable[[int, int], str]
  lo: int = -9
  hi: int = 9


_LOOP_SUM = "PUSH 0 SWAP loop: DUP JZ end SWAP OVER ADD SWAP PUSH 1 SUB JMP loop end: POP"

FAMILIES = {
    "add_const": _Family(1, 1, lambda a, b: f"x+{b}", lambda a, b, v: v[0] + b,
                         lambda a, b: f"PUSH {b} ADD"),
    "sub_const": _Family(1, 1, lambda a, b: f"x-{b}", lambda a, b, v: v[0] - b,
                         lambda a, b: f"PUSH {b} SUB"),
    "scale": _Family(1, 1, lambda a, b: f"{a}*x", lambda a, b, v: a * v[0],
                     lambda a, b: f"PUSH {a} MUL"),
    "square": _Family(1, 1, lambda a, b: "x*x", lambda a, b, v: v[0] * v[0],
                      lambda a, b: "DUP MUL"),
    "affine": _Family(2, 1, lambda a, b: f"{a}*x+{b}", lambda a, b, v: a * v[0] + b,
                      lambda a, b: f"PUSH {a} MUL PUSH {b} ADD"),
    "shift_scale": _Family(2, 1, lambda a, b: f"(x+{b})*{a}", lambda a, b, v: (v[0] + b) * a,
                           lambda a, b: f"PUSH {b} ADD PUSH {a} MUL"),
    "square_plus": _Family(2, 1, lambda a, b: f"x*x+{b}", lambda a, b, v: v[0] * v[0] + b,
                           lambda a, b: f"DUP MUL PUSH {b} ADD"),
    "sum2": _Family(2, 2, lambda a, b: "x+y", lambda a, b, v: v[0] + v[1], lambda a, b: "ADD"),
    "diff2": _Family(2, 2, lambda a, b: "x-y", lambda a, b, v: v[0] - v[1], lambda a, b: "SUB"),
    "rdiff2": _Family(2, 2, lambda a, b: "y-x", lambda a, b, v: v[1] - v[0],
                      lambda a, b: "SWAP SUB"),
    "prod2": _Family(2, 2, lambda a, b: "x*y", lambda a, b, v: v[0] * v[1], lambda a, b: "MUL"),
    "prod2_plus": _Family(3, 2, lambda a, b: f"x*y+{b}", lambda a, b, v: v[0] * v[1] + b,
                          lambda a, b: f"MUL PUSH {b} ADD"),
    "lin2": _Family(3, 2, lambda a, b: f"{a}*x+y", lambda a, b, v: a * v[0] + v[1],
                    lambda a, b: f"SWAP PUSH {a} MUL ADD"),
    "lin2_sub": _Family(3, 2, lambda a, b: f"x-{a}*y", lambda a, b, v: v[0] - a * v[1],
                        lambda a, b: f"PUSH {a} MUL SUB"),
    "mod": _Family(3, 1, lambda a, b: f"x%{a}", lambda a, b, v: v[0] % a,
                   lambda a, b: f"PUSH {a} MOD", lo=0, hi=30),
    "triangle": _Family(3, 1, lambda a, b: "1+2+...+x", lambda a, b, v: v[0] * (v[0] + 1) // 2,
                        lambda a, b: _LOOP_SUM, lo=0, hi=12),
}


class CodingTask:
  """Write a stack program for a stated f; reward = fraction of hidden test cases passed.

  level: 1 single-op functions of x; 2 adds two-op and two-input functions; 3 adds mixed
  two-input, modulo and a loop (1+2+...+x).
  """

  name = "coding"

  def __init__(self, level: int = 2, num_tests: int = 5, limits: Limits = DEFAULT_LIMITS):
    if level not in (1, 2, 3):
      raise ValueError(f"level must be 1, 2 or 3, got {level!r}")
    if num_tests < 1:
      raise ValueError(f"num_tests must be >= 1, got {num_tests}")
    self.level, self.num_tests, self.limits = level, num_tests, limits
    self.families = tuple(k for k, f in FAMILIES.items() if f.level <= level)

  def _problem(self, rng: np.random.Generator) -> Problem:
    key = self.families[rng.integers(len(self.families))]
    fam = FAMILIES[key]
    a, b = int(rng.integers(2, 6)), int(rng.integers(1, 10))
    args = "x" if fam.arity == 1 else "x,y"
    tests = []
    for _ in range(self.num_tests):
      v = tuple(int(x) for x in rng.integers(fam.lo, fam.hi + 1, size=fam.arity))
      tests.append((v, int(fam.reference(a, b, v))))
    return Problem(prompt=f"Write a stack program for f({args}) = {fam.formula(a, b)}\n",
                   answer=fam.program(a, b), meta={"family": key, "tests": tuple(tests)})

  def sample(self, rng: Seed, n: int) -> list[Problem]:
    rng = as_rng(rng)
    return [self._problem(rng) for _ in range(check_count(n))]

  def reward(self, problem: Problem, completion: str) -> float:
    return score_program(completion, problem.meta["tests"], self.limits)

  def demonstration(self, problem: Problem) -> str:
    return problem.answer
