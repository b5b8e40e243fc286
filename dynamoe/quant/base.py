"""The quantized weight type shared by the formats.

A :class:`QuantizedWeight` is a logical float weight ``[..., out, in]`` (leading dims = experts) kept
packed in memory as the tensors its on-disk format stores. ``w[e]`` is expert e's weight (views,
no copy); ``w.dequantize(dtype)`` materialises a dense copy of *that* weight only, which is how the
matmuls use it: one expert (or one Linear) at a time, never the whole model.
"""
from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

__all__ = ["QuantizedWeight", "check_float_weight"]


def check_float_weight(w: Tensor, name: str = "w") -> None:
    if not isinstance(w, Tensor) or not w.is_floating_point() or w.dim() < 2:
        got = f"{w.dtype} {tuple(w.shape)}" if isinstance(w, Tensor) else type(w).__name__
        raise ValueError(f"{name} must be a floating-point tensor [..., out, in], got {got}")


class QuantizedWeight:
    """Base of BlockFP8Weight, MXFP4Weight, NVFP4Weight, INT4Weight (dataclasses of tensors + a shape)."""

    format: str = ""
    shape: tuple

    # -- to be provided by each format -----------------------------------------------------------
    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    # -- shared ----------------------------------------------------------------------------------
    def _tensor_fields(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self) if isinstance(getattr(self, f.name), Tensor)]

    @property
    def num_leading(self) -> int:
        return len(self.shape) - 2

    def __len__(self) -> int:
        if self.num_leading == 0:
            raise TypeError(f"a single {self.format} weight has no experts to index")
        return self.shape[0]

    def __getitem__(self, e: int) -> "QuantizedWeight":
        """Expert e's weight (leading dim), sharing storage."""
        if self.num_leading == 0:
            raise TypeError(f"a single {self.format} weight {self.shape} has no leading (expert) dim to index")
        if not -self.shape[0] <= e < self.shape[0]:
            raise IndexError(f"expert {e} out of range for {self.shape[0]} experts")
        changes = {name: getattr(self, name)[e] for name in self._tensor_fields()}
        return dataclasses.replace(self, shape=tuple(self.shape[1:]), **changes)

    @property
    def nbytes(self) -> int:
        """Bytes held by the packed tensors."""
        return sum(getattr(self, n).numel() * getattr(self, n).element_size() for n in self._tensor_fields())

    @property
    def dense_nbytes_bf16(self) -> int:
        return 2 * math.prod(self.shape)

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.nbytes / math.prod(self.shape)

    @property
    def device(self) -> torch.device:
        return getattr(self, self._tensor_fields()[0]).device

    def to(self, device) -> "QuantizedWeight":
        return dataclasses.replace(self, **{n: getattr(self, n).to(device) for n in self._tensor_fields()})

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={self.shape}, {self.bits_per_weight:.2f} bits/weight)"
