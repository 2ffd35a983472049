"""The Colab notebooks: each runs top to bottom in a fresh kernel on the tiny settings
(TRACE_TINY=1) and shows what it claims; the copies in git carry no outputs.

A cell error fails the test with the cell's traceback (nbclient's CellExecutionError). The kernel
gets this checkout on PYTHONPATH and the suite's persistent XLA cache (tests/conftest.py), and
not the suite's 8 simulated CPU devices: a notebook sees what a user's fresh kernel sees.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
NAMES = ("01_quickstart", "02_mismatch_anatomy", "03_checkpoints")
CELL_TIMEOUT_S = 600
_NUM = r"([0-9.]+(?:e[-+]?\d+)?)"


def kernel_env() -> dict[str, str]:
  """The test process's environment with TRACE_TINY=1, this checkout first on PYTHONPATH, the
  suite's compilation cache (every program kept), and XLA_FLAGS without the simulated device
  count."""
  env = dict(os.environ, TRACE_TINY="1")
  env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
  env.setdefault("JAX_COMPILATION_CACHE_DIR", str(ROOT / ".pytest_cache" / "jax"))
  env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # as tests/conftest.py
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  if flags:
    env["XLA_FLAGS"] = " ".join(flags)
  else:
    env.pop("XLA_FLAGS", None)
  return env


def execute(name: str) -> Any:
  """The notebook after running every cell in a fresh python3 kernel started in notebooks/."""
  import nbformat
  from nbclient import NotebookClient

  nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
  client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, startup_timeout=120,
                          kernel_name="python3",
                          resources={"metadata": {"path": str(NOTEBOOKS)}})
  client.execute(env=kernel_env())
  return nb


def printed(nb: Any) -> str:
  """Everything the code cells printed (stdout) or returned as text."""
  out = []
  for cell in nb.cells:
    for o in cell.get("outputs", []):
      if o.output_type == "stream" and o.name == "stdout":
        out.append(o.text)
      elif o.output_type in ("execute_result", "display_data") and "text/plain" in o.data:
        out.append(o.data["text/plain"] + "\n")
  return "".join(out)


def figures(nb: Any) -> int:
  return sum("image/png" in o.get("data", {}) for cell in nb.cells
             for o in cell.get("outputs", []))


def find(pattern: str, text: str) -> tuple[str, ...]:
  m = re.search(pattern, text, re.MULTILINE)
  assert m, f"the notebook printed no line matching {pattern!r}:\n{text[-3000:]}"
  return m.groups()


def check_quickstart(text: str, n_figures: int) -> None:
  """SFT lowers the loss; the reward/mismatch figure is shown; under fp4_trace every audited
  guided site of every RL step reproduces the rollout's FP4 codes (flips.csv)."""
  first, last = map(float, find(rf"^SFT: \d+ steps in .* loss {_NUM} -> {_NUM}$", text))
  assert last < first
  assert n_figures >= 1
  rows = re.findall(r"^\d+,\d+,(?:moe_in|expert_mid|k|v),1,(\d+),(\d+),", text, re.MULTILINE)
  assert rows, text[-3000:]
  assert all(int(flips) == 0 and int(total) > 0 for flips, total in rows), rows


def check_mismatch_anatomy(text: str, n_figures: int) -> None:
  """Guided training removes the guided sites' flips that RTN has (NVFP4 and MXFP4); compact
  guidance is smaller than full codes; the flip, step and byte plots are shown."""
  rtn, trace = map(float, find(
      rf"^guided-site flip rate: fp4_rtn {_NUM}% .*, fp4_trace {_NUM}% ", text))
  assert trace == 0.0 < rtn
  compact, full = map(float, find(
      rf"^what fp4_trace consumes: {_NUM} B/token compact vs {_NUM} B/token full", text))
  assert compact < full
  (mx_trace,) = find(rf"^mxfp4_trace: flips at guided sites {_NUM}%", text)
  assert float(mx_trace) == 0.0
  assert n_figures >= 3


def check_checkpoints(text: str, n_figures: int) -> None:
  """Our logits match transformers'; the NVFP4 export is smaller than the BF16 one; the HTTP
  server answered /generate exactly as the in-process engine."""
  del n_figures
  (diff,) = find(rf"max \|ours - transformers\| = {_NUM} ", text)
  assert float(diff) < 1e-4
  nvfp4, bf16 = map(float, find(rf"^NVFP4 export {_NUM} KiB vs BF16 export {_NUM} KiB", text))
  assert nvfp4 < bf16
  assert "HTTP answers identical to the in-process engine: True" in text
  assert "server stopped; health now: False" in text


CHECKS: dict[str, Callable[[str, int], None]] = {
    "01_quickstart": check_quickstart, "02_mismatch_anatomy": check_mismatch_anatomy,
    "03_checkpoints": check_checkpoints}


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(n, id=n) for n in NAMES])
def test_notebook_runs_in_a_fresh_kernel(name):
  nb = execute(name)
  CHECKS[name](printed(nb), figures(nb))


def test_every_notebook_is_tested():
  assert sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb")) == sorted(NAMES) == sorted(CHECKS)


@pytest.mark.parametrize("name", [pytest.param(n, id=n) for n in NAMES])
def test_stored_without_outputs(name):
  """Outputs are stripped in git; the first code cell is the install cell."""
  with open(NOTEBOOKS / f"{name}.ipynb", encoding="utf-8") as f:
    nb = json.load(f)
  assert nb["nbformat"] == 4
  code = [c for c in nb["cells"] if c["cell_type"] == "code"]
  for i, cell in enumerate(code):
    assert cell["outputs"] == [], f"code cell {i} has outputs"
    assert cell["execution_count"] is None, f"code cell {i} has an execution count"
  assert "widgets" not in nb["metadata"]
  assert 'find_spec("trace_jax")' in "".join(code[0]["source"]), "no install cell first"
