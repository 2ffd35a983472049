"""Multi-turn rollouts through a scripted engine: token layout, loss mask, log-probs, guidance."""

import numpy as np
import pytest

from configs import quickstart
from trace_jax.guidance.handle import GuidanceHandle
from trace_jax.rl.tasks import get_task
from trace_jax.rl.tasks.base import Problem
from trace_jax.rl.tasks.long_horizon import demonstration_episode
from trace_jax.rl.tokenizer import BOS_ID, EOS_ID, CharTokenizer
from trace_jax.rollout.protocol import Sample, SamplingParams
from trace_jax.train import batch as batch_lib
from trace_jax.train import episodes, run_config, task_io

TOK = CharTokenizer()
TASK = get_task("long_horizon", max_number=7)  # 3 + 1 turns


class ScriptedEngine:
  """Answers call k with actions[k] for every prompt; records what it was asked."""

  def __init__(self, actions: list[str]):
    self.actions = actions
    self.calls: list[tuple[list[list[int]], list[SamplingParams]]] = []

  def generate(self, prompts, sampling):
    k = len(self.calls)
    self.calls.append(([list(p) for p in prompts], list(sampling)))
    ids = TOK.encode(self.actions[k]) if k < len(self.actions) else [EOS_ID]
    return [Sample(prompt=list(p), tokens=list(ids), logprobs=[-0.5 - k] * len(ids),
                   finish_reason="stop",
                   guidance=GuidanceHandle(batch_id=f"b{k:06d}", seq_id=f"{i}"))
            for i, p in enumerate(prompts)]


def _problem(target: int) -> Problem:
  return Problem(prompt="pick\n", answer=str(target),
                 meta={"target": target, "max_turns": TASK.max_turns})


def test_episode_layout_mask_and_logprobs():
  engine = ScriptedEngine(["guess 1\n", "guess 4\n"])
  prompt = [BOS_ID] + TOK.encode("pick\n")
  sp = SamplingParams(max_new_tokens=9, temperature=1.0, seed=100)
  (ep,) = episodes.play(engine, TASK, TOK, [_problem(4)], [prompt], [sp])
  a1, o1, a2, o2 = (TOK.encode(t) for t in ("guess 1\n", "higher\n", "guess 4\n", "correct\n"))
  assert ep.tokens == a1 + o1 + a2 + o2 + [EOS_ID]
  assert ep.meta["loss_mask"] == [1] * 8 + [0] * 7 + [1] * 8 + [0] * 8 + [0]
  assert ep.logprobs == [-0.5] * 8 + [0.0] * 7 + [-1.5] * 8 + [0.0] * 8 + [0.0]
  assert ep.meta["reward"] == 1.0 and ep.guidance is None
  # Turn 2's prompt is the whole transcript; seeds differ per turn; stop at newline or EOS.
  assert engine.calls[1][0] == [prompt + a1 + o1]
  assert [c[1][0].seed for c in engine.calls] == [100, 101]
  assert engine.calls[0][1][0].stop_token_ids == (TOK.encode("\n")[0], EOS_ID)


def test_finished_episodes_leave_the_batch_and_failures_score_zero():
  engine = ScriptedEngine(["guess 4\n", "nonsense\n", "guess 9\n", "guess 2\n"])
  prompt = [BOS_ID] + TOK.encode("pick\n")
  sp = [SamplingParams(max_new_tokens=9)] * 2
  won, lost = episodes.play(engine, TASK, TOK, [_problem(4), _problem(5)], [prompt] * 2, sp)
  assert [len(c[0]) for c in engine.calls] == [2, 1, 1, 1]  # the winner stops after turn 1
  assert won.meta["reward"] == 1.0 and lost.meta["reward"] == 0.0
  assert TOK.decode(lost.tokens[:-1]).endswith("guess 2\nhigher\ngame over\n")
  assert sum(lost.meta["loss_mask"]) == len(TOK.encode("guess 4\nnonsense\nguess 9\nguess 2\n"))


def test_record_prefills_the_finished_episode_once():
  engine = ScriptedEngine(["guess 1\n", "guess 4\n"])
  prompt = [BOS_ID] + TOK.encode("pick\n")
  (ep,) = episodes.play(engine, TASK, TOK, [_problem(4)], [prompt], [SamplingParams()],
                        record=True)
  prompts, sampling = engine.calls[-1]
  assert len(engine.calls) == 3 and sampling[0].max_new_tokens == 1
  # The recording call's rows (prompt + 1 new token - 1) are the trainer's rows.
  assert prompts == [ep.prompt + ep.tokens[:-1]]
  assert ep.guidance == GuidanceHandle(batch_id="b000002", seq_id="0")
  assert ep.meta["turn_guidance_batches"] == ["b000000", "b000001"]


def test_train_batch_masks_observations_and_places_logprobs():
  engine = ScriptedEngine(["guess 1\n", "guess 4\n"])
  prompt = [BOS_ID] + TOK.encode("pick\n")
  (ep,) = episodes.play(engine, TASK, TOK, [_problem(4)], [prompt], [SamplingParams()])
  b = batch_lib.rl_batch([ep], np.ones(1), 48)
  p = len(prompt)
  rows = slice(p - 1, p - 1 + len(ep.tokens))  # row t predicts token t + 1
  np.testing.assert_array_equal(np.asarray(b.loss_mask)[0, rows], ep.meta["loss_mask"])
  np.testing.assert_array_equal(np.asarray(b.logp_rollout)[0, rows], ep.logprobs)
  assert np.asarray(b.loss_mask)[0].sum() == 16 and np.asarray(b.valid)[0].sum() == \
      p + len(ep.tokens) - 1
  with pytest.raises(ValueError, match="completion mask has 2 entries for 3"):
    batch_lib.sequence_batch([[1, 5]], [[6, 7, 2]], 8, [[1, 0]])


def test_sft_demonstrations_mask_the_environment():
  cfg = quickstart.get_config()
  cfg.task.name, cfg.task.kwargs = "long_horizon", {"max_number": 7}
  io = task_io.make_task_io(run_config.resolve(cfg))
  problems, prompts = io.prompts(0, 3)
  demos, masks = io.demonstrations(problems, prompts)
  for pr, d, m, p in zip(prompts, demos, masks, problems):
    ep = demonstration_episode(TASK, p, TOK)
    assert pr + d == ep.ids.tolist() and m == ep.loss_mask[len(pr):].tolist()
    actions = "".join(TOK.decode([t]) for t, k in zip(d, m) if k)
    assert actions == "".join(TASK.binary_search_actions(p))
