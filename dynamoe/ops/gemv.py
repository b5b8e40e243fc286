"""``linear(x, w, bias)`` = ``F.linear`` with a decode fast path on CPU.

For bf16 weights and a handful of rows (decode: one token per sequence), F.linear goes through
oneDNN's GEMV, which on AVX512-BF16 CPUs reads the weight at about a third of the memory bandwidth
(docs/benchmarks.md). There, the rows go through dynamoe's bf16 GEMV kernel (dynamoe.ops.cpu_kernels:
AVX512-BF16 dot products over four weight rows at a time, fp32 accumulation) -- only without
autograd, for contiguous 2-D weights, and when the kernel could be built; everything else, and
every result's shape and dtype, is F.linear's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import cpu_kernels

__all__ = ["linear", "small_rows_kernel", "KERNEL_MAX_ROWS"]

# rows up to which the kernel beats oneDNN (measured: 1-2 rows clearly; beyond, oneDNN's blocked
# GEMM catches up on large weights)
KERNEL_MAX_ROWS = 2


def small_rows_kernel(x: Tensor, w: Tensor):
    """The kernel module when (x [rows, I], w [O, I]) qualify for it, else None."""
    if (x.device.type != "cpu" or x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or w.dim() != 2
            or not 1 <= x.size(0) <= KERNEL_MAX_ROWS or not w.is_contiguous() or x.stride(-1) != 1):
        return None
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return None
    return cpu_kernels.load()


def linear(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    rows = x.reshape(-1, x.size(-1)) if x.dim() != 2 else x
    k = small_rows_kernel(rows, w) if (bias is None or (bias.dtype == torch.bfloat16 and not bias.requires_grad)) else None
    if k is None:
        return F.linear(x, w, bias)
    rows = rows.contiguous() if rows.stride(0) != rows.size(1) else rows
    out = rows.new_empty(rows.size(0), w.size(0))
    k.bf16_gemv_out(rows, w, bias.contiguous() if bias is not None else None, out)
    return out.view(*x.shape[:-1], w.size(0))
