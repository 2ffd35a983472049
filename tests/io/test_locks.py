"""Locks on directories a process writes (`trace_jax.io.locks`)."""

import logging
import os
import socket
import subprocess
import sys
import time

import pytest

from trace_jax.io import locks

HOLDER = ("import sys, time\n"
          "from trace_jax.io import locks\n"
          "with locks.hold(sys.argv[1], 'it'):\n"
          "  print('held', flush=True)\n"
          "  time.sleep(600)\n")


def test_a_held_lock_is_refused_naming_its_holder_and_a_dead_ones_is_taken_over(tmp_path,
                                                                                caplog):
  path = str(tmp_path / "run" / "run.lock")
  holder = subprocess.Popen([sys.executable, "-c", HOLDER, path], stdout=subprocess.PIPE,
                            text=True, cwd=os.getcwd())
  try:
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(locks.LockHeldError) as e:
      with locks.hold(path, "the run x"):
        pass
    msg = str(e.value)
    assert msg.startswith(f"the run x is in use by pid {holder.pid} on {socket.gethostname()} "
                          "since ") and f"(lock file {path})" in msg and "\n" not in msg
  finally:
    holder.kill()  # -9: no cleanup runs; the kernel drops the flock
    holder.wait()
  with caplog.at_level(logging.INFO, logger=locks.__name__):
    with locks.hold(path, "the run x"):
      assert f"of pid {holder.pid} on" in caplog.text  # whose stale lock was taken over
      with pytest.raises(locks.LockHeldError, match=f"in use by pid {os.getpid()}"):
        with locks.hold(path, "the run x"):  # one holder, even within a process
          pass
  with locks.hold(path, "the run x"):  # released at the end of the block
    pass


def test_the_holder_records_itself(tmp_path):
  path = tmp_path / "a.lock"
  t0 = time.strftime("%Y-%m-%d")
  with locks.hold(str(path), "a"):
    text = path.read_text()
  assert f'"pid": {os.getpid()}' in text and t0 in text and socket.gethostname() in text
