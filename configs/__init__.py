"""Config files (ml_collections, one per experiment) and what they share.

Every file's `model` section holds every `ModelConfig` field (`model_section`), so any field
can be set on the command line of any launcher (`--config.model.decode_impl=kernel`,
`--config.model.plan=reference`); `trace_jax.model.config.resolve` reads the section.
"""

from typing import Any

import ml_collections


def model_section(preset: str = "tiny", **choices: Any) -> ml_collections.ConfigDict:
  """The `model` section of a config file: `trace_jax.model.config.section` (the preset's
  fields, the file's choices over them) as a ConfigDict. guided_layers, None unless chosen (the
  deepest half of the run's layers), is a typed reference so `--config.model.guided_layers`
  takes a tuple."""
  from trace_jax.model import config as config_lib

  fields = config_lib.section(preset, **choices)
  if fields["guided_layers"] is None:
    fields["guided_layers"] = ml_collections.FieldReference(None, field_type=tuple)
  return ml_collections.ConfigDict(fields)


def rl_section(**choices: Any) -> ml_collections.ConfigDict:
  """The `rl` section of a config file: every optional GRPO field at its default
  (`trace_jax.train.run_config.OPTIONAL`: mini-batches, epochs, loss variants, ...) with the
  file's choices over them, so any of them can be set on the command line of any config. A
  default of None is a typed reference, so `--config.rl.clip_eps_high=0.28` takes a float."""
  return _optional_section("rl", {"clip_eps_high": float, "adv_std": str}, choices)


def guidance_section(**choices: Any) -> ml_collections.ConfigDict:
  """The `guidance` section: a budget of guidance bytes per token (None: the model's
  guided_layers; `trace_jax.train.guidance_budget`) and its calibration prompts."""
  return _optional_section("guidance", {"budget_bytes_per_token": float}, choices)


def _optional_section(name: str, types: dict[str, type],
                      choices: dict[str, Any]) -> ml_collections.ConfigDict:
  """Section `name` with every optional field of `run_config.OPTIONAL` under it at its default,
  `choices` over them; a None default of `types` is a typed reference (command-line settable)."""
  from trace_jax.train import run_config

  fields = {path.split(".", 1)[1]: v for path, v in run_config.OPTIONAL.items()
            if path.startswith(f"{name}.")}
  fields.update(choices)
  for k, v in fields.items():
    if v is None and k in types:
      fields[k] = ml_collections.FieldReference(None, field_type=types[k])
  return ml_collections.ConfigDict(fields)
