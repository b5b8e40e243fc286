"""Tutel's bandwidth_test on dynamoe: all-to-all bandwidth of ``dynamoe.net.all_to_all_single`` next to
raw ``torch.distributed.all_to_all_single``.

Usage: torchrun --nproc_per_node=2 -m dynamoe.examples.bandwidth_test --size_mb 256 [--iters 10] [--device cpu]

Every rank sends a float32 buffer of S MB (S = 1, 2, 4, ... doubling, then --size_mb itself), a
1/world block to each rank. Each size is exchanged once to warm up, then --iters times between
barriers; the time is the slowest rank's. Rank 0 prints one row per size: the buffer size in MB
(2**20 bytes), the milliseconds per exchange and the bandwidth in GB/s (10**9 bytes of the buffer
per second, Tutel's convention) for both. gloo on CPU, NCCL on CUDA. All-to-all needs at least two
ranks: on one process the example says so and exits with status 0.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from .. import net
from ._common import _positive_int, _sync, dist_print, parse_args, run_main, world

_MB = 1 << 20


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1, help="set by distributed launchers; ignored")
    p.add_argument("--size_mb", type=_positive_int, default=256, help="largest buffer per rank, in MB")
    p.add_argument("--iters", type=_positive_int, default=10, help="timed exchanges per size")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    return p


def sizes_mb(size_mb: int) -> list[int]:
    """1, 2, 4, ... below ``size_mb``, then ``size_mb``."""
    sizes, s = [], 1
    while s < size_mb:
        sizes.append(s)
        s *= 2
    return sizes + [size_mb]


def _time(fn, iters: int, device: torch.device) -> float:
    """Seconds per call of ``fn``: one warm-up call, then ``iters`` timed calls; the slowest rank's."""
    fn()
    _sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    elapsed = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def main(argv=None) -> list[tuple[int, float, float]]:
    """Returns rows (MB, dynamoe seconds, torch seconds) per size; [] on one process."""
    args = parse_args(build_parser(), argv)
    rank, size = world()
    if size < 2:
        print("bandwidth_test measures all-to-all between ranks and needs >= 2 ranks; launch it with "
              "`torchrun --nproc_per_node=N -m dynamoe.examples.bandwidth_test ...` (N >= 2). Nothing to measure.")
        return []
    dist_print(f"[Bandwidth] all-to-all across {size} ranks, backend = {dist.get_backend()}, device = `{args.device}`, "
               f"float32, {args.iters} timed exchange(s) per size")
    dist_print(f"{'MB':>8} {'dynamoe ms':>12} {'dynamoe GB/s':>14} {'torch ms':>12} {'torch GB/s':>12}")
    rows = []
    with torch.no_grad():
        for mb in sizes_mb(args.size_mb):
            numel = mb * _MB // 4 // size * size  # whole blocks of 1/world each
            x = torch.randn(numel, device=args.device)
            out = torch.empty_like(x)
            ours = _time(lambda: net.all_to_all_single(x), args.iters, args.device)
            raw = _time(lambda: dist.all_to_all_single(out, x), args.iters, args.device)
            nbytes = numel * 4
            dist_print(f"{mb:>8} {ours * 1e3:>12.3f} {nbytes * 1e-9 / ours:>14.3f} {raw * 1e3:>12.3f} {nbytes * 1e-9 / raw:>12.3f}")
            rows.append((mb, ours, raw))
    return rows


if __name__ == "__main__":
    run_main(main)
