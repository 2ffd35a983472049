"""The RL and SFT launchers as a user runs them: a mistake in the config, a flag or the workdir
prints one line, `error: <message>`, and exits 2 (no traceback, nothing written)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
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


# The first three fail while parsing flags, before anything compiles (~2 s each).
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
    pytest.param(["--config=configs/quickstart.py", "--report_only"],
                 "holds no run of train_rl", id="report_only_without_a_run"),
    pytest.param(["--config=configs/quickstart.py", "--report_only", "--sft_only"],
                 "--report_only and --sft_only exclude each other", id="report_only_and_sft_only"),
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


# ------------------------------------------------------------------------------ faults

FAST = ["--config=configs/quickstart.py", "--config.sft.steps=0", "--config.rl.steps=1",
        "--policies=bf16", "--no_progress"]


def assert_one_line_fault(p: subprocess.CompletedProcess, message: str) -> str:
  """Exit status 1, the last line `error: ...` holding `message`, no traceback on stderr;
  returns the log file the line names."""
  assert p.returncode == 1, p.stderr[-3000:]
  lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
  assert lines[-1].startswith("error: ") and message in lines[-1], p.stderr[-3000:]
  assert "Traceback" not in p.stderr, p.stderr[-3000:]
  log = lines[-1].rsplit("(traceback in ", 1)[1].rstrip(")")
  assert "Traceback" in Path(log).read_text()
  return log


def test_a_second_launch_of_a_running_run_is_refused(tmp_path):
  """Two launches on one workdir: while the first trains its warm start, the second is refused
  in one line naming the first's pid and host, and the first runs on. Killed with -9, the
  first leaves a stale lock that the next holder takes over."""
  from trace_jax.io import locks
  args = ["--config=configs/quickstart.py", "--config.sft.steps=2000", "--policies=bf16",
          "--no_progress", f"--workdir={tmp_path}"]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  first = subprocess.Popen([sys.executable, "-m", "experiments.train_rl", *args], cwd=ROOT,
                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  try:
    lock = tmp_path / "sft.lock"
    deadline = time.time() + 240
    while f'"pid": {first.pid}' not in (lock.read_text() if lock.exists() else ""):
      assert first.poll() is None and time.time() < deadline, first.stderr.read()[-2000:]
      time.sleep(0.2)
    second = launch("experiments.train_rl", *args)
    assert_one_line_error(second, f"the warm start of {tmp_path} is in use by pid {first.pid} "
                                  f"on {socket.gethostname()}")
    assert first.poll() is None
  finally:
    first.kill()
    first.wait()
  with locks.hold(str(tmp_path / "sft.lock"), "the warm start"):
    assert f'"pid": {os.getpid()}' in (tmp_path / "sft.lock").read_text()


def test_a_full_disk_ends_in_one_line_naming_the_cause(tmp_path):
  """ENOSPC injected where the warm start is saved (as a full disk raises it): exit status 1,
  one line naming the cause, the path and what to do, the traceback in workdir/error.log."""
  code = ("import errno, runpy, sys\n"
          "from trace_jax.io import orbax_ckpt\n"
          "def full(path, *a, **k):\n"
          "  raise OSError(errno.ENOSPC, 'No space left on device', path)\n"
          "orbax_ckpt.save_orbax = full\n"
          "sys.argv[0] = 'train_rl'\n"
          "runpy.run_module('experiments.train_rl', run_name='__main__')\n")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  p = subprocess.run([sys.executable, "-c", code, *FAST, f"--workdir={tmp_path}"], cwd=ROOT,
                     env=env, capture_output=True, text=True, timeout=300)
  log = assert_one_line_fault(p, f"no space left on the device writing {tmp_path}/sft")
  assert log == f"{tmp_path}/error.log" and "free space there" in p.stderr


def test_no_restorable_checkpoint_is_one_short_line(tmp_path):
  """A run whose only checkpoint is of another state (a workdir reused across code versions):
  exit status 1 and one short line; every step's error is in the log it names."""
  from trace_jax.train import checkpoints
  ckpt = checkpoints.checkpointer(str(tmp_path / "bf16" / "seed0" / "ckpt"), keep=2)
  checkpoints.save(ckpt, 1, {"w": np.zeros(3, np.float32)}, {"history": [], "evals": []})
  ckpt.close()
  p = launch("experiments.train_rl", *FAST, "--config.rl.seeds=(0,)", f"--workdir={tmp_path}")
  log = assert_one_line_fault(p, "no checkpoint in ")
  assert len(p.stderr.strip().splitlines()[-1]) < 600
  assert "step 1: " in Path(log).read_text()


@pytest.mark.parametrize("module,args,message", [
    pytest.param("experiments.quant_report", ["--batch=abc"], "flag --batch=abc: invalid literal",
                 id="quant_report_bad_value"),
    pytest.param("experiments.quant_report", ["--batch=0", "--split_k=3"],
                 "--batch must be >= 1, got 0; --split_k=3 must divide --width=512",
                 id="quant_report_out_of_range"),
    pytest.param("experiments.measure_mismatch", ["--json_out=/tmp/x.json", "--num_prompts=0"],
                 "--num_prompts must be >= 1, got 0", id="measure_mismatch_out_of_range"),
    pytest.param("experiments.measure_mismatch", ["--json_out=/tmp/x.json", "--config=/nope.py"],
                 "--config=/nope.py: cannot load the config file", id="measure_mismatch_config"),
    pytest.param("experiments.measure_mismatch", ["--json_out=/tmp/x.json",
                                                  "--guidance_budget=50"],
                 "--guidance_budget: guidance budget 50 B/token is below the cheapest layer's",
                 id="measure_mismatch_budget"),
    pytest.param("rollout_bridge.serve", ["--port=70000", "--max_batch=0"],
                 "--port must be an int in 0..65535 (0: any free port), got 70000; --max_batch "
                 "must be an int >= 1", id="serve_out_of_range"),
    pytest.param("experiments.train_rl", ["--rollout_url=http://127.0.0.1:9", "--api_key=a",
                                          "--api_key_file=b"],
                 "give --api_key or --api_key_file, not both", id="train_rl_two_keys"),
])
def test_bad_flags_are_one_line_with_exit_status_2(module, args, message, tmp_path):
  assert_one_line_error(launch(module, *args, *(
      [f"--workdir={tmp_path}/w"] if module == "experiments.train_rl" else [])), message)
