"""Routed FFN experts (fc1 -> ReLU -> fc2, Tutel's layout) on CPU in bf16 with the grouped GEMM kernels.

Legend: T tokens, N routed rows (sorted by expert), E experts, D model dim, F hidden dim, O output dim.

``routed_ffn(x_TD, token_N, weight_N, counts, w1_EFD, b1_EF, w2_EFO, b2_EO)`` returns
``y[t] = sum over t's rows n of weight_N[n] * (relu(x[t] @ w1[e].T + b1[e]) @ w2[e] + b2[e])`` --
what dispatch_ragged -> FFNExperts.forward_ragged -> combine_ragged compute, in two kernel calls for
all experts (csrc/grouped_gemm_bf16.cpp: AMX-BF16 tiles where the CPU has them, else AVX512-BF16 dot
products) instead of per-expert oneDNN matmuls and separate bf16
gather, ReLU, row scale and scatter-add passes; the backward likewise (four GEMM calls, the ReLU
gradient and dL/dweight fused into the first). The rounding points are the torch path's; weight
gradients are summed in fp32 over all of an expert's rows and rounded once.

Weights are repacked into the kernels' panel layout once per version (``Tensor._version``: an
optimizer step repacks them) and kept beside the parameter: two packed copies per weight when
training (forward and backward products), one at inference.

``routed_ffn_kernels(...)`` says whether the kernels apply (CPU, bf16, ReLU, one group per expert,
enough rows per expert to be GEMMs: decode sizes keep the per-expert path, which skips idle experts);
otherwise callers use the torch path. ``routed_ffn_reference`` is the plain per-expert loop in fp32.
"""
from __future__ import annotations

import weakref
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from . import cpu_kernels
from .scratch import scratch

__all__ = ["routed_ffn", "routed_ffn_reference", "routed_ffn_kernels", "MIN_ROWS_PER_EXPERT"]

#: run the kernels on AMX-BF16 tiles where the CPU has them (``has_grouped_gemm_amx()``); False keeps
#: the AVX512-BF16 dot-product path (tests compare the two; benchmarks time them side by side)
USE_AMX = True

#: below this many rows per expert that got any, the per-expert path (bf16 GEMV for a few rows, idle
#: experts skipped in the backward) stays: packing rows for a GEMM would cost more than it saves
MIN_ROWS_PER_EXPERT = 16


def _kernels():
    k = cpu_kernels.load()
    return k if k is not None and getattr(k, "has_grouped_gemm_bf16", None) is not None and k.has_grouped_gemm_bf16() else None


def routed_ffn_kernels(x_TD: Tensor, w1_EFD: Tensor, w2_EFO: Tensor, biases: Sequence[Tensor | None], activation_fn,
                       counts: Sequence[int]):
    """The kernel module when routed_ffn can run these operands, else None."""
    if x_TD.device.type != "cpu" or x_TD.dtype != torch.bfloat16 or activation_fn is not F.relu:
        return None
    if any(t is not None and (t.dtype != torch.bfloat16 or t.device.type != "cpu") for t in (w1_EFD, w2_EFO, *biases)):
        return None
    E, F_, D = w1_EFD.shape
    b1, b2 = biases
    if len(counts) != E or x_TD.dim() != 2 or x_TD.size(1) != D or tuple(w2_EFO.shape[:2]) != (E, F_):
        return None
    if (b1 is not None and tuple(b1.shape) != (E, F_)) or (b2 is not None and tuple(b2.shape) != (E, w2_EFO.size(2))):
        return None
    active = sum(1 for c in counts if c)
    if not active or sum(counts) < MIN_ROWS_PER_EXPERT * active:
        return None
    return _kernels()


# id(parameter) -> (weak reference to it, {k_along_rows: ((version, data_ptr), packed)}); an entry
# leaves with its parameter (a WeakKeyDictionary would compare tensors with ==)
_PACKED: dict[int, tuple] = {}


def _packed(k, w: Tensor, k_along_rows: bool) -> Tensor:
    """w [E, R, C] in the kernels' panel layout (B = w[e] if k_along_rows else w[e]^T), cached per version."""
    slot = _PACKED.get(id(w))
    if slot is None or slot[0]() is not w:
        try:
            ref = weakref.ref(w, lambda _, key=id(w): _PACKED.pop(key, None))
        except TypeError:  # not weak-referenceable: pack every call
            return k.pack_weight(w=w.detach(), k_along_rows=k_along_rows)
        slot = _PACKED[id(w)] = (ref, {})
    stamp = (w._version, w.data_ptr())
    hit = slot[1].get(k_along_rows)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    p = k.pack_weight(w=w.detach(), k_along_rows=k_along_rows)
    slot[1][k_along_rows] = (stamp, p)
    return p


def _rows_gemm(k, **fields) -> None:
    args = k.RowsGemm()
    args.amx = USE_AMX
    for name, value in fields.items():
        setattr(args, name, value)
    k.grouped_rows_gemm(args=args)


def _pack_rows(k, purpose: str, src: Tensor, counts: list[int], index: Tensor | None = None,
               scale: Tensor | None = None, col_sums: Tensor | None = None) -> Tensor:
    """Each expert's rows of src (gathered by index, times scale) packed with k along the rows, into
    backward scratch (never handed out: the weight-gradient GEMM reads it and is done)."""
    numel = k.packed_rows_numel(counts=counts, cols=src.size(1))
    out = scratch(purpose, 1, max(numel, 1), torch.bfloat16, src.device).view(-1)
    args = k.PackRows()
    args.src, args.counts, args.out = src, counts, out
    args.index, args.scale, args.col_sums = index, scale, col_sums
    k.pack_rows(args=args)
    return out


def _weight_grad(k, a: Tensor, b: Tensor, m: int, n: int, counts: list[int]) -> Tensor:
    out = torch.empty(len(counts), m, n, dtype=torch.bfloat16)
    args = k.WeightGrad()
    args.a, args.b, args.m, args.n, args.counts, args.out = a, b, m, n, counts, out
    args.amx = USE_AMX
    k.weight_grad(args=args)
    return out


class _RoutedFFN(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, weight_N, w1_EFD, b1_EF, w2_EFO, b2_EO, token_N, counts, k):
        N, F_, O = token_N.numel(), w1_EFD.size(1), w2_EFO.size(2)
        grad = any(ctx.needs_input_grad[:6])  # (grad mode itself is off inside forward)
        s_N = weight_N.detach().float().contiguous()
        # the hidden rows: saved for the backward when training, reusable scratch at inference
        h_NF = torch.empty(N, F_, dtype=torch.bfloat16) if grad else scratch("moe_hidden", N, F_, torch.bfloat16, x_TD.device)
        _rows_gemm(k, a=x_TD, a_index=token_N, b=_packed(k, w1_EFD, False), cols=F_, counts=counts,
                   bias=b1_EF, activation=int(k.GemmActivation.RELU), epilogue=int(k.GemmEpilogue.STORE), out=h_NF)
        y_TO = torch.zeros(x_TD.size(0), O, dtype=torch.bfloat16)
        _rows_gemm(k, a=h_NF, b=_packed(k, w2_EFO, True), cols=O, counts=counts, bias=b2_EO, row_scale=s_N,
                   epilogue=int(k.GemmEpilogue.SCATTER_ADD), out=y_TO, out_index=token_N)
        ctx.save_for_backward(x_TD, weight_N, w1_EFD, b1_EF, w2_EFO, b2_EO, token_N, h_NF)
        ctx.counts, ctx.k = counts, k
        return y_TO

    @staticmethod
    @once_differentiable
    def backward(ctx, g_TO):
        x_TD, weight_N, w1_EFD, b1_EF, w2_EFO, b2_EO, token_N, h_NF = ctx.saved_tensors
        counts, k = ctx.counts, ctx.k
        need_x, need_s, need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad[:6]
        g_TO = g_TO.to(torch.bfloat16).contiguous()
        N, F_, D, O = token_N.numel(), w1_EFD.size(1), x_TD.size(1), w2_EFO.size(2)
        s_N = weight_N.detach().float().contiguous()
        gx = gs = gw1 = gb1 = gw2 = gb2 = None
        if need_w2 or need_b2:  # dL/dw2_e = h_e^T (s * g[token])_e, dL/db2_e = column sums of the latter
            gb2_f = torch.empty(len(counts), O) if need_b2 else None
            b = _pack_rows(k, "ffn_bwd_b", g_TO, counts, index=token_N, scale=s_N, col_sums=gb2_f)
            if need_w2:
                gw2 = _weight_grad(k, _pack_rows(k, "ffn_bwd_a", h_NF, counts), b, F_, O, counts)
            gb2 = gb2_f.to(torch.bfloat16) if need_b2 else None
        if not (need_x or need_s or need_w1 or need_b1):
            return None, None, None, None, gw2, gb2, None, None, None
        # ga = relu'(h) * s * (g[token] @ w2^T), and dL/ds = <g[token] @ w2^T, h> (+ <g[token], b2>), one call
        ga_NF = scratch("ffn_bwd_ga", N, F_, torch.bfloat16, x_TD.device)
        ds_N = torch.empty(N)
        _rows_gemm(k, a=g_TO, a_index=token_N, b=_packed(k, w2_EFO, False), cols=F_, counts=counts, row_scale=s_N,
                   epilogue=int(k.GemmEpilogue.RELU_GRAD), out=ga_NF, relu_out=h_NF, row_dot=ds_N)
        if need_s:
            if b2_EO is not None:
                expert_N = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts), output_size=N)
                ds_N += (g_TO.index_select(0, token_N) * b2_EO.index_select(0, expert_N)).sum(1, dtype=torch.float32)
            gs = ds_N.to(weight_N.dtype)
        if need_w1 or need_b1:  # dL/dw1_e = ga_e^T x[token]_e, dL/db1_e = column sums of ga_e
            gb1_f = torch.empty(len(counts), F_) if need_b1 else None
            a = _pack_rows(k, "ffn_bwd_a", ga_NF, counts, col_sums=gb1_f)
            if need_w1:
                gw1 = _weight_grad(k, a, _pack_rows(k, "ffn_bwd_b", x_TD, counts, index=token_N), F_, D, counts)
            gb1 = gb1_f.to(torch.bfloat16) if need_b1 else None
        if need_x:  # dL/dx[t] = sum over t's rows of ga_n @ w1_e
            gx = torch.zeros(x_TD.size(0), D, dtype=torch.bfloat16)
            _rows_gemm(k, a=ga_NF, b=_packed(k, w1_EFD, True), cols=D, counts=counts,
                       epilogue=int(k.GemmEpilogue.SCATTER_ADD), out=gx, out_index=token_N)
        return gx, gs, gw1, gb1, gw2, gb2, None, None, None


def routed_ffn(x_TD: Tensor, token_N: Tensor, weight_N: Tensor, counts: Sequence[int], w1_EFD: Tensor,
               b1_EF: Tensor | None, w2_EFO: Tensor, b2_EO: Tensor | None, kernels) -> Tensor:
    """[T, O]: every token's weighted sum of its experts' FFN outputs (module docstring), differentiable
    in x, the weights, the biases and weight_N. ``kernels`` from routed_ffn_kernels (not None);
    ``token_N`` int64 [N], rows sorted by expert with ``counts[e]`` rows for expert e."""
    counts = [int(c) for c in counts]
    if token_N.dtype != torch.long or tuple(token_N.shape) != (sum(counts),):
        raise ValueError(f"token_N must be int64 [sum(counts)={sum(counts)}], got {token_N.dtype} {tuple(token_N.shape)}")
    if tuple(weight_N.shape) != tuple(token_N.shape):
        raise ValueError(f"weight_N must have token_N's shape {tuple(token_N.shape)}, got {tuple(weight_N.shape)}")
    E, F_, D = w1_EFD.shape
    if x_TD.size(1) != D or tuple(w2_EFO.shape[:2]) != (E, F_):
        raise ValueError(f"x [T, {x_TD.size(1)}], w1 {tuple(w1_EFD.shape)} and w2 {tuple(w2_EFO.shape)} do not chain")
    return _RoutedFFN.apply(x_TD.contiguous(), weight_N, w1_EFD, b1_EF, w2_EFO, b2_EO, token_N.contiguous(), counts,
                            kernels)


def routed_ffn_reference(x_TD: Tensor, token_N: Tensor, weight_N: Tensor, counts: Sequence[int], w1_EFD: Tensor,
                         b1_EF: Tensor | None, w2_EFO: Tensor, b2_EO: Tensor | None) -> Tensor:
    """Plain reference in fp32: a loop over experts, each token's rows added one by one."""
    y = torch.zeros(x_TD.size(0), w2_EFO.size(2), dtype=torch.float32)
    rows = 0
    for e, c in enumerate(counts):
        for n in range(rows, rows + c):
            t = int(token_N[n])
            h = x_TD[t].float() @ w1_EFD[e].float().t()
            if b1_EF is not None:
                h = h + b1_EF[e].float()
            o = torch.relu(h) @ w2_EFO[e].float()
            if b2_EO is not None:
                o = o + b2_EO[e].float()
            y = y.index_add(0, torch.tensor([t]), (weight_N[n].float() * o).unsqueeze(0))
        rows += c
    return y
