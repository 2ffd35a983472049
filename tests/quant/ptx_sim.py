"""A numpy interpreter for the PTX subset of our inline-assembly programs (tests only).

The Mosaic GPU kernels (`wgmma_decode`) run PTX text that no CPU executes; this runs the same
text, instruction by instruction, on numpy arrays (one element per thread), with each
instruction's semantics from the PTX ISA: float32 products in IEEE round-to-nearest without
flushing subnormals (as `mul.rn.f32` without `.ftz`), bf16 / f16 conversions to nearest even,
`prmt` from its definition (`fp4_decode.prmt_jnp`). Unknown instructions raise, so a program
that grows an instruction the interpreter lacks fails loudly instead of being skipped.
"""

from __future__ import annotations

import re

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from trace_jax.kernels import fp4_decode

_F32 = np.float32


def _f32(bits: np.ndarray) -> np.ndarray:
  return np.asarray(bits, np.uint32).view(_F32)


def _bits(x: np.ndarray) -> np.ndarray:
  return np.asarray(x, _F32).view(np.uint32)


def _round16(x: np.ndarray, dtype) -> np.ndarray:
  """float32 -> 16-bit pattern of dtype (nearest even), as uint32."""
  return np.asarray(x, _F32).astype(dtype).view(np.uint16).astype(np.uint32)


def _from16(bits: np.ndarray, dtype) -> np.ndarray:
  return (np.asarray(bits, np.uint32) & 0xFFFF).astype(np.uint16).view(dtype).astype(_F32)


def run(text: str, operands: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
  """Executes `text` with the given input operands ($N -> uint32 bit patterns; floats as
  their float32 bits) and returns every operand after it ran (outputs included)."""
  regs: dict[str, np.ndarray] = {f"${i}": np.asarray(v, np.uint32) for i, v in operands.items()}

  def val(tok: str) -> np.ndarray:
    tok = tok.strip()
    if tok.startswith("0f"):
      return np.uint32(int(tok[2:], 16))
    if tok.startswith("0x") or tok.isdigit():
      return np.uint32(int(tok, 0))
    return regs[tok]

  for raw in text.replace("\n", ";").split(";"):
    line = raw.strip()
    if not line or line in ("{", "}") or line.startswith(".reg"):
      continue
    op, _, rest = line.partition(" ")
    if op.startswith("{") or op == "}":
      raise ValueError(f"unexpected brace in {line!r}")
    if op == "mov.b32" and rest.lstrip().startswith("{"):  # unpack into two 16-bit halves
      dst, src = re.match(r"\{\s*(\S+),\s*(\S+)\s*\},\s*(\S+)", rest).group(1, 2), \
          rest.rsplit(",", 1)[1]
      v = val(src)
      regs[dst[0]], regs[dst[1]] = v & 0xFFFF, v >> 16
      continue
    args = [a.strip() for a in rest.split(",")]
    d, srcs = args[0], args[1:]
    a = [val(s) for s in srcs]
    if op == "mov.b32":
      out = a[0]
    elif op == "and.b32":
      out = a[0] & a[1]
    elif op == "xor.b32":
      out = a[0] ^ a[1]
    elif op == "shr.b32":
      out = a[0] >> a[1]
    elif op == "shl.b32":
      out = (a[0].astype(np.uint64) << a[1]).astype(np.uint32)
    elif op == "prmt.b32":
      out = np.asarray(fp4_decode.prmt_jnp(jnp.asarray(a[0], jnp.uint32),
                                           jnp.asarray(a[1], jnp.uint32),
                                           jnp.asarray(a[2], jnp.uint32)))
    elif op == "mul.rn.f32":
      with np.errstate(all="ignore"):
        out = _bits(_f32(a[0]) * _f32(a[1]))
    elif op == "abs.f32":
      out = a[0] & np.uint32(0x7FFFFFFF)
    elif op in ("setp.gt.f32", "setp.ge.f32", "setp.lt.f32", "setp.lt.and.f32"):
      x, y = _f32(a[0]), _f32(a[1])
      out = {"gt": x > y, "ge": x >= y, "lt": x < y}[op.split(".")[1]]
      if op.endswith(".and.f32"):
        out = out & regs[srcs[2]]
    elif op == "selp.f32":
      out = np.where(regs[srcs[2]], a[0], a[1]).astype(np.uint32)
    elif op == "cvt.rn.f16x2.e4m3x2":
      v = np.asarray(a[0], np.uint32)
      lo, hi = (((v >> s) & 0xFF).astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(_F32)
                for s in (0, 8))
      out = _round16(lo, np.float16) | (_round16(hi, np.float16) << 16)
    elif op == "cvt.f32.f16":
      out = _bits(_from16(a[0], np.float16))
    elif op == "cvt.rn.bf16x2.f32":  # d = [lo | hi << 16] from (hi, lo)
      out = _round16(_f32(a[1]), ml_dtypes.bfloat16) | (
          _round16(_f32(a[0]), ml_dtypes.bfloat16) << 16)
    elif op == "mul.rn.bf16x2":
      bf = ml_dtypes.bfloat16
      prod = [(_from16(a[0] >> s, bf).astype(np.float64) * _from16(a[1] >> s, bf)
               ).astype(bf).view(np.uint16).astype(np.uint32) for s in (0, 16)]  # one rounding
      out = prod[0] | (prod[1] << 16)
    else:
      raise NotImplementedError(f"ptx_sim: no semantics for {op!r} ({line!r})")
    regs[d] = np.asarray(out)
  return {int(k[1:]): v for k, v in regs.items() if k.startswith("$")}
