"""Packed weights to dense for matmuls too large for the decode kernels (prefill, training forward).

``dense(w, dtype)`` is ``w.dequantize(dtype)`` -- the same bits -- through one native pass
(``csrc/dequantize.cpp``: code table times scale, the scale codes decoded there too) where it applies (CPU, bf16
or fp32 out, kernels built), instead of the formats' chain of torch passes (unpack,
table lookup, scale broadcast, multiply, cast: 38-153 ms per 2880 x 2880 weight on the SPR VM, against
a few ms for the 128-row matmul that needs it). Elsewhere it is ``w.dequantize(dtype)`` itself.
``packed_codes(w)`` is the same description of the weight for the grouped GEMM's decoded panels
(``dynamoe.quant.matmul.panel_gemm``).
"""
from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from ..ops import cpu_kernels
from .base import QuantizedWeight
from .codecs import E2M1_VALUES, _lut, e8m0_decode
from .fp8_block import BlockFP8Weight
from .int4 import INT4_OFFSET, INT4Weight
from .mxfp4 import MXFP4Weight
from .nvfp4 import NV_GROUP, NVFP4Weight

__all__ = ["dense", "packed_codes"]

_INT4_VALUES = torch.arange(16, dtype=torch.float32) - INT4_OFFSET
_KERNEL_DTYPES = (torch.bfloat16, torch.float32)
_KERNEL_FORMATS = (MXFP4Weight, NVFP4Weight, BlockFP8Weight, INT4Weight)


@functools.cache
def _e8m0_values() -> Tensor:
    """The value of every e8m0 byte, as e8m0_decode gives it."""
    return e8m0_decode(torch.arange(256, dtype=torch.uint8)).contiguous()


def _codes(k, w: QuantizedWeight):
    """The kernels' ``PackedCodes`` (csrc/packed_codes.h) of one of the _KERNEL_FORMATS' [..., out, in] weights,
    its leading dims flattened into one: views of the weight's own tensors (the scale codes stay codes), but INT4's
    scales and FP8's fp32 scale grid in fp32."""
    *lead, rows, _ = w.shape
    E = math.prod(lead)
    c = k.PackedCodes()
    c.bits, c.lut, c.group, c.block_rows = 4, E2M1_VALUES, 32, 1
    if isinstance(w, MXFP4Weight):
        codes, c.scales, c.scale_lut = w.blocks, w.scales, _e8m0_values()
    elif isinstance(w, NVFP4Weight):
        codes, c.scales, c.group = w.weight, w.weight_scale.view(torch.uint8), NV_GROUP
        c.scale_lut = _lut("e4m3", torch.float32, w.weight.device).contiguous()
        c.scale_mul = w.weight_scale_2.float().reshape(E).contiguous()
    elif isinstance(w, BlockFP8Weight):
        codes, c.bits, c.lut = w.weight.view(torch.uint8), 8, _lut("e4m3", torch.float32, w.weight.device).contiguous()
        c.group, c.block_rows = w.block[1], w.block[0]
        if w.scale_fmt == "ue8m0":
            c.scales, c.scale_lut = w.weight_scale_inv, _e8m0_values()
        else:
            c.scales = w.weight_scale_inv.float()
    else:
        codes, c.lut, c.group = w.weight_packed.contiguous().view(torch.uint8), _INT4_VALUES, w.group_size
        c.scales = w.weight_scale.float()
    c.codes = codes.reshape(E, rows, -1).contiguous()
    c.scales = c.scales.reshape(E, *c.scales.shape[-2:]).contiguous()
    return c


def packed_codes(w: QuantizedWeight):
    """The grouped GEMM's packed b (a ``PackedCodes``) of a CPU [E, out, in] or [out, in] (E = 1) weight, whose
    panels it decodes on the fly with dense()'s bits; None where that does not apply (kernels without the grouped
    bf16 GEMM, another device or format, more than one leading dim)."""
    k = cpu_kernels.load()
    device = getattr(w, w._tensor_fields()[0]).device
    if (k is None or device.type != "cpu" or not isinstance(w, _KERNEL_FORMATS) or w.num_leading > 1
            or not k.has_grouped_gemm_bf16()):
        return None
    return _codes(k, w)


def dense(w: QuantizedWeight, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """The dense weight [..., out, in] in ``dtype``, equal to ``w.dequantize(dtype)`` (module docstring); every
    matrix of the leading (expert) dims in one native call."""
    device = getattr(w, w._tensor_fields()[0]).device
    k = cpu_kernels.load() if device.type == "cpu" and dtype in _KERNEL_DTYPES else None
    if k is None or getattr(k, "PackedCodes", None) is None or not isinstance(w, _KERNEL_FORMATS):
        return w.dequantize(dtype)
    out = torch.empty(w.shape, dtype=dtype)
    k.dequantize(w=_codes(k, w), out=out.view(-1, *w.shape[-2:]))
    return out
