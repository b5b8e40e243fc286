"""Custom gate and custom experts plugged into ``moe_layer``, in Tutel's style.

Usage: python -m dynamoe.examples.helloworld_custom_gate_expert --batch_size 4 --num_tokens 256 \
           --model_dim 256 --num_local_experts 4 --top 2 --num_steps 10

A gate is any module returning logits [tokens, experts]; experts are any module with
``forward(x, ctx)`` where x is [local_experts, capacity, model_dim]. Dict keys the layer does not
know (``my_activ_type`` below, and ``top_k`` for the gate) reach the class constructor as options.
The experts have no ``forward_ragged``, so the layer always runs them on the padded layout.
"""
from __future__ import annotations

import torch
from torch import nn

from ..moe import moe_layer
from ..moe.config import parse_parallel_type
from ._common import (run_main, DTYPES, ExampleModel, build_parser, layer_seeds, make_data, moe_forward_flops, parse_args,
                      print_param_counts, run_loop)


class CustomGate(nn.Module):
    """Called as CustomGate(model_dim=..., num_global_experts=..., top_k=...)."""

    def __init__(self, model_dim: int, num_global_experts: int, top_k: int = 2):
        super().__init__()
        self.top_k = top_k  # informational: the layer routes with the dict's top_k
        self.my_wg = nn.Linear(model_dim, num_global_experts, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.my_wg(x)


class CustomExpert(nn.Module):
    """Called as CustomExpert(model_dim=..., num_experts_per_device=..., sharded_count=..., my_activ_type=...).
    One [D, D] matrix per local expert, then an optional activation."""

    def __init__(self, model_dim: int, num_experts_per_device: int, sharded_count: int = 1, my_activ_type: str = "relu"):
        super().__init__()
        if my_activ_type not in ("relu", "none"):
            raise ValueError(f"my_activ_type must be 'relu' or 'none', got {my_activ_type!r}")
        self.W = nn.Parameter(torch.empty(num_experts_per_device, model_dim, model_dim))
        self.my_activation = torch.relu if my_activ_type == "relu" else None
        with torch.no_grad():
            self.W.normal_(0, 0.001)

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        if ctx.sharded_count > 1:
            raise NotImplementedError("this expert does not support sharding one expert over devices (sharded_count > 1)")
        y = torch.matmul(x, self.W)  # [L, C, D] @ [L, D, D]
        return self.my_activation(y) if self.my_activation is not None else y


def main(argv=None) -> list[float]:
    parser = build_parser(__doc__.splitlines()[0], omit=("hidden_size", "expert_type", "megablocks_size", "fp32_gate"),
                          checkpoint_path="./dynamoe-helloworld_custom_gate_expert.ckpt")
    args = parse_args(parser, argv)
    moe = moe_layer(
        gate_type={"type": "custom", "module": CustomGate, "top_k": args.top},
        experts={"type": "custom", "module": CustomExpert, "num_experts_per_device": args.num_local_experts,
                 "my_activ_type": "relu"},
        model_dim=args.model_dim,
        scan_expert_func=lambda name, param: setattr(param, "skip_allreduce", True),
        seeds=layer_seeds(args),  # Tutel's (1, rank + 1, 1)
        a2a_ffn_overlap_degree=args.a2a_ffn_overlap_degree,
        parallel_type=args.parallel_type,
        use_2dh=args.use_2dh,  # no effect on one process
        dtype=DTYPES[args.dtype], device=args.device,  # the layer moves the user modules once they are built
    )
    print_param_counts(moe)
    model = ExampleModel(moe)
    print(model)
    x, target = make_data(args, DTYPES[args.dtype])
    print(f"[Benchmark] dtype = {args.dtype}, model_dim = {args.model_dim}, samples = {args.batch_size * args.num_tokens}, "
          f"num_local_experts = {args.num_local_experts}, topK = {args.top}, device = `{args.device}`")
    switches = dict(capacity_factor=args.capacity_factor, a2a_ffn_overlap_degree=args.a2a_ffn_overlap_degree,
                    adaptive_r=parse_parallel_type(args.parallel_type))
    per_row = 2 * args.model_dim * args.model_dim  # one [D, D] matmul per routed row
    return run_loop(args, model, x, target, lambda s: moe_forward_flops(s, args.model_dim, per_row), switches)


if __name__ == "__main__":
    run_main(main)
