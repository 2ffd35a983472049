"""expert_weights' parameter helpers: leaves an engine holds in another form, emptied."""

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax import model as M
from trace_jax.model import expert_weights


def test_empty_where_empties_exactly_the_chosen_leaves():
  params = {"a": jnp.ones((3, 4), jnp.bfloat16), "b": {"c": jnp.arange(5, dtype=jnp.int32),
                                                       "d": jnp.zeros((2,), jnp.float32)}}
  out = expert_weights.empty_where(params, lambda path: path[0].key == "b")
  assert out["a"] is params["a"]
  for name, dtype in (("c", jnp.int32), ("d", jnp.float32)):
    assert out["b"][name].shape == (0,) and out["b"][name].dtype == dtype
  assert expert_weights.empty_where(params, lambda path: False)["b"]["c"] is params["b"]["c"]


def test_drop_prepared_keeps_all_but_the_experts_and_attention_projections():
  config = M.tiny(policy="fp4_trace", dtype="bfloat16", num_hidden_layers=1)
  params = M.init_params(config, 0)
  dropped = expert_weights.drop_prepared(params, config)
  flat = jax.tree_util.tree_flatten_with_path(dropped)[0]
  before = dict(jax.tree_util.tree_flatten_with_path(params)[0])
  empty = [jax.tree_util.keystr(p) for p, a in flat if a.size == 0 and before[p].size]
  names = sorted(k.split("['")[3].split("'")[0] for k in empty)
  assert names == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                   "v_proj"], empty
  for p, a in flat:
    if a.size:
      np.testing.assert_array_equal(a, before[p])
