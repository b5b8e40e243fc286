"""nn.Linear with dynamoe's CPU decode path: a loaded model's linears run through
:func:`dynamoe.ops.linear` (the bf16 GEMV kernel for decode-sized inputs, F.linear otherwise)."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ..ops import cpu_kernels, linear

__all__ = ["Linear", "use_fast_linears_"]


class Linear(nn.Linear):
    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


def use_fast_linears_(model: nn.Module) -> nn.Module:
    """Switch every plain nn.Linear in ``model`` to :class:`Linear` in place, and fuse each
    attention's q/k/v weights into one buffer (``fuse_qkv_``: one matmul instead of three) -- same
    parameters, same state dict, same results up to the kernels' fp32 accumulation order."""
    bf16_cpu = False
    for m in model.modules():
        if type(m) is nn.Linear:
            m.__class__ = Linear
            bf16_cpu = bf16_cpu or (m.weight.dtype == torch.bfloat16 and m.weight.device.type == "cpu")
    for m in model.modules():
        if hasattr(m, "fuse_qkv_"):
            m.fuse_qkv_()
    if bf16_cpu:
        cpu_kernels.load()  # build (once per machine) now, not in the middle of the first request
    return model
