"""Train state placement: one compile of the step whether params come committed or not."""

import jax
import jax.numpy as jnp
import numpy as np

from configs import quickstart
from trace_jax import model as model_lib
from trace_jax.train import batch as batch_lib
from trace_jax.train import rl_loop
from trace_jax.train import step as step_lib


def test_step_compiles_once_committed_or_not():
  """Uncommitted params (init_params) and committed ones (as orbax restores them) give the same
  state placement: 3 steps from the uncommitted start compile one program, and 3 from the
  committed start run that program (no new one). A state mixing committed and uncommitted
  leaves, or one whose placement differs from the step's outputs, compiles again."""
  cfg = quickstart.get_config()
  mc = rl_loop.model_config(cfg, "bf16")
  tx = step_lib.make_optimizer(step_lib.OptimConfig(total_steps=4))
  # A batch shape no other test uses, so this test owns the new cache entries.
  b = batch_lib.sequence_batch([[1, 2, 3]] * 5, [[4, 5, 2]] * 5, 16)
  batch = {k: jnp.asarray(v) for k, v in b.items()}
  for placement, new_programs in (("uncommitted", 1), ("committed", 0)):
    params = model_lib.init_params(mc, jax.random.key(0), param_dtype=jnp.float32)
    if placement == "committed":
      params = jax.device_put(params, jax.devices()[0])
      assert all(a.committed for a in jax.tree.leaves(params))
    state = step_lib.init_state(params, tx)
    leaves = jax.tree.leaves(state)
    assert len({a.committed for a in leaves}) == 1, f"{placement}: state mixes placements"
    before = step_lib.sft_step._cache_size()
    for _ in range(3):
      state, m = step_lib.sft_step(state, batch, config=mc, tx=tx)
    assert np.isfinite(float(m["loss"])), placement
    assert step_lib.sft_step._cache_size() - before == new_programs, placement


def test_init_state_traces():
  """init_state works abstractly too (eval_shape: sharding plans, memory estimates)."""
  mc = rl_loop.model_config(quickstart.get_config(), "bf16")
  tx = step_lib.make_optimizer(step_lib.OptimConfig(total_steps=4))
  state = jax.eval_shape(lambda: step_lib.init_state(
      model_lib.init_params(mc, jax.random.key(0), param_dtype=jnp.float32), tx))
  assert state.step.shape == () and state.step.dtype == jnp.int32
