"""experiments/bench/gpu_check.py: the driver's record, summary and exit status (its direct
checks are tests/experiments/bench/test_bit_checks.py's; here they are replaced by stubs)."""

from __future__ import annotations

import json

import pytest

from experiments.bench import bit_checks, gpu_check

STUBS = ("check_exhaustive", "check_platform_trap", "check_sign_of_zero", "check_parity",
         "check_grad")


@pytest.mark.parametrize("failing", [None, "check_parity"], ids=["all_pass", "one_fails"])
def test_exit_status_record_and_summary(tmp_path, monkeypatch, capsys, failing):
  for name in STUBS:
    def stub(checks, *args, name=name, **kwargs):
      checks.add(f"{name}_stub", name != failing, "stubbed")
      return {"naive": 7} if name == "check_platform_trap" else None

    monkeypatch.setattr(bit_checks, name, stub)
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  rc = gpu_check.main(["gpu_check", f"--out={tmp_path}", "--nopytest", "--nobench",
                       "--torch_device=cpu"])
  record = json.loads((tmp_path / "gpu_check.json").read_text())
  out = capsys.readouterr().out
  statuses = {r["name"]: r["status"] for r in record["checks"]}
  assert statuses["xla_default_flags"] == "PASS"
  assert [n for n in statuses if n.endswith("_stub")] == [f"{n}_stub" for n in STUBS]
  assert record["platform_trap_naive_wrong"] == {"naive": 7}
  assert "platform trap, naive naive: 7 of 10001" in out
  if failing is None:
    assert rc == 0 and "GPU CHECK PASS: 6 passed, 0 failed" in out
  else:
    assert rc == 1 and statuses[f"{failing}_stub"] == "FAIL"
    assert "GPU CHECK FAIL: 5 passed, 1 failed, 0 skipped" in out
    assert f"FAIL {failing}_stub: stubbed" in out


def test_an_excess_precision_override_fails_the_flag_check(tmp_path, monkeypatch, capsys):
  for name in STUBS:
    monkeypatch.setattr(bit_checks, name, lambda checks, *a, **k: None)
  monkeypatch.setenv("XLA_FLAGS", "--xla_allow_excess_precision=false")
  assert gpu_check.main(["gpu_check", f"--out={tmp_path}", "--nopytest", "--nobench",
                         "--torch_device=cpu"]) == 1
  assert "GPU CHECK FAIL: 0 passed, 1 failed" in capsys.readouterr().out


def test_the_default_test_paths_exist_under_the_repo_root():
  """The check's pytest and bench subprocesses run from REPO: the repository root, where its
  default test paths and `experiments` lie (a wrong root skips them on the GPU)."""
  import os
  assert os.path.isdir(os.path.join(gpu_check.REPO, "experiments", "bench"))
  for path in gpu_check.FLAGS["pytest_paths"].default:
    assert os.path.exists(os.path.join(gpu_check.REPO, path)), path
