"""nn.Linear with dynamoe's CPU decode path: a loaded model's linears run through
:func:`dynamoe.ops.linear` (the bf16 GEMV kernel for decode-sized inputs, F.linear otherwise)."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ..ops import cpu_kernels, linear
from ..ops.stacked_linears import StackedLinears

__all__ = ["Linear", "use_fast_linears_"]


class Linear(nn.Linear):
    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


def use_fast_linears_(model: nn.Module) -> nn.Module:
    """Switch every plain nn.Linear in ``model`` to :class:`Linear` in place, and fuse each
    attention's q/k/v weights into one buffer (``fuse_qkv_``: one matmul instead of three) and each GLU MLP's
    gate and up projections (:class:`~dynamoe.ops.stacked_linears.StackedLinears`) -- same
    parameters, same state dict, same results up to the kernels' fp32 accumulation order."""
    for m in model.modules():
        if type(m) is nn.Linear:
            m.__class__ = Linear
    for m in model.modules():
        if hasattr(m, "fuse_qkv_"):
            m.fuse_qkv_()
        if isinstance(m, StackedLinears):  # a GLU's gate and up projections (the decode kernels read them as one)
            m.stack_linears_()
    if any(p.device.type == "cpu" and p.dtype in (torch.bfloat16, torch.float32) for p in model.parameters()):
        # the decode kernels (GEMV, MoE experts, RMSNorm, RoPE): built once per machine, now rather
        # than in the middle of the first request
        cpu_kernels.load()
    return model
