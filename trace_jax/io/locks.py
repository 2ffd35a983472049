"""Locks on directories a process writes: one run per workdir, one server per guidance root.

`hold(path)` takes an advisory lock (`flock`) on the file `path` for as long as the process
runs the block, without waiting: when another process holds it, `LockHeldError` names that
process (its pid, host, start time and command line, which the holder writes into the file).
The kernel releases a flock when its process dies, even under kill -9, so a stale lock of a dead
process never blocks: the next launch takes it over and logs whose it was. Where the file
system has no flock (some network mounts), `hold` raises the OSError rather than run unlocked.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)


class LockHeldError(RuntimeError):
  """Another live process holds the lock."""


def _holder(f: Any) -> dict[str, Any]:
  f.seek(0)
  try:
    return json.loads(f.read() or "{}")
  except ValueError:
    return {}


def describe_holder(info: dict[str, Any]) -> str:
  """`pid 123 on host-a since <start time> (python -m ...)` (what is known)."""
  if not info:
    return "another process (it recorded nothing)"
  cmd = " ".join(info.get("argv", []))
  cmd = f" ({cmd[:120]}{'...' if len(cmd) > 120 else ''})" if cmd else ""
  return (f"pid {info.get('pid', '?')} on {info.get('host', '?')} since "
          f"{info.get('since', '?')}{cmd}")


@contextlib.contextmanager
def hold(path: str, what: str) -> Iterator[None]:
  """Holds an exclusive lock on the file `path` (created with its directory) for the block.

  what: how a refusal names the locked thing (e.g. "the run runs/q/bf16/seed0").
  Raises LockHeldError at once when another process holds it.
  """
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  f = open(path, "a+")  # noqa: SIM115 - held open for the whole block
  try:
    try:
      fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
        raise
      raise LockHeldError(f"{what} is in use by {describe_holder(_holder(f))}; wait for it to "
                          f"finish or stop it (lock file {path})") from None
    _record(f, path)
    yield
  finally:
    f.close()  # closing the file releases the lock


def _record(f: Any, path: str) -> None:
  """Writes this process into the lock file, logging the previous holder it replaces."""
  old = _holder(f)
  if old and old.get("pid") != os.getpid():
    log.info("took over the lock %s of %s (that process has ended)", path, describe_holder(old))
  info = {"pid": os.getpid(), "host": socket.gethostname(),
          "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": list(sys.argv)}
  f.seek(0)
  f.truncate()
  f.write(json.dumps(info))
  f.flush()
