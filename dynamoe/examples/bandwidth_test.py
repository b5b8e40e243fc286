"""Tutel's bandwidth_test on dynamoe: all-to-all bandwidth of ``dynamoe.net.all_to_all_single`` next to
raw ``torch.distributed.all_to_all_single``.

Usage: torchrun --nproc_per_node=2 -m dynamoe.examples.bandwidth_test --size_mb 256 [--iters 10] [--device cpu]
       torchrun --nproc_per_node=2 -m dynamoe.examples.bandwidth_test --size_mb 256 --loop 50   # Tutel's output

With ``--loop N`` it runs Tutel's test instead: N rounds over one --size_mb buffer, each printing the
AllToAll, AllReduce, AllGather and ReduceScatter bandwidth lines of Tutel's script (``net.simple_*``,
one call each, GB/s of the whole buffer; on one process too, where they are local copies).

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
    p.add_argument("--loop", type=_positive_int, default=None,
                   help="Tutel's test: this many rounds of all-to-all, all-reduce, all-gather and reduce-scatter lines")
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


def tutel_loop(args) -> list[dict]:
    """Tutel's bandwidth_test: ``args.loop`` rounds, each timing one simple_all_to_all, simple_all_reduce
    (in place), simple_all_gather and simple_reduce_scatter of a float32 buffer of --size_mb MB;
    returns the GB/s per round and collective."""
    rank, size = world()
    numel = ((args.size_mb + 3) // 4 * 1024 * 1024 + size - 1) // size * size  # Tutel's buffer length
    x = torch.randn(numel, device=args.device, dtype=torch.float32)

    def wait() -> float:
        _sync(args.device)
        return time.perf_counter()

    ops = [("AllToAll", lambda: net.simple_all_to_all(x.view(size, -1))),
           ("AllReduce", lambda: net.simple_all_reduce(x.view(-1), inplace=True)),
           ("AllGather", lambda: net.simple_all_gather(x.view(size, -1)[rank])),
           ("ReduceScatter", lambda: net.simple_reduce_scatter(x.view(size, -1)))]
    rounds = []
    with torch.no_grad():
        for _ in range(args.loop):
            speeds = {}
            for name, fn in ops:
                t0 = wait()
                fn()
                t1 = wait()
                speeds[name] = numel * 4 * 1e-9 / max(t1 - t0, 1e-9)
                dist_print(f"{name} bandwidth across {size} node(s) = {speeds[name]:.4f} GB/s")
            dist_print("")
            rounds.append(speeds)
    return rounds


def main(argv=None) -> list:
    """Returns rows (MB, dynamoe seconds, torch seconds) per size ([] on one process), or with
    ``--loop`` the GB/s of each round and collective."""
    args = parse_args(build_parser(), argv)
    if args.loop is not None:
        return tutel_loop(args)
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
