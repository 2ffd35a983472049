"""Which lines of our code a profiled XLA kernel runs: fusion names -> source locations.

A profile (`experiments.bench.profiling`) names XLA's kernels as the optimized HLO names its
fusions (`input_or_reduce_fusion`, `loop_transpose_fusion_15`); which JAX operations went into
one is in the HLO XLA dumps (`XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text"`): each
instruction's `metadata={op_name=... stack_frame_id=N}`, and the module's tables of stack frames
(file, line, function). This reads the `*after_optimizations.txt` dumps and, for each fusion
name asked for, says in which module it is, its output shape, the JAX operations fused into it
and the source lines they were traced from (the innermost frames under this repository).

`python -m experiments.bench.hlo_sources --hlo_dir=DIR --log=PROFILE_LOG` takes the names from
a profile summary's kernel lines (`profiling.format_summary`); `--names=a,b` names them.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import os
import re
import sys
from collections.abc import Iterable, Sequence

from absl import app, flags

from experiments import common

_TABLE = re.compile(r"^(\d+) (.*)$")
_FIELD = re.compile(r"(\w+)=(\"[^\"]*\"|[-\w.]+)")
# An instruction: its name, its shape (one array, or a tuple of them: a multi-output fusion's
# "(f32[8]{0}, u8[8,128]{1,0})", possibly with /*index=5*/ comments), its opcode, its operands.
_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\((?:[^()]|\([^()]*\))*\)|\S+) (\S+)\((.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) \(.*\{$")
_KERNEL_LINE = re.compile(r"^\s+([\d.]+) ms\s+x\s+[\d.]+\s+\S+\s+(\S+)\s*$")
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass
class Fusion:
  """A fusion instruction of one dumped module."""
  module: str
  shape: str
  kind: str
  ops: collections.Counter  # JAX op_name (its last path element) -> instructions
  sources: collections.Counter  # "file:line (function)" -> instructions


def _fields(text: str) -> dict[str, str]:
  return {k: v.strip('"') for k, v in _FIELD.findall(text)}


class _Module:
  """One optimized HLO text dump: its stack frame tables and computations."""

  def __init__(self, path: str):
    self.name = os.path.basename(path).split(".")[1] if "." in os.path.basename(path) else path
    tables: dict[str, dict[int, str]] = collections.defaultdict(dict)
    self.computations: dict[str, list[str]] = {}
    table, body = None, None
    with open(path) as f:
      for line in f:
        line = line.rstrip("\n")
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
          table = line
          continue
        if table and (m := _TABLE.match(line)):
          tables[table][int(m.group(1))] = m.group(2)
          continue
        table = None
        if m := _COMPUTATION.match(line):
          body = self.computations.setdefault(m.group(1), [])
        elif line.startswith("}"):
          body = None
        elif body is not None:
          body.append(line)
    self._tables = tables

  def location(self, frame_id: int, depth: int = 3) -> str | None:
    """`frame_id`'s chain as its innermost `depth` frames in this repository, callee first:
    "file:line (function) < caller ..." (paths relative to the repository); the innermost
    frame of all where none is in it."""
    frames, locs = self._tables["StackFrames"], self._tables["FileLocations"]
    files, funcs = self._tables["FileNames"], self._tables["FunctionNames"]
    first, ours, seen = None, [], set()
    while frame_id in frames and frame_id not in seen and len(ours) < depth:
      seen.add(frame_id)
      frame = _fields(frames[frame_id])
      loc = _fields(locs.get(int(frame.get("file_location_id", -1)), ""))
      path = files.get(int(loc.get("file_name_id", -1)), "?").strip('"')
      func = funcs.get(int(loc.get("function_name_id", -1)), "?").strip('"')
      mine = path.startswith(_REPO) and "site-packages" not in path
      where = f"{os.path.relpath(path, _REPO) if mine else path}:{loc.get('line', '?')} ({func})"
      first = first or where
      if mine and not (ours and ours[-1][1] == (path, func)):  # a function's frames: once
        ours.append((where, (path, func)))
      frame_id = int(frame.get("parent_frame_id", -1))
    return " < ".join(w for w, _ in ours) if ours else first

  def fusions(self, names: set[str]) -> Iterable[tuple[str, Fusion]]:
    """The fusions of these kernel names (`kernel_name` of their HLO names)."""
    for body in self.computations.values():
      for line in body:
        m = _INSTR.match(line)
        if not m or m.group(3) != "fusion" or (key := kernel_name(m.group(1))) not in names:
          continue
        attrs = m.group(4)
        kind = re.search(r"kind=(\w+)", attrs)
        calls = re.search(r"calls=%(\S+?)[,\s]", attrs + " ")
        fusion = Fusion(self.name, m.group(2), kind.group(1) if kind else "?",
                        collections.Counter(), collections.Counter())
        for inner in self.computations.get(calls.group(1), []) if calls else []:
          self._count(fusion, inner)
        if not fusion.ops:
          self._count(fusion, line)
        yield key, fusion

  def _count(self, fusion: Fusion, line: str) -> None:
    meta = re.search(r"metadata=\{([^}]*)\}", line)
    if not meta:
      return
    fields = _fields(meta.group(1))
    if "op_name" in fields:
      fusion.ops[fields["op_name"].rsplit("/", 1)[-1]] += 1
    if "stack_frame_id" in fields:
      where = self.location(int(fields["stack_frame_id"]))
      if where:
        fusion.sources[where] += 1


def kernel_name(hlo_name: str) -> str:
  """The name a profile gives the kernel of an HLO instruction: XLA names a fusion's kernel
  after the instruction, every character but letters, digits and '_' made '_'
  (`%loop_or_fusion.8` runs as `loop_or_fusion_8`, `%select_shift-left_fusion` as
  `select_shift_left_fusion`)."""
  return re.sub(r"[^A-Za-z0-9_]", "_", hlo_name)


def find(hlo_dir: str, names: Sequence[str]) -> dict[str, list[Fusion]]:
  """Each name's fusions over the optimized HLO dumps in hlo_dir ([] where none is named so);
  a name is a profile's kernel name or the HLO instruction's."""
  out: dict[str, list[Fusion]] = {n: [] for n in names}
  asked = collections.defaultdict(list)
  for n in names:
    asked[kernel_name(n)].append(n)
  paths = sorted(glob.glob(os.path.join(hlo_dir, "*after_optimizations.txt")))
  if not paths:
    raise FileNotFoundError(f"no *after_optimizations.txt HLO dumps in {hlo_dir} (dump with "
                            "XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text)")
  for path in paths:
    for key, fusion in _Module(path).fusions(set(asked)):
      for name in asked[key]:
        out[name].append(fusion)
  return out


def kernel_times(summary: str) -> dict[str, list[float]]:
  """The kernels of a profile summary's lines (`profiling.format_summary`), in order, each
  with its ms per step in every profile of the summary that lists it."""
  out: dict[str, list[float]] = {}
  for line in summary.splitlines():
    if m := _KERNEL_LINE.match(line):
      out.setdefault(m.group(2), []).append(float(m.group(1)))
  return out


def kernel_names(summary: str) -> list[str]:
  """The kernel names of a profile summary's lines, in order, each once."""
  return list(kernel_times(summary))


def format_found(found: dict[str, list[Fusion]], top: int = 4,
                 times: dict[str, list[float]] | None = None) -> str:
  """Each name's fusions: module, kind, shape, its commonest ops and source lines; with
  `times` (`kernel_times`), the name's ms per step in each profile first."""
  lines = []
  for name, fusions in found.items():
    if times and times.get(name):
      lines.append(f"{name}: " + ", ".join(f"{t:.3f}" for t in times[name]) + " ms/step")
    if not fusions:
      lines.append(f"{name}: not a fusion of the dumped modules")
      continue
    for f in fusions:
      ops = ", ".join(f"{op} x{n}" for op, n in f.ops.most_common(top))
      src = "; ".join(f"{s} x{n}" for s, n in f.sources.most_common(top))
      lines.append(f"{name} [{f.module}] {f.kind} -> {f.shape}\n  ops: {ops}\n  from: {src}")
  return "\n".join(lines)


FLAGS = flags.FlagValues()
flags.DEFINE_string("hlo_dir", None, "XLA's HLO text dumps (--xla_dump_to).", flag_values=FLAGS)
flags.DEFINE_string("log", "", "A profile summary whose kernel lines name the fusions.",
                    flag_values=FLAGS)
flags.DEFINE_list("names", [], "Fusion names (beside or instead of --log's).",
                  flag_values=FLAGS)


def main(argv: Sequence[str]) -> None:
  if not common.parse_flags(FLAGS, argv):
    return
  if not FLAGS.hlo_dir:
    raise app.UsageError("--hlo_dir is required")
  names, times = list(FLAGS.names), {}
  if FLAGS.log:
    with open(FLAGS.log) as f:
      times = kernel_times(f.read())
    names += [n for n in times if n not in names]
  if not names:
    raise app.UsageError("no fusion names: give --names or a --log with kernel lines")
  print(format_found(find(FLAGS.hlo_dir, names), times=times))


if __name__ == "__main__":
  main(sys.argv)
