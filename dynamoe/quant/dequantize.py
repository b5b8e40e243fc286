"""Packed weights to dense for matmuls too large for the decode kernels (prefill, training forward).

``dense(w, dtype)`` is ``w.dequantize(dtype)`` -- the same bits -- through one native pass
(``csrc/dequantize.cpp``: code table times fp32 scale grid) where it applies (CPU, bf16 or fp32 out,
kernels built), instead of the formats' chain of torch passes (unpack,
table lookup, scale broadcast, multiply, cast: 38-153 ms per 2880 x 2880 weight on the SPR VM, against
a few ms for the 128-row matmul that needs it). Elsewhere it is ``w.dequantize(dtype)`` itself.
"""
from __future__ import annotations

import itertools

import torch
from torch import Tensor

from ..ops import cpu_kernels
from .base import QuantizedWeight
from .codecs import E2M1_VALUES, _lut, e4m3_decode, e8m0_decode
from .fp8_block import BlockFP8Weight
from .int4 import INT4_OFFSET, INT4Weight
from .mxfp4 import MXFP4Weight
from .nvfp4 import NV_GROUP, NVFP4Weight

__all__ = ["dense", "packed_b"]

_INT4_VALUES = torch.arange(16, dtype=torch.float32) - INT4_OFFSET
_KERNEL_DTYPES = (torch.bfloat16, torch.float32)
_KERNEL_FORMATS = (MXFP4Weight, NVFP4Weight, BlockFP8Weight, INT4Weight)


def _parts(w: QuantizedWeight):
    """(codes uint8 [..., R, row_bytes], bits, code table, fp32 scales [..., R / block_rows, C / group], group,
    block_rows) of one of the _KERNEL_FORMATS' [..., out, in] weights (views where the format stores them so)."""
    *lead, rows, _ = w.shape
    if isinstance(w, MXFP4Weight):
        return w.blocks.reshape(*lead, rows, -1), 4, E2M1_VALUES, e8m0_decode(w.scales), 32, 1
    if isinstance(w, NVFP4Weight):
        scales = e4m3_decode(w.weight_scale) * w.weight_scale_2.reshape(*lead, 1, 1)
        return w.weight.view(torch.uint8), 4, E2M1_VALUES, scales, NV_GROUP, 1
    if isinstance(w, BlockFP8Weight):
        return w.weight.view(torch.uint8), 8, _lut("e4m3", torch.float32, w.weight.device), w.scales(), w.block[1], w.block[0]
    return w.weight_packed.contiguous().view(torch.uint8), 4, _INT4_VALUES, w.weight_scale.float(), w.group_size, 1


def packed_b(w: QuantizedWeight):
    """The grouped GEMM's ``PackedB`` (csrc/panel_decode.h) of a CPU [E, out, in] or [out, in] (E = 1) weight, for
    products whose panels are decoded on the fly with dense()'s bits; None where that does not apply (kernels
    without the grouped bf16 GEMM, another device or format, more than one leading dim)."""
    k = cpu_kernels.load()
    device = getattr(w, w._tensor_fields()[0]).device
    if (k is None or device.type != "cpu" or not isinstance(w, _KERNEL_FORMATS) or w.num_leading > 1
            or not k.has_grouped_gemm_bf16()):
        return None
    codes, bits, lut, scales, group, block_rows = _parts(w)
    if not w.num_leading:
        codes, scales = codes.unsqueeze(0), scales.unsqueeze(0)
    b = k.PackedB()
    b.codes, b.bits, b.lut = codes.contiguous(), bits, lut.contiguous()
    b.scales, b.group, b.block_rows = scales.float().contiguous(), int(group), int(block_rows)
    return b


def dense(w: QuantizedWeight, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """The dense weight [..., out, in] in ``dtype``, equal to ``w.dequantize(dtype)`` (module docstring);
    leading (expert) dims one matrix at a time into one output."""
    device = getattr(w, w._tensor_fields()[0]).device
    k = cpu_kernels.load() if device.type == "cpu" and dtype in _KERNEL_DTYPES else None
    if k is None or getattr(k, "Dequantize", None) is None or not isinstance(w, _KERNEL_FORMATS):
        return w.dequantize(dtype)
    out = torch.empty(w.shape, dtype=dtype)
    flat = out.view(-1, *w.shape[-2:])
    for i, index in enumerate(itertools.product(*(range(n) for n in w.shape[:-2]))):
        m = w
        for e in index:
            m = m[e]
        _dequantize_into(k, m, flat[i])
    return out


def _dequantize_into(k, w: QuantizedWeight, out: Tensor) -> None:
    codes, bits, lut, scales, group, block_rows = _parts(w)
    args = k.Dequantize()
    args.codes, args.bits, args.lut = codes.contiguous(), bits, lut.contiguous()
    args.scales, args.group, args.block_rows = scales.float().contiguous(), int(group), int(block_rows)
    args.out = out
    k.dequantize(args=args)
