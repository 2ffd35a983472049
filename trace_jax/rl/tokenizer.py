"""Character-level tokenizer for the synthetic tasks, and helpers for any text tokenizer.

The synthetic tasks (reasoning, coding, long-horizon) only use printable ASCII and newlines,
so one id per character keeps the vocabulary below 128 and lets tiny models learn them. Ids
0, 1, 2 are pad, bos and eos; then newline, tab, and printable ASCII 32..126 (100 ids in all).

`TextTokenizer` is the small interface the tasks and the GSM8K loader need (`encode`,
`decode`); `encode_ids` also accepts HF `tokenizers.Tokenizer`, whose `encode` returns an
`Encoding` with `.ids`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
# Newline and tab first, then printable ASCII in code-point order (space .. '~').
CHARS = "\n\t" + "".join(chr(c) for c in range(32, 127))


class OutOfVocabularyError(ValueError):
  """A character the character-level vocabulary does not contain."""


class TextTokenizer(Protocol):
  """Anything that maps text to token ids and back."""

  def encode(self, text: str) -> Any: ...

  def decode(self, ids: Sequence[int]) -> str: ...


class CharTokenizer:
  """One token per character over a fixed printable-ASCII vocabulary plus pad/bos/eos.

  Stateless and deterministic; every instance has the same vocabulary, so ids are stable
  across runs and checkpoints.
  """

  pad_id = PAD_ID
  bos_id = BOS_ID
  eos_id = EOS_ID

  def __init__(self):
    offset = len(SPECIAL_TOKENS)
    self._char_to_id = {c: i + offset for i, c in enumerate(CHARS)}
    self._id_to_char = {i: c for c, i in self._char_to_id.items()}

  @property
  def vocab_size(self) -> int:
    return len(SPECIAL_TOKENS) + len(CHARS)

  def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
    """Text -> ids; raises OutOfVocabularyError naming the first unknown character."""
    ids = [BOS_ID] if add_bos else []
    table = self._char_to_id
    for pos, ch in enumerate(text):
      i = table.get(ch)
      if i is None:
        raise OutOfVocabularyError(
            f"character {ch!r} (U+{ord(ch):04X}) at position {pos} is not in the "
            f"character vocabulary (printable ASCII, newline and tab only)")
      ids.append(i)
    if add_eos:
      ids.append(EOS_ID)
    return ids

  def decode(self, ids: Sequence[int] | np.ndarray, *, stop_at_eos: bool = True,
             skip_special: bool = True) -> str:
    """Ids -> text. Stops at the first eos (by default) and drops pad/bos.

    With skip_special=False, special tokens are rendered by name (e.g. "<pad>").
    Unknown ids raise ValueError.
    """
    out = []
    for i in np.asarray(ids, dtype=np.int64).reshape(-1).tolist():
      if i == EOS_ID and stop_at_eos:
        break
      if 0 <= i < len(SPECIAL_TOKENS):
        if not skip_special:
          out.append(SPECIAL_TOKENS[i])
        continue
      ch = self._id_to_char.get(i)
      if ch is None:
        raise ValueError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
      out.append(ch)
    return "".join(out)

  def can_encode(self, text: str) -> bool:
    return all(c in self._char_to_id for c in text)


def encode_ids(tokenizer: TextTokenizer, text: str) -> list[int]:
  """`tokenizer.encode(text)` as a list of ints, for list-returning tokenizers and HF ones."""
  out = tokenizer.encode(text)
  ids = getattr(out, "ids", out)
  return [int(i) for i in ids]


def pad_batch(seqs: Sequence[Sequence[int]], *, pad_id: int = PAD_ID, length: int | None = None,
              side: str = "right") -> tuple[np.ndarray, np.ndarray]:
  """Pads id sequences into int32 ids [B, T] and a 0/1 int32 mask [B, T] (1 = real token).

  side="left" aligns the ends (prompts for generation), "right" aligns the starts. length
  defaults to the longest sequence; a sequence longer than `length` raises ValueError.
  """
  if side not in ("left", "right"):
    raise ValueError(f"side must be 'left' or 'right', got {side!r}")
  longest = max((len(s) for s in seqs), default=0)
  length = longest if length is None else length
  if longest > length:
    raise ValueError(f"a sequence has {longest} tokens, more than the padded length {length}")
  ids = np.full((len(seqs), length), pad_id, np.int32)
  mask = np.zeros((len(seqs), length), np.int32)
  for b, s in enumerate(seqs):
    n = len(s)
    if n == 0:
      continue
    sl = slice(0, n) if side == "right" else slice(length - n, length)
    ids[b, sl] = np.asarray(s, np.int32)
    mask[b, sl] = 1
  return ids, mask


def concat_prompt_completion(prompts: Sequence[Sequence[int]],
                             completions: Sequence[Sequence[int]], *, pad_id: int = PAD_ID,
                             length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
  """Right-padded prompt+completion ids [B, T] and a loss mask that is 1 on completion tokens.

  The usual single-turn RL/SFT layout: the loss sees only what the policy generated.
  """
  if len(prompts) != len(completions):
    raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
  seqs = [list(p) + list(c) for p, c in zip(prompts, completions)]
  ids, valid = pad_batch(seqs, pad_id=pad_id, length=length)
  loss_mask = np.zeros_like(valid)
  for b, (p, c) in enumerate(zip(prompts, completions)):
    loss_mask[b, len(p):len(p) + len(c)] = 1
  return ids, loss_mask


class HFTokenizer:
  """A Hugging Face tokenizer read from a local directory (or a tokenizer.json file).

  The directory is what `save_pretrained` writes (`tokenizer.json`, and `tokenizer_config.json`
  naming the special tokens), e.g. an HF checkpoint's. Uses the `tokenizers` library only, so
  no network and no transformers import. bos_id may be None (Qwen tokenizers have no BOS);
  eos_id is required: it ends completions.
  """

  def __init__(self, path: str):
    import json
    import os
    try:
      import tokenizers
    except ImportError as e:  # pragma: no cover - a dependency of the package
      raise ImportError("HF tokenizers need the `tokenizers` package") from e
    file = path if path.endswith(".json") else os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
      raise FileNotFoundError(f"no HF tokenizer at {path!r}: expected {file} (a directory "
                              "written by save_pretrained, or a tokenizer.json)")
    self.path = path
    self._tok = tokenizers.Tokenizer.from_file(file)
    special = {}
    cfg_file = os.path.join(os.path.dirname(file), "tokenizer_config.json")
    if os.path.isfile(cfg_file):
      with open(cfg_file) as f:
        special = json.load(f)

    def token_id(name: str, fallbacks: tuple[str, ...]) -> int | None:
      tok = special.get(name)
      tok = tok.get("content") if isinstance(tok, dict) else tok
      for t in ((tok,) if tok else ()) + fallbacks:
        i = self._tok.token_to_id(t)
        if i is not None:
          return int(i)
      return None

    self.eos_id = token_id("eos_token", ("<|endoftext|>", "</s>", "<eos>", "<|im_end|>"))
    if self.eos_id is None:
      raise ValueError(f"tokenizer {path!r} names no end-of-sequence token "
                       "(tokenizer_config.json eos_token) that its vocabulary holds")
    self.bos_id = token_id("bos_token", ())
    self.pad_id = token_id("pad_token", ()) or 0

  @property
  def vocab_size(self) -> int:
    return int(self._tok.get_vocab_size(with_added_tokens=True))

  def encode(self, text: str) -> list[int]:
    return list(self._tok.encode(text, add_special_tokens=False).ids)

  def decode(self, ids: Sequence[int]) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


def make_tokenizer(spec: str | None) -> CharTokenizer | HFTokenizer:
  """The tokenizer a config names (`task.tokenizer`): None or "char" for the character
  tokenizer of the shipped tasks, else a local HF tokenizer directory."""
  if spec in (None, "", "char"):
    return CharTokenizer()
  return HFTokenizer(str(spec))
