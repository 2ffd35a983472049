"""The project's config files as the launchers parse them (shared by the config tests)."""

import pathlib

from absl import flags
from ml_collections import config_flags

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"
CONFIG_FILES = sorted(p.name for p in CONFIGS.glob("*.py") if p.name != "__init__.py")


def parsed(name: str, *overrides: str):
  """The config file `name` as a launcher's `--config` flag parses it, with `overrides`
  (`--config.x=v` flags)."""
  argv = ["prog", f"--config={CONFIGS / name}", *overrides]
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", flag_values=fv, sys_argv=argv)
  fv(argv)
  return fv.config
