"""Grouped matmul over the ragged layout (rows sorted by group), fp32 accumulation.

Legend: N rows, G groups (row blocks; group g uses weight g % E), E weights (experts), I input
features, O output features, F hidden features of a GLU (w1 then has 2F outputs: gate rows, then
up rows).

Layouts: x [N, I] (or, with ``gather``, x [T, I] read at rows ``gather[n]``: the dispatch fused into
the first matmul); w [E, I, O], or with ``trans_w`` [E, O, I] (the nn.Linear layout) -- any strides;
offsets [G + 1] int32 on the device (group g holds rows offsets[g] .. offsets[g+1]); bias [E, O];
row_scale [N]; out [N, O] (or [N, F] with ``swiglu``) in x's dtype.

Scheduling needs no host synchronisation: the grid covers an upper bound of the M tiles
(ceil(N / BLOCK_M) + G), every program derives its (group, first row) from the offsets it loads, and
programs past the last real tile return at once. Epilogue, all in fp32 before the one rounding:
+ bias, SwiGLU (``silu(x w_gate + b_gate) * (x w_up + b_up)``, the two accumulators side by side),
* row scale (the combine weight). Forward only; the reference is dynamoe.ops.grouped_matmul.
"""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import fix_interpreter, interpreted, next_pow2

fix_interpreter()

__all__ = ["grouped_gemm", "offsets_from_counts", "pick_config"]


@triton.jit
def _tile_of(pid_m, offsets_ptr, G, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr):
    """(group, first row, group's end row, valid) of the pid_m-th M tile of the ragged layout."""
    gcols = tl.arange(0, BLOCK_G)
    gmask = gcols < G
    start = tl.load(offsets_ptr + gcols, mask=gmask, other=0)
    end = tl.load(offsets_ptr + gcols + 1, mask=gmask, other=0)
    tiles = (end - start + BLOCK_M - 1) // BLOCK_M
    last = tl.cumsum(tiles, axis=0)                        # inclusive: tiles up to and including group g
    g = tl.sum((last <= pid_m).to(tl.int32), axis=0)       # groups that end at or before this tile
    hit = gcols == g
    first_tile = tl.sum(tl.where(hit, last - tiles, 0), axis=0)
    row0 = tl.sum(tl.where(hit, start, 0), axis=0) + (pid_m - first_tile) * BLOCK_M
    row_end = tl.sum(tl.where(hit, end, 0), axis=0)
    return g, row0, row_end, g < G


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """acc += a @ b; fp32 operands in full fp32 with IEEE (the default would use TF32 on GPUs)."""
    if IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _swizzle(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """Tutorial-style grouped ordering: GROUP_M consecutive M tiles sweep the N tiles together."""
    width = GROUP_M * num_n
    group = pid // width
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    return pid_m, pid_n


@triton.jit
def _tile_rows(pid, num_m, num_n, offsets_ptr, gather_ptr, G, E_W, GATHER: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_G: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's tile: (N tile, weight e, rows, row mask, source rows in x, whether it is a real
    tile). Shared by the bf16 and the packed-weight kernels."""
    pid_m, pid_n = _swizzle(pid, num_m, num_n, GROUP_M)
    g, row0, row_end, valid = _tile_of(pid_m, offsets_ptr, G, BLOCK_M, BLOCK_G)
    e = (g % E_W).to(tl.int64)
    rows = row0 + tl.arange(0, BLOCK_M)
    rmask = (rows < row_end) & valid
    if GATHER:
        src = tl.load(gather_ptr + rows, mask=rmask, other=0).to(tl.int64)
    else:
        src = rows.to(tl.int64)
    return pid_n, e, rows, rmask, src, valid


@triton.jit
def _epilogue(acc, acc_up, e, rows, rmask, cols, cmask, bias_ptr, stride_be, F_UP, scale_ptr, out_ptr, stride_om,
              HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, SWIGLU: tl.constexpr):
    """+ bias, SwiGLU, * row scale, all in fp32, then one rounding into ``out``."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + e * stride_be + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        if SWIGLU:
            acc_up += tl.load(bias_ptr + e * stride_be + F_UP + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    if SWIGLU:
        acc = acc * tl.sigmoid(acc) * acc_up
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + rows, mask=rmask, other=0.0).to(tl.float32)[:, None]
    o_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _grouped_gemm_kernel(x_ptr, w_ptr, bias_ptr, scale_ptr, gather_ptr, offsets_ptr, out_ptr,
                         G, E_W, O, I, F_UP, num_m,
                         stride_xm, stride_xk, stride_we, stride_wk, stride_wn, stride_be, stride_om,
                         HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, GATHER: tl.constexpr,
                         SWIGLU: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCK_G: tl.constexpr, GROUP_M: tl.constexpr):
    pid_n, e, rows, rmask, src, valid = _tile_rows(tl.program_id(0), num_m, tl.cdiv(O, BLOCK_N), offsets_ptr,
                                                   gather_ptr, G, E_W, GATHER, BLOCK_M, BLOCK_G, GROUP_M)
    if valid:
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < O
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = x_ptr + src[:, None] * stride_xm + ks[None, :] * stride_xk
        b_ptrs = w_ptr + e * stride_we + ks[:, None] * stride_wk + cols[None, :].to(tl.int64) * stride_wn
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, I, BLOCK_K):
            kmask = (k0 + ks) < I
            a = tl.load(a_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=kmask[:, None] & cmask[None, :], other=0.0)
            if UPCAST:  # the interpreter's half-precision dot is wrong: fp32 tiles there
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = _dot(a, b, acc, IEEE)
            if SWIGLU:
                b_up = tl.load(b_ptrs + F_UP * stride_wn, mask=kmask[:, None] & cmask[None, :], other=0.0)
                if UPCAST:
                    b_up = b_up.to(tl.float32)
                acc_up = _dot(a, b_up, acc_up, IEEE)
            a_ptrs += BLOCK_K * stride_xk
            b_ptrs += BLOCK_K * stride_wk
        _epilogue(acc, acc_up, e, rows, rmask, cols, cmask, bias_ptr, stride_be, F_UP, scale_ptr, out_ptr, stride_om,
                  HAS_BIAS, HAS_SCALE, SWIGLU)


def offsets_from_counts(counts: Sequence[int], device) -> Tensor:
    """int32 [G + 1] row offsets of Python-int counts, copied to ``device`` without a host sync
    (pinned staging buffer on CUDA)."""
    off = [0]
    for c in counts:
        off.append(off[-1] + int(c))
    t = torch.tensor(off, dtype=torch.int32)
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def pick_config(rows_per_group: float, out_cols: int, swiglu: bool = False, interpret: bool = False) -> dict:
    """Tile sizes by the average rows per group (decode: few rows, weight-read bound; prefill:
    many rows, compute bound). Heuristic for Hopper-class GPUs; the interpreter gets small tiles."""
    if interpret:
        return dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=4, num_warps=4, num_stages=1)
    if rows_per_group <= 16:
        cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)
    elif rows_per_group <= 32:
        cfg = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)
    elif rows_per_group <= 64:
        cfg = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4)
    else:
        cfg = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)
    if swiglu and cfg["BLOCK_N"] > 64:  # two accumulators
        cfg["BLOCK_N"] = 64
    cfg["GROUP_M"] = 8
    return cfg


def grouped_gemm(x: Tensor, w: Tensor, offsets_G1: Tensor, bias: Tensor | None = None, trans_w: bool = False,
                 row_scale: Tensor | None = None, gather: Tensor | None = None, swiglu: bool = False,
                 out: Tensor | None = None, num_rows: int | None = None, config: dict | None = None) -> Tensor:
    """y[n] = (x[src(n)] @ w[g(n) % E] + bias[e]) (SwiGLU'd) * row_scale[n] for the ragged layout.

    Args:
        x: [N, I] rows sorted by group, or any [T, I] when ``gather`` [N] gives each row's source row.
        w: [E, I, O] or, with ``trans_w``, [E, O, I]; with ``swiglu`` O = 2F (gate outputs, then up).
        offsets_G1: int32 [G + 1] row offsets on x's device (see offsets_from_counts).
        num_rows: N when ``gather`` is None and x has more rows than the groups cover (default: x's rows).
        config: tile sizes (see pick_config), chosen from N / G when None.
    Returns:
        [N, O] (or [N, F] with ``swiglu``) in x's dtype.
    """
    E = w.size(0)
    wv = w.transpose(1, 2) if trans_w else w                  # logical [E, I, O] view, any strides
    I, O_w = wv.size(1), wv.size(2)
    if x.size(1) != I:
        raise ValueError(f"x has {x.size(1)} features but w expects {I}")
    if swiglu and O_w % 2:
        raise ValueError(f"swiglu needs an even number of w outputs (gate then up), got {O_w}")
    O = O_w // 2 if swiglu else O_w
    N = gather.numel() if gather is not None else (x.size(0) if num_rows is None else num_rows)
    G = offsets_G1.numel() - 1
    if out is None:
        out = torch.empty(N, O, dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (N, O) or out.stride(1) != 1:
        raise ValueError(f"out must be a [{N}, {O}] tensor with unit column stride, got {tuple(out.shape)}")
    if N == 0 or O == 0:
        return out
    if I == 0:
        return out.zero_() if bias is None else _bias_only(out, bias, offsets_G1, E, swiglu, O, row_scale)
    interp = interpreted(_grouped_gemm_kernel)
    cfg = dict(config or pick_config(N / max(G, 1), O, swiglu, interp))
    BM, BN = cfg["BLOCK_M"], cfg["BLOCK_N"]
    num_m = triton.cdiv(N, BM) + min(G, N)
    grid = (num_m * triton.cdiv(O, BN),)
    dummy = out
    _grouped_gemm_kernel[grid](
        x, wv, bias if bias is not None else dummy, row_scale if row_scale is not None else dummy,
        gather if gather is not None else dummy, offsets_G1, out,
        G, E, O, I, O, num_m,
        x.stride(0), x.stride(1), wv.stride(0), wv.stride(1), wv.stride(2),
        bias.stride(0) if bias is not None else 0, out.stride(0),
        HAS_BIAS=bias is not None, HAS_SCALE=row_scale is not None, GATHER=gather is not None, SWIGLU=swiglu,
        UPCAST=interp and x.dtype != torch.float32, IEEE=x.dtype == torch.float32,
        BLOCK_G=max(next_pow2(G), 16), **cfg)
    return out


def _bias_only(out, bias, offsets_G1, E, swiglu, O, row_scale):
    """I == 0: the product is empty, only the bias (and activation, scale) remain."""
    counts = (offsets_G1[1:] - offsets_G1[:-1]).long()
    group = torch.repeat_interleave(torch.arange(counts.numel(), device=out.device) % E, counts, output_size=out.size(0))
    b = bias.index_select(0, group).float()
    y = torch.nn.functional.silu(b[:, :O]) * b[:, O:] if swiglu else b
    if row_scale is not None:
        y = y * row_scale.float().unsqueeze(1)
    return out.copy_(y)
