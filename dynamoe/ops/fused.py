"""What a fused decode kernel reads, held once per module state, and how it knows it is still current.

A fused kernel (csrc/attn_decode.cpp, csrc/moe_block_decode.cpp, a DecodeStack of them) takes a bound
weight struct (``kernels.AttentionWeights`` / ``kernels.MoEWeights``, csrc/decode_weights.h). Building
one means finding the module's tensors and deciding whether the kernel applies at all -- ~0.1 ms of
Python per layer -- so a :class:`Fused` keeps the struct together with everything the decision read:

* **refs**: (mapping, key, object) for every attribute, submodule and parameter looked up (a module's
  ``_modules`` / ``_parameters`` / ``__dict__``): reassigning any of them makes it stale;
* **tensors**: data pointers of the tensors the struct holds and of those it reads through another one
  (q/k/v parameters that are views of one fused buffer): ``p.data = ...`` moves them; and (pointer,
  version) of tensors the struct holds a copy of or something derived from (an in-place update makes
  it stale);
* **values**: (function, value) for configuration read by value (a routing config changed in place).

``Fused.current()`` checks those, in microseconds; there are no process-wide hooks. A builder that
finds the kernel does not apply raises :class:`Unfusable` with the reason, which callers report once
(dynamoe.models.decode_plan) and the layer-by-layer path runs the modules instead.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from . import cpu_kernels

__all__ = ["Fused", "FusedSlot", "slot", "Holds", "Unfusable", "MAX_ROWS", "RMSNormSpec", "struct"]

#: the most rows (decode sequences or tokens) a fused decode kernel takes (csrc/decode_weights.h's kMaxRows)
MAX_ROWS = cpu_kernels.MAX_ROWS


@dataclass(frozen=True)
class RMSNormSpec:
    """An RMSNorm a fused kernel applies first (dynamoe.models.RMSNorm's weight, eps, where the weight is applied,
    and whether the scale is 1 + weight)."""

    weight: Tensor
    eps: float
    weight_in_fp32: bool
    zero_centered: bool = False


class Unfusable(Exception):
    """A fused kernel does not apply here; ``str(exc)`` says why (e.g. "q/k norms over all heads")."""


class Holds:
    """What a builder reads: looked-up attributes (refs), tensors read by pointer, values."""

    __slots__ = ("refs", "tensors", "values")

    def __init__(self) -> None:
        self.refs: list = []
        self.tensors: list = []
        self.values: list = []

    def attr(self, obj, name: str, default=None):
        """``obj.name`` from its ``__dict__`` (a plain attribute), remembered."""
        d = obj.__dict__
        v = d.get(name, default)
        self.refs.append((d, name, v))
        return v

    def module(self, parent, name: str):
        d = parent._modules
        m = d.get(name)
        self.refs.append((d, name, m))
        return m

    def param(self, module, name: str) -> Tensor | None:
        d = module._parameters
        if name not in d:
            return self.buffer(module, name)
        p = d[name]
        self.refs.append((d, name, p))
        return p

    def buffer(self, module, name: str) -> Tensor | None:
        d = module._buffers
        b = d.get(name)
        self.refs.append((d, name, b))
        return b

    def value(self, fn: Callable[[], Any]):
        v = fn()
        self.values.append((fn, v))
        return v

    def pointer(self, t: Tensor) -> None:
        """``t``'s storage must stay where it is (it is read through another tensor)."""
        self.tensors.append((t, t.data_ptr(), None))

    def derived(self, t: Tensor) -> None:
        """The struct holds a tensor computed from ``t``: stale once ``t`` changes."""
        self.tensors.append((t, t.data_ptr(), _version(t)))

    def fp32(self, t: Tensor | None) -> Tensor | None:
        """A contiguous fp32 copy of ``t`` (``t`` itself when it is one), stale once ``t`` changes."""
        if t is None:
            return None
        if t.dtype == torch.float32 and t.is_contiguous():
            return t
        self.tensors.append((t, t.data_ptr(), _version(t)))
        return t.float().contiguous()


def _version(t: Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter: changes cannot be seen
        raise Unfusable("a kernel would hold a copy of an inference-mode tensor (its changes cannot be tracked)") from None


class Fused:
    """A kernel's weight struct for one module state (see the module docstring)."""

    __slots__ = ("weights", "refs", "tensors", "values", "extra", "after")

    def __init__(self, weights, holds: Holds, extra=None, after=None) -> None:
        #: ``after``: a module whose output on the kernel's input is added to the kernel's output (a part
        #: the kernel cannot read, e.g. shared experts that are not stacked), or None
        self.weights, self.extra, self.after = weights, extra, after
        self.refs, self.tensors, self.values = tuple(holds.refs), tuple(holds.tensors), tuple(holds.values)

    def current(self) -> bool:
        for d, k, o in self.refs:
            if d.get(k) is not o:
                return False
        for t, p, v in self.tensors:
            if t.data_ptr() != p or (v is not None and t._version != v):
                return False
        for fn, v in self.values:
            if fn() != v:
                return False
        return True


class FusedSlot:
    """A module's cached :class:`Fused` under a key (e.g. (norm module, dtype)); copies and pickles of the
    module start with an empty slot (the struct holds the original's tensors)."""

    __slots__ = ("key", "fused")

    def __init__(self) -> None:
        self.key = self.fused = None

    def get(self, key) -> Fused | None:
        """The cached Fused for ``key`` while it is current, else None."""
        f = self.fused
        return f if f is not None and self.key == key and f.current() else None

    def put(self, key, fused: Fused) -> Fused:
        self.key, self.fused = key, fused
        return fused

    def __deepcopy__(self, memo) -> "FusedSlot":
        return FusedSlot()

    def __reduce__(self):
        return FusedSlot, ()


def slot(module) -> FusedSlot:
    """``module``'s :class:`FusedSlot` (a plain attribute: no submodule, buffer or state-dict entry)."""
    s = module.__dict__.get("_fused")
    if s is None:
        s = module.__dict__["_fused"] = FusedSlot()
    return s


def struct(cls, holds: Holds, **fields):
    """An instance of a bound kernel struct (``kernels.AttentionWeights``...) with ``fields`` set by name;
    the tensors it holds must stay where they are (``holds.pointer``: ``p.data = ...`` makes it stale)."""
    s = cls()
    for name, value in fields.items():
        if isinstance(value, Tensor):
            holds.pointer(value)
        setattr(s, name, value)
    return s
