"""GRPO loop: one tiny end-to-end step per precision policy, and resume-after-kill equality."""

import importlib
import json
import logging
import shutil

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import pytest

from configs import quickstart
from tests.io.checkpoint_damage import garble_largest_array, stale_state, truncate_arrays
from trace_jax.model.policies import POLICIES
from trace_jax.train import checkpoints, rl_loop, run_log


def tiny_cfg():
  c = quickstart.get_config()
  c.model.num_hidden_layers = 1  # guided layers: (0,)
  # FP8 (fp8_unified) needs every linear layer's sizes in multiples of 128.
  c.model.num_key_value_heads = 4
  c.model.moe_intermediate_size = 128
  c.sft.steps = 2
  c.sft.batch_size = 4
  c.rl.steps = 3
  c.rl.prompts_per_step = 2
  c.rl.group_size = 2
  c.rl.max_new_tokens = 8
  c.eval.num_prompts = 4  # same engine bucket as the 4 training samples: one compile
  c.eval.every = 100
  c.checkpoint_every = 1
  c.max_prompt_len = 104
  c.seq_len = 112
  return c


@pytest.fixture(scope="module")
def start_params():
  params, hist = rl_loop.run_sft(tiny_cfg(), "unused", progress=False)
  assert np.isfinite(hist[-1]["loss"])
  return params


# Every run policy but the MXFP4 baselines (the same code paths as their NVFP4 twins, with the
# format mxfp4_trace exercises here): each one compiles its own rollout and step programs.
ONE_STEP = [p for p in POLICIES if p not in ("mxfp4_rollout", "mxfp4_rtn")] + ["fp4_trace+r3",
                                                                       "fp8_unified+fp8bwd"]


@pytest.mark.parametrize("policy", ONE_STEP)
def test_one_rl_step(policy, start_params, tmp_path):
  cfg = tiny_cfg()
  cfg.rl.steps = 1
  out = rl_loop.run_rl(cfg, str(tmp_path), policy, start_params, progress=False)
  row = out["history"][0]
  for k in ("reward", "loss", "grad_norm", "mean_abs_dlogp", "k3_kl"):
    assert np.isfinite(row[k]), (k, row)
  assert row["grad_norm"] > 0
  changed = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))),
                         out["params"], start_params)
  assert any(jax.tree.leaves(changed)), "parameters did not change"
  if policy.startswith(("fp4_rtn", "fp4_trace", "mxfp4_trace")):
    assert 0.0 <= row["flip_rate_guided"] <= 1.0
  if policy.startswith("fp4_trace"):
    assert row["guidance_bytes_per_token"] > 0
  if (tmp_path / "guidance").is_dir():  # FP4 rollouts: the step's and the evals' records
    assert not [p.name for p in (tmp_path / "guidance").iterdir() if p.name.startswith("b")]
  if policy.startswith("fp4_"):
    assert 0.0 <= row["routing_flip_rate"] <= 1.0
  phases = [row[k] for k in run_log.PHASE_KEYS]  # the step's wall time, phase by phase
  assert min(phases) >= 0 and 0.5 * row["step_s"] < sum(phases) <= row["step_s"], row
  assert (tmp_path / "metrics.csv").read_text().count("\n") == 2
  summary = json.loads((tmp_path / "history.json").read_text())["summary"]
  assert summary["final_reward"] is not None


@pytest.mark.parametrize("policy", ["fp4_rtn", "fp4_trace"])
def test_flip_metrics_see_an_unrelated_rollout(policy, start_params, tmp_path):
  """The rollout runs other weights than the trainer: its codes and routing are unrelated to
  the trainer's, and the loop's metrics must say so. (The earlier mantissa-bit metric reported
  ~3% flips under fp4_trace on such input: guided rounding copies the bit it compares.)"""
  from trace_jax import model as model_lib
  from trace_jax.rollout.engine import InProcessEngine
  cfg = tiny_cfg()
  cfg.rl.steps = 1
  other = model_lib.init_params(rl_loop.model_config(cfg), 7, param_dtype="float32")
  # Committed to the device as the learner's own state is: the engine then runs the programs
  # test_one_rl_step compiled for the policy (uncommitted params compile other ones).
  other = jax.device_put(jax.tree.map(lambda a: a if a.ndim == 1 else a * 8.0, other),
                         jax.devices()[0])
  factory = lambda p, c, w: InProcessEngine(
      other, c, guidance_store=w, record_guidance=policy == "fp4_trace", record_routing=True,
      audit_fraction=1.0, max_batch=4, min_prompt_len=cfg.max_prompt_len)
  row = rl_loop.run_rl(cfg, str(tmp_path), policy, start_params, engine_factory=factory,
                       progress=False)["history"][0]
  assert row["flip_rate_guided"] > 0.3, row
  assert row["routing_flip_rate"] > 0.5, row
  flips = (tmp_path / "flips.csv").read_text().splitlines()
  assert len(flips) == 1 + 4 + 1  # header, 4 sites and routing of the one layer


def test_records_in_memory_train_as_records_on_disk(start_params, tmp_path):
  """The in-process loop hands its rollout records to the trainer in memory (no guidance
  directory); kept on disk (`rl.keep_guidance`: the disk store) the same run trains and
  audits bit for bit alike."""
  cfg = tiny_cfg()
  cfg.rl.steps = 2
  memory = rl_loop.run_rl(cfg, str(tmp_path / "memory"), "fp4_trace", start_params,
                          progress=False)
  cfg.rl.keep_guidance = True
  disk = rl_loop.run_rl(cfg, str(tmp_path / "disk"), "fp4_trace", start_params, progress=False)
  assert not (tmp_path / "memory" / "guidance").exists()
  assert [p.name for p in (tmp_path / "disk" / "guidance").iterdir() if p.name.startswith("b")]
  for a, b in zip(jax.tree.leaves(memory["state"]), jax.tree.leaves(disk["state"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  strip = lambda h: [{k: v for k, v in r.items() if k not in run_log.TIMING_KEYS} for r in h]
  assert strip(memory["history"]) == strip(disk["history"])
  assert memory["history"][-1]["flip_rate_guided"] is not None
  assert (tmp_path / "memory" / "flips.csv").read_text() == (
      tmp_path / "disk" / "flips.csv").read_text()


# gsm8k's prompts are 112-141 tokens: max_prompt_len 144 pads every batch (rollout and eval) to
# one length, one rollout program (at 104 they fell in the 128 and 256 buckets: two).
@pytest.mark.parametrize("task,kwargs,seq_len,max_prompt_len", [
    pytest.param("coding", {}, 112, 104, id="coding"),  # reward from the sandboxed interpreter
    pytest.param("gsm8k", {}, 160, 144, id="gsm8k"),  # the shipped JSONL sample, numeric verifier
    pytest.param("long_horizon", {"max_number": 7}, 176, 104, id="long_horizon"),  # multi-turn
])
def test_rl_step_on_task(task, kwargs, seq_len, max_prompt_len, start_params, tmp_path):
  cfg = tiny_cfg()
  cfg.task.name, cfg.task.kwargs, cfg.seq_len = task, kwargs, seq_len
  cfg.max_prompt_len = max_prompt_len
  cfg.rl.steps = 1
  out = rl_loop.run_rl(cfg, str(tmp_path), "bf16", start_params, progress=False)
  row = out["history"][0]
  assert 0.0 <= row["reward"] <= 1.0 and np.isfinite(row["loss"]) and row["grad_norm"] > 0


@pytest.mark.parametrize("epochs,minibatches", [(1, 1), (2, 2)],
                         ids=["one_update", "two_epochs_two_minibatches"])
def test_resume_after_kill_is_bitwise_identical(epochs, minibatches, start_params, tmp_path):
  cfg = tiny_cfg()
  cfg.rl.epochs, cfg.rl.minibatches = epochs, minibatches
  cfg.eval.every = 1  # an evals.csv row per step (same engine bucket: no extra compile)
  full = rl_loop.run_rl(cfg, str(tmp_path / "full"), "fp4_trace", start_params,
                        progress=False)
  rl_loop.run_rl(cfg, str(tmp_path / "killed"), "fp4_trace", start_params, max_steps=2,
                 progress=False)  # "killed" after step 2's checkpoint
  resumed = rl_loop.run_rl(cfg, str(tmp_path / "killed"), "fp4_trace", start_params,
                           progress=False)
  for a, b in zip(jax.tree.leaves(full["state"]), jax.tree.leaves(resumed["state"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  strip = lambda h: [{k: v for k, v in r.items() if k not in run_log.TIMING_KEYS} for r in h]
  assert strip(full["history"]) == strip(resumed["history"])
  assert full["evals"] == resumed["evals"]
  assert [e["step"] for e in full["evals"]] == [0, 1, 2, 3]
  # The CSVs of the killed-and-resumed run hold each step and eval once, as the full run's.
  rows, evals = run_log.read_curves(str(tmp_path / "killed"))
  assert strip(rows) == strip(full["history"])
  assert evals == full["evals"]
  updates = lambda d: (d / "updates.csv").read_text()
  assert updates(tmp_path / "killed") == updates(tmp_path / "full")
  assert updates(tmp_path / "full").count("\n") == 1 + 3 * epochs * minibatches


def test_a_killed_runs_half_written_guidance_batches_are_removed_on_resume(start_params,
                                                                           tmp_path):
  """A batch directory without a manifest (a write killed before its manifest) under a run's
  guidance root is removed when the run resumes; a complete batch and other files stay."""
  cfg = tiny_cfg()
  cfg.rl.keep_guidance = True  # the run's own batches stay, complete
  rl_loop.run_rl(cfg, str(tmp_path), "fp4_trace", start_params, max_steps=1, progress=False)
  root = tmp_path / "guidance"
  complete = sorted(p.name for p in root.iterdir() if (p / "manifest.json").exists())
  assert complete
  (root / "b000777" / "layer0").mkdir(parents=True)  # killed half-way: arrays, no manifest
  (root / "b000777" / "layer0" / "moe_in").write_bytes(b"\0" * 64)
  (root / "notes.txt").write_text("not a batch")
  rl_loop.run_rl(cfg, str(tmp_path), "fp4_trace", start_params, max_steps=1, progress=False)
  assert not (root / "b000777").exists() and (root / "notes.txt").exists()
  assert set(complete) <= {p.name for p in root.iterdir()}


@pytest.fixture(scope="module")
def full_bf16_run(start_params, tmp_path_factory):
  """A finished 3-step bf16 run (checkpoints of steps 2 and 3 kept) and its output."""
  path = tmp_path_factory.mktemp("full")
  return path, rl_loop.run_rl(tiny_cfg(), str(path), "bf16", start_params, progress=False)


@pytest.mark.parametrize("damage", [truncate_arrays, garble_largest_array, stale_state],
                         ids=["torn", "garbled", "stale"])
def test_corrupt_latest_checkpoint_falls_back_to_the_previous_one(
    damage, full_bf16_run, start_params, tmp_path, caplog):
  """A finished run whose newest checkpoint (step 3) has torn array files, 64 garbled bytes in
  its largest array file (which fail to decode or decode into other values, as the trained
  bytes fall), or step 2's state under step 3's metadata (it decodes whole: only the digests
  the checkpoint recorded catch it): the next launch warns naming the step, moves it aside and
  counts it, resumes from step 2, and ends bitwise equal to the uninterrupted run."""
  cfg = tiny_cfg()  # checkpoint_every=1, 2 kept: steps 2 and 3
  full_path, full = full_bf16_run
  shutil.copytree(full_path, tmp_path / "bad")
  assert damage(tmp_path / "bad" / "ckpt" / "3") > 0
  with caplog.at_level(logging.WARNING, logger=checkpoints.__name__):
    again = rl_loop.run_rl(cfg, str(tmp_path / "bad"), "bf16", start_params, progress=False)
  assert "checkpoint step 3 in" in caplog.text and "does not restore" in caplog.text
  assert "resuming from step 2" in caplog.text
  if damage is stale_state:
    assert "differs from its recorded digest" in caplog.text
  for a, b in zip(jax.tree.leaves(full["state"]), jax.tree.leaves(again["state"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  strip = lambda h: [{k: v for k, v in r.items() if k not in run_log.TIMING_KEYS} for r in h]
  assert strip(again["history"]) == strip(full["history"]) and again["evals"] == full["evals"]
  summary = json.loads((tmp_path / "bad" / "history.json").read_text())["summary"]
  assert summary["checkpoint_fallbacks"] == 1 and full["summary"]["checkpoint_fallbacks"] == 0
  moved = (tmp_path / "bad" / checkpoints.CORRUPT_DIR).iterdir()
  assert [p.name.split("-")[0] for p in moved] == ["3"]
  assert sorted(int(p.name) for p in (tmp_path / "bad" / "ckpt").iterdir()) == [2, 3]


def test_an_update_that_leaves_nan_stops_the_run_before_its_checkpoint(start_params, tmp_path,
                                                                      monkeypatch):
  """A reward pipeline that yields NaN advantages: the first update makes the weights NaN, and
  the run stops with NonFiniteStateError naming the step and a parameter, before the engine or
  a checkpoint sees the state."""
  from trace_jax.rl import advantages as adv_lib
  monkeypatch.setattr(adv_lib, "get_advantage_fn",
                      lambda name, *a: lambda rewards, group: rewards * np.float32(np.nan))
  with pytest.raises(checkpoints.NonFiniteStateError,
                     match=r"^rl step 0 of .*: the update left non-finite values \(NaN or Inf\) "
                           r"in \.params\[") as e:
    rl_loop.run_rl(tiny_cfg(), str(tmp_path), "bf16", start_params, progress=False)
  assert "\n" not in str(e.value)
  assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())
  assert not (tmp_path / "history.json").exists()


def test_no_restorable_checkpoint_is_a_clear_error(tmp_path):
  """Every step unreadable (or of other shapes): CheckpointRestoreError naming each step and
  why, and nothing moved aside."""
  state = {"w": np.zeros(4, np.float32)}
  mgr = checkpoints.checkpointer(str(tmp_path / "ckpt"), keep=2)
  for step in (1, 2):
    mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                           meta=ocp.args.JsonSave({"history": []})))
  mgr.wait_until_finished()
  truncate_arrays(tmp_path / "ckpt" / "2")
  other_shape = {"w": np.zeros(5, np.float32)}  # step 1 is intact, but of another shape
  with pytest.raises(checkpoints.CheckpointRestoreError,
                     match=r"no checkpoint in .* restores \(steps 2, 1; step 2: .*\)") as e:
    checkpoints.restore_latest(mgr, other_shape, str(tmp_path / "aside"))
  assert "\n" not in str(e.value) and len(str(e.value)) < 450
  step2, step1 = e.value.details.splitlines()  # every step and its error, for the log
  assert step2.startswith("step 2: ") and step1.startswith("step 1: ValueError: stored shapes")
  assert not (tmp_path / "aside").exists() and mgr.all_steps() == [1, 2]
  step, restored, meta = checkpoints.restore_latest(mgr, state, str(tmp_path / "aside"))
  assert step == 1 and meta == {"history": []} and (tmp_path / "aside").is_dir()
  mgr.close()


def test_a_checkpoint_holding_nan_does_not_restore(tmp_path):
  """A step saved with NaN in it (its digest matches: the values were NaN when saved) is
  refused like a damaged one: the older finite step restores."""
  mgr = checkpoints.checkpointer(str(tmp_path / "ckpt"), keep=2)
  good = {"w": np.ones(4, np.float32), "n": np.zeros((), np.int32)}
  checkpoints.save(mgr, 1, good, {"history": []})
  checkpoints.save(mgr, 2, {"w": np.array([1, np.nan, 1, 1], np.float32),
                            "n": np.ones((), np.int32)}, {"history": [1]})
  step, restored, meta = checkpoints.restore_latest(mgr, good, str(tmp_path / "aside"))
  assert step == 1 and meta["history"] == [] and np.all(np.asarray(restored["w"]) == 1)
  (moved,) = (tmp_path / "aside").iterdir()
  assert moved.name.startswith("2-")
  mgr.close()


def _with(cfg: ml_collections.ConfigDict, field: str, value) -> ml_collections.ConfigDict:
  """cfg with `field` (dotted) set to value, whatever its type (a config file could hold it;
  ConfigDict refuses to change a field's type in place)."""
  d = cfg.to_dict()
  node = d
  *path, last = field.split(".")
  for p in path:
    node = node[p]
  node[last] = value
  return ml_collections.ConfigDict(d)


@pytest.mark.parametrize("field,value,match", [
    ("policies", ("bf16", "fp5"), "policy"),
    ("rl.group_size", 1, r"rl.group_size must be an int >= 2 .*got 1"),
    ("rl.is_mode", "clip", "rl.is_mode must be truncate|mask|none, got 'clip'"),
    ("model.vocab_size", 50, "vocab_size"),
    ("max_prompt_len", 64, r"rl step 0 has a prompt of \d+ tokens > max_prompt_len=64"),
    ("seq_len", 100, "seq_len=100 cannot hold"),
    ("rl.steps", -1, "rl.steps must be an int >= 1, got -1"),
    ("rl.steps", 0, "rl.steps must be an int >= 1, got 0"),
    ("rl.steps", 2.5, "rl.steps must be an int >= 1, got 2.5"),
    ("rl.steps", True, "rl.steps must be an int >= 1, got True"),
    ("sft.steps", -1, "sft.steps must be an int >= 0, got -1"),
    ("sft.batch_size", 0, "sft.batch_size must be an int >= 1, got 0"),
    ("sft.lr", 0.0, r"sft.lr must be a finite number > 0, got 0.0"),
    ("sft.warmup_steps", -1, "sft.warmup_steps must be an int >= 0, got -1"),
    ("sft.weight_decay", -0.1, r"sft.weight_decay must be a finite number >= 0, got -0.1"),
    ("rl.lr", -1.0, r"rl.lr must be a finite number > 0, got -1.0"),
    ("rl.lr", float("nan"), r"rl.lr must be a finite number > 0, got nan"),
    ("rl.warmup_steps", -3, "rl.warmup_steps must be an int >= 0, got -3"),
    ("rl.weight_decay", -1.0, "rl.weight_decay must be a finite number >= 0"),
    ("rl.prompts_per_step", 0, "rl.prompts_per_step must be an int >= 1, got 0"),
    ("rl.max_new_tokens", 0, "rl.max_new_tokens must be an int >= 1, got 0"),
    ("rl.temperature", 0.0, r"rl.temperature must be a finite number > 0, got 0.0"),
    ("rl.top_p", 0.0, r"rl.top_p must be a number in \(0, 1\], got 0.0"),
    ("rl.top_p", 1.5, r"rl.top_p must be a number in \(0, 1\], got 1.5"),
    ("rl.clip_eps", 0.0, "rl.clip_eps must be a finite number > 0"),
    ("rl.is_cap", -5.0, "rl.is_cap must be a finite number > 0"),
    ("rl.aux_loss_coef", -0.1, "rl.aux_loss_coef must be a finite number >= 0"),
    ("rl.audit_fraction", 1.5, r"rl.audit_fraction must be a number in \[0, 1\], got 1.5"),
    ("rl.on_missing_guidance", "skip", "rl.on_missing_guidance must be error|fallback"),
    ("eval.num_prompts", 0, "eval.num_prompts must be an int >= 1, got 0"),
    ("eval.every", 0, "eval.every must be an int >= 1, got 0"),
    ("checkpoint_every", 0, "checkpoint_every must be an int >= 1, got 0"),
    ("seq_len", 0, "seq_len must be an int >= 1, got 0"),
    ("max_prompt_len", -1, "max_prompt_len must be an int >= 1, got -1"),
], ids=["unknown_policy", "group_of_one", "bad_is_mode", "vocab_too_small",
        "prompt_longer_than_max_prompt_len", "seq_len_below_prompt_plus_completion",
        "rl_steps_negative", "rl_steps_zero", "rl_steps_float", "rl_steps_bool",
        "sft_steps_negative", "sft_batch_zero", "sft_lr_zero", "sft_warmup_negative",
        "sft_weight_decay_negative", "rl_lr_negative", "rl_lr_nan", "rl_warmup_negative",
        "rl_weight_decay_negative", "prompts_per_step_zero", "max_new_tokens_zero",
        "temperature_zero_is_greedy", "top_p_zero", "top_p_above_one", "clip_eps_zero",
        "is_cap_negative", "aux_loss_coef_negative", "audit_fraction_above_one",
        "unknown_on_missing_guidance", "eval_prompts_zero", "eval_every_zero",
        "checkpoint_every_zero", "seq_len_zero", "max_prompt_len_negative"])
def test_validate_rejects_bad_configs(field, value, match):
  rl_loop.validate(tiny_cfg())
  with pytest.raises(ValueError, match=match):
    rl_loop.validate(_with(tiny_cfg(), field, value))


@pytest.mark.parametrize("field,value", [
    ("sft.steps", 0), ("rl.top_p", 1.0), ("rl.audit_fraction", 0.0), ("rl.warmup_steps", 0),
    ("rl.weight_decay", 0.0), ("rl.steps", 1),
], ids=["no_sft", "top_p_one", "no_audit", "no_warmup", "no_weight_decay", "one_rl_step"])
def test_validate_accepts_edge_values(field, value):
  rl_loop.validate(_with(tiny_cfg(), field, value))


def test_validate_names_every_bad_field_at_once():
  cfg = _with(_with(_with(tiny_cfg(), "rl.steps", -1), "sft.steps", -1), "rl.lr", -1.0)
  del cfg.rl["clip_eps"]
  with pytest.raises(ValueError) as e:
    rl_loop.validate(cfg)
  assert str(e.value) == ("sft.steps must be an int >= 0, got -1; rl.steps must be an int >= 1, "
                          "got -1; rl.lr must be a finite number > 0, got -1.0; config has no "
                          "`rl.clip_eps`")


@pytest.mark.parametrize("name", ["quickstart", "quickstart_fp8", "small_h200", "small_h200_fp8",
                                  "qwen3_30b_a3b", "long_horizon"])
def test_shipped_configs_hold_every_prompt_of_their_run(name, bpe_tokenizer):
  module = importlib.import_module(f"configs.{name}")
  # The Qwen3 config reads the checkpoint's HF tokenizer; a small BPE stands in for it.
  cfg = module.get_config(bpe_tokenizer()) if name == "qwen3_30b_a3b" else module.get_config()
  rl_loop.validate(cfg)  # enumerates the run's SFT, RL and eval prompts
