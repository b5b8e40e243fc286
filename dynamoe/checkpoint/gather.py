"""``python -m dynamoe.checkpoint.gather --inputs rank0.pt rank1.pt ... --output full.pt``: join the
per-rank checkpoints of an expert-parallel run (state dicts saved with torch.save, rank order as
given) into one that a single process, or ``scatter`` into any other world size, loads."""
from __future__ import annotations

import argparse
import os
import sys

import torch

from .atomic import save_atomic
from .reshard import gather


def _load(path: str) -> dict:
    obj = torch.load(path, map_location="cpu", weights_only=True)
    return obj.get("model", obj) if isinstance(obj, dict) and "model" in obj and isinstance(obj["model"], dict) else obj


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--inputs", nargs="+", required=True, help="per-rank state dict files, rank 0 first")
    p.add_argument("--output", required=True)
    args = p.parse_args(argv)
    missing = [f for f in args.inputs if not os.path.isfile(f)]
    if missing:
        p.error(f"argument --inputs: no such file(s): {missing}")
    try:
        full = gather([_load(f) for f in args.inputs])
    except ValueError as e:
        p.error(str(e))
    save_atomic(full, args.output)
    print(f"gathered {len(args.inputs)} rank checkpoints into {args.output}")


if __name__ == "__main__":
    main(sys.argv[1:])
