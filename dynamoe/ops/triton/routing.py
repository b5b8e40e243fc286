"""Fused routing kernels: one launch from router logits to (weights, ids[, scores]).

Legend: T tokens, E experts, K experts chosen per token, G expert groups.

Layouts: logits [T, E] (any float dtype, unit stride along E), weights out [T, K] fp32, ids out
[T, K] int64, probs/scores out [T, E] fp32. One program handles BLOCK_T tokens with the whole expert
row in registers (E <= 1024); top-k is K rounds of (row max, lowest index holding it, mask it out),
so the K ids come out best first and ties go to the lowest expert index (torch.topk leaves tie
order unspecified). References: dynamoe.ops.routing (softmax_topk_reference, sigmoid_group_topk,
qwen3_moe_scaled_topk), which the tests compare against. Forward only (no autograd).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import ROUTING_MAX_EXPERTS as MAX_EXPERTS
from . import fix_interpreter, next_pow2

fix_interpreter()

__all__ = ["softmax_topk", "sigmoid_group_topk", "normalized_topk", "MAX_EXPERTS"]

# weight modes of _softmax_topk_kernel
_RENORM, _PROBS, _NORMALIZE = 0, 1, 2


@triton.jit
def _topk_round(cur, taken, cols, BLOCK_E: tl.constexpr):
    """One selection round over a [BT, BE] tile: the best untaken value per row and its lowest index."""
    cand = tl.where(taken != 0, float("-inf"), cur)
    best = tl.max(cand, axis=1)
    idx = tl.min(tl.where((cand == best[:, None]) & (taken == 0), cols[None, :], BLOCK_E), axis=1)
    return best, idx


@triton.jit
def _softmax_topk_kernel(x_ptr, w_ptr, ids_ptr, probs_ptr, T, E, stride_xt,
                         K: tl.constexpr, KP: tl.constexpr, MODE: tl.constexpr, WRITE_PROBS: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    kcols = tl.arange(0, KP)
    rmask = rows < T
    cmask = cols < E
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_xt + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
    x = tl.where(cmask[None, :], x.to(tl.float32), float("-inf"))          # [BT, BE]
    m = tl.max(x, axis=1)
    denom = tl.full([BLOCK_T], 1.0, tl.float32)
    if MODE != 2:
        p = tl.exp(x - m[:, None])
        denom = tl.sum(p, axis=1)
        if WRITE_PROBS:
            tl.store(probs_ptr + rows64[:, None] * E + cols[None, :], p / denom[:, None],
                     mask=rmask[:, None] & cmask[None, :])
    # the padding columns count as taken, so they are never chosen
    taken = tl.where(cmask[None, :], 0, 1) + tl.zeros([BLOCK_T, BLOCK_E], tl.int32)
    vals = tl.zeros([BLOCK_T, KP], tl.float32)
    ids = tl.zeros([BLOCK_T, KP], tl.int64)
    for k in tl.static_range(K):
        best, idx = _topk_round(x, taken, cols, BLOCK_E)
        if MODE == 0:
            v = tl.exp(best - m)            # renormalised below: a softmax over the K chosen logits
        elif MODE == 1:
            v = tl.exp(best - m) / denom    # the full softmax's probability
        else:
            v = best                        # the input values (probabilities), normalised below
        vals = tl.where(kcols[None, :] == k, v[:, None], vals)
        ids = tl.where(kcols[None, :] == k, idx.to(tl.int64)[:, None], ids)
        taken = tl.where(cols[None, :] == idx[:, None], 1, taken)
    if MODE == 0:
        vals = vals / tl.sum(vals, axis=1)[:, None]
    if MODE == 2:
        vals = vals / tl.maximum(tl.sum(vals, axis=1), 1.1754943508222875e-38)[:, None]
    omask = rmask[:, None] & (kcols[None, :] < K)
    tl.store(w_ptr + rows64[:, None] * K + kcols[None, :], vals, mask=omask)
    tl.store(ids_ptr + rows64[:, None] * K + kcols[None, :], ids, mask=omask)


@triton.jit
def _sigmoid_group_topk_kernel(x_ptr, bias_ptr, w_ptr, ids_ptr, scores_ptr, T, E, stride_xt, route_scale,
                               GROUP_SIZE, K: tl.constexpr, KP: tl.constexpr, HAS_BIAS: tl.constexpr,
                               N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, LIMIT_GROUPS: tl.constexpr,
                               TOP2: tl.constexpr, RENORM: tl.constexpr, WRITE_SCORES: tl.constexpr,
                               BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    kcols = tl.arange(0, KP)
    rmask = rows < T
    cmask = cols < E
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_xt + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
    s = tl.sigmoid(x.to(tl.float32))                                      # [BT, BE] routing scores
    if WRITE_SCORES:
        tl.store(scores_ptr + rows64[:, None] * E + cols[None, :], s, mask=rmask[:, None] & cmask[None, :])
    choice = s
    if HAS_BIAS:  # the selection bias only chooses; the weights stay the unbiased scores
        choice = s + tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    choice = tl.where(cmask[None, :], choice, float("-inf"))
    if LIMIT_GROUPS:
        gid = cols // GROUP_SIZE
        gcols = tl.arange(0, BLOCK_G)
        gscore = tl.full([BLOCK_T, BLOCK_G], float("-inf"), tl.float32)
        for g in tl.static_range(N_GROUP):
            c = tl.where((gid == g)[None, :], choice, float("-inf"))
            m1 = tl.max(c, axis=1)
            sc = m1
            if TOP2:  # sum of the group's two best (a repeated maximum counts twice, as in topk(2))
                i1 = tl.min(tl.where(c == m1[:, None], cols[None, :], BLOCK_E), axis=1)
                sc = m1 + tl.max(tl.where(cols[None, :] == i1[:, None], float("-inf"), c), axis=1)
            gscore = tl.where(gcols[None, :] == g, sc[:, None], gscore)
        gtaken = tl.where(gcols < N_GROUP, 0, 1)[None, :] + tl.zeros([BLOCK_T, BLOCK_G], tl.int32)
        for j in tl.static_range(TOPK_GROUP):
            _, gi = _topk_round(gscore, gtaken, gcols, BLOCK_G)
            gtaken = tl.where(gcols[None, :] == gi[:, None], 2, gtaken)      # 2 = kept group
        for g in tl.static_range(N_GROUP):
            dropped = tl.max(tl.where(gcols[None, :] == g, gtaken, 0), axis=1) != 2
            choice = tl.where((gid == g)[None, :] & dropped[:, None], float("-inf"), choice)
    taken = tl.where(cmask[None, :], 0, 1) + tl.zeros([BLOCK_T, BLOCK_E], tl.int32)
    vals = tl.zeros([BLOCK_T, KP], tl.float32)
    ids = tl.zeros([BLOCK_T, KP], tl.int64)
    for k in tl.static_range(K):
        _, idx = _topk_round(choice, taken, cols, BLOCK_E)
        hit = cols[None, :] == idx[:, None]
        v = tl.sum(tl.where(hit, s, 0.0), axis=1)
        vals = tl.where(kcols[None, :] == k, v[:, None], vals)
        ids = tl.where(kcols[None, :] == k, idx.to(tl.int64)[:, None], ids)
        taken = tl.where(hit, 1, taken)
    if RENORM:
        vals = vals / (tl.sum(vals, axis=1)[:, None] + 1e-20)
    vals = vals * route_scale
    omask = rmask[:, None] & (kcols[None, :] < K)
    tl.store(w_ptr + rows64[:, None] * K + kcols[None, :], vals, mask=omask)
    tl.store(ids_ptr + rows64[:, None] * K + kcols[None, :], ids, mask=omask)


def _prepare(x_TE: Tensor) -> tuple[Tensor, int, int, int, int]:
    if x_TE.dim() != 2 or x_TE.size(1) > MAX_EXPERTS:
        raise ValueError(f"the Triton routing kernels take [tokens, experts <= {MAX_EXPERTS}], got {tuple(x_TE.shape)}")
    if x_TE.stride(1) != 1:
        x_TE = x_TE.contiguous()
    T, E = x_TE.shape
    BLOCK_E = max(next_pow2(E), 16)
    BLOCK_T = max(1, min(64, 4096 // BLOCK_E, next_pow2(T)))
    return x_TE, T, E, BLOCK_E, BLOCK_T


def _launch_softmax(x_TE: Tensor, top_k: int, mode: int, need_probs: bool):
    x_TE, T, E, BLOCK_E, BLOCK_T = _prepare(x_TE)
    w_TK = torch.empty(T, top_k, dtype=torch.float32, device=x_TE.device)
    ids_TK = torch.empty(T, top_k, dtype=torch.int64, device=x_TE.device)
    probs_TE = torch.empty(T, E, dtype=torch.float32, device=x_TE.device) if need_probs else None
    if T:
        _softmax_topk_kernel[(triton.cdiv(T, BLOCK_T),)](
            x_TE, w_TK, ids_TK, probs_TE if need_probs else w_TK, T, E, x_TE.stride(0),
            K=top_k, KP=next_pow2(top_k), MODE=mode, WRITE_PROBS=need_probs, BLOCK_T=BLOCK_T, BLOCK_E=BLOCK_E,
            num_warps=4)
    return w_TK, ids_TK, probs_TE


def softmax_topk(logits_TE: Tensor, top_k: int, renormalize: bool, need_probs: bool = True
                 ) -> tuple[Tensor, Tensor, Tensor | None]:
    """Same contract as dynamoe.ops.routing.softmax_topk (arguments already validated there):
    returns (weights_TK fp32, ids_TK int64, probs_TE fp32 or None)."""
    need_probs = need_probs or not renormalize  # the reference returns probs whenever it computed them
    return _launch_softmax(logits_TE, top_k, _RENORM if renormalize else _PROBS, need_probs)


def normalized_topk(probs_TE: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """Tutel's qwen3_moe_scaled_topk on [T, E] probabilities: the top-k values divided by their sum."""
    w_TK, ids_TK, _ = _launch_softmax(probs_TE, top_k, _NORMALIZE, False)
    return w_TK, ids_TK


def sigmoid_group_topk(logits_TE: Tensor, top_k: int, correction_bias_E: Tensor | None = None, n_group: int = 1,
                       topk_group: int = 1, renormalize: bool = True, route_scale: float = 1.0,
                       need_scores: bool = True) -> tuple[Tensor, Tensor, Tensor | None]:
    """Same contract as dynamoe.ops.routing.sigmoid_group_topk (arguments already validated there):
    returns (weights_TK fp32, ids_TK int64, scores_TE fp32 or None when not ``need_scores``)."""
    x_TE, T, E, BLOCK_E, BLOCK_T = _prepare(logits_TE)
    w_TK = torch.empty(T, top_k, dtype=torch.float32, device=x_TE.device)
    ids_TK = torch.empty(T, top_k, dtype=torch.int64, device=x_TE.device)
    scores_TE = torch.empty(T, E, dtype=torch.float32, device=x_TE.device) if need_scores else None
    has_bias = correction_bias_E is not None
    bias = correction_bias_E.contiguous() if has_bias else w_TK
    group_size = E // n_group
    if T:
        _sigmoid_group_topk_kernel[(triton.cdiv(T, BLOCK_T),)](
            x_TE, bias, w_TK, ids_TK, scores_TE if need_scores else w_TK, T, E, x_TE.stride(0), float(route_scale),
            group_size, K=top_k, KP=next_pow2(top_k), HAS_BIAS=has_bias, N_GROUP=n_group, TOPK_GROUP=topk_group,
            LIMIT_GROUPS=n_group > 1 and topk_group < n_group, TOP2=has_bias and group_size >= 2,
            RENORM=bool(renormalize), WRITE_SCORES=need_scores, BLOCK_T=BLOCK_T, BLOCK_E=BLOCK_E,
            BLOCK_G=max(next_pow2(n_group), 2), num_warps=4)
    return w_TK, ids_TK, scores_TE
