"""hlo_sources: a profiled XLA kernel's name -> the JAX operations and our source lines in it."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import pytest

from experiments.bench import hlo_sources

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
_PROGRAM = """
import jax, jax.numpy as jnp
from trace_jax.quant import formats
jax.jit(formats.fp8_quantize_act)(jnp.ones((256, 256), jnp.bfloat16))
"""


@pytest.fixture(scope="module")
def dump(tmp_path_factory) -> str:
  """XLA's optimized HLO of the FP8 activation quantizer, dumped by a process of its own (the
  dump flags are read when the backend starts)."""
  out = str(tmp_path_factory.mktemp("hlo"))
  env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={out} --xla_dump_hlo_as_text",
             PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  subprocess.run([sys.executable, "-c", _PROGRAM], env=env, check=True, cwd=REPO)
  return out


def _fusion_names(out: str) -> list[str]:
  (path,) = [p for p in glob.glob(os.path.join(out, "*after_optimizations.txt"))
             if "fp8_quantize_act" in p]
  with open(path) as f:
    return re.findall(r"%(\S+) = \S+ fusion\(", f.read())


def test_fusions_name_the_quantizer_s_lines(dump):
  """Every fusion of the quantizer's program is found, with formats.py's lines (the amax
  reduction's `_amax`; a callee of `fp8_quantize_act`, e.g. the scale's division, with
  its caller); a name no module has finds nothing."""
  names = _fusion_names(dump)
  assert names
  found = hlo_sources.find(dump, names + ["no_such_fusion"])
  assert found["no_such_fusion"] == []
  assert all(found[n] for n in names), {n: found[n] for n in names}
  sources = [s for n in names for f in found[n] for s in f.sources]
  assert any(s.startswith("trace_jax/quant/formats.py:") and "(_amax)" in s
             for s in sources), sources
  assert any(") < trace_jax/quant/formats.py:" in s and "(fp8_quantize_act)" in s
             for s in sources), sources  # a callee's lines, then its caller's
  ops = {op for n in names for f in found[n] for op in f.ops}
  assert {"reduce_max", "is_finite"} & ops, ops
  text = hlo_sources.format_found(found)
  assert "no_such_fusion: not a fusion of the dumped modules" in text


def test_kernel_names_of_a_profile_summary():
  summary = """profile mgpu cudnn bf16: per step 53.323 ms wall, 526 kernels
  by category (ms/step): fusion/other 25.265, gemm 11.141
     10.899 ms  x  24.0  fusion/other body_mosaic_gpu_kernel
      1.615 ms  x   8.0  fusion/other wrapped_convert_10
     14.882 ms  x   4.0  fusion/other input_or_reduce_fusion
      1.615 ms  x   8.0  fusion/other wrapped_convert_10
  idle gaps by the kernel that ended them (ms/step, gaps/step):
      4.890 ms  x   0.5  loop_and_fusion
"""
  assert hlo_sources.kernel_names(summary) == [
      "body_mosaic_gpu_kernel", "wrapped_convert_10", "input_or_reduce_fusion"]


def test_a_directory_without_dumps_fails_loudly(tmp_path):
  with pytest.raises(FileNotFoundError, match="no .*after_optimizations"):
    hlo_sources.find(str(tmp_path), ["x"])
