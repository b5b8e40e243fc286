"""Data-parallel training helpers for models with expert-parallel MoE layers.

Expert parameters (tagged ``skip_allreduce`` by ``scan_expert_func``, or by the layer itself) already
get the sum of every rank's contribution through the all-to-all: they must not be all-reduced.
Everything else is replicated and needs its gradients averaged over ranks.

* :class:`ZeroOptimizer`: ZeRO-1. The replicated parameters' optimizer state is sharded: each rank
  keeps an fp32 master copy and the state of 1/world of them; a step reduce-scatters (averages) the
  gradients, updates the shard, and all-gathers the new values. Expert parameters step locally.
* :func:`data_parallel`: torch's DistributedDataParallel told to leave the expert parameters alone.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import Tensor, nn

from . import net

__all__ = ["is_expert_parameter", "ZeroOptimizer", "data_parallel"]


def is_expert_parameter(p: Tensor) -> bool:
    return bool(getattr(p, "skip_allreduce", False) or getattr(p, "_dynamoe_expert", False))


class ZeroOptimizer:
    """``ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=...)``: ZeRO-1 over ``group``.

    ``step()``/``zero_grad()`` as any optimizer; ``state_dict()`` holds this rank's shard (save one
    per rank). On one process it is the inner optimizer with fp32 master weights."""

    def __init__(self, params: Iterable[Tensor], optimizer=torch.optim.AdamW, group=None, **optimizer_kwargs):
        params = [p for p in params if p.requires_grad]
        if not params:
            raise ValueError("ZeroOptimizer got no parameters that require grad")
        self.group = group
        self.world, self.rank = net.get_world_size(group), net.get_world_rank(group)
        self.expert = [p for p in params if is_expert_parameter(p)]
        self.replicated = [p for p in params if not is_expert_parameter(p)]
        device = params[0].device
        total = sum(p.numel() for p in self.replicated)
        self.shard = -(-total // self.world) if total else 0
        flat = torch.zeros(self.shard * self.world, dtype=torch.float32, device=device)
        self._flat_copy(flat, [p.detach() for p in self.replicated])
        self.master = nn.Parameter(flat[self.rank * self.shard:(self.rank + 1) * self.shard].clone())
        self.inner = optimizer(([self.master] if self.shard else []) + self.expert, **optimizer_kwargs)
        self._total = total

    @property
    def param_groups(self):
        return self.inner.param_groups

    def _flat_copy(self, flat: Tensor, tensors: list) -> None:
        off = 0
        for t in tensors:
            flat[off:off + t.numel()].copy_(t.reshape(-1))
            off += t.numel()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.replicated + self.expert:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        if self.shard:
            flat = torch.zeros(self.shard * self.world, dtype=torch.float32, device=self.master.device)
            off = 0
            for p in self.replicated:
                if p.grad is not None:
                    flat[off:off + p.numel()].copy_(p.grad.reshape(-1))
                off += p.numel()
            if self.world > 1:
                mine = torch.empty(self.shard, dtype=torch.float32, device=flat.device)
                net.reduce_scatter_into(mine, flat, self.group)
                mine /= self.world
            else:
                mine = flat
            self.master.grad = mine
        self.inner.step()
        if self.shard:
            full = torch.empty(self.shard * self.world, dtype=torch.float32, device=self.master.device)
            if self.world > 1:
                net.all_gather_into(full, self.master.detach(), self.group)
            else:
                full.copy_(self.master.detach())
            off = 0
            for p in self.replicated:
                p.copy_(full[off:off + p.numel()].view_as(p))
                off += p.numel()

    def state_dict(self) -> dict:
        return {"inner": self.inner.state_dict(), "world": self.world, "rank": self.rank,
                "master": self.master.detach().clone()}

    def load_state_dict(self, state: dict) -> None:
        if (state.get("world"), state.get("rank")) != (self.world, self.rank):
            raise ValueError(f"this optimizer shard is rank {self.rank} of {self.world}; the state is rank "
                             f"{state.get('rank')} of {state.get('world')} (re-shard the checkpoint first)")
        self.inner.load_state_dict(state["inner"])
        with torch.no_grad():
            self.master.copy_(state["master"])


def data_parallel(model: nn.Module, **ddp_kwargs) -> nn.Module:
    """Wrap ``model`` in DistributedDataParallel, leaving expert parameters out of its all-reduce.
    Buffers are not broadcast from rank 0 by default: the MoE layers' load counters are per rank."""
    ddp_kwargs.setdefault("broadcast_buffers", False)
    names = [n for n, p in model.named_parameters() if is_expert_parameter(p)]
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
    return nn.parallel.DistributedDataParallel(model, **ddp_kwargs)
