"""Shared pytest fixtures for the whole suite (keep this file small)."""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import pytest

# JAX's persistent compilation cache is off in the suite unless asked for
# (TRACE_TEST_COMPILE_CACHE=1; or JAX_COMPILATION_CACHE_DIR set by hand). Writing an entry
# serializes the executable, and a serialization that threw a C++ exception crashed in libgcc's
# unwinder in CI (a worker hung in tvm_ffi's SIGSEGV handler, or aborted; WORKSPACE.md, Traps).
# Shared between the xdist workers it had made the suite ~10% faster.
if os.environ.get("TRACE_TEST_COMPILE_CACHE") == "1" and \
    "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  jax.config.update("jax_compilation_cache_dir",
                    str(Path(__file__).resolve().parent.parent / ".pytest_cache" / "jax"))
  # Every program, not only those compiling in over 1 s (JAX's default): eager code
  # (interpret-mode kernels, eager scans) compiles the same small programs dozens of times.
  if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

# Shared test helpers live next to the quantization tests (`tests/quant/cases.py`); make them
# importable as `cases` from every test directory, whatever the import mode.
_QUANT_TESTS = str(Path(__file__).resolve().parent / "quant")
if _QUANT_TESTS not in sys.path:
  sys.path.insert(0, _QUANT_TESTS)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs() -> Iterator[None]:
  """Drops every compiled program after each test module. A worker that kept them all held
  ~7 GB by the end of the suite, and CI runs lost a worker at 94-97% to a C++ abort or hang
  inside XLA on the 23 GB, swap-free CI machine (WORKSPACE.md, Traps); a module's own programs
  stay cached while it runs."""
  yield
  jax.clear_caches()
  gc.collect()


@pytest.fixture(scope="session")
def torch_device() -> Any:
  """The torch device of the twin tests: env TRACE_TORCH_DEVICE (default "cpu")."""
  torch = pytest.importorskip("torch")
  return torch.device(os.environ.get("TRACE_TORCH_DEVICE", "cpu"))


@pytest.fixture(scope="session")
def bpe_tokenizer(tmp_path_factory) -> Callable[..., str]:
  """make(bos=False, eos=True) -> directory of a small byte-level BPE HF tokenizer (vocab
  <= 400) trained on reasoning-task text, as `save_pretrained` lays it out; built once per
  variant."""
  built: dict[tuple[bool, bool], str] = {}

  def make(bos: bool = False, eos: bool = True) -> str:
    if (bos, eos) not in built:
      import json

      from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

      from trace_jax.rl import tasks
      task = tasks.get_task("reasoning", difficulty=1)
      text = [p.prompt + task.demonstration(p) for p in task.sample(0, 300)]
      tok = Tokenizer(models.BPE())
      tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
      tok.decoder = decoders.ByteLevel()
      special = (["<|endoftext|>"] if eos else []) + (["<s>"] if bos else [])
      tok.train_from_iterator(text, trainers.BpeTrainer(
          vocab_size=400, special_tokens=special,
          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
      path = tmp_path_factory.mktemp(f"bpe_bos{int(bos)}_eos{int(eos)}")
      tok.save(str(path / "tokenizer.json"))
      cfg = {"eos_token": "<|endoftext|>", **({"bos_token": {"content": "<s>"}} if bos else {})}
      (path / "tokenizer_config.json").write_text(json.dumps(cfg))
      built[(bos, eos)] = str(path)
    return built[(bos, eos)]

  return make


def pytest_collection_modifyitems(config, items):
  """The notebooks' tests first (stable order otherwise): each notebook runs 20-50 s in its own
  kernel, and collected last of their half they ran back to back at the end of one xdist worker
  while the other, having stolen the short tests queued behind them, sat idle."""
  del config
  items.sort(key=lambda item: item.path.parent.name != "notebooks")
