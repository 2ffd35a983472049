"""Small helpers shared by the experiment launchers (flags, timing, logging, JSON, devices).

Imports only the standard library, numpy and absl at module level, so the GPU check can use it
on a machine without the package's optional dependencies (e.g. no ml_collections).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TextIO

import numpy as np
from absl import flags


def parse_flags(fv: flags.FlagValues, argv: Sequence[str]) -> bool:
  """Parses argv (argv[0] is the program) into a script's own FlagValues.

  Each launcher keeps its flags in a private `FlagValues` (not absl's global FLAGS), so that
  several launchers can be imported and run in one process (tests, the GPU check) without
  duplicate-flag errors and without one run's flags leaking into the next. Returns False when
  help was asked for (it is printed), True otherwise.
  """
  argv = list(argv) if argv else ["prog"]
  if any(a in ("-h", "--help", "--helpfull", "-?") for a in argv[1:]):
    print(fv.get_help())
    return False
  fv.unparse_flags()
  fv(argv)
  return True


def flag_dict(fv: flags.FlagValues) -> dict[str, Any]:
  """The parsed values of the flags defined in fv (for the JSON record of a run)."""
  return {name: fv[name].value for name in sorted(fv) if not name.startswith("?")}


def set_gpu_memory_env() -> None:
  """Lets JAX and torch share one GPU: no 75% preallocation by XLA (unless the user set it).

  Must run before JAX creates its backend (the first device query or array).
  """
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def device_description() -> dict[str, Any]:
  """JAX backend, device kind and count, and library versions."""
  import jax

  devs = jax.devices()
  return {
      "backend": jax.default_backend(),
      "device_kind": devs[0].device_kind if devs else "none",
      "device_count": len(devs),
      "devices": [str(d) for d in devs],
      "jax": jax.__version__,
  }


def bits(a: np.ndarray) -> np.ndarray:
  """The bit patterns of an array as unsigned integers of its width (exact comparison: -0 !=
  +0, NaN payloads compared)."""
  if a.dtype == np.bool_:
    return a.astype(np.uint8)
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def device_memory(devices: Sequence[Any]) -> dict[str, float] | None:
  """The largest `bytes_in_use` and `peak_bytes_in_use` (GB) over `devices` (their allocator's
  counters: the peak is since the process started), or None where the backend keeps none (CPU).
  """
  stats = [d.memory_stats() for d in devices]
  if not stats or any(s is None for s in stats):
    return None
  return {f"{k}_gb_max": max(s.get(k, 0) for s in stats) / 1e9
          for k in ("bytes_in_use", "peak_bytes_in_use")}


def median_seconds(fn: Callable[[], Any], sync: Callable[[Any], Any], warmup: int,
                   reps: int, calls: int = 1) -> tuple[float, float]:
  """Median and minimum wall time of one fn() call over reps samples after warmup calls.

  `sync(out)` must block until the device work behind out is done (`jax.block_until_ready`,
  or a `torch.cuda.synchronize` wrapper), so that asynchronous dispatch is timed fully.
  calls: fn() calls per sample, dispatched back to back and synced once (a sample's time over
  calls): for ops not much longer than a sync's round trip, which a sample of one call adds.
  """
  for _ in range(warmup):
    out = fn()
    sync(out)
    del out
  times = []
  for _ in range(max(reps, 1)):
    t0 = time.perf_counter()
    for _ in range(max(calls, 1)):
      out = fn()
    sync(out)
    times.append((time.perf_counter() - t0) / max(calls, 1))
    del out
  return statistics.median(times), min(times)


def bandwidth_gbps(mib: int | None = None, reps: int = 10) -> dict[str, float]:
  """The memory-bandwidth references of this device, measured now: a jitted copy (bytes read +
  written) and a read-only float32 sum of a BF16 array of `mib` MiB (default 4096 on GPU: a
  1 GiB copy read low on the H200, 64 elsewhere)."""
  import jax
  import jax.numpy as jnp

  mib = mib or (4096 if jax.default_backend() == "gpu" else 64)
  a = jnp.zeros((mib * 2**19,), jnp.bfloat16)
  nbytes = a.size * 2
  copy = jax.jit(jnp.copy)
  read = jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32))
  t_copy, _ = median_seconds(lambda: copy(a), jax.block_until_ready, 2, reps)
  t_read, _ = median_seconds(lambda: read(a), jax.block_until_ready, 2, reps)
  return {"copy_gbps": 2 * nbytes / t_copy / 1e9, "read_gbps": nbytes / t_read / 1e9,
          "mib": mib}


def matmul_tflops(n: int | None = None, reps: int = 10) -> dict[str, float]:
  """The dense BF16 matmul rate of this device, measured now: an n x n x n `jnp.dot` with
  float32 accumulation (default n 8192 on GPU, 512 elsewhere)."""
  import jax
  import jax.numpy as jnp

  n = n or (8192 if jax.default_backend() == "gpu" else 512)
  a = jnp.ones((n, n), jnp.bfloat16)
  dot = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32
                                     ).astype(jnp.bfloat16))
  t, _ = median_seconds(lambda: dot(a, a), jax.block_until_ready, 2, reps)
  return {"bf16_tflops": 2 * n**3 / t / 1e12, "n": n}


def fp8_matmul_tflops(n: int, reps: int = 10) -> float:
  """The dense FP8 (e4m3) matmul rate of this device, measured now as `matmul_tflops` measures
  BF16's: n x n x n with float32 accumulation, both operands contraction-last (the layout of
  cuBLASLt's FP8 GEMM on Hopper, so no transpose is timed)."""
  import jax
  import jax.numpy as jnp

  a = jnp.ones((n, n), jnp.float8_e4m3fn)
  dot = jax.jit(lambda x, y: jax.lax.dot_general(x, y, (((1,), (1,)), ((), ())),
                                                 preferred_element_type=jnp.float32
                                                 ).astype(jnp.bfloat16))
  t, _ = median_seconds(lambda: dot(a, a), jax.block_until_ready, 2, reps)
  return 2 * n**3 / t / 1e12


def _to_jsonable(obj: Any) -> Any:
  if isinstance(obj, dict):
    return {str(k): _to_jsonable(v) for k, v in obj.items()}
  if isinstance(obj, list | tuple):
    return [_to_jsonable(v) for v in obj]
  if isinstance(obj, np.ndarray):
    return _to_jsonable(obj.tolist())
  if isinstance(obj, np.generic):
    return obj.item()
  if isinstance(obj, float) and not np.isfinite(obj):
    return None
  return obj


def finish(res: dict[str, Any], fv: flags.FlagValues, text: str | None = None
           ) -> dict[str, Any]:
  """A benchmark's last steps: its flags into `res`, `text` printed, `res` written to
  --json_out (when set, saying where); returns res."""
  res["flags"] = flag_dict(fv)
  if text is not None:
    print(text)
  write_json(fv.json_out, res)
  if fv.json_out:
    print(f"wrote {fv.json_out}")
  return res


def write_json(path: str, obj: Any) -> None:
  """Writes obj as indented JSON (numpy values converted, non-finite floats as null)."""
  if not path:
    return
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(_to_jsonable(obj), f, indent=2, sort_keys=False)
    f.write("\n")


class Tee:
  """A text stream that writes to several streams (the console and a log file)."""

  def __init__(self, *streams: TextIO):
    self.streams = streams

  def write(self, s: str) -> int:
    for st in self.streams:
      st.write(s)
    return len(s)

  def flush(self) -> None:
    for st in self.streams:
      st.flush()

  def isatty(self) -> bool:
    return False

  def close(self) -> None:
    """Leaves the underlying streams open (loggers may hold this stream until exit)."""
    self.flush()


@contextlib.contextmanager
def tee_output(log_path: str) -> Iterator[TextIO]:
  """Copies everything printed to stdout and stderr into log_path while active."""
  os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
  with open(log_path, "w", buffering=1) as log:
    old_out, old_err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = Tee(old_out, log), Tee(old_err, log)
    try:
      yield log
    finally:
      sys.stdout, sys.stderr = old_out, old_err


def format_table(header: Sequence[str], rows: Sequence[Sequence[Any]],
                 align: str | None = None) -> str:
  """Aligned plain-text table; align holds 'l' or 'r' per column (default: first left)."""
  cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
  widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
  align = align or "l" + "r" * (len(header) - 1)

  def line(r: Sequence[str]) -> str:
    return "  ".join(c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(r, widths, align))

  sep = "  ".join("-" * w for w in widths)
  return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])
