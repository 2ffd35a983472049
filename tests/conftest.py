"""Shared pytest fixtures for the whole suite (keep this file small)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

# Share compiled XLA programs between the pytest-xdist workers and test modules (and across
# runs): several modules jit the same quantizers at the same shapes, and compiling them is most
# of the suite's CPU time. Keyed by the program, flags and jax version, so never stale.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  import jax

  jax.config.update("jax_compilation_cache_dir",
                    str(Path(__file__).resolve().parent.parent / ".pytest_cache" / "jax"))

# Shared test helpers live next to the quantization tests (`tests/quant/cases.py`); make them
# importable as `cases` from every test directory, whatever the import mode.
_QUANT_TESTS = str(Path(__file__).resolve().parent / "quant")
if _QUANT_TESTS not in sys.path:
  sys.path.insert(0, _QUANT_TESTS)


@pytest.fixture(scope="session")
def torch_device() -> Any:
  """The torch device of the twin tests: env TRACE_TORCH_DEVICE (default "cpu")."""
  torch = pytest.importorskip("torch")
  return torch.device(os.environ.get("TRACE_TORCH_DEVICE", "cpu"))
