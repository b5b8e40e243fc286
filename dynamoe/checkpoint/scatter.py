"""``python -m dynamoe.checkpoint.scatter --input full.pt --world M --output 'ckpt-{rank}-of-{world}.pt'``:
split a gathered checkpoint for an expert-parallel run on M ranks."""
from __future__ import annotations

import argparse
import os
import sys

from .atomic import save_atomic
from .gather import _load
from .reshard import scatter


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--input", required=True)
    p.add_argument("--world", type=int, required=True, help="number of ranks to split for")
    p.add_argument("--output", required=True, help="path pattern with {rank} (and optionally {world})")
    args = p.parse_args(argv)
    if not os.path.isfile(args.input):
        p.error(f"argument --input: no such file: {args.input}")
    if "{rank}" not in args.output:
        p.error("argument --output: the pattern must contain {rank}")
    try:
        parts = scatter(_load(args.input), args.world)
    except ValueError as e:
        p.error(str(e))
    for r, part in enumerate(parts):
        save_atomic(part, args.output.format(rank=r, world=args.world))
    print(f"scattered {args.input} into {args.world} rank checkpoints")


if __name__ == "__main__":
    main(sys.argv[1:])
