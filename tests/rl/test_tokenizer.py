"""Character tokenizer: vocabulary, round trips, errors, padding helpers."""

import numpy as np
import pytest

from trace_jax.rl import tasks
from trace_jax.rl.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    CharTokenizer,
    OutOfVocabularyError,
    concat_prompt_completion,
    encode_ids,
    pad_batch,
)


def test_vocab_and_round_trip():
  tok = CharTokenizer()
  assert tok.vocab_size == 100 <= 128
  text = "Ava has 7 apples.\n\t#### 12 {x}[y] ~!@$%^&*()_+-=|\\;:'\",.<>/?`"
  ids = tok.encode(text)
  assert len(ids) == len(text) and min(ids) >= 3 and max(ids) < tok.vocab_size
  assert tok.decode(ids) == text
  assert tok.encode("a", add_bos=True, add_eos=True) == [BOS_ID, tok.encode("a")[0], EOS_ID]
  assert CharTokenizer().encode(text) == ids  # every instance has the same vocabulary


def test_decode_specials():
  tok = CharTokenizer()
  ids = [BOS_ID] + tok.encode("ab") + [EOS_ID] + tok.encode("c") + [PAD_ID]
  assert tok.decode(ids) == "ab"
  assert tok.decode(ids, stop_at_eos=False) == "abc"
  assert tok.decode(ids, stop_at_eos=False, skip_special=False) == "<bos>ab<eos>c<pad>"
  assert tok.decode(np.array(ids, np.int32)) == "ab"
  with pytest.raises(ValueError, match="outside the vocabulary"):
    tok.decode([tok.vocab_size])


def test_out_of_vocabulary_error():
  tok = CharTokenizer()
  with pytest.raises(OutOfVocabularyError, match=r"'é' \(U\+00E9\) at position 2"):
    tok.encode("caé")
  assert not tok.can_encode("\r") and tok.can_encode("ok\n")


def test_pad_batch():
  ids, mask = pad_batch([[5, 6, 7], [8]], pad_id=0)
  np.testing.assert_array_equal(ids, [[5, 6, 7], [8, 0, 0]])
  np.testing.assert_array_equal(mask, [[1, 1, 1], [1, 0, 0]])
  ids, mask = pad_batch([[5, 6, 7], [8], []], side="left", length=4)
  np.testing.assert_array_equal(ids, [[0, 5, 6, 7], [0, 0, 0, 8], [0, 0, 0, 0]])
  np.testing.assert_array_equal(mask, [[0, 1, 1, 1], [0, 0, 0, 1], [0, 0, 0, 0]])
  assert ids.dtype == np.int32
  with pytest.raises(ValueError, match="more than the padded length"):
    pad_batch([[1, 2, 3]], length=2)
  with pytest.raises(ValueError, match="side"):
    pad_batch([[1]], side="middle")


def test_concat_prompt_completion_mask():
  ids, mask = concat_prompt_completion([[1, 10, 11], [1, 12]], [[20, 2], [21, 22, 2]])
  np.testing.assert_array_equal(ids, [[1, 10, 11, 20, 2], [1, 12, 21, 22, 2]])
  np.testing.assert_array_equal(mask, [[0, 0, 0, 1, 1], [0, 0, 1, 1, 1]])
  ids, mask = concat_prompt_completion([[1]], [[5]], length=4)
  np.testing.assert_array_equal(mask, [[0, 1, 0, 0]])


def test_encode_ids_accepts_encoding_objects():
  class FakeEncoding:
    ids = (4, 5)

  class FakeTokenizer:
    def encode(self, text):
      return FakeEncoding()

  assert encode_ids(FakeTokenizer(), "x") == [4, 5]
  assert encode_ids(CharTokenizer(), "ab") == CharTokenizer().encode("ab")


@pytest.mark.parametrize("name", sorted(tasks.TASKS))
def test_every_task_text_is_in_vocabulary(name):
  task, tok = tasks.get_task(name), CharTokenizer()
  for p in task.sample(0, 50):
    assert tok.decode(tok.encode(p.prompt + task.demonstration(p))) == p.prompt + \
        task.demonstration(p)


@pytest.mark.parametrize("bos", [False, True], ids=["no_bos", "bos"])
def test_hf_tokenizer_directory(bpe_tokenizer, bos):
  from trace_jax.rl.tokenizer import HFTokenizer, make_tokenizer
  tok = make_tokenizer(bpe_tokenizer(bos=bos))
  assert isinstance(tok, HFTokenizer)
  text = "Ava has 7 apples.\n7+5=12\n#### 12"
  ids = tok.encode(text)
  assert tok.decode(ids) == text and len(ids) < len(text)  # merges, and a lossless round trip
  assert tok.eos_id == tok._tok.token_to_id("<|endoftext|>")
  assert (tok.bos_id is not None) == bos
  assert tok.decode(ids + [tok.eos_id]) == text  # special tokens dropped
  assert 256 < tok.vocab_size <= 400


def test_hf_tokenizer_errors(tmp_path, bpe_tokenizer):
  from trace_jax.rl.tokenizer import CharTokenizer as Char
  from trace_jax.rl.tokenizer import make_tokenizer
  assert isinstance(make_tokenizer(None), Char) and isinstance(make_tokenizer("char"), Char)
  with pytest.raises(FileNotFoundError, match="no HF tokenizer"):
    make_tokenizer(str(tmp_path / "missing"))
  with pytest.raises(ValueError, match="end-of-sequence"):
    make_tokenizer(bpe_tokenizer(eos=False))
