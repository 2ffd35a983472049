"""Train state placement: one compile of the step whether params come committed or not."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import quickstart
from trace_jax import model as model_lib
from trace_jax.train import batch as batch_lib
from trace_jax.train import rl_loop
from trace_jax.train import step as step_lib


@pytest.mark.parametrize("placement", ["uncommitted", "committed"])
def test_step_compiles_once(placement):
  cfg = quickstart.get_config()
  mc = rl_loop.model_config(cfg, "bf16")
  params = model_lib.init_params(mc, jax.random.key(0), param_dtype=jnp.float32)
  if placement == "committed":  # as orbax restores them
    params = jax.device_put(params, jax.devices()[0])
    assert all(a.committed for a in jax.tree.leaves(params))
  tx = step_lib.make_optimizer(step_lib.OptimConfig(total_steps=4))
  state = step_lib.init_state(params, tx)
  leaves = jax.tree.leaves(state)
  assert len({a.committed for a in leaves}) == 1, "state mixes committed and uncommitted"
  # A batch shape no other test uses, so this test owns the new cache entries.
  rows = 3 if placement == "committed" else 5
  b = batch_lib.sequence_batch([[1, 2, 3]] * rows, [[4, 5, 2]] * rows, 16)
  batch = {k: jnp.asarray(v) for k, v in b.items()}
  before = step_lib.sft_step._cache_size()
  for _ in range(3):
    state, m = step_lib.sft_step(state, batch, config=mc, tx=tx)
  assert np.isfinite(float(m["loss"]))
  assert step_lib.sft_step._cache_size() - before == 1


def test_init_state_traces():
  """init_state works abstractly too (eval_shape: sharding plans, memory estimates)."""
  mc = rl_loop.model_config(quickstart.get_config(), "bf16")
  tx = step_lib.make_optimizer(step_lib.OptimConfig(total_steps=4))
  state = jax.eval_shape(lambda: step_lib.init_state(
      model_lib.init_params(mc, jax.random.key(0), param_dtype=jnp.float32), tx))
  assert state.step.shape == () and state.step.dtype == jnp.int32
