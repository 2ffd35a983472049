r"""Converts model checkpoints: HF safetensors <-> orbax, and orbax -> NVFP4 (ModelOpt layout).

  python -m experiments.convert_checkpoint --src=/ckpt/hf --dst=/ckpt/orbax \
      --direction=hf_to_orbax
  python -m experiments.convert_checkpoint --src=/ckpt/orbax --dst=/ckpt/hf \
      --direction=orbax_to_hf [--dtype=bfloat16] [--max_shard_gb=5]
  python -m experiments.convert_checkpoint --src=/ckpt/orbax --dst=/ckpt/nvfp4 \
      --direction=orbax_to_nvfp4

Every tensor is checked against the config before anything is written; a missing, misshapen
or non-finite (NaN/Inf) tensor, a garbled orbax file or a config mismatch stops the conversion
with a message naming it.

The destination: a new or empty directory is written; one that holds a previous conversion of
the same kind needs --overwrite, which replaces that conversion's files (every `*.safetensors`,
the shard index, `config.json`, `hf_quant_config.json`; or the whole orbax checkpoint) and
leaves every other file alone (an HF directory's tokenizer files, say). A directory holding a
conversion of another kind is refused, and so is an orbax destination holding anything else
(orbax owns its directory). The new files are written into a temporary sibling first, so a
failed conversion leaves the destination as it was.

Errors end in one line, `error: ...`: exit status 2 for flags and destinations, 1 for faults
(an unreadable source, a full disk), with the traceback in a log file the line names.
"""

from __future__ import annotations

import os
import shutil
import sys

from absl import app, flags

from trace_jax.io import hf, orbax_ckpt
from trace_jax.train import run_guard

DIRECTIONS = ("hf_to_orbax", "orbax_to_hf", "orbax_to_nvfp4")
KINDS = {"hf_to_orbax": "orbax", "orbax_to_hf": "hf", "orbax_to_nvfp4": "nvfp4"}
# What a conversion writes, by kind (orbax: the whole directory, its own layout).
_HF_FILES = (hf.CONFIG_FILE, "model.safetensors.index.json", "hf_quant_config.json")
_ORBAX_ITEMS = ("_CHECKPOINT_METADATA", "commit_success.txt", "meta", "params", "descriptor",
                "_sharding")

_SRC = flags.DEFINE_string("src", None, "source checkpoint directory", required=True)
_DST = flags.DEFINE_string("dst", None, "destination directory", required=True)
_DIRECTION = flags.DEFINE_enum("direction", None, DIRECTIONS, "conversion", required=True)
_DTYPE = flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"],
                           "orbax_to_hf: cast tensors to this dtype (default: keep)")
_MAX_SHARD_GB = flags.DEFINE_float("max_shard_gb", 5.0,
                                   "HF/NVFP4 output: shard size limit in GB (index above it)")
_OVERWRITE = flags.DEFINE_bool(
    "overwrite", False, "replace a previous conversion of the same kind in --dst (its files "
    "only; other files stay)")


class DestinationError(run_guard.UserError, FileExistsError):
  """The destination holds what this conversion must not replace."""


def kind_of(path: str) -> str | None:
  """The kind of conversion a directory holds: "orbax", "hf", "nvfp4", or None."""
  names = set(os.listdir(path))
  if ("meta" in names and "params" in names) or "_CHECKPOINT_METADATA" in names:
    return "orbax"
  if "hf_quant_config.json" in names:
    return "nvfp4"
  if hf.CONFIG_FILE in names or any(n.endswith(".safetensors") for n in names):
    return "nvfp4" if _quantized(path) else "hf"
  return None


def _quantized(path: str) -> bool:
  import json
  try:
    with open(os.path.join(path, hf.CONFIG_FILE)) as f:
      return bool(json.load(f).get("quantization_config"))
  except (OSError, ValueError):
    return False


def _owned(name: str, kind: str) -> bool:
  """Whether a conversion of `kind` writes the directory entry `name`."""
  if kind == "orbax":
    return name in _ORBAX_ITEMS
  return name in _HF_FILES or name.endswith(".safetensors")


def check_destination(dst: str, kind: str, overwrite: bool) -> None:
  """Raises DestinationError unless `dst` may receive a conversion of `kind` (module doc)."""
  if not os.path.isdir(dst) or not os.listdir(dst):
    if os.path.exists(dst) and not os.path.isdir(dst):
      raise DestinationError(f"--dst {dst} is a file, not a directory")
    return
  held = kind_of(dst)
  if held is not None and held != kind:
    raise DestinationError(f"--dst {dst} holds a {held} checkpoint; a {kind} conversion does not "
                           "replace it: use another --dst")
  other = sorted(n for n in os.listdir(dst) if not _owned(n, kind))
  if kind == "orbax" and other:
    raise DestinationError(f"--dst {dst} holds files an orbax conversion did not write "
                           f"({', '.join(other[:5])}); orbax owns its directory: use an empty "
                           "or new --dst")
  if held is None and not other:
    return
  if not overwrite:
    what = f"a previous {kind} conversion" if held else f"other files ({', '.join(other[:5])})"
    raise DestinationError(f"--dst {dst} is not empty: it holds {what}; pass --overwrite to "
                           f"replace {'it' if held else 'nothing and write beside them'}")


def convert(src: str, dst: str, direction: str, dtype: str | None = None,
            max_shard_gb: float = 5.0, overwrite: bool = False) -> list[str]:
  """Runs one conversion; returns the files of dst (sorted)."""
  if direction not in DIRECTIONS:
    raise ValueError(f"unknown direction {direction!r}; expected one of {DIRECTIONS}")
  if not os.path.isdir(src):
    raise FileNotFoundError(f"--src {src} is not a directory")
  kind = KINDS[direction]
  check_destination(dst, kind, overwrite)
  shard = int(max_shard_gb * 1e9)
  if direction == "hf_to_orbax":
    config, params = hf.load_hf_checkpoint(src, progress=True)
  else:
    config, params = orbax_ckpt.load_orbax(src)
  parent = os.path.dirname(os.path.abspath(dst))
  os.makedirs(parent, exist_ok=True)
  tmp = os.path.join(parent, f".{os.path.basename(os.path.abspath(dst))}.tmp-{os.getpid()}")
  shutil.rmtree(tmp, ignore_errors=True)
  try:
    if direction == "hf_to_orbax":
      orbax_ckpt.save_orbax(tmp, config, params, wait=True)
    elif direction == "orbax_to_hf":
      hf.save_hf_checkpoint(tmp, config, params, dtype=dtype, max_shard_bytes=shard,
                            progress=True)
    else:
      hf.save_nvfp4_checkpoint(tmp, config, params, max_shard_bytes=shard, progress=True)
    _replace(tmp, dst, kind)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return sorted(os.listdir(dst))


def _replace(tmp: str, dst: str, kind: str) -> None:
  """Moves the new conversion in `tmp` into `dst`, removing the previous conversion's files
  there first (all of dst for orbax, which `check_destination` found holds nothing else)."""
  if kind == "orbax" or not os.path.isdir(dst):
    if os.path.isdir(dst):
      shutil.rmtree(dst)
    os.replace(tmp, dst)
    return
  for name in os.listdir(dst):
    if _owned(name, kind):
      os.remove(os.path.join(dst, name))
  for name in os.listdir(tmp):
    os.replace(os.path.join(tmp, name), os.path.join(dst, name))


def main(argv: list[str]) -> None:
  del argv
  with run_guard.exit_on_errors():
    if not os.path.isdir(_SRC.value):
      raise run_guard.UserError(f"--src {_SRC.value} is not a directory")
    files = convert(_SRC.value, _DST.value, _DIRECTION.value, _DTYPE.value,
                    _MAX_SHARD_GB.value, _OVERWRITE.value)
  print(f"convert_checkpoint: {_DIRECTION.value}: wrote {len(files)} entries to {_DST.value}",
        file=sys.stdout)


if __name__ == "__main__":
  app.run(main, flags_parser=run_guard.flags_parser())
