"""NVFP4 (ModelOpt and compressed-tensors exports).

Groups of 16 input elements share an e4m3 scale; one fp32 global scale per weight (per expert):
W = e2m1 * float(weight_scale[i, j // 16]) * weight_scale_2. ModelOpt stores ``weight`` (packed
uint8 [..., out, in/2]), ``weight_scale`` (float8_e4m3fn [..., out, in/16]), ``weight_scale_2`` (fp32,
= amax / (6 * 448)) and ``input_scale``; compressed-tensors stores ``weight_packed``, ``weight_scale``
and ``weight_global_scale`` = 1 / weight_scale_2 -- forgetting that reciprocal on MoE experts is a
known bug elsewhere. Quantization: global scale from the weight's amax, group scale =
group amax / 6 / global (e4m3, round to nearest even), elements e2m1 of w / (group scale * global).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from .base import QuantizedWeight, check_float_weight
from .codecs import E2M1_MAX, E4M3_MAX, e2m1_decode, e2m1_encode, e4m3_decode, e4m3_encode, pack_nibbles, unpack_nibbles

__all__ = ["NVFP4Weight", "NV_GROUP", "finite_amax"]

NV_GROUP = 16


def finite_amax(w: Tensor) -> Tensor:
    """Largest finite |w| of each [out, in] weight (leading dims kept): what the global scale is made of."""
    return w.float().abs().flatten(-2).nan_to_num(nan=0.0, posinf=0.0).amax(-1)


@dataclass(repr=False)
class NVFP4Weight(QuantizedWeight):
    weight: Tensor          # uint8 [..., out, in/2]
    weight_scale: Tensor    # float8_e4m3fn [..., out, in/16]
    weight_scale_2: Tensor  # fp32 [...] (one per weight / expert)
    shape: tuple
    input_scale: Optional[Tensor] = None  # fp32 [...], ModelOpt's static activation scale (kept, unused)
    format = "nvfp4"

    def __post_init__(self):
        *lead, rows, cols = self.shape
        if cols % NV_GROUP:
            raise ValueError(f"NVFP4 needs in_features divisible by {NV_GROUP}, got shape {tuple(self.shape)}")
        if tuple(self.weight.shape) != (*lead, rows, cols // 2) or self.weight.dtype != torch.uint8:
            raise ValueError(f"weight must be uint8 {(*lead, rows, cols // 2)}, got {self.weight.dtype} {tuple(self.weight.shape)}")
        if tuple(self.weight_scale.shape) != (*lead, rows, cols // NV_GROUP):
            raise ValueError(f"weight_scale must have shape {(*lead, rows, cols // NV_GROUP)}, got {tuple(self.weight_scale.shape)}")
        if self.weight_scale.dtype == torch.uint8:
            self.weight_scale = self.weight_scale.view(torch.float8_e4m3fn)
        if self.weight_scale.dtype != torch.float8_e4m3fn:
            raise ValueError(f"weight_scale must be float8_e4m3fn, got {self.weight_scale.dtype}")
        self.weight_scale_2 = torch.as_tensor(self.weight_scale_2, dtype=torch.float32, device=self.weight.device)
        if self.weight_scale_2.numel() == 1 and not lead:
            self.weight_scale_2 = self.weight_scale_2.reshape(())
        if tuple(self.weight_scale_2.shape) != tuple(lead):
            raise ValueError(f"weight_scale_2 must have shape {tuple(lead)} (one per weight), got {tuple(self.weight_scale_2.shape)}")
        if self.input_scale is not None:
            self.input_scale = torch.as_tensor(self.input_scale, dtype=torch.float32, device=self.weight.device)
            if self.input_scale.numel() == 1 and not lead:
                self.input_scale = self.input_scale.reshape(())
            if tuple(self.input_scale.shape) != tuple(lead):
                raise ValueError(f"input_scale must have shape {tuple(lead)} (one per weight), got {tuple(self.input_scale.shape)}")

    @classmethod
    def quantize(cls, w: Tensor, global_amax: Tensor | float | None = None) -> "NVFP4Weight":
        """``global_amax``: the amax the global scale is made from, when several weights share one
        (ModelOpt fuses q/k/v and an expert's gate/up that way); at least the weight's own amax."""
        check_float_weight(w)
        *lead, rows, cols = w.shape
        if cols % NV_GROUP:
            raise ValueError(f"NVFP4 needs in_features divisible by {NV_GROUP}, got {cols}")
        wf = w.float()
        amax = finite_amax(wf)
        if global_amax is not None:
            amax = torch.maximum(torch.as_tensor(global_amax, dtype=torch.float32, device=wf.device).expand(amax.shape), amax)
        global_scale = torch.where(amax > 0, amax / (E2M1_MAX * E4M3_MAX), torch.ones_like(amax))
        g = wf.reshape(*lead, rows, cols // NV_GROUP, NV_GROUP)
        gamax = g.abs().amax(-1)
        gs = global_scale[..., None, None]
        group_scale = e4m3_encode(gamax / E2M1_MAX / gs)                          # NaN/Inf groups -> NaN/448
        group_scale = torch.where(torch.isfinite(gamax), group_scale, torch.full_like(group_scale, 0x7F))
        denom = e4m3_decode(group_scale) * gs
        scaled = torch.where(denom[..., None] > 0, g / denom[..., None], torch.zeros_like(g))
        codes = e2m1_encode(torch.nan_to_num(scaled, nan=0.0))
        return cls(pack_nibbles(codes).reshape(*lead, rows, cols // 2).contiguous(), group_scale.contiguous().view(torch.float8_e4m3fn),
                   global_scale.contiguous(), tuple(w.shape))

    @property
    def weight_global_scale(self) -> Tensor:
        """compressed-tensors' name: the reciprocal of ModelOpt's weight_scale_2."""
        return 1.0 / self.weight_scale_2

    @classmethod
    def from_compressed_tensors(cls, weight_packed: Tensor, weight_scale: Tensor, weight_global_scale: Tensor,
                                shape: tuple) -> "NVFP4Weight":
        return cls(weight_packed, weight_scale, 1.0 / torch.as_tensor(weight_global_scale, dtype=torch.float32), shape)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> Tensor:
        *lead, rows, cols = self.shape
        values = e2m1_decode(unpack_nibbles(self.weight)).reshape(*lead, rows, cols // NV_GROUP, NV_GROUP)
        scale = e4m3_decode(self.weight_scale) * self.weight_scale_2.reshape(*lead, 1, 1)
        return (values * scale[..., None]).reshape(*lead, rows, cols).to(dtype)
