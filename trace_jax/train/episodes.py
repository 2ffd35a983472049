"""Multi-turn rollouts: a task that is an environment (`reset`/`step`/`final_reward`, e.g.
`long_horizon`) played through any `RolloutEngine`, turn by turn.

Each turn samples one action line (stop at newline or EOS, at most `max_new_tokens`) per live
episode; the environment's observation tokens follow it. The finished episode is one `Sample`
whose `tokens` hold actions and observations (then EOS), whose `logprobs` are the rollout's on
action tokens and 0 elsewhere, and whose `meta["loss_mask"]` marks the action tokens:
observations and EOS are not the policy's, so they stay out of the loss.

An engine with sessions (`InProcessEngine.open_session`) keeps each episode's KV cache across
turns: a turn feeds only the new tokens, and with `record=True` the records of every token are
written as the rollout computed them (decode and observation feeds), so the trainer consumes
exactly what the rollout computed. Other engines (HTTP) get the whole transcript as the prompt
of each turn, and with `record=True` one more call prefills each finished episode (one new
token, discarded) so the store holds its rows at rollout precision; `meta["turn_guidance_
batches"]` then names the turn calls' own records, for the caller to delete.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from trace_jax.rl.tokenizer import TextTokenizer, encode_ids
from trace_jax.rollout.protocol import RolloutEngine, Sample, SamplingParams


def is_environment(task: Any) -> bool:
  """Whether the task is played turn by turn rather than answered in one completion."""
  return all(callable(getattr(task, n, None)) for n in ("reset", "step", "final_reward"))


def max_episode_tokens(task: Any, max_action_tokens: int) -> int:
  """Upper bound on an episode's tokens after the prompt (actions, observations, EOS)."""
  return task.max_turns * (max_action_tokens + task.max_observation_len) + 1


def play(engine: RolloutEngine, task: Any, tok: TextTokenizer, problems: Sequence[Any],
         prompts: Sequence[Sequence[int]], sampling: Sequence[SamplingParams], *,
         record: bool = False) -> list[Sample]:
  """Plays one episode per (problem, prompt, sampling) in lock-step turns; see module doc.

  sampling[i].seed, if set, is offset by the turn number so turns draw independent samples.
  meta["reward"] is the environment's final reward.
  """
  newline = encode_ids(tok, "\n")
  eos = int(tok.eos_id)
  n = len(prompts)
  session = None
  if callable(getattr(engine, "open_session", None)):
    session = engine.open_session(n, max(map(len, prompts)) + max_episode_tokens(
        task, max(s.max_new_tokens for s in sampling)))
  chunks = [list(p) for p in prompts]  # what each episode feeds next (session engines)
  states = [task.reset(p) for p in problems]
  tokens: list[list[int]] = [[] for _ in range(n)]
  logps: list[list[float]] = [[] for _ in range(n)]
  masks: list[list[int]] = [[] for _ in range(n)]
  turn_batches: dict[str, None] = {}  # guidance batches the turn calls recorded
  turn = 0
  while live := [i for i in range(n) if not states[i].done]:
    calls = [SamplingParams(
        max_new_tokens=sampling[i].max_new_tokens, temperature=sampling[i].temperature,
        top_p=sampling[i].top_p, top_k=sampling[i].top_k, stop_token_ids=(*newline, eos),
        seed=None if sampling[i].seed is None else sampling[i].seed + turn) for i in live]
    if session is not None:
      out = engine.extend(session, live, [chunks[i] for i in live], calls)
    else:
      out = engine.generate([list(prompts[i]) + tokens[i] for i in live], calls)
    for i, s in zip(live, out):
      if s.guidance is not None:
        turn_batches[s.guidance.batch_id] = None
      action = tok.decode([t for t in s.tokens if t != eos]).split("\n", 1)[0]
      states[i], obs = task.step(states[i], action)
      obs_ids = encode_ids(tok, obs)
      tokens[i] += list(s.tokens) + obs_ids
      logps[i] += list(s.logprobs) + [0.0] * len(obs_ids)
      masks[i] += [1] * len(s.tokens) + [0] * len(obs_ids)
      chunks[i] = obs_ids
    turn += 1
  episodes = [Sample(prompt=list(prompts[i]), tokens=tokens[i] + [eos],
                     logprobs=logps[i] + [0.0], finish_reason="stop",
                     meta={"loss_mask": masks[i] + [0], "reward": task.final_reward(states[i]),
                           "turn_guidance_batches": list(turn_batches)}) for i in range(n)]
  if session is not None:
    # The last observations complete the transcripts the trainer will run (prompt +
    # tokens[:-1]); recording them closes each episode's record.
    for e, handle in zip(episodes, engine.close_session(session, chunks)):
      e.guidance = handle
  elif record:
    greedy = SamplingParams(max_new_tokens=1, temperature=0.0)
    full = [e.prompt + e.tokens[:-1] for e in episodes]
    for e, s in zip(episodes, engine.generate(full, [greedy] * n)):
      e.guidance = s.guidance
  return episodes
