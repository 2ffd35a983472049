r"""Converts model checkpoints: HF safetensors <-> orbax, and orbax -> NVFP4 (ModelOpt layout).

  python -m experiments.convert_checkpoint --src=/ckpt/hf --dst=/ckpt/orbax \
      --direction=hf_to_orbax
  python -m experiments.convert_checkpoint --src=/ckpt/orbax --dst=/ckpt/hf \
      --direction=orbax_to_hf [--dtype=bfloat16] [--max_shard_gb=5]
  python -m experiments.convert_checkpoint --src=/ckpt/orbax --dst=/ckpt/nvfp4 \
      --direction=orbax_to_nvfp4

Every tensor is checked against the config before anything is written; a missing or
misshapen tensor or a config mismatch stops the conversion with a message naming it.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags

from trace_jax.io import hf, orbax_ckpt

DIRECTIONS = ("hf_to_orbax", "orbax_to_hf", "orbax_to_nvfp4")

_SRC = flags.DEFINE_string("src", None, "source checkpoint directory", required=True)
_DST = flags.DEFINE_string("dst", None, "destination directory", required=True)
_DIRECTION = flags.DEFINE_enum("direction", None, DIRECTIONS, "conversion", required=True)
_DTYPE = flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"],
                           "orbax_to_hf: cast tensors to this dtype (default: keep)")
_MAX_SHARD_GB = flags.DEFINE_float("max_shard_gb", 5.0,
                                   "HF/NVFP4 output: shard size limit in GB (index above it)")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "allow writing into a non-empty --dst")


def convert(src: str, dst: str, direction: str, dtype: str | None = None,
            max_shard_gb: float = 5.0, overwrite: bool = False) -> list[str]:
  """Runs one conversion; returns the files written into dst."""
  if direction not in DIRECTIONS:
    raise ValueError(f"unknown direction {direction!r}; expected one of {DIRECTIONS}")
  if not os.path.isdir(src):
    raise FileNotFoundError(f"--src {src} is not a directory")
  if os.path.isdir(dst) and os.listdir(dst) and not overwrite:
    raise FileExistsError(f"--dst {dst} is not empty (pass --overwrite to write into it)")
  shard = int(max_shard_gb * 1e9)
  if direction == "hf_to_orbax":
    config, params = hf.load_hf_checkpoint(src, progress=True)
    orbax_ckpt.save_orbax(dst, config, params, wait=True)
  else:
    config, params = orbax_ckpt.load_orbax(src)
    if direction == "orbax_to_hf":
      hf.save_hf_checkpoint(dst, config, params, dtype=dtype, max_shard_bytes=shard,
                            progress=True)
    else:
      hf.save_nvfp4_checkpoint(dst, config, params, max_shard_bytes=shard, progress=True)
  return sorted(os.listdir(dst))


def main(argv: list[str]) -> None:
  del argv
  try:
    files = convert(_SRC.value, _DST.value, _DIRECTION.value, _DTYPE.value,
                    _MAX_SHARD_GB.value, _OVERWRITE.value)
  except (hf.CheckpointError, FileNotFoundError, FileExistsError, ValueError) as e:
    print(f"convert_checkpoint: error: {e}", file=sys.stderr)
    sys.exit(1)
  print(f"convert_checkpoint: {_DIRECTION.value}: wrote {len(files)} entries to {_DST.value}")


if __name__ == "__main__":
  app.run(main)
