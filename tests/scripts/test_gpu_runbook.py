"""scripts/gpu_runbook.sh: every step named in its header exists, and runs through under
`set -u` with its benchmark commands stubbed out (a typo there would otherwise surface only on
the GPU machine, after minutes of device time)."""

from __future__ import annotations

import re
import subprocess
import tarfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_runbook.sh"
TEXT = SCRIPT.read_text()


def _header_steps() -> list[str]:
  block = TEXT.split("# Steps:\n", 1)[1].split("\n#\n", 1)[0]
  return re.findall(r"^#   ([a-z0-9_]+)\s", block, flags=re.M)


def _functions() -> list[str]:
  return re.findall(r"^step_([a-z0-9_]+)\(\) \{", TEXT, flags=re.M)


def test_the_header_names_every_step_and_the_script_parses():
  assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
  assert sorted(_header_steps()) == sorted(_functions())


def test_an_unknown_step_is_refused_naming_every_step(tmp_path):
  p = subprocess.run(["bash", str(SCRIPT), "nope"], capture_output=True, text=True,
                     env={"OUT": str(tmp_path), "PATH": "/usr/bin:/bin"})
  assert p.returncode == 2 and "unknown step 'nope'" in p.stderr
  assert set(re.findall(r"[a-z0-9_]+", p.stderr.split("steps:", 1)[1])) == set(_functions())


@pytest.mark.parametrize("step", _functions())
def test_step_runs_through_with_its_commands_stubbed(step, tmp_path):
  """The step under `set -u`, `run` printing what it would run: every command has a name, a
  positive limit and a python module or pytest."""
  body = TEXT.replace('\nmain "$@"\n', "\n")
  stub = ('run() { [ "$2" -gt 1 ] || { echo "bad limit $1 $2" >&2; exit 3; }; '
          'echo "RUN $1 $2 ${*:3}"; }; small_gpu() { return 1; }; '
          f"step_{step}")
  p = subprocess.run(["bash", "-c", body + "\n" + stub], capture_output=True, text=True,
                     env={"OUT": str(tmp_path), "PATH": "/usr/bin:/bin"}, cwd=tmp_path)
  assert p.returncode == 0, p.stderr
  runs = [ln for ln in p.stdout.splitlines() if ln.startswith("RUN ")]
  assert runs, p.stdout
  for ln in runs:
    assert re.match(r"RUN [a-z0-9_]+ \d+ python3 -m (experiments\.|pytest)", ln), ln


def _test_files(tmp_path, shard: str | None) -> subprocess.CompletedProcess:
  body = TEXT.replace('\nmain "$@"\n', "\n")
  env = {"OUT": str(tmp_path), "PATH": "/usr/bin:/bin"}
  if shard is not None:
    env["TESTS_SHARD"] = shard
  return subprocess.run(["bash", "-c", body + "\ntest_files"], capture_output=True, text=True,
                        env=env, cwd=SCRIPT.parents[1])


def test_test_shards_partition_the_files(tmp_path):
  """TESTS_SHARD=i/3 for i = 1..3 give disjoint lists whose union is the unsharded list (every
  test file under tests/kernels and tests/quant among them)."""
  whole = _test_files(tmp_path, None).stdout.split()
  assert "tests/kernels/test_decode_attention.py" in whole and len(whole) == len(set(whole))
  shards = [_test_files(tmp_path, f"{i}/3").stdout.split() for i in (1, 2, 3)]
  assert all(shards) and sorted(sum(shards, [])) == sorted(whole)


@pytest.mark.parametrize("shard", ["0/3", "4/3", "two"], ids=["zero", "past_n", "not_numbers"])
def test_a_bad_shard_is_refused(tmp_path, shard):
  p = _test_files(tmp_path, shard)
  assert p.returncode == 2 and "TESTS_SHARD must be i/n" in p.stderr


def test_test_options_pass_through_every_shard(tmp_path):
  """Options in TESTS_ARGS (not paths) stay in order ahead of each shard's files."""
  body = TEXT.replace('\nmain "$@"\n', "\n")
  env = {"OUT": str(tmp_path), "PATH": "/usr/bin:/bin", "TESTS_SHARD": "2/2",
         "TESTS_ARGS": "-k wgmma tests/kernels/test_decode_attention.py tests/quant"}
  got = subprocess.run(["bash", "-c", body + "\ntest_files"], capture_output=True, text=True,
                       env=env, cwd=SCRIPT.parents[1]).stdout.split()
  assert got[:2] == ["-k", "wgmma"] and len(got) > 2
  assert all(f.startswith("tests/quant/test_") for f in got[2:]), got


def _pack(out: Path, packed: Path) -> None:
  body = TEXT.replace('\nmain "$@"\n', "\n")
  env = {"OUT": str(out), "PACKED": str(packed), "PATH": "/usr/bin:/bin"}
  p = subprocess.run(["bash", "-c", body + "\npack"], capture_output=True, text=True, env=env)
  assert p.returncode == 0, p.stderr


def _tar_names(path: Path) -> set[str]:
  with tarfile.open(path) as tar:
    return {Path(n).name for n in tar.getnames() if n not in (".", "./")}


def test_pack_keeps_every_file_within_the_eight_that_come_back(tmp_path):
  """Packed after each step: loose files stay while 7 or fewer; past that they go into
  out.tar.gz, and a later step's files join the same archive (not replace it)."""
  out, packed = tmp_path / "out", tmp_path / "packed"
  out.mkdir()
  (out / "runbook.log").write_text("log")
  for i in range(3):
    (out / f"a{i}.json").write_text(str(i))
  _pack(out, packed)
  assert sorted(p.name for p in out.iterdir()) == ["a0.json", "a1.json", "a2.json", "runbook.log"]
  for i in range(3, 9):
    (out / f"a{i}.json").write_text(str(i))
  _pack(out, packed)
  assert sorted(p.name for p in out.iterdir()) == ["out.tar.gz", "runbook.log"]
  assert _tar_names(out / "out.tar.gz") == {f"a{i}.json" for i in range(9)}
  (out / "b.log").write_text("next step")
  _pack(out, packed)
  assert sorted(p.name for p in out.iterdir()) == ["out.tar.gz", "runbook.log"]
  assert _tar_names(out / "out.tar.gz") == {f"a{i}.json" for i in range(9)} | {"b.log"}
