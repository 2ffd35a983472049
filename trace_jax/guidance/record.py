"""The guidance record (docs/design.md §5): what the rollout keeps of one site, field by field.

A site's record for token rows [..., K] (K: the width the site quantizes) holds

  block_scale  the FP4 format's block scales, one byte per block: E4M3 per 16 elements
               (NVFP4) or E8M0 per 32 (MXFP4)
  row_scale    float32 [..., 1]: NVFP4's per-row second-level scale (MXFP4 has none)
  mantissa     uint8 [..., K // 8]: each code's mantissa bit, element 8i+j in bit j of byte i
               (compact mode), or
  codes        uint8 [..., K // 2]: the 4-bit E2M1 codes, two per byte (full mode);

and a layer's routing holds its expert ids, int32 [T, top_k]. Float8 block scales are kept and
stored as their bytes (`STORED_DTYPES`).

This module needs numpy and ml_dtypes only, not JAX: the SGLang plugin's torch recorder builds
records with it. `Guidance` is a NamedTuple, which JAX takes as a pytree without registration
(a None field is an empty subtree).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

# The activation sites an FP4 policy quantizes in each decoder layer (docs/design.md §3, §5),
# in the order records, the store and the metrics list them.
SITES = ("moe_in", "expert_mid", "k", "v")
ROUTING = "routing"  # the per-layer record of expert ids, beside the sites
ROUTING_FIELD = "ids"
MODES = ("compact", "full")
FP4_FORMATS = ("nvfp4", "mxfp4")
DEFAULT_FORMAT = "nvfp4"
# Elements per block scale (the FP4 formats' blocks: `quant.formats.FP4_BLOCKS`, which tests
# compare with these; this module cannot import quant, which imports JAX).
FP4_BLOCKS = {"nvfp4": 16, "mxfp4": 32}
SCALE_DTYPES = {"nvfp4": "float8_e4m3fn", "mxfp4": "float8_e8m0fnu"}
# The scale 1.0 as each format's block-scale byte (E4M3 0x38, E8M0 127).
SCALE_ONE = {"nvfp4": 0x38, "mxfp4": 127}
# Logical dtype of each field (block scales: NVFP4's; `field_dtype` gives any format's) and the
# dtype its bytes are kept in by the store and the plugin's recorder.
FIELD_DTYPES = {"mantissa": "uint8", "codes": "uint8", "block_scale": "float8_e4m3fn",
                "row_scale": "float32", ROUTING_FIELD: "int32"}
STORED_DTYPES = {**FIELD_DTYPES, "block_scale": "uint8"}
MODE_FIELDS = {"compact": ("mantissa", "block_scale", "row_scale"),
               "full": ("codes", "block_scale", "row_scale")}


class Guidance(NamedTuple):
  """What rollout recorded at one site for a batch of token rows (the fields: module
  docstring); arrays of any kind (jax, numpy), or None for the fields its mode and format
  lack."""
  block_scale: Any
  row_scale: Any = None
  mantissa: Any = None
  codes: Any = None

  @property
  def mode(self) -> str:
    return "compact" if self.mantissa is not None else "full"

  @property
  def format(self) -> str:
    return ("mxfp4" if np.dtype(self.block_scale.dtype).name == SCALE_DTYPES["mxfp4"]
            else "nvfp4")

  @property
  def k(self) -> int:
    return self.block_scale.shape[-1] * FP4_BLOCKS[self.format]

  @property
  def nbytes(self) -> int:
    """Exact bytes of the record's arrays."""
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize
               for a in (self.block_scale, self.row_scale, self.mantissa, self.codes)
               if a is not None)

  def replace(self, **fields: Any) -> Guidance:
    """A copy with `fields` replaced."""
    return self._replace(**fields)


def check_mode(mode: str) -> None:
  if mode not in MODES:
    raise ValueError(f"unknown guidance mode {mode!r}; expected one of {MODES}")


def check_format(fmt: str) -> None:
  if fmt not in FP4_FORMATS:
    raise ValueError(f"unknown FP4 format {fmt!r}; expected one of {FP4_FORMATS}")


def mode_fields(mode: str, fmt: str) -> tuple[str, ...]:
  """The arrays a site's record holds in `mode` and FP4 format `fmt` (MXFP4: no row scale)."""
  return tuple(f for f in MODE_FIELDS[mode] if fmt == "nvfp4" or f != "row_scale")


def field_dtype(field: str, fmt: str) -> str:
  """Logical dtype of a field's array in FP4 format `fmt`."""
  return SCALE_DTYPES[fmt] if field == "block_scale" else FIELD_DTYPES[field]


def numpy_dtype(name: str) -> np.dtype:
  """The numpy dtype of a dtype name of this module (float8 names from ml_dtypes)."""
  return np.dtype(getattr(ml_dtypes, name) if name.startswith("float8") else name)


def field_width(field: str, k: int, fmt: str) -> int:
  """Last-axis length of a site field for rows of width k."""
  widths = {"mantissa": k // 8, "codes": k // 2, "block_scale": k // FP4_BLOCKS[fmt],
            "row_scale": 1}
  return widths[field]


def field_shapes(lead: Sequence[int], k: int, mode: str, fmt: str
                 ) -> dict[str, tuple[int, ...]]:
  """Shape of each field of a record of rows `lead` and width k, in `mode` and `fmt`."""
  lead = tuple(int(d) for d in lead)
  return {f: lead + (field_width(f, k, fmt),) for f in mode_fields(mode, fmt)}


def bytes_per_row(k: int, mode: str, fmt: str = "nvfp4") -> int:
  """Guidance bytes per token row of width k: payload + block scales (+ NVFP4's FP32 row
  scale)."""
  check_mode(mode)
  check_format(fmt)
  return sum(field_width(f, k, fmt) * numpy_dtype(field_dtype(f, fmt)).itemsize
             for f in mode_fields(mode, fmt))
