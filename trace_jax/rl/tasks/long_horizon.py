"""Long-horizon task: a multi-turn number-guessing game with the reward only at the end.

The environment picks a hidden number in [1, max_number] and tells the policy the range and
its number of guesses. Each turn the policy writes one line "guess N"; the environment answers
"higher", "lower" or "correct" (or "invalid" for an unreadable line, which still costs the
turn), and "game over" after the last unsuccessful guess. The episode's reward is 1 if the
number was found, else 0. Binary search always wins with floor(log2(max_number)) + 1 guesses;
the game allows that many plus `slack`.

Token layout of an episode (`Episode`): bos + prompt, then per turn the policy's action tokens
(loss mask 1) and the environment's observation tokens (loss mask 0), then eos (mask 0). Given
a problem and a deterministic policy the episode is deterministic; problems come from a seed.

The `Task` methods work on text: `demonstration` is the whole transcript (actions and
observations) of binary search, and `reward` replays a transcript against the environment
(a transcript whose observations do not match the environment's scores 0).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence

import numpy as np

from trace_jax.rl.tasks.base import Problem, Seed, as_rng, check_count
from trace_jax.rl.tokenizer import TextTokenizer, encode_ids, pad_batch

_GUESS_RE = re.compile(r"guess (-?\d{1,9})")
Policy = Callable[[list[int]], Sequence[int]]


@dataclasses.dataclass(frozen=True)
class GameState:
  """Where a game stands; `done` after a correct guess or the last allowed one."""
  target: int
  max_turns: int
  turn: int = 0
  found: bool = False
  done: bool = False


@dataclasses.dataclass(frozen=True)
class Episode:
  """One played episode: ids and loss_mask int32 [T] (1 on policy tokens), reward at the end."""
  ids: np.ndarray
  loss_mask: np.ndarray
  reward: float
  actions: tuple[str, ...]
  observations: tuple[str, ...]

  @property
  def num_turns(self) -> int:
    return len(self.actions)


def parse_guess(action: str) -> int | None:
  """The N of an action line "guess N" (surrounding whitespace ignored), else None."""
  m = _GUESS_RE.fullmatch(action.strip())
  return int(m.group(1)) if m else None


class NumberGuessTask:
  """Guess the hidden number in [1, max_number] within floor(log2(max_number)) + 1 + slack turns.

  max_number is the difficulty knob (more numbers, more turns).
  """

  name = "long_horizon"

  def __init__(self, max_number: int = 31, slack: int = 1):
    if max_number < 2:
      raise ValueError(f"max_number must be >= 2, got {max_number}")
    if slack < 0:
      raise ValueError(f"slack must be >= 0, got {slack}")
    self.max_number = max_number
    self.max_turns = int(max_number).bit_length() + slack

  # ---------------------------------------------------------------- Task protocol (text level)

  def sample(self, rng: Seed, n: int) -> list[Problem]:
    rng = as_rng(rng)
    out = []
    for _ in range(check_count(n)):
      target = int(rng.integers(1, self.max_number + 1))
      prompt = (f"I picked a number from 1 to {self.max_number}. You have {self.max_turns} "
                f"guesses. Reply: guess N\n")
      out.append(Problem(prompt=prompt, answer=str(target),
                         meta={"target": target, "max_turns": self.max_turns}))
    return out

  def reward(self, problem: Problem, completion: str) -> float:
    state, rest = self.reset(problem), completion
    while not state.done and rest:
      action, _, rest = rest.partition("\n")
      state, obs = self.step(state, action)
      if rest and not rest.startswith(obs):  # an observation the environment did not give
        return 0.0
      rest = rest[len(obs):]
    return self.final_reward(state)

  def demonstration(self, problem: Problem) -> str:
    actions, observations = self.play_text(problem, self.binary_search_actions(problem))
    return "".join(a + o for a, o in zip(actions, observations))

  # --------------------------------------------------------------------------- environment

  def reset(self, problem: Problem) -> GameState:
    return GameState(target=int(problem.meta["target"]), max_turns=int(problem.meta["max_turns"]))

  def step(self, state: GameState, action: str) -> tuple[GameState, str]:
    """Applies one action line; returns the new state and the observation text."""
    if state.done:
      raise ValueError("step called on a finished game")
    guess = parse_guess(action)
    turn = state.turn + 1
    if guess is None:
      obs = "invalid\n"
    elif guess == state.target:
      return dataclasses.replace(state, turn=turn, found=True, done=True), "correct\n"
    else:
      obs = "higher\n" if guess < state.target else "lower\n"
    done = turn >= state.max_turns
    return dataclasses.replace(state, turn=turn, done=done), obs + ("game over\n" if done else "")

  def final_reward(self, state: GameState) -> float:
    return float(state.found)

  @property
  def max_observation_len(self) -> int:
    """Characters in the longest observation (an upper bound on its tokens)."""
    return max(len(o) for o in ("invalid\n", "higher\n", "lower\n")) + len("game over\n")

  def binary_search_actions(self, problem: Problem) -> list[str]:
    """The optimal (binary search) action lines for this problem, each ending in newline."""
    lo, hi, target, actions = 1, self.max_number, int(problem.meta["target"]), []
    while True:
      mid = (lo + hi) // 2
      actions.append(f"guess {mid}\n")
      if mid == target:
        return actions
      lo, hi = (mid + 1, hi) if mid < target else (lo, mid - 1)

  def play_text(self, problem: Problem, actions: Sequence[str]
                ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Plays fixed action texts until the game ends; returns the used actions and observations."""
    state, used, observations = self.reset(problem), [], []
    for action in actions:
      if state.done:
        break
      state, obs = self.step(state, action.split("\n", 1)[0])
      used.append(action)
      observations.append(obs)
    return tuple(used), tuple(observations)


# ------------------------------------------------------------------------------ token episodes

def _special(tokenizer: TextTokenizer, name: str, given: int | None) -> list[int]:
  tid = given if given is not None else getattr(tokenizer, name, None)
  return [] if tid is None else [int(tid)]


def run_episode(task: NumberGuessTask, problem: Problem, policy: Policy,
                tokenizer: TextTokenizer, *, bos_id: int | None = None,
                eos_id: int | None = None) -> Episode:
  """Plays one episode with `policy(ids so far) -> action token ids` and builds its tokens.

  The action text is the decoded action ids up to the first newline; all of the action ids go
  in the sequence with loss mask 1, the environment's observation ids with mask 0. bos/eos
  default to the tokenizer's `bos_id`/`eos_id` attributes when it has them.
  """
  ids = _special(tokenizer, "bos_id", bos_id) + encode_ids(tokenizer, problem.prompt)
  mask = [0] * len(ids)
  state, actions, observations = task.reset(problem), [], []
  while not state.done:
    action_ids = [int(i) for i in policy(list(ids))]
    action = tokenizer.decode(action_ids)
    state, obs = task.step(state, action.split("\n", 1)[0])
    obs_ids = encode_ids(tokenizer, obs)
    ids += action_ids + obs_ids
    mask += [1] * len(action_ids) + [0] * len(obs_ids)
    actions.append(action)
    observations.append(obs)
  end = _special(tokenizer, "eos_id", eos_id)
  ids += end
  mask += [0] * len(end)
  return Episode(np.asarray(ids, np.int32), np.asarray(mask, np.int32), task.final_reward(state),
                 tuple(actions), tuple(observations))


def episode_from_actions(task: NumberGuessTask, problem: Problem, actions: Sequence[str],
                         tokenizer: TextTokenizer, **kwargs) -> Episode:
  """The episode of fixed action texts (e.g. a demonstration); actions after the end are unused.

  Raises ValueError if the actions run out before the game ends.
  """
  queue = list(actions)

  def scripted(_ids: list[int]) -> list[int]:
    if not queue:
      raise ValueError("the scripted actions ran out before the game ended")
    return encode_ids(tokenizer, queue.pop(0))

  return run_episode(task, problem, scripted, tokenizer, **kwargs)


def demonstration_episode(task: NumberGuessTask, problem: Problem, tokenizer: TextTokenizer,
                          **kwargs) -> Episode:
  """The binary-search episode (reward 1), for the SFT warm start with its loss mask."""
  return episode_from_actions(task, problem, task.binary_search_actions(problem), tokenizer,
                              **kwargs)


def stack_episodes(episodes: Sequence[Episode], *, pad_id: int = 0, length: int | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
  """Right-padded ids [B, T] and loss mask [B, T] (padding has mask 0)."""
  ids, _ = pad_batch([e.ids.tolist() for e in episodes], pad_id=pad_id, length=length)
  mask, _ = pad_batch([e.loss_mask.tolist() for e in episodes], pad_id=0, length=length)
  return ids, mask
