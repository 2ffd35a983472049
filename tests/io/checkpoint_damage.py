"""Damage done to orbax checkpoints on disk, as faults do it (shared by the integrity tests)."""

import shutil
from pathlib import Path


def array_files(path: Path) -> list[Path]:
  """The array data files of an orbax checkpoint (or one step of a run's checkpoints)."""
  return [f for f in Path(path).rglob("*") if f.is_file() and f.parent.name == "d"]


def truncate_arrays(path: Path) -> int:
  """Cuts every array data file to half its size (a torn write); returns how many."""
  files = array_files(path)
  for f in files:
    data = f.read_bytes()
    f.write_bytes(data[:len(data) // 2])
  return len(files)


def garble_largest_array(path: Path) -> int:
  """XORs 64 bytes in the middle of the largest array data file with 0xFF: a file of the right
  size. The chunks are compressed and their grouping into files varies from save to save, so
  whether it still decodes (into other values) or fails to decode depends on the bytes hit; a
  test of it accepts either refusal. Returns 1 (files damaged)."""
  f = max(array_files(path), key=lambda f: f.stat().st_size)
  data = bytearray(f.read_bytes())
  mid = len(data) // 2
  data[mid:mid + 64] = bytes(b ^ 0xFF for b in data[mid:mid + 64])
  f.write_bytes(bytes(data))
  return 1


def stale_state(path: Path) -> int:
  """Replaces the train state of run checkpoint step `path` (`<run>/ckpt/<step>`) with the state
  of the next older step, keeping this step's metadata: a checkpoint that decodes whole, into
  values other than those it recorded (a stale copy). Returns 1 (states replaced)."""
  path = Path(path)
  older = max(int(p.name) for p in path.parent.iterdir()
              if p.name.isdigit() and int(p.name) < int(path.name))
  shutil.rmtree(path / "state")
  shutil.copytree(path.parent / str(older) / "state", path / "state")
  return 1


def stale_params(path: Path, donor: Path) -> int:
  """Replaces the parameter data of orbax params checkpoint `path` with that of `donor` (same
  config, other values), keeping `path`'s metadata: it decodes whole, into values other than
  those recorded, so only the recorded digests catch it. Returns 1 (checkpoints changed)."""
  path = Path(path)
  shutil.rmtree(path / "params")
  shutil.copytree(Path(donor) / "params", path / "params")
  return 1
