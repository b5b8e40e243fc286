"""Routing: expert scores -> top-k expert ids and combine weights.

Legend: T tokens, E experts, K experts chosen per token, G expert groups.

Every function here is a pure tensor function. Scores are computed in at least float32 whatever
the logits' dtype (routing decisions must not depend on bf16 rounding), ids are int64.
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "check_top_k",
    "softmax_topk",
    "softmax_topk_reference",
    "sigmoid_group_topk",
    "qwen3_moe_scaled_topk",
    "deepseek_moe_sigmoid_scaled_topk",
]


def check_top_k(top_k: int, num_experts: int) -> int:
    """Validate a top-k value against the expert count; returns it as an int."""
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise ValueError(f"top_k must be an int in [1, {num_experts}], got {top_k!r}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
    return top_k


def _upcast(t: Tensor) -> Tensor:
    """fp16/bf16 -> fp32+; fp32+ and fp64 stay (fp64 keeps gradcheck exact)."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def _check_logits(logits_TE: Tensor, name: str = "logits") -> None:
    if logits_TE.dim() != 2:
        raise ValueError(f"{name} must be 2-D [tokens, experts], got shape {tuple(logits_TE.shape)}")
    if not logits_TE.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {logits_TE.dtype}")


def softmax_topk_reference(logits_TE: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Plain reference: full softmax, pick top-k, optionally renormalise the chosen weights.

    Returns (weights_TK fp32+, ids_TK int64, probs_TE fp32+).
    """
    _check_logits(logits_TE)
    check_top_k(top_k, logits_TE.size(1))
    probs_TE = torch.softmax(_upcast(logits_TE), dim=-1)
    weights_TK, ids_TK = torch.topk(probs_TE, top_k, dim=-1)
    if renormalize:
        weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).eps)
    return weights_TK, ids_TK, probs_TE


def softmax_topk(
    logits_TE: Tensor, top_k: int, renormalize: bool, need_probs: bool = True
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Softmax-then-top-k (GShard, Switch, Mixtral, Qwen3-MoE).

    Top-k is taken on the logits (softmax is monotonic, so the choice is the same). With
    ``renormalize`` the weights are a softmax over the K chosen logits, which equals the
    renormalised full softmax without computing it; ``need_probs=False`` then skips the [T, E]
    softmax entirely (used at inference when no loss is wanted).

    Returns (weights_TK fp32+, ids_TK int64, probs_TE fp32+ or None).
    """
    _check_logits(logits_TE)
    check_top_k(top_k, logits_TE.size(1))
    logits_TE = _upcast(logits_TE)
    top_logits_TK, ids_TK = torch.topk(logits_TE, top_k, dim=-1)
    probs_TE = torch.softmax(logits_TE, dim=-1) if (need_probs or not renormalize) else None
    if renormalize:
        weights_TK = torch.softmax(top_logits_TK, dim=-1)
    else:
        weights_TK = probs_TE.gather(1, ids_TK)
    return weights_TK, ids_TK, probs_TE


def sigmoid_group_topk(
    logits_TE: Tensor,
    top_k: int,
    correction_bias_E: Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    renormalize: bool = True,
    route_scale: float = 1.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """DeepSeek-V3 / Kimi-K2 / GLM-4.5 routing.

    scores = sigmoid(logits); the correction bias is added only to *choose* experts; with groups,
    each group is ranked by the sum of its top-2 biased scores (its max when there is no bias),
    only the best ``topk_group`` groups stay eligible; the K chosen experts are weighted by their
    unbiased scores, optionally renormalised to sum to 1, then multiplied by ``route_scale``.

    Returns (weights_TK fp32+, ids_TK int64, scores_TE fp32+).
    """
    _check_logits(logits_TE)
    T, E = logits_TE.shape
    check_top_k(top_k, E)
    if n_group < 1 or E % n_group:
        raise ValueError(f"n_group must be >= 1 and divide num_experts={E}, got {n_group}")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group must be in [1, n_group={n_group}], got {topk_group}")
    if topk_group * (E // n_group) < top_k:
        raise ValueError(
            f"top_k={top_k} exceeds the experts in the {topk_group} selected groups "
            f"({topk_group} x {E // n_group}); raise topk_group or lower top_k"
        )
    scores_TE = torch.sigmoid(_upcast(logits_TE))
    choice_TE = scores_TE if correction_bias_E is None else scores_TE + correction_bias_E.to(scores_TE.dtype)
    if n_group > 1 and topk_group < n_group:
        choice_TGe = choice_TE.view(T, n_group, E // n_group)
        if correction_bias_E is None or E // n_group < 2:
            group_scores_TG = choice_TGe.amax(dim=-1)
        else:
            group_scores_TG = choice_TGe.topk(2, dim=-1).values.sum(dim=-1)
        group_ids = group_scores_TG.topk(topk_group, dim=-1).indices
        keep_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool).scatter_(1, group_ids, True)
        choice_TE = choice_TGe.masked_fill(~keep_TG.unsqueeze(-1), float("-inf")).view(T, E)
    ids_TK = choice_TE.topk(top_k, dim=-1).indices
    weights_TK = scores_TE.gather(1, ids_TK)
    if renormalize:
        weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
    if route_scale != 1.0:
        weights_TK = weights_TK * route_scale
    return weights_TK, ids_TK, scores_TE


def qwen3_moe_scaled_topk(logits_TE: Tensor, top_k: int = 8, renormalize: bool = True) -> tuple[Tensor, Tensor]:
    """Qwen3-MoE routing (Tutel's name): softmax top-k (8 of 128), weights renormalised to 1.

    Returns (weights_TK fp32+, ids_TK int64).
    """
    weights_TK, ids_TK, _ = softmax_topk(logits_TE, top_k, renormalize, need_probs=False)
    return weights_TK, ids_TK


def deepseek_moe_sigmoid_scaled_topk(
    logits_TE: Tensor,
    correction_bias_E: Tensor | None,
    top_k: int = 8,
    n_group: int = 8,
    topk_group: int = 4,
    route_scale: float = 2.5,
    renormalize: bool = True,
) -> tuple[Tensor, Tensor]:
    """DeepSeek-V3 routing (Tutel's name): sigmoid, bias for choice, group-limited top-k, scaled.

    Defaults are DeepSeek-V3's (256 experts, 8 groups, 4 kept, k=8, scale 2.5).
    Returns (weights_TK fp32+, ids_TK int64).
    """
    weights_TK, ids_TK, _ = sigmoid_group_topk(
        logits_TE, top_k, correction_bias_E, n_group, topk_group, renormalize, route_scale
    )
    return weights_TK, ids_TK
