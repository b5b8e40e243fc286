"""Tutel's helloworld_ddp on dynamoe: helloworld's model wrapped in DistributedDataParallel.

Usage: torchrun --nproc_per_node=2 -m dynamoe.examples.helloworld_ddp --batch_size 4 --num_tokens 256 \
           --model_dim 256 --hidden_size 512 --num_local_experts 2 --num_steps 10
       python -m dynamoe.examples.helloworld_ddp ...   (one process: a 1-rank gloo group of its own)

``dynamoe.parallel.data_parallel`` is DDP told to leave the expert parameters out of its all-reduce:
their gradients already hold every rank's contribution (the all-to-all's backward sums them), while
the gate is replicated and DDP averages its gradients -- what helloworld does by hand, so both print
the same losses. DDP needs a process group even on one process: when not launched by torchrun, the
example initialises a 1-rank gloo group on 127.0.0.1 (a free port) and destroys it at the end.
"""
from __future__ import annotations

import inspect
import socket

import torch.distributed as dist
from torch import nn

from ..parallel import data_parallel, net
from ._common import DTYPES, build_parser, dist_print, make_data, parse_args, run_loop, run_main
from .helloworld import build_model, flops_fn, forward_switches, print_benchmark_line


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _no_forward_buffer_sync() -> dict:
    """DDP kwargs that stop the per-forward broadcast of rank 0's buffers: the layer's buffers are
    routing counters of this rank, not replicated state (newer torch spells it forward_sync_buffers)."""
    params = inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}


def init_single_process_group() -> bool:
    """Join a 1-rank gloo group on 127.0.0.1 unless a process group exists; True if it made one."""
    if net.is_initialized():
        return False
    net.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    return True


def main(argv=None) -> list[float]:
    parser = build_parser(__doc__.splitlines()[0], checkpoint_path="./dynamoe-helloworld_ddp.ckpt")
    args = parse_args(parser, argv)  # under torchrun this joins the group (gloo on CPU, NCCL on CUDA)
    own_group = init_single_process_group()
    try:
        model = build_model(args)
        ddp_kwargs = _no_forward_buffer_sync()
        if args.device.type == "cuda":
            ddp_kwargs["device_ids"] = [args.device.index if args.device.index is not None else 0]
        model = data_parallel(model, **ddp_kwargs)
        dist_print(model)
        x, target = make_data(args, DTYPES[args.dtype])
        print_benchmark_line(args)
        # DDP averages the replicated parameters' gradients during backward: no manual averaging
        return run_loop(args, model, x, target, flops_fn(args), forward_switches(args), average_gradients=False)
    finally:
        if own_group:
            dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
