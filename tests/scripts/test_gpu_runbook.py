"""scripts/gpu_runbook.sh: every step named in its header exists, and runs through under
`set -u` with its benchmark commands stubbed out (a typo there would otherwise surface only on
the GPU machine, after minutes of device time)."""

from __future__ import annotations

import re
import subprocess
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
