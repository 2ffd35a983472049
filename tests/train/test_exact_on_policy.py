"""Exact on-policy under the invariant kernel plan (`model.plan="invariant"`): the trainer's
log-probs of the sampled tokens (`step.policy_logprobs`, the GRPO step's forward) equal the
rollout engine's bit for bit, in BF16 and in FP4 (every FP4 code of every site and layer the
same, so `fp4_trace` guidance has nothing left to repair), for single-turn batches and for
multi-turn sessions; the default plan differs (the positive control)."""

import dataclasses

import jax
import numpy as np
import pytest

from trace_jax import model as model_lib
from trace_jax.guidance import layout as guidance_layout
from trace_jax.rollout.engine import InProcessEngine
from trace_jax.rollout.protocol import SamplingParams
from trace_jax.train import batch as batch_lib
from trace_jax.train import mismatch
from trace_jax.train import step as step_lib

CFG = model_lib.tiny(vocab_size=100, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=32, num_experts=4, moe_intermediate_size=32,
                     dtype="bfloat16", plan="invariant", max_position_embeddings=128)
SEQ_LEN = 32
PROMPTS = [[5, 17, 42, 9, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19], [7] * 12]


@pytest.fixture(scope="module")
def params():
  return model_lib.init_params(CFG, 0, param_dtype="float32")


def _sampling(n: int = 3) -> list[SamplingParams]:
  return [SamplingParams(max_new_tokens=8, temperature=1.0, seed=i) for i in range(n)]


def _rollout_and_trainer(params, cfg, audit: bool = False):
  """The engine's samples and records of PROMPTS, and the trainer's forward of them as a GRPO
  batch (guidance and routing as the learner passes them; taps of every layer when audit)."""
  eng = InProcessEngine(params, cfg, max_batch=4, audit_fraction=1.0 if audit else 0.0)
  samples = eng.generate(PROMPTS, _sampling())
  rec = eng.last_guidance
  guided = cfg.forward.guided
  batch = batch_lib.rl_batch(
      samples, np.zeros(len(samples), np.float32), SEQ_LEN,
      rec["guidance"] if guided else None,
      {layer: rec["routing"][layer] for layer in cfg.guided_layers} if guided else None)
  taps = tuple(range(cfg.num_hidden_layers)) if audit else ()
  logp, out_taps = step_lib.policy_logprobs(params, cfg, step_lib.RLConfig(), batch, taps)
  mask = np.asarray(batch.loss_mask) > 0
  return (np.asarray(batch.logp_rollout)[mask], np.asarray(logp)[mask], samples, rec,
          out_taps, batch)


def _assert_bitwise(rollout: np.ndarray, trainer: np.ndarray) -> None:
  assert np.array_equal(rollout.view(np.uint32), trainer.view(np.uint32)), (
      f"max |dlogp| {np.abs(rollout - trainer).max()}")


def test_bf16_trainer_logprobs_equal_the_rollout_s_bit_for_bit(params):
  """policy_logprobs, and the GRPO step's own forward (a program with the backward, whose
  fusions differ): its mismatch metrics are exactly 0."""
  rollout, trainer, samples, _, _, batch = _rollout_and_trainer(params, CFG)
  assert rollout.size == sum(len(s.tokens) for s in samples) > 10
  _assert_bitwise(rollout, trainer)
  tx = step_lib.make_optimizer(step_lib.OptimConfig())
  _, m, _ = step_lib.grpo_step(step_lib.init_state(params, tx), batch, config=CFG, tx=tx,
                               rl=step_lib.RLConfig())
  assert float(m["mean_abs_dlogp"]) == 0.0 and float(m["k3_kl"]) == 0.0, m


def test_fp4_trace_logprobs_codes_and_routes_are_the_rollout_s(params):
  """fp4_trace (guided by the rollout's records), every layer audited: the trainer's
  log-probs are the rollout's bit for bit, and so are its full FP4 codes and expert ids at
  every site of every layer (no flip, guided or not: guidance has nothing to repair)."""
  cfg = dataclasses.replace(CFG, policy="fp4_trace")
  rollout, trainer, samples, rec, taps, _ = _rollout_and_trainer(params, cfg, audit=True)
  assert rec["guidance"] and rollout.size > 10
  _assert_bitwise(rollout, trainer)
  counts = [s.num_rows for s in samples]
  ragged = {layer: {site: guidance_layout.unpad(v, counts) for site, v in sites.items()}
            for layer, sites in taps.items()}
  train_routing = {layer: t.pop("routing") for layer, t in ragged.items()}
  report = mismatch.compare(ragged, rec["audit"]["guidance"], train_routing, rec["routing"],
                            guided_layers=cfg.guided_layers)
  assert len(report.flips) == 4 * cfg.num_hidden_layers
  assert all(f.flips == 0 and f.scale_flips == 0 and f.total > 0 and f.scale_total > 0
             for f in report.flips.values()), report.metrics()
  assert report.routing_total().flip_rate == 0.0, report.metrics()


def test_multi_turn_session_logprobs_equal_the_trainer_s(params):
  """Two turns of an fp4_rtn session (the second fed an observation chunk on top of the
  session's NVFP4 KV cache): the trainer's forward of the whole transcript gives each sampled
  token the log-prob the engine sampled it with."""
  cfg = dataclasses.replace(CFG, policy="fp4_rtn")
  eng = InProcessEngine(params, cfg, max_batch=4)
  session = eng.open_session(2, 60)
  first = eng.extend(session, [0, 1], PROMPTS[:2], _sampling(2))
  obs = [[21, 22, 23], [31, 32, 33, 34, 35]]
  second = eng.extend(session, [0, 1], obs, _sampling(2))
  transcripts, rollout, where = [], [], []
  for i in range(2):
    t = PROMPTS[i] + first[i].tokens + obs[i]
    start2 = len(t)
    t = t + second[i].tokens
    transcripts.append(t)
    gen_at = ([len(PROMPTS[i]) + j for j in range(len(first[i].tokens))]
              + [start2 + j for j in range(len(second[i].tokens))])
    rollout += first[i].logprobs + second[i].logprobs
    where += [(i, p - 1) for p in gen_at]  # target t[p] is predicted at row p - 1
  seqs = batch_lib.sequence_batch(transcripts, [[]] * 2, SEQ_LEN)
  logp, _ = jax.jit(step_lib.token_logprobs, static_argnums=1)(params, cfg, seqs["inputs"],
                                                                seqs["targets"])
  trainer = np.asarray([np.asarray(logp)[i, r] for i, r in where], np.float32)
  _assert_bitwise(np.asarray(rollout, np.float32), trainer)


def test_default_plan_differs(params):
  """Positive control: the default ("auto") plan's trainer and rollout are other XLA programs
  and disagree on some log-probs, by float32 summation order only."""
  rollout, trainer, *_ = _rollout_and_trainer(params, dataclasses.replace(CFG, plan="auto"))
  d = np.abs(rollout - trainer)
  assert d.max() > 0 and d.max() < 0.05, d.max()
