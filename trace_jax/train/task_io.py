"""A task with its tokenizer: prompts to ids, completions to text and rewards, demonstrations.

The tokenizer is the config's `task.tokenizer`: the character tokenizer of the shipped tasks by
default, or a local HF tokenizer directory (`trace_jax.rl.tokenizer.make_tokenizer`). Prompts
start with the tokenizer's BOS when it has one (Qwen tokenizers have none); completions end
with its EOS.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from trace_jax.rl.tasks import get_task
from trace_jax.rl.tasks.long_horizon import demonstration_episode
from trace_jax.rl.tokenizer import TextTokenizer, encode_ids, make_tokenizer
from trace_jax.rollout.protocol import RolloutEngine, Sample, SamplingParams
from trace_jax.train import episodes
from trace_jax.train.run_config import RunConfig, TaskConfig


@dataclasses.dataclass
class TaskIO:
  """A single-turn task with the tokenizer that turns its text into the model's ids and back
  (`TaskIO.of` picks `EpisodeIO` for a multi-turn environment)."""
  task: Any
  tok: TextTokenizer

  @property
  def eos_id(self) -> int:
    return int(self.tok.eos_id)

  @property
  def bos_ids(self) -> list[int]:
    """[BOS] when the tokenizer has one, else []."""
    bos = getattr(self.tok, "bos_id", None)
    return [] if bos is None else [int(bos)]

  def prompts(self, seed: int, n: int) -> tuple[list[Any], list[list[int]]]:
    problems = self.task.sample(seed, n)
    return problems, [self.bos_ids + encode_ids(self.tok, p.prompt) for p in problems]

  def text(self, tokens: list[int]) -> str:
    """Completion text without EOS; ids past the tokenizer's vocabulary (a larger model vocab)
    read '?'."""
    out, run = [], []
    for t in tokens:
      if t == self.eos_id:
        continue
      if t < self.tok.vocab_size:
        run.append(int(t))
        continue
      out += [self.tok.decode(run), "?"] if run else ["?"]
      run = []
    out.append(self.tok.decode(run) if run else "")
    return "".join(out)

  def rewards(self, problems: list[Any], samples: list[Sample]) -> np.ndarray:
    return np.asarray([self.task.reward(p, self.text(s.tokens))
                       for p, s in zip(problems, samples)], np.float32)

  def sampling(self, **kwargs: Any) -> SamplingParams:
    """SamplingParams that stop at this tokenizer's EOS."""
    return SamplingParams(stop_token_ids=(self.eos_id,), **kwargs)

  def generate(self, engine: RolloutEngine, problems: list[Any], prompts: list[list[int]],
               sampling: list[SamplingParams], record: bool = False) -> list[Sample]:
    """One completion per prompt (record: the engine records as configured; unused here)."""
    del problems, record
    return engine.generate(prompts, sampling)

  def demonstrations(self, problems: list[Any], prompts: list[list[int]]
                     ) -> tuple[list[list[int]], list[list[int]] | None]:
    """SFT targets after each prompt (+ EOS), and their loss masks (None: all of them)."""
    del prompts
    return [encode_ids(self.tok, self.task.demonstration(p)) + [self.eos_id]
            for p in problems], None

  def tokens_after_prompt(self, max_new_tokens: int) -> int:
    """Most tokens a sample holds after its prompt."""
    return max_new_tokens

  @staticmethod
  def of(task: Any, tok: TextTokenizer) -> TaskIO:
    """The TaskIO of a task: `EpisodeIO` for environments (played turn by turn)."""
    return EpisodeIO(task, tok) if episodes.is_environment(task) else TaskIO(task, tok)


class EpisodeIO(TaskIO):
  """A multi-turn environment (`reset`/`step`/`final_reward`, `trace_jax.train.episodes`):
  samples are played episodes, scored by the environment as they ran."""

  def rewards(self, problems: list[Any], samples: list[Sample]) -> np.ndarray:
    return np.asarray([s.meta["reward"] for s in samples], np.float32)

  def generate(self, engine: RolloutEngine, problems: list[Any], prompts: list[list[int]],
               sampling: list[SamplingParams], record: bool = False) -> list[Sample]:
    """One played episode per prompt (record: episodes' records for the trainer)."""
    return episodes.play(engine, self.task, self.tok, problems, prompts, sampling,
                         record=record)

  def demonstrations(self, problems: list[Any], prompts: list[list[int]]
                     ) -> tuple[list[list[int]], list[list[int]] | None]:
    """Demonstration episodes after each prompt, with the environment's tokens masked out."""
    eps = [demonstration_episode(self.task, p, self.tok) for p in problems]
    return ([e.ids[len(pr):].tolist() for e, pr in zip(eps, prompts)],
            [e.loss_mask[len(pr):].tolist() for e, pr in zip(eps, prompts)])

  def tokens_after_prompt(self, max_new_tokens: int) -> int:
    """Every turn's action and observation, then EOS."""
    return episodes.max_episode_tokens(self.task, max_new_tokens)


def make_task_io(task: TaskConfig | RunConfig) -> TaskIO:
  """The TaskIO of a run's task (name, kwargs, and optionally tokenizer)."""
  task = task.task if isinstance(task, RunConfig) else task
  return TaskIO.of(get_task(task.name, **dict(task.kwargs)), make_tokenizer(task.tokenizer))
