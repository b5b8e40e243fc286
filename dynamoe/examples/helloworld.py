"""Tutel's helloworld on dynamoe: one ``moe_layer`` trained with SGD on a toy objective.

Usage: python -m dynamoe.examples.helloworld --batch_size 4 --num_tokens 256 --model_dim 256 \
           --hidden_size 512 --num_local_experts 4 --top 2 --num_steps 10 [--eval] [--capacity_factor 0] \
           [--expert_type ffn|llama_ffn|glu] [--checkpoint_path 'ckpt-{rank}-of-{size}.pt' | --save_load_checkpoint]

Tutel's flags, seeds ((1, rank + 1, 1) for the gate, experts and after) and data (x from
torch.manual_seed(0), the same batch on every rank): in fp32 it prints the per-step losses Tutel's
helloworld prints for the same flags.

The per-call switches (capacity_factor, a2a_ffn_overlap_degree, adaptive_r from --parallel_type,
megablocks_size) are passed to every forward, as Tutel's forward accepts them. Under
torchrun (e.g. `torchrun --nproc_per_node=2 -m dynamoe.examples.helloworld ...`) the experts are
spread over the ranks (expert parallelism over gloo on CPU, NCCL on CUDA) and the gate's gradients
are averaged, as in Tutel (not with --allreduce_degree -1); --local_rank is accepted for Tutel's command lines.
--checkpoint_path alone is Tutel's: the model's state dict is loaded from it when it exists and saved there
at the end (``{rank}``/``{size}`` name one file per rank; Tutel's own files load). --save_load_checkpoint
also keeps the optimizer and the step count, to resume.
"""
from __future__ import annotations

import torch.nn.functional as F

from ..moe import moe_layer
from ..moe.config import parse_parallel_type
from ._common import (run_main, DTYPES, ExampleModel, build_parser, dist_print, ffn_flops_per_row, make_data, moe_forward_flops,
                      layer_seeds, parse_args, print_param_counts, run_loop, sharded_count, world)


def _world_group():
    import torch.distributed as dist
    return dist.group.WORLD if world()[1] > 1 else None


def build_model(args, dtype=None) -> ExampleModel:
    """The MoE layer exactly as Tutel's helloworld builds it; ``dtype`` defaults to ``--dtype``."""
    experts = {"type": args.expert_type, "num_experts_per_device": args.num_local_experts,
               "hidden_size_per_expert": args.hidden_size}
    if args.expert_type != "glu":  # as Tutel's example (llama_ffn too); glu experts take glu_activation (silu)
        experts["activation_fn"] = lambda x: F.relu(x)
    moe = moe_layer(
        gate_type={"type": "top", "k": args.top, "fp32_gate": args.fp32_gate, "capacity_factor": args.capacity_factor},
        experts=experts,
        model_dim=args.model_dim,
        scan_expert_func=lambda name, param: setattr(param, "skip_allreduce", True),
        seeds=layer_seeds(args),  # Tutel's (1, rank + 1, 1)
        a2a_ffn_overlap_degree=args.a2a_ffn_overlap_degree,
        parallel_type=args.parallel_type,
        group=_world_group(),  # torchrun: experts spread over the ranks (expert parallelism)
        use_2dh=args.use_2dh,
        dtype=dtype or DTYPES[args.dtype],  # dynamoe extension: build in place, no global default dtype
        device=args.device,
    )
    print_param_counts(moe)
    return ExampleModel(moe)


def forward_switches(args) -> dict:
    """The per-call switches from the flags, passed to every forward."""
    return dict(capacity_factor=args.capacity_factor, a2a_ffn_overlap_degree=args.a2a_ffn_overlap_degree,
                adaptive_r=parse_parallel_type(args.parallel_type, sharded_count(args.num_local_experts)), megablocks_size=args.megablocks_size)


def flops_fn(args):
    per_row = ffn_flops_per_row(args.model_dim, args.hidden_size, args.expert_type)
    return lambda stats: moe_forward_flops(stats, args.model_dim, per_row)


def print_benchmark_line(args) -> None:
    dist_print(f"[Benchmark] world_size = {world()[1]}, dtype = {args.dtype}, model_dim = {args.model_dim}, hidden_size = {args.hidden_size}, "
          f"samples = {args.batch_size * args.num_tokens}, num_local_experts = {args.num_local_experts}, "
          f"topK = {args.top}, a2a_ffn_overlap_degree = {args.a2a_ffn_overlap_degree}, "
          f"parallel_type = `{args.parallel_type}`, device = `{args.device}`")


def main(argv=None) -> list[float]:
    args = parse_args(build_parser(__doc__.splitlines()[0]), argv)
    model = build_model(args)
    dist_print(model)
    x, target = make_data(args, DTYPES[args.dtype])
    print_benchmark_line(args)
    return run_loop(args, model, x, target, flops_fn(args), forward_switches(args))


if __name__ == "__main__":
    run_main(main)
