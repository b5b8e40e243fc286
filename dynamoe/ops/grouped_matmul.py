"""Grouped matmul over rows sorted by expert (the ragged, dropless layout).

Legend: N rows (sum of counts), E groups (experts), I input features, O output features.

``grouped_mm(x_NI, w, counts)`` computes, for every group e, ``x_e @ w[e]`` (``w`` is [E, I, O]) or
with ``trans_w=True`` ``x_e @ w[e].T`` (``w`` is [E, O, I], the nn.Linear layout), optionally adding
``bias[e]`` in the same call (addmm). Two backends:

* ``"loop"``: one BLAS call per non-empty group writing straight into the output (``out=``), wrapped
  in an autograd Function whose backward does the same per group -- never ``w[e]`` indexing under
  autograd, whose backward would allocate a full-size zero gradient per expert. On CPU this beats
  ``torch._grouped_mm`` (see docs/benchmarks.md), and empty experts cost nothing (decode).
* ``"torch"``: ``torch._grouped_mm`` with int32 offsets; the default on CUDA. Its CUDA kernels
  take bf16 only (and, depending on the torch build, only some GPU generations): other dtypes,
  shapes whose strides are not 16-byte aligned, a CPU backward through the [E, I, O] layout, and
  any (device, dtype) on which the kernel once refused to run go to the loop instead.

With ``backend=None`` on CUDA at inference (no autograd), Triton installed and ``DYNAMOE_NO_TRITON``
unset, the Triton grouped GEMM (dynamoe.ops.triton.grouped_gemm) runs instead: one launch for all groups.

The counts arrive as Python ints (the dispatch plan already synchronised once to size things), so
neither backend adds a host synchronisation.

``counts`` may also list k*E groups (k >= 1): group g then uses ``w[g % E]``. That is the layout an
expert-parallel rank receives from the all-to-all -- W source blocks of its L experts' slots -- so
the experts read the received buffer in place instead of re-laying it out expert-major (the loop
backend; weight gradients sum over an expert's k groups).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .gemv import KERNEL_MAX_ROWS, small_rows_kernel
from .triton import FLOAT_DTYPES, no_grad_needed, use_triton

__all__ = ["grouped_mm", "grouped_mm_reference", "default_backend"]


def default_backend(device: torch.device) -> str:
    return "torch" if device.type == "cuda" and hasattr(torch, "_grouped_mm") else "loop"


def grouped_mm_reference(x_NI: Tensor, w: Tensor, counts: Sequence[int], bias: Tensor | None = None,
                         trans_w: bool = False, row_scale: Tensor | None = None) -> Tensor:
    """Plain reference: a Python loop of matmuls, concatenated."""
    outs = []
    for g, x_e in enumerate(torch.split(x_NI, list(counts))):
        e = g % w.size(0)
        w_e = w[e].t() if trans_w else w[e]
        y = x_e @ w_e
        outs.append(y if bias is None else y + bias[e])
    y = torch.cat(outs) if outs else x_NI.new_empty(0, w.size(1 if trans_w else 2))
    return y if row_scale is None else y * row_scale.unsqueeze(1)


def _groups(counts: list[int], E: int):
    """(weight index, row offset, rows) of the non-empty groups (group g uses weight g % E): with
    many experts and few tokens (decode) most groups are empty, and building views for them would
    cost more than the matmuls."""
    off = 0
    for g, c in enumerate(counts):
        if c:
            yield g % E, off, c
        off += c


# oneDNN (CPU bf16/fp16 matmuls) builds a kernel per distinct row count: ~3x the cost of the
# matmul itself. Row counts per expert change every step, so on CPU half precision each group's
# rows go through matmuls of bucketed sizes -- at most ~70 distinct shapes per weight, all cached
# after warm-up (docs/benchmarks.md). fp32 (MKL) has no such cost and runs one matmul per group.
_ROW_BUCKETS = (1024, 512, 256, 64)


def _chunked(x: Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16)


def _row_chunks(off: int, rows: int, chunked: bool):
    """(offset, rows) pieces covering [off, off + rows)."""
    if not chunked:
        yield off, rows
        return
    end = off + rows
    for b in _ROW_BUCKETS:
        while end - off >= b:
            yield off, b
            off += b
    if off < end:
        yield off, end - off


def _per_group_mm(x_NI: Tensor, w: Tensor, bias: Tensor | None, counts: list[int], trans_w: bool, out: Tensor) -> None:
    chunked = _chunked(x_NI)
    # decode: a row or two per expert, bf16 [O, I] weights -> dynamoe's bf16 GEMV (see ops.linear)
    k = small_rows_kernel(x_NI[:1], w[0]) if trans_w and chunked and w.is_contiguous() else None
    if k is not None and bias is not None and bias.dtype != torch.bfloat16:
        k = None
    small = []
    for e, off, c in _groups(counts, w.size(0)):
        if k is not None and c <= KERNEL_MAX_ROWS:
            small.append((e, off, c))  # all of them in one kernel call below
            continue
        w_e = w[e].t() if trans_w else w[e]  # no autograd here: a view, not a gradient buffer
        for o, n in (_row_chunks(off, c, True) if chunked else ((off, c),)):
            if bias is None:
                torch.mm(x_NI.narrow(0, o, n), w_e, out=out.narrow(0, o, n))
            else:
                torch.addmm(bias[e], x_NI.narrow(0, o, n), w_e, out=out.narrow(0, o, n))
    if small:
        k.bf16_grouped_gemv_out(x_NI, w, torch.tensor(small, dtype=torch.long), bias, out)


def _forward_no_grad(x_NI, w, bias, row_scale_N, counts, trans_w, out) -> Tensor:
    """The loop without an autograd node (inference): same math as _LoopGroupedMM.forward."""
    if out is None:
        out = x_NI.new_empty(x_NI.size(0), w.size(1) if trans_w else w.size(2))
    _per_group_mm(x_NI, w, bias, counts, trans_w, out)
    if row_scale_N is not None:
        out.mul_(row_scale_N.to(out.dtype).unsqueeze(1))
    return out


def _calloc_zeros(shape, dtype: torch.dtype) -> Tensor | None:
    """A CPU tensor of zeros in memory the OS hands out already zeroed (numpy's zeros is calloc),
    or None without numpy. Nothing is written: pages nobody writes stay the shared zero page."""
    try:
        import numpy as np
    except ImportError:
        return None
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


def _grad_buffer(shape, dtype: torch.dtype, device: torch.device, calloc: bool) -> Tensor:
    """Contiguous gradient of a stacked [E, ...] weight. Autograd wants the parameter's whole shape,
    but at decode most experts get no rows: zeroing them (torch.zeros, or a fill per expert) was
    ~80 % of a decode forward+backward on CPU -- fresh pages faulted in only to be written with
    zeros. ``calloc`` (CPU): memory that costs nothing until touched, the backward writing only
    the experts hit. Measured slower once most experts are hit (D8), hence only for few."""
    if calloc and device.type == "cpu":
        z = _calloc_zeros(shape, dtype)
        if z is not None:
            return z
    return torch.empty(shape, dtype=dtype, device=device)


class _LoopGroupedMM(torch.autograd.Function):
    """y = (x_e @ w_e + b_e) * s, per group, with s an optional per-row scale (the MoE combine
    weight folded into the last expert matmul, so no separate [N, O] product is allocated)."""

    @staticmethod
    def forward(ctx, x_NI, w, bias, row_scale_N, counts, trans_w, out):
        out = _forward_no_grad(x_NI, w, bias, row_scale_N, counts, trans_w, out)
        ctx.save_for_backward(x_NI, w, bias, row_scale_N)
        ctx.counts, ctx.trans_w = counts, trans_w
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, g_NO: Tensor):
        x_NI, w, bias, s_N = ctx.saved_tensors
        counts, trans_w = ctx.counts, ctx.trans_w
        need_x, need_w, need_b, need_s = ctx.needs_input_grad[:4]
        g_NO = g_NO.contiguous()
        # gradient of the unscaled product u = x w + b is g * s
        gu_NO = g_NO * s_N.to(g_NO.dtype).unsqueeze(1) if s_N is not None else g_NO
        gx = x_NI.new_empty(x_NI.shape) if (need_x or need_s) else None
        E = w.size(0)
        rows_of = [sum(counts[e::E]) for e in range(E)]
        idle = [e for e in range(E) if rows_of[e] == 0]  # experts that got no rows: zero gradient
        calloc = w.device.type == "cpu" and 4 * len(idle) >= 3 * E and _calloc_zeros((1,), w.dtype) is not None
        gw = _grad_buffer(w.shape, w.dtype, w.device, calloc) if need_w else None
        gb = _grad_buffer((E, g_NO.size(1)), g_NO.dtype, g_NO.device, calloc) if need_b else None
        if not calloc:  # (calloc'd buffers come zeroed, see _grad_buffer)
            for e in idle:
                for t in (gw, gb):
                    if t is not None:
                        t[e].zero_()
        chunked = _chunked(x_NI)
        started: set = set()  # experts whose gradient already holds a first group's term
        for e, off, c in _groups(counts, E):
            first = e not in started
            started.add(e)
            if gx is not None:  # with a row scale this is first the *unscaled* g @ w^T (see below)
                w_e = w[e] if trans_w else w[e].t()
                for o, n in _row_chunks(off, c, chunked):
                    torch.mm((g_NO if need_s else gu_NO).narrow(0, o, n), w_e, out=gx.narrow(0, o, n))
            if need_w:  # dL/dw_e = x_e^T gu_e (or its transpose for the Linear layout), summed over chunks
                for i, (o, n) in enumerate(_row_chunks(off, c, chunked)):
                    a, b = (gu_NO.narrow(0, o, n), x_NI.narrow(0, o, n)) if trans_w else (x_NI.narrow(0, o, n), gu_NO.narrow(0, o, n))
                    if i == 0 and first:
                        torch.mm(a.t(), b, out=gw[e])
                    else:
                        gw[e].addmm_(a.t(), b)
            if need_b:
                if first:
                    torch.sum(gu_NO.narrow(0, off, c), dim=0, out=gb[e])
                else:
                    gb[e].add_(gu_NO.narrow(0, off, c).sum(0))
        gs = None
        if need_s:
            # dL/ds_n = <g_n, x_n w + b> = <g_n w^T, x_n> + <g_n, b_e>: reuses g w^T, no extra matmul
            acc = torch.promote_types(x_NI.dtype, torch.float32)  # fp32 for half inputs, fp64 stays fp64
            gs = (gx * x_NI).sum(1, dtype=acc)
            if bias is not None:
                group = torch.repeat_interleave(torch.arange(len(counts), device=g_NO.device) % E,
                                                torch.tensor(counts, device=g_NO.device), output_size=g_NO.size(0))
                gs += (g_NO * bias.index_select(0, group)).sum(1, dtype=acc)
            gs = gs.to(s_N.dtype)
            if need_x:
                gx.mul_(s_N.to(gx.dtype).unsqueeze(1))
        return (gx if need_x else None), gw, gb, gs, None, None, None


# (device type, dtype) pairs on which torch._grouped_mm raised once: not tried again.
_TORCH_REFUSED: set = set()


def _torch_can_run(x_NI: Tensor, w: Tensor, trans_w: bool) -> bool:
    if not hasattr(torch, "_grouped_mm") or (x_NI.device.type, x_NI.dtype) in _TORCH_REFUSED:
        return False
    if x_NI.device.type == "cuda" and x_NI.dtype != torch.bfloat16:
        return False
    if x_NI.device.type == "cpu" and not trans_w and torch.is_grad_enabled() and (x_NI.requires_grad or w.requires_grad):
        return False
    size = x_NI.element_size()
    w_view = w.transpose(-2, -1) if trans_w else w
    strides = [x_NI.stride(0)] + [s for s in w_view.stride() if s != 1]
    return all((s * size) % 16 == 0 for s in strides) and x_NI.stride(1) == 1


def _torch_grouped_mm(x_NI: Tensor, w: Tensor, counts: Sequence[int], bias: Tensor | None, trans_w: bool) -> Tensor | None:
    """torch._grouped_mm, or None when this (device, dtype) turns out not to be supported."""
    counts_E = torch.tensor(list(counts), device=x_NI.device)
    offs = torch.cumsum(counts_E, 0).to(torch.int32)
    try:
        out = torch._grouped_mm(x_NI, w.transpose(-2, -1) if trans_w else w, offs=offs)
    except (RuntimeError, NotImplementedError):
        _TORCH_REFUSED.add((x_NI.device.type, x_NI.dtype))
        return None
    if bias is not None:
        group_of_row = torch.repeat_interleave(torch.arange(w.size(0), device=x_NI.device), counts_E, output_size=x_NI.size(0))
        out = out + bias.index_select(0, group_of_row)
    return out


def grouped_mm(
    x_NI: Tensor,
    w: Tensor,
    counts: Sequence[int],
    bias: Tensor | None = None,
    trans_w: bool = False,
    backend: str | None = None,
    row_scale: Tensor | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """Per-group matmul of row blocks: rows ``[off_e, off_e + counts[e])`` of ``x`` times group e's weight.

    Args:
        x_NI: [N, I] rows sorted by group; N == sum(counts).
        w: [E, I, O] (or [E, O, I] with ``trans_w``).
        counts: E row counts (Python ints); or k*E, group g using weight g % E.
        bias: optional [E, O], added per group.
        backend: "loop", "torch" or None (per device; see module docstring).
        row_scale: optional [N] factor per output row (differentiable), applied after the bias.
        out: optional [N, O] buffer to write into (loop backend, no autograd: e.g. reusing a
            dispatch buffer at inference).
    Returns:
        [N, O] in x's dtype.
    """
    counts = [int(c) for c in counts]
    if x_NI.dim() != 2 or w.dim() != 3:
        raise ValueError(f"grouped_mm wants x [N, I] and w [E, *, *], got x {tuple(x_NI.shape)} and w {tuple(w.shape)}")
    if not counts or len(counts) % w.size(0) or sum(counts) != x_NI.size(0):
        raise ValueError(f"counts must have E={w.size(0)} entries (or a multiple of E) summing to N={x_NI.size(0)}, "
                         f"got {len(counts)} summing to {sum(counts)}")
    in_features = w.size(2) if trans_w else w.size(1)
    if x_NI.size(1) != in_features:
        raise ValueError(f"x has {x_NI.size(1)} features but w expects {in_features}")
    if row_scale is not None and tuple(row_scale.shape) != (x_NI.size(0),):
        raise ValueError(f"row_scale must have shape [N={x_NI.size(0)}], got {tuple(row_scale.shape)}")
    if out is not None:
        out_features = w.size(1) if trans_w else w.size(2)
        if tuple(out.shape) != (x_NI.size(0), out_features) or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous [{x_NI.size(0)}, {out_features}] tensor, got {tuple(out.shape)}")
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x_NI, w, bias, row_scale)):
            raise ValueError("out= is for inference only (no autograd)")
    if w.dtype != x_NI.dtype:  # autocast does not reach mm(out=): cast like it would (differentiably)
        w = w.to(x_NI.dtype)
        bias = bias.to(x_NI.dtype) if bias is not None else None
    if backend is None and use_triton(x_NI, w) and x_NI.dtype in FLOAT_DTYPES and no_grad_needed(x_NI, w, bias, row_scale):
        # --- Triton fast path (GPU inference; dynamoe.ops.triton.grouped_gemm): no per-group launches ---
        from .triton.grouped_gemm import grouped_gemm as triton_grouped_gemm, offsets_from_counts
        return triton_grouped_gemm(x_NI, w, offsets_from_counts(counts, x_NI.device), bias, trans_w,
                                   row_scale=row_scale, out=out)
    backend = backend or default_backend(x_NI.device)
    if backend not in ("loop", "torch"):
        raise ValueError(f"backend must be 'loop', 'torch' or None, got {backend!r}")
    if backend == "torch" and out is None and len(counts) == w.size(0) and _torch_can_run(x_NI, w, trans_w):
        y = _torch_grouped_mm(x_NI, w, counts, bias, trans_w)
        if y is not None:
            return y if row_scale is None else y * row_scale.to(y.dtype).unsqueeze(1)
    # the loop: also where shapes torch's kernel does not take end up
    if not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in (x_NI, w, bias, row_scale)):
        return _forward_no_grad(x_NI, w, bias, row_scale, counts, trans_w, out)
    return _LoopGroupedMM.apply(x_NI, w, bias, row_scale, counts, trans_w, out)
