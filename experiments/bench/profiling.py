"""Where a program's device time goes: a `jax.profiler` trace, summarized per kernel.

`trace(log_dir)` records; `summarize(log_dir, steps)` reads the newest `.xplane.pb` under it
with `jax.profiler.ProfileData` (no TensorBoard needed) and sums the duration of every device
kernel (GPU: the events on the device plane's stream lines; CPU: the XLA thunks on the host
threads) per HLO op and per category, per step. The busy time is the union of the kernels'
intervals; wall minus busy is the time the device waited for the host (launch gaps, syncs),
which is what a launch-bound program loses; the idle gaps are listed by the kernel that ended
them (a `MemcpyD2H`: a predicate the host waited for; a loop body's first kernel: the host
launching the next iteration).

On the GPU, XLA runs without command buffers (CUDA graphs) while a profile is recorded unless
`--xla_enable_command_buffers_during_profiling=true` is in XLA_FLAGS: a default profile shows
more launch gaps than the plain run has. For a GPU profile the host's events are summed per
step too, by name (the runtime's annotations of what it runs: thunks, command-buffer updates and
launches, copies, syncs, and the CUDA calls CUPTI reports): what the host does while the device
waits.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import Any

import jax

# Kernel categories, first match wins (lower-cased kernel name or HLO op name).
_CATEGORIES = (
    ("pallas", re.compile(r"grouped_matmul|grouped_fprop|grouped_dgrad|fp8_|decode_attention|"
                          r"flash_decode|nvfp4_quantize|nvfp4_kv_append|kv_cache|pallas|wgrad")),
    ("gemm", re.compile(r"gemm|cublas|cutlass|xmma|nvjet|\bdot\b|^dot|wgmma|matmul")),
    ("collective", re.compile(r"all-reduce|all-gather|all-to-all|reduce-scatter|nccl|"
                              r"collective-permute")),
    ("memcpy", re.compile(r"memcpy|memset")),
    ("copy/update", re.compile(r"copy|dynamic-update-slice|dynamic_update_slice|"
                               r"scatter|concatenate|transpose")),
    ("sort/top-k", re.compile(r"sort|topk|top-k|top_k")),
)
# Host-side bookkeeping events on CPU lines, not kernels.
_SKIP = re.compile(r"^ThreadpoolListener|^\$")
_CONTAINER = re.compile(r"^(while|conditional|call)(\.|$)")


def category(name: str) -> str:
  """The category of a kernel or HLO op name (see `_CATEGORIES`); 'fusion/other' else."""
  low = name.lower()
  for cat, pattern in _CATEGORIES:
    if pattern.search(low):
      return cat
  return "fusion/other"


@contextlib.contextmanager
def trace(log_dir: str) -> Iterator[None]:
  """Records a profile of the block into log_dir (call `summarize(log_dir)` after it)."""
  os.makedirs(log_dir, exist_ok=True)
  with jax.profiler.trace(log_dir):
    yield


def _newest_xspace(log_dir: str) -> str:
  paths = glob.glob(os.path.join(log_dir, "**", "*.xplane.pb"), recursive=True)
  if not paths:
    raise FileNotFoundError(f"no .xplane.pb under {log_dir}: was it recorded with `trace`?")
  return max(paths, key=os.path.getmtime)


def _kernel_events(planes: Sequence[Any]) -> list[tuple[str, str, float, float]]:
  """(kernel name, op, start ns, duration ns) of every device kernel in the profile; op is the
  kernel name on the GPU and the thunk's HLO op on the CPU."""
  out = []
  planes = list(planes)  # ProfileData.planes is an iterator
  devices = [p for p in planes if p.name.startswith("/device:")]
  if devices:  # GPU: kernels sit on the stream lines (the others, e.g. "XLA Ops", aggregate)
    for plane in devices:
      lines = [ln for ln in plane.lines if ln.name.startswith("Stream")]
      if not lines:
        raise ValueError(f"profile plane {plane.name} has no 'Stream' lines: "
                         f"{[ln.name for ln in plane.lines]}")
      for line in lines:
        for ev in line.events:
          # Keyed by the kernel's name: XLA's command buffers (CUDA graphs) give every
          # kernel they launch the buffer's hlo_op.
          out.append((ev.name, ev.name, ev.start_ns, ev.duration_ns))
    return out
  for plane in planes:  # CPU: XLA thunks carry an hlo_op stat on the host threads
    if plane.name != "/host:CPU":
      continue
    for line in plane.lines:
      for ev in line.events:
        if _SKIP.match(ev.name) or ev.duration_ns <= 0:
          continue
        stats = dict(ev.stats)
        # while/conditional/call thunks contain the thunks they run: count those only
        if "hlo_op" in stats and not _CONTAINER.match(str(stats["hlo_op"])):
          out.append((ev.name, str(stats["hlo_op"]), ev.start_ns, ev.duration_ns))
  return out


def _host_events(planes: Sequence[Any]) -> dict[str, list[float]]:
  """{name: [count, host ns]} of the events on the host planes of a GPU profile (Python frames
  and thread-pool bookkeeping left out); empty for a CPU profile, whose host events are the
  kernels."""
  planes = list(planes)
  out: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
  if not any(p.name.startswith("/device:") for p in planes):
    return out
  for plane in planes:
    if plane.name.startswith("/device:"):
      continue
    for line in plane.lines:
      for ev in line.events:
        if not _SKIP.match(ev.name):
          out[ev.name][0] += 1
          out[ev.name][1] += ev.duration_ns
  return out


def _union_ns(intervals: list[tuple[float, float]]) -> float:
  total, end = 0.0, float("-inf")
  for start, stop in sorted(intervals):
    if stop > end:
      total += stop - max(start, end)
      end = stop
  return total


def _gaps(events: list[tuple[str, str, float, float]], min_ns: float
          ) -> dict[str, list[float]]:
  """Idle gaps of at least min_ns between the union of kernel intervals, keyed by the kernel
  that ends the gap (the one the device waited for): {name: [gap ns, count]}."""
  out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
  end = None
  for name, _, start, dur in sorted(events, key=lambda e: e[2]):
    if end is not None and start - end >= min_ns:
      out[name][0] += start - end
      out[name][1] += 1
    end = start + dur if end is None else max(end, start + dur)
  return out


def summarize(log_dir: str, steps: int = 1, top: int = 25,
              gap_us: float = 2.0) -> dict[str, Any]:
  """Per-step device time of the newest trace under log_dir.

  Returns {"steps", "kernels" (launches per step), "wall_ms" (first kernel start to last
  kernel end, per step), "busy_ms" (union of kernel intervals, per step), "idle_fraction"
  (1 - busy / wall), "categories" {name: ms per step}, "top" [(kernel (GPU) or HLO op (CPU),
  category, ms per step, launches per step)], "gaps" [(kernel that ended an idle gap of at
  least gap_us, ms of such gaps per step, gaps per step)]: where the device waited,
  "host_events" [(host event name, events per step, host ms per step)], GPU only, by host
  time (nested events both count)}.
  """
  if steps < 1:
    raise ValueError(f"summarize: steps must be >= 1, got {steps}")
  planes = list(jax.profiler.ProfileData.from_file(_newest_xspace(log_dir)).planes)
  events = _kernel_events(planes)
  if not events:
    raise ValueError(f"summarize: the trace under {log_dir} holds no device kernels")
  per_op: dict[str, list[Any]] = {}  # op -> [ns, launches, category]
  cats: dict[str, float] = defaultdict(float)
  for name, op, _, dur in events:
    if op not in per_op:  # the kernel's name first (CPU thunk names say less), then the op's
      cat = category(name)
      per_op[op] = [0.0, 0, cat if cat != "fusion/other" else category(op)]
    per_op[op][0] += dur
    per_op[op][1] += 1
    cats[per_op[op][2]] += dur
  wall = max(s + d for _, _, s, d in events) - min(s for _, _, s, _ in events)
  busy = _union_ns([(s, s + d) for _, _, s, d in events])
  ms = lambda ns: ns / 1e6 / steps
  ranked = sorted(per_op.items(), key=lambda kv: -kv[1][0])[:top]
  gaps = sorted(_gaps(events, gap_us * 1e3).items(), key=lambda kv: -kv[1][0])[:top]
  return {
      "steps": steps, "kernels": len(events) / steps, "wall_ms": ms(wall), "busy_ms": ms(busy),
      "idle_fraction": 1.0 - busy / wall if wall > 0 else 0.0,
      "categories": {c: ms(v) for c, v in sorted(cats.items(), key=lambda kv: -kv[1])},
      "top": [(op, v[2], ms(v[0]), v[1] / steps) for op, v in ranked],
      "gaps": [(name, ms(v[0]), v[1] / steps) for name, v in gaps],
      "host_events": [(name, v[0] / steps, ms(v[1])) for name, v in
                      sorted(_host_events(planes).items(), key=lambda kv: -kv[1][1])[:top]],
  }


def timeline(log_dir: str, anchor: str, index: int = 0, before_ms: float = 0.3,
             span_ms: float = 3.0, min_host_us: float = 2.0
             ) -> list[tuple[float, float, str, str]]:
  """The host's and the device's events in time order around one moment of the newest trace
  under log_dir: the `index`-th host event whose name starts with `anchor` (e.g.
  "cuGraphLaunch": one decode step's launch). Rows (start us from the anchor, duration us,
  where: the host thread's name or the device stream's, event name), from before_ms before the
  anchor to span_ms after it; Python frames and host events shorter than min_host_us are left
  out. For reading a step: when the device idles and what the host does meanwhile."""
  planes = jax.profiler.ProfileData.from_file(_newest_xspace(log_dir)).planes
  return _timeline_rows(planes, anchor, index, before_ms, span_ms, min_host_us)


def _timeline_rows(planes: Sequence[Any], anchor: str, index: int, before_ms: float,
                   span_ms: float, min_host_us: float) -> list[tuple[float, float, str, str]]:
  planes = list(planes)
  hosts = [(ln.name, list(ln.events)) for p in planes if not p.name.startswith("/device:")
           for ln in p.lines]
  marks = sorted(e.start_ns for _, evs in hosts for e in evs if e.name.startswith(anchor))
  if not -len(marks) <= index < len(marks):
    raise ValueError(f"timeline: {len(marks)} host events start with {anchor!r}; no index "
                     f"{index}")
  t0 = marks[index]
  lo, hi = t0 - before_ms * 1e6, t0 + span_ms * 1e6
  rows = [((e.start_ns - t0) / 1e3, e.duration_ns / 1e3, where, e.name)
          for where, evs in hosts for e in evs
          if lo <= e.start_ns <= hi and e.duration_ns >= min_host_us * 1e3
          and not _SKIP.match(e.name)]
  rows += [((e.start_ns - t0) / 1e3, e.duration_ns / 1e3, ln.name, e.name)
           for p in planes if p.name.startswith("/device:") for ln in p.lines
           if ln.name.startswith("Stream") for e in ln.events if lo <= e.start_ns <= hi]
  return sorted(rows)


def format_timeline(rows: list[tuple[float, float, str, str]], gap_us: float = 20.0) -> str:
  """Timeline rows as lines; a device event after at least gap_us of device idle time is
  marked with that gap."""
  lines, end = [], None
  for start, dur, where, name in rows:
    note = ""
    if where.startswith("Stream"):
      if end is not None and start - end >= gap_us:
        note = f"  <- device idle {start - end:.1f} us"
      end = start + dur if end is None else max(end, start + dur)
    lines.append(f"{start:10.1f} us {dur:9.1f} us  {where[:24]:24s} {name[:80]}{note}")
  return "\n".join(lines)


def format_summary(s: dict[str, Any], title: str) -> str:
  """A few lines for a log: totals, categories, the top ops."""
  lines = [f"profile {title}: per step {s['wall_ms']:.3f} ms wall (first to last kernel), "
           f"{s['busy_ms']:.3f} ms busy, idle {100 * s['idle_fraction']:.1f}%, "
           f"{s['kernels']:.0f} kernels",
           "  by category (ms/step): " + ", ".join(f"{c} {v:.3f}"
                                                   for c, v in s["categories"].items())]
  for op, cat, v, n in s["top"]:
    lines.append(f"  {v:9.3f} ms  x{n:6.1f}  {cat:12s} {op[:110]}")
  if s.get("gaps"):
    lines.append("  idle gaps by the kernel that ended them (ms/step, gaps/step):")
    for name, v, n in s["gaps"][:12]:
      lines.append(f"  {v:9.3f} ms  x{n:6.1f}  {name[:110]}")
  if s.get("host_events"):
    lines.append("  host events (events/step, host ms/step):")
    for name, n, v in s["host_events"][:20]:
      lines.append(f"  {n:9.1f}  {v:9.3f} ms  {name[:110]}")
  return "\n".join(lines)
