"""measure_mismatch on the tiny config: guided rounding removes the FP4 flips RTN shows."""

import json

import numpy as np
import pytest
from absl.testing import flagsaver

from experiments import measure_mismatch


@pytest.fixture(scope="module")
def report(tmp_path_factory):
  out = tmp_path_factory.mktemp("mismatch") / "m.json"
  with flagsaver.flagsaver(json_out=str(out), num_prompts=4, prompt_len=10, max_new_tokens=8):
    measure_mismatch.main([])
  return json.loads(out.read_text()), out


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
  assert path.with_suffix(".png").stat().st_size > 10_000
  # Bytes: compact record of the guided layers, per token, from the formula.
  c = r["config"]
  per_token = sum(r["guidance_bytes_per_row_formula"][f"compact_K{k}"] * n for k, n in (
      (c["hidden_size"], 1), (c["moe_intermediate_size"], c["num_experts_per_tok"]),
      (c["head_dim"], 2 * c["num_key_value_heads"])))
  assert np.isclose(r["guidance_bytes_per_token"], per_token * len(r["guided_layers"]))
