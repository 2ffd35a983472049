"""What bounds one kernel: Nsight Compute over a benchmark's launches of it.

`ncu` runs the benchmark command after `--` and reports, for the launches of the kernels whose
names match `--kernel`, the sections that say where a kernel's time goes: throughput against
the device's limits (`SpeedOfLight`), memory traffic per level (`MemoryWorkloadAnalysis`),
why warps stall (`WarpStateStats`, `SchedulerStats`), occupancy and launch shape (`Occupancy`,
`LaunchStats`). Its text report goes to stdout.

  python -m experiments.bench.ncu --kernel=wgmma_flash --seconds=200 -- \\
      python3 -m experiments.bench.decode_attention --contexts=32768 --batches=64 \\
      --impls=kernel_packed_wgmma_fused --decoder_check=false --reps=1 --warmup=1 --inner=1

A `timeout` around ncu ends ncu but not the process it profiles; here both run in a process
group of their own, killed whole after `--seconds` (exit status 124).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence

from absl import flags

from experiments import common

SECTIONS = ("SpeedOfLight", "MemoryWorkloadAnalysis", "WarpStateStats", "SchedulerStats",
            "Occupancy", "LaunchStats")
TIMED_OUT = 124

FLAGS = flags.FlagValues()
flags.DEFINE_string("kernel", "", "Regular expression over the kernels' names (e.g. wgmma_flash: "
                    "`decode_attention_wgmma_flash`).", flag_values=FLAGS)
flags.DEFINE_integer("launch_skip", 1, "Matching launches to skip first (warm-up, reference "
                     "checks).", flag_values=FLAGS)
flags.DEFINE_integer("launch_count", 1, "Matching launches to profile.", flag_values=FLAGS)
flags.DEFINE_list("sections", list(SECTIONS), "ncu sections to collect.", flag_values=FLAGS)
flags.DEFINE_integer("seconds", 300, "Kill ncu and the profiled process after this.",
                     flag_values=FLAGS)


def command(target: Sequence[str], kernel: str, skip: int = 1, count: int = 1,
            sections: Sequence[str] = SECTIONS) -> list[str]:
  """The ncu command line profiling `target`'s launches of the kernels matching `kernel`
  (clocks left as the device runs them, not locked to base)."""
  if not target:
    raise ValueError("ncu: no command to profile (give it after --)")
  if skip < 0 or count < 1:
    raise ValueError(f"ncu: launch_skip must be >= 0 and launch_count >= 1, got {skip}, {count}")
  cmd = ["ncu", "--clock-control", "none", "--kernel-name", f"regex:{kernel}",
         "--launch-skip", str(skip), "--launch-count", str(count)]
  for section in sections:
    cmd += ["--section", section]
  return cmd + list(target)


def run_limited(cmd: Sequence[str], seconds: float) -> int:
  """Runs cmd in a process group of its own; after `seconds` kills the group (cmd and whatever
  it started) and returns TIMED_OUT, else cmd's exit status."""
  proc = subprocess.Popen(list(cmd), start_new_session=True)
  try:
    return proc.wait(timeout=seconds)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    print(f"ncu: stopped after {seconds} s", flush=True)
    return TIMED_OUT


def main(argv: Sequence[str]) -> int:
  """argv: the program, this module's flags, `--`, the command to profile. Returns the exit
  status (ncu's, or TIMED_OUT)."""
  argv = list(argv)
  cut = argv.index("--") if "--" in argv else len(argv)
  if not common.parse_flags(FLAGS, argv[:cut]):
    return 0
  if not FLAGS.kernel:
    raise SystemExit("ncu: --kernel is required (a regular expression over kernel names)")
  try:
    cmd = command(argv[cut + 1:], FLAGS.kernel, FLAGS.launch_skip, FLAGS.launch_count,
                  FLAGS.sections)
  except ValueError as e:
    raise SystemExit(str(e)) from e
  if shutil.which("ncu") is None:
    raise SystemExit("ncu: Nsight Compute's `ncu` is not on PATH")
  print(" ".join(cmd), flush=True)
  return run_limited(cmd, FLAGS.seconds)


if __name__ == "__main__":
  sys.exit(main(sys.argv))
