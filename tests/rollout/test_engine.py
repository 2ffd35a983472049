"""The in-process engine's prompt-length floor: one program for a run's bounded prompts."""

import numpy as np
import pytest

from trace_jax import model as model_lib
from trace_jax.rollout import decode
from trace_jax.rollout import engine as engine_lib
from trace_jax.rollout.protocol import SamplingParams

CFG = model_lib.tiny()


@pytest.mark.parametrize("n,floor,want", [
    pytest.param(5, 0, 16, id="no_floor_min_bucket"),
    pytest.param(17, 0, 32, id="no_floor_power_of_two"),
    pytest.param(5, 40, 48, id="floor_rounds_up_to_16"),
    pytest.param(48, 40, 48, id="at_floor"),
    pytest.param(49, 40, 64, id="past_floor_power_of_two"),
    pytest.param(97, 112, 112, id="quickstart_longest"),
])
def test_prompt_bucket(n, floor, want):
  assert engine_lib.prompt_bucket(n, floor) == want


def test_negative_floor_is_rejected():
  with pytest.raises(ValueError, match="min_prompt_len"):
    engine_lib.InProcessEngine(None, CFG, min_prompt_len=-1)


def test_floor_compiles_once_and_does_not_change_completions():
  params = model_lib.init_params(CFG, 0)
  sp = SamplingParams(max_new_tokens=6, temperature=0.0)
  rng = np.random.default_rng(0)
  batches = [[rng.integers(1, CFG.vocab_size, size=n).tolist() for n in lens]
             for lens in ((3, 9), (20, 7), (33, 2))]  # plain buckets 16, 32, 64
  floored = engine_lib.InProcessEngine(params, CFG, max_batch=2, min_prompt_len=40)
  plain = engine_lib.InProcessEngine(params, CFG, max_batch=2)
  before = decode.generate._cache_size()
  got = [floored.generate(b, sp) for b in batches]
  assert decode.generate._cache_size() - before == 1  # one [2, 48] program
  for b, out in zip(batches, got):
    for s, ref in zip(out, plain.generate(b, sp)):
      assert s.tokens == ref.tokens
      # Longer padding changes XLA's reduction shapes: log-probs agree closely, not bitwise.
      np.testing.assert_allclose(s.logprobs, ref.logprobs, rtol=0, atol=1e-5)
