"""One Linear as the fused decode kernels read it (``kernels.LinearWeights``, csrc/decode_weights.h): a dense
weight of the step's dtype, or a packed one (dynamoe.quant's QuantizedLinear: blockwise FP8, MXFP4, NVFP4,
INT4) through the same packed GEMV kernels the layer-by-layer path calls, so the numbers are the same.

Also the packed formats' fields as the kernels take them (:func:`packed_fields`) and the activation switch
(:func:`packed_acts`), shared with the packed experts kernel (dynamoe.ops.moe_decode).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .fused import Holds, Unfusable, struct

__all__ = ["PACKED_FORMATS", "INT8_ACT_FORMATS", "packed_acts", "packed_fields", "int4_kernel_applies",
           "linear_weights"]

PACKED_FORMATS = ("fp8_block", "mxfp4", "nvfp4", "int4")
INT8_ACT_FORMATS = ("mxfp4", "nvfp4", "int4")  # the formats with int8-activation kernels (csrc/packed_int8.h)


def packed_acts(kernels, act_quant, fmt: str):
    """The kernels' PackedActs for a packed module's ``act_quant`` (a dynamoe.quant.ActQuant, which is a str):
    None -> exact, 'int8' -> int8 for the 4-bit formats; None (no kernel) otherwise -- 'fp8' activations
    and int8 with FP8 weights are simulated by the general path."""
    if act_quant is None:
        return kernels.PackedActs.exact
    if act_quant == "int8" and fmt in INT8_ACT_FORMATS:
        return kernels.PackedActs.int8
    return None


def packed_fields(w) -> tuple[Tensor, Tensor, Tensor, int, int]:
    """(a, b, c, block0, block1) of a packed weight (one, or experts stacked), as the kernels take them:
    FP8 (e4m3 bytes, fp32 scale grid, -, block), MXFP4 (blocks, e8m0 scales), INT4 (the int32 words' bytes,
    bf16 scales, -, group size), NVFP4 (e2m1 bytes, e4m3 scale bytes, fp32 global scale(s))."""
    fmt = w.format
    if fmt == "fp8_block":
        return w.weight.view(torch.uint8), w.scales().contiguous(), torch.empty(0), w.block[0], w.block[1]
    if fmt == "mxfp4":
        return w.blocks, w.scales, torch.empty(0), 1, 1
    if fmt == "int4":
        return w.weight_packed.view(torch.uint8), w.weight_scale, torch.empty(0), w.group_size, 1
    return (w.weight, w.weight_scale.view(torch.uint8), w.weight_scale_2.float().reshape(-1).contiguous(), 1, 1)


def int4_kernel_applies(w) -> bool:
    """Whether the kernels take this INT4 weight: in_features and group size multiples of 16, contiguous
    words and scales (dynamoe.quant.matmul runs other shapes dequantized)."""
    return (w.shape[-1] % 16 == 0 and w.group_size % 16 == 0 and w.weight_packed.is_contiguous()
            and w.weight_scale.is_contiguous())


def linear_weights(kernels, holds: Holds, module: nn.Module, dtype: torch.dtype, name: str):
    """``module`` (an ``nn.Linear`` or a packed linear: dynamoe.quant.QuantizedLinear) as a
    ``kernels.LinearWeights`` for steps of ``dtype``; Unfusable (naming ``name``) where the kernels would not
    compute what the module does."""
    if isinstance(module, nn.Linear):
        w, b = holds.param(module, "weight"), holds.param(module, "bias")
        if w.dtype != dtype or w.device.type != "cpu" or not w.is_contiguous() or (b is not None and b.dtype != dtype):
            raise Unfusable(f"{name}'s weight is {w.dtype} on {w.device.type} for steps of {dtype}")
        return struct(kernels.LinearWeights, holds, format=kernels.WeightFormat.dense, w=w, bias=b)
    fmt = holds.attr(module, "format")
    if fmt not in PACKED_FORMATS or not hasattr(module, "qweight"):
        raise Unfusable(f"{name} is a {type(module).__name__} (the kernels take nn.Linear or a packed linear)")
    for d in (module._parameters, module._buffers):  # every tensor it holds: reassigning one is a change
        holds.refs.extend((d, k, v) for k, v in d.items())
    for t in module._buffers.values():  # the struct holds tensors derived from them (scales, views)
        holds.derived(t)
    w = module.qweight
    acts = packed_acts(kernels, holds.attr(module, "act_quant"), fmt)
    if acts is None:
        raise Unfusable(f"{name}: activation quantization '{module.act_quant.value}' with {fmt} weights (simulated by the "
                        "general path)")
    if w.device.type != "cpu" or w.num_leading:
        raise Unfusable(f"{name}'s packed weight is on {w.device.type} or not one [out, in] matrix")
    if fmt == "int4" and not int4_kernel_applies(w):
        raise Unfusable(f"{name}: INT4 groups are not whole multiples of 16 elements")
    a, b, c, blk0, blk1 = packed_fields(w)
    return struct(kernels.LinearWeights, holds, format=kernels.WeightFormat.__members__[fmt], w=a, scale=b,
                  global_scale=float(c[0]) if fmt == "nvfp4" else 1.0, blk0=int(blk0), blk1=int(blk1),
                  bias=holds.fp32(holds.param(module, "bias")), acts=acts)
