"""Import-only placeholder for `torchvision`, for importing SGLang's classes on CPU test machines.

SGLang 0.5.23 imports torchvision at module level through its multimodal config modules
(`sglang/srt/configs/__init__.py` -> `nano_nemotron_vl.py` -> `multimodal/internvl_utils.py`),
which `sglang.srt.layers.quantization` reaches. The PyPI torchvision wheels fail to import
beside CPU torch 2.13 ("operator torchvision::nms does not exist"), and an unpinned
`pip install torchvision` replaces torch with a CUDA build plus ~3 GB of NVIDIA libraries. No
code path the plugin tests exercise uses torchvision, so `tests/rollout_bridge/
test_sglang_plugin.py` puts this directory first on `sys.path`, in that test module only.

Every `torchvision.<anything>` submodule imports as a placeholder module whose attributes are
placeholder classes (their attributes are placeholders too); calling one raises. Transformers
5.x finds this package (`importlib.util.find_spec`) and builds its interpolation tables from
`torchvision.transforms.InterpolationMode` at import; those only reference placeholders.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.28.0"


class _PlaceholderMeta(type):
  """Class-level attribute access (enum members such as `InterpolationMode.BILINEAR`) gives
  further placeholders, so module-level tables that only reference them import fine."""

  def __getattr__(cls, name: str):
    if name.startswith("__"):
      raise AttributeError(name)
    value = _PlaceholderMeta(name, (_Placeholder,), {"__module__": cls.__module__})
    setattr(cls, name, value)
    return value


class _Placeholder(metaclass=_PlaceholderMeta):
  """Stands in for any torchvision class, enum member or function; raises when called."""

  def __init__(self, *args, **kwargs):
    raise RuntimeError("torchvision placeholder (tests/rollout_bridge/_stubs): the real "
                       "torchvision is not installed on this CPU test machine")

  def __class_getitem__(cls, item):
    return cls


class _PlaceholderModule(types.ModuleType):
  """A module whose every public attribute is a fresh placeholder class."""

  def __getattr__(self, name: str):
    if name.startswith("__"):
      raise AttributeError(name)
    value = _PlaceholderMeta(name, (_Placeholder,), {"__module__": self.__name__})
    setattr(self, name, value)
    return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """Resolves `torchvision.*` submodules to placeholder packages."""

  def find_spec(self, fullname, path=None, target=None):
    if fullname.startswith(__name__ + "."):
      return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
    return None

  def create_module(self, spec):
    mod = _PlaceholderModule(spec.name)
    mod.__path__ = []
    return mod

  def exec_module(self, module):
    return None


if not any(isinstance(f, _Finder) for f in sys.meta_path):
  sys.meta_path.insert(0, _Finder())


def __getattr__(name: str):
  if name.startswith("__"):
    raise AttributeError(name)
  return importlib.import_module(f"{__name__}.{name}")
