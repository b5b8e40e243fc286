"""Tutel's nccl_all_to_all_v on dynamoe: ``net.batch_all_to_all_v`` with uneven and zero send counts.

Usage: torchrun --nproc_per_node=2 -m dynamoe.examples.nccl_all_to_all_v [--device cpu]

Despite Tutel's name it runs on any backend (NCCL on CUDA, gloo on CPU) and any number of ranks
(one process included, where the exchange is the identity). Rank s sends ``count(s, d)`` rows to
rank d, with ``count(s, d) = (s + 2 d + 1) mod 3`` -- uneven, and zero for some pairs. ``y`` (int64
[rows], every entry encoding (source, destination, index)) and ``-y`` travel in one Tutel-style call
(``net.batch_all_to_all_v([y, -y], counts)``: flat tensors of one length, counts in elements, returns
``(outputs, received counts)``); ``x`` (float32 [rows, 3], the same code per row) goes through the
row-based, differentiable ``net.all_to_all_v(x, counts)``. Every rank can compute what it must receive -- the rows from
ranks 0..W-1 in order -- and checks the result, and the gradient (the reverse exchange: ones back
to every sent row). Rank 0 prints OK, or the example exits with status 1.
"""
from __future__ import annotations

import argparse

import torch

from .. import net
from ._common import dist_print, parse_args, run_main, world


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1, help="set by distributed launchers; ignored")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    return p


def count(src: int, dst: int) -> int:
    """Rows rank ``src`` sends to rank ``dst``."""
    return (src + 2 * dst + 1) % 3


def code(src: int, dst: int, i: int) -> int:
    return 10000 * src + 100 * dst + i


def rows_sent(src: int, dst: int) -> list[int]:
    return [code(src, dst, i) for i in range(count(src, dst))]


def _tensors(codes: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.tensor(codes, dtype=torch.int64, device=device)
    x = torch.stack([y.float(), -y.float(), y.float() * 0.5], dim=1) if codes else torch.zeros(0, 3, device=device)
    return x, y


def agree(ok: bool, device) -> bool:
    """True when ``ok`` holds on every rank."""
    bad = torch.tensor([0 if ok else 1], dtype=torch.int64, device=device)
    bad = net.simple_all_reduce(bad)
    return int(bad.item()) == 0


def main(argv=None) -> bool:
    args = parse_args(build_parser(), argv)
    rank, size = world()
    send_counts = [count(rank, d) for d in range(size)]
    x, y = _tensors([c for d in range(size) for c in rows_sent(rank, d)], args.device)
    x.requires_grad_(True)
    print(f"Device-{rank} sends {send_counts} rows to ranks 0..{size - 1}: {y.tolist()}", flush=True)
    net.barrier()

    (got_y, got_neg), recv_counts = net.batch_all_to_all_v([y, -y], send_counts)
    got_x = net.all_to_all_v(x, send_counts)
    want_x, want_y = _tensors([c for s in range(size) for c in rows_sent(s, rank)], args.device)
    print(f"Device-{rank} recvs {recv_counts.tolist()} rows from ranks 0..{size - 1}: {got_y.tolist()}", flush=True)
    ok = (torch.equal(got_y, want_y) and torch.equal(got_neg, -want_y) and torch.equal(got_x.detach(), want_x)
          and recv_counts.tolist() == [count(s, rank) for s in range(size)])
    got_x.sum().backward()  # the gradient goes back to each sent row exactly once
    ok = ok and x.grad is not None and torch.equal(x.grad, torch.ones_like(x))
    net.barrier()
    if not agree(ok, args.device):
        dist_print("[all_to_all_v] FAILED: a rank received rows (or gradients) other than the ones it expected")
        raise SystemExit(1)
    dist_print(f"[all_to_all_v] OK: {size} rank(s), counts (s + 2d + 1) mod 3 incl. zeros, 2 tensors and the gradient verified")
    return True


if __name__ == "__main__":
    run_main(main)
