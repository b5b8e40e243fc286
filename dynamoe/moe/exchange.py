"""Where the MoE layer's tokens meet experts on other processes: an extension point.

The layer computes on one process through :class:`LocalExchange` (nothing to exchange). Expert
parallelism plugs in an exchange whose ``dispatch``/``combine`` are all-to-alls: ``dynamoe.parallel``
registers its factory here when imported (this layer never imports the parallel layer above it).

An exchange has ``world_size``, ``rank`` and:
  * ``agree_max(values) -> values``: element-wise max over ranks (capacity and token counts must
    agree so that every rank sends equal-size blocks);
  * ``dispatch(x_ECD, use_2dh) -> x_LWcD``: [E = W*L global experts, C, D] -> [L local experts, W*C, D]
    (``use_2dh``: the two-level exchange, same result);
  * ``combine(y_LWcO) -> y_ECO``: the inverse exchange;
  * ``exchange_blocks(x) -> x``: dim 0's W equal blocks to ranks 0..W-1, received in source-rank
    order, no re-layout (the experts read [W source blocks of L experts] in place);
  * ``start_dispatch`` / ``start_combine`` -> handle and ``finish(handle)``: the same exchanges split
    in two, so several can be in flight while experts compute (``a2a_ffn_overlap_degree``);
  * ``sum_over_ranks(t) -> t``: element-wise sum over ranks (e.g. the expert load behind the
    aux-loss-free bias update, which must be the same on every rank);
  * ``gather_experts(p_L...) -> p_E...``: every rank's expert parameters concatenated along dim 0,
    differentiable (the gradient of each expert sums over ranks) -- data parallelism for one call
    (``adaptive_r=0``) without moving any parameter for good;
  * ``shard_groups(n)``: the groups behind experts shared by n ranks (``num_experts_per_device=-n``):
    ``exchange(r, local)`` (the exchange at degree r) and ``gather_shards(p, g)``.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch.distributed as dist
from torch import Tensor

__all__ = ["LocalExchange", "register_distributed_exchange", "exchange_for"]


class LocalExchange:
    world_size = 1
    rank = 0

    def agree_max(self, values: list[int]) -> list[int]:
        return list(values)

    def dispatch(self, x_ECD: Tensor, use_2dh: bool = False) -> Tensor:
        return x_ECD

    def combine(self, y_LCO: Tensor, use_2dh: bool = False) -> Tensor:
        return y_LCO

    def gather_experts(self, p: Tensor) -> Tensor:
        return p

    def exchange_blocks(self, x: Tensor) -> Tensor:
        return x

    def sum_over_ranks(self, t: Tensor) -> Tensor:
        return t

    def start_dispatch(self, x_ECD: Tensor, use_2dh: bool = False):
        return x_ECD

    def start_combine(self, y_LCO: Tensor, use_2dh: bool = False):
        return y_LCO

    @staticmethod
    def finish(handle) -> Tensor:
        return handle


_FACTORY: Optional[Callable] = None


def register_distributed_exchange(factory: Callable) -> None:
    """Called by dynamoe.parallel: ``factory(group)`` builds the exchange for a process group."""
    global _FACTORY
    _FACTORY = factory


def exchange_for(group) -> object:
    """The exchange for ``group``: local on one process, else the registered distributed one."""
    world = dist.get_world_size(group) if (group is not None and dist.is_available() and dist.is_initialized()) else 1
    if world == 1:
        return LocalExchange()
    if _FACTORY is None:
        raise ValueError(f"group has {world} ranks: expert parallelism needs dynamoe.parallel (import dynamoe.parallel)")
    return _FACTORY(group)
