"""Expert parallelism: the all-to-all exchange plugged into the MoE layer (see dynamoe.moe.exchange).

Each rank holds L experts of E = L * world; after routing its own tokens, a rank sends slot block
[expert e's capacity C] to the rank owning e and receives [L, world * C, D] for its experts; the
inverse all-to-all brings the results back. Capacity is agreed over ranks first (the max token
count and the max load), so every block has the same size and the result equals one process's
on the global batch wherever no token is dropped.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from . import net

__all__ = ["AllToAllExchange", "ShardGroups"]


class AllToAllExchange:
    def __init__(self, group=None):
        self.group = group
        self.world_size = net.get_world_size(group)
        self.rank = net.get_world_rank(group)

    def agree_max(self, values: list[int]) -> list[int]:
        t = torch.tensor(values, dtype=torch.int64, device=self._device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.tolist()

    def _device(self):
        backend = dist.get_backend(self.group)
        return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def start_dispatch(self, x_ECD: Tensor, use_2dh: bool = False):
        return net.all_to_all_start(x_ECD, 1, 0, self.group, use_2dh)   # [E, C, D] -> [L, W*C, D]

    def start_combine(self, y_LCO: Tensor, use_2dh: bool = False):
        return net.all_to_all_start(y_LCO, 0, 1, self.group, use_2dh)   # [L, W*C, O] -> [E, C, O]

    @staticmethod
    def finish(handle) -> Tensor:
        return net.all_to_all_finish(handle)

    def dispatch(self, x_ECD: Tensor, use_2dh: bool = False) -> Tensor:
        return self.finish(self.start_dispatch(x_ECD, use_2dh))

    def combine(self, y_LCO: Tensor, use_2dh: bool = False) -> Tensor:
        return self.finish(self.start_combine(y_LCO, use_2dh))

    def exchange_blocks(self, x: Tensor) -> Tensor:
        """Block w of dim 0 to rank w, rank w's block into slot w (no re-layout)."""
        return net.all_to_all_single(x, group=self.group)

    def sum_over_ranks(self, t: Tensor) -> Tensor:
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t

    def gather_experts(self, p: Tensor) -> Tensor:
        return net.all_gather(p, 0, fused=True, group=self.group)   # [L, ...] -> [E, ...], grads summed back

    def shard_groups(self, n: int) -> "ShardGroups":
        """The process groups behind experts shared by n consecutive ranks (collective: every rank
        builds the same layers in the same order)."""
        if dist.get_world_size(self.group) != dist.get_world_size():
            raise ValueError("experts sharded over ranks (num_experts_per_device < 0) need the whole world as the "
                             "layer's group (group=None)")
        return ShardGroups(n, self)


class ShardGroups:
    """Groups for experts sharded over n consecutive ranks (see dynamoe.moe.sharding).

    At adaptive degree r (a divisor of n), the g = n / r consecutive ranks of each block gather
    their shards, so each rank computes 1/r of an expert; the tokens of an expert then go to r
    ranks, one per slice: the all-to-all runs among the ranks with the same position in their
    g-block (stride g; member m computes slice m % r of expert m // r). r = n: no gathering, one
    all-to-all over the world (model parallel); r = 1: whole experts, exchanges among W / n ranks.
    """

    def __init__(self, n: int, world_exchange: AllToAllExchange):
        W = net.get_world_size()
        if W % n:
            raise ValueError(f"{n} ranks should share each expert, but the world has {W} ranks")
        self.n = n
        self._blocks = {1: None}                # g -> group of g consecutive ranks (gathering shards)
        self._exchanges = {1: world_exchange}   # g -> exchange among the ranks at stride g
        for g in (d for d in range(2, n + 1) if n % d == 0):
            groups = net.create_groups_from_world(-g)
            self._blocks[g] = groups.model_group
            self._exchanges[g] = AllToAllExchange(groups.data_group) if W // g > 1 else None

    def exchange(self, r: int, local):
        """The exchange at degree r (``local`` when the stride group is one rank)."""
        return self._exchanges[self.n // r] or local

    def gather_shards(self, p: Tensor, g: int) -> Tensor:
        """[g, *p.shape]: this rank's g-block's shards of ``p`` in rank order (differentiable:
        each shard's gradient sums over the block)."""
        return net.all_gather(p.unsqueeze(0), 0, fused=True, group=self._blocks[g])
