"""experiments.convert_checkpoint: HF -> orbax -> HF (bit exact) and -> NVFP4; clear errors."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import pytest
import torch
from safetensors.torch import load_file, save_file

from experiments.convert_checkpoint import convert
from tests.io.checkpoint_damage import garble_largest_array, stale_params
from trace_jax import model as M
from trace_jax.io import hf, orbax_ckpt

ROOT = Path(__file__).resolve().parents[2]


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
  last = res.stderr.strip().splitlines()[-1]
  assert last.startswith("error: ") and "config.json" in last, res.stderr
  assert "Traceback" not in res.stderr


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """An HF checkpoint of the tiny model and its orbax conversion."""
  root = tmp_path_factory.mktemp("ckpts")
  config = M.tiny(dtype="bfloat16")
  hf.save_hf_checkpoint(str(root / "hf"), config, M.init_params(config, 0))
  convert(str(root / "hf"), str(root / "orbax"), "hf_to_orbax")
  return root


def _tree(path) -> dict[str, bytes]:
  return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
          if p.is_file()}


def test_overwrite_replaces_the_previous_hf_conversion_and_keeps_other_files(checkpoints,
                                                                             tmp_path):
  """A previous 3-shard HF conversion beside a tokenizer file: refused without --overwrite;
  with it, the new single-file conversion replaces every old shard and the index (none stays
  stale) and the tokenizer file is untouched."""
  dst = tmp_path / "hf"
  convert(str(checkpoints / "orbax"), str(dst), "orbax_to_hf", max_shard_gb=0.0003)
  old = sorted(os.listdir(dst))
  assert "model.safetensors.index.json" in old and len([n for n in old if "-of-" in n]) >= 3
  (dst / "tokenizer.json").write_text('{"keep": true}')
  with pytest.raises(FileExistsError, match="holds a previous hf conversion; pass --overwrite"):
    convert(str(checkpoints / "orbax"), str(dst), "orbax_to_hf")
  assert sorted(os.listdir(dst)) == sorted(old + ["tokenizer.json"])
  files = convert(str(checkpoints / "orbax"), str(dst), "orbax_to_hf", overwrite=True)
  assert files == ["config.json", "model.safetensors", "tokenizer.json"]
  assert (dst / "tokenizer.json").read_text() == '{"keep": true}'
  assert _tree(dst)["model.safetensors"] == _tree(checkpoints / "hf")["model.safetensors"]


@pytest.mark.parametrize("overwrite", [False, True], ids=["plain", "overwrite"])
def test_an_orbax_destination_with_other_files_is_refused_and_left_alone(checkpoints, tmp_path,
                                                                         overwrite):
  """orbax owns its directory (saving it forcibly wipes it): a destination holding a file the
  converter did not write is refused, with or without --overwrite, and nothing is deleted."""
  dst = tmp_path / "orbax"
  dst.mkdir()
  (dst / "notes.txt").write_text("mine")
  with pytest.raises(FileExistsError, match=r"did not write \(notes.txt\)"):
    convert(str(checkpoints / "hf"), str(dst), "hf_to_orbax", overwrite=overwrite)
  assert os.listdir(dst) == ["notes.txt"]


def test_overwrite_replaces_a_previous_orbax_conversion(checkpoints, tmp_path):
  dst = tmp_path / "orbax"
  shutil.copytree(checkpoints / "orbax", dst)
  with pytest.raises(FileExistsError, match="holds a previous orbax conversion"):
    convert(str(checkpoints / "hf"), str(dst), "hf_to_orbax")
  convert(str(checkpoints / "hf"), str(dst), "hf_to_orbax", overwrite=True)
  assert orbax_ckpt.read_orbax_config(str(dst)) == orbax_ckpt.read_orbax_config(
      str(checkpoints / "orbax"))
  assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_a_conversion_of_another_kind_is_not_replaced(checkpoints, tmp_path):
  dst = tmp_path / "x"
  shutil.copytree(checkpoints / "hf", dst)
  before = _tree(dst)
  with pytest.raises(FileExistsError, match="holds a hf checkpoint; a orbax conversion"):
    convert(str(checkpoints / "orbax"), str(dst), "hf_to_orbax", overwrite=True)
  with pytest.raises(FileExistsError, match="holds a hf checkpoint; a nvfp4 conversion"):
    convert(str(checkpoints / "orbax"), str(dst), "orbax_to_nvfp4", overwrite=True)
  assert _tree(dst) == before


def test_non_finite_or_garbled_sources_are_refused(checkpoints, tmp_path):
  """An HF source with a NaN in one tensor, an orbax source with 64 garbled bytes in its
  largest array file, and one holding another checkpoint's data under its metadata: each
  conversion stops naming the tensor, and writes nothing."""
  bad_hf = tmp_path / "nan_hf"
  shutil.copytree(checkpoints / "hf", bad_hf)
  tensors = load_file(str(bad_hf / "model.safetensors"))
  name = "model.layers.1.mlp.experts.3.up_proj.weight"
  tensors[name][0, 5] = float("nan")
  save_file(tensors, str(bad_hf / "model.safetensors"), metadata={"format": "pt"})
  with pytest.raises(hf.CheckpointError, match=f"tensor {name} holds non-finite values"):
    convert(str(bad_hf), str(tmp_path / "out1"), "hf_to_orbax")
  bad_orbax = tmp_path / "garbled"
  shutil.copytree(checkpoints / "orbax", bad_orbax)
  garble_largest_array(bad_orbax)
  with pytest.raises(hf.CheckpointError,
                     match="differs from its recorded digest|could not be decoded"):
    convert(str(bad_orbax), str(tmp_path / "out2"), "orbax_to_hf")
  stale = tmp_path / "stale"
  shutil.copytree(checkpoints / "orbax", stale)
  config, params = orbax_ckpt.load_orbax(str(stale))
  orbax_ckpt.save_orbax(str(tmp_path / "donor"), config,
                        jax.tree.map(lambda x: x * 2, params), wait=True)
  stale_params(stale, tmp_path / "donor")
  with pytest.raises(hf.CheckpointError, match=r"stale: the content of .* differs from its "
                                               r"recorded digest"):
    convert(str(stale), str(tmp_path / "out3"), "orbax_to_nvfp4")
  assert not any((tmp_path / f"out{i}").exists() for i in (1, 2, 3))


def test_cli_refuses_a_non_empty_destination_with_exit_status_2(checkpoints, tmp_path):
  dst = tmp_path / "hf"
  shutil.copytree(checkpoints / "hf", dst)
  res = subprocess.run([sys.executable, "-m", "experiments.convert_checkpoint",
                        f"--src={checkpoints / 'orbax'}", f"--dst={dst}",
                        "--direction=orbax_to_hf"], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
  assert res.returncode == 2, res.stderr
  assert res.stderr.strip().splitlines()[-1].startswith("error: --dst ")
  assert "Traceback" not in res.stderr
