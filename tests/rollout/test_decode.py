"""The decode loop (`trace_jax.rollout.decode`): several steps per check of its condition
(`ModelConfig.decode_steps_per_sync`) change how often the host waits, nothing else."""

import jax
import numpy as np
import pytest

from trace_jax import model as model_lib
from trace_jax.rollout import decode
from trace_jax.rollout.engine import InProcessEngine
from trace_jax.rollout.protocol import SamplingParams

# Every layer guided: the layers are one run (one scan body), so the programs compile half the
# layer code of a guided and an unguided run; the decode loop is the same for any layers.
CFG = model_lib.tiny(vocab_size=64, num_hidden_layers=2, policy="fp4_trace", dtype="float32",
                     guided_layers=(0, 1))
PER_SYNC = 4  # steps 1..15 of max_new 16 in blocks of 4: the last runs one step past the end


def _pair(config):
  """Engines with one and with PER_SYNC decode steps per check, recording everything."""
  params = model_lib.init_params(config, 0, param_dtype="float32")
  return [InProcessEngine(params, config.replace(decode_steps_per_sync=k), audit_fraction=1.0,
                          record_routing=True, max_batch=4) for k in (1, PER_SYNC)]


@pytest.fixture(scope="module")
def engines():
  return _pair(CFG)


def _requests(stop: int | None):
  """Sampled rows with their own lengths; row 0 stops early at `stop` if given."""
  return [SamplingParams(max_new_tokens=n, temperature=1.0, seed=i,
                         stop_token_ids=(stop,) if (stop is not None and i == 0) else ())
          for i, n in enumerate((16, 7, 16, 4))]


def _records(eng):
  rec = eng.last_guidance
  return jax.tree.map(np.asarray, (rec["token_counts"], rec["audit"]["guidance"],
                                   rec["routing"]))


def test_blocks_of_steps_give_the_same_completions_and_records(engines):
  """Tokens, log-probs and the guidance / routing records of every fed token are those of one
  step per check, for rows ending at their own lengths, at a stop token mid-block and at
  max_new (the engine's bucket, 16: the last block runs a step past the buffers)."""
  one, blocks = engines
  rng = np.random.default_rng(0)
  prompts = [rng.integers(3, 64, n).tolist() for n in (5, 9, 3, 7)]
  free = one.generate(prompts, _requests(None))
  stop = free[0].tokens[4]  # row 0 now ends at its first occurrence of this token
  for sp in (_requests(None), _requests(stop)):
    ref = one.generate(prompts, sp)
    ref_rec = _records(one)
    got = blocks.generate(prompts, sp)
    got_rec = _records(blocks)
    for r, g in zip(ref, got):
      assert g.tokens == r.tokens
      np.testing.assert_allclose(g.logprobs, r.logprobs, rtol=0, atol=1e-6)
    assert [len(r.tokens) for r in ref][1:] == [7, 16, 4]
    jax.tree.map(np.testing.assert_array_equal, got_rec, ref_rec)
  assert len(ref[0].tokens) <= 5 and ref[0].tokens[-1] == stop


def test_blocks_of_steps_in_a_session():
  """Two session turns and a close: the same tokens, the same records of the transcripts
  (routing under bf16: the session's cache and records, for a quarter of fp4_trace's compile
  time on CPU)."""
  outs = []
  for eng in _pair(CFG.replace(policy="bf16")):
    session = eng.open_session(2, 48)
    rng = np.random.default_rng(1)
    tokens = []
    for turn in range(2):
      chunk = [rng.integers(3, 64, 4).tolist() for _ in range(2)]
      sp = [SamplingParams(max_new_tokens=5 + turn, temperature=1.0, seed=7 * turn + i)
            for i in range(2)]
      tokens.append([r.tokens for r in eng.extend(session, [0, 1], chunk, sp)])
    eng.close_session(session, [[5, 6], [7]])
    outs.append((tokens, _records(eng)))
  (ref_tokens, ref_rec), (got_tokens, got_rec) = outs
  assert got_tokens == ref_tokens
  jax.tree.map(np.testing.assert_array_equal, got_rec, ref_rec)


def test_the_loop_condition_is_checked_once_per_block():
  """The decode while loop's body is a loop of PER_SYNC steps of known trip count (which XLA
  runs without asking the host); with one step per check there is no such loop."""
  params = model_lib.init_params(CFG, 0, param_dtype="float32")

  def trip_counts(k: int) -> list[int]:
    c = CFG.replace(policy="bf16", decode_steps_per_sync=k)
    b = 2
    args = (params, c, np.ones((b, 4), np.int32), np.full(b, 4), np.full(b, 6),
            np.ones(b, np.float32), np.ones(b, np.float32), np.full(b, -1),
            jax.random.split(jax.random.key(0), b), np.full((b, 1), -1))
    jaxpr = jax.make_jaxpr(lambda *a: decode.generate(*a, max_new=6, truncate=False,
                                                      tap_layers=(), tap_mode="compact",
                                                      tap_routing=False),
                           static_argnums=1)(*args)
    whiles = [e for e in jaxpr.jaxpr.eqns[0].params["jaxpr"].jaxpr.eqns
              if e.primitive.name == "while"]
    assert len(whiles) == 1, [e.primitive.name for e in jaxpr.jaxpr.eqns]
    body = whiles[0].params["body_jaxpr"].jaxpr
    return [e.params["length"] for e in body.eqns if e.primitive.name == "scan"]

  assert PER_SYNC not in trip_counts(1)
  assert trip_counts(PER_SYNC) == [PER_SYNC]
