"""Tutel's low-level MoE ops, for models written against them (``helloworld_from_scratch``):
``extract_critical`` / ``top_k_routing`` (routing decision and capacity), ``fast_encode`` (tokens ->
[E, C, D] slots), ``fast_decode`` (slots -> tokens, weighted), ``fast_dispatcher`` (the same as an
object) and ``fast_cumsum_sub_one``.

Legend: T tokens, D model dim, E experts, K experts per token, C capacity.

The "critical data" tuple is Tutel's: ``(E, indices_s, locations_s, gates_s, capacity, counts_E)``
with one int32 [T] expert index, int32 [T] slot and [T] gate per choice k (first choices first), the
slot count C and the tokens routed to each expert. Tokens whose slot is >= C are dropped. Encode and
decode are plain autograd (index_add), differentiable in the data and the gates; they compute in
float32 unless the data is float16, as Tutel's kernels do. The :class:`~dynamoe.moe.MoELayer` does
not use them: its dispatch plan (dynamoe.moe.dispatch) adds the ragged layout and counted drops.
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import Tensor

from ..ops.slots import fast_cumsum_sub_one
from . import losses

__all__ = ["extract_critical", "top_k_routing", "fast_encode", "fast_decode", "fast_dispatcher",
           "TutelMoeFastDispatcher", "fast_cumsum_sub_one", "get_dispatch_count"]

_logger = logging.getLogger(__name__)


def _all_reduce_max(value: int, group, device) -> int:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return int(value)
    t = torch.tensor(int(value), device=device if dist.get_backend(group) == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t)


def _locations(mask_TE: Tensor, importance_T: Tensor | None) -> Tensor:
    """Each token's 0-based rank among the tokens of its expert: in token order, or by importance
    (most important first) under batch-prioritized routing."""
    if importance_T is None:
        return fast_cumsum_sub_one(mask_TE)
    order = importance_T.argsort(dim=0)
    sorted_TE = mask_TE[order]
    return (fast_cumsum_sub_one(sorted_TE) * sorted_TE)[order.argsort(dim=0)]


def extract_critical(scores: Tensor, top_k: int, loss_fn=losses.gshard_loss, capacity_factor: float = 1.0,
                     batch_prioritized_routing: bool = False, normalize_gate: bool = True, alignment: int = 1,
                     group=None, inequivalent_tokens: bool = False):
    """Tutel's routing decision from ``scores`` [T, E] (softmax probabilities): ``(critical data,
    loss_fn(scores, topk_ids) or None)``. ``top_k`` above E becomes E. Capacity (Tutel's rule, agreed
    over ``group`` -- None: the default group -- where it depends on the loads): ``capacity_factor``
    > 0: k * int(cf * ceil(T / E)); 0: the largest load; < 0: the largest load, at most
    k * int(-cf * ceil(T / E)); then rounded up to a multiple of ``alignment``. Gates of k > 1 are
    renormalised to sum to 1 when ``normalize_gate``. ``inequivalent_tokens``: ranks hold different
    T, so the largest T sets the capacity."""
    if scores.dim() != 2:
        raise ValueError(f"scores must be [tokens, experts], got shape {tuple(scores.shape)}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be an int >= 1, got {top_k!r}")
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1:
        raise ValueError(f"alignment must be an int >= 1, got {alignment!r}")
    T, E = scores.shape
    k_asked, top_k = top_k, min(top_k, E)
    topk_ids_TK = torch.topk(scores, top_k, dim=1).indices
    ids_s = [c.reshape(-1) for c in topk_ids_TK.chunk(top_k, dim=1)]
    masks_s = [torch.nn.functional.one_hot(i, E).to(i.dtype) for i in ids_s]   # [T, E] each
    gates_s = [(scores * m).sum(dim=1) for m in masks_s]
    l_loss = loss_fn(scores, topk_ids_TK) if loss_fn is not None else None

    importance = -scores.max(dim=1).values if batch_prioritized_routing else None
    loc_TE = _locations(masks_s[0], importance)
    locations_s = [(loc_TE * masks_s[0]).sum(dim=1).to(torch.int32)]
    base_1E = None
    for k in range(1, top_k):  # k-th choices queue behind every earlier choice of the expert
        taken = masks_s[k - 1].sum(dim=0, keepdim=True)
        base_1E = taken if base_1E is None else base_1E + taken
        loc_TE = _locations(masks_s[k], importance) + base_1E
        locations_s.append((loc_TE * masks_s[k]).sum(dim=1).to(torch.int32))
    if top_k > 1 and normalize_gate:
        denom = torch.clamp(sum(gates_s), min=torch.finfo(gates_s[0].dtype).eps)
        gates_s = [g / denom for g in gates_s]
    counts_E = loc_TE[-1] + 1 if T else torch.zeros(E, dtype=torch.int64, device=scores.device)

    num_samples = _all_reduce_max(T, group, scores.device) if inequivalent_tokens else T
    per_expert = -(-num_samples // E)
    if capacity_factor > 0:
        capacity = top_k * int(capacity_factor * per_expert)
    else:
        capacity = _all_reduce_max(int(counts_E.max()) if T else 0, group, scores.device)
        if capacity_factor < 0:
            capacity = min(capacity, top_k * int(-capacity_factor * per_expert))
    if capacity % alignment:
        capacity += alignment - capacity % alignment
    _logger.info("Capacity = %d, real-time capacity-factor for top-%d = %s", capacity, k_asked,
                 capacity / max(top_k * per_expert, 1))
    indices_s = [i.to(torch.int32) for i in ids_s]
    return (E, indices_s, locations_s, gates_s, capacity, counts_E), l_loss


top_k_routing = extract_critical


def get_dispatch_count(critical_data) -> Tensor:
    """The tokens routed to each expert [E] (before the capacity cut)."""
    return critical_data[-1]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float16 if dtype == torch.float16 else torch.float32


class TutelMoeFastDispatcher:
    """Tutel's dispatcher object: ``update(indices_, locations_, gates_, capacity, is_postscore)`` with
    the lists of :func:`extract_critical`, then ``encode(x_TD) -> [E*C, D]`` and ``decode(y) -> [T, D]``.
    Post-score (default): gates weight the combine; otherwise they weight the dispatch."""

    def __init__(self, num_global_experts: int, capacity: int, model_dim: int, dispatch_dtype: torch.dtype):
        self.num_global_experts, self.capacity, self.model_dim = int(num_global_experts), int(capacity), int(model_dim)
        self.original_dtype = dispatch_dtype
        self.dtype = _compute_dtype(dispatch_dtype)

    def update(self, indices_, locations_, gates_, capacity=None, is_postscore: bool = True) -> None:
        self.indices_ = [i.to(torch.int64).reshape(-1) for i in indices_]
        self.locations_ = [loc.to(torch.int64).reshape(-1) for loc in locations_]
        self.gates_ = [g.to(self.dtype) for g in gates_]
        self.is_postscore = is_postscore
        self.sample_size = int(self.indices_[0].numel())
        self.capacity = int(capacity) if capacity else self.capacity

    def _kept(self, k: int) -> tuple[Tensor, Tensor]:
        """(token rows, slot rows) of the k-th choices that fit in the capacity."""
        idx, loc = self.indices_[k], self.locations_[k]
        keep = ((loc < self.capacity) & (idx >= 0)).nonzero().squeeze(1)
        return keep, idx[keep] * self.capacity + loc[keep]

    def encode(self, data: Tensor) -> Tensor:
        x_TD = data.to(self.dtype).reshape(-1, self.model_dim)
        out = x_TD.new_zeros(self.num_global_experts * self.capacity, self.model_dim)
        for k in range(len(self.indices_)):
            rows, slots = self._kept(k)
            src = x_TD[rows] if self.is_postscore else x_TD[rows] * self.gates_[k][rows, None]
            out = out.index_add(0, slots, src)
        return out.to(self.original_dtype)

    def decode(self, data: Tensor) -> Tensor:
        y = data.to(self.dtype).reshape(-1, data.size(-1))
        out = y.new_zeros(self.sample_size, y.size(-1))
        for k in range(len(self.indices_)):
            rows, slots = self._kept(k)
            src = y[slots] * self.gates_[k][rows, None] if self.is_postscore else y[slots]
            out = out.index_add(0, rows, src)
        return out.to(self.original_dtype)


fast_dispatcher = TutelMoeFastDispatcher


def _dispatcher(data: Tensor, critical_data, is_postscore: bool) -> TutelMoeFastDispatcher:
    if not data.is_contiguous():
        raise ValueError("fast_encode / fast_decode take contiguous tensors (call .contiguous() first)")
    d = TutelMoeFastDispatcher(critical_data[0], 0, data.size(-1), data.dtype)
    d.update(*critical_data[1:-1], is_postscore=is_postscore)
    return d


# (``critial_data``, sic: Tutel's parameter name, kept for callers passing it by keyword)
def fast_encode(data: Tensor, critial_data, is_postscore: bool = True) -> Tensor:
    """Tokens [T, D] -> expert slots [E, C, D] (empty slots zero; with ``is_postscore=False`` each
    token is scaled by its gate here instead of in :func:`fast_decode`)."""
    E = critial_data[0]
    return _dispatcher(data, critial_data, is_postscore).encode(data).view(E, -1, data.size(-1))


def fast_decode(data: Tensor, critial_data, is_postscore: bool = True) -> Tensor:
    """Expert outputs [E, C, O] -> tokens [T, O]: each token's kept choices, weighted by their gates
    (when ``is_postscore``), summed; dropped choices add nothing."""
    return _dispatcher(data, critial_data, is_postscore).decode(data).view(-1, data.size(-1))
