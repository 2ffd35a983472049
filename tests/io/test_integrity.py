"""Content digests and the finite-values guard (`trace_jax.io.integrity`)."""

import hashlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from trace_jax.io import integrity

DTYPES = {
    "float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float8_e4m3fn":
    ml_dtypes.float8_e4m3fn, "int32": np.int32, "uint8": np.uint8, "bool": np.bool_,
}


def _array(dtype, shape=(3, 8), seed=0):
  rng = np.random.default_rng(seed)
  if dtype == np.bool_:
    return rng.random(shape) < 0.5
  if np.issubdtype(dtype, np.integer):
    return rng.integers(0, 100, shape).astype(dtype)
  return rng.standard_normal(shape).astype(dtype)


def _flip_bit(a: np.ndarray, index: int, bit: int) -> np.ndarray:
  b = a.copy()
  raw = b.view(np.uint8).reshape(-1)
  raw[index] ^= np.uint8(1 << bit)
  return b


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_every_single_bit_flip_changes_the_digest(dtype):
  """Each bit of every byte of the array, flipped alone, gives another digest (the
  bijective mix makes a one-word change always visible)."""
  a = _array(dtype)
  if dtype == np.bool_:
    variants = [np.logical_not(a)] + [np.where(np.arange(a.size).reshape(a.shape) == i, ~a, a)
                                      for i in range(a.size)]
  else:
    variants = [_flip_bit(a, i, bit) for i in range(a.nbytes) for bit in range(8)]
  base = integrity.tree_digests({"a": a})["['a']"]
  digests = {integrity.tree_digests({"a": v})["['a']"] for v in variants}
  assert base not in digests
  assert len(digests) == len(variants)  # no two single flips collide either


def test_digest_names_dtype_and_shape_and_is_order_sensitive():
  a = np.arange(16, dtype=np.float32)
  d = integrity.tree_digests({"a": a, "b": a[::-1].copy(), "c": a.reshape(4, 4)})
  assert d["['a']"].startswith("float32[16]:") and d["['c']"].startswith("float32[4, 4]:")
  assert d["['a']"].split(":")[1] != d["['b']"].split(":")[1]  # same words, other order
  assert d["['a']"].split(":")[1] == d["['c']"].split(":")[1]  # same bits, another shape


def test_digest_of_a_sharded_array_equals_the_unsharded_one():
  devices = jax.devices()
  if len(devices) < 8:
    pytest.skip("needs 8 devices (make test simulates 8 CPU devices)")
  mesh = jax.sharding.Mesh(np.array(devices).reshape(4, 2), ("data", "model"))
  a = _array(np.float32, (16, 32), seed=3)
  sharded = jax.device_put(a, jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec("data", "model")))
  assert integrity.tree_digests([sharded]) == integrity.tree_digests([a])


def test_verify_names_the_first_changed_leaf_and_the_count():
  tree = {"x": _array(np.float32), "y": _array(np.float32, seed=1), "z": _array(np.int32)}
  expected = integrity.tree_digests(tree)
  integrity.verify_digests(tree, expected)  # unchanged: no error
  bad = dict(tree, y=_flip_bit(tree["y"], 7, 3), z=tree["z"] + 1)
  with pytest.raises(integrity.IntegrityError, match=r"\['y'\] and 1 more differs") as e:
    integrity.verify_digests(bad, expected)
  assert "\n" not in str(e.value)
  with pytest.raises(integrity.IntegrityError, match=r"\['w'\] has no recorded digest"):
    integrity.verify_digests(dict(tree, w=tree["x"]), expected)


def test_digests_are_equal_exactly_when_the_bytes_are():
  """An independent reference: equal arrays have equal digests exactly when their bytes are
  equal (compared with sha256 of the raw bytes) over a set of near-identical arrays."""
  a = _array(np.float32, (4, 8), seed=5)
  arrays = [a, a.copy(), _flip_bit(a, 0, 0), _flip_bit(a, 127, 7), -a, np.zeros_like(a),
            np.negative(np.zeros_like(a))]  # +0 and -0: other bits, other digest
  for x in arrays:
    for y in arrays:
      same_bytes = hashlib.sha256(x.tobytes()).digest() == hashlib.sha256(y.tobytes()).digest()
      same_digest = integrity.tree_digests([x]) == integrity.tree_digests([y])
      assert same_bytes == same_digest


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "neg_inf"])
def test_nonfinite_flags_name_the_first_bad_leaf(bad):
  tree = {"a": np.ones(4, np.float32), "b": {"c": np.ones((2, 3), ml_dtypes.bfloat16),
                                             "d": np.ones(3, np.float32)},
          "n": np.array([2**31 - 1], np.int32)}
  assert integrity.first_nonfinite(tree) is None
  tree["b"]["d"][1] = bad
  tree["b"]["c"][1, 2] = bad
  flags = jax.jit(integrity.nonfinite_flags)(tree)
  assert flags.tolist() == [False, True, True, False]
  assert integrity.first_nonfinite(tree, flags) == "['b']['c']"
  assert integrity.first_nonfinite(tree) == "['b']['c']"
  with pytest.raises(integrity.IntegrityError, match=r"the state holds non-finite .* \['b'\]"):
    integrity.check_finite(tree, "the state")


def test_empty_tree():
  assert integrity.tree_digests({}) == {}
  assert integrity.first_nonfinite({}) is None
  assert jnp.shape(integrity.nonfinite_flags({})) == (0,)
