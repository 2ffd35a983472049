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
    return re.findall(r"%(\S+) = (?:\(.*?\)|\S+) fusion\(", f.read())  # tuple shapes too


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
  times = hlo_sources.kernel_times(summary + summary.replace("14.882", "3.500"))
  assert times["input_or_reduce_fusion"] == [14.882, 3.5]
  assert times["wrapped_convert_10"] == [1.615] * 4  # listed twice in each profile
  text = hlo_sources.format_found({"input_or_reduce_fusion": []}, times=times)
  assert text.splitlines()[0] == "input_or_reduce_fusion: 14.882, 3.500 ms/step"


def test_a_directory_without_dumps_fails_loudly(tmp_path):
  with pytest.raises(FileNotFoundError, match="no .*after_optimizations"):
    hlo_sources.find(str(tmp_path), ["x"])


_TUPLE_MODULE = """HloModule jit_f

FileNames
1 "{repo}/trace_jax/quant/formats.py"

FunctionNames
1 "_amax"

FileLocations
1 {file_name_id=1 function_name_id=1 line=93 end_line=93 column=6 end_column=67}

StackFrames
1 {file_location_id=1 parent_frame_id=1}

%fc (param_0: f32[8,2]) -> (f32[8], u8[8,2]) {
  %param_0 = f32[8,2]{1,0} parameter(0)
  %abs = f32[8,2]{1,0} abs(%param_0), metadata={op_name="jit(f)/abs" stack_frame_id=1}
  %or = u8[8,2]{1,0} or(%abs, %abs), metadata={op_name="jit(f)/or" stack_frame_id=1}
  %reduce = f32[8]{0} reduce(%abs), metadata={op_name="jit(f)/reduce_max" stack_frame_id=1}
  ROOT %tuple = (f32[8]{0}, u8[8,2]{1,0}) tuple(%reduce, %or)
}

%fc.1 (param_0: f32[8,2]) -> f32[8,2] {
  %param_0 = f32[8,2]{1,0} parameter(0)
  ROOT %neg = f32[8,2]{1,0} negate(%param_0), metadata={op_name="jit(f)/neg" stack_frame_id=1}
}

ENTRY %main (x: f32[8,2]) -> (f32[8], u8[8,2]) {
  %x = f32[8,2]{1,0} parameter(0)
  %loop_negate_fusion.8 = f32[8,2]{1,0} fusion(%x), kind=kLoop, calls=%fc.1
  %wrapped_shift-left = f32[8,2]{1,0} fusion(%x), kind=kLoop, calls=%fc.1
  ROOT %input_or_reduce_fusion = (f32[8]{0}, /*index=1*/u8[8,2]{1,0}) fusion(%x), kind=kInput,\
 calls=%fc
}
"""


def test_a_multi_output_fusion_is_found(tmp_path):
  """A fusion of several outputs (its shape a tuple, as XLA prints it with index comments) is
  found with its operations and lines, as a single-output one is."""
  path = tmp_path / "module_0001.jit_f.sm_90_gpu_after_optimizations.txt"
  path.write_text(_TUPLE_MODULE.replace("{repo}", REPO))
  (fusion,) = hlo_sources.find(str(tmp_path), ["input_or_reduce_fusion"])["input_or_reduce_fusion"]
  assert fusion.kind == "kInput" and fusion.shape.startswith("(f32[8]{0}, ")
  assert set(fusion.ops) == {"abs", "or", "reduce_max"}, fusion.ops
  assert list(fusion.sources) == ["trace_jax/quant/formats.py:93 (_amax)"], fusion.sources


def test_a_kernel_name_finds_its_numbered_fusion(tmp_path):
  """A profile names the kernel of HLO's `%loop_negate_fusion.8` `loop_negate_fusion_8` (and of
  `%wrapped_shift-left` `wrapped_shift_left`): either name finds it, with the operations of its
  own computation (`%fc.1`, not `%fc`)."""
  path = tmp_path / "module_0001.jit_f.sm_90_gpu_after_optimizations.txt"
  path.write_text(_TUPLE_MODULE.replace("{repo}", REPO))
  found = hlo_sources.find(str(tmp_path), ["loop_negate_fusion_8", "loop_negate_fusion.8",
                                           "loop_negate_fusion"])
  assert found["loop_negate_fusion"] == []
  (shift,) = hlo_sources.find(str(tmp_path), ["wrapped_shift_left"])["wrapped_shift_left"]
  assert set(shift.ops) == {"neg"}, shift
  for name in ("loop_negate_fusion_8", "loop_negate_fusion.8"):
    (fusion,) = found[name]
    assert fusion.kind == "kLoop" and set(fusion.ops) == {"neg"}, fusion
