"""MXFP4 (OCP Microscaling; GPT-OSS experts).

Groups of 32 consecutive input elements share an e8m0 scale (bias 127); elements are e2m1 packed two
per byte, low nibble = even element. On disk (GPT-OSS): ``*_blocks`` uint8 [..., out, in/32, 16] and
``*_scales`` uint8 [..., out, in/32]; value = e2m1(nibble) * 2**(scale - 127).
Quantization follows the OCP recipe: shared exponent = floor(log2(amax)) - 2 (2 = e2m1's emax),
elements rounded to nearest even and saturated to +-6; a group holding NaN/Inf gets the NaN scale.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import QuantizedWeight, check_float_weight
from .codecs import e2m1_decode, e2m1_encode, e8m0_decode, e8m0_encode_exponent, pack_nibbles, unpack_nibbles

__all__ = ["MXFP4Weight", "MX_GROUP"]

MX_GROUP = 32
_E2M1_EMAX = 2


@dataclass(repr=False)
class MXFP4Weight(QuantizedWeight):
    blocks: Tensor  # uint8 [..., out, in/32, 16]
    scales: Tensor  # uint8 [..., out, in/32]
    shape: tuple
    format = "mxfp4"

    def __post_init__(self):
        *lead, rows, cols = self.shape
        if cols % MX_GROUP:
            raise ValueError(f"MXFP4 needs in_features divisible by {MX_GROUP}, got shape {tuple(self.shape)}")
        if tuple(self.blocks.shape) != (*lead, rows, cols // MX_GROUP, MX_GROUP // 2) or self.blocks.dtype != torch.uint8:
            raise ValueError(f"blocks must be uint8 {(*lead, rows, cols // MX_GROUP, MX_GROUP // 2)}, got {self.blocks.dtype} {tuple(self.blocks.shape)}")
        if tuple(self.scales.shape) != (*lead, rows, cols // MX_GROUP) or self.scales.dtype != torch.uint8:
            raise ValueError(f"scales must be uint8 {(*lead, rows, cols // MX_GROUP)}, got {self.scales.dtype} {tuple(self.scales.shape)}")

    @classmethod
    def quantize(cls, w: Tensor) -> "MXFP4Weight":
        check_float_weight(w)
        *lead, rows, cols = w.shape
        if cols % MX_GROUP:
            raise ValueError(f"MXFP4 needs in_features divisible by {MX_GROUP}, got {cols}")
        g = w.float().reshape(*lead, rows, cols // MX_GROUP, MX_GROUP)
        amax = g.abs().amax(-1)
        finite = torch.isfinite(amax)
        exponent = torch.where(amax > 0, torch.floor(torch.log2(amax)) - _E2M1_EMAX, torch.full_like(amax, -127.0))
        exponent = exponent.clamp(-127, 127)
        scaled = torch.nan_to_num(g / torch.exp2(exponent)[..., None], nan=0.0)
        codes = e2m1_encode(torch.where(finite[..., None], scaled, torch.zeros_like(scaled)))
        scales = e8m0_encode_exponent(torch.where(finite, exponent, torch.full_like(exponent, float("nan"))))
        return cls(pack_nibbles(codes).contiguous(), scales.contiguous(), tuple(w.shape))

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> Tensor:
        *lead, rows, cols = self.shape
        values = e2m1_decode(unpack_nibbles(self.blocks))                   # [..., out, in/32, 32]
        out = values * e8m0_decode(self.scales)[..., None]
        return out.reshape(*lead, rows, cols).to(dtype)
