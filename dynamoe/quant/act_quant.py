"""Activation quantization of packed matmuls: the ``act_quant`` switch of QuantizedLinear / QuantizedExperts.

None (the default) keeps the activations exact: the packed weights are decoded and multiplied with the
activations as they are (bf16 or fp32 products, fp32 sums). The other settings change the numerics and
are asked for by name:

* ``ActQuant.FP8``: e4m3 per token and 128 features (DeepSeek-V3's recipe), simulated -- the activations
  are quantized and dequantized, then the exact matmul runs.
* ``ActQuant.INT8``: int8 per token and 32 features with an fp32 scale, as llama.cpp's Q8_0 / Q8_1
  activations. For the 4-bit formats (MXFP4, NVFP4, INT4) the CPU decode kernels quantize once per call
  and use VNNI int8 dot products (``csrc/packed_int8.h``); everywhere else :func:`int8_activation_quant`
  runs before the exact matmul in fp32, which is what the kernels compute up to fp32 summation order.
  Each activation moves by at most half a step (amax / 254) of its block.

Legend: N rows, I features.
"""
from __future__ import annotations

import enum

import torch
import torch.nn.functional as F
from torch import Tensor

from .codecs import E4M3_MAX, e4m3_decode, e4m3_encode

__all__ = ["ActQuant", "ACT_QUANT", "act_quant_of", "fp8_activation_quant", "int8_quantize", "int8_activation_quant", "INT8_BLOCK"]

INT8_BLOCK = 32  # features per int8 scale (csrc/packed_int8.h: kI8Block)
INT8_MAX = 127.0


class ActQuant(str, enum.Enum):
    """Activation quantization of a packed matmul (see the module docstring); None means exact."""

    FP8 = "fp8"
    INT8 = "int8"


ACT_QUANT = (None, *ActQuant)


def act_quant_of(value) -> ActQuant | None:
    """``value`` (None, an ActQuant or its name 'fp8' / 'int8') as an ActQuant or None; ValueError otherwise."""
    if value is None:
        return None
    try:
        return ActQuant(value)
    except ValueError:
        raise ValueError(f"act_quant must be one of {[None, *(a.value for a in ActQuant)]}, got {value!r}") from None


def fp8_activation_quant(x: Tensor, group: int = 128) -> Tensor:
    """Dynamic FP8 activation quantization, per token and per ``group`` features (DeepSeek-V3's
    recipe): scale = amax / 448 per group, x -> e4m3(x / scale) * scale. Returns the dequantized
    activations in x's dtype, i.e. what an FP8 x FP8 matmul sees; each element's relative error is
    at most 2^-4 (3 mantissa bits), plus 2^-10 of its group's scale for values in the subnormal range."""
    *lead, cols = x.shape
    pad = -cols % group
    xf = F.pad(x.float(), (0, pad)) if pad else x.float()
    g = xf.reshape(*lead, -1, group)
    scale = g.abs().amax(-1, keepdim=True) / E4M3_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = e4m3_decode(e4m3_encode(g / scale)) * scale
    return q.reshape(*lead, cols + pad)[..., :cols].to(x.dtype)


def int8_quantize(x: Tensor, block: int = INT8_BLOCK) -> tuple[Tensor, Tensor]:
    """(q [..., I] int8, d [..., ceil(I / block)] fp32) of x per token and ``block`` features, with the fp32
    operations of the kernels: amax of the block, d = amax / 127, q = round-half-even(x * (127 / amax))
    (0 for an all-zero block), |q| <= 127; x ~ q * d. A block holding NaN or Inf gets q = 0 and d = NaN."""
    *lead, cols = x.shape
    pad = -cols % block
    xf = F.pad(x.float(), (0, pad)) if pad else x.float()
    g = xf.reshape(*lead, -1, block)
    amax = g.abs().amax(-1, keepdim=True)
    bad = ~torch.isfinite(amax)
    # true fp32 divisions, as the kernels do (scalar / tensor would be reciprocal-then-multiply)
    full = torch.full_like(amax, INT8_MAX)
    inv = torch.where((amax > 0) & ~bad, full / amax, torch.zeros_like(amax))
    q = torch.where(bad, 0.0, torch.round(g * inv).clamp_(-INT8_MAX, INT8_MAX))
    d = torch.where(bad, float("nan"), amax / full)
    return q.reshape(*lead, cols + pad)[..., :cols].to(torch.int8), d.squeeze(-1)


def int8_activation_quant(x: Tensor, block: int = INT8_BLOCK) -> Tensor:
    """x quantized as :func:`int8_quantize` does and dequantized, in fp32 (q * d; a bf16 result would round
    it again): the activations the int8 kernels multiply."""
    q, d = int8_quantize(x, block)
    *lead, cols = x.shape
    pad = -cols % block
    qf = F.pad(q.float(), (0, pad)) if pad else q.float()
    return (qf.reshape(*lead, -1, block) * d.unsqueeze(-1)).reshape(*lead, cols + pad)[..., :cols]
