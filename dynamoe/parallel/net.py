"""Collectives for MoE over ``torch.distributed`` with Tutel's names, differentiable where Tutel's are.

Everything goes through torch.distributed's own collectives (NCCL on GPUs, gloo on CPU); this module
decides what to send, never how bytes move. Every function works on one process too (no
``init_process_group``): it is then the identity or a local copy. Variable-length exchanges
(``*_v``) are built on ``all_to_all_single`` with split sizes, because gloo's list form of
``all_to_all`` rejects unequal tensors.

Collective timeout: ``init_process_group`` reads ``DYNAMOE_COLLECTIVE_TIMEOUT_SEC`` (default 1800), so
a dead rank ends the job with torch's timeout error instead of a hang.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "TIMEOUT_ENV", "init_process_group", "is_initialized", "get_world_size", "get_world_rank", "barrier",
    "all_to_all_single", "all_to_all", "all_to_all_start", "all_to_all_finish", "local_size", "all_gather", "reduce_scatter", "zero_gather", "zero_scatter",
    "all_to_all_v", "batch_all_to_all_v", "all_gather_v", "batch_all_gather_v", "create_groups_from_world",
    "ParallelGroups", "simple_all_reduce", "collective_timeout", "all_gather_into", "reduce_scatter_into",
]

TIMEOUT_ENV = "DYNAMOE_COLLECTIVE_TIMEOUT_SEC"


# torch 2.13 renamed the tensor-in/tensor-out collectives; older releases (>= 2.4) have the old names
_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_into(out: Tensor, x: Tensor, group=None) -> None:
    """out = every rank's x concatenated along dim 0 (in place, no autograd)."""
    _gather_single(out, x, group=group)


def reduce_scatter_into(out: Tensor, x: Tensor, group=None) -> None:
    """out = this rank's dim-0 chunk of the sum over ranks of x (in place, no autograd)."""
    _scatter_single(out, x, op=dist.ReduceOp.SUM, group=group)


def collective_timeout() -> datetime.timedelta:
    raw = os.environ.get(TIMEOUT_ENV, "1800")
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{TIMEOUT_ENV} must be a positive number of seconds, got {raw!r}")
    return datetime.timedelta(seconds=seconds)


def init_process_group(backend: Optional[str] = None, **kwargs) -> None:
    """``torch.distributed.init_process_group`` from the launcher's environment (torchrun's or
    ``dynamoe.launcher.run``'s), with the timeout from ``DYNAMOE_COLLECTIVE_TIMEOUT_SEC``; the backend
    defaults to NCCL when CUDA is there, else gloo. A no-op when already initialised."""
    if dist.is_initialized():
        return
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    kwargs.setdefault("timeout", collective_timeout())
    dist.init_process_group(backend=backend, **kwargs)


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_world_size(group=None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def get_world_rank(group=None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def barrier(group=None) -> None:
    if is_initialized():
        dist.barrier(group)


def simple_all_reduce(x: Tensor, group=None, op=None) -> Tensor:
    """In-place all-reduce (sum by default) of a tensor; returns it."""
    if get_world_size(group) > 1:
        dist.all_reduce(x, op=op or dist.ReduceOp.SUM, group=group)
    return x


# ---------------------------------------------------------------- equal-size exchanges (autograd)
class _AllToAllSingle(torch.autograd.Function):
    """Row block i of the input goes to rank i; block j of the output came from rank j."""

    @staticmethod
    def forward(ctx, x: Tensor, group, out_splits, in_splits) -> Tensor:
        ctx.group, ctx.splits = group, (in_splits, out_splits)
        x = x.contiguous()
        rows = x.size(0) if out_splits is None else sum(out_splits)
        out = x.new_empty(rows, *x.shape[1:])
        dist.all_to_all_single(out, x, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        in_splits, out_splits = ctx.splits
        return _AllToAllSingle.apply(g, ctx.group, in_splits, out_splits), None, None, None


def all_to_all_single(x: Tensor, group=None) -> Tensor:
    """Equal split along dim 0 (its size a multiple of the world): block i to rank i."""
    W = get_world_size(group)
    if W == 1:
        return x
    if x.size(0) % W:
        raise ValueError(f"all_to_all_single needs dim 0 ({x.size(0)}) divisible by the world size {W}")
    return _AllToAllSingle.apply(x, group, None, None)


class _AllToAllStart(torch.autograd.Function):
    """Issues an equal-split all_to_all_single asynchronously; the caller must wait on the handle
    (all_to_all_finish) before using the output. The backward exchange is synchronous."""

    @staticmethod
    def forward(ctx, x: Tensor, group, handles: list) -> Tensor:
        ctx.group = group
        out = torch.empty_like(x)
        handles.append(dist.all_to_all_single(out, x, group=group, async_op=True))
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        g = g.contiguous()
        out = torch.empty_like(g)
        dist.all_to_all_single(out, g, group=ctx.group)
        return out, None, None


def local_size(world: int) -> int:
    """Ranks per node for 2DH: ``LOCAL_SIZE`` (set by torchrun's LOCAL_WORLD_SIZE or the launcher)."""
    raw = os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or str(world)
    n = int(raw) if raw.isdigit() else 0
    if n < 1 or world % n:
        raise ValueError(f"2DH all-to-all needs LOCAL_SIZE (ranks per node) dividing the world size {world}, got {raw!r}")
    return n


def _two_level(chunks: Tensor, W: int) -> Tensor:
    """Two-level (2DH) exchange of [W, c...] blocks: first within each node, then across nodes
    between ranks with the same local index; the result is the flat exchange's, in its order."""
    n = local_size(W)
    N = W // n
    groups = create_groups_from_world(-n)                  # model_group: my node; data_group: my column
    tail = chunks.shape[1:]
    # [N(dst node), n(dst local), c] -> [n(dst local), N(dst node), c]: intra-node exchange by dst local
    a = chunks.view(N, n, *tail).transpose(0, 1).contiguous().view(W, *tail)
    works: list = []
    a = _AllToAllStart.apply(a, groups.model_group, works)
    for w in works:
        w.wait()
    # now [n(src local), N(dst node), c] -> [N(dst node), n(src local), c]: exchange across nodes
    b = a.view(n, N, *tail).transpose(0, 1).contiguous().view(W, *tail)
    works = []
    b = _AllToAllStart.apply(b, groups.data_group, works)
    for w in works:
        w.wait()
    return b                                               # [N(src node), n(src local), c] = [W(src), c]


def all_to_all_start(x: Tensor, input_dim: int, output_dim: int, group=None, use_2dh: bool = False):
    """Issue :func:`all_to_all` asynchronously and return a handle; :func:`all_to_all_finish` waits
    for it and lays the result out. Issuing several before finishing any overlaps the transfers with
    whatever runs in between (``a2a_ffn_overlap_degree``). ``use_2dh``: the two-level exchange
    (completes before returning)."""
    W = get_world_size(group)
    if W == 1:
        return ("local", x)
    nd = x.dim()
    input_dim, output_dim = input_dim % nd, output_dim % nd
    if x.size(output_dim) % W:
        raise ValueError(f"all_to_all: dim {output_dim} ({x.size(output_dim)}) must be divisible by the world size {W}")
    # [W, chunk...] with the chunk index first, so one all_to_all_single moves everything
    chunks = x.unflatten(output_dim, (W, x.size(output_dim) // W)).movedim(output_dim, 0).contiguous()
    if use_2dh:
        if group not in (None, dist.group.WORLD):
            raise ValueError("use_2dh works on the world group (nodes are groups of LOCAL_SIZE consecutive ranks)")
        return ("sent", _two_level(chunks, W), [], input_dim)
    works: list = []
    moved = _AllToAllStart.apply(chunks, group, works)
    return ("sent", moved, works, input_dim)


def all_to_all_finish(handle) -> Tensor:
    if handle[0] == "local":
        return handle[1]
    _, moved, works, input_dim = handle
    for w in works:
        w.wait()
    works.clear()
    return moved.movedim(0, input_dim).flatten(input_dim, input_dim + 1)


def all_to_all(x: Tensor, input_dim: int, output_dim: int, use_2dh: bool = False, group=None) -> Tensor:
    """Tutel's all_to_all: split ``x`` into world-many chunks along ``output_dim``, send chunk i to
    rank i, and concatenate what arrives along ``input_dim``. Its gradient is the reverse exchange.
    ``use_2dh``: Tutel's two-level exchange (within each node of ``LOCAL_SIZE`` ranks, then across
    nodes), which sends fewer, larger messages between nodes; identical result."""
    return all_to_all_finish(all_to_all_start(x, input_dim, output_dim, group, use_2dh))


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, dim: int, group) -> Tensor:
        ctx.dim, ctx.group = dim, group
        W = get_world_size(group)
        moved = (x if dim == 0 else x.movedim(dim, 0)).contiguous()
        out = moved.new_empty(W * moved.size(0), *moved.shape[1:])
        all_gather_into(out, moved, group)
        return out if dim == 0 else out.movedim(0, dim)

    @staticmethod
    def backward(ctx, g: Tensor):
        return _ReduceScatter.apply(g, ctx.dim, ctx.group), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, dim: int, group) -> Tensor:
        ctx.dim, ctx.group = dim, group
        W = get_world_size(group)
        moved = (x if dim == 0 else x.movedim(dim, 0)).contiguous()
        out = moved.new_empty(moved.size(0) // W, *moved.shape[1:])
        reduce_scatter_into(out, moved, group)
        return out if dim == 0 else out.movedim(0, dim)

    @staticmethod
    def backward(ctx, g: Tensor):
        return _AllGather.apply(g, ctx.dim, ctx.group), None, None


def all_gather(x: Tensor, dim: int = 0, group=None) -> Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order). Gradient: the sum over ranks of
    each rank's slice (reduce-scatter), as each copy may feed a different loss."""
    if get_world_size(group) == 1:
        return x
    return _AllGather.apply(x, dim % x.dim(), group)


def reduce_scatter(x: Tensor, dim: int = 0, group=None) -> Tensor:
    """Sum ``x`` over ranks and keep this rank's chunk along ``dim``. Gradient: all-gather."""
    W = get_world_size(group)
    if W == 1:
        return x
    if x.size(dim) % W:
        raise ValueError(f"reduce_scatter: dim {dim} ({x.size(dim)}) must be divisible by the world size {W}")
    return _ReduceScatter.apply(x, dim % x.dim(), group)


def zero_gather(x: Tensor, group=None) -> Tensor:
    """Tutel's ZeRO gather: every rank's flattened shard, concatenated -> 1-D [world * numel]."""
    return all_gather(x.reshape(-1), 0, group)


class _ZeroScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group, ctx.shape = group, x.shape
        W, r = get_world_size(group), get_world_rank(group)
        return x.reshape(-1).chunk(W)[r].clone()

    @staticmethod
    def backward(ctx, g: Tensor):
        return _AllGather.apply(g.contiguous(), 0, ctx.group).view(ctx.shape), None


def zero_scatter(x: Tensor, group=None) -> Tensor:
    """This rank's 1/world of the flattened ``x`` (the inverse of zero_gather)."""
    W = get_world_size(group)
    if W == 1:
        return x.reshape(-1)
    if x.numel() % W:
        raise ValueError(f"zero_scatter: {x.numel()} elements do not split into {W} equal shards")
    return _ZeroScatter.apply(x, group)


# ---------------------------------------------------------------- variable-length exchanges
def _exchange_counts(send_counts: Sequence[int], group, device) -> list[int]:
    W = get_world_size(group)
    send = torch.tensor(list(send_counts), dtype=torch.int64, device=device)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.tolist() if W else []


def _check_counts(send_counts, rows: int, W: int) -> list[int]:
    counts = [int(c) for c in send_counts]
    if len(counts) != W or any(c < 0 for c in counts) or sum(counts) != rows:
        raise ValueError(f"send_counts must be {W} non-negative ints summing to the rows ({rows}), got {list(send_counts)}")
    return counts


def batch_all_to_all_v(tensors: Sequence[Tensor], send_counts: Sequence[int], group=None) -> list[Tensor]:
    """Send rows [off_i, off_i + send_counts[i]) of every tensor to rank i; returns, per tensor, the
    rows received from ranks 0..W-1 concatenated. Any lengths, zero included; differentiable."""
    W = get_world_size(group)
    tensors = list(tensors)
    if not tensors:
        return []
    rows = tensors[0].size(0)
    if any(t.size(0) != rows for t in tensors):
        raise ValueError("batch_all_to_all_v: every tensor must have the same number of rows")
    counts = _check_counts(send_counts, rows, W)
    if W == 1:
        return tensors
    recv = _exchange_counts(counts, group, tensors[0].device)
    return [_AllToAllSingle.apply(t, group, recv, counts) for t in tensors]


def all_to_all_v(x: Tensor, send_counts: Sequence[int], group=None) -> Tensor:
    return batch_all_to_all_v([x], send_counts, group)[0]


def batch_all_gather_v(tensors: Sequence[Tensor], group=None) -> list[Tensor]:
    """Every rank's rows (any count per rank, zero included) concatenated in rank order, per tensor."""
    W = get_world_size(group)
    tensors = list(tensors)
    if W == 1 or not tensors:
        return tensors
    rows = tensors[0].size(0)
    if any(t.size(0) != rows for t in tensors):
        raise ValueError("batch_all_gather_v: every tensor must have the same number of rows")
    # send my rows to every rank: an all_to_all_v with my rows repeated W times
    out = []
    for t in tensors:
        rep = t.unsqueeze(0).expand(W, *t.shape).reshape(W * rows, *t.shape[1:])
        out.append(rep)
    return batch_all_to_all_v(out, [rows] * W, group)


def all_gather_v(x: Tensor, group=None) -> Tensor:
    return batch_all_gather_v([x], group)[0]


# ---------------------------------------------------------------- groups
@dataclass
class ParallelGroups:
    """Process groups of this rank: ``model_group`` (consecutive ranks), ``data_group`` (the ranks
    with the same position in every model group), and the sizes and ranks within them."""

    global_rank: int
    global_size: int
    model_group: object
    data_group: object
    model_rank: int
    model_size: int
    data_rank: int
    data_size: int


_GROUPS: dict = {}


def create_groups_from_world(group_count: int) -> ParallelGroups:
    """Split the world into ``group_count`` model groups of consecutive ranks (Tutel's convention;
    a negative ``-n`` asks for groups of n ranks), plus the orthogonal data groups. Every rank must
    call it with the same value (group creation is collective); results are cached."""
    W, rank = get_world_size(), get_world_rank()
    if isinstance(group_count, bool) or not isinstance(group_count, int) or group_count == 0:
        raise ValueError(f"group_count must be a non-zero int, got {group_count!r}")
    size = W // group_count if group_count > 0 else -group_count
    if size < 1 or W % size:
        raise ValueError(f"group_count={group_count} does not split a world of {W} ranks into equal groups")
    key = (W, size)
    if key not in _GROUPS:
        if W == 1:
            _GROUPS[key] = ParallelGroups(0, 1, None, None, 0, 1, 0, 1)
        else:
            model_groups = [dist.new_group(list(range(s, s + size))) for s in range(0, W, size)]
            data_groups = [dist.new_group(list(range(i, W, size))) for i in range(size)]
            _GROUPS[key] = ParallelGroups(rank, W, model_groups[rank // size], data_groups[rank % size],
                                          rank % size, size, rank // size, W // size)
    return _GROUPS[key]
