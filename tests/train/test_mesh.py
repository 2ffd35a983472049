"""Training on an 8-device CPU mesh from `cfg.mesh`: params sharded, each step compiled once."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from test_rl_loop import tiny_cfg  # tests/train is on sys.path (pytest's prepend mode)

from trace_jax.model import expert_parallel
from trace_jax.train import learner as learner_lib
from trace_jax.train import rl_loop
from trace_jax.train import step as step_lib

needs_8 = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices: run with "
                             "XLA_FLAGS=--xla_force_host_platform_device_count=8")


def mesh_cfg():
  c = tiny_cfg()  # sft.steps 2: the single-device SFT below is the one other tests compile
  c.rl.steps = 2
  c.mesh = dict(data=1, fsdp=2, expert=2, tensor=2)
  return c


@needs_8
def test_sft_and_rl_on_a_mesh_compile_each_step_once(tmp_path, monkeypatch):
  cfg = mesh_cfg()
  traced = []  # the MoE blocks the steps trace expert-parallel (the mesh's expert axis is 2)
  ep_moe = expert_parallel.moe
  monkeypatch.setattr(expert_parallel, "moe", lambda *a, **k: traced.append(1) or ep_moe(*a, **k))
  sft_before = step_lib.sft_step._cache_size()
  params, hist = rl_loop.run_sft(cfg, "unused", progress=False)
  assert traced, "the SFT step did not run its MoE blocks expert-parallel"
  # 2 steps, one program: the state's shardings are the step's declared in/out shardings.
  assert step_lib.sft_step._cache_size() - sft_before == 1
  leaves = jax.tree.leaves(params)
  assert all(isinstance(a.sharding, NamedSharding) for a in leaves)
  assert any(len(a.sharding.device_set) == 8 and not a.sharding.is_fully_replicated
             for a in leaves), "nothing is sharded"
  # The same SFT on one device: the mesh changes the partitioning, not the maths.
  _, hist1 = rl_loop.run_sft(tiny_cfg(), "unused", progress=False)
  np.testing.assert_allclose([h["loss"] for h in hist], [h["loss"] for h in hist1], rtol=2e-3)

  meshes = []  # the learner's rollout engine runs on the config's mesh (expert-parallel)
  engine_cls = learner_lib.InProcessEngine
  monkeypatch.setattr(learner_lib, "InProcessEngine",
                      lambda *a, **k: meshes.append(k.get("mesh")) or engine_cls(*a, **k))
  grpo_before = step_lib.grpo_step._cache_size()
  out = rl_loop.run_rl(cfg, str(tmp_path), "bf16", params, progress=False)
  assert meshes and meshes[0] is not None and meshes[0].shape["expert"] == 2, meshes
  assert step_lib.grpo_step._cache_size() - grpo_before == 1
  assert len(out["history"]) == 2 and all(np.isfinite(r["loss"]) for r in out["history"])


@needs_8
def test_reference_logprobs_run_expert_parallel_on_the_params_mesh(monkeypatch):
  """The KL term's reference log-probs on params sharded over a mesh run the MoE blocks
  expert-parallel (a jit of their own per mesh: one traced off the mesh would leave the
  experts to XLA's partitioner), within float32 summation order of one device's."""
  from trace_jax import model as M
  from trace_jax.model import sharding
  config = M.tiny(num_hidden_layers=1, vocab_size=128)
  params = M.init_params(config, 0)
  toks = np.random.default_rng(0).integers(0, 128, (8, 9)).astype(np.int32)
  want = step_lib.reference_logprobs(params, config, toks[:, :-1], toks[:, 1:])
  traced = []
  ep_moe = expert_parallel.moe
  monkeypatch.setattr(expert_parallel, "moe", lambda *a, **k: traced.append(1) or ep_moe(*a, **k))
  mesh = sharding.make_mesh(dict(data=2, expert=4), jax.devices()[:8])
  got = step_lib.reference_logprobs(sharding.shard_params(params, mesh), config, toks[:, :-1],
                                    toks[:, 1:])
  assert traced, "the reference forward did not run its MoE blocks expert-parallel"
  assert got.shape == want.shape == (8, 8)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5)


@needs_8
def test_step_takes_the_batch_split_along_the_batch_axes():
  """On a mesh a step's batch goes in split over data x fsdp x expert (data parallel), not
  replicated: an elementwise output keeps its input's layout (8 rows: one per device)."""
  from trace_jax.model import sharding
  mesh = sharding.make_mesh(dict(data=2, fsdp=2, expert=2), jax.devices()[:8])
  counter = jax.device_put(np.zeros((), np.int32), NamedSharding(mesh, PartitionSpec()))
  state = step_lib.TrainState(step=counter, params={}, opt_state=())
  probe = step_lib.ShardedStep(lambda st, b: (st, b["x"] + 1), 2)
  _, y = probe(state, {"x": np.arange(8 * 3, dtype=np.float32).reshape(8, 3)})
  assert y.sharding.spec == PartitionSpec(("data", "fsdp", "expert"))
  assert y.addressable_shards[0].data.shape == (1, 3)
  np.testing.assert_array_equal(np.asarray(y), np.arange(24, dtype=np.float32).reshape(8, 3) + 1)
