"""Orbax checkpoints of model params plus their ModelConfig, dtype-exact, saved asynchronously.

Layout of a checkpoint directory: `params/` (orbax standard pytree: the parameter state as a
nested dict with string keys), `meta/` (JSON: the full ModelConfig, each parameter's dtype and
each parameter's content digest, `trace_jax.io.integrity`). Restoring builds the target from
the stored config and dtypes, so every array comes back with the exact dtype and bits it was
saved with, optionally sharded onto a mesh. A parameter whose bits differ from its digest (a
garbled or stale file) or that holds NaN/Inf, and array data that no longer decodes, are
refused with `CheckpointError` naming the checkpoint (and the parameter where known).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import traverse_util

from trace_jax.io import integrity
from trace_jax.io.hf import CheckpointError, flatten_params, params_from_flat
from trace_jax.model import abstract_params
from trace_jax.model.config import ModelConfig
from trace_jax.model.sharding import param_shardings

FORMAT = "trace_jax.params.v1"


def _key(path: tuple[Any, ...]) -> str:
  return "/".join(str(p) for p in path)


def _path(key: str) -> tuple[Any, ...]:
  return tuple(int(p) if p.isdigit() else p for p in key.split("/"))


def _string_tree(flat: dict[tuple[Any, ...], Any]) -> dict[str, Any]:
  return traverse_util.unflatten_dict({tuple(str(p) for p in k): v for k, v in flat.items()})


class PendingSave:
  """Handle of an asynchronous save; `wait()` blocks until the checkpoint is complete."""

  def __init__(self, checkpointer: ocp.AsyncCheckpointer, path: str):
    self._ckptr, self.path = checkpointer, path

  def wait(self) -> str:
    self._ckptr.wait_until_finished()
    self._ckptr.close()
    return self.path


def save_orbax(path: str, config: ModelConfig, params: Any, *, wait: bool = False) -> PendingSave:
  """Starts saving params + config to `path` (absolute or relative) and returns at once.

  The device arrays are copied to host before returning, so `params` may be donated or
  changed afterwards; call `.wait()` (or pass wait=True) before reading the checkpoint.
  """
  path = os.path.abspath(path)
  flat = flatten_params(params)
  tree = _string_tree(flat)
  meta = {"format": FORMAT, "config": dataclasses.asdict(config),
          "dtypes": {_key(k): jnp.dtype(v.dtype).name for k, v in flat.items()},
          "digest_version": integrity.DIGEST_VERSION, "digests": integrity.tree_digests(tree)}
  ckptr = ocp.AsyncCheckpointer(ocp.CompositeCheckpointHandler())
  ckptr.save(path, args=ocp.args.Composite(params=ocp.args.StandardSave(tree),
                                           meta=ocp.args.JsonSave(meta)), force=True)
  pending = PendingSave(ckptr, path)
  if wait:
    pending.wait()
  return pending


def read_orbax_config(path: str) -> ModelConfig:
  """The ModelConfig stored in an orbax checkpoint."""
  return _config(_read_meta(path))


def _read_meta(path: str) -> dict[str, Any]:
  path = os.path.abspath(path)
  if not os.path.isdir(os.path.join(path, "meta")):
    raise FileNotFoundError(f"{path}: not a trace_jax orbax checkpoint (no meta/ item)")
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    meta = ckptr.restore(path, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  if meta.get("format") != FORMAT:
    raise CheckpointError(f"{path}: unknown checkpoint format {meta.get('format')!r}")
  return meta


def _config(meta: dict[str, Any]) -> ModelConfig:
  c = dict(meta["config"])
  if c.get("guided_layers") is not None:
    c["guided_layers"] = tuple(c["guided_layers"])
  return ModelConfig(**c)


def _read_failure(e: BaseException) -> str:
  """One line for a restore that failed to read the array data: the innermost error (orbax
  wraps tensorstore's), naming the stored parameter where tensorstore does."""
  while e.__cause__ is not None:
    e = e.__cause__
  text = " ".join(str(e).split()) or type(e).__name__
  text = text.split(" [tensorstore_spec")[0]
  m = re.search(r'Error reading "([^"/]+)/[^"]*"', text)
  if m:
    reason = text.rsplit('": ', 1)[-1].split(";")[0][:160]
    name = "".join(f"[{p!r}]" for p in m.group(1).split("."))
    return f"the data of {name} could not be decoded ({reason})"
  return f"the parameter data could not be read ({text[:200]})"


def load_orbax(path: str, *, mesh: jax.sharding.Mesh | None = None) -> tuple[ModelConfig, Any]:
  """(config, params) of a checkpoint written by `save_orbax`, dtypes exactly as saved."""
  path = os.path.abspath(path)
  meta = _read_meta(path)
  config = _config(meta)
  abstract = flatten_params(abstract_params(config))
  dtypes = {_path(k): v for k, v in meta["dtypes"].items()}
  if set(dtypes) != set(abstract):
    raise CheckpointError(f"{path}: stored parameters do not match the stored config: missing "
                          f"{sorted(map(_key, set(abstract) - set(dtypes)))[:5]}, unexpected "
                          f"{sorted(map(_key, set(dtypes) - set(abstract)))[:5]}")
  if mesh is None:
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shard = {k: dev for k in abstract}
  else:
    shard = flatten_params(param_shardings(_string_tree(abstract), mesh))
    shard = {_path(_key(k)): v for k, v in shard.items()}
  target = {k: jax.ShapeDtypeStruct(v.shape, jnp.dtype(dtypes[k]), sharding=shard[k])
            for k, v in abstract.items()}
  try:
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
      got = ckptr.restore(path, args=ocp.args.Composite(
          params=ocp.args.StandardRestore(_string_tree(target))))["params"]
  except Exception as e:  # noqa: BLE001 - orbax re-raises tensorstore decode errors as Exception
    raise CheckpointError(f"{path}: {_read_failure(e)}") from e
  try:
    if meta.get("digest_version") == integrity.DIGEST_VERSION:
      integrity.verify_digests(got, meta["digests"])
    integrity.check_finite(got, "the checkpoint")
  except integrity.IntegrityError as e:
    raise CheckpointError(f"{path}: {e}") from e
  flat = {_path(_key(k)): v for k, v in traverse_util.flatten_dict(got).items()}
  return config, params_from_flat(config, flat)
