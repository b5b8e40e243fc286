"""Capacity rule and slot assignment (which slot of its expert each routed token takes).

Legend: T tokens, E experts, K experts chosen per token, C capacity (slots per expert).

The rule is Tutel's, so that checkpoints and experiments carry over:
  * ``capacity_factor > 0``: C = K * int(capacity_factor * ceil(T / E)) -- every expert padded to C;
  * ``capacity_factor == 0``: dropless, C = the largest load;
  * ``capacity_factor < 0``: C = min(largest load, K * int(-capacity_factor * ceil(T / E)));
then C is rounded up to a multiple of ``alignment``.
Slots are handed out choice-major: all first choices (in token order, or by descending router
score with batch-prioritized routing) before any second choice, and so on. An assignment whose
slot is >= C is dropped -- and counted by the caller, never silently.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .triton import use_triton

__all__ = ["capacity", "expert_slots", "fast_cumsum_sub_one"]


def capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float, max_load: int, alignment: int = 1) -> int:
    """Slots per expert for this batch (see the module docstring for the rule)."""
    if not math.isfinite(capacity_factor):
        raise ValueError(f"capacity_factor must be a finite number, got {capacity_factor}")
    if alignment < 1:
        raise ValueError(f"alignment must be >= 1, got {alignment}")
    tokens_per_expert = -(-num_tokens // num_experts)  # ceil(T / E)
    if capacity_factor > 0:
        cap = top_k * int(capacity_factor * tokens_per_expert)
    elif capacity_factor == 0:
        cap = max_load
    else:
        cap = min(max_load, top_k * int(-capacity_factor * tokens_per_expert))
    return -(-cap // alignment) * alignment


def expert_slots(ids_TK: Tensor, num_experts: int, priority_T: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Slot of each assignment within its expert, in Tutel's order.

    Args:
        ids_TK: int64 expert ids, [T, K].
        num_experts: E.
        priority_T: optional per-token score; higher goes first within each choice
            (batch-prioritized routing). Ties keep token order.

    Returns:
        slots_TK: int64 position of each assignment in its expert's queue (0-based).
        load_E: int64 assignments routed to each expert (before any capacity cut).
        order_KT: int64 flat assignment indices (k * T + t) sorted by (expert, slot); i.e. the
            ragged row order. Its i-th entry is the assignment that lands in sorted row i.
    """
    T, K = ids_TK.shape
    if priority_T is None and use_triton(ids_TK):  # --- Triton fast path (GPU; dynamoe.ops.triton.permute) ---
        from .triton.permute import sort_by_expert
        s = sort_by_expert(ids_TK, num_experts)
        return s.slots_TK, s.counts_E.long(), s.order_N
    if priority_T is None:
        token_order_T = None
        ids_KT = ids_TK.t().reshape(-1)
    else:
        token_order_T = torch.sort(priority_T, descending=True, stable=True).indices
        ids_KT = ids_TK.index_select(0, token_order_T).t().reshape(-1)
    # One stable sort gives both the slot of every assignment and the expert-major row order.
    sorted_ids, perm = torch.sort(ids_KT, stable=True)
    load_E = torch.bincount(ids_KT, minlength=num_experts)
    start_E = torch.cumsum(load_E, 0) - load_E
    rank = torch.arange(ids_KT.numel(), device=ids_TK.device) - start_E.index_select(0, sorted_ids)
    slots_flat = torch.empty_like(rank).scatter_(0, perm, rank)
    slots_TK = slots_flat.view(K, T).t()
    if token_order_T is not None:
        slots_TK = torch.empty_like(slots_TK).index_copy_(0, token_order_T, slots_TK)
        # map positions in the priority order back to real token indices
        k_idx, t_pos = perm // T, perm % T
        perm = k_idx * T + token_order_T.index_select(0, t_pos)
    return slots_TK.contiguous(), load_E, perm


def fast_cumsum_sub_one(data: Tensor, dim: int = 0) -> Tensor:
    """Tutel's ``fast_cumsum_sub_one``: ``cumsum(data, dim=0) - 1`` of a 2-D mask [T, E] -- each
    token's 0-based position among the tokens routed to the same expert (where its mask is 1)."""
    if data.dim() != 2 or dim != 0:
        raise ValueError(f"fast_cumsum_sub_one takes a 2-D tensor and dim=0, got shape {tuple(data.shape)} and dim={dim}")
    return torch.cumsum(data, dim=0) - 1
