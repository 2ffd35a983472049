"""measure_mismatch on the tiny config: guided rounding removes the FP4 flips RTN shows."""

import jax
import numpy as np
import pytest

from experiments import measure_mismatch
from trace_jax import model as model_lib
from trace_jax.rollout.protocol import SamplingParams


@pytest.fixture(scope="module")
def report(tmp_path_factory):
  """What `measure_mismatch.main` does with --num_prompts=4 --prompt_len=10 --max_new=8."""
  config = measure_mismatch.tiny_config()
  params = model_lib.init_params(config, jax.random.fold_in(jax.random.key(0), 0))
  prompts = np.random.default_rng(0).integers(0, config.vocab_size, (4, 10)).tolist()
  sampling = [SamplingParams(max_new_tokens=8, seed=i) for i in range(4)]
  r = measure_mismatch.measure(params, config, prompts, sampling)
  path = tmp_path_factory.mktemp("mismatch") / "m.png"
  measure_mismatch.plot(r, str(path))
  return r, path


def test_guided_sites_have_no_flips_and_rtn_has_some(report):
  r, _ = report
  assert r["flip_rate_trace"] == 0.0, r["policies"]["fp4_trace"]["per_layer"]
  assert r["flip_rate_rtn"] > 0.0, r["policies"]["fp4_rtn"]["per_layer"]


def test_trace_mismatch_not_above_rtn(report):
  r, _ = report
  assert r["mean_abs_dlogp"]["fp4_trace"] <= r["mean_abs_dlogp"]["fp4_rtn"]


def test_report_fields_and_plot(report):
  r, path = report
  for key in ("flip_rate_rtn", "flip_rate_trace", "routing_flip_rate", "mean_abs_dlogp",
              "k3_kl", "guidance_bytes_per_token"):
    assert key in r, key
  layers = r["policies"]["fp4_rtn"]["per_layer"]
  assert set(layers) == {"0", "1"}
  assert set(layers["1"]) == {"moe_in", "expert_mid", "k", "v", "routing"}
  assert path.stat().st_size > 10_000
  # Bytes: compact record of the guided layers, per token, from the formula.
  c = r["config"]
  per_token = sum(r["guidance_bytes_per_row_formula"][f"compact_K{k}"] * n for k, n in (
      (c["hidden_size"], 1), (c["moe_intermediate_size"], c["num_experts_per_tok"]),
      (c["head_dim"], 2 * c["num_key_value_heads"])))
  assert np.isclose(r["guidance_bytes_per_token"], per_token * len(r["guided_layers"]))
