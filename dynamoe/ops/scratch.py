"""Reusable scratch buffers for inference temporaries on CPU.

On CPU a fresh multi-megabyte tensor is page-faulted in on every call: for an MoE layer the
dispatch and hidden buffers ([T*k, D] and [T*k, F]) cost as much as the activation and combine
together (docs/benchmarks.md). Under ``torch.no_grad`` the layer takes them from here instead: one
buffer per (purpose, dtype, device), per thread, grown to the largest size seen. Outputs handed to
the caller never live in scratch. ``release_scratch()`` frees everything.
"""
from __future__ import annotations

import threading

import torch

__all__ = ["scratch", "release_scratch", "scratch_bytes"]

_local = threading.local()


def _cache() -> dict:
    cache = getattr(_local, "buffers", None)
    if cache is None:
        cache = _local.buffers = {}
    return cache


def scratch(purpose: str, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A contiguous [rows, cols] tensor whose contents are undefined, reused across calls."""
    key = (purpose, dtype, torch.device(device))
    need = rows * cols
    buf = _cache().get(key)
    if buf is None or buf.numel() < need:
        # a normal tensor even when first asked for under inference_mode, so that later no_grad
        # calls may write into it
        with torch.inference_mode(False):
            buf = torch.empty(need, dtype=dtype, device=device)
        _cache()[key] = buf
    return buf[:need].view(rows, cols)


def scratch_bytes() -> int:
    """Bytes held by this thread's scratch buffers."""
    return sum(b.numel() * b.element_size() for b in _cache().values())


def release_scratch() -> None:
    """Free this thread's scratch buffers."""
    _cache().clear()
