"""The guidance store tests' shared fixture: one pristine batch per mode."""

from __future__ import annotations

import pytest
from store_cases import write


@pytest.fixture(scope="module")
def stored(tmp_path_factory) -> tuple:
  """One pristine batch per mode (batch id = mode), shared by the read-only tests."""
  root = tmp_path_factory.mktemp("guidance")
  stats = {mode: write(root, mode, batch_id=mode).stats for mode in ("compact", "full")}
  return root, stats
