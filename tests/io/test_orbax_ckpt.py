"""Orbax checkpoints: exact dtypes and bits, async save, config round trip, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.io.checkpoint_damage import garble_largest_array, stale_params, truncate_arrays
from trace_jax import model as M
from trace_jax.io import orbax_ckpt


def _mixed_params(config):
  """float32 master weights with bf16 norms: dtypes must come back per parameter."""
  params = M.init_params(config, 0)
  return jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.ndim == 1 else x, params)


def test_round_trip_exact(tmp_path):
  config = M.tiny(policy="fp4_trace", guided_layers=(0,), guidance_mode="full")
  params = _mixed_params(config)
  pending = orbax_ckpt.save_orbax(str(tmp_path / "ckpt"), config, params)
  path = pending.wait()
  got_config, got = orbax_ckpt.load_orbax(path)
  assert got_config == config
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(got), strict=True):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
  assert orbax_ckpt.read_orbax_config(path) == config


def test_restore_sharded(tmp_path):
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 devices")
  from trace_jax.model import sharding
  config = M.tiny()
  params = M.init_params(config, 1)
  path = orbax_ckpt.save_orbax(str(tmp_path / "ckpt"), config, params, wait=True).path
  mesh = sharding.make_mesh(dict(data=2, expert=2, tensor=2), jax.devices()[:8])
  _, got = orbax_ckpt.load_orbax(path, mesh=mesh)
  gate = got["layers"][0]["moe"]["gate_proj"].get_value()
  assert gate.sharding.spec[0] == "expert"
  np.testing.assert_array_equal(gate, params["layers"][0]["moe"]["gate_proj"].get_value())


def test_not_a_checkpoint(tmp_path):
  with pytest.raises(FileNotFoundError, match="not a trace_jax orbax checkpoint"):
    orbax_ckpt.load_orbax(str(tmp_path))


REFUSED = r"differs from its recorded digest|could not be decoded"


@pytest.mark.parametrize("damage, message", [
    ("garbled", REFUSED),
    ("truncated", r"good: the data of \['\w+'\].* could not be decoded \(Requested byte range"),
    ("stale", r"good: the content of \['embed'\]\['embedding'\] and 17 more differs from its "
              r"recorded digest"),
], ids=["garbled_bytes", "truncated_files", "stale_params"])
def test_damaged_params_do_not_load(tmp_path, damage, message):
  """64 garbled bytes (they decode into other values or not at all), files cut in half (they
  no longer decode), another checkpoint's data under this one's metadata (decodes whole, only
  the digests tell): each raises CheckpointError naming the checkpoint and the parameter."""
  from trace_jax.io import hf
  config = M.tiny()
  path = orbax_ckpt.save_orbax(str(tmp_path / "good"), config, M.init_params(config, 0),
                               wait=True).path
  if damage == "garbled":
    garble_largest_array(tmp_path / "good")
  elif damage == "truncated":
    truncate_arrays(tmp_path / "good")
  else:
    orbax_ckpt.save_orbax(str(tmp_path / "other"), config, M.init_params(config, 1), wait=True)
    stale_params(tmp_path / "good", tmp_path / "other")
  with pytest.raises(hf.CheckpointError, match=message):
    orbax_ckpt.load_orbax(path)


def test_read_failure_names_the_parameter_of_the_innermost_error():
  inner = ValueError('FAILED_PRECONDITION: Error reading "layers.1.moe.gate_proj/0.0.0" in OCDBT '
                     'database at local file "/x/params/": ZSTD_decompressStream() failed: Data '
                     'corruption detected; at byte 0')
  try:
    try:
      raise inner
    except ValueError as e:
      raise Exception("Encountered error while reading array index: (slice(0, 8, 1),)") from e
  except Exception as outer:  # noqa: BLE001
    got = orbax_ckpt._read_failure(outer)
  assert got == ("the data of ['layers']['1']['moe']['gate_proj'] could not be decoded "
                 "(ZSTD_decompressStream() failed: Data corruption detected)")
  assert orbax_ckpt._read_failure(OSError("disk gone")) == (
      "the parameter data could not be read (disk gone)")


def test_non_finite_params_do_not_load(tmp_path):
  from trace_jax.io import hf
  config = M.tiny()
  params = M.init_params(config, 0)
  flat = hf.flatten_params(params)
  key = next(k for k in flat if "up" in str(k))
  flat[key] = flat[key].at[0, 0, 1].set(jnp.inf)
  bad = hf.params_from_flat(config, flat)
  path = orbax_ckpt.save_orbax(str(tmp_path / "inf"), config, bad, wait=True).path
  with pytest.raises(hf.CheckpointError, match=r"holds non-finite values \(NaN or Inf\) in "
                                               r"\['layers'\]"):
    orbax_ckpt.load_orbax(path)
