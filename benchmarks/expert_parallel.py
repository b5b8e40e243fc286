"""Expert parallelism on gloo over loopback: 1 rank vs N ranks for config A, and our all-to-all vs a
raw ``all_to_all_single`` of the same bytes.

    python benchmarks/expert_parallel.py [--ranks 2] [--rounds 7]

Config A: 4096 tokens (the global batch, split over the ranks), D 1024, F 1024, 8 experts (split over
the ranks), top-2, dropless, fp32, forward+backward. Each rank runs with cores / ranks threads. The
all-to-all share is the time of the layer's two exchanges (dispatch + combine of the [E, C, D]
buffer, timed separately on a buffer of that shape, the way the layer exchanges it) over the step
time.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from dynamoe.moe import ExpertConfig, GateConfig, MoEConfig, MoELayer  # noqa: E402
from dynamoe.parallel import AllToAllExchange, net  # noqa: E402

T, D, F, E, K = 4096, 1024, 1024, 8, 2


def timed(fn, rounds: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(rounds):
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def layer_step(world: int, rounds: int):
    group = dist.group.WORLD if world > 1 else None
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(model_dim=D, gates=[GateConfig(k=K, capacity_factor=0.0)], aux_loss="none",
                               experts=ExpertConfig(num_experts_per_device=E // world, hidden_size_per_expert=F)),
                     group=group)
    x = torch.randn(T // world, D, generator=torch.Generator().manual_seed(net.get_world_rank()))

    def step():
        xx = x.detach().requires_grad_()
        y = layer(xx, layout="padded")
        y.backward(torch.ones_like(y))

    t_step = timed(step, rounds)
    C = layer(x, layout="padded").routing_stats.capacity
    return t_step, C


def exchange_times(C: int, rounds: int):
    buf = torch.randn(E, C, D)
    ex = AllToAllExchange(dist.group.WORLD)
    # what the layer does on CPU: blocks out as they are, the experts read the received blocks in place
    t_layer = timed(lambda: ex.exchange_blocks(ex.exchange_blocks(buf)), rounds)
    t_ours = timed(lambda: net.all_to_all(net.all_to_all(buf, 1, 0), 0, 1), rounds)
    flat = buf.reshape(-1).contiguous()
    out = torch.empty_like(flat)

    def raw():
        dist.all_to_all_single(out, flat)
        dist.all_to_all_single(flat, out)

    t_raw = timed(raw, rounds)
    t_prim = timed(lambda: net.all_to_all_single(net.all_to_all_single(flat)), rounds)
    return t_layer, t_ours, t_raw, t_prim, buf.numel() * buf.element_size()


def worker(rank: int, world: int, port: int, rounds: int, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    net.init_process_group("gloo")
    t_step, C = layer_step(world, rounds)
    t_layer, t_ours, t_raw, t_prim, nbytes = exchange_times(C, rounds)
    if rank == 0:
        results.put((t_step, C, t_layer, t_ours, t_raw, t_prim, nbytes))
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)
    if args.ranks < 2 or E % args.ranks:
        p.error(f"--ranks must be >= 2 and divide the {E} experts")
    t1, C1 = layer_step(1, args.rounds)
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(worker, args=(args.ranks, port, args.rounds, results), nprocs=args.ranks, start_method="spawn")
    tN, CN, t_layer, t_ours, t_raw, t_prim, nbytes = results.get()
    print(f"# torch {torch.__version__}, gloo on loopback, {os.cpu_count()} cpus; config A (T{T} D{D} F{F} E{E} k{K}), fp32, fwd+bwd")
    print(f"{'ranks':>5} {'step ms':>9} {'capacity':>9} {'a2a ms (2 exchanges)':>21} {'a2a share':>9}")
    print(f"{1:>5} {t1 * 1e3:9.1f} {C1:>9} {'-':>21} {'-':>9}")
    # forward+backward runs 4 exchanges of the buffer (dispatch, combine, and their gradients)
    print(f"{args.ranks:>5} {tN * 1e3:9.1f} {CN:>9} {t_layer * 1e3:21.1f} {2 * t_layer / tN:9.1%}")
    gbs = lambda t: nbytes * 2 / t / 1e9  # noqa: E731 -- two exchanges of the buffer
    print(f"exchanges of the {nbytes / 1e6:.1f} MB [E, C, D] buffer, there and back:")
    print(f"  raw all_to_all_single into preallocated buffers  {gbs(t_raw):6.2f} GB/s  1.00")
    print(f"  dynamoe.net.all_to_all_single (autograd)         {gbs(t_prim):6.2f} GB/s  {t_raw / t_prim:.2f}")
    print(f"  the layer's exchange (experts read it in place)  {gbs(t_layer):6.2f} GB/s  {t_raw / t_layer:.2f}")
    print(f"  dynamoe.net.all_to_all [E,C,D] <-> [L,W*C,D]     {gbs(t_ours):6.2f} GB/s  {t_raw / t_ours:.2f}"
          "  (Tutel's layout: with the re-layout copies)")


if __name__ == "__main__":
    main()
