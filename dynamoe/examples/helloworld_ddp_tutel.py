"""Tutel's helloworld_ddp_tutel on dynamoe: helloworld trained with a ZeRO-style optimizer.

Usage: torchrun --nproc_per_node=2 -m dynamoe.examples.helloworld_ddp_tutel --batch_size 4 --num_tokens 256 \
           --model_dim 256 --hidden_size 512 --num_local_experts 2 --num_steps 10 [--optimizer zero_adamw --lr 1e-3]
       (also runs as one plain process)

``--optimizer tutel`` (default, Tutel's script): ``net.TutelDistributedOptimizer(params,
average_shared=True).warp_local(torch.optim.SGD, lr=--lr)`` -- the replicated parameters (the gate) are
split into 1/world flat shards, each rank steps its shard on the averaged (reduce-scattered)
gradients and all-gathers the result; the expert parameters step locally. Same flags, same losses as
Tutel's helloworld_ddp_tutel. ``--optimizer zero_adamw``: dynamoe's ``ZeroOptimizer`` with AdamW and
fp32 master weights of the replicated parameters, its AdamW state sharded over the ranks. Both
optimizers average, so the loop does no manual gradient averaging.
"""
from __future__ import annotations

import torch

from .. import net
from ..parallel import ZeroOptimizer
from ._common import DTYPES, build_parser, dist_print, make_data, parse_args, run_loop, run_main, world
from .helloworld import build_model, flops_fn, forward_switches, print_benchmark_line


def main(argv=None) -> list[float]:
    parser = build_parser(__doc__.splitlines()[0], checkpoint_path="./dynamoe-helloworld_ddp_tutel.ckpt",
                          parallel_type="auto")  # Tutel's default for this script
    parser.add_argument("--optimizer", choices=["tutel", "zero_adamw"], default="tutel",
                        help="tutel: TutelDistributedOptimizer over SGD (Tutel's); zero_adamw: dynamoe's ZeroOptimizer over AdamW")
    args = parse_args(parser, argv)
    model = build_model(args)
    dist_print(model)
    x, target = make_data(args, DTYPES[args.dtype])
    print_benchmark_line(args)
    if args.optimizer == "tutel":
        dist_print(f"[Optimizer] TutelDistributedOptimizer(SGD, lr = {args.lr}, average_shared) over {world()[1]} rank(s)")

        def make_optimizer(params):
            return net.TutelDistributedOptimizer(params, average_shared=True).warp_local(torch.optim.SGD, lr=args.lr)
    else:
        dist_print(f"[Optimizer] ZeroOptimizer(AdamW, lr = {args.lr}) over {world()[1]} rank(s)")

        def make_optimizer(params):
            return ZeroOptimizer(params, torch.optim.AdamW, lr=args.lr)
    return run_loop(args, model, x, target, flops_fn(args), forward_switches(args), make_optimizer=make_optimizer,
                    average_gradients=False)


if __name__ == "__main__":
    run_main(main)
