"""Mixed precision: Tutel's helloworld under ``torch.autocast`` with fp32 master weights.

Usage: python -m dynamoe.examples.helloworld_amp --batch_size 4 --num_tokens 256 --model_dim 256 \
           --hidden_size 512 --num_local_experts 4 --num_steps 10 [--amp_dtype bfloat16]

Parameters and optimizer state stay fp32; the expert matmuls run in ``--amp_dtype`` (bfloat16 works
on CPU too). The gate always routes in fp32 (the layer disables autocast around routing), so
routing decisions do not depend on low-precision rounding. float16 adds a GradScaler. Both layouts
(--megablocks_size 0 padded, 1 ragged; unset lets the layer pick) run under autocast.
"""
from __future__ import annotations

import torch

from ._common import run_main, build_parser, make_data, parse_args, run_loop
from .helloworld import build_model, flops_fn, forward_switches, print_benchmark_line

AMP_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def main(argv=None) -> list[float]:
    # --dtype is the master-weight dtype in Tutel's helloworld; here it is fixed to float32.
    parser = build_parser(__doc__.splitlines()[0], omit=("dtype",), dtype="float32",
                          checkpoint_path="./dynamoe-helloworld_amp.ckpt")
    parser.add_argument("--amp_dtype", choices=list(AMP_DTYPES), default="bfloat16")
    args = parse_args(parser, argv)
    model = build_model(args, dtype=torch.float32)
    x, target = make_data(args, torch.float32)
    print_benchmark_line(args)
    print(f"[AMP] autocast({args.device.type}, dtype={args.amp_dtype}), master weights "
          f"{sorted({str(p.dtype) for p in model.parameters()})}")
    return run_loop(args, model, x, target, flops_fn(args), forward_switches(args),
                    autocast_dtype=AMP_DTYPES[args.amp_dtype])


if __name__ == "__main__":
    run_main(main)
