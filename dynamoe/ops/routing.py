"""Routing: expert scores -> top-k expert ids and combine weights.

Legend: T tokens, E experts, K experts chosen per token, G expert groups.

Every function here is a pure tensor function. Scores are computed in at least float32 whatever
the logits' dtype (routing decisions must not depend on bf16 rounding), ids are int64.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .triton import FLOAT_DTYPES, ROUTING_MAX_EXPERTS, no_grad_needed, use_triton

__all__ = [
    "check_top_k",
    "softmax_topk",
    "softmax_topk_reference",
    "sigmoid_group_topk",
    "softmax_group_topk",
    "GROUP_RANKS",
    "sparsemixer_top2",
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


def _triton_path(*ts: Tensor | None) -> bool:
    """GPU fast path (dynamoe.ops.triton.routing): CUDA, Triton, no autograd, half/fp32, E <= 1024."""
    x = ts[0]
    return (use_triton(*ts) and x.dtype in FLOAT_DTYPES and x.size(-1) <= ROUTING_MAX_EXPERTS
            and no_grad_needed(*ts))


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
    if _triton_path(logits_TE):  # --- Triton fast path (GPU): one launch ---
        from .triton import routing as triton_routing
        return triton_routing.softmax_topk(logits_TE, top_k, renormalize, need_probs)
    logits_TE = _upcast(logits_TE)
    top_logits_TK, ids_TK = torch.topk(logits_TE, top_k, dim=-1)
    probs_TE = torch.softmax(logits_TE, dim=-1) if (need_probs or not renormalize) else None
    if renormalize:
        weights_TK = torch.softmax(top_logits_TK, dim=-1)
    else:
        weights_TK = probs_TE.gather(1, ids_TK)
    return weights_TK, ids_TK, probs_TE


def _check_groups(E: int, top_k: int, n_group: int, topk_group: int) -> None:
    if n_group < 1 or E % n_group:
        raise ValueError(f"n_group must be >= 1 and divide num_experts={E}, got {n_group}")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group must be in [1, n_group={n_group}], got {topk_group}")
    if topk_group * (E // n_group) < top_k:
        raise ValueError(
            f"top_k={top_k} exceeds the experts in the {topk_group} selected groups "
            f"({topk_group} x {E // n_group}); raise topk_group or lower top_k"
        )


GROUP_RANKS = ("max", "top2_sum")


def softmax_group_topk(logits_TE: Tensor, top_k: int, n_group: int = 1, topk_group: int = 1, renormalize: bool = False,
                       route_scale: float = 1.0, correction_bias_E: Tensor | None = None,
                       group_rank: str = "max") -> tuple[Tensor, Tensor, Tensor]:
    """Group-limited softmax routing: probs = softmax(logits); each of ``n_group`` equal groups of
    experts is ranked -- ``group_rank`` "max": by its best probability (DeepSeek-V2's
    'group_limited_greedy'), "top2_sum": by the sum of its two best (Mistral-4; a group of one expert
    by that one) --, only the best ``topk_group`` groups stay eligible, and the K most probable
    eligible experts are chosen, weighted by their probabilities (optionally renormalised to sum to
    1), times ``route_scale``. n_group == topk_group is plain softmax top-k.
    ``correction_bias_E`` (ERNIE-4.5) is added to the probabilities to *choose* the experts (and rank
    the groups); the weights stay the unbiased probabilities.

    Returns (weights_TK fp32+, ids_TK int64, probs_TE fp32+).
    """
    _check_logits(logits_TE)
    T, E = logits_TE.shape
    check_top_k(top_k, E)
    _check_groups(E, top_k, n_group, topk_group)
    if group_rank not in GROUP_RANKS:
        raise ValueError(f"group_rank must be one of {list(GROUP_RANKS)}, got {group_rank!r}")
    probs_TE = torch.softmax(_upcast(logits_TE), dim=-1)
    choice_TE = probs_TE if correction_bias_E is None else probs_TE + correction_bias_E.reshape(E).to(probs_TE.dtype)
    if topk_group < n_group:
        choice_TGe = choice_TE.view(T, n_group, E // n_group)
        if group_rank == "max":
            group_scores_TG = choice_TGe.amax(dim=-1)
        else:
            group_scores_TG = choice_TGe.topk(min(2, E // n_group), dim=-1).values.sum(dim=-1)
        group_ids = group_scores_TG.topk(topk_group, dim=-1).indices
        keep_TG = torch.zeros(T, n_group, dtype=torch.bool, device=probs_TE.device).scatter_(1, group_ids, True)
        choice_TE = choice_TGe.masked_fill(~keep_TG.unsqueeze(-1), float("-inf")).view(T, E)
    ids_TK = choice_TE.topk(top_k, dim=-1).indices
    weights_TK = probs_TE.gather(1, ids_TK)
    if renormalize:
        weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).eps)
    if route_scale != 1.0:
        weights_TK = weights_TK * route_scale
    return weights_TK, ids_TK, probs_TE


def sigmoid_group_topk(
    logits_TE: Tensor,
    top_k: int,
    correction_bias_E: Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    renormalize: bool = True,
    route_scale: float = 1.0,
    bias_on_logits: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """DeepSeek-V3 / Kimi-K2 / GLM-4.5 routing.

    scores = sigmoid(logits); the correction bias is added only to *choose* experts; with groups,
    each group is ranked by the sum of its top-2 biased scores (its max when there is no bias),
    only the best ``topk_group`` groups stay eligible; the K chosen experts are weighted by their
    unbiased scores, optionally renormalised to sum to 1, then multiplied by ``route_scale``.
    ``bias_on_logits``: the bias is added to the logits instead of the scores to choose (Kolibri-1: top-k of
    logits + bias, weighted by the sigmoids of the chosen logits).

    Returns (weights_TK fp32+, ids_TK int64, scores_TE fp32+).
    """
    _check_logits(logits_TE)
    T, E = logits_TE.shape
    check_top_k(top_k, E)
    _check_groups(E, top_k, n_group, topk_group)
    if not bias_on_logits and _triton_path(logits_TE, correction_bias_E):  # --- Triton fast path (GPU): one launch ---
        from .triton import routing as triton_routing
        return triton_routing.sigmoid_group_topk(logits_TE, top_k, correction_bias_E, n_group, topk_group,
                                                 renormalize, route_scale)
    scores_TE = torch.sigmoid(_upcast(logits_TE))
    base_TE = _upcast(logits_TE) if bias_on_logits else scores_TE
    choice_TE = base_TE if correction_bias_E is None else base_TE + correction_bias_E.to(base_TE.dtype)
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


def _sparsemixer_pick(logits_TE: Tensor, candidates_TE: Tensor, jitter_eps: float) -> tuple[Tensor, Tensor]:
    """(id [T, 1], weight [T, 1]) of SparseMixer's inference step over ``candidates`` (the logits, with the experts
    chosen before at -inf): the best candidate, weighted by its softmax over only the candidates within a
    relative margin of it, (best - logit) / max(|logit|, best) <= 2 * jitter_eps."""
    best_T1, id_T1 = candidates_TE.max(dim=-1, keepdim=True)
    factor_TE = logits_TE.abs().clamp(min=best_T1)
    far_TE = ((best_T1 - logits_TE) / factor_TE) > (2 * jitter_eps)
    probs_TE = torch.softmax(candidates_TE.masked_fill(far_TE, float("-inf")), dim=-1)
    return id_T1, probs_TE.gather(1, id_T1)


def sparsemixer_top2(logits_TE: Tensor, jitter_eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """Phi-3.5-MoE's SparseMixer router at inference (transformers' ``sparsemixer`` with training off): the best
    expert, weighted by its softmax over the experts within a relative margin ``2 * jitter_eps`` of it; then the
    best of the others, weighted by its softmax over the others within that margin of it. Exactly two experts,
    weights not renormalised. (Training samples the experts and needs its own gradient estimator: not here.)

    Returns (weights_TK fp32+, ids_TK int64, scores_TE = softmax of the logits, fp32+), K = 2.
    """
    _check_logits(logits_TE)
    T, E = logits_TE.shape
    if E < 2:
        raise ValueError(f"sparsemixer_top2 needs at least 2 experts, got {E}")
    if isinstance(jitter_eps, bool) or not isinstance(jitter_eps, (int, float)) or jitter_eps < 0:
        raise ValueError(f"jitter_eps must be a number >= 0, got {jitter_eps!r}")
    logits = _upcast(logits_TE)
    id1_T1, w1_T1 = _sparsemixer_pick(logits, logits, jitter_eps)
    id2_T1, w2_T1 = _sparsemixer_pick(logits, logits.scatter(1, id1_T1, float("-inf")), jitter_eps)
    return torch.cat([w1_T1, w2_T1], dim=1), torch.cat([id1_T1, id2_T1], dim=1), torch.softmax(logits, dim=-1)


def _write_out(result: Tensor, out: Tensor | None, name: str) -> Tensor:
    if out is None:
        return result
    if tuple(out.shape) != tuple(result.shape):
        raise ValueError(f"{name} must have shape {tuple(result.shape)}, got {tuple(out.shape)}")
    return out.copy_(result)


def qwen3_moe_scaled_topk(
    probs: Tensor,
    top_v_out: Tensor | None = None,
    top_k_out: Tensor | None = None,
    *,
    top_k: int = 8,
) -> tuple[Tensor, Tensor]:
    """Qwen3-MoE gating with Tutel's name and signature: ``probs`` are the router's *softmax
    probabilities* [..., E] (as Tutel's op takes them); returns the top-k of them divided by their
    sum (weights fp32+, summing to 1) and their ids (int64), optionally written into
    ``top_v_out`` / ``top_k_out``.
    """
    if probs.dim() < 1 or not probs.is_floating_point():
        raise ValueError(f"probs must be a floating-point tensor [..., experts], got {probs.dtype} {tuple(probs.shape)}")
    flat = probs.reshape(-1, probs.size(-1))
    check_top_k(top_k, flat.size(1))
    if _triton_path(flat):  # --- Triton fast path (GPU): one launch ---
        from .triton import routing as triton_routing
        vals_TK, ids_TK = triton_routing.normalized_topk(flat, top_k)
    else:
        vals_TK, ids_TK = torch.topk(_upcast(flat), top_k, dim=-1)
        vals_TK = vals_TK / vals_TK.sum(-1, keepdim=True).clamp_min(torch.finfo(vals_TK.dtype).tiny)
    shape = tuple(probs.shape[:-1]) + (top_k,)
    return (_write_out(vals_TK.view(shape), top_v_out, "top_v_out"),
            _write_out(ids_TK.view(shape), top_k_out, "top_k_out"))


def deepseek_moe_sigmoid_scaled_topk(
    logits: Tensor,
    correction_bias: Tensor | None,
    top_v_out: Tensor | None = None,
    top_k_out: Tensor | None = None,
    *,
    top_k: int = 8,
    n_group: int = 8,
    topk_group: int = 4,
    route_scale: float = 2.5,
    renormalize: bool = True,
) -> tuple[Tensor, Tensor]:
    """DeepSeek-V3/R1 gating with Tutel's name and signature ``(logits, bias, top_v_out, top_k_out)``:
    sigmoid, selection-only bias, group-limited top-k, weights renormalised and scaled. Defaults
    are DeepSeek-V3's (256 experts, 8 groups, 4 kept, k=8, scale 2.5); ``logits`` is [..., E].
    Returns (weights fp32+, ids int64), optionally written into the ``*_out`` tensors.
    """
    if logits.dim() < 1:
        raise ValueError(f"logits must be [..., experts], got shape {tuple(logits.shape)}")
    flat = logits.reshape(-1, logits.size(-1))
    weights_TK, ids_TK, _ = sigmoid_group_topk(flat, top_k, correction_bias, n_group, topk_group, renormalize, route_scale)
    shape = tuple(logits.shape[:-1]) + (top_k,)
    return (_write_out(weights_TK.view(shape), top_v_out, "top_v_out"),
            _write_out(ids_TK.view(shape), top_k_out, "top_k_out"))
