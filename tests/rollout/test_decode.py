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


def test_ragged_records_are_the_rows_by_position():
  """`decode.ragged_records` lays out a batch's prefill rows and decode step rows as the
  engine's ragged rows: sequence i's prompt rows [:prompt_lens[i]], then its step rows
  1..counts[i] - prompt_lens[i], bit for bit for every dtype a record holds (NaN payloads and
  -0.0 included), the sequences one after another (numpy reference)."""
  rng = np.random.default_rng(0)
  b, p, max_new, spare = 4, 6, 8, 3
  total = p + max_new
  f32 = rng.integers(0, 2**32, (b, p, 3), dtype=np.uint32)
  f32[0, 0, :2] = [0x7FC01234, 0x80000000]  # a NaN with a payload, -0.0
  prompt = {"a": f32.view(np.float32), "b": rng.integers(0, 2, (b, p, 2)).astype(bool),
            "c": rng.integers(0, 256, (b, p, 5), dtype=np.uint8),
            "d": rng.integers(-2**31, 2**31, (b, p, 1, 2), dtype=np.int32)}
  width = 3 * 4 + 2 + 5 + 2 * 4
  steps = rng.integers(0, 256, (b, max_new + spare, width), dtype=np.uint8)
  steps[..., 12:14] &= 1  # the bool columns hold 0 or 1
  lens = np.array([6, 2, 4, 1], np.int32)
  counts = np.array([6 + 7, 2 + 3, 0, 1 + 7], np.int32)  # the third row is padding
  got = decode.ragged_records(prompt, steps, lens, counts, total=total)
  stepped = {"a": steps[..., :12].copy().view(np.float32), "b": steps[..., 12:14] != 0,
             "c": steps[..., 14:19], "d": steps[..., 19:].copy().view(np.int32).reshape(
                 b, max_new + spare, 1, 2)}
  for k in prompt:
    want = np.concatenate([np.concatenate([prompt[k][i, :lens[i]],
                                           stepped[k][i, 1:counts[i] - lens[i] + 1]])
                           for i in range(b) if counts[i]])
    g = np.asarray(got[k])
    assert g.shape == (b * total,) + prompt[k].shape[2:] and g.dtype == prompt[k].dtype
    np.testing.assert_array_equal(g[:counts.sum()].view(np.uint8), want.view(np.uint8))


def test_generate_holds_one_copy_of_the_records():
  """Over the generation program's buffers (its outputs and temporaries, as XLA assigns
  them), recording adds one copy of each sequence's records: the prefill's rows and the decode
  loop's step rows, not buffers of the whole sequence beside the step rows (which held ~2x)."""
  config = model_lib.tiny(vocab_size=64, policy="bf16", decode_steps_per_sync=PER_SYNC,
                          max_position_embeddings=1024)
  params = model_lib.init_params(config, 0, param_dtype="float32")
  prompts = [[3, 4, 5], [6, 7]]
  sp = SamplingParams(max_new_tokens=500, temperature=0.0)
  held = []
  for routing in (False, True):
    eng = InProcessEngine(params, config, record_routing=routing, max_batch=2)
    m = eng.lower_generate(prompts, sp).compile().memory_analysis()
    held.append(m.temp_size_in_bytes + m.output_size_in_bytes)
  b, p, max_new = 2, 16, 512  # the engine's buckets
  row = config.num_hidden_layers * config.num_experts_per_tok * 4  # int32 expert ids
  one_copy = b * (p + decode.step_rows(config, max_new)) * row
  assert one_copy <= held[1] - held[0] <= 1.05 * one_copy, (held, one_copy)
