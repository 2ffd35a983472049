"""experiments/bench/fp8_layouts.py on CPU (interpret mode): every path timed, the kernels'
outputs checked against XLA's bits (a kernel that moves a byte wrongly stops the run)."""

import json

import jax.numpy as jnp
import pytest

from experiments.bench import fp8_layouts
from trace_jax.kernels import fp8_tiles


def test_times_xla_and_the_kernels_side_by_side(tmp_path):
  out = tmp_path / "fp8_layouts.json"
  fp8_layouts.main(["fp8_layouts", "--preset=cpu", "--nosweep", "--reps=1",
                    f"--json_out={out}"])
  res = json.loads(out.read_text())
  assert set(res["shapes"]) == set(fp8_layouts.PRESETS["cpu"])
  for shape in res["shapes"].values():
    assert set(shape["paths"]) == {"xla", shape["best_kernel"]}
    assert all(p["ms"] > 0 and p["frac_copy"] > 0 for p in shape["paths"].values())
    assert shape["kernel_over_xla"] > 0


def test_a_kernel_that_misplaces_bytes_is_caught(tmp_path, monkeypatch):
  real = fp8_tiles.transpose_codes
  monkeypatch.setattr(fp8_tiles, "transpose_codes",
                      lambda v, **cfg: jnp.flip(real(v, **cfg), axis=-1))
  with pytest.raises(AssertionError, match="differs from XLA's bits"):
    fp8_layouts.main(["fp8_layouts", "--preset=cpu", "--nosweep", "--reps=1"])
