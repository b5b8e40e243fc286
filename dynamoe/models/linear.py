"""nn.Linear with dynamoe's CPU decode path: a loaded model's linears run through
:func:`dynamoe.ops.linear` (the bf16 GEMV kernel for decode-sized inputs, F.linear otherwise)."""
from __future__ import annotations

from torch import Tensor, nn

from ..ops import linear

__all__ = ["Linear", "use_fast_linears_"]


class Linear(nn.Linear):
    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


def use_fast_linears_(model: nn.Module) -> nn.Module:
    """Switch every plain nn.Linear in ``model`` to :class:`Linear` in place (same parameters, same
    state dict, same results up to the kernel's fp32 accumulation order)."""
    for m in model.modules():
        if type(m) is nn.Linear:
            m.__class__ = Linear
    return model
