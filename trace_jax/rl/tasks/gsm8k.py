"""GSM8K-style data: a JSONL loader and a numeric math verifier, for users' own data.

Each line is a JSON object with `question` and `answer`; the answer is a worked solution whose
last "#### n" gives the final number (GSM8K's format; its "<<48/2=24>>" calculator notes are
stripped by default). The verifier reads the text after the last "####" in a completion,
removes thousands separators, "$" and a trailing ".", and compares the numbers exactly as
fractions: "1,800", "$1800", "1800." and "1800.0" all equal "1800".

Works with any tokenizer with encode/decode (`encode_problem`), e.g. an HF
`trace_jax.rl.tokenizer.HFTokenizer` (a local HF tokenizer directory). A few original
records in the format ship in `data/gsm8k_sample.jsonl` (the default source).
"""

from __future__ import annotations

import json
import re
from fractions import Fraction
from pathlib import Path

import numpy as np

from trace_jax.rl.tasks.base import Problem, Seed, as_rng, check_count
from trace_jax.rl.tokenizer import TextTokenizer, encode_ids

MARKER = "####"
SAMPLE_PATH = Path(__file__).resolve().parent / "data" / "gsm8k_sample.jsonl"
PROMPT_TEMPLATE = "Question: {question}\nAnswer: "
_NUMBER_RE = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:/\d+)?")
_CALC_RE = re.compile(r"<<[^<>\n]*>>")
_LAST_NUMBER_RE = re.compile(r"[+-]?\$?\d[\d,]*(?:\.\d+)?")
_MAX_NUMBER_CHARS = 64


def extract_final_answer(text: str) -> str | None:
  """The text after the last "####" up to the end of its line, stripped; None if no marker."""
  idx = text.rfind(MARKER)
  if idx < 0:
    return None
  return text[idx + len(MARKER):].split("\n", 1)[0].strip()


def normalize_number(text: str) -> Fraction | None:
  """A number written as GSM8K answers write it ("1,200", "$52", "8.75.", "3/4"), or None."""
  s = text.strip().replace(",", "").replace("$", "").replace(" ", "")
  s = s.rstrip(".")
  if not s or len(s) > _MAX_NUMBER_CHARS or not _NUMBER_RE.fullmatch(s):
    return None
  try:
    return Fraction(s)
  except (ValueError, ZeroDivisionError):
    return None


def math_equal(prediction: str, reference: str) -> bool:
  """Whether two answer strings are the same number after normalisation."""
  a, b = normalize_number(prediction), normalize_number(reference)
  return a is not None and b is not None and a == b


def math_reward(completion: str, reference: str, *, fallback_last_number: bool = False) -> float:
  """1.0 if the completion's "####" answer equals the reference number, else 0.0.

  With fallback_last_number, a completion without "####" is judged by its last number.
  """
  pred = extract_final_answer(completion)
  if pred is None and fallback_last_number:
    found = _LAST_NUMBER_RE.findall(completion)
    pred = found[-1] if found else None
  return float(pred is not None and math_equal(pred, reference))


def strip_calculator(text: str) -> str:
  """Removes GSM8K calculator annotations "<<expr=value>>"."""
  return _CALC_RE.sub("", text)


def load_jsonl(path: str | Path = SAMPLE_PATH, *, limit: int | None = None,
               strip_calc: bool = True, prompt_template: str = PROMPT_TEMPLATE) -> list[Problem]:
  """Reads GSM8K-style records into Problems (answer: the final number as written).

  Blank lines are skipped; a malformed line raises ValueError naming the file and line.
  """
  problems = []
  with open(path, encoding="utf-8") as f:
    for lineno, line in enumerate(f, 1):
      if limit is not None and len(problems) >= limit:
        break
      if not line.strip():
        continue
      where = f"{path}:{lineno}"
      try:
        rec = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg})") from e
      if not isinstance(rec, dict) or not all(isinstance(rec.get(k), str)
                                              for k in ("question", "answer")):
        raise ValueError(f"{where}: expected an object with string fields 'question', 'answer'")
      final = extract_final_answer(rec["answer"])
      if final is None or normalize_number(final) is None:
        raise ValueError(f"{where}: the answer has no '#### <number>' final line")
      solution = strip_calculator(rec["answer"]) if strip_calc else rec["answer"]
      problems.append(Problem(prompt=prompt_template.format(question=rec["question"]),
                              answer=final, meta={"solution": solution, "line": lineno}))
  return problems


class GSM8KTask:
  """Problems from a GSM8K-style JSONL file; reward 1 iff the "####" number is right."""

  name = "gsm8k"

  def __init__(self, path: str | Path = SAMPLE_PATH, *, limit: int | None = None,
               strip_calc: bool = True, prompt_template: str = PROMPT_TEMPLATE,
               fallback_last_number: bool = False):
    self.problems = load_jsonl(path, limit=limit, strip_calc=strip_calc,
                               prompt_template=prompt_template)
    if not self.problems:
      raise ValueError(f"no records in {path}")
    self.fallback_last_number = fallback_last_number

  def sample(self, rng: Seed, n: int) -> list[Problem]:
    """n problems, without replacement while n <= the number of records."""
    rng, n = as_rng(rng), check_count(n)
    idx = rng.choice(len(self.problems), size=n, replace=n > len(self.problems))
    return [self.problems[i] for i in np.asarray(idx).tolist()]

  def reward(self, problem: Problem, completion: str) -> float:
    return math_reward(completion, problem.answer,
                       fallback_last_number=self.fallback_last_number)

  def demonstration(self, problem: Problem) -> str:
    return problem.meta["solution"]


def encode_problem(problem: Problem, tokenizer: TextTokenizer, completion: str | None = None
                   ) -> tuple[list[int], list[int]]:
  """(prompt ids, completion ids) with any encode/decode tokenizer.

  The completion defaults to the demonstration (the record's solution).
  """
  text = problem.meta["solution"] if completion is None else completion
  return encode_ids(tokenizer, problem.prompt), encode_ids(tokenizer, text)

