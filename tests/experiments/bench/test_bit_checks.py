"""experiments/bench/bit_checks.py: gpu_check's direct checks pass on this backend (small
parity data), and each can show the failure it is named for (planted bugs fail them)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from experiments.bench import bit_checks
from experiments.bench.bit_checks import Checks


def test_every_check_passes_on_this_backend():
  torch = pytest.importorskip("torch")
  del torch
  checks = Checks()
  bit_checks.check_exhaustive(checks)
  bit_checks.check_platform_trap(checks)
  bit_checks.check_sign_of_zero(checks, "cpu")
  bit_checks.check_parity(checks, n_log2=15, device="cpu", seed=0, k=256)
  bit_checks.check_grad(checks)
  assert not checks.failed, checks.failed
  names = [r["name"] for r in checks.results]
  # every group ran: 3 + 4 exhaustive, 2 trap, 13 sign of zero, 2 x 30 parity, 6 gradients
  assert len(names) == 88, len(names)
  assert sum(n.startswith("parity_bfloat16") for n in names) == 30
  assert all(r["mismatches"] == 0 and r["total"] > 0 for r in checks.results if "total" in r)


@pytest.mark.parametrize("got, want, only_zero_sign", [
    pytest.param([1, 3, 5], [1, 4, 5], 0, id="rounding"),
    pytest.param([1, 8, 5], [1, 0, 5], 1, id="sign_of_zero"),
])
def test_mismatch_counts_and_names_a_difference(got, want, only_zero_sign):
  checks = Checks()
  assert checks.mismatch("codes", np.uint8(got), np.uint8(want), codes=True) is False
  (r,) = checks.results
  assert (r["status"], r["mismatches"], r["total"]) == ("FAIL", 1, 3)
  assert f"{only_zero_sign} of them only in the sign of zero" in r["detail"]
  assert "first at flat [1]" in r["detail"]


def test_a_tie_rounding_bug_fails_the_exhaustive_check(monkeypatch):
  """E2M1 ties rounded away from zero instead of to even: the check names the encoder."""
  from trace_jax.quant import formats

  encode = formats.e2m1_encode
  monkeypatch.setattr(formats, "e2m1_encode",
                      lambda x: encode(jnp.where(x == 2.5, jnp.asarray(2.6, x.dtype), x)))
  checks = Checks()
  bit_checks.check_exhaustive(checks)
  assert checks.failed == ["e2m1_encode_all_finite_bf16", "e2m1_encode_all_finite_bf16_as_f32"]
  assert all(r["mismatches"] == 1 for r in checks.results if r["status"] == "FAIL")


def test_a_lost_negative_zero_fails_the_sign_of_zero_check(monkeypatch):
  from trace_jax import quant

  quantize = quant.mxfp4_quantize

  def no_negative_zero(x):
    q = quantize(x)
    return q.replace(codes=jnp.where(q.codes == 8, jnp.uint8(0), q.codes))

  monkeypatch.setattr(quant, "mxfp4_quantize", no_negative_zero)
  checks = Checks()
  bit_checks.check_sign_of_zero(checks, torch_device=None)
  assert set(checks.failed) == {"sign_of_zero_mxfp4", "sign_of_zero_mxfp4_vs_ml_dtypes"}


def test_parity_data_holds_the_adversarial_blocks():
  x = bit_checks.parity_data(n_log2=15, k=256, seed=0)
  assert x.shape == (128, 256) and x.dtype == np.float32
  blocks = x.reshape(-1, 16)
  assert np.any(np.all(blocks == 0, axis=1))  # all-zero blocks
  assert np.any((x != 0) & (np.abs(x) < 2.0**-126))  # float32 subnormals
  amax = np.abs(blocks).max(axis=1)
  assert np.abs(x[x != 0]).min() < 2.0**-20 and amax.max() > 2.0**19  # the magnitude span
