"""Run-time switching: every step runs the SAME layer with a different (top_k, capacity_factor, layout).

Usage: python -m dynamoe.examples.helloworld_switch --batch_size 4 --num_tokens 256 --model_dim 256 \
           --hidden_size 512 --num_local_experts 4 --top 2 --num_steps 8

The switches are forward arguments, so changing them allocates nothing and moves no parameter:
the example records every parameter's storage pointer and asserts it never changes.

Under torchrun (`torchrun --nproc_per_node=2 -m dynamoe.examples.helloworld_switch ...`) the experts
are spread over the ranks; the schedule then runs the ragged entries padded (expert parallelism
exchanges equal padded blocks), unless --parallel_type adaptive:0 keeps every expert local. After
the schedule, one fixed batch is evaluated (no_grad, dropless, so no setting can change which tokens
are kept) under every combination of the parallel switches -- adaptive_r in (0, 1),
a2a_ffn_overlap_degree in (1, 2), use_2dh in (False, True; True only when LOCAL_SIZE or
LOCAL_WORLD_SIZE divides the world) -- with one loss line each. They compute the same function, so
the losses must agree (to float rounding: padded vs ragged expert matmuls); the example prints
``identical: True`` or ``identical: False`` and exits with status 1 on a mismatch.
"""
from __future__ import annotations

import itertools
import os

import torch
import torch.nn.functional as F

from ..moe.config import parse_parallel_type
from ..parallel import net
from ._common import (DTYPES, build_parser, dist_print, format_stats, global_experts, make_data, parse_args, run_loop,
                      run_main, sharded_count, world)
from .helloworld import build_model, flops_fn, print_benchmark_line

# how far "identical" losses may differ: the padded and ragged layouts round differently
_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


def make_schedule(args) -> list[tuple[int, float, str]]:
    """(top_k, capacity_factor, layout) settings visited in turn: Switch-style k=1, the configured
    k, dropless (0), capped dropless (-1) and a roomy capacity (2.0), on both layouts."""
    E = global_experts(args.num_local_experts, world()[1])
    ks = sorted({1, min(2, E), min(args.top, E)})  # (moe_layer would clamp a larger k to E)
    cfs = [args.capacity_factor, 0.0, -1.0, 2.0]
    schedule = []
    for i, cf in enumerate(cfs):
        for j, k in enumerate(ks):
            schedule.append((k, cf, ("padded", "ragged")[(i + j) % 2]))
    return schedule


def _use_2dh_choices(world_size: int) -> tuple[bool, ...]:
    """(False, True) when LOCAL_SIZE or LOCAL_WORLD_SIZE (ranks per node) divides the world, else (False,)."""
    raw = os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or ""
    n = int(raw) if raw.isdigit() else 0
    return (False, True) if n >= 1 and world_size % n == 0 else (False,)


def check_parallel_switches(args, model, x, target) -> bool:
    """Evaluate (x, target) under every (adaptive_r, a2a_ffn_overlap_degree, use_2dh) and print one
    loss line each (rank 0's loss); True when every setting gives the same loss on every rank."""
    n = sharded_count(args.num_local_experts)
    degrees = [0] + [d for d in range(1, n + 1) if n % d == 0]  # 0: data parallel; n: experts sharded
    settings = list(itertools.product(degrees, (1, 2), _use_2dh_choices(world()[1])))
    dist_print(f"\n[Switch-check] one fixed batch, no_grad, top_k = {args.top}, capacity_factor = 0 (dropless), "
               f"{len(settings)} settings:")
    model.eval()
    losses = []
    with torch.no_grad():
        for r, overlap, two in settings:
            out = model(x, top_k=args.top, capacity_factor=0.0, adaptive_r=r, a2a_ffn_overlap_degree=overlap, use_2dh=two)
            losses.append(float(F.nll_loss(out.float(), target)))
            dist_print(f"[Switch-check] adaptive_r = {r}, a2a_ffn_overlap_degree = {overlap}, use_2dh = {two}: "
                       f"loss = {losses[-1]:.6f}, layout = {model.routing_stats.layout}")
    model.train(not args.eval)
    worst = torch.tensor([max(abs(v - losses[0]) for v in losses)], dtype=torch.float64, device=x.device)
    worst = net.simple_all_reduce(worst, op=torch.distributed.ReduceOp.MAX)  # every rank agrees on the verdict
    identical = bool(worst.item() <= _TOLERANCE.get(DTYPES[args.dtype], 1e-2) * max(1.0, abs(losses[0])))
    dist_print(f"[Switch-check] identical: {identical} (largest difference {worst.item():.3e} over {world()[1]} rank(s))")
    return identical


def main(argv=None) -> list[float]:
    parser = build_parser(__doc__.splitlines()[0], omit=("megablocks_size",), num_steps=8,
                          checkpoint_path="./dynamoe-helloworld_switch.ckpt")
    args = parse_args(parser, argv)
    model = build_model(args)
    x, target = make_data(args, DTYPES[args.dtype])
    print_benchmark_line(args)
    schedule = make_schedule(args)
    pointers = {name: p.data_ptr() for name, p in model.named_parameters()}
    r = parse_parallel_type(args.parallel_type, sharded_count(args.num_local_experts))
    distributed = world()[1] > 1
    padded_only = distributed and r != 0  # expert parallelism exchanges equal padded blocks

    def switches(i: int) -> dict:
        k, cf, layout = schedule[i % len(schedule)]
        if padded_only:
            layout = "padded"
        return dict(top_k=k, capacity_factor=cf, layout=layout, adaptive_r=r,
                    a2a_ffn_overlap_degree=args.a2a_ffn_overlap_degree)

    def after_step(i, kw, stats) -> None:
        moved = [n for n, p in model.named_parameters() if p.data_ptr() != pointers[n]]
        dist_print(f"    switch: {format_stats(stats)}, parameters moved = {len(moved)}")
        assert (stats.top_k, stats.capacity_factor, stats.layout) == (kw["top_k"], kw["capacity_factor"], kw["layout"])
        assert not moved, f"switching moved parameter storage: {moved}"

    losses = run_loop(args, model, x, target, flops_fn(args), switches, after_step=after_step)
    dist_print(f"[Check] {len(pointers)} parameter storages unchanged across {min(args.num_steps, len(schedule))} settings.")
    if distributed and not check_parallel_switches(args, model, x, target):
        raise SystemExit(1)
    return losses


if __name__ == "__main__":
    run_main(main)
