"""Run checkpoints: orbax save and restore, falling back past unreadable steps.

A run keeps its newest `keep` checkpoints (train state plus the JSON history). Each records,
when it commits, a digest of every array it holds (`trace_jax.io.integrity`). On resume,
`restore_latest` restores the newest step that reads back whole, with the run's shapes, the
recorded digests and finite values; the steps that fail (torn, garbled or non-finite) are
logged, moved to `<run>/ckpt_corrupt/` and counted (`checkpoint_fallbacks`), so the run saves
those steps afresh and a user can inspect them.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from trace_jax.io import integrity
from trace_jax.train import run_guard

log = logging.getLogger(__name__)


def checkpointer(path: str, keep: int) -> ocp.CheckpointManager:
  """An orbax manager of a run's checkpoints under `path` (created), keeping the newest `keep`."""
  return ocp.CheckpointManager(
      os.path.abspath(path),
      options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))


# Checkpoint steps that did not restore are moved here (under the run's workdir); their number
# is the run's `checkpoint_fallbacks` (history.json summary).
CORRUPT_DIR = "ckpt_corrupt"


class CheckpointRestoreError(run_guard.RunError):
  """No checkpoint step of a run restores. Its message is one short line (the newest step's
  error); `details` lists every step and its error (the launcher writes it to its log)."""

  def __init__(self, message: str, details: str = ""):
    super().__init__(message)
    self.details = details


def restore_latest(ckpt: ocp.CheckpointManager, state: Any, corrupt_dir: str
                   ) -> tuple[int, Any, dict[str, Any]] | None:
  """(step, state, meta) of the newest checkpoint that restores; None without checkpoints.

  A step that fails to restore (truncated or garbled files: orbax's error, or content that
  differs from the digests recorded at save; non-finite values) is logged with its error, and
  the next older one is tried; once one restores, the failed newer steps move to `corrupt_dir`.
  Raises CheckpointRestoreError, moving nothing, when none restores (a damaged run, or a
  config whose shapes differ from the checkpoints').
  """
  failed: list[tuple[int, str]] = []
  for step in sorted(ckpt.all_steps(), reverse=True):
    try:
      restored = ckpt.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(state), meta=ocp.args.JsonRestore()))
      _same_shapes(state, restored.state)
      _verify(restored.state, restored.meta, step)
    except Exception as e:  # noqa: BLE001 - whatever broke in this step, an older one may do
      run_guard.quiet_closed_loop_callbacks()
      why = _one_line(e)
      log.warning("checkpoint step %d in %s does not restore (%s); trying an older step", step,
                  ckpt.directory, why)
      failed.append((step, why))
      continue
    if failed:
      os.makedirs(corrupt_dir, exist_ok=True)
      for bad, _ in failed:
        dest = os.path.join(corrupt_dir, f"{bad}-{time.strftime('%Y%m%d-%H%M%S')}")
        shutil.move(os.path.join(str(ckpt.directory), str(bad)), dest)
        log.warning("moved the unreadable checkpoint step %d to %s; resuming from step %d",
                    bad, dest, step)
      ckpt.reload()
    return int(step), restored.state, restored.meta
  if failed:
    newest, why = failed[0]
    raise CheckpointRestoreError(
        f"no checkpoint in {ckpt.directory} restores (steps {', '.join(str(s) for s, _ in failed)}"
        f"; step {newest}: {_one_line_text(why, 120)}); a config of other shapes fails so: use "
        "a new workdir; else move the ckpt directory aside to start over",
        details="\n".join(f"step {s}: {why}" for s, why in failed))
  return None


class NonFiniteStateError(run_guard.RunError):
  """A training state holds NaN or Inf: the run stops before it is checkpointed."""


def check_state(state: Any, nonfinite: Any, where: str) -> None:
  """The finite-values guard after an update: raises NonFiniteStateError naming `where` (e.g.
  "rl step 5") and the first leaf of `state` that holds NaN or Inf, from the step's
  `nonfinite` flags (`trace_jax.io.integrity.nonfinite_flags` of the new state)."""
  bad = integrity.first_nonfinite(state, nonfinite)
  if bad is not None:
    raise NonFiniteStateError(
        f"{where}: the update left non-finite values (NaN or Inf) in {bad}; the run stops "
        "before checkpointing them (it resumes from its last checkpoint: lower the learning "
        "rate or check the data)")


def _same_shapes(want: Any, got: Any) -> None:
  """Raises ValueError unless the restored tree has the template's structure and shapes
  (orbax restores the stored shapes whatever the template's)."""
  bad = [jax.tree_util.keystr(k) for (k, a), b in zip(jax.tree_util.tree_leaves_with_path(want),
                                                      jax.tree.leaves(got))
         if np.shape(a) != np.shape(b)]
  if jax.tree.structure(want) != jax.tree.structure(got) or bad:
    raise ValueError(f"stored shapes differ from the config's at {bad[:3] or 'the structure'}")


def _verify(state: Any, meta: dict[str, Any], step: int) -> None:
  """Raises IntegrityError unless the restored state has its recorded digests (checkpoints
  saved before digests were recorded are only checked for finite values) and finite values."""
  if meta.get("digest_version") == integrity.DIGEST_VERSION:
    integrity.verify_digests(state, meta["digests"])
  else:
    log.warning("checkpoint step %d records no digest (%s): its content is not verified", step,
                meta.get("digest_version", "saved before digests"))
  integrity.check_finite(state, f"checkpoint step {step}")


def checkpoint_fallbacks(workdir: str) -> int:
  """How many checkpoint steps of the run at `workdir` failed to restore (moved aside)."""
  path = os.path.join(workdir, CORRUPT_DIR)
  return len(os.listdir(path)) if os.path.isdir(path) else 0


def _one_line(e: BaseException, limit: int = 300) -> str:
  return _one_line_text(f"{type(e).__name__}: {e}", limit)


def _one_line_text(text: str, limit: int) -> str:
  text = " ".join(text.split())
  return text if len(text) <= limit else f"{text[:limit]}..."


def save(ckpt: ocp.CheckpointManager, step: int, state: Any, meta: dict[str, Any]) -> None:
  """Saves `state` and the JSON-able `meta` (plus the state's digests) as checkpoint `step`
  and waits for it."""
  meta = {**meta, "digest_version": integrity.DIGEST_VERSION,
          "digests": integrity.tree_digests(state)}
  ckpt.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                          meta=ocp.args.JsonSave(meta)))
  ckpt.wait_until_finished()
