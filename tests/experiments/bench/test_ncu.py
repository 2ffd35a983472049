"""experiments/bench/ncu.py: the ncu command it builds, its refusals, and the limit that stops
the profiled process with ncu (a `timeout` around ncu alone does not)."""

from __future__ import annotations

import os
import sys
import time

import pytest

from experiments.bench import ncu


def test_command_profiles_the_matching_launches_with_each_section():
  target = ["python3", "-m", "experiments.bench.decode_attention", "--reps=1"]
  cmd = ncu.command(target, "wgmma_flash", skip=2, count=3, sections=("SpeedOfLight",
                                                                     "WarpStateStats"))
  assert cmd[0] == "ncu" and cmd[-len(target):] == target
  opts = cmd[1:-len(target)]
  pairs = dict(zip(opts[::2], opts[1::2]))
  assert pairs["--kernel-name"] == "regex:wgmma_flash"
  assert (pairs["--launch-skip"], pairs["--launch-count"]) == ("2", "3")
  assert pairs["--clock-control"] == "none"
  assert [opts[i + 1] for i, o in enumerate(opts) if o == "--section"] == ["SpeedOfLight",
                                                                           "WarpStateStats"]


@pytest.mark.parametrize("target,skip,count,match", [
    pytest.param([], 1, 1, "no command", id="no_target"),
    pytest.param(["python3"], -1, 1, "launch_skip", id="negative_skip"),
    pytest.param(["python3"], 0, 0, "launch_count", id="no_launch"),
])
def test_bad_arguments_are_refused(target, skip, count, match):
  with pytest.raises(ValueError, match=match):
    ncu.command(target, "k", skip, count)


def test_main_refuses_a_missing_kernel_and_a_missing_command():
  with pytest.raises(SystemExit, match="--kernel is required"):
    ncu.main(["ncu.py", "--", "python3"])
  with pytest.raises(SystemExit, match="no command"):
    ncu.main(["ncu.py", "--kernel=k"])


def test_run_limited_returns_the_command_s_status():
  assert ncu.run_limited([sys.executable, "-c", "raise SystemExit(3)"], 30) == 3


def test_run_limited_kills_the_command_and_what_it_started(tmp_path):
  """A command that starts a child and waits on it: after the limit both are gone."""
  pid_file = tmp_path / "child.pid"
  script = (f"import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', "
            f"'import time; time.sleep(60)']); open({str(pid_file)!r}, 'w').write(str(p.pid)); "
            f"p.wait()")
  t0 = time.monotonic()
  assert ncu.run_limited([sys.executable, "-c", script], 2) == ncu.TIMED_OUT
  assert time.monotonic() - t0 < 30
  child = int(pid_file.read_text())
  for _ in range(50):  # the orphaned child is reaped by init
    if not _alive(child):
      break
    time.sleep(0.1)
  assert not _alive(child)


def _alive(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().split(")")[-1].split()[0] != "Z"
  except FileNotFoundError:
    return False
  except OSError:
    return os.path.exists(f"/proc/{pid}")
