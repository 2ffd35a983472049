"""experiments/quant_report.py: runs end to end on a tiny model; flips and bytes are right."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import quant_report
from trace_jax import quant
from trace_jax.quant import formats

K = 128
BATCH = 64
LAYERS = 2


def _run(tmp_path):
  argv = ["quant_report", f"--batch={BATCH}", f"--width={K}", "--hidden=256",
          f"--layers={LAYERS}", "--noprogress", f"--json_out={tmp_path / 'report.json'}",
          f"--plot_out={tmp_path / 'flip_rates.png'}"]
  returned = quant_report.main(argv)
  with open(tmp_path / "report.json") as f:
    return returned, json.load(f)


def _check_keys(returned, written, tmp_path):
  assert (tmp_path / "flip_rates.png").stat().st_size > 1000
  for key in ("config", "backend", "device", "layers", "elements_per_site", "methods",
              "flip_rate", "flip_rate_mean", "scale_flip_rate", "beyond_one_code_rate",
              "site_rel_drift", "output_rel_diff", "bytes_per_element", "bytes_per_row",
              "record_nbytes_per_site", "guided_layers", "bytes_per_token", "elapsed_s"):
    assert key in written, key
  assert written["methods"] == ["nvfp4_rtn", "nvfp4_guided_compact", "nvfp4_guided_full",
                                "mxfp4_rtn", "fp8_rtn"]
  assert written["elements_per_site"] == BATCH * K
  for m in written["methods"]:
    assert len(written["flip_rate"][m]) == LAYERS
  assert set(written["beyond_one_code_rate"]) == {"nvfp4_guided_compact", "nvfp4_guided_full"}
  assert set(written["scale_flip_rate"]) == {"nvfp4_rtn", "mxfp4_rtn", "fp8_rtn"}
  assert written["flip_rate"] == returned["flip_rate"]


def _check_flips(r):
  for m in ("nvfp4_guided_compact", "nvfp4_guided_full"):
    for flip, beyond in zip(r["flip_rate"][m], r["beyond_one_code_rate"][m], strict=True):
      # Guided rounding picks between the two neighbours of the training value: it reproduces
      # the rollout code exactly when that code is one of them, and cannot when it is not.
      assert flip == beyond
      if beyond == 0:
        assert flip == 0
  assert all(b == 0 for b in r["beyond_one_code_rate"]["nvfp4_guided_compact"])
  for m in ("nvfp4_rtn", "fp8_rtn"):
    assert all(f > 0 for f in r["flip_rate"][m]), (m, r["flip_rate"][m])
  assert r["flip_rate_mean"]["mxfp4_rtn"] > 0


def _check_bytes(r):
  bpe = r["bytes_per_element"]
  assert bpe["compact"] == (K // 8 + K // 16 + 4) / K
  assert bpe["full"] == (K // 2 + K // 16 + 4) / K
  assert bpe["full_cache_4p5bit"] == 0.5625
  assert r["bytes_per_row"] == {"compact": K // 8 + K // 16 + 4, "full": K // 2 + K // 16 + 4}
  assert r["record_nbytes_per_site"] == {"compact": (K // 8 + K // 16 + 4) * BATCH,
                                         "full": (K // 2 + K // 16 + 4) * BATCH}
  guided = LAYERS // 2
  assert r["guided_layers"] == guided
  assert r["bytes_per_token"]["compact_guided_layers"] == (K // 8 + K // 16 + 4) * guided
  assert r["bytes_per_token"]["full_cache_all_layers"] == 0.5625 * K * LAYERS


def test_report_end_to_end(tmp_path):
  """One run (compiling the passes dominates), checked three ways: the JSON and plot, flip
  rates (guided 0 where drift is within one code, RTN > 0), and exact guidance bytes."""
  returned, written = _run(tmp_path)
  _check_keys(returned, written, tmp_path)
  _check_flips(written)
  _check_bytes(written)


@pytest.mark.parametrize("mode", ["compact", "full"])
def test_guided_reach_predicts_guided_flips(mode):
  """The report's 'beyond one code' measure equals guided rounding's misses, also under drift
  large enough that many rollout codes are out of reach."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal((32, K)).astype(np.float32)
  xt = (x * (1 + 0.3 * rng.standard_normal(x.shape))).astype(np.float32)
  _, g = jax.jit(quant.quantize_act_record, static_argnums=1)(jnp.asarray(x), mode)
  rollout = np.asarray(jax.jit(lambda v: quant.nvfp4_quantize(v, quant.nvfp4_row_scale(v)))(
      jnp.asarray(x)).codes)
  guided = np.asarray(jax.jit(quant.guided_codes)(jnp.asarray(xt), g))
  reach = quant_report._guided_reach(xt, rollout, np.asarray(g.block_scale).astype(np.float32),
                                     np.asarray(g.row_scale))
  assert 0 < np.mean(~reach) < 0.5
  # A flip is a change of value: codes keep the sign of zero, and 0 vs 8 (+0 vs -0) is none.
  np.testing.assert_array_equal(~formats.e2m1_values_equal(guided, rollout), ~reach)


def test_flip_rate_compares_fp4_values_not_codes():
  """+0 (code 0) and -0 (code 8) are the same E2M1 value: no flip; every other code change is
  one. FP8 bytes compare as they are (FP8 values never hold -0)."""
  train = np.array([[0, 8, 8, 0, 1, 9, 7, 15]], np.uint8)
  rollout = np.array([[8, 0, 8, 0, 9, 1, 6, 15]], np.uint8)
  for fmt in ("nvfp4", "mxfp4"):
    assert quant_report.code_flip_rate(train, rollout, fmt) == 3 / 8
  assert quant_report.code_flip_rate(train, rollout, "fp8") == 5 / 8


def test_help_returns_without_running(capsys):
  assert quant_report.main(["quant_report", "--help"]) is None
  assert "--noise" in capsys.readouterr().out
