"""RMSNorm, computed in fp32 whatever the activations' dtype (inference on CPU: one kernel call,
dynamoe/ops/csrc/rms_norm.cpp, instead of ~9 small ops), and the gated RMSNorm of linear-attention
outputs (Gated DeltaNet: ``norm(x) * silu(z)``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops import cpu_kernels

_KERNEL_DTYPES = (torch.bfloat16, torch.float32)

__all__ = ["RMSNorm", "GatedRMSNorm", "LayerNorm"]


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps) over the last dim.

    ``weight_in_fp32``: multiply by the weight before casting back to the input dtype (GPT-OSS),
    instead of after (Llama, Qwen3, Mixtral, DeepSeek). The two agree in fp32.

    ``zero_centered``: the stored weight w is centred on zero and the scale is ``1 + w`` (Qwen3-Next,
    Qwen3.5: y = (x / rms(x) * (1 + w)) in fp32, then cast), so a fresh weight is zeros. The fused
    decode kernels read the flag (``zero_centered``: the same 1 + w in fp32).
    """

    def __init__(self, dim: int, eps: float = 1e-6, weight_in_fp32: bool = False, zero_centered: bool = False,
                 dtype=None, device=None):
        super().__init__()
        self.eps, self.zero_centered = eps, zero_centered
        self.weight_in_fp32 = weight_in_fp32 or zero_centered
        init = torch.zeros if zero_centered else torch.ones
        self.weight = nn.Parameter(init(dim, dtype=dtype, device=device))

    def scale(self) -> Tensor:
        """The multiplier of the normalised x: ``weight``, or fp32 ``1 + weight`` when zero_centered."""
        return self.weight.float() + 1.0 if self.zero_centered else self.weight

    def forward(self, x: Tensor) -> Tensor:
        if self.zero_centered:  # (1 + w) in fp32, in the kernel too (the fused decode kernels' rounding)
            if (not torch.is_grad_enabled() and x.device.type == "cpu" and x.dtype in _KERNEL_DTYPES
                    and self.weight.dtype == x.dtype and x.numel()):
                k = cpu_kernels.load()
                if k is not None:
                    return self._kernel(k, x, self.weight.contiguous())
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
            return (h * self.scale()).to(x.dtype)
        if (not torch.is_grad_enabled() and x.device.type == "cpu" and x.dtype in _KERNEL_DTYPES
                and self.weight.dtype == x.dtype and x.numel()):
            k = cpu_kernels.load()
            if k is not None:  # inference on CPU: one kernel call (same math, fp32 statistics)
                return self._kernel(k, x, self.weight.contiguous())
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_in_fp32:
            return (self.weight.float() * h).to(x.dtype)
        return self.weight * h.to(x.dtype)

    def _kernel(self, k, x: Tensor, weight: Tensor) -> Tensor:
        rows = x.reshape(-1, x.size(-1))
        rows = rows if rows.stride(-1) == 1 else rows.contiguous()
        out = torch.empty(x.shape, dtype=x.dtype)
        k.rms_norm_out(rows, weight, self.eps, self.weight_in_fp32, out, self.zero_centered)
        return out

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}" + (", zero_centered" if self.zero_centered else "")


class GatedRMSNorm(nn.Module):
    """y = (weight * (x / rms(x)) in x's dtype) * silu(z) in fp32, cast to x's dtype, over the last dim
    (Gated DeltaNet's output norm; the weight is a plain scale, initialised to ones). ``weight_in_fp32``: the weight
    multiplies the fp32 normed x, before any cast (Lara-4-Mini); the two agree in fp32. ``activation``: the gate's,
    'silu' (default) or 'sigmoid' (Qwen4-Exp's ``output_gate_type``).
    ``forward(x [..., d], z [..., d]) -> [..., d]``."""

    ACTIVATIONS = {"silu": F.silu, "sigmoid": torch.sigmoid}

    def __init__(self, dim: int, eps: float = 1e-6, dtype=None, device=None, *, weight_in_fp32: bool = False,
                 activation: str = "silu"):
        super().__init__()
        if activation not in self.ACTIVATIONS:
            raise ValueError(f"the gated RMSNorm's activation must be one of {sorted(self.ACTIVATIONS)}, "
                             f"got {activation!r}")
        self.eps, self.weight_in_fp32, self.activation = eps, weight_in_fp32, activation
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: Tensor, z: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight.float() * h if self.weight_in_fp32 else self.weight * h.to(x.dtype)
        return (h * self.ACTIVATIONS[self.activation](z.float())).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}" + (f", {self.activation}" if self.activation != "silu"
                                                               else "")


class LayerNorm(nn.Module):
    """y = (weight * (x - mean(x)) / sqrt(var(x) + eps) [+ bias]) over the last dim, all in fp32, cast back to x's
    dtype once (Cohere's LayerNorm: weight only, ``bias=False``). The fused decode kernels take RMSNorm only: they
    refuse this one by its type."""

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = False, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(dim, dtype=dtype, device=device)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        bias = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), (x.size(-1),), self.weight.float(), bias, self.eps).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, bias={self.bias is not None}"
