"""Engine sessions: multi-turn episodes whose KV cache and records stay on the device."""

import dataclasses

import numpy as np
import pytest

from trace_jax import model as model_lib
from trace_jax.rl.tasks import get_task
from trace_jax.rl.tokenizer import CharTokenizer
from trace_jax.rollout.engine import InProcessEngine
from trace_jax.rollout.protocol import SamplingParams
from trace_jax.train import episodes, mismatch, scoring, task_io

CFG = model_lib.tiny(vocab_size=100)


@pytest.fixture(scope="module")
def params():
  return model_lib.init_params(CFG, 0, param_dtype="float32")


def test_one_turn_session_equals_generate(params):
  """A session's first turn is a generate call: same greedy tokens, log-probs to float32
  rounding (the prompt goes through decode-mode attention over the session's cache)."""
  eng = InProcessEngine(params, CFG, max_batch=4)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(3, 100, n).tolist() for n in (5, 9, 12)]
  sp = [SamplingParams(max_new_tokens=8, temperature=0.0)] * 3
  ref = eng.generate(prompts, sp)
  session = eng.open_session(3, 40)
  got = eng.extend(session, [0, 1, 2], prompts, sp)
  for r, g in zip(ref, got):
    assert g.tokens == r.tokens
    np.testing.assert_allclose(g.logprobs, r.logprobs, atol=2e-5)
  # Each row fed its prompt and all but its last token; that token waits for the next chunk.
  assert session.lens[:3].tolist() == [len(p) + len(r.tokens) - 1 for p, r in zip(prompts, ref)]
  assert session.pending[:3] == [r.tokens[-1] for r in ref]


def test_session_rejects_overflow_and_foreign_rows(params):
  eng = InProcessEngine(params, CFG, max_batch=4)
  session = eng.open_session(2, 20)
  with pytest.raises(ValueError, match="exceed the session length"):
    eng.extend(session, [0], [[5] * 30], [SamplingParams(max_new_tokens=8)])
  with pytest.raises(ValueError, match="row 3 is not in this session"):
    eng.extend(session, [3], [[5]], [SamplingParams(max_new_tokens=2)])


def test_multi_turn_records_are_the_transcripts_rows(params):
  """Episodes played in a session record one row per token the trainer runs (prompt +
  tokens[:-1]), in order: the trainer's float32 forward routes like the record at almost every
  row and, guided by it, reproduces its moe_in codes; shifted by one row they disagree."""
  cfg = dataclasses.replace(CFG, policy="fp4_trace", dtype="float32")
  eng = InProcessEngine(params, cfg, audit_fraction=1.0, max_batch=4)
  task = get_task("long_horizon", max_number=7)
  tok = CharTokenizer()
  io = task_io.TaskIO.of(task, tok)
  problems, _ = io.prompts(3, 3)
  # Short prompts (the random model cannot read the task's): the first chunk then pads to the
  # same 16-token bucket as every later turn's, so all turns run one compiled extend program.
  prompts = [io.bos_ids + tok.encode(f"pick {i}\n") for i in range(3)]
  sp = [SamplingParams(max_new_tokens=10, temperature=1.0, seed=i) for i in range(3)]
  eps = episodes.play(eng, task, tok, problems, prompts, sp, record=True)
  rec = eng.last_guidance
  seqs = [e.prompt + e.tokens for e in eps]
  assert rec["token_counts"] == [len(s) - 1 for s in seqs]
  assert [e.guidance.seq_id for e in eps] == rec["seq_ids"]
  assert any(len(e.tokens) > 12 for e in eps)  # at least one episode took several turns
  out = scoring.score(params, cfg, seqs, guidance=rec["guidance"],
                      routing={1: rec["routing"][1]}, tap_layers=(0, 1), tap_mode="full")
  train_routing = {layer: t.pop("routing") for layer, t in out["taps"].items()}
  report = mismatch.compare(out["taps"], rec["audit"]["guidance"], train_routing,
                            rec["routing"], guided_layers=(1,))
  assert report.routing_total().flip_rate < 0.05, report.metrics()
  assert report.flips[(1, "moe_in")].rate < 0.01, report.metrics()
  shifted = mismatch.routing_counts(train_routing[0][1:], rec["routing"][0][:-1])
  assert shifted.flip_rate > 0.3
