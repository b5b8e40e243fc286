"""Run-time switching: every step runs the SAME layer with a different (top_k, capacity_factor, layout).

Usage: python -m dynamoe.examples.helloworld_switch --batch_size 4 --num_tokens 256 --model_dim 256 \
           --hidden_size 512 --num_local_experts 4 --top 2 --num_steps 8

The switches are forward arguments, so changing them allocates nothing and moves no parameter:
the example records every parameter's storage pointer and asserts it never changes.
"""
from __future__ import annotations

from ..moe.config import parse_parallel_type
from ._common import DTYPES, build_parser, format_stats, make_data, parse_args, run_loop
from .helloworld import build_model, flops_fn, print_benchmark_line


def make_schedule(args) -> list[tuple[int, float, str]]:
    """(top_k, capacity_factor, layout) settings visited in turn: Switch-style k=1, the configured
    k, dropless (0), capped dropless (-1) and a roomy capacity (2.0), on both layouts."""
    ks = sorted({1, min(2, args.num_local_experts), args.top})
    cfs = [args.capacity_factor, 0.0, -1.0, 2.0]
    schedule = []
    for i, cf in enumerate(cfs):
        for j, k in enumerate(ks):
            schedule.append((k, cf, ("padded", "ragged")[(i + j) % 2]))
    return schedule


def main(argv=None) -> list[float]:
    parser = build_parser(__doc__.splitlines()[0], omit=("megablocks_size",), num_steps=8,
                          checkpoint_path="./dynamoe-helloworld_switch.ckpt")
    args = parse_args(parser, argv)
    model = build_model(args)
    x, target = make_data(args, DTYPES[args.dtype])
    print_benchmark_line(args)
    schedule = make_schedule(args)
    pointers = {name: p.data_ptr() for name, p in model.named_parameters()}
    r = parse_parallel_type(args.parallel_type)

    def switches(i: int) -> dict:
        k, cf, layout = schedule[i % len(schedule)]
        return dict(top_k=k, capacity_factor=cf, layout=layout, adaptive_r=r,
                    a2a_ffn_overlap_degree=args.a2a_ffn_overlap_degree)

    def after_step(i, kw, stats) -> None:
        moved = [n for n, p in model.named_parameters() if p.data_ptr() != pointers[n]]
        print(f"    switch: {format_stats(stats)}, parameters moved = {len(moved)}")
        assert (stats.top_k, stats.capacity_factor, stats.layout) == (kw["top_k"], kw["capacity_factor"], kw["layout"])
        assert not moved, f"switching moved parameter storage: {moved}"

    losses = run_loop(args, model, x, target, flops_fn(args), switches, after_step=after_step)
    print(f"[Check] {len(pointers)} parameter storages unchanged across {min(args.num_steps, len(schedule))} settings.")
    return losses


if __name__ == "__main__":
    main()
