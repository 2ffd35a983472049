"""experiments.convert_checkpoint: HF -> orbax -> HF (bit exact) and -> NVFP4; clear errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from experiments.convert_checkpoint import convert
from trace_jax import model as M
from trace_jax.io import hf


def test_hf_orbax_hf_nvfp4(tmp_path):
  config = M.tiny(dtype="bfloat16")
  params = M.init_params(config, 0)
  src = str(tmp_path / "hf")
  hf.save_hf_checkpoint(src, config, params)
  convert(src, str(tmp_path / "orbax"), "hf_to_orbax")
  convert(str(tmp_path / "orbax"), str(tmp_path / "hf2"), "orbax_to_hf")
  a = load_file(os.path.join(src, "model.safetensors"))
  b = load_file(os.path.join(tmp_path / "hf2", "model.safetensors"))
  assert sorted(a) == sorted(b)
  assert all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a)
  files = convert(str(tmp_path / "orbax"), str(tmp_path / "fp4"), "orbax_to_nvfp4")
  assert "hf_quant_config.json" in files
  with pytest.raises(FileExistsError, match="not empty"):
    convert(str(tmp_path / "orbax"), str(tmp_path / "fp4"), "orbax_to_nvfp4")


def test_cli_reports_errors(tmp_path):
  os.makedirs(tmp_path / "empty")
  cmd = [sys.executable, "-m", "experiments.convert_checkpoint", f"--src={tmp_path / 'empty'}",
         f"--dst={tmp_path / 'out'}", "--direction=hf_to_orbax"]
  res = subprocess.run(cmd, capture_output=True, text=True, cwd=os.path.dirname(
      os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), timeout=120)
  assert res.returncode == 1
  assert "convert_checkpoint: error:" in res.stderr and "config.json" in res.stderr
