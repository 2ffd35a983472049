"""The run fingerprint (run_config.json): one config per workdir, exempt fields, the allowed
change and its record, concurrent launches; launch errors as one line."""

from __future__ import annotations

import json
import logging
import threading

import ml_collections
import pytest

from configs import quickstart
from trace_jax.train import run_guard


def _set(cfg: ml_collections.ConfigDict, path: str, value) -> None:
  *parents, last = path.split(".")
  node = cfg
  for p in parents:
    node = node[p]
  node[last] = value


def _record(tmp_path) -> dict:
  return json.loads((tmp_path / run_guard.FILE).read_text())


def test_first_launch_records_config_and_fingerprint(tmp_path):
  cfg = quickstart.get_config()
  run_guard.check_workdir(str(tmp_path), cfg, launch={"sft_checkpoint": None})
  rec = _record(tmp_path)
  assert rec["config"] == json.loads(cfg.to_json_best_effort())
  flat = run_guard.flatten(rec["config"])
  assert rec["fingerprint"] == run_guard.fingerprint(run_guard.fingerprinted(flat))
  assert "rl.lr" in run_guard.fingerprinted(flat) and "rl.steps" not in (
      run_guard.fingerprinted(flat))
  assert rec["changes"] == [] and rec["launch"] == {}


def test_same_config_is_accepted_and_file_untouched(tmp_path):
  run_guard.check_workdir(str(tmp_path), quickstart.get_config())
  before = (tmp_path / run_guard.FILE).stat().st_mtime_ns
  run_guard.check_workdir(str(tmp_path), quickstart.get_config())
  assert (tmp_path / run_guard.FILE).stat().st_mtime_ns == before


@pytest.mark.parametrize("path,value,shown", [
    pytest.param("seed", 1, "seed: 0 -> 1", id="seed"),
    pytest.param("model.hidden_size", 256, "model.hidden_size: 128 -> 256", id="model_width"),
    pytest.param("sft.steps", 60, "sft.steps: 120 -> 60", id="sft_steps_change_the_start"),
    pytest.param("rl.lr", 3e-4, "rl.lr: 0.0001 -> 0.0003", id="rl_lr"),
    pytest.param("task.kwargs.difficulty", 2, "task.kwargs.difficulty: 1 -> 2",
                 id="nested_task_kwarg"),
    pytest.param("eval.num_prompts", 32, "eval.num_prompts: 64 -> 32", id="eval_set"),
])
def test_changed_field_is_refused_naming_it(path, value, shown, tmp_path):
  run_guard.check_workdir(str(tmp_path), quickstart.get_config())
  before = (tmp_path / run_guard.FILE).read_text()
  cfg = quickstart.get_config()
  _set(cfg, path, value)
  with pytest.raises(run_guard.ConfigMismatchError, match="1 field differs") as e:
    run_guard.check_workdir(str(tmp_path), cfg)
  assert shown in str(e.value) and "--allow_config_change" in str(e.value)
  assert (tmp_path / run_guard.FILE).read_text() == before


def test_other_warm_start_checkpoint_is_refused(tmp_path):
  run_guard.check_workdir(str(tmp_path), quickstart.get_config(), launch={"sft_checkpoint": None})
  with pytest.raises(run_guard.ConfigMismatchError, match="--sft_checkpoint: '<absent>' -> "):
    run_guard.check_workdir(str(tmp_path), quickstart.get_config(),
                            launch={"sft_checkpoint": "/ckpt/a"})


@pytest.mark.parametrize("path,value", [
    pytest.param("policies", ("bf16",), id="policies"),
    pytest.param("rl.seeds", (0, 1, 2, 3), id="more_rl_seeds"),
    pytest.param("rl.steps", 60, id="longer_run"),
    pytest.param("eval.every", 5, id="eval_every"),
    pytest.param("eval.posthoc_fp4", False, id="posthoc_fp4"),
    pytest.param("checkpoint_every", 1, id="checkpoint_every"),
    pytest.param("rl.keep_guidance", True, id="keep_guidance"),
    pytest.param("rl.on_missing_guidance", "fallback", id="on_missing_guidance"),
])
def test_exempt_field_may_change_and_is_recorded(path, value, tmp_path):
  assert any(path == e or path.startswith(f"{e}.") for e in run_guard.EXEMPT)
  first = run_guard.check_workdir(str(tmp_path), quickstart.get_config())["fingerprint"]
  cfg = quickstart.get_config()
  _set(cfg, path, value)
  rec = run_guard.check_workdir(str(tmp_path), cfg)
  assert rec["fingerprint"] == first
  (change,) = _record(tmp_path)["changes"]
  assert not change["allowed"] and list(change["fields"]) == [path]


def test_allow_config_change_proceeds_and_keeps_the_history(tmp_path, caplog):
  run_guard.check_workdir(str(tmp_path), quickstart.get_config())
  cfg = quickstart.get_config()
  cfg.rl.lr = 3e-4
  with caplog.at_level(logging.WARNING, logger=run_guard.__name__):
    run_guard.check_workdir(str(tmp_path), cfg, allow_change=True)
  assert "rl.lr: 0.0001 -> 0.0003" in caplog.text
  rec = _record(tmp_path)
  assert rec["config"]["rl"]["lr"] == 3e-4
  assert rec["changes"][-1]["allowed"] and rec["changes"][-1]["fields"] == {
      "rl.lr": [1e-4, 3e-4]}
  run_guard.check_workdir(str(tmp_path), cfg)  # the new config is now the workdir's own
  with pytest.raises(run_guard.ConfigMismatchError, match="rl.lr: 0.0003 -> 0.0001"):
    run_guard.check_workdir(str(tmp_path), quickstart.get_config())


def test_sft_scope_compares_only_what_the_warm_start_depends_on(tmp_path):
  run_guard.check_workdir(str(tmp_path), quickstart.get_config(), scope=run_guard.SFT_SCOPE)
  cfg = quickstart.get_config()
  cfg.rl.lr, cfg.eval.num_prompts = 3e-4, 32  # RL fields: the warm start is the same
  run_guard.check_workdir(str(tmp_path), cfg, scope=run_guard.SFT_SCOPE)
  cfg.sft.lr = 1e-3
  with pytest.raises(run_guard.ConfigMismatchError, match="sft.lr"):
    run_guard.check_workdir(str(tmp_path), cfg, scope=run_guard.SFT_SCOPE)


def test_workdir_with_results_but_no_record_is_adopted_with_a_warning(tmp_path, caplog):
  (tmp_path / "sft").mkdir()
  with caplog.at_level(logging.WARNING, logger=run_guard.__name__):
    run_guard.check_workdir(str(tmp_path), quickstart.get_config())
  assert "recording this launch's config unchecked" in caplog.text
  assert (tmp_path / run_guard.FILE).exists()


def test_concurrent_launches_agree_on_one_record(tmp_path):
  """Policy processes start together on one workdir: one writes the record, the others compare
  against it (a lock serialises them; the file is never seen half-written)."""
  other = quickstart.get_config()
  other.seed = 1
  cfgs = [quickstart.get_config() for _ in range(7)] + [other]
  outcome: list = [None] * len(cfgs)
  go = threading.Barrier(len(cfgs))

  def launch(i: int) -> None:
    go.wait()
    try:
      outcome[i] = run_guard.check_workdir(str(tmp_path), cfgs[i])["fingerprint"]
    except run_guard.ConfigMismatchError as e:
      outcome[i] = e

  threads = [threading.Thread(target=launch, args=(i,)) for i in range(len(cfgs))]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  seeds = _record(tmp_path)["config"]["seed"]
  failed = [i for i, o in enumerate(outcome) if isinstance(o, Exception)]
  # Whichever launched first owns the workdir; every other config is refused.
  assert failed == ([7] if seeds == 0 else list(range(7)))
  assert len({o for o in outcome if isinstance(o, str)}) == 1
  assert not list(tmp_path.glob("*.tmp-*"))


@pytest.mark.parametrize("error,argv,line", [
    pytest.param(AttributeError(KeyError("'nope'")), ["p", "--config.rl.nope=1"],
                 "--config.rl.nope: no such config field `rl.nope`", id="unknown_field"),
    pytest.param(AttributeError(KeyError("'stesp'\nDid you mean \"steps\" instead of "
                                         "\"stesp\"?")), ["p", "--config.rl.stesp=1"],
                 "--config.rl.stesp: no such config field `rl.stesp` (Did you mean \"steps\" "
                 "instead of \"stesp\"?)", id="did_you_mean"),
])
def test_override_errors_name_the_flag(error, argv, line):
  assert run_guard._override_message(error, argv, "config") == line


def test_fail_prints_one_line_and_exits(capsys):
  with pytest.raises(SystemExit) as e, run_guard.exit_on_errors():
    raise run_guard.UserError("bad\n  thing")
  assert e.value.code == 2
  assert capsys.readouterr().err == "error: bad thing\n"
