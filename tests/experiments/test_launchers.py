"""The RL and SFT launchers as a user runs them: a mistake in the config, a flag or the workdir
prints one line, `error: <message>`, and exits 2 (no traceback, nothing written)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from configs import quickstart
from trace_jax.train import run_guard

ROOT = Path(__file__).resolve().parents[2]


def launch(module: str, *args: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)


def assert_one_line_error(p: subprocess.CompletedProcess, message: str) -> None:
  assert p.returncode == 2, p.stderr[-2000:]
  lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
  assert lines[-1].startswith("error: ") and message in lines[-1], p.stderr[-2000:]
  assert "Traceback" not in p.stderr


# The first three fail while parsing flags, before JAX is imported (well under a second each).
@pytest.mark.parametrize("args,message", [
    pytest.param(["--config=configs/nope.py"],
                 "--config=configs/nope.py: cannot load the config file: [Errno 2] No such file",
                 id="missing_config_file"),
    pytest.param(["--config=configs/quickstart.py", "--config.rl.nope=1"],
                 "--config.rl.nope: no such config field `rl.nope`", id="unknown_override"),
    pytest.param(["--config=configs/quickstart.py", "--config.rl.steps=abc"],
                 "flag --config.rl.steps=abc: invalid literal for int()", id="bad_flag_value"),
    pytest.param(["--config=configs/quickstart.py", "--config.rl.steps=-1",
                  "--config.rl.lr=-1"],
                 "rl.steps must be an int >= 1, got -1; rl.lr must be a finite number > 0",
                 id="out_of_range_values"),
])
def test_train_rl_user_errors(args, message, tmp_path):
  work = tmp_path / "run"
  assert_one_line_error(launch("experiments.train_rl", *args, f"--workdir={work}"), message)
  assert not work.exists()


def test_train_rl_refuses_a_workdir_of_another_config(tmp_path):
  """The fingerprint refusal through the CLI: the workdir was started with the quickstart
  config; --config.seed=1 is refused before the warm start, naming the field."""
  run_guard.check_workdir(str(tmp_path), quickstart.get_config())
  before = sorted(os.listdir(tmp_path))
  p = launch("experiments.train_rl", "--config=configs/quickstart.py", "--config.seed=1",
             f"--workdir={tmp_path}")
  assert_one_line_error(p, "1 field differs: seed: 0 -> 1")
  assert "--allow_config_change" in p.stderr and sorted(os.listdir(tmp_path)) == before


def test_sft_user_error(tmp_path):
  work = tmp_path / "sft"
  p = launch("experiments.sft", "--config=configs/quickstart.py", "--config.sft.steps=-1",
             f"--workdir={work}")
  assert_one_line_error(p, "sft.steps must be an int >= 0, got -1")
  assert not work.exists()
