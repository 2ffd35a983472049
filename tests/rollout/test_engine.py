"""The in-process engine's prompt-length floor: one program for a run's bounded prompts."""

import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax import model as model_lib
from trace_jax.rollout import decode
from trace_jax.rollout import engine as engine_lib
from trace_jax.rollout.protocol import SamplingParams

CFG = model_lib.tiny()


@pytest.mark.parametrize("n,floor,want", [
    pytest.param(5, 0, 16, id="no_floor_min_bucket"),
    pytest.param(17, 0, 32, id="no_floor_power_of_two"),
    pytest.param(5, 40, 48, id="floor_rounds_up_to_16"),
    pytest.param(48, 40, 48, id="at_floor"),
    pytest.param(49, 40, 64, id="past_floor_power_of_two"),
    pytest.param(97, 112, 112, id="quickstart_longest"),
])
def test_prompt_bucket(n, floor, want):
  assert engine_lib.prompt_bucket(n, floor) == want


def test_negative_floor_is_rejected():
  with pytest.raises(ValueError, match="min_prompt_len"):
    engine_lib.InProcessEngine(None, CFG, min_prompt_len=-1)


def test_floor_compiles_once_and_does_not_change_completions():
  params = model_lib.init_params(CFG, 0)
  sp = SamplingParams(max_new_tokens=6, temperature=0.0)
  rng = np.random.default_rng(0)
  batches = [[rng.integers(1, CFG.vocab_size, size=n).tolist() for n in lens]
             for lens in ((3, 9), (20, 7), (33, 2))]  # plain buckets 16, 32, 64
  floored = engine_lib.InProcessEngine(params, CFG, max_batch=2, min_prompt_len=40)
  plain = engine_lib.InProcessEngine(params, CFG, max_batch=2)
  before = decode.generate._cache_size()
  got = [floored.generate(b, sp) for b in batches]
  assert decode.generate._cache_size() - before == 1  # one [2, 48] program
  for b, out in zip(batches, got):
    for s, ref in zip(out, plain.generate(b, sp)):
      assert s.tokens == ref.tokens
      # Longer padding changes XLA's reduction shapes: log-probs agree closely, not bitwise.
      np.testing.assert_allclose(s.logprobs, ref.logprobs, rtol=0, atol=1e-5)


def test_records_reach_the_store_and_memory_alike(tmp_path):
  """fp4_trace records of sequences of unequal lengths (padding rows past each batch's
  tokens): the store's writer gets the device rows (their host copy started at generation)
  and cuts the padding; the batch it reads back equals the in-memory engine's
  `last_guidance` bit for bit, sequence for sequence; a shifted selection does not. The rows
  reach the writer in pinned host memory (`guidance_layout.start_host_copy`), not on the
  device."""
  import jax

  from trace_jax.guidance import record
  from trace_jax.guidance import store as gs

  cfg = model_lib.tiny(policy="fp4_trace", dtype="float32")
  params = model_lib.init_params(cfg, 0, param_dtype="float32")
  rng = np.random.default_rng(1)
  prompts = [rng.integers(1, cfg.vocab_size, size=n).tolist() for n in (4, 11, 7)]
  sp = [SamplingParams(max_new_tokens=m, temperature=0.0) for m in (3, 8, 5)]
  store = gs.GuidanceStore(str(tmp_path), gs.config_hash(cfg))
  kw = dict(max_batch=4, record_guidance=True, record_routing=True)
  to_store = engine_lib.InProcessEngine(params, cfg, guidance_store=store, **kw)
  kinds, write_batch = set(), store.writer.write_batch

  def spy(*args, **kwargs):
    kinds.update(a.sharding.memory_kind for a in jax.tree.leaves(args[3:]))
    return write_batch(*args, **kwargs)

  store.writer.write_batch = spy
  in_memory = engine_lib.InProcessEngine(params, cfg, **kw)
  handles = [s.guidance for s in to_store.generate(prompts, sp)]
  in_memory.generate(prompts, sp)
  mem = in_memory.last_guidance
  assert to_store.emit_bytes > 0 and to_store.emit_seconds > 0
  assert kinds == {"pinned_host"}
  back = store.read(handles)
  counts = mem["token_counts"]
  assert counts == [len(p) + m - 1 for p, m in zip(prompts, (3, 8, 5))]
  np.testing.assert_array_equal(np.diff(back.seq_offsets), counts)
  bits = lambda a: np.ascontiguousarray(np.asarray(a)).view(np.uint8)
  for layer, sites in mem["guidance"].items():
    for site, g in sites.items():
      for field in record.MODE_FIELDS["compact"]:
        want, got = getattr(g, field), getattr(back.guidance[layer][site], field)
        assert got.shape == want.shape
        np.testing.assert_array_equal(bits(got), bits(want), err_msg=f"{layer}/{site}/{field}")
  for layer, ids in mem["routing"].items():
    np.testing.assert_array_equal(back.routing[layer], ids)
  shifted = store.read(handles[1:] + handles[:1])
  assert not np.array_equal(shifted.routing[0], mem["routing"][0])
  in_memory.generate(prompts[::-1], sp[::-1])  # a second batch; close waits for its records
  in_memory.close()
  assert in_memory._pending_guidance is None
  assert in_memory.last_guidance["token_counts"] == counts[::-1]
  to_store.close()


def test_an_audited_rollout_stores_the_same_compact_records(tmp_path):
  """With audits the program taps full codes of every layer; the guided layers' compact
  training records are made from them on the device and equal a rollout's without audits,
  bit for bit; the audited rows' full codes carry the same mantissa bits."""
  from trace_jax.guidance import store as gs
  from trace_jax.quant import guided

  cfg = model_lib.tiny(policy="fp4_trace", dtype="float32")
  params = model_lib.init_params(cfg, 0, param_dtype="float32")
  rng = np.random.default_rng(2)
  prompts = [rng.integers(1, cfg.vocab_size, size=n).tolist() for n in (5, 9, 3, 6)]
  sp = SamplingParams(max_new_tokens=4, temperature=0.0)
  backs = []
  for name, audit in (("plain", 0.0), ("audited", 0.5)):
    store = gs.GuidanceStore(str(tmp_path / name), gs.config_hash(cfg))
    engine = engine_lib.InProcessEngine(params, cfg, guidance_store=store, max_batch=4,
                                        record_guidance=True, record_routing=True,
                                        audit_fraction=audit)
    handles = [s.guidance for s in engine.generate(prompts, sp)]
    backs.append((store.read(handles), store.read(handles[:2], audit=True) if audit else None))
  (plain, _), (audited, audit) = backs
  bits = lambda a: np.ascontiguousarray(np.asarray(a)).view(np.uint8)
  for layer in cfg.guided_layers:
    for site, g in plain.guidance[layer].items():
      got = audited.guidance[layer][site]
      assert got.codes is None
      for field in ("mantissa", "block_scale", "row_scale"):
        np.testing.assert_array_equal(bits(getattr(got, field)), bits(getattr(g, field)),
                                      err_msg=f"{layer}/{site}/{field}")
      full = audit.guidance[layer][site]
      rows = full.codes.shape[0]
      low = np.packbits(np.asarray(guided.unpack_fp4(jnp.asarray(full.codes))) & 1, axis=-1,
                        bitorder="little")
      np.testing.assert_array_equal(low, np.asarray(g.mantissa)[:rows])
