"""GSM8K-style loader and math verifier; the shipped sample; HF tokenizers when installed."""

import importlib.util
import json
from fractions import Fraction

import pytest

from trace_jax.rl.tasks.gsm8k import (
    SAMPLE_PATH,
    GSM8KTask,
    encode_problem,
    extract_final_answer,
    load_jsonl,
    math_equal,
    math_reward,
    normalize_number,
)
from trace_jax.rl.tokenizer import CharTokenizer

HAS_TOKENIZERS = importlib.util.find_spec("tokenizers") is not None


def test_sample_file_loads_and_demonstrations_verify():
  problems = load_jsonl(SAMPLE_PATH)
  assert len(problems) >= 5
  task = GSM8KTask()
  for p in problems:
    assert p.prompt.startswith("Question: ") and p.prompt.endswith("\nAnswer: ")
    assert "<<" not in task.demonstration(p)
    assert task.reward(p, task.demonstration(p)) == 1.0
  assert load_jsonl(SAMPLE_PATH, strip_calc=False)[0].meta["solution"].count("<<") == 2
  assert len(load_jsonl(SAMPLE_PATH, limit=2)) == 2


def test_normalize_and_compare():
  assert normalize_number("1,200") == 1200
  assert normalize_number(" $52 ") == 52
  assert normalize_number("8.75.") == Fraction(35, 4)
  assert normalize_number("-3") == -3 and normalize_number(".5") == Fraction(1, 2)
  for bad in ["", "abc", "1e5", "12 apples", "1/0", "--3", "9" * 100]:
    assert normalize_number(bad) is None, bad
  assert math_equal("1,800", "1800") and math_equal("1800.0", "1800")
  assert math_equal("$1800.", "1,800") and not math_equal("1801", "1800")
  assert not math_equal("x", "x")


def test_math_reward():
  assert math_reward("so 7 muffins.\n#### 7", "7") == 1.0
  assert math_reward("#### $1,200.", "1200") == 1.0
  assert math_reward("#### 7.0", "7") == 1.0
  assert math_reward("#### 8", "7") == 0.0
  assert math_reward("the answer is 7", "7") == 0.0
  assert math_reward("the answer is 7", "7", fallback_last_number=True) == 1.0
  assert math_reward("#### seven", "7") == 0.0
  assert extract_final_answer("a\n#### 3\n#### 4 \nb") == "4"


def test_malformed_jsonl(tmp_path):
  cases = {
      "{not json": "not valid JSON",
      json.dumps({"question": "q"}): "string fields",
      json.dumps({"question": "q", "answer": "no final line"}): "final line",
      json.dumps({"question": "q", "answer": "#### lots"}): "final line",
      json.dumps([1, 2]): "string fields",
  }
  for line, message in cases.items():
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"question": "ok", "answer": "#### 1"}) + "\n\n" + line + "\n")
    with pytest.raises(ValueError, match=message) as e:
      load_jsonl(path)
    assert "bad.jsonl:3" in str(e.value)
  (tmp_path / "empty.jsonl").write_text("\n")
  with pytest.raises(ValueError, match="no records"):
    GSM8KTask(tmp_path / "empty.jsonl")


def test_sampling_is_seeded_and_without_replacement():
  task = GSM8KTask()
  n = len(task.problems)
  assert task.sample(1, n) == task.sample(1, n)
  assert sorted(p.meta["line"] for p in task.sample(1, n)) == list(range(1, n + 1))
  assert len(task.sample(2, 3 * n)) == 3 * n


def test_char_tokenizer_round_trip():
  tok, task = CharTokenizer(), GSM8KTask()
  for p in task.problems:
    prompt_ids, demo_ids = encode_problem(p, tok)
    assert tok.decode(prompt_ids) == p.prompt
    assert task.reward(p, tok.decode(demo_ids)) == 1.0


@pytest.mark.skipif(not HAS_TOKENIZERS, reason="HF `tokenizers` is not installed")
def test_hf_tokenizer_round_trip():
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  task = GSM8KTask()
  texts = [p.prompt + task.demonstration(p) for p in task.problems]
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(texts, trainers.BpeTrainer(
      vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
  for p in task.problems:
    prompt_ids, demo_ids = encode_problem(p, tok)
    assert all(isinstance(i, int) for i in prompt_ids + demo_ids)
    assert tok.decode(prompt_ids) == p.prompt
    assert task.reward(p, tok.decode(demo_ids)) == 1.0
    _, wrong_ids = encode_problem(p, tok, completion="#### 123456")
    assert task.reward(p, tok.decode(wrong_ids)) == 0.0
