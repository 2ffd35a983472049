"""Request batching for the rollout HTTP server.

HTTP handler threads `submit` jobs (one job = the prompts of one `/generate` request); one
batcher thread collects the prompts that arrive within a short window (or until `max_batch`
are queued), calls `engine.generate` once for all of them and hands each job its samples.
Batching is what makes a server of many small concurrent requests efficient: the engine runs
one jitted program for the whole batch instead of one per request.

Per-request seeds keep a request's tokens independent of what else shares its batch, up to the
engine's batch invariance (row results may differ in the last bits between batch shapes).
`pad_to` pads every engine call to a fixed number of rows, so a server (or a test suite) only
ever compiles one batch shape.

A job can be waited on from a thread (`Job.wait`) or from an event loop (`Job.add_done_callback`
runs a callback on the batcher thread when it finishes: the HTTP server turns it into a future,
so a waiting request holds no thread). `Batcher.cancel` drops a job's still-queued prompts
when its client has gone.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from trace_jax.rollout.protocol import Sample, SamplingParams

log = logging.getLogger(__name__)

# Rows added to reach `pad_to`: one prompt token, one greedy new token (cheap, deterministic).
PAD_PROMPT: tuple[int, ...] = (0,)
PAD_SAMPLING = SamplingParams(max_new_tokens=1, temperature=0.0, seed=0)


class BatcherClosed(RuntimeError):
  """The batcher stopped before the job ran (server shutting down)."""


class JobCancelled(RuntimeError):
  """The job was cancelled (its client went away) before all its prompts ran."""


def pad_batch(prompts: Sequence[Sequence[int]], sampling: Sequence[SamplingParams],
              size: int | None) -> tuple[list[list[int]], list[SamplingParams]]:
  """Pads a batch with dummy one-token requests up to `size` rows (None: no padding).

  Tests use it too, to run reference generations with exactly the server's batch shape.
  """
  prompts = [list(p) for p in prompts]
  sampling = list(sampling)
  if size is not None and len(prompts) < size:
    extra = size - len(prompts)
    prompts += [list(PAD_PROMPT) for _ in range(extra)]
    sampling += [PAD_SAMPLING] * extra
  return prompts, sampling


@dataclasses.dataclass(eq=False)
class Job:
  """The prompts of one request and, once `done` is set, their samples or an error."""
  prompts: list[list[int]]
  sampling: list[SamplingParams]
  submitted: float = dataclasses.field(default_factory=time.monotonic)
  results: list[Sample | None] = dataclasses.field(default_factory=list)
  error: BaseException | None = None
  done: threading.Event = dataclasses.field(default_factory=threading.Event)
  remaining: int = 0
  _callbacks: list[Callable[[Job], None]] = dataclasses.field(
      default_factory=list, init=False, repr=False)
  _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, init=False,
                                            repr=False)

  def __post_init__(self):
    self.results = [None] * len(self.prompts)
    self.remaining = len(self.prompts)

  def add_done_callback(self, fn: Callable[[Job], None]) -> None:
    """Calls fn(job) once the job is done: now if it is, else on the thread that finishes it."""
    with self._lock:
      if not self.done.is_set():
        self._callbacks.append(fn)
        return
    fn(self)

  def _finish(self, error: BaseException | None = None) -> None:
    """Marks the job done (with `error`, unless already done) and runs its callbacks."""
    with self._lock:
      if self.done.is_set():
        return
      if error is not None:
        self.error = error
      self.done.set()
      callbacks, self._callbacks = self._callbacks, []
    for fn in callbacks:
      try:
        fn(self)
      except Exception:
        log.exception("job done-callback failed")

  def wait(self, timeout: float | None = None) -> list[Sample]:
    """The job's samples in prompt order; raises the engine's error, or TimeoutError."""
    if not self.done.wait(timeout):
      raise TimeoutError(f"generation did not finish within {timeout} s")
    if self.error is not None:
      raise self.error
    return list(self.results)  # type: ignore[arg-type]


class Batcher:
  """Collects concurrent jobs into engine batches on one background thread.

  engine: anything with `generate(prompts, sampling) -> list[Sample]`.
  max_batch: most prompts per engine call (a larger job is split over several calls).
  window_s: how long to wait for more prompts after the first one is queued.
  pad_to: pad every engine call to this many rows (>= max_batch), or None.
  """

  def __init__(self, engine: Any, *, max_batch: int = 32, window_s: float = 0.01,
               pad_to: int | None = None):
    if max_batch < 1:
      raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    if window_s < 0:
      raise ValueError(f"window_s must be >= 0, got {window_s}")
    if pad_to is not None and pad_to < max_batch:
      raise ValueError(f"pad_to ({pad_to}) must be >= max_batch ({max_batch})")
    self.engine = engine
    self.max_batch = max_batch
    self.window_s = window_s
    self.pad_to = pad_to
    self._items: collections.deque[tuple[Job, int]] = collections.deque()
    self._cv = threading.Condition()
    self._stopping = False
    self._thread: threading.Thread | None = None
    self._stats_lock = threading.Lock()
    self._stats: dict[str, Any] = {
        "jobs": 0, "prompts": 0, "engine_calls": 0, "engine_rows": 0, "padded_rows": 0,
        "engine_seconds": 0.0, "failed_calls": 0, "max_batch_seen": 0, "cancelled_prompts": 0,
        "batch_sizes": collections.Counter(), "last_batch": None}

  # ------------------------------------------------------------------------------ lifecycle

  def start(self) -> Batcher:
    if self._thread is None:
      self._thread = threading.Thread(target=self._loop, name="rollout-batcher", daemon=True)
      self._thread.start()
    return self

  def stop(self, timeout: float | None = 30.0) -> None:
    """Stops taking jobs, lets the running batch finish, fails every queued job."""
    with self._cv:
      self._stopping = True
      pending = list(self._items)
      self._items.clear()
      self._cv.notify_all()
    for job, _ in pending:
      self._fail(job, BatcherClosed("the rollout server is shutting down"))
    if self._thread is not None:
      self._thread.join(timeout)

  # ------------------------------------------------------------------------------ jobs

  def submit(self, prompts: Sequence[Sequence[int]],
             sampling: Sequence[SamplingParams]) -> Job:
    """Queues one request's prompts; returns at once (call `job.wait()`)."""
    if len(prompts) != len(sampling):
      raise ValueError(f"{len(prompts)} prompts but {len(sampling)} sampling params")
    job = Job([list(p) for p in prompts], list(sampling))
    if not job.prompts:
      job._finish()
      return job
    with self._cv:
      if self._stopping:
        raise BatcherClosed("the rollout server is shutting down")
      self._items.extend((job, i) for i in range(len(job.prompts)))
      self._cv.notify_all()
    with self._stats_lock:
      self._stats["jobs"] += 1
      self._stats["prompts"] += len(job.prompts)
    return job

  def cancel(self, job: Job) -> int:
    """Drops the job's prompts that are still queued and fails it; returns how many.

    Prompts already in a running engine call finish (their results are discarded).
    """
    with self._cv:
      before = len(self._items)
      self._items = collections.deque(it for it in self._items if it[0] is not job)
      dropped = before - len(self._items)
    if dropped:
      with self._stats_lock:
        self._stats["cancelled_prompts"] += dropped
    job._finish(JobCancelled(f"cancelled with {dropped} prompts still queued"))
    return dropped

  def generate(self, prompts: Sequence[Sequence[int]], sampling: Sequence[SamplingParams],
               timeout: float | None = None) -> list[Sample]:
    """Blocking `submit` + `wait`."""
    return self.submit(prompts, sampling).wait(timeout)

  def stats(self) -> dict[str, Any]:
    """Counters since start (a JSON-able copy)."""
    with self._stats_lock:
      out = dict(self._stats)
      out["batch_sizes"] = {str(k): v for k, v in sorted(self._stats["batch_sizes"].items())}
    with self._cv:
      out["queued_prompts"] = len(self._items)
    out.update(max_batch=self.max_batch, window_ms=self.window_s * 1e3, pad_to=self.pad_to)
    return out

  # ------------------------------------------------------------------------------ thread

  def _take(self) -> list[tuple[Job, int]] | None:
    """Waits for the first prompt, then up to window_s for more; None once stopping."""
    with self._cv:
      while not self._items and not self._stopping:
        self._cv.wait()
      if self._stopping:
        return None
      deadline = time.monotonic() + self.window_s
      while len(self._items) < self.max_batch and not self._stopping:
        left = deadline - time.monotonic()
        if left <= 0:
          break
        self._cv.wait(left)
      n = min(self.max_batch, len(self._items))
      return [self._items.popleft() for _ in range(n)]

  def _loop(self) -> None:
    while True:
      items = self._take()
      if items is None:
        return
      try:
        self._run(items)
      except BaseException as e:  # never let the thread die with jobs waiting on it
        log.exception("batcher: unexpected error")
        for job, _ in items:
          self._fail(job, e)

  def _run(self, items: list[tuple[Job, int]]) -> None:
    try:
      samples = self._call(items)
    except Exception as e:
      jobs = list(dict.fromkeys(job for job, _ in items))
      if len(jobs) == 1:
        self._fail(jobs[0], e)
        return
      # Several requests shared the failed call: rerun each alone, so one bad request
      # cannot fail the others.
      log.warning("batch of %d requests failed (%s: %s); retrying them one by one",
                  len(jobs), type(e).__name__, e)
      for job in jobs:
        mine = [it for it in items if it[0] is job]
        try:
          self._deliver(mine, self._call(mine))
        except Exception as e2:
          self._fail(job, e2)
      return
    self._deliver(items, samples)

  def _call(self, items: list[tuple[Job, int]]) -> list[Sample]:
    prompts = [job.prompts[i] for job, i in items]
    sampling = [job.sampling[i] for job, i in items]
    prompts, sampling = pad_batch(prompts, sampling, self.pad_to)
    t0 = time.perf_counter()
    ok = False
    try:
      samples = self.engine.generate(prompts, sampling)
      ok = True
    finally:
      dt = time.perf_counter() - t0
      with self._stats_lock:
        st = self._stats
        st["engine_calls"] += 1
        st["engine_seconds"] += dt
        st["failed_calls"] += 0 if ok else 1
        if ok:
          st["engine_rows"] += len(prompts)
          st["padded_rows"] += len(prompts) - len(items)
          st["batch_sizes"][len(items)] += 1
          st["max_batch_seen"] = max(st["max_batch_seen"], len(items))
    if len(samples) != len(prompts):
      raise RuntimeError(f"engine returned {len(samples)} samples for {len(prompts)} prompts")
    samples = samples[:len(items)]
    with self._stats_lock:
      g = samples[0].guidance
      self._stats["last_batch"] = {
          "prompts": len(items), "rows": len(prompts),
          "requests": len({id(job) for job, _ in items}), "seconds": dt,
          "generated_tokens": sum(len(s.tokens) for s in samples),
          "guidance_batch_id": g and g.batch_id, "guidance_store": g and g.store,
          "guidance_bytes_per_token": g and g.guidance_bytes_per_token}
    return samples

  def _deliver(self, items: list[tuple[Job, int]], samples: list[Sample]) -> None:
    for (job, i), s in zip(items, samples):
      if job.done.is_set():
        continue
      job.results[i] = s
      job.remaining -= 1
      if job.remaining == 0:
        job._finish()

  @staticmethod
  def _fail(job: Job, err: BaseException) -> None:
    job._finish(err)
