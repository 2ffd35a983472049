"""Guards a run's workdir and command line: the run fingerprint, and user errors in one line.

A workdir holds the results of one config. `check_workdir` records the resolved config in
`<workdir>/run_config.json` at the first launch, with a sha256 of its fingerprinted part (the
config minus `EXEMPT`); a later launch with another fingerprint is refused with the fields that
differ, unless the caller allows the change (then the change is logged and kept in the file's
`changes`). Without it, a resumed run would mix two configs' numbers under the new config's
name. Processes that share a workdir (`--sft_only`, then one `--policies` process each) take
an exclusive lock on `run_config.lock`; the first writes the file, the others compare. For the
whole launch each process also holds the runs it writes (`holding`), so two launches never
write one run.

The launchers report user errors (`UserError`: a bad config, flag or workdir) as one line,
`error: <message>`, and exit 2; `RunError` (a fault the run cannot get past, e.g. no
checkpoint restores) and every other fault (disk full, permission denied) exit 1 the same way,
with the traceback in a log file the line names (`exit_on_errors`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import reprlib
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NoReturn

log = logging.getLogger(__name__)

FILE = "run_config.json"
LOCK = "run_config.lock"
VERSION = 1
# Config fields a run may change between launches on one workdir (a path covers its subtree).
EXEMPT = (
    "policies",                # which runs to do: each (policy, seed) run has its own directory
    "rl.seeds",                # the same: adding or dropping seeds adds or drops runs
    "rl.steps",                # extends (or stops early) a run; the LR schedule's decay follows
                               # the new length from the resume on (kept in `changes`)
    "eval.every",              # when greedy evals run: they change no training state
    "eval.posthoc_fp4",        # an extra eval of the bf16 runs after training
    "checkpoint_every",        # resume is exact from any checkpoint
    "rl.keep_guidance",        # whether read guidance records stay on disk
    "rl.on_missing_guidance",  # error or RTN fallback on missing records (counted in summary)
)
# The fields a warm start (`experiments.sft`, `workdir/sft`) depends on: top-level sections.
SFT_SCOPE = ("seed", "model", "task", "sft", "seq_len", "mesh")
ABSENT = "<absent>"


class UserError(ValueError):
  """A mistake in the launch (config, flags, workdir): reported in one line, exit status 2."""


class ConfigMismatchError(UserError):
  """The workdir holds a run of another config (fingerprint differs)."""


class WorkdirInUseError(UserError):
  """Another live launch holds a run (or warm start) this launch would write."""


class RunError(RuntimeError):
  """A fault the run cannot get past (e.g. no checkpoint restores): one line, exit status 1."""


# ------------------------------------------------------------------------------ fingerprint

def config_dict(cfg: Any) -> dict[str, Any]:
  """A ConfigDict (or mapping) as plain JSON values: tuples become lists, sections dicts."""
  text = cfg.to_json_best_effort(sort_keys=True) if hasattr(cfg, "to_json_best_effort") else (
      json.dumps(cfg, sort_keys=True, default=str))
  return json.loads(text)


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """Dotted paths to leaves (`rl.lr`); an empty section is a leaf ({})."""
  out: dict[str, Any] = {}
  for k, v in tree.items():
    path = f"{prefix}{k}"
    if isinstance(v, Mapping) and v:
      out.update(flatten(v, f"{path}."))
    else:
      out[path] = v
  return out


def _under(path: str, roots: Sequence[str]) -> bool:
  return any(path == r or path.startswith(f"{r}.") for r in roots)


def fingerprinted(flat: Mapping[str, Any], scope: Sequence[str] | None = None,
                  exempt: Sequence[str] = EXEMPT) -> dict[str, Any]:
  """The fields that identify a run: in `scope` (top-level sections; None: all), not exempt."""
  return {k: v for k, v in flat.items()
          if not _under(k, exempt) and (scope is None or _under(k, scope))}


def fingerprint(fields: Mapping[str, Any]) -> str:
  """sha256 of the fields' canonical JSON."""
  text = json.dumps(dict(fields), sort_keys=True, separators=(",", ":"))
  return hashlib.sha256(text.encode()).hexdigest()


def diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
  """{path: (old, new)} for every path whose value differs; `ABSENT` for a missing side."""
  return {k: (old.get(k, ABSENT), new.get(k, ABSENT)) for k in sorted(set(old) | set(new))
          if old.get(k, ABSENT) != new.get(k, ABSENT)}


def describe(changes: Mapping[str, tuple[Any, Any]]) -> str:
  """`a.b: old -> new, ...` (values shortened)."""
  short = reprlib.Repr()
  short.maxstring, short.maxlist, short.maxother = 40, 6, 40
  return ", ".join(f"{k}: {short.repr(a)} -> {short.repr(b)}" for k, (a, b) in changes.items())


def _fields(cfg: Any, launch: Mapping[str, Any] | None) -> dict[str, Any]:
  """The config's dotted fields plus the launch's (as `--name`)."""
  return {**flatten(config_dict(cfg)), **{f"--{k}": v for k, v in _launch(launch).items()}}


def _launch(launch: Mapping[str, Any] | None) -> dict[str, Any]:
  """Launch arguments that are set (None: not given, the same as absent)."""
  return {k: v for k, v in (launch or {}).items() if v is not None}


def _stored_fields(record: Mapping[str, Any]) -> dict[str, Any]:
  return {**flatten(record["config"]),
          **{f"--{k}": v for k, v in record.get("launch", {}).items()}}


# ------------------------------------------------------------------------------ the check

def read(workdir: str) -> dict[str, Any] | None:
  """The workdir's run_config.json, or None."""
  path = os.path.join(workdir, FILE)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def check_workdir(workdir: str, cfg: Any, *, launch: Mapping[str, Any] | None = None,
                  scope: Sequence[str] | None = None, allow_change: bool = False
                  ) -> dict[str, Any]:
  """Records (first launch) or checks (later ones) the run's fingerprint; returns the record.

  launch: launcher arguments that change results (e.g. `sft_checkpoint`), compared like
  config fields. scope: the top-level sections this launcher depends on (None: all).
  Raises ConfigMismatchError naming every differing field (`path: old -> new`) unless
  allow_change; exempt fields may differ and are recorded in `changes`.
  """
  os.makedirs(workdir, exist_ok=True)
  new = _fields(cfg, launch)
  with locked(os.path.join(workdir, LOCK)):
    record = read(workdir)
    if record is None:
      if any(n not in (FILE, LOCK) for n in os.listdir(workdir)):
        log.warning("%s has results but no %s (written before fingerprints): recording this "
                    "launch's config unchecked", workdir, FILE)
      record = {"version": VERSION, "created": _now(), "changes": []}
      return _store(workdir, record, cfg, launch, scope, new)
    old = _stored_fields(record)
    changed = diff(fingerprinted(old, scope), fingerprinted(new, scope))
    exempt = {k: v for k, v in diff(old, new).items()
              if _under(k, EXEMPT) and (scope is None or _under(k, scope))}
    if changed and not allow_change:
      raise ConfigMismatchError(
          f"{workdir} holds a run of another config ("
          f"{'1 field differs' if len(changed) == 1 else f'{len(changed)} fields differ'}: "
          f"{describe(changed)}); use a new "
          f"--workdir, or --allow_config_change to continue this run under the new config")
    if not changed and not exempt:
      return record
    if changed:
      log.warning("%s: continuing under a changed config (--allow_config_change): %s", workdir,
                  describe(changed))
    else:
      log.info("%s: exempt fields changed: %s", workdir, describe(exempt))
    record["changes"] = [*record.get("changes", []), {
        "time": _now(), "allowed": bool(changed),
        "fields": {k: list(v) for k, v in {**changed, **exempt}.items()}}]
    return _store(workdir, record, cfg, launch, scope, new)


def _store(workdir: str, record: dict[str, Any], cfg: Any, launch: Mapping[str, Any] | None,
           scope: Sequence[str] | None, new: Mapping[str, Any]) -> dict[str, Any]:
  """Writes the record with the launch's config (only its `scope` sections replace the old)."""
  full = config_dict(cfg)
  if scope is not None and "config" in record:
    full = {**{k: v for k, v in record["config"].items() if not _under(k, scope)},
            **{k: v for k, v in full.items() if _under(k, scope)}}
  record.update(config=full,
                launch=_launch(launch) if scope is None else record.get("launch", {}))
  record["fingerprint"] = fingerprint(fingerprinted(_stored_fields(record)))
  write_json(os.path.join(workdir, FILE), record)
  return record


def write_json(path: str, obj: Any) -> None:
  """Written whole or not at all (tmp file, fsync, rename): readers never see half a file."""
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=1)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


@contextlib.contextmanager
def locked(path: str) -> Iterator[None]:
  """An exclusive lock on `path` (created if absent) for the block: one process at a time."""
  with open(path, "a") as f:
    fcntl.flock(f.fileno(), fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _now() -> str:
  return time.strftime("%Y-%m-%dT%H:%M:%S%z")


@contextlib.contextmanager
def holding(path: str, what: str) -> Iterator[None]:
  """`trace_jax.io.locks.hold` for a launch: another live holder is a WorkdirInUseError
  (one line, exit status 2) naming it."""
  from trace_jax.io import locks
  with contextlib.ExitStack() as stack:
    try:
      stack.enter_context(locks.hold(path, what))
    except locks.LockHeldError as e:
      raise WorkdirInUseError(str(e)) from None
    yield


# ------------------------------------------------------------------------------ launchers

@contextlib.contextmanager
def user_input() -> Iterator[None]:
  """ValueError and OSError raised in the block (config checks, paths) become UserError."""
  try:
    yield
  except UserError:
    raise
  except (ValueError, OSError) as e:
    raise UserError(str(e)) from e


def fail(message: Any, status: int = 2) -> NoReturn:
  """Prints `error: <message>` (one line) to stderr and exits with `status`."""
  text = " ".join(str(message).split()) or type(message).__name__
  print(f"error: {text}", file=sys.stderr, flush=True)
  sys.exit(status)


@contextlib.contextmanager
def exit_on_errors(log_dir: str | None = None) -> Iterator[None]:
  """A launcher's main body, ending every error in one line, `error: <cause>; <what to do>`.

  UserError (config, flags, workdir) exits 2. RunError (a fault the run cannot get past) and
  every other exception (disk full, permission denied, a bug) exit 1; their traceback (and a
  RunError's `details`) go to a log file the line names: `<log_dir>/error.log` (appended), or
  the temp directory when that cannot be written (a full disk).
  """
  quiet_closed_loop_callbacks()
  with _orbax_errors_aside() as aside:
    try:
      yield
    except UserError as e:
      fail(e, 2)
    except (KeyboardInterrupt, SystemExit):
      raise
    except BaseException as e:  # noqa: BLE001 - every fault ends as one line, traceback logged
      held = "".join(logging.Formatter().format(r) + "\n" for r in aside.held)
      where = write_error_log(e, log_dir, held)
      fail(f"{describe_fault(e)} ({where})", 1)


_HOOK_LOCK = threading.Lock()


def quiet_closed_loop_callbacks() -> None:
  """Drops the "Event loop is closed" errors that a failed orbax restore leaves behind.

  orbax runs a restore in its own asyncio loop and closes it when a read fails; TensorStore
  reads still in flight then complete on their threads and call `call_soon_threadsafe` on the
  closed loop, which Python reports as "Exception ignored" tracebacks after the fallback has
  succeeded or the launcher has reported the fault. Installed once (by the launchers, and by
  a restore that falls back); every other unraisable error reaches the previous hook
  unchanged.
  """
  with _HOOK_LOCK:
    previous = sys.unraisablehook
    if getattr(previous, "_drops_closed_loop_callbacks", False):
      return

    def hook(info: Any) -> None:
      tb = info.exc_traceback
      while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
      if (isinstance(info.exc_value, RuntimeError) and str(info.exc_value) ==
          "Event loop is closed" and tb is not None and
          tb.tb_frame.f_code.co_name == "_check_closed"):
        return
      previous(info)

    hook._drops_closed_loop_callbacks = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


class _OrbaxErrorsAside(logging.Filter):
  """Keeps orbax's own error reports off the console: each comes with a traceback of the
  failure the launcher reports in one line (tens of them for one full disk); they are kept
  for the error log."""

  def __init__(self) -> None:
    super().__init__()
    self.held: list[logging.LogRecord] = []

  def filter(self, record: logging.LogRecord) -> bool:
    if record.levelno >= logging.ERROR and "/orbax/" in record.pathname.replace(os.sep, "/"):
      self.held.append(record)
      return False
    return True


@contextlib.contextmanager
def _orbax_errors_aside() -> Iterator[_OrbaxErrorsAside]:
  aside = _OrbaxErrorsAside()
  handlers = list(logging.getLogger().handlers)
  for h in handlers:
    h.addFilter(aside)
  try:
    yield aside
  finally:
    for h in handlers:
      h.removeFilter(aside)


MAX_ERROR_CHARS = 400  # one line a person reads; the rest goes to the log


def describe_fault(e: BaseException) -> str:
  """The cause of a fault in a few words, with what to do, from the exception and its chain:
  no space left, permission denied or a read-only file system (by errno or by the message
  that TensorStore and orbax wrap them in), a RunError's own message, or the exception."""
  for x in _chain(e):
    text = " ".join(str(x).split())
    code = getattr(x, "errno", None)
    path = getattr(x, "filename", None) or next(iter(re.findall(r'file "([^"]+)"', text)), None)
    where = f" writing {path}" if path else ""
    if code in (errno.ENOSPC, errno.EDQUOT) or re.search(
        r"No space left on device|Disk quota exceeded|ENOSPC", text):
      return (f"no space left on the device{where} ({type(x).__name__}); free space there or "
              "use another --workdir, then launch again: the run resumes from its last "
              "checkpoint")
    if code in (errno.EACCES, errno.EPERM, errno.EROFS) or re.search(
        r"Permission denied|Read-only file system", text):
      return (f"permission denied{where} ({_short(text)}); make that path writable or use "
              "another --workdir")
    if code == errno.EADDRINUSE:
      return f"address already in use ({_short(text)}); pick another --port or stop its holder"
  if isinstance(e, RunError):
    return _short(" ".join(str(e).split()))
  return _short(f"{type(e).__name__}: {' '.join(str(e).split())}")


def _chain(e: BaseException) -> Iterator[BaseException]:
  seen: set[int] = set()
  x: BaseException | None = e
  while x is not None and id(x) not in seen:
    seen.add(id(x))
    yield x
    x = x.__cause__ or x.__context__


def _short(text: str, limit: int = MAX_ERROR_CHARS) -> str:
  return text if len(text) <= limit else f"{text[:limit - 3]}..."


def write_error_log(e: BaseException, log_dir: str | None, extra: str = "") -> str:
  """Appends the exception's traceback (its `details`, when it has them, and `extra`) to
  `<log_dir>/error.log`, falling back to a file in the temp directory; returns "traceback in
  <path>", or why it could not be saved."""
  import tempfile
  import traceback
  text = "".join([f"==== {_now()} pid {os.getpid()}: {' '.join(sys.argv)}\n",
                  *traceback.format_exception(e),
                  *([f"details:\n{e.details}\n"] if getattr(e, "details", None) else []),
                  *([f"orbax reported:\n{extra}"] if extra else [])])
  tried = []
  for d in ([log_dir] if log_dir else []) + [tempfile.gettempdir()]:
    path = os.path.join(d, "error.log" if d == log_dir else f"trace_jax-error-{os.getpid()}.log")
    try:
      os.makedirs(d, exist_ok=True)
      with open(path, "a") as f:
        f.write(text)
      return f"traceback in {path}"
    except OSError as err:
      tried.append(f"{path}: {err.strerror}")
  return f"traceback not saved: {'; '.join(tried)}"


def flags_parser(config_flag: Any = None) -> Callable[[list[str]], list[str]]:
  """An `app.run(flags_parser=...)` that reports flag and config-file errors in one line.

  config_flag: the launcher's ml_collections config flag, if it has one.

  absl exits 1 with its own text on a bad flag value; ml_collections raises AttributeError from
  the flag parser on an unknown `--config.x` override and defers a missing config file's
  IOError to the config's first use. All of these exit 2 with `error: <message>` here.
  """
  from absl import flags

  def parse(argv: list[str]) -> list[str]:
    try:
      rest = flags.FLAGS(argv)
    except flags.Error as e:
      fail(e)
    except (AttributeError, KeyError) as e:
      if config_flag is None:
        raise
      fail(_override_message(e, argv, config_flag.name))
    except OSError as e:
      if config_flag is None:
        raise
      fail(_config_file_message(e, argv, config_flag.name))
    if config_flag is not None:
      try:
        config_flag.value.keys()  # a config file that failed to load raises here
      except OSError as e:
        fail(_config_file_message(e, argv, config_flag.name))
    return rest

  return parse


def _override_message(e: BaseException, argv: Sequence[str], name: str) -> str:
  """Names the `--config.x=v` override whose field does not exist (ml_collections' KeyError
  text holds the missing key and a did-you-mean hint)."""
  inner: Any = e
  while isinstance(inner, BaseException) and inner.args:  # AttributeError(KeyError(message))
    inner = inner.args[0]
  text = str(inner)
  m = re.search(r"'([^'\s]+)'", text)
  hint = re.search(r"Did you mean.*\?", text)
  key = m.group(1) if m else None
  for a in argv:
    if a.startswith(f"--{name}."):
      path = a[len(name) + 3:].split("=", 1)[0]
      if key is None or key in path.split("."):
        return (f"--{name}.{path}: no such config field `{path}`" +
                (f" ({hint.group(0)})" if hint else ""))
  return f"--{name}: {text}"


def _config_file_message(e: BaseException, argv: Sequence[str], name: str) -> str:
  """`--config=<path>: <the loader's last line>` (e.g. no such file)."""
  path = next((a.split("=", 1)[1] for a in argv if a.startswith(f"--{name}=")), None)
  lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
  reason = lines[-1] if lines else type(e).__name__
  return f"--{name}={path}: cannot load the config file: {reason}" if path else (
      f"--{name}: {reason}")
