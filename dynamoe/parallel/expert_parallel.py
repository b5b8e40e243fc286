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

__all__ = ["AllToAllExchange"]


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

    def sum_over_ranks(self, t: Tensor) -> Tensor:
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t

    def gather_experts(self, p: Tensor) -> Tensor:
        return net.all_gather(p, 0, group=self.group)          # [L, ...] -> [E, ...], grads summed back
