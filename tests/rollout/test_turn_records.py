"""turn_records: a session's records, kept turn by turn on the host, laid out as one batch."""

from __future__ import annotations

import numpy as np
import pytest

from trace_jax.guidance import byte_rows
from trace_jax.rollout import turn_records

W = 3  # bytes per token's record row: a uint16 position and a uint8 turn number


def _layout() -> byte_rows.Layout:
  return byte_rows.layout_of({"pos": np.zeros((1, 1), np.uint16),
                              "turn": np.zeros((1, 1, 1), np.uint8)}, 2)


def _rows(pos: np.ndarray, turn: int) -> np.ndarray:
  """Byte rows [B, C, W] whose record says the position and turn that wrote it; 0xFF..:
  padding (a position no row has)."""
  out = np.zeros(pos.shape + (W,), np.uint8)
  out[..., :2] = pos.astype(np.uint16)[..., None].view(np.uint8)
  out[..., 2] = turn
  return out


def _session(rng: np.random.Generator, b: int, turns: int):
  """Random turns as the engine's programs return them, and each row's expected transcript
  (the (position, turn) of every record row, built independently of `ragged`)."""
  lens = np.zeros(b, int)
  want = [[] for _ in range(b)]
  out = []
  for t in range(turns):
    fed = rng.integers(0, 4, b)  # rows with 0 sit the turn out
    fed[0] = max(fed[0], 1)
    closing = t == turns - 1
    c, s = 4, 6
    pos = np.full((b, c), 0xFFFF)
    for r in range(b):
      pos[r, :fed[r]] = lens[r] + np.arange(fed[r])
      want[r] += [(p, t) for p in pos[r, :fed[r]]]
    lens = lens + fed
    n_gen = None
    steps = None
    if not closing:
      n_gen = np.where(fed > 0, rng.integers(1, s + 1, b), 0)
      spos = np.full((b, s), 0xFFFF)
      for r in range(b):
        for k in range(1, n_gen[r]):  # step k fed the token sampled at step k - 1
          spos[r, k] = lens[r] + k - 1
          want[r].append((spos[r, k], t))
      lens = lens + np.maximum(n_gen - 1, 0)
      steps = _rows(spos, t)
    out.append(turn_records.Turn(chunk=_rows(pos, t), steps=steps, fed=fed, n_gen=n_gen))
  return out, want, lens


@pytest.mark.parametrize("b,turns,seed", [(1, 1, 0), (3, 2, 1), (5, 4, 2)],
                         ids=["one_row_closing_only", "two_turns", "rows_sitting_out"])
def test_ragged_is_each_transcript_in_order(b, turns, seed):
  turns_, want, lens = _session(np.random.default_rng(seed), b, turns)
  n = max(1, b - 1)  # the last padding row of the batch is not a sequence
  got = turn_records.ragged(turns_, [int(x) for x in lens[:n]], _layout())
  flat = [x for r in range(n) for x in want[r]]
  assert got["pos"].shape == (len(flat),) and got["turn"].shape == (len(flat), 1)
  assert got["pos"].tolist() == [p for p, _ in flat]
  assert got["turn"][:, 0].tolist() == [t for _, t in flat]
  for r in range(n):  # each transcript's positions are 0, 1, ... with no gap or repeat
    assert [p for p, _ in want[r]] == list(range(lens[r]))


def test_a_count_the_turns_do_not_hold_fails_loudly():
  turns_, _, lens = _session(np.random.default_rng(3), 2, 2)
  with pytest.raises(AssertionError, match="row 1 holds"):
    turn_records.ragged(turns_, [int(lens[0]), int(lens[1]) + 1], _layout())
