"""Quantized weights: blockwise FP8, MXFP4, NVFP4 and INT4 (W4A16) -- codecs, formats, and matmuls that keep the
weights packed and dequantize one expert (or one Linear) at a time."""
from .base import QuantizedWeight
from .codecs import (E2M1_VALUES, e2m1_decode, e2m1_encode, e4m3_decode, e4m3_encode, e8m0_decode, e8m0_encode_exponent,
                     pack_nibbles, unpack_nibbles)
from .fp8_block import BlockFP8Weight
from .int4 import INT4Weight
from .mxfp4 import MXFP4Weight
from .nvfp4 import NVFP4Weight

FORMATS = {"fp8_block": BlockFP8Weight, "mxfp4": MXFP4Weight, "nvfp4": NVFP4Weight, "int4": INT4Weight}


def quantize(w, format: str, **options) -> QuantizedWeight:
    """Quantize a float weight [..., out, in] into ``format`` ('fp8_block', 'mxfp4', 'nvfp4', 'int4')."""
    if format not in FORMATS:
        raise ValueError(f"format must be one of {list(FORMATS)}, got {format!r}")
    return FORMATS[format].quantize(w, **options)


from .act_quant import ActQuant, int8_activation_quant, int8_quantize  # noqa: E402
from .matmul import fp8_activation_quant, quantized_grouped_mm, quantized_linear  # noqa: E402
from .modules import QuantizedExperts, QuantizedLinear, quantize_experts_, quantize_linears_  # noqa: E402
from . import checkpoint, checkpoint_files, checkpoint_writer  # noqa: E402  (on-disk layouts)

__all__ = [
    "checkpoint", "checkpoint_files", "checkpoint_writer", "QuantizedLinear", "QuantizedExperts", "quantize_experts_", "quantize_linears_", "quantized_linear",
    "quantized_grouped_mm", "fp8_activation_quant", "ActQuant", "int8_activation_quant", "int8_quantize",
    "QuantizedWeight", "BlockFP8Weight", "MXFP4Weight", "NVFP4Weight", "INT4Weight", "FORMATS", "quantize",
    "E2M1_VALUES", "e2m1_encode", "e2m1_decode", "pack_nibbles", "unpack_nibbles", "e4m3_encode", "e4m3_decode",
    "e8m0_encode_exponent", "e8m0_decode",
]
