"""Dispatch plan: where every routed token goes, and the two execution layouts built from it.

Legend: T tokens, K experts per token, E experts, C capacity, N kept assignments, D/O in/out dim.

An *assignment* is one (token, choice) pair, flat index ``a = k * T + t`` (choice-major, Tutel's
slot order). The plan keeps the kept assignments sorted by (expert, slot) -- the ragged row order;
the padded layout puts row i of that order at slot ``expert * C + slot`` of an [E, C, D] buffer.
Both layouts combine the same way: ``y[token] += weight * expert_out[row]``, so they agree exactly.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from ..ops.slots import capacity as capacity_rule
from ..ops.slots import expert_slots

__all__ = ["DispatchPlan", "RoutingStats", "build_plan", "dispatch_ragged", "dispatch_padded", "combine_ragged", "combine_padded"]


@dataclass
class RoutingStats:
    """What routing did in one forward -- exposed as ``y.routing_stats``.

    load: int64 [E] assignments routed to each expert (before capacity). kept: int64 [E] assignments
    each expert processed. dropped: assignments over capacity (their weight is lost, never silently:
    this counts them). capacity: slots per expert (padded layout; the max load when dropless).
    """

    load: Tensor
    kept: Tensor
    dropped: int
    capacity: int
    top_k: int
    capacity_factor: float
    layout: str
    losses: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.load.sum()) // max(self.top_k, 1)


@dataclass
class DispatchPlan:
    num_tokens: int
    num_experts: int
    top_k: int
    capacity: int
    load: list          # E ints: routed per expert
    counts: list        # E ints: kept per expert (rows of each expert in the ragged layout)
    order_N: Tensor     # flat assignment index of each kept row, sorted by (expert, slot)
    token_N: Tensor     # token of each row
    weight_N: Tensor    # combine weight of each row (fp32)
    expert_N: Tensor    # expert of each row
    slot_N: Tensor      # slot of each row within its expert
    load_E: Tensor      # int64 [E] on the routing device: routed per expert
    _slot_index_N: Optional[Tensor] = None

    def stats(self, capacity_factor: float, layout: str, losses: dict | None = None) -> RoutingStats:
        """The :class:`RoutingStats` of this plan (load and kept on the routing device; building
        them from the Python lists would cost more than the decode step's routing)."""
        return RoutingStats(load=self.load_E, kept=self.load_E.clamp(max=self.capacity), dropped=self.num_dropped,
                            capacity=self.capacity, top_k=self.top_k, capacity_factor=capacity_factor,
                            layout=layout, losses=losses or {})

    @property
    def num_dropped(self) -> int:
        return self.num_tokens * self.top_k - int(self.order_N.numel())

    @property
    def padded_index_N(self) -> Tensor:
        """Row of the flattened [E*C, D] padded buffer that each kept assignment occupies."""
        if self._slot_index_N is None:
            self._slot_index_N = self.expert_N * self.capacity + self.slot_N
        return self._slot_index_N


def build_plan(ids_TK: Tensor, weights_TK: Tensor, num_experts: int, capacity_factor: float,
               priority_T: Tensor | None = None, alignment: int = 1, agree_max=None) -> DispatchPlan:
    """Apply the capacity rule (dynamoe.ops.slots) to a routing decision.

    One host synchronisation (the per-expert load) decides the capacity and the row counts. Across
    ranks, ``agree_max([tokens, max load])`` returns their maxima over ranks, so that every rank uses
    the same capacity (dropless: the global max load; token counts may differ per rank).
    """
    T, K = ids_TK.shape
    slots_TK, load_E, order = expert_slots(ids_TK, num_experts, priority_T)
    load = load_E.tolist()
    T_cap, max_load = T, max(load, default=0)
    if agree_max is not None:
        T_cap, max_load = agree_max([T_cap, max_load])
    C = capacity_rule(T_cap, num_experts, K, capacity_factor, max_load, alignment)
    counts = [min(n, C) for n in load]
    ids_flat = ids_TK.t().reshape(-1)
    slots_flat = slots_TK.t().reshape(-1)
    if sum(counts) != T * K:
        order = order[slots_flat.index_select(0, order) < C]
    return DispatchPlan(
        num_tokens=T, num_experts=num_experts, top_k=K, capacity=C, load=load, counts=counts,
        order_N=order, token_N=order % T if K > 1 else order,
        weight_N=weights_TK.t().reshape(-1).index_select(0, order),
        expert_N=ids_flat.index_select(0, order), slot_N=slots_flat.index_select(0, order), load_E=load_E,
    )


def dispatch_ragged(x_TD: Tensor, plan: DispatchPlan, prescale: bool = False, out: Tensor | None = None) -> Tensor:
    """Rows of x in expert order, [N, D]. With ``prescale`` each row is multiplied by its weight
    (Tutel's ``is_postscore=False``). ``out``: optional [N, D] buffer (inference only)."""
    x_ND = x_TD.index_select(0, plan.token_N) if out is None else torch.index_select(x_TD, 0, plan.token_N, out=out)
    if prescale:
        x_ND = x_ND * plan.weight_N.to(x_ND.dtype).unsqueeze(1)
    return x_ND


def dispatch_padded(x_TD: Tensor, plan: DispatchPlan, prescale: bool = False) -> Tensor:
    """Padded expert input [E, C, D]; empty slots are zeros."""
    x_ND = dispatch_ragged(x_TD, plan, prescale)
    E, C, D = plan.num_experts, plan.capacity, x_TD.size(1)
    buf = x_TD.new_zeros(E * C, D)
    return buf.index_copy(0, plan.padded_index_N, x_ND).view(E, C, D)


def combine_ragged(y_NO: Tensor, plan: DispatchPlan, postscore: bool = True) -> Tensor:
    """y[t] = sum over t's kept assignments of weight * row output; [T, O] in y_NO's dtype."""
    if postscore:
        y_NO = y_NO * plan.weight_N.to(y_NO.dtype).unsqueeze(1)
    # in place on a fresh buffer: an out-of-place index_add would first copy the zeros
    return y_NO.new_zeros(plan.num_tokens, y_NO.size(1)).index_add_(0, plan.token_N, y_NO)


def combine_padded(y_ECO: Tensor, plan: DispatchPlan, postscore: bool = True) -> Tensor:
    y_NO = y_ECO.reshape(-1, y_ECO.size(-1)).index_select(0, plan.padded_index_N)
    return combine_ragged(y_NO, plan, postscore)
