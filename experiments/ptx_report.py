"""Static instruction counts of the Pallas kernels in an XLA dump's PTX: which MMA, how much
shared-memory traffic, how many byte permutes, per kernel.

Run a program with `XLA_FLAGS=--xla_dump_to=DIR` on the GPU (XLA links the Pallas/Triton
kernels into the module it dumps as `*.ptx`), then

  python -m experiments.ptx_report --dump_dir=DIR --kernels=decode_attention

prints, per `.entry` whose name matches `--kernels`, the count of each instruction class in
its text (static counts: a loop body counts once, so read them as the shape of the code, not
as work done; `ncu` measures the work).
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
import sys
from collections.abc import Sequence

from absl import flags

from experiments import common

FLAGS = flags.FlagValues()
flags.DEFINE_string("dump_dir", "", "XLA dump directory (searched recursively for *.ptx).",
                    flag_values=FLAGS)
flags.DEFINE_string("kernels", "decode_attention", "Regex on the kernels' entry names.",
                    flag_values=FLAGS)
flags.DEFINE_string("json_out", "", "Write the counts here as JSON (optional).",
                    flag_values=FLAGS)
flags.DEFINE_string("bodies_out", "", "Write the matching kernels' PTX here, gzipped "
                    "(optional).", flag_values=FLAGS)

# Instruction classes, matched on the opcode (the first token of a PTX statement).
CLASSES = (
    ("wgmma", re.compile(r"^wgmma\.mma_async")),
    ("mma_sync", re.compile(r"^mma\.sync")),
    ("ldmatrix", re.compile(r"^ldmatrix")),
    ("stmatrix", re.compile(r"^stmatrix")),
    ("st_shared", re.compile(r"^st\.shared")),
    ("ld_shared", re.compile(r"^ld\.shared")),
    ("cp_async", re.compile(r"^cp\.async")),
    ("ld_global", re.compile(r"^ld\.global")),
    ("st_global", re.compile(r"^st\.global")),
    ("prmt", re.compile(r"^prmt")),
    ("shfl", re.compile(r"^shfl")),
    ("bar", re.compile(r"^(bar|barrier)\.")),
    ("cvt", re.compile(r"^cvt")),
)
_ENTRY = re.compile(r"\.entry\s+([A-Za-z_$][\w$]*)")


def entries(ptx: str) -> dict[str, str]:
  """Kernel name -> its PTX body, for every `.entry` in a PTX module's text."""
  starts = [(m.group(1), m.start()) for m in _ENTRY.finditer(ptx)]
  bounds = [s for _, s in starts[1:]] + [len(ptx)]
  return {name: ptx[s:e] for (name, s), e in zip(starts, bounds)}


def counts(body: str) -> dict[str, int]:
  """Instruction classes of one kernel's PTX: {class: statements}, plus `total` (every
  statement) and `shared_bytes` (its `.shared` declarations)."""
  out = {name: 0 for name, _ in CLASSES}
  total = 0
  for line in body.splitlines():
    stmt = line.strip()
    if stmt.startswith("@"):  # predicated: `@%p1 st.shared...`
      stmt = stmt.split(None, 1)[1] if " " in stmt else ""
    if not stmt or stmt.startswith(("//", ".", "{", "}", "$")) or not stmt.endswith(";"):
      continue
    total += 1
    for name, pattern in CLASSES:
      if pattern.match(stmt):
        out[name] += 1
        break
  shared = [int(m) for m in re.findall(r"\.shared\s+\.align\s+\d+\s+\.b8\s+\w+\[(\d+)\]", body)]
  out.update(total=total, shared_bytes=sum(shared))
  return out


def matching_entries(dump_dir: str, kernels: str) -> dict[str, str]:
  """Name -> PTX body of every kernel under dump_dir whose name matches (first one kept)."""
  if not os.path.isdir(dump_dir):
    raise FileNotFoundError(f"--dump_dir {dump_dir!r} is not a directory")
  want = re.compile(kernels)
  found: dict[str, str] = {}
  for path in sorted(glob.glob(os.path.join(dump_dir, "**", "*.ptx"), recursive=True)):
    with open(path) as f:
      for name, body in entries(f.read()).items():
        if want.search(name) and name not in found:
          found[name] = body
  return found


def report(dump_dir: str, kernels: str) -> dict[str, dict[str, int]]:
  """`counts` of every matching kernel under dump_dir."""
  return {name: counts(body) for name, body in matching_entries(dump_dir, kernels).items()}


def main(argv: Sequence[str]) -> dict[str, dict[str, int]] | None:
  """Parses argv (argv[0] is the program name), prints the table, writes the JSON."""
  if not common.parse_flags(FLAGS, argv):
    return None
  bodies = matching_entries(FLAGS.dump_dir, FLAGS.kernels)
  found = {name: counts(body) for name, body in bodies.items()}
  if not found:
    names = sorted(matching_entries(FLAGS.dump_dir, ""))
    raise SystemExit(f"no kernel matching {FLAGS.kernels!r} in the PTX under {FLAGS.dump_dir} "
                     f"({len(names)} kernels: {', '.join(names[:40])})")
  cols = [name for name, _ in CLASSES] + ["total", "shared_bytes"]
  width = max(len(k) for k in found)
  print(f"{'kernel':{width}s} " + " ".join(f"{c:>9s}" for c in cols))
  for name, c in found.items():
    print(f"{name:{width}s} " + " ".join(f"{c[k]:9d}" for k in cols))
  if FLAGS.json_out:
    with open(FLAGS.json_out, "w") as f:
      json.dump(found, f, indent=1)
  if FLAGS.bodies_out:
    with gzip.open(FLAGS.bodies_out, "wt") as f:
      f.write("\n".join(bodies.values()))
  return found


if __name__ == "__main__":
  main(sys.argv)
