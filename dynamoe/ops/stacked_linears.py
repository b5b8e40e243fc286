"""Linears that read the same input, stored as row blocks of one weight (q/k/v; a GLU's gate and up).

:func:`stack_linears_` gives their parameters new storage: one [sum(O_i), I] weight (and bias) of which
each parameter is a view of its rows, so that inference runs one matmul (one GEMV at decode) and the
fused decode kernels read one contiguous weight. Names, shapes and the state dict stay; in-place
updates (``load_state_dict``) reach the stacked weight through the views. :func:`still_stacked` says
whether the parameters still view it (a parameter replaced, ``.data`` reassigned or copied apart
breaks that).
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor, nn

__all__ = ["stack_linears_", "still_stacked"]


def stack_linears_(linears: Sequence[nn.Module]) -> tuple[Tensor, Tensor | None] | None:
    """(weight, bias) that the plain ``nn.Linear``\\ s ``linears`` now view, or None where they cannot be
    stacked (not all plain linears, of one dtype and device, with or without biases alike, or parameters
    that need gradients: a model being trained keeps its own parameters)."""
    if not all(isinstance(p, nn.Linear) and type(p.weight) is nn.Parameter for p in linears):
        return None
    ws, bs = [p.weight for p in linears], [p.bias for p in linears]
    if (len({(w.dtype, w.device, w.size(1)) for w in ws}) != 1 or any(w.requires_grad for w in ws)
            or (any(b is None for b in bs) and not all(b is None for b in bs))):
        return None
    with torch.no_grad():
        weight = torch.cat([w.detach() for w in ws])
        bias = None if bs[0] is None else torch.cat([b.detach() for b in bs])
        row = 0
        for p in linears:
            n = p.weight.size(0)
            p.weight = nn.Parameter(weight[row:row + n], requires_grad=False)
            if bias is not None:
                p.bias = nn.Parameter(bias[row:row + n], requires_grad=False)
            row += n
    return weight, bias


def still_stacked(linears: Sequence[nn.Module], stacked: tuple[Tensor, Tensor | None]) -> bool:
    """Whether ``linears``' parameters are still the row views of ``stacked`` (weight, bias)."""
    weight, bias = stacked
    row_bytes = weight.stride(0) * weight.element_size()
    ptr, row = weight.data_ptr(), 0
    for m in linears:  # (the modules' dicts: this runs on every decode step)
        params = m._parameters
        w, b = params.get("weight"), params.get("bias")
        if w is None or w.data_ptr() != ptr + row * row_bytes or (bias is not None and (
                b is None or b.data_ptr() != bias.data_ptr() + row * bias.element_size())):
            return False
        row += w.size(0)
    return True


class StackedLinears:
    """Mixin for an nn.Module whose sub-linears ``stacked_names`` (in row order) read one input: after
    :meth:`stack_linears_` they view one weight (:meth:`stacked`), kept so over ``.to()`` / ``.float()``
    and deep copies."""

    #: the sub-linears stacked, in row order (e.g. ("gate_proj", "up_proj"))
    stacked_names: tuple = ()

    def _stack_members(self) -> list:
        return [self._modules.get(n) for n in self.stacked_names]

    def stack_linears_(self) -> bool:
        """Stack the sub-linears (see :func:`stack_linears_`); True when they are."""
        s = stack_linears_(self._stack_members())
        object.__setattr__(self, "_stacked", s)  # (a plain attribute: not a parameter or state-dict entry)
        return s is not None

    def stacked(self) -> tuple[Tensor, Tensor | None] | None:
        """(weight, bias) the sub-linears still view, or None (never stacked, or no longer: then dropped)."""
        s = self.__dict__.get("_stacked")
        if s is not None and not still_stacked(self._stack_members(), s):
            object.__setattr__(self, "_stacked", None)
            return None
        return s

    def stacked_for(self, holds) -> tuple[Tensor, Tensor | None]:
        """:meth:`stacked` for a fused kernel: the sub-linears and their parameters recorded in ``holds``
        (dynamoe.ops.fused.Holds); raises Unfusable when they are not stacked."""
        from .fused import Unfusable

        s = holds.attr(self, "_stacked")
        if s is None or self.stacked() is None:
            raise Unfusable(f"{' / '.join(self.stacked_names)} are not stacked into one weight (stack_linears_)")
        for name in self.stacked_names:  # views of the stacked weight: p.data = ... moves them
            m = holds.module(self, name)
            for t in (holds.param(m, "weight"), holds.param(m, "bias")):
                if t is not None:
                    holds.pointer(t)
        return s

    def _apply(self, fn, recurse=True):
        # the parameters get new data one by one: stacked before, stacked after
        was = self.stacked() is not None
        super()._apply(fn, recurse)
        if was:
            self.stack_linears_()
        return self

    def __setstate__(self, state):
        super().__setstate__(state)
        if self.__dict__.get("_stacked") is not None and self.stacked() is None:  # a copy: parameters copied apart
            self.stack_linears_()
