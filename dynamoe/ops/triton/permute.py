"""Permutation kernels: assignments sorted by expert, on the device, with no host synchronisation;
and the weighted combine back to tokens.

Legend: T tokens, K experts per token, E experts, A = T*K assignments, N rows (= A, dropless),
C capacity (slots per expert), D features, B blocks of BLOCK_A assignments.

An assignment is the pair (token t, choice k), flat index ``a = k * T + t`` (choice-major: Tutel's
slot order, the same as dynamoe.ops.slots.expert_slots). Its *slot* is its rank among the
assignments to the same expert in that order; its ragged *row* is ``offsets[e] + slot``, where
``offsets`` [E + 1] are the exclusive sums of the per-expert loads. With a capacity C the padded
layout [E, C, D] puts it at ``e * C + slot`` when ``slot < C`` (else it is dropped: index -1).

Kernels: ``_hist`` (per-block expert histogram), ``_scan`` (exclusive prefix over blocks, per expert,
and the loads), ``_scatter`` (slots, rows, the inverse permutation, tokens, weights). When all
assignments fit one block (decode), ``_scatter`` alone does everything: one launch.
``gather_rows`` reads x rows by index (dispatch); ``combine`` sums each token's K output rows times
its gate weights (deterministic: a gather per token, no atomics). Forward only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import fix_interpreter, next_pow2

fix_interpreter()

__all__ = ["ExpertSort", "sort_by_expert", "gather_rows", "combine"]


@dataclass
class ExpertSort:
    """Everything on the device; int64 indices unless said otherwise.

    counts_E: assignments per expert (the load). offsets_E1: int32 [E + 1] row offsets of the
    experts in the ragged layout (offsets[E] = A). slots_TK: slot of each assignment in its
    expert's queue. rows_TK: ragged row of each assignment. order_N: assignment (k*T + t) held by
    each ragged row. token_N: token of each ragged row. weight_N: fp32 gate weight of each row
    (when weights were given). padded_TK: e*C + slot, or -1 when dropped (when a capacity was
    given). padded_token_EC: token held by each padded slot, -1 for an empty slot.
    """

    counts_E: Tensor
    offsets_E1: Tensor
    slots_TK: Tensor
    rows_TK: Tensor
    order_N: Tensor
    token_N: Tensor
    weight_N: Optional[Tensor] = None
    padded_TK: Optional[Tensor] = None
    padded_token_EC: Optional[Tensor] = None
    capacity: int = 0


@triton.jit
def _load_block(ids_ptr, T, A, stride_t, stride_k, E, BLOCK_A: tl.constexpr, BLOCK_E: tl.constexpr):
    """The block's assignments a, their tokens, and the one-hot [BA, BE] of their experts."""
    a = tl.program_id(0) * BLOCK_A + tl.arange(0, BLOCK_A)
    amask = a < A
    t = a % T
    k = a // T
    e = tl.load(ids_ptr + t.to(tl.int64) * stride_t + k * stride_k, mask=amask, other=-1).to(tl.int32)
    cols = tl.arange(0, BLOCK_E)
    onehot = (e[:, None] == cols[None, :]).to(tl.int32)            # padding rows match no expert
    return a, amask, t, k, onehot, cols


@triton.jit
def _hist_kernel(ids_ptr, hist_ptr, T, A, stride_t, stride_k, E, BLOCK_A: tl.constexpr, BLOCK_E: tl.constexpr):
    a, amask, t, k, onehot, cols = _load_block(ids_ptr, T, A, stride_t, stride_k, E, BLOCK_A, BLOCK_E)
    h = tl.sum(onehot, axis=0)
    tl.store(hist_ptr + tl.program_id(0).to(tl.int64) * E + cols, h, mask=cols < E)


@triton.jit
def _scan_kernel(hist_ptr, counts_ptr, NB, E, BLOCK_B: tl.constexpr, BLOCK_EC: tl.constexpr):
    """hist [B, E] -> in place: the exclusive prefix over blocks (per expert); counts [E] = totals."""
    cols = tl.program_id(0) * BLOCK_EC + tl.arange(0, BLOCK_EC)
    cmask = cols < E
    run = tl.zeros([BLOCK_EC], tl.int32)
    for b0 in range(0, NB, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        m = (b < NB)[:, None] & cmask[None, :]
        ptrs = hist_ptr + b.to(tl.int64)[:, None] * E + cols[None, :]
        h = tl.load(ptrs, mask=m, other=0)
        inc = tl.cumsum(h, axis=0)
        tl.store(ptrs, inc - h + run[None, :], mask=m)
        run += tl.sum(h, axis=0)
    tl.store(counts_ptr + cols, run, mask=cmask)


@triton.jit
def _scatter_kernel(ids_ptr, base_ptr, counts_ptr, offsets_ptr, w_ptr, slots_ptr, rows_ptr, order_ptr, token_ptr,
                    weight_ptr, padded_ptr, padded_token_ptr, T, A, stride_t, stride_k, E, C,
                    SINGLE: tl.constexpr, HAS_W: tl.constexpr, PADDED: tl.constexpr,
                    BLOCK_A: tl.constexpr, BLOCK_E: tl.constexpr):
    a, amask, t, k, onehot, cols = _load_block(ids_ptr, T, A, stride_t, stride_k, E, BLOCK_A, BLOCK_E)
    cmask = cols < E
    rank = tl.sum((tl.cumsum(onehot, axis=0) - onehot) * onehot, axis=1)  # earlier same-expert ones in the block
    if SINGLE:  # every assignment is in this block: the histogram is the load
        counts = tl.sum(onehot, axis=0)
        base = tl.zeros([BLOCK_E], tl.int32)
        tl.store(counts_ptr + cols, counts, mask=cmask)
    else:
        counts = tl.load(counts_ptr + cols, mask=cmask, other=0)
        base = tl.load(base_ptr + tl.program_id(0).to(tl.int64) * E + cols, mask=cmask, other=0)
    offsets = tl.cumsum(counts, axis=0) - counts
    if tl.program_id(0) == 0:
        tl.store(offsets_ptr + cols, offsets, mask=cmask)
        tl.store(offsets_ptr + E, tl.sum(counts, axis=0))
    slot = tl.sum(onehot * base[None, :], axis=1) + rank
    row = tl.sum(onehot * offsets[None, :], axis=1) + slot
    tk = t.to(tl.int64) * stride_t + k * stride_k        # [T, K] outputs share the ids' strides
    tl.store(slots_ptr + tk, slot, mask=amask)
    tl.store(rows_ptr + tk, row, mask=amask)
    tl.store(order_ptr + row, a, mask=amask)
    tl.store(token_ptr + row, t, mask=amask)
    if HAS_W:
        tl.store(weight_ptr + row, tl.load(w_ptr + t.to(tl.int64) * stride_t + k * stride_k, mask=amask), mask=amask)
    if PADDED:
        e = tl.sum(onehot * cols[None, :], axis=1)
        keep = amask & (slot < C)
        dest = e.to(tl.int64) * C + slot
        tl.store(padded_ptr + tk, tl.where(keep, dest, -1), mask=amask)
        tl.store(padded_token_ptr + dest, t, mask=keep)


def sort_by_expert(ids_TK: Tensor, num_experts: int, weights_TK: Tensor | None = None,
                   capacity: int | None = None) -> ExpertSort:
    """Sort the assignments of ``ids_TK`` [T, K] by expert (see the module docstring); no host sync.

    ``weights_TK`` (fp32, [T, K]) are permuted into ``weight_N``; ``capacity`` C >= 0 also builds
    the padded layout's indices. Equal to dynamoe.ops.slots.expert_slots without priorities.
    """
    if ids_TK.dim() != 2:
        raise ValueError(f"ids_TK must be [tokens, k], got shape {tuple(ids_TK.shape)}")
    if weights_TK is not None and tuple(weights_TK.shape) != tuple(ids_TK.shape):
        raise ValueError(f"weights_TK must have the ids' shape {tuple(ids_TK.shape)}, got {tuple(weights_TK.shape)}")
    ids_TK = ids_TK.contiguous()
    T, K = ids_TK.shape
    A, E, dev = T * K, int(num_experts), ids_TK.device
    BLOCK_E = max(next_pow2(E), 16)
    BLOCK_A = max(16, min(128, 8192 // BLOCK_E, next_pow2(A)))
    NB = triton.cdiv(A, BLOCK_A)
    i64 = dict(dtype=torch.int64, device=dev)
    counts_E = torch.empty(E, dtype=torch.int32, device=dev)
    offsets_E1 = torch.empty(E + 1, dtype=torch.int32, device=dev)
    slots_TK, rows_TK = torch.empty(T, K, **i64), torch.empty(T, K, **i64)
    order_N, token_N = torch.empty(A, **i64), torch.empty(A, **i64)
    weight_N = torch.empty(A, dtype=torch.float32, device=dev) if weights_TK is not None else None
    w_TK = weights_TK.float().contiguous() if weights_TK is not None else None
    padded = capacity is not None
    C = int(capacity) if padded else 0
    padded_TK = torch.empty(T, K, **i64) if padded else None
    padded_token = torch.full((E * C,), -1, **i64) if padded else None
    if A == 0:
        counts_E.zero_()
        offsets_E1.zero_()
    else:
        single = NB == 1
        base = counts_E if single else torch.empty(NB, E, dtype=torch.int32, device=dev)
        if not single:
            _hist_kernel[(NB,)](ids_TK, base, T, A, K, 1, E, BLOCK_A=BLOCK_A, BLOCK_E=BLOCK_E, num_warps=4)
            BLOCK_EC = 16
            _scan_kernel[(triton.cdiv(E, BLOCK_EC),)](base, counts_E, NB, E, BLOCK_B=min(256, next_pow2(NB)),
                                                    BLOCK_EC=BLOCK_EC, num_warps=4)
        dummy = order_N
        _scatter_kernel[(NB,)](
            ids_TK, base, counts_E, offsets_E1, w_TK if w_TK is not None else dummy, slots_TK, rows_TK, order_N, token_N,
            weight_N if weight_N is not None else dummy, padded_TK if padded else dummy,
            padded_token if padded and padded_token.numel() else dummy, T, A, K, 1, E, C,
            SINGLE=single, HAS_W=weights_TK is not None, PADDED=padded, BLOCK_A=BLOCK_A, BLOCK_E=BLOCK_E, num_warps=4)
    return ExpertSort(counts_E, offsets_E1, slots_TK, rows_TK, order_N, token_N, weight_N, padded_TK,
                      padded_token.view(E, C) if padded else None, C)


@triton.jit
def _gather_rows_kernel(x_ptr, idx_ptr, scale_ptr, out_ptr, N, D, stride_x, stride_o,
                        HAS_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    rmask = rows < N
    src = tl.load(idx_ptr + rows, mask=rmask, other=-1)
    valid = src >= 0
    m = (rmask & valid)[:, None] & (cols < D)[None, :]
    v = tl.load(x_ptr + src.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=m, other=0.0)
    if HAS_SCALE:
        v = (v.to(tl.float32) * tl.load(scale_ptr + rows, mask=rmask & valid, other=0.0)[:, None]).to(v.dtype)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_o + cols[None, :], v, mask=rmask[:, None] & (cols < D)[None, :])


def gather_rows(x_TD: Tensor, index_N: Tensor, scale_N: Tensor | None = None) -> Tensor:
    """out[i] = x[index[i]] (* scale[i]); rows whose index is -1 are zeros (empty padded slots).
    [N, D] in x's dtype."""
    x_TD = x_TD if x_TD.stride(1) == 1 else x_TD.contiguous()
    index_N = index_N.reshape(-1)
    N, D = index_N.numel(), x_TD.size(1)
    out = torch.empty(N, D, dtype=x_TD.dtype, device=x_TD.device)
    if N and D:
        BLOCK_D = min(1024, max(next_pow2(D), 16))
        BLOCK_N = max(1, min(16, 4096 // BLOCK_D))
        _gather_rows_kernel[(triton.cdiv(N, BLOCK_N), triton.cdiv(D, BLOCK_D))](
            x_TD, index_N, scale_N if scale_N is not None else x_TD, out, N, D, x_TD.stride(0), out.stride(0),
            HAS_SCALE=scale_N is not None, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, num_warps=4)
    return out


@triton.jit
def _combine_kernel(y_ptr, rows_ptr, w_ptr, out_ptr, T, O, stride_y, stride_o,
                    K: tl.constexpr, HAS_W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_O: tl.constexpr):
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    tmask = toks < T
    cmask = cols < O
    acc = tl.zeros([BLOCK_T, BLOCK_O], tl.float32)
    for k in tl.static_range(K):
        r = tl.load(rows_ptr + toks.to(tl.int64) * K + k, mask=tmask, other=-1)
        ok = tmask & (r >= 0)  # -1: dropped
        v = tl.load(y_ptr + r[:, None] * stride_y + cols[None, :], mask=ok[:, None] & cmask[None, :], other=0.0)
        v = v.to(tl.float32)
        if HAS_W:
            v = v * tl.load(w_ptr + toks.to(tl.int64) * K + k, mask=ok, other=0.0)[:, None]
        acc += v
    tl.store(out_ptr + toks.to(tl.int64)[:, None] * stride_o + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=tmask[:, None] & cmask[None, :])


def combine(y_NO: Tensor, rows_TK: Tensor, weights_TK: Tensor | None = None) -> Tensor:
    """y_TO[t] = sum_k weights[t, k] * y_NO[rows[t, k]] (rows -1 skipped; no weights: plain sum),
    summed in fp32, [T, O] in y's dtype. ``rows_TK`` are ExpertSort.rows_TK (ragged) or padded_TK
    (with y the [E*C, O] padded output)."""
    y_NO = y_NO if y_NO.stride(1) == 1 else y_NO.contiguous()
    rows_TK = rows_TK.contiguous()
    T, K = rows_TK.shape
    O = y_NO.size(1)
    out = torch.empty(T, O, dtype=y_NO.dtype, device=y_NO.device)
    if T and O:
        BLOCK_O = min(1024, max(next_pow2(O), 16))
        BLOCK_T = max(1, min(16, 4096 // BLOCK_O, next_pow2(T)))
        w = weights_TK.float().contiguous() if weights_TK is not None else y_NO
        _combine_kernel[(triton.cdiv(T, BLOCK_T), triton.cdiv(O, BLOCK_O))](
            y_NO, rows_TK, w, out, T, O, y_NO.stride(0), out.stride(0), K=K, HAS_W=weights_TK is not None,
            BLOCK_T=BLOCK_T, BLOCK_O=BLOCK_O, num_warps=4)
    return out
