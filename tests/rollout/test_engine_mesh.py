"""The in-process engine on an 8-device CPU mesh (`InProcessEngine(mesh=)`) against one device:
the routed experts (the params' stacked per run, or the prepared ones of decode_impl="kernel")
split along E over `expert`, every program's MoE blocks expert-parallel
(`model.expert_parallel`), the one-device engine's greedy tokens, and layer 0's records bit for
bit; the compiled program never moves an expert's weights."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from cases import assert_bits_equal, count_eqns, pallas_calls
from jax.sharding import PartitionSpec

from trace_jax import model as M
from trace_jax.model import expert_parallel, mesh_context, sharding
from trace_jax.rollout import decode
from trace_jax.rollout.engine import InProcessEngine
from trace_jax.rollout.protocol import SamplingParams

needs_8 = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices: run with "
                             "XLA_FLAGS=--xla_force_host_platform_device_count=8")

EXPERTS = PartitionSpec(None, "expert")  # [L, E, ...] stacks: E over `expert`


def _params(config):
  return jax.tree.map(lambda a: a if a.ndim == 1 else a * 4.0, M.init_params(config, 3))


def _mesh(shape):
  return sharding.make_mesh(shape, jax.devices()[:8])


def _prompts(n: int, length: int, vocab: int) -> list[list[int]]:
  return np.random.default_rng(0).integers(1, vocab, (n, length)).tolist()


def _count_ep_traces(monkeypatch) -> list[int]:
  """Appends to the returned list each time an MoE block is traced expert-parallel."""
  traced: list[int] = []
  ep_moe = expert_parallel.moe
  monkeypatch.setattr(expert_parallel, "moe", lambda *a, **k: traced.append(1) or ep_moe(*a, **k))
  return traced


def _rows(records: dict, counts: list[int], keep: list[int]) -> list:
  """Each sequence's first keep[i] rows of ragged records (rows of all sequences concatenated,
  counts[i] each)."""
  ends = np.cumsum(counts)
  return [jax.tree.map(lambda a, e=e, c=c, k=k: np.asarray(a)[e - c:e - c + k], records)
          for e, c, k in zip(ends, counts, keep)]


def _assert_sharded_along_experts(arrays, num_experts: int, ep: int) -> None:
  for a in jax.tree.leaves(arrays):
    want = jax.sharding.NamedSharding(a.sharding.mesh, EXPERTS)
    assert a.sharding.is_equivalent_to(want, a.ndim), a.sharding
    assert a.addressable_shards[0].data.shape[1] == num_experts // ep, a.shape


def _expert_matrices(hlo: str, config) -> list:
  """Collectives of compiled HLO that carry expert weight matrices: [..., F, D] / [..., D, F] /
  gate and up stacked [..., 2F, D], with an expert or tile axis in front."""
  f, d = config.moe_intermediate_size, config.hidden_size
  mats = {(f, d), (d, f), (2 * f, d)}
  return [(op, s) for op, s in sharding.collectives(hlo) if len(s) >= 3 and s[-2:] in mats]


MESHES = [
    pytest.param(dict(data=2, expert=2, tensor=2), id="dp2_ep2_tp2"),
    pytest.param(dict(expert=8), id="ep8"),
    pytest.param(dict(data=4, tensor=2), id="dp4_tp2"),  # expert 1: the block data-parallel
]


@needs_8
@pytest.mark.parametrize("shape", MESHES)
def test_generate_matches_one_device(shape, monkeypatch):
  """bf16 policy in float32, decode_impl "xla" (the params' experts, stacked per run): every
  greedy token and every layer's routing as on one device, log-probs within float32 summation
  order (the MoE output is summed over devices, and XLA runs the dense layers on the token
  shards: ~1e-6, far below the gaps between the top tokens); layer 0's routing bit for bit.
  Only the mesh engine traces its MoE blocks expert-parallel, with its experts split."""
  config = M.tiny(vocab_size=128)
  params = _params(config)
  mesh = _mesh(shape)
  ep = mesh.shape["expert"]
  traced = _count_ep_traces(monkeypatch)
  ref = InProcessEngine(params, config, record_routing=True, max_batch=4)
  prompts = [p[:n] for p, n in zip(_prompts(4, 12, 128), (12, 7, 9, 3))]
  sp = SamplingParams(max_new_tokens=16, temperature=0.0)
  want = ref.generate(prompts, sp)
  assert not traced  # control: no mesh, no expert parallelism
  eng = InProcessEngine(params, config, record_routing=True, max_batch=4, mesh=mesh)
  experts = ("gate_proj", "up_proj", "down_proj")
  for run in eng.layers:
    _assert_sharded_along_experts([run["moe"][n][...] for n in experts], config.num_experts, ep)
  others = [a for path, a in jax.tree_util.tree_flatten_with_path((eng.params, eng.layers))[0]
            if not any(getattr(k, "key", None) in experts for k in path)]
  assert others and all(a.sharding.is_fully_replicated for a in others)
  got = eng.generate(prompts, sp)
  assert traced, "the mesh engine did not run its MoE blocks expert-parallel"
  assert len({tuple(s.tokens) for s in want}) == len(want)  # not one degenerate sequence
  for x, y in zip(want, got):
    assert x.tokens == y.tokens and len(x.tokens) == 16
    np.testing.assert_allclose(y.logprobs, x.logprobs, rtol=0, atol=1e-4)
  ra, rb = ref.last_guidance["routing"], eng.last_guidance["routing"]
  assert set(ra) == set(rb) == set(range(config.num_hidden_layers))
  assert_bits_equal(rb[0], ra[0], "layer 0 routing")
  for layer in ra:
    np.testing.assert_array_equal(rb[layer], ra[layer], f"layer {layer} routing")


@needs_8
def test_session_matches_one_device_and_compiles_each_turn_shape_once():
  """A three-turn session on dp2 x ep4 (bf16 policy in float32): the one-device engine's
  greedy tokens and routing records. Between turns the session's cache and records lie split
  along the batch as `open_session` placed them (the 2 sequences over `data`: each device
  holds its own sequence's cache), so each turn's inputs have the last turn's shardings: the
  turns' two chunk shapes (a prompt-length chunk, then the pending token alone) compile two
  programs, as on one device."""
  config = M.tiny(vocab_size=128)
  params = _params(config)
  sp = [SamplingParams(max_new_tokens=6, temperature=0.0)] * 2
  results = []
  for mesh in (None, _mesh(dict(data=2, expert=4))):
    eng = InProcessEngine(params, config, max_batch=2, record_routing=True, mesh=mesh)
    s = eng.open_session(2, 40)
    out = eng.extend(s, [0, 1], [[3, 4, 5], [7, 8]], sp)
    out += eng.extend(s, [0, 1], [[11, 12, 13, 14], [15]], sp)
    out += eng.extend(s, [0, 1], [[], []], sp)  # the pending tokens only: one decode step
    eng.close_session(s, [[1], [2]])
    results.append(([x.tokens for x in out], eng.last_guidance["routing"]))
  assert eng._programs.extend._cache_size() == 2 and eng._programs.feed._cache_size() == 1
  assert s.cache is None and not s.turns  # closed: the cache freed, the records emitted
  s = eng.open_session(2, 40)
  eng.extend(s, [0, 1], [[3, 4, 5], [7, 8]], sp)
  (turn,) = s.turns
  for tree, dim in ((s.cache, 1), ((turn.chunk, turn.steps), 0)):  # runs' stacks [L, B, ...];
    for a in jax.tree.leaves(tree):                                # a turn's records [B, ...]
      assert a.sharding.spec == PartitionSpec(*([None] * dim), "data"), a.sharding
      assert a.addressable_shards[0].data.shape[dim] == 1, a.shape
  (want, ra), (got, rb) = results
  assert got == want
  for layer in ra:
    np.testing.assert_array_equal(rb[layer], ra[layer], f"layer {layer} routing")


@needs_8
def test_fp4_trace_kernel_decode_records_match_one_device(monkeypatch):
  """fp4_trace with decode_impl="kernel" (packed NVFP4 experts made once, split along E;
  prefill through XLA on them, decode steps through the decode kernel inside the
  expert-parallel block), every site recorded (audit), BF16 as the rollout runs, on dp2 x ep4
  (prefill's 32 tokens split over data x expert and gathered per expert group; a decode
  step's 2 over data only, each device running all of its group's tokens): the records of
  layer 0 (routing, moe_in, k, v, expert_mid) equal the one-device engine's bit for bit on
  every position both fed the same tokens. One layer (guided): the only one whose inputs are the
  same bits on the mesh (a deeper layer's differ in summation order: layer 0's MoE output is
  summed over devices, the dense layers run on the token shards, and an FP4 site input one
  BF16 ulp off can round to the neighbouring code), and each layer more compiles into both
  engines' programs (a deeper layer's records' layout on a mesh:
  test_expert_parallel.test_records_match_one_device). Log-probs differ in summation order
  only; greedy paths could part at a near tie of the tiny random model's flat distribution.
  The mesh engine writes the packed cache with `kv_append` (kv_write="kernel"), inside
  `batch_local`'s shard_map."""
  config = M.tiny(policy="fp4_trace", dtype="bfloat16", num_hidden_layers=1, vocab_size=128,
                  decode_impl="kernel")
  params = _params(config)
  mesh = _mesh(dict(data=2, expert=4))
  kw = dict(audit_fraction=1.0, record_routing=True, max_batch=2)
  traced = _count_ep_traces(monkeypatch)
  ref = InProcessEngine(params, config, **kw)
  # The mesh engine writes its k/v sites and records with `kv_append` (kv_write="kernel"): the
  # same bits as the one-device engine's site kernel and scatters.
  eng = InProcessEngine(params, config.replace(kv_write="kernel"), mesh=mesh, **kw)
  for run in eng.experts:
    assert run.packed
    _assert_sharded_along_experts((run.gate_up, run.down), config.num_experts, 4)
    assert all(a.sharding.is_fully_replicated for a in jax.tree.leaves(run.attention))
  prompts = _prompts(2, 9, 128)
  sp = SamplingParams(max_new_tokens=32, temperature=0.0)
  want = ref.generate(prompts, sp)
  assert not traced
  _assert_kernels_run_per_shard(eng, prompts, sp, {
      "nvfp4_quantize_rows", "nvfp4_kv_append", "grouped_matmul_decode",
      "grouped_matmul_decode_fp4", "decode_attention_scores_nvfp4", "decode_attention_pv_nvfp4"})
  got = eng.generate(prompts, sp)
  assert traced
  same = []  # per sequence: positions fed the same tokens (prompt + the common completion)
  for x, y in zip(want, got):
    n = next((i for i, (u, v) in enumerate(zip(x.tokens, y.tokens)) if u != v), len(x.tokens))
    assert n >= 4, f"greedy tokens part at step {n}"  # seen: 32 of 32
    # Log-probs agree up to and including the first step that picks differently.
    np.testing.assert_allclose(y.logprobs[:n + 1], x.logprobs[:n + 1], rtol=0, atol=0.2)
    same.append(len(x.prompt) + n)
  ga, gb = ref.last_guidance, eng.last_guidance
  counts = ga["token_counts"]
  assert gb["token_counts"] == counts
  for a, b in zip(_rows(ga["routing"][0], counts, same), _rows(gb["routing"][0], counts, same)):
    assert_bits_equal(b, a, "layer 0 routing")
  sites = ga["audit"]["guidance"][0]
  assert set(sites) == {"moe_in", "expert_mid", "k", "v"}
  for site, rec in sites.items():
    other = gb["audit"]["guidance"][0][site]
    assert jax.tree.structure(other) == jax.tree.structure(rec)
    for a, b in zip(_rows(rec, counts, same), _rows(other, counts, same)):
      for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert_bits_equal(v, u, f"layer 0 {site}")
  for layer, sites in ga["audit"]["guidance"].items():  # every layer: the one-device layout
    for site, rec in sites.items():
      other = gb["audit"]["guidance"][layer][site]
      assert [(u.shape, u.dtype) for u in jax.tree.leaves(other)] == [
          (u.shape, u.dtype) for u in jax.tree.leaves(rec)], (layer, site)


def _assert_kernels_run_per_shard(eng, prompts, sp, names: set[str]) -> None:
  """Every Pallas kernel of the engine's generation program runs inside a shard_map body (the
  expert-parallel block's or `batch_local`'s): on the GPU a kernel outside one would run on the
  whole batch on every device, its operands (the KV cache) gathered first. names: the kernels
  the program must hold."""
  calls = pallas_calls(eng.trace_generate(prompts, sp).jaxpr)
  assert {n for n, _ in calls} == names, calls
  outside = sorted({n for n, inside in calls if not inside})
  assert not outside, f"kernels outside any shard_map: {outside}"


@needs_8
@pytest.mark.parametrize("shape", [pytest.param(dict(data=2, expert=4), id="dp2_ep4"),
                                   pytest.param(dict(data=4), id="dp4")])
def test_fp8_kernel_engine_runs_every_kernel_per_shard(shape):
  """fp8_unified with the FP8 GEMM kernel (`fp8_gemm="kernel"`) and the decode kernels at batch
  4: the dense FP8 projections, the attention kernels and lm_head run on each device's own
  sequences, the grouped FP8 experts in the MoE block (expert-parallel on dp2 x ep4,
  data-parallel on dp4: every expert on each device)."""
  config = M.tiny(policy="fp8_unified", dtype="bfloat16", num_hidden_layers=2, vocab_size=128,
                  decode_impl="kernel", fp8_gemm="kernel", moe_intermediate_size=128,
                  head_dim=64)
  eng = InProcessEngine(_params(config), config, max_batch=4, mesh=_mesh(shape))
  _assert_kernels_run_per_shard(eng, _prompts(4, 9, 128), SamplingParams(max_new_tokens=4), {
      "fp8_gemm", "fp8_grouped_gemm", "grouped_matmul_decode", "decode_attention_scores",
      "decode_attention_pv"})


@needs_8
def test_kernel_decode_runs_the_local_experts_in_the_block():
  """decode_impl="kernel" on ep8: a decode step's expert kernels run inside the
  expert-parallel block on each device's experts (E / 8 of the run's stack); bf16 policy in
  float32: the one-device kernel engine's greedy tokens; no collective of the compiled
  program carries expert weights."""
  config = M.tiny(vocab_size=128, decode_impl="kernel")
  params = _params(config)
  mesh = _mesh(dict(expert=8))
  eng = InProcessEngine(params, config, max_batch=2, mesh=mesh)
  (run,) = eng.experts
  _assert_sharded_along_experts((run.gate_up, run.down), config.num_experts, 8)
  cache = M.init_cache(config, 2, 8)
  step = lambda e, s, c: M.decode_step(eng.params, config, c, np.zeros(2, np.int32),
                                       np.zeros(2, np.int32), experts=e, layers=s).logits
  with mesh_context.use_mesh(mesh, sharding.ENGINE_RULES):
    jaxpr = jax.make_jaxpr(step)(eng.experts, eng.layers, cache).jaxpr
  blocks = [eqn.params["jaxpr"] for eqn in _eqns(jaxpr) if eqn.primitive.name == "shard_map"]
  assert len(blocks) == len(M.layer_runs(config))  # one scan body per run of layers
  for block in blocks:  # gate/up and down of the block's local experts
    assert count_eqns(block, "pallas_call") == 2
    shapes = [v.aval.shape for v in block.invars]
    assert (config.num_hidden_layers, config.num_experts // 8,
            2 * config.moe_intermediate_size, config.hidden_size) in shapes
  ref = InProcessEngine(params, config, max_batch=2)
  prompts = _prompts(2, 9, 128)
  sp = SamplingParams(max_new_tokens=8, temperature=0.0)
  for x, y in zip(ref.generate(prompts, sp), eng.generate(prompts, sp)):
    assert x.tokens == y.tokens
    np.testing.assert_allclose(y.logprobs, x.logprobs, rtol=0, atol=1e-4)
  # The prepared stacks stay where they lie (the detector's control: the next test).
  assert not _expert_matrices(eng.lower_generate(prompts, sp).compile().as_text(), config)


def _eqns(jaxpr):
  """Every equation of a jaxpr and of the jaxprs nested in it (scan / jit bodies)."""
  for eqn in jaxpr.eqns:
    yield eqn
    for v in eqn.params.values():
      for sub in v if isinstance(v, (tuple, list)) else (v,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          yield from _eqns(sub.jaxpr)
        elif isinstance(sub, jax.extend.core.Jaxpr) and eqn.primitive.name != "shard_map":
          yield from _eqns(sub)


@needs_8
def test_engine_program_never_moves_expert_weights():
  """The mesh engine's compiled generation program (dp2 x ep4) has no collective carrying
  expert weight matrices; the same program traced without the expert-parallel block (XLA's
  own partitioning of the split experts) moves them (the tiled grouped matmul's per-tile
  weights, all-reduced): the detector sees them."""
  config = M.tiny(vocab_size=128)
  mesh = _mesh(dict(data=2, expert=4))
  eng = InProcessEngine(_params(config), config, max_batch=4, mesh=mesh)
  prompts = _prompts(4, 9, 128)
  sp = SamplingParams(max_new_tokens=4, temperature=0.0)
  hlo = eng.lower_generate(prompts, sp).compile().as_text()
  assert sharding.collectives(hlo)  # the tokens do move
  assert not _expert_matrices(hlo, config)
  args, kw = eng._generate_args(prompts, [sp] * len(prompts))
  plain = jax.jit(functools.partial(decode.generate.__wrapped__), static_argnames=decode._STATIC)
  assert _expert_matrices(plain.lower(*args, **kw).compile().as_text(), config)


def test_mesh_that_does_not_divide_the_experts_is_refused():
  if len(jax.devices()) < 3:
    pytest.skip("needs 3 devices")
  config = M.tiny()
  with pytest.raises(ValueError, match="do not split"):
    InProcessEngine(None, config, mesh=_mesh(dict(expert=3)))
