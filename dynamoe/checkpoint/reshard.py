"""Re-shard the state dicts of a model with expert-parallel MoE layers between world sizes.

Each rank's state dict holds, for every MoE layer at prefix ``P``, the buffer ``P._num_global_experts``
and its local experts ``P.experts.*`` whose leading dim is the local expert count L = E / world; every
other tensor is replicated. ``gather`` concatenates the expert tensors of N rank state dicts in rank
order (one state dict with all E experts: what one process loads); ``scatter`` splits them into M
(E must be divisible by M). Replicated tensors must agree across ranks and are kept once.

More ranks than experts (N or M a multiple of E): each expert was / is sharded over n = N / E
consecutive ranks along its hidden dim (``num_experts_per_device=-n``, dynamoe.moe.sharding); the
built-in ffn/glu experts' shards are merged / split by parameter name.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import Tensor

from ..moe.sharding import BUILTIN_SHARD_SPEC, OUTPUT_BIAS, OUTPUT_DIM_OF, merge_shards, split_shard

__all__ = ["expert_keys", "gather", "scatter"]

_MARKER = "_num_global_experts"


def expert_keys(state: Mapping[str, Tensor]) -> dict[str, int]:
    """{key of an expert-sharded tensor: the global expert count of its layer}."""
    layers = {k[: -len(_MARKER)]: int(v) for k, v in state.items() if k.endswith(_MARKER)}
    out = {}
    for key in state:
        for prefix, E in layers.items():
            if key.startswith(prefix + "experts."):
                out[key] = E
    return out


def _check_same(key: str, tensors: Sequence[Tensor]) -> Tensor:
    first = tensors[0]
    for r, t in enumerate(tensors[1:], 1):
        if t.shape != first.shape or not torch.equal(t, first):
            raise ValueError(f"replicated tensor {key!r} differs between rank 0 and rank {r}; "
                             "these are not checkpoints of one data-parallel run")
    return first


def gather(states: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """N rank state dicts (rank order) -> one with all experts."""
    if not states:
        raise ValueError("gather needs at least one state dict")
    keys = list(states[0])
    for r, s in enumerate(states[1:], 1):
        if set(s) != set(keys):
            raise ValueError(f"rank {r}'s state dict has different keys from rank 0's "
                             f"(missing {sorted(set(keys) - set(s))[:3]}, extra {sorted(set(s) - set(keys))[:3]})")
    sharded = expert_keys(states[0])
    out = {}
    for key in keys:
        parts = [s[key] for s in states]
        if key in sharded and len(states) > sharded[key]:
            out[key] = _merge_expert_shards(key, parts, sharded[key], states[0])
        elif key in sharded:
            full = torch.cat(parts, dim=0)
            if full.size(0) != sharded[key]:
                raise ValueError(f"{key!r}: {len(states)} ranks x {parts[0].size(0)} experts = {full.size(0)}, "
                                 f"but the layer has {sharded[key]} experts: are all ranks' files here?")
            out[key] = full
        else:
            out[key] = _check_same(key, parts)
    return out


def _role(key: str):
    name = key.rsplit(".", 1)[-1]
    if name not in BUILTIN_SHARD_SPEC:
        raise ValueError(f"{key!r}: experts sharded over ranks can be re-sharded for the built-in ffn/glu experts "
                         f"only (parameters {sorted(BUILTIN_SHARD_SPEC)})")
    return BUILTIN_SHARD_SPEC[name]


def _output_dim(key: str, state: Mapping[str, Tensor]) -> int | None:
    name = key.rsplit(".", 1)[-1]
    if name not in OUTPUT_DIM_OF:
        return None
    weight, dim = OUTPUT_DIM_OF[name]
    w = state.get(key[: -len(name)] + weight)
    if w is None:
        raise ValueError(f"{key!r}: no {weight!r} beside it to tell the output size")
    return w.size(dim)


def _merge_expert_shards(key: str, parts: Sequence[Tensor], E: int, state0: Mapping[str, Tensor]) -> Tensor:
    N = len(parts)
    if N % E or any(p.size(0) != 1 for p in parts):
        raise ValueError(f"{key!r}: {N} ranks for {E} experts: expected a multiple of {E} ranks holding one expert shard each")
    n, role = N // E, _role(key)
    out_dim = _output_dim(key, state0) if role == OUTPUT_BIAS else None
    return torch.cat([merge_shards(torch.stack(parts[e * n:(e + 1) * n]), role, out_dim) for e in range(E)], dim=0)


def scatter(state: Mapping[str, Tensor], world: int) -> list[dict[str, Tensor]]:
    """One state dict with all experts -> ``world`` rank state dicts."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be an int >= 1, got {world!r}")
    sharded = expert_keys(state)
    outs: list[dict[str, Tensor]] = [{} for _ in range(world)]
    for key, t in state.items():
        if key in sharded:
            E = sharded[key]
            if t.size(0) != E:
                raise ValueError(f"{key!r} holds {t.size(0)} experts, the layer {E}: is this a gathered checkpoint?")
            if world > E:  # n = world / E ranks share each expert
                if world % E:
                    raise ValueError(f"{key!r}: {E} experts cannot be shared equally by {world} ranks")
                n, role = world // E, _role(key)
                for r in range(world):
                    outs[r][key] = split_shard(t[r // n:r // n + 1], role, n, r % n)
                continue
            if E % world:
                raise ValueError(f"{key!r}: {E} experts do not split over {world} ranks")
            for r, part in enumerate(t.chunk(world, dim=0)):
                outs[r][key] = part.clone()
        else:
            for r in range(world):
                outs[r][key] = t
    return outs
