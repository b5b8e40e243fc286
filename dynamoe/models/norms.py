"""RMSNorm, computed in fp32 whatever the activations' dtype (inference on CPU: one kernel call,
dynamoe/ops/csrc/rms_norm.cpp, instead of ~9 small ops)."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ..ops import cpu_kernels

_KERNEL_DTYPES = (torch.bfloat16, torch.float32)

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps) over the last dim.

    ``weight_in_fp32``: multiply by the weight before casting back to the input dtype (GPT-OSS),
    instead of after (Llama, Qwen3, Mixtral, DeepSeek). The two agree in fp32.
    """

    def __init__(self, dim: int, eps: float = 1e-6, weight_in_fp32: bool = False, dtype=None, device=None):
        super().__init__()
        self.eps, self.weight_in_fp32 = eps, weight_in_fp32
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: Tensor) -> Tensor:
        if (not torch.is_grad_enabled() and x.device.type == "cpu" and x.dtype in _KERNEL_DTYPES
                and self.weight.dtype == x.dtype and x.numel()):
            k = cpu_kernels.load()
            if k is not None:  # inference on CPU: one kernel call (same math, fp32 statistics)
                dim = x.size(-1)
                rows = x.reshape(-1, dim)
                rows = rows if rows.stride(-1) == 1 else rows.contiguous()
                out = torch.empty(x.shape, dtype=x.dtype)
                k.rms_norm_out(rows, self.weight.contiguous(), self.eps, self.weight_in_fp32, out)
                return out
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_in_fp32:
            return (self.weight.float() * h).to(x.dtype)
        return self.weight * h.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
