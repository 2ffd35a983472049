"""Long-horizon game: environment rules, end-of-episode reward, token layout and loss mask."""

import numpy as np
import pytest

from trace_jax.rl.tasks.base import Problem
from trace_jax.rl.tasks.long_horizon import (
    NumberGuessTask,
    demonstration_episode,
    episode_from_actions,
    parse_guess,
    run_episode,
    stack_episodes,
)
from trace_jax.rl.tokenizer import BOS_ID, EOS_ID, CharTokenizer

TOK = CharTokenizer()


def _problem(task, target):
  """The task's problem with this hidden number (built directly, as `sample` would)."""
  p = task.sample(0, 1)[0]
  return Problem(p.prompt, str(target), {"target": target, "max_turns": task.max_turns})


def test_rules():
  task = NumberGuessTask(max_number=31, slack=1)
  assert task.max_turns == 6
  p = _problem(task, 20)
  s = task.reset(p)
  s, obs = task.step(s, "guess 16")
  assert obs == "higher\n" and not s.done
  s, obs = task.step(s, "  guess 25 ")
  assert obs == "lower\n"
  s, obs = task.step(s, "I think 20")
  assert obs == "invalid\n" and s.turn == 3
  s, obs = task.step(s, "guess 20")
  assert obs == "correct\n" and s.done and task.final_reward(s) == 1.0
  with pytest.raises(ValueError, match="finished"):
    task.step(s, "guess 1")
  assert parse_guess("guess -3") == -3 and parse_guess("guess") is None


def test_running_out_of_turns_gives_zero():
  task = NumberGuessTask(max_number=7, slack=0)
  p = _problem(task, 7)
  actions, obs = task.play_text(p, ["guess 1\n"] * 10)
  assert len(actions) == task.max_turns == 3
  assert obs[-1] == "higher\ngame over\n"
  assert task.reward(p, "".join(a + o for a, o in zip(actions, obs))) == 0.0


@pytest.mark.parametrize("max_number,slack", [(7, 0), (31, 1), (100, 0)])
def test_binary_search_always_wins(max_number, slack):
  task = NumberGuessTask(max_number=max_number, slack=slack)
  for target in range(1, max_number + 1):
    p = _problem(task, target)
    assert task.reward(p, task.demonstration(p)) == 1.0
    assert len(task.binary_search_actions(p)) <= task.max_turns


def test_reward_replays_transcripts():
  task = NumberGuessTask()
  p = _problem(task, 20)
  demo = task.demonstration(p)
  assert demo.startswith("guess 16\nhigher\n") and demo.endswith("guess 20\ncorrect\n")
  assert task.reward(p, demo) == 1.0
  assert task.reward(p, demo + "trailing text") == 1.0  # the game already ended
  assert task.reward(p, "guess 20") == 1.0  # final observation not yet written
  assert task.reward(p, "guess 16\nlower\nguess 20\ncorrect\n") == 0.0  # forged observation
  assert task.reward(p, "guess 20\nincorrect\n") == 0.0
  assert task.reward(p, "") == 0.0
  assert task.reward(p, "guess 16\nhigher\n") == 0.0  # unfinished


def test_demonstration_episode_tokens_and_mask():
  task = NumberGuessTask()
  p = _problem(task, 20)
  ep = demonstration_episode(task, p, TOK)
  assert ep.reward == 1.0 and ep.num_turns == 3
  assert ep.ids.dtype == np.int32 and ep.ids.shape == ep.loss_mask.shape
  assert ep.ids[0] == BOS_ID and ep.ids[-1] == EOS_ID
  assert ep.loss_mask[0] == 0 and ep.loss_mask[-1] == 0
  policy_text = TOK.decode(ep.ids[ep.loss_mask == 1])
  env_text = TOK.decode(ep.ids[ep.loss_mask == 0], stop_at_eos=False)
  assert policy_text == "guess 16\nguess 24\nguess 20\n" == "".join(ep.actions)
  assert policy_text == "".join(task.binary_search_actions(p))
  assert env_text == p.prompt + "".join(ep.observations)
  # The full sequence reads as prompt + transcript, and the mask is 1 exactly on actions.
  assert TOK.decode(ep.ids) == p.prompt + task.demonstration(p)
  n_prompt = 1 + len(p.prompt)
  expected_mask = [0] * n_prompt
  for a, o in zip(ep.actions, ep.observations):
    expected_mask += [1] * len(a) + [0] * len(o)
  np.testing.assert_array_equal(ep.loss_mask, expected_mask + [0])


def test_run_episode_with_a_seeded_random_policy_is_deterministic():
  task = NumberGuessTask(max_number=15, slack=0)

  def play(seed):
    rng = np.random.default_rng(seed)
    seen = []

    def policy(ids):
      seen.append(list(ids))
      return TOK.encode(f"guess {int(rng.integers(1, 16))}\n")

    problem = task.sample(seed, 1)[0]
    return run_episode(task, problem, policy, TOK), seen

  (a, seen_a), (b, _) = play(3), play(3)
  np.testing.assert_array_equal(a.ids, b.ids)
  np.testing.assert_array_equal(a.loss_mask, b.loss_mask)
  assert a.reward == b.reward and a.reward in (0.0, 1.0)
  # The policy always sees the whole episode so far, which grows turn by turn.
  for prev, nxt in zip(seen_a, seen_a[1:]):
    assert nxt[:len(prev)] == prev and len(nxt) > len(prev)
  assert a.ids[:len(seen_a[-1])].tolist() == seen_a[-1]


def test_policy_tokens_stay_in_the_sequence_even_when_malformed():
  task = NumberGuessTask(max_number=3, slack=0)
  p = task.sample(0, 1)[0]
  ep = run_episode(task, p, lambda ids: TOK.encode("hmm") + [EOS_ID], TOK)
  assert ep.reward == 0.0 and ep.num_turns == task.max_turns == 2
  assert ep.observations == ("invalid\n", "invalid\ngame over\n")
  assert int(ep.loss_mask.sum()) == 2 * 4  # "hmm" + eos, twice


def test_episode_from_actions_and_stacking():
  task = NumberGuessTask()
  p = _problem(task, 20)
  with pytest.raises(ValueError, match="ran out"):
    episode_from_actions(task, p, ["guess 1\n"], TOK)
  short = episode_from_actions(task, p, ["guess 20\n"], TOK, bos_id=BOS_ID, eos_id=EOS_ID)
  long = demonstration_episode(task, p, TOK)
  ids, mask = stack_episodes([short, long])
  assert ids.shape == mask.shape == (2, len(long.ids))
  np.testing.assert_array_equal(ids[0, :len(short.ids)], short.ids)
  assert not ids[0, len(short.ids):].any() and not mask[0, len(short.ids):].any()
  np.testing.assert_array_equal(mask[1], long.loss_mask)
