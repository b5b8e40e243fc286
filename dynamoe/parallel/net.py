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
import math
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "TIMEOUT_ENV", "init_process_group", "is_initialized", "get_world_size", "get_world_rank", "barrier",
    "all_to_all_single", "all_to_all", "all_to_all_start", "all_to_all_finish", "local_size", "all_gather", "reduce_scatter", "zero_gather", "zero_scatter",
    "spatial_split", "allreduce_forward", "allreduce_backward",
    "all_to_all_v", "batch_all_to_all_v", "all_gather_v", "batch_all_gather_v", "create_groups_from_world",
    "create_standalone_group", "ParallelGroups", "simple_all_reduce", "simple_all_to_all", "simple_all_gather",
    "simple_reduce_scatter", "simple_split", "collective_timeout", "all_gather_into", "reduce_scatter_into",
    "TutelDistributedOptimizer",
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


def simple_all_reduce(input: Tensor, group=None, op=None, inplace: bool = False) -> Tensor:
    """All-reduce (sum by default) over ``group`` without autograd. As in Tutel, the result is a new
    tensor unless ``inplace=True`` (then ``input`` itself is reduced and returned); on one process
    ``input`` comes back as is."""
    if get_world_size(group) == 1:
        return input
    out = input if inplace else torch.clone(input, memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=dist.ReduceOp.SUM if op is None else op, group=group)
    return out


def simple_all_to_all(input: Tensor, group=None, background: bool = False):
    """Equal split of dim 0 (a multiple of the world size): block i to rank i, no autograd.
    ``background=True`` returns ``(output, wait)``: the exchange runs while the caller works, and
    ``wait()`` must be called before the output is read."""
    input = input.contiguous()
    if get_world_size(group) == 1:
        return (input, lambda *args: None) if background else input
    out = torch.empty_like(input)
    if background:
        work = dist.all_to_all_single(out, input, group=group, async_op=True)
        return out, work.wait
    dist.all_to_all_single(out, input, group=group)
    return out


def simple_split(input: Tensor, group=None) -> Tensor:
    """This rank's chunk of dim 0 split into world-many equal chunks (no communication)."""
    W = get_world_size(group)
    if W == 1:
        return input
    if input.size(0) % W:
        raise ValueError(f"simple_split: dim 0 ({input.size(0)}) must be divisible by the world size {W}")
    return input.contiguous().chunk(W, dim=0)[get_world_rank(group)]


def simple_reduce_scatter(input: Tensor, group=None, op=None) -> Tensor:
    """Sum over ranks (``op``), keeping this rank's chunk of dim 0; no autograd."""
    W = get_world_size(group)
    if W == 1:
        return input
    input = input.contiguous()
    if input.size(0) % W:
        raise ValueError(f"simple_reduce_scatter: dim 0 ({input.size(0)}) must be divisible by the world size {W}")
    if op is not None and op != dist.ReduceOp.SUM:
        return simple_split(simple_all_reduce(input, group, op=op), group)
    out = input.new_empty(input.size(0) // W, *input.shape[1:])
    reduce_scatter_into(out, input, group)
    return out


def simple_all_gather(input: Tensor, group=None) -> Tensor:
    """Every rank's ``input`` concatenated along dim 0 (rank order); a 1-D input gives [W * n]. No autograd."""
    W = get_world_size(group)
    if W == 1:
        return input
    input = input.contiguous()
    out = input.new_empty(W * input.numel())
    all_gather_into(out, input.view(-1), group)
    return out.view(-1, *input.shape[1:]) if input.dim() else out


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


def all_to_all_single(input: Tensor, group=None) -> Tensor:
    """Equal split along dim 0 (its size a multiple of the world): block i to rank i; differentiable."""
    W = get_world_size(group)
    if W == 1:
        return input
    if input.size(0) % W:
        raise ValueError(f"all_to_all_single needs dim 0 ({input.size(0)}) divisible by the world size {W}")
    return _AllToAllSingle.apply(input, group, None, None)


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


def all_to_all(input: Tensor, input_dim: int, output_dim: int, group=None, background: bool = False,
               use_2dh: bool = False):
    """Tutel's all_to_all: split ``input`` into world-many chunks along ``output_dim``, send chunk i to
    rank i, and concatenate what arrives along ``input_dim``. Its gradient is the reverse exchange.
    ``use_2dh``: Tutel's two-level exchange (within each node of ``LOCAL_SIZE`` ranks, then across
    nodes), which sends fewer, larger messages between nodes; identical result. ``background=True``
    returns a function that waits for the exchange and returns the result (Tutel's signature: call it
    before reading), so work can run while the data moves."""
    handle = all_to_all_start(input, input_dim, output_dim, group, use_2dh)
    if background:
        return lambda *args: all_to_all_finish(handle)
    return all_to_all_finish(handle)


class _AllGather(torch.autograd.Function):
    """Forward: every rank's ``x`` concatenated along ``dim``. Backward (Tutel's two kinds):
    ``fused`` -- each rank's slice of the gradient summed over ranks (reduce-scatter: every copy may
    feed a different loss); not fused -- this rank's own slice (the copies feed one replicated loss)."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, fused: bool, group) -> Tensor:
        ctx.dim, ctx.fused, ctx.group = dim, fused, group
        W = get_world_size(group)
        moved = (x if dim == 0 else x.movedim(dim, 0)).contiguous()
        out = moved.new_empty(W * moved.size(0), *moved.shape[1:])
        all_gather_into(out, moved, group)
        return out if dim == 0 else out.movedim(0, dim)

    @staticmethod
    def backward(ctx, g: Tensor):
        if ctx.fused:
            return _ReduceScatter.apply(g, ctx.dim, ctx.group), None, None, None
        return g.chunk(get_world_size(ctx.group), dim=ctx.dim)[get_world_rank(ctx.group)].contiguous(), None, None, None


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
        return _AllGather.apply(g, ctx.dim, False, ctx.group), None, None


class _Split(torch.autograd.Function):
    """This rank's chunk along ``dim``; backward: all-gather (Tutel's spatial_split)."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, group) -> Tensor:
        ctx.dim, ctx.group = dim, group
        return x.chunk(get_world_size(group), dim=dim)[get_world_rank(group)].contiguous()

    @staticmethod
    def backward(ctx, g: Tensor):
        return _AllGather.apply(g, ctx.dim, False, ctx.group), None, None


class _AllReduceForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, op, group) -> Tensor:
        return simple_all_reduce(x, group=group, op=op)

    @staticmethod
    def backward(ctx, g: Tensor):
        return g, None, None


class _AllReduceBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, op, group) -> Tensor:
        ctx.op, ctx.group = op, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: Tensor):
        return simple_all_reduce(g, group=ctx.group, op=ctx.op), None, None


def all_gather(input: Tensor, dim: int = 0, fused: bool = False, group=None) -> Tensor:
    """Tutel's all_gather: every rank's ``input`` concatenated along ``dim`` (rank order). Gradient:
    with ``fused=True`` the sum over ranks of each rank's slice (reduce-scatter), as each copy may feed
    a different loss; by default (Tutel's) this rank's own slice of its gradient."""
    if get_world_size(group) == 1:
        return input
    return _AllGather.apply(input, dim % input.dim(), bool(fused), group)


def reduce_scatter(input: Tensor, dim: int = 0, group=None) -> Tensor:
    """Sum ``input`` over ranks and keep this rank's chunk along ``dim``. Gradient: all-gather."""
    W = get_world_size(group)
    if W == 1:
        return input
    if input.size(dim) % W:
        raise ValueError(f"reduce_scatter: dim {dim} ({input.size(dim)}) must be divisible by the world size {W}")
    return _ReduceScatter.apply(input, dim % input.dim(), group)


def spatial_split(input: Tensor, dim: int = 0, group=None) -> Tensor:
    """This rank's chunk of ``input`` split world-many ways along ``dim``. Gradient: all-gather."""
    W = get_world_size(group)
    if W == 1:
        return input
    if input.size(dim) % W:
        raise ValueError(f"spatial_split: dim {dim} ({input.size(dim)}) must be divisible by the world size {W}")
    return _Split.apply(input, dim % input.dim(), group)


def allreduce_forward(input: Tensor, op=None, group=None) -> Tensor:
    """All-reduce in the forward pass; the gradient passes through unchanged."""
    if get_world_size(group) == 1:
        return input
    return _AllReduceForward.apply(input, dist.ReduceOp.SUM if op is None else op, group)


def allreduce_backward(input: Tensor, op=None, group=None) -> Tensor:
    """Identity in the forward pass; the gradient is all-reduced."""
    if get_world_size(group) == 1:
        return input
    return _AllReduceBackward.apply(input, dist.ReduceOp.SUM if op is None else op, group)


def zero_gather(input: Tensor, full_shape=None, group=None) -> Tensor:
    """Tutel's ZeRO gather: every rank's shard concatenated along dim 0, viewed as ``full_shape``
    (default: ``input``'s shape with dim 0 world times longer; a shorter shape drops the tail, e.g.
    the padding :func:`zero_scatter` added). Gradient: each shard's slice summed over ranks."""
    W = get_world_size(group)
    if full_shape is None:
        full_shape = [W * input.size(0), *input.shape[1:]] if input.dim() else [W]
    full_shape = [int(d) for d in full_shape]
    numel = math.prod(full_shape)
    gathered = input.reshape(1) if input.dim() == 0 else input
    if W > 1:
        gathered = _AllGather.apply(gathered, 0, True, group)
    if gathered.numel() < numel:
        raise ValueError(f"zero_gather: {gathered.numel()} gathered elements cannot fill full_shape {full_shape}")
    return gathered.reshape(-1)[:numel].view(full_shape)


def zero_scatter(input: Tensor, scatter_fn=None, group=None):
    """Tutel's ZeRO scatter: ``input`` flattened, zero-padded to a multiple of the world size, and
    handed to ``scatter_fn(data, group=group)`` (default :func:`simple_split`: this rank's 1/world;
    :func:`simple_reduce_scatter`: the same slice summed over ranks). Returns ``(shard, input.shape)``."""
    W = get_world_size(group)
    scatter_fn = simple_split if scatter_fn is None else scatter_fn
    n = input.numel()
    if n % W == 0:
        data = input.reshape(-1)
    else:
        data = input.new_zeros(-(-n // W) * W)
        data[:n] = input.reshape(-1)
    return scatter_fn(data, group=group), input.shape


# ---------------------------------------------------------------- variable-length exchanges
def _exchange_counts(send_counts: Sequence[int], group, device) -> list[int]:
    W = get_world_size(group)
    send = torch.tensor(list(send_counts), dtype=torch.int64, device=device)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.tolist() if W else []


def _check_counts(send_counts, rows: int, W: int, what: str = "rows") -> list[int]:
    counts = [int(c) for c in (send_counts.tolist() if isinstance(send_counts, Tensor) else send_counts)]
    if len(counts) != W or any(c < 0 for c in counts) or sum(counts) != rows:
        raise ValueError(f"send_counts must be {W} non-negative ints summing to the {what} ({rows}), got {counts}")
    return counts


def _rows_all_to_all_v(tensors: list[Tensor], counts: list[int], group) -> tuple[list[Tensor], list[int]]:
    if get_world_size(group) == 1:
        return tensors, counts
    recv = _exchange_counts(counts, group, tensors[0].device)
    return [_AllToAllSingle.apply(t, group, recv, counts) for t in tensors], recv


def all_to_all_v(x: Tensor, send_counts: Sequence[int], group=None) -> Tensor:
    """Send rows [off_i, off_i + send_counts[i]) of ``x`` to rank i; returns the rows received from
    ranks 0..W-1 concatenated. Any lengths, zero included; differentiable."""
    counts = _check_counts(send_counts, x.size(0), get_world_size(group))
    return _rows_all_to_all_v([x], counts, group)[0][0]


def batch_all_to_all_v(datas: Sequence[Tensor], partition_sizes, group=None) -> tuple[list[Tensor], Tensor]:
    """Tutel's batch_all_to_all_v: every tensor of ``datas`` (same numel) is flattened; elements
    [off_i, off_i + partition_sizes[i]) go to rank i. Returns ``(outputs, recv_sizes)``: per tensor the
    1-D concatenation of what ranks 0..W-1 sent here, and the int64 counts received. Any lengths,
    zero included; differentiable (Tutel's is not)."""
    if not isinstance(datas, (list, tuple)) or not datas:
        raise ValueError(f"datas must be a non-empty list or tuple of tensors, got {type(datas).__name__}")
    flat = [d.contiguous().view(-1) for d in datas]
    if any(t.numel() != flat[0].numel() for t in flat):
        raise ValueError("batch_all_to_all_v: every tensor must have the same number of elements")
    counts = _check_counts(partition_sizes, flat[0].numel(), get_world_size(group), "elements")
    outs, recv = _rows_all_to_all_v(flat, counts, group)
    return list(outs), torch.tensor(recv, dtype=torch.int64, device=flat[0].device)


def _rows_all_gather_v(tensors: list[Tensor], group) -> tuple[list[Tensor], list[int]]:
    W = get_world_size(group)
    rows = tensors[0].size(0)
    if W == 1:
        return tensors, [rows]
    # send my rows to every rank: an all_to_all_v with my rows repeated W times
    reps = [t.unsqueeze(0).expand(W, *t.shape).reshape(W * rows, *t.shape[1:]) for t in tensors]
    return _rows_all_to_all_v(reps, [rows] * W, group)


def all_gather_v(x: Tensor, group=None) -> Tensor:
    """Every rank's rows of ``x`` (any count per rank, zero included) concatenated in rank order; differentiable."""
    return _rows_all_gather_v([x], group)[0][0]


def batch_all_gather_v(datas: Sequence[Tensor], group=None) -> tuple[list[Tensor], Tensor]:
    """Tutel's batch_all_gather_v: every tensor of ``datas`` (same numel) is flattened and every rank's
    elements are concatenated in rank order. Returns ``(outputs, sizes)``: the 1-D results and the
    int64 element count each rank contributed."""
    if not isinstance(datas, (list, tuple)) or not datas:
        raise ValueError(f"datas must be a non-empty list or tuple of tensors, got {type(datas).__name__}")
    flat = [d.contiguous().view(-1) for d in datas]
    if any(t.numel() != flat[0].numel() for t in flat):
        raise ValueError("batch_all_gather_v: every tensor must have the same number of elements")
    outs, sizes = _rows_all_gather_v(flat, group)
    return list(outs), torch.tensor(sizes, dtype=torch.int64, device=flat[0].device)


# ---------------------------------------------------------------- groups
@dataclass
class ParallelGroups:
    """Process groups of this rank (Tutel's ``create_groups_from_world`` result): ``model_group``
    (``model_size`` consecutive ranks), ``data_group`` (the ``group_count`` ranks with the same position
    in every model group), ``global_group`` (the world), the ranks within them, ``local_device`` (from
    the backend: ``cuda:LOCAL_RANK`` for NCCL, CPU for gloo, None when unknown), ``is_distributed`` and
    :meth:`dist_print`. On one process the groups are None."""

    global_rank: int
    global_size: int
    model_group: object
    data_group: object
    model_rank: int
    model_size: int
    data_rank: int
    data_size: int
    global_group: object = None
    is_distributed: bool = False
    local_device: Optional[torch.device] = None

    @property
    def group_count(self) -> int:
        return self.data_size

    def dist_print(self, *args, **kwargs) -> None:
        """``print`` on global rank 0 only."""
        if self.global_rank == 0:
            print(*args, **kwargs)


_GROUPS: dict = {}
_BACKEND: dict = {}   # the backend named by the first include_init (Tutel allows one)


def create_standalone_group():
    """A process group of this rank alone (a layer built with it keeps all its experts local), or
    None when torch.distributed is not initialised."""
    return dist.new_group(ranks=[get_world_rank()]) if is_initialized() else None


def _init_from_launcher(backend: str) -> None:
    """Join the process group from torchrun's environment or, as Tutel does, Open MPI's
    (OMPI_COMM_WORLD_* with MASTER_ADDR / MASTER_PORT); nothing to join without either."""
    env = os.environ
    if "LOCAL_RANK" not in env and "OMPI_COMM_WORLD_SIZE" in env:
        if "MASTER_ADDR" not in env:
            raise ValueError("Open MPI launch without MASTER_ADDR: export MASTER_ADDR (and MASTER_PORT) to the rank-0 host")
        init_process_group(backend, init_method=f"tcp://{env['MASTER_ADDR']}:{env.get('MASTER_PORT', '23456')}",
                           rank=int(env["OMPI_COMM_WORLD_RANK"]), world_size=int(env["OMPI_COMM_WORLD_SIZE"]))
    elif "WORLD_SIZE" in env and "MASTER_ADDR" in env:
        init_process_group(backend)


def _local_device(backend: Optional[str]) -> Optional[torch.device]:
    if backend == "nccl":
        local = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", min(local, torch.cuda.device_count() - 1))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu") if backend == "gloo" else None


def create_groups_from_world(group_count: int, include_init: Optional[str] = None, parent_group=None) -> ParallelGroups:
    """Split the world into ``group_count`` model groups of consecutive ranks (Tutel's convention;
    a negative ``-n`` asks for groups of n ranks), plus the orthogonal data groups. Every rank must
    call it with the same value (group creation is collective); results are cached.

    ``include_init``: a backend ('gloo', 'nccl') with which to join the process group first, from
    torchrun's (or Open MPI's) environment; without a launcher environment the run is one process.
    'nccl' without CUDA falls back to gloo. ``parent_group``: accepted as in Tutel, which splits the
    world only (a group smaller than the world raises)."""
    if include_init is not None:
        if include_init not in ("nccl", "gloo"):
            raise ValueError(f"include_init must be 'nccl', 'gloo' or None, got {include_init!r}")
        backend = include_init if (include_init != "nccl" or torch.cuda.is_available()) else "gloo"
        if _BACKEND.setdefault("backend", backend) != backend:
            raise ValueError(f"only one backend per process: already {_BACKEND['backend']!r}, got {backend!r}")
        if not is_initialized():
            _init_from_launcher(backend)
    if parent_group is not None and 1 < get_world_size(parent_group) < get_world_size():
        raise ValueError("create_groups_from_world splits the world only: parent_group must be the world group "
                         f"(or None), got a group of {get_world_size(parent_group)} of {get_world_size()} ranks")
    W, rank = get_world_size(), get_world_rank()
    if isinstance(group_count, bool) or not isinstance(group_count, int) or group_count == 0:
        raise ValueError(f"group_count must be a non-zero int, got {group_count!r}")
    size = W // group_count if group_count > 0 else -group_count
    if size < 1 or W % size or (group_count > 0 and W % group_count):
        raise ValueError(f"group_count={group_count} does not split a world of {W} ranks into equal groups")
    key = (W, size)
    if key not in _GROUPS:
        device = _local_device(_BACKEND.get("backend") or (dist.get_backend() if is_initialized() else None))
        if W == 1:
            _GROUPS[key] = ParallelGroups(0, 1, None, None, 0, 1, 0, 1, None, is_initialized(), device)
        else:
            world = dist.group.WORLD
            model_groups = ([dist.new_group(list(range(s, s + size))) for s in range(0, W, size)]
                            if size != W else [world])
            data_groups = [dist.new_group(list(range(i, W, size))) for i in range(size)] if size != 1 else [world]
            _GROUPS[key] = ParallelGroups(rank, W, model_groups[rank // size if size != W else 0],
                                          data_groups[rank % size if size != 1 else 0],
                                          rank % size, size, rank // size, W // size, world, True, device)
    return _GROUPS[key]


class TutelDistributedOptimizer:
    """Tutel's ZeRO-style optimizer wrapper: the replicated parameters (those without
    ``_tutel_expert`` / ``_dynamoe_expert``) are split into 1/world flat shards, each rank steps its
    shard with ``local_optim`` on reduce-scattered gradients (averaged when ``average_shared``) and
    the updated shards are all-gathered back; expert parameters step locally.

    ``TutelDistributedOptimizer(params, group=None, average_shared=False).warp_local(torch.optim.SGD, lr=...)``.
    For fp32 master weights and a state dict see :class:`dynamoe.parallel.ZeroOptimizer`."""

    def __init__(self, params, group=None, average_shared: bool = False):
        params = list(params)
        self.params = [p for p in params if not _is_expert(p)]
        self.expert_params = [p for p in params if _is_expert(p)]
        self.shapes = [p.shape for p in self.params]
        self.group = group
        self.average_shared = average_shared
        self.local_optim = None

    def chunk_param(self) -> None:
        self.virt_params = [zero_scatter(p.data, simple_split, group=self.group)[0].clone() for p in self.params]

    def chunk_grad(self) -> None:
        W = get_world_size(self.group)
        for p, v in zip(self.params, self.virt_params):
            if p.grad is not None:
                grad = p.grad.reshape(-1) / W if self.average_shared else p.grad.reshape(-1)
                v.grad = zero_scatter(grad, simple_reduce_scatter, group=self.group)[0]

    def restore(self) -> None:
        for i, v in enumerate(self.virt_params):
            data = simple_all_gather(v.data, group=self.group).view(-1)
            self.params[i].data = data[:self.shapes[i].numel()].view(self.shapes[i])

    def warp_local(self, local_optim, *args, **kwargs) -> "TutelDistributedOptimizer":
        """Build ``local_optim(shards + expert params, *args, **kwargs)``; returns self (Tutel's name)."""
        self.chunk_param()
        self.local_optim = local_optim(self.virt_params + self.expert_params, *args, **kwargs)
        return self

    def zero_grad(self, set_to_none: bool = False) -> None:
        for p in self.params + self.expert_params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_()
                    p.grad.zero_()

    def step(self) -> None:
        if self.local_optim is None:
            raise ValueError("call warp_local(torch.optim.X, ...) before step()")
        self.chunk_grad()
        self.local_optim.step()
        self.restore()

    def state_dict(self) -> dict:
        """The local optimizer's state (this rank's shards and experts)."""
        return self.local_optim.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.local_optim.load_state_dict(state)


def _is_expert(p) -> bool:
    return hasattr(p, "_tutel_expert") or getattr(p, "_dynamoe_expert", False)
