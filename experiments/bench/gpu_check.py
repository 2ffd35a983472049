"""One-call accelerator check: quantization tests, direct bit-exactness checks, and the benchmark.

Run from the repository root (no install needed):
  PYTHONPATH=. python3 -m experiments.bench.gpu_check [--out=DIR]
It prints, and writes to DIR/gpu_check.log (DIR: --out, else $OUT, else runs/gpu_check):
1. device information, package versions (missing packages named, not fatal) and XLA_FLAGS,
   checking that XLA runs with default flags (no --xla_allow_excess_precision override: the
   numerics must be right under the user's defaults, `docs/numerics.md`);
2. direct checks under `jax.jit` on the default backend (`bit_checks`): every finite bf16 through
   `e2m1_encode` vs ml_dtypes; E4M3 rounding vs ml_dtypes on every bf16 in [-448, 448] and at
   float32 neighbours of every E4M3 tie; the platform trap (a naive `astype(fp4)` round trip
   under jit, counted, vs ours, which must be exact); NVFP4 (1- and 2-level), MXFP4 and FP8
   codes, scales and dequantized values, guided codes and fake-quant outputs vs the torch twin
   on the torch device, for 2**22 elements spanning 2**-20..2**20 plus adversarial blocks, in
   bf16 and fp32; the straight-through BF16 gradient;
3. `pytest -q tests/quant tests/rollout_bridge/test_torch_quant.py` with
   TRACE_TORCH_DEVICE=cuda (cpu where torch sees no GPU), summary line captured;
4. `experiments.bench.quant` at its default size for the backend (256M elements on GPU).
pytest and the benchmark run in subprocesses, cut to what is left of `--budget_s`, so the whole
run stays within about 6 minutes. The summary table comes last (a remote run's tail shows it).
Writes DIR/gpu_check.json and DIR/bench_quant.json; exits 1 if any check fails.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

from absl import flags

from experiments import common
from experiments.bench import bit_checks
from experiments.bench.bit_checks import Checks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

FLAGS = flags.FlagValues()
flags.DEFINE_string("out", "", "Output folder ('': $OUT if set, else runs/gpu_check).",
                    flag_values=FLAGS)
flags.DEFINE_integer("parity_log2", 22, "log2 of the random elements per dtype in the torch "
                     "parity check (at least 18).", flag_values=FLAGS)
flags.DEFINE_string("torch_device", "", "Torch device for the twin ('': cuda if available, "
                    "else cpu).", flag_values=FLAGS)
flags.DEFINE_bool("pytest", True, "Run the quantization test files.", flag_values=FLAGS)
flags.DEFINE_list("pytest_paths", ["tests/quant", "tests/rollout_bridge/test_torch_quant.py"],
                  "Test paths for pytest.", flag_values=FLAGS)
flags.DEFINE_integer("pytest_timeout", 200, "Seconds before pytest is stopped.",
                     flag_values=FLAGS)
flags.DEFINE_integer("pytest_workers", -1, "pytest-xdist workers (-1: 4 on GPU when xdist is "
                     "installed, else 0; 0: no xdist). Compilation runs on the host's CPUs.",
                     flag_values=FLAGS)
flags.DEFINE_bool("bench", True, "Run experiments.bench.quant.", flag_values=FLAGS)
flags.DEFINE_integer("bench_size", 0, "bench_quant --size (0: its default for the backend).",
                     flag_values=FLAGS)
flags.DEFINE_integer("bench_reps", 0, "bench_quant --reps (0: its default).", flag_values=FLAGS)
flags.DEFINE_integer("bench_timeout", 150, "Seconds before bench_quant is stopped.",
                     flag_values=FLAGS)
flags.DEFINE_integer("seed", 0, "Seed of the random parity data.", flag_values=FLAGS)
flags.DEFINE_integer("budget_s", 340, "Wall-time budget: pytest and the benchmark get at most "
                     "what is left of it (each at least 60 s), within their own timeouts.",
                     flag_values=FLAGS)
BENCH_RESERVE_S = 110  # kept for the benchmark when pytest's time is cut to the budget

PACKAGES = ("jax", "jaxlib", "flax", "numpy", "ml_dtypes", "torch", "absl-py", "pytest",
            "hypothesis", "tqdm", "matplotlib", "ml_collections", "tensorstore", "optax", "chex",
            "orbax-checkpoint", "safetensors")
IMPORT_NAMES = {"absl-py": "absl", "orbax-checkpoint": "orbax.checkpoint"}


# ----------------------------------------------------------------------------- 1. info

def package_versions() -> dict[str, str | None]:
  """Installed version of each package the project uses, None where it does not import."""
  out: dict[str, str | None] = {}
  for name in PACKAGES:
    try:
      importlib.import_module(IMPORT_NAMES.get(name, name))
      try:
        out[name] = importlib.metadata.version(name)
      except importlib.metadata.PackageNotFoundError:
        out[name] = "unknown version"
    except Exception as e:  # ImportError, or a package that breaks on import
      out[name] = None
      print(f"  package {name}: MISSING or broken ({type(e).__name__}: {str(e)[:120]}); "
            "continuing without it", flush=True)
  return out


def device_info(checks: Checks, torch_device: str | None) -> dict[str, Any]:
  """Prints and returns device, version and flag information; checks XLA_FLAGS."""

  print("== 1. device information", flush=True)
  info: dict[str, Any] = {"python": sys.version.split()[0], "platform": platform.platform()}
  info["packages"] = package_versions()
  for name, v in info["packages"].items():
    print(f"  {name:18s} {v if v else 'MISSING'}")
  info.update(common.device_description())
  print(f"  jax backend {info['backend']}: {info['devices']}")
  info["torch_device"] = torch_device
  if info["packages"].get("torch"):
    import torch

    info["torch_cuda_available"] = torch.cuda.is_available()
    if torch.cuda.is_available():
      info["torch_cuda_device"] = torch.cuda.get_device_name(0)
      info["torch_cuda_version"] = torch.version.cuda
    print(f"  torch {torch.__version__}: cuda available {torch.cuda.is_available()}"
          + (f", {info['torch_cuda_device']} (CUDA {info['torch_cuda_version']})"
             if torch.cuda.is_available() else "") + f"; twin runs on {torch_device}")
  if shutil.which("nvidia-smi"):
    try:
      smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,"
                            "clocks.sm,clocks.mem", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
      info["nvidia_smi"] = smi.stdout.strip()
      print(f"  nvidia-smi: {info['nvidia_smi']}")
    except (OSError, subprocess.SubprocessError) as e:
      print(f"  nvidia-smi failed: {e}")
  xla_flags = os.environ.get("XLA_FLAGS", "")
  info["XLA_FLAGS"] = xla_flags
  print(f"  XLA_FLAGS={xla_flags!r}")
  for var in ("JAX_PLATFORMS", "XLA_PYTHON_CLIENT_PREALLOCATE", "TRACE_TORCH_DEVICE"):
    print(f"  {var}={os.environ.get(var)!r}")
  checks.add("xla_default_flags", "xla_allow_excess_precision" not in xla_flags,
             "no --xla_allow_excess_precision override" if "xla_allow_excess_precision"
             not in xla_flags else f"XLA_FLAGS overrides excess precision: {xla_flags!r}; the "
             "checks must run under default flags")
  return info


# ----------------------------------------------------------------------------- 3. pytest

def _stream(cmd: Sequence[str], env: dict[str, str], timeout: int, prefix: str = "") -> tuple[
    int | None, list[str], float]:
  """Runs cmd in the repo root, echoing its output; stops it (its own group) after timeout."""
  t0 = time.perf_counter()
  proc = subprocess.Popen(list(cmd), cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, bufsize=1,
                          start_new_session=True)
  timed_out = threading.Event()

  def stop() -> None:
    timed_out.set()
    try:
      os.killpg(proc.pid, 9)  # the group this Popen started, nothing else
    except ProcessLookupError:
      pass

  timer = threading.Timer(timeout, stop)
  timer.start()
  lines: list[str] = []
  try:
    assert proc.stdout is not None
    for line in proc.stdout:
      lines.append(line.rstrip("\n"))
      print(prefix + line, end="", flush=True)
    rc = proc.wait()
  finally:
    timer.cancel()
  if timed_out.is_set():
    print(f"{prefix}** stopped after {timeout} s", flush=True)
    return None, lines, time.perf_counter() - t0
  return rc, lines, time.perf_counter() - t0


def _subprocess_env(torch_device: str | None) -> dict[str, str]:
  env = dict(os.environ)
  env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
  env["PYTHONUNBUFFERED"] = "1"
  env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  # One JAX compilation cache for the pytest workers and the benchmark (tests/conftest.py puts
  # it under .pytest_cache otherwise, which `-p no:cacheprovider` leaves uncreated).
  if "JAX_COMPILATION_CACHE_DIR" not in env:
    env["JAX_COMPILATION_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), "trace_jax_xla_cache")
    os.makedirs(env["JAX_COMPILATION_CACHE_DIR"], exist_ok=True)
  if torch_device:
    env["TRACE_TORCH_DEVICE"] = torch_device
  return env


def _xdist_workers(requested: int) -> int:
  if requested >= 0:
    return requested
  import jax

  try:
    importlib.import_module("xdist")
  except ImportError:
    return 0
  return 4 if jax.default_backend() == "gpu" else 0


def run_pytest(checks: Checks, paths: Sequence[str], torch_device: str | None,
               timeout: int, workers: int) -> dict[str, Any]:
  """Runs pytest on the existing test paths; the summary line decides the check."""
  print("\n== 3. pytest", flush=True)
  present = [p for p in paths if os.path.exists(os.path.join(REPO, p))]
  missing = [p for p in paths if p not in present]
  if missing:
    print(f"  test paths not found (skipped): {missing}")
  if not present:
    checks.add("pytest", False, f"none of the test paths exist: {list(paths)}")
    return {"missing": missing}
  cmd = [sys.executable, "-m", "pytest", "-q", *present, "-p", "no:cacheprovider"]
  workers = _xdist_workers(workers)
  if workers:
    cmd += ["-n", str(workers)]
  print(f"  $ TRACE_TORCH_DEVICE={torch_device} {' '.join(cmd[2:])}", flush=True)
  rc, lines, secs = _stream(cmd, _subprocess_env(torch_device), timeout, prefix="  | ")
  summary = next((l.strip() for l in reversed(lines)
                  if any(w in l for w in ("passed", "failed", "error", "no tests ran",
                                          "skipped"))), "")
  if rc is None:
    summary = f"stopped after the {timeout} s timeout, before pytest's summary"
  detail = f"rc={rc}, {secs:.0f} s: {summary or 'no summary line'}"
  if missing:
    detail += f" (missing paths: {missing})"
  checks.add("pytest", rc == 0 and not missing, detail)
  return {"rc": rc, "summary": summary, "seconds": secs, "paths": present, "missing": missing}


# ----------------------------------------------------------------------------- 4. bench

def run_bench(checks: Checks, out_dir: str, size: int, reps: int, torch_device: str | None,
              timeout: int) -> dict[str, Any]:
  """Runs experiments.bench.quant in a subprocess (its own memory) and reads back its JSON."""
  import json

  print("\n== 4. bench_quant", flush=True)
  json_path = os.path.join(out_dir, "bench_quant.json")
  cmd = [sys.executable, "-m", "experiments.bench.quant", f"--json_out={json_path}"]
  if size:
    cmd.append(f"--size={size}")
  if reps:
    cmd.append(f"--reps={reps}")
  if torch_device:
    cmd.append(f"--torch_device={torch_device}")
  else:
    cmd.append("--notorch")
  if os.path.exists(json_path):
    os.remove(json_path)  # never report a previous run's numbers
  rc, _, secs = _stream(cmd, _subprocess_env(torch_device), timeout, prefix="  | ")
  res = None
  if os.path.exists(json_path):
    with open(json_path) as f:
      res = json.load(f)
  # Stopped at the time limit while timing the torch twin: the JAX results stand.
  stopped_in_twin = rc is None and res is not None and res.get("partial")
  if res is None or (rc != 0 and not stopped_in_twin):
    checks.add("bench_quant", False, f"rc={rc} after {secs:.0f} s")
    return {"rc": rc}
  errors = [n for n, e in res["ops"].items() if "error" in e]
  torch_errors = [n for n, e in res["ops"].items() if "torch_error" in e]
  # A torch-twin timing failure (e.g. out of memory at 256M elements) is reported, not failed:
  # the twin's eager E2M1 search is memory-hungry and is not what this benchmark qualifies.
  checks.add("bench_quant", not errors, f"{secs:.0f} s, copy {res['copy_gbps']:.0f} GB/s"
             + (f"; JAX errors in {errors}" if errors else "")
             + (f"; torch twin errors in {torch_errors}" if torch_errors else "")
             + ("; stopped at the time limit while timing the torch twin" if stopped_in_twin
                else ""))
  return res


# ----------------------------------------------------------------------------- main

def _out_dir(flag: str) -> str:
  return flag or os.environ.get("OUT") or os.path.join("runs", "gpu_check")


def _resolve_torch(flag: str) -> str | None:
  try:
    import torch
  except Exception as e:  # torch missing or broken: the twin checks are skipped
    print(f"torch does not import ({type(e).__name__}: {e}); torch checks are skipped")
    return None
  return flag or ("cuda" if torch.cuda.is_available() else "cpu")


def main(argv: Sequence[str]) -> int:
  """Runs everything; returns the exit status (0: every check passed)."""
  if not common.parse_flags(FLAGS, argv):
    return 0
  common.set_gpu_memory_env()
  out_dir = _out_dir(FLAGS.out)
  os.makedirs(out_dir, exist_ok=True)
  checks = Checks()
  record: dict[str, Any] = {"flags": common.flag_dict(FLAGS), "out_dir": out_dir}
  t_start = time.perf_counter()
  with common.tee_output(os.path.join(out_dir, "gpu_check.log")):
    print(f"gpu_check: repo {REPO}, output {out_dir}", flush=True)
    torch_device = _resolve_torch(FLAGS.torch_device)
    record["info"] = checks.guard("device_info", lambda: device_info(checks, torch_device))

    def left(reserve: float = 0.0) -> int:
      return int(max(60.0, FLAGS.budget_s - (time.perf_counter() - t_start) - reserve))

    bc = bit_checks
    checks.guard("exhaustive", lambda: bc.check_exhaustive(checks))
    record["platform_trap_naive_wrong"] = checks.guard(
        "platform_trap", lambda: bc.check_platform_trap(checks))
    checks.guard("sign_of_zero", lambda: bc.check_sign_of_zero(checks, torch_device))
    if torch_device:
      checks.guard("parity", lambda: bc.check_parity(checks, max(FLAGS.parity_log2, 18),
                                                     torch_device, FLAGS.seed))
    else:
      checks.add("parity", None, "torch is missing: no twin to compare with")
    checks.guard("ste_grad", lambda: bc.check_grad(checks))
    if FLAGS.pytest:
      reserve = BENCH_RESERVE_S if FLAGS.bench else 0.0
      record["pytest"] = checks.guard("pytest", lambda: run_pytest(
          checks, FLAGS.pytest_paths, torch_device, min(FLAGS.pytest_timeout, left(reserve)),
          FLAGS.pytest_workers))
    if FLAGS.bench:
      bench = checks.guard("bench_quant", lambda: run_bench(
          checks, out_dir, FLAGS.bench_size, FLAGS.bench_reps, torch_device,
          min(FLAGS.bench_timeout, left())))
      record["bench_copy_gbps"] = (bench or {}).get("copy_gbps")
    record["checks"] = checks.results
    record["seconds"] = time.perf_counter() - t_start
    common.write_json(os.path.join(out_dir, "gpu_check.json"), record)
    _print_summary(checks, record)
  return 1 if checks.failed else 0


def _group(name: str) -> str:
  """Summary group of a check: its name up to the first '/' or dtype-qualified stem."""
  for prefix in ("parity_bfloat16", "parity_float32", "e2m1_", "e4m3_", "trap_", "ste_grad_",
                 "sign_of_zero_"):
    if name.startswith(prefix):
      return prefix.rstrip("_")
  return name


def _print_summary(checks: Checks, record: dict[str, Any]) -> None:
  """A short summary for the end of the output: groups of checks, failures, the benchmark."""
  print("\n== summary", flush=True)
  info = record.get("info") or {}
  print(f"device: {info.get('backend')} {info.get('device_kind')}; torch twin on "
        f"{info.get('torch_device')}; XLA_FLAGS={info.get('XLA_FLAGS')!r}")
  if record.get("pytest"):
    print(f"pytest: {record['pytest'].get('summary') or record['pytest']}")
  for name, n in (record.get("platform_trap_naive_wrong") or {}).items():
    print(f"platform trap, naive {name}: {n} of 10001 values left unquantized")
  groups: dict[str, dict[str, int]] = {}
  for r in checks.results:
    g = groups.setdefault(_group(r["name"]), {"PASS": 0, "FAIL": 0, "SKIP": 0, "elements": 0,
                                              "mismatches": 0})
    g[r["status"]] += 1
    g["elements"] += r.get("total", 0)
    g["mismatches"] += r.get("mismatches", 0)
  rows = [[name, g["PASS"], g["FAIL"], g["SKIP"], g["elements"] or "-",
           g["mismatches"] if g["elements"] else "-"] for name, g in groups.items()]
  print(common.format_table(["checks", "pass", "fail", "skip", "elements", "mismatched"], rows))
  for r in checks.results:
    if r["status"] != "PASS":
      print(f"  {r['status']} {r['name']}: {r['detail']}")
  bench_json = os.path.join(record["out_dir"], "bench_quant.json")
  if record.get("bench_copy_gbps") and os.path.exists(bench_json):
    import json

    from experiments.bench import quant as bench_quant

    with open(bench_json) as f:
      print(bench_quant.format_bench(json.load(f)))
  n_pass = sum(r["status"] == "PASS" for r in checks.results)
  n_skip = sum(r["status"] == "SKIP" for r in checks.results)
  verdict = "FAIL" if checks.failed else "PASS"
  print(f"GPU CHECK {verdict}: {n_pass} passed, {len(checks.failed)} failed, {n_skip} skipped "
        f"in {record['seconds']:.0f} s; log and JSON in {record['out_dir']}"
        + (f"; failed: {checks.failed}" if checks.failed else ""))


if __name__ == "__main__":
  sys.exit(main(sys.argv))
