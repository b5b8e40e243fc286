"""Blockwise FP8 (DeepSeek-V3/R1, Kimi-K2, GLM FP8 checkpoints).

``weight`` float8_e4m3fn [..., out, in] and ``weight_scale_inv`` [..., ceil(out/b0), ceil(in/b1)]
(fp32, or e8m0 bytes with ``scale_fmt='ue8m0'``): W[i, j] = q[i, j] * s[i // b0, j // b1]. Edge blocks
are partial: 576 x 7168 with 128 x 128 blocks has a 5 x 56 scale grid whose last row covers 64 rows.
The block size is the format's (``weight_block_size`` in the config), never inferred from
``rows // scale_rows`` -- that inference is what breaks unaligned shapes in other loaders.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .base import QuantizedWeight, check_float_weight
from .codecs import E4M3_MAX, e4m3_decode, e4m3_encode, e8m0_decode, e8m0_encode_exponent

__all__ = ["BlockFP8Weight"]

SCALE_FORMATS = ("fp32", "ue8m0")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _blocked(t: Tensor, block: tuple[int, int]) -> Tensor:
    """[..., out, in] -> zero-padded [..., R, b0, C, b1] view-able blocks."""
    *lead, rows, cols = t.shape
    b0, b1 = block
    R, C = _ceil_div(rows, b0), _ceil_div(cols, b1)
    if (R * b0, C * b1) != (rows, cols):
        t = F.pad(t, (0, C * b1 - cols, 0, R * b0 - rows))
    return t.reshape(*lead, R, b0, C, b1)


@dataclass(repr=False)
class BlockFP8Weight(QuantizedWeight):
    weight: Tensor            # float8_e4m3fn [..., out, in]
    weight_scale_inv: Tensor  # fp32 (or uint8 e8m0 codes) [..., ceil(out/b0), ceil(in/b1)]
    shape: tuple
    block: tuple = (128, 128)
    scale_fmt: str = "fp32"
    format = "fp8_block"

    def __post_init__(self):
        self.block = tuple(int(b) for b in self.block)
        if len(self.block) != 2 or min(self.block) < 1:
            raise ValueError(f"block must be two positive ints, got {self.block}")
        if self.scale_fmt not in SCALE_FORMATS:
            raise ValueError(f"scale_fmt must be one of {list(SCALE_FORMATS)}, got {self.scale_fmt!r}")
        if self.weight.dtype == torch.uint8:
            self.weight = self.weight.view(torch.float8_e4m3fn)
        if self.weight.dtype != torch.float8_e4m3fn:
            raise ValueError(f"weight must be float8_e4m3fn (or its uint8 bytes), got {self.weight.dtype}")
        sdt = self.weight_scale_inv.dtype
        if self.scale_fmt == "ue8m0":
            if sdt == torch.float8_e8m0fnu:
                self.weight_scale_inv = self.weight_scale_inv.view(torch.uint8)
            elif sdt != torch.uint8:
                raise ValueError(f"ue8m0 weight_scale_inv must be e8m0 bytes (uint8 or float8_e8m0fnu), got {sdt}")
        elif not sdt.is_floating_point or sdt.itemsize < 2:
            raise ValueError(f"fp32 weight_scale_inv must be a float tensor, got {sdt}; e8m0 bytes need scale_fmt='ue8m0'")
        *lead, rows, cols = self.shape
        want = (*lead, _ceil_div(rows, self.block[0]), _ceil_div(cols, self.block[1]))
        if tuple(self.weight.shape) != tuple(self.shape):
            raise ValueError(f"weight has shape {tuple(self.weight.shape)}, expected {tuple(self.shape)}")
        if tuple(self.weight_scale_inv.shape) != want:
            raise ValueError(f"weight_scale_inv for a {tuple(self.shape)} weight with {self.block} blocks must have shape "
                             f"{want}, got {tuple(self.weight_scale_inv.shape)}")

    @classmethod
    def quantize(cls, w: Tensor, block: tuple[int, int] = (128, 128), scale_fmt: str = "fp32") -> "BlockFP8Weight":
        """Per-block scale = amax / 448 (rounded up to a power of two for ue8m0), q = e4m3(w / scale).
        An all-zero block gets scale 1; a block holding NaN/Inf gets a NaN scale (it decodes to NaN)."""
        check_float_weight(w)
        if scale_fmt not in SCALE_FORMATS:
            raise ValueError(f"scale_fmt must be one of {list(SCALE_FORMATS)}, got {scale_fmt!r}")
        block = tuple(block)
        *lead, rows, cols = w.shape
        wb = _blocked(w.float(), block)                                  # [..., R, b0, C, b1]
        amax = wb.abs().amax(dim=(-3, -1))                               # [..., R, C]
        finite = torch.isfinite(amax)
        scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        if scale_fmt == "ue8m0":
            exponent = torch.ceil(torch.log2(scale))
            scale = torch.exp2(exponent)
        scale = torch.where(finite, scale, torch.full_like(scale, float("nan")))
        q = e4m3_encode(torch.nan_to_num(wb / scale[..., :, None, :, None], nan=0.0))
        q = q.flatten(-4, -3).flatten(-2, -1)
        q = q[..., :rows, :cols].contiguous().view(torch.float8_e4m3fn)
        if scale_fmt == "ue8m0":
            stored = e8m0_encode_exponent(torch.where(finite, exponent, torch.full_like(exponent, float("nan"))))
        else:
            stored = scale.contiguous()
        return cls(q, stored, tuple(w.shape), block, scale_fmt)

    def scales(self) -> Tensor:
        """The fp32 scale grid, whatever its storage format."""
        if self.scale_fmt == "ue8m0":
            return e8m0_decode(self.weight_scale_inv)
        return self.weight_scale_inv.float()

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> Tensor:
        *lead, rows, cols = self.shape
        q = e4m3_decode(self.weight)                                     # fp32 via the byte LUT
        qb = _blocked(q, self.block)
        out = qb * self.scales()[..., :, None, :, None]
        out = out.flatten(-4, -3).flatten(-2, -1)[..., :rows, :cols]
        return out.to(dtype)
