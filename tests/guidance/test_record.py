"""The guidance record's format: field shapes and dtypes against the quantizers' own records,
the record as a JAX pytree, and the format modules importing without JAX."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from trace_jax.guidance import record
from trace_jax.guidance.record import Guidance
from trace_jax.quant import formats, qat

CASES = [("nvfp4", "compact", (3, 64)), ("nvfp4", "full", (2, 5, 32)),
         ("mxfp4", "compact", (3, 64)), ("mxfp4", "full", (2, 5, 32))]


@pytest.mark.parametrize("fmt,mode,shape", CASES, ids=[f"{f}_{m}" for f, m, _ in CASES])
def test_field_shapes_and_dtypes_are_the_quantizer_records(fmt, mode, shape):
  """`field_shapes`, `field_dtype`, `bytes_per_row` and `Guidance`'s properties describe what
  `qat.quantize_act_record` returns (the rollout's record), field for field."""
  rec = jax.eval_shape(lambda x: qat.quantize_act_record(x, mode, fmt)[1],
                       jax.ShapeDtypeStruct(shape, jnp.bfloat16))
  want = {f: tuple(getattr(rec, f).shape) for f in ("block_scale", "row_scale", "mantissa",
                                                     "codes") if getattr(rec, f) is not None}
  assert record.field_shapes(shape[:-1], shape[-1], mode, fmt) == want
  assert record.mode_fields(mode, fmt) == tuple(f for f in record.MODE_FIELDS[mode] if f in want)
  for field in want:
    assert jnp.dtype(getattr(rec, field).dtype).name == record.field_dtype(field, fmt), field
  assert (rec.mode, rec.format, rec.k) == (mode, fmt, shape[-1])
  rows = int(np.prod(shape[:-1]))
  assert rec.nbytes == rows * record.bytes_per_row(shape[-1], mode, fmt)


def test_constants_agree_with_the_quantizers():
  """The JAX-free block sizes and formats are quant.formats'; the padding scale bytes decode to
  1.0 in each format's scale dtype."""
  assert record.FP4_BLOCKS == formats.FP4_BLOCKS
  assert record.FP4_FORMATS == formats.FP4_FORMATS
  for fmt, byte in record.SCALE_ONE.items():
    scale = np.array([byte], np.uint8).view(record.numpy_dtype(record.SCALE_DTYPES[fmt]))
    assert scale.astype(np.float32)[0] == 1.0, fmt
  assert record.numpy_dtype("float8_e8m0fnu") == np.dtype(ml_dtypes.float8_e8m0fnu)


def test_record_is_a_jax_pytree():
  """A record built from numpy arrays (as the torch recorder builds it) maps and jits as a
  pytree; its None fields stay None."""
  g = Guidance(block_scale=np.full((4, 2), 0x38, np.uint8).view(ml_dtypes.float8_e4m3fn),
               row_scale=np.ones((4, 1), np.float32),
               mantissa=np.arange(16, dtype=np.uint8).reshape(4, 4))
  assert (g.mode, g.format, g.k, g.nbytes) == ("compact", "nvfp4", 32, 4 * (2 + 4 + 4))
  assert len(jax.tree.leaves(g)) == 3
  out = jax.jit(lambda r: jax.tree.map(lambda a: a[1:], r))(g)
  assert isinstance(out, Guidance) and out.codes is None
  np.testing.assert_array_equal(np.asarray(out.mantissa), g.mantissa[1:])


@pytest.mark.parametrize("module", ["trace_jax.guidance.record", "trace_jax.guidance.schema",
                                    "trace_jax.guidance.handle"],
                         ids=["record", "schema", "handle"])
def test_format_modules_import_without_jax(module):
  """What the SGLang plugin's torch recorder imports pulls in no JAX (a fresh interpreter)."""
  code = (f"import sys, {module}; bad = sorted(m for m in sys.modules if m.split('.')[0] in "
          "('jax', 'jaxlib', 'flax')); assert not bad, bad")
  subprocess.run([sys.executable, "-c", code], check=True, timeout=120,
                 cwd=Path(__file__).resolve().parents[2])  # this checkout's trace_jax


def test_replace_returns_a_new_record():
  g = Guidance(block_scale=np.zeros((2, 1), np.uint8).view(ml_dtypes.float8_e4m3fn),
               row_scale=np.ones((2, 1), np.float32), mantissa=np.zeros((2, 2), np.uint8))
  full = g.replace(mantissa=None, codes=np.ones((2, 8), np.uint8))
  assert isinstance(full, Guidance) and full.mode == "full" and g.mode == "compact"
  assert full.block_scale is g.block_scale
  with pytest.raises(ValueError, match="scale"):
    g.replace(scale=None)
