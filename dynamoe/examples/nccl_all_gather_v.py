"""Tutel's nccl_all_gather_v on dynamoe: ``net.batch_all_gather_v`` with a different row count per rank.

Usage: torchrun --nproc_per_node=2 -m dynamoe.examples.nccl_all_gather_v [--device cpu]

Despite Tutel's name it runs on any backend (NCCL on CUDA, gloo on CPU) and any number of ranks
(one process included). Rank r holds r rows -- rank 0 none -- of two tensors: ``x`` (float32
[r, 2], row i = (100 r + i, -(100 r + i))) and ``y`` (int64 [r], 100 r + i). Every rank must get
all ranks' rows concatenated in rank order, which it can compute itself, and checks that.
Rank 0 prints OK, or the example exits with status 1.
"""
from __future__ import annotations

import torch

from .. import net
from ._common import dist_print, parse_args, run_main, world
from .nccl_all_to_all_v import agree, build_parser


def rows_of(rank: int) -> list[int]:
    return [100 * rank + i for i in range(rank)]


def _tensors(codes: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.tensor(codes, dtype=torch.int64, device=device)
    x = torch.stack([y.float(), -y.float()], dim=1) if codes else torch.zeros(0, 2, device=device)
    return x, y


def main(argv=None) -> bool:
    parser = build_parser()
    parser.description = __doc__.splitlines()[0]
    args = parse_args(parser, argv)
    rank, size = world()
    x, y = _tensors(rows_of(rank), args.device)
    print(f"Device-{rank} sends {len(rows_of(rank))} row(s): {y.tolist()}", flush=True)
    net.barrier()

    (got_y, got_neg), sizes = net.batch_all_gather_v([y, -y])   # Tutel's: flat tensors, (outputs, sizes)
    got_x = net.all_gather_v(x)                                   # rows, differentiable
    want_x, want_y = _tensors([c for s in range(size) for c in rows_of(s)], args.device)
    print(f"Device-{rank} recvs {got_y.numel()} row(s): {got_y.tolist()}", flush=True)
    ok = (torch.equal(got_y, want_y) and torch.equal(got_neg, -want_y) and torch.equal(got_x, want_x)
          and sizes.tolist() == [len(rows_of(s)) for s in range(size)])
    net.barrier()
    if not agree(ok, args.device):
        dist_print("[all_gather_v] FAILED: a rank gathered rows other than the ones it expected")
        raise SystemExit(1)
    dist_print(f"[all_gather_v] OK: {size} rank(s) holding {[len(rows_of(s)) for s in range(size)]} rows, 2 tensors verified")
    return True


if __name__ == "__main__":
    run_main(main)
