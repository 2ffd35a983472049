"""Bit-exact FP4/FP8 quantization (docs/design.md §3): formats, guided rounding, QAT operators."""

from trace_jax.guidance.record import Guidance, bytes_per_row
from trace_jax.quant.formats import (
    FP8Tensor,
    MXFP4Tensor,
    NVFP4Tensor,
    e2m1_decode,
    e2m1_encode,
    fp8_dequantize,
    fp8_quantize_act,
    fp8_quantize_weight,
    mxfp4_dequantize,
    mxfp4_quantize,
    nvfp4_dequantize,
    nvfp4_quantize,
    nvfp4_row_scale,
    nvfp4_tensor_scale,
    pack_fp4,
    unpack_fp4,
)
from trace_jax.quant.guided import guided_codes, guided_quantize, record
from trace_jax.quant.qat import (
    fake_quant_act,
    fake_quant_act_guided,
    fake_quant_weight,
    qdq_act,
    qdq_weight,
    quantize_act_record,
)

__all__ = [
    "FP8Tensor", "Guidance", "MXFP4Tensor", "NVFP4Tensor", "bytes_per_row", "e2m1_decode",
    "e2m1_encode", "fake_quant_act", "fake_quant_act_guided", "fake_quant_weight",
    "fp8_dequantize", "fp8_quantize_act", "fp8_quantize_weight", "guided_codes",
    "guided_quantize", "mxfp4_dequantize", "mxfp4_quantize", "nvfp4_dequantize",
    "nvfp4_quantize", "nvfp4_row_scale", "nvfp4_tensor_scale", "pack_fp4", "qdq_act",
    "qdq_weight", "quantize_act_record", "record", "unpack_fp4",
]
