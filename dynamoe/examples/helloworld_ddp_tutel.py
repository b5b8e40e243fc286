"""Tutel's helloworld_ddp_tutel on dynamoe: helloworld trained with the ZeRO-1 ``ZeroOptimizer`` (AdamW).

Usage: torchrun --nproc_per_node=2 -m dynamoe.examples.helloworld_ddp_tutel --batch_size 4 --num_tokens 256 \
           --model_dim 256 --hidden_size 512 --num_local_experts 2 --num_steps 10 --lr 1e-3
       (also runs as one plain process: the optimizer is then AdamW with fp32 master weights)

``ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=--lr)`` plays the part of Tutel's
``TutelDistributedOptimizer``: the replicated parameters (the gate) keep an fp32 master copy whose
AdamW state is sharded over the ranks; each step reduce-scatters (averages) their gradients, updates
this rank's shard and all-gathers the new values. The expert parameters (tagged ``skip_allreduce``)
step locally. The optimizer averages, so the loop does no manual gradient averaging.
"""
from __future__ import annotations

import torch

from ..parallel import ZeroOptimizer
from ._common import DTYPES, build_parser, dist_print, make_data, parse_args, run_loop, run_main, world
from .helloworld import build_model, flops_fn, forward_switches, print_benchmark_line


def main(argv=None) -> list[float]:
    parser = build_parser(__doc__.splitlines()[0], checkpoint_path="./dynamoe-helloworld_ddp_tutel.ckpt")
    args = parse_args(parser, argv)
    model = build_model(args)
    dist_print(model)
    x, target = make_data(args, DTYPES[args.dtype])
    print_benchmark_line(args)
    dist_print(f"[Optimizer] ZeroOptimizer(AdamW, lr = {args.lr}) over {world()[1]} rank(s)")
    return run_loop(args, model, x, target, flops_fn(args), forward_switches(args),
                    make_optimizer=lambda params: ZeroOptimizer(params, torch.optim.AdamW, lr=args.lr),
                    average_gradients=False)


if __name__ == "__main__":
    run_main(main)
