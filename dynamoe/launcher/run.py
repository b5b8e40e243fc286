"""Run a program as one rank of a torch.distributed job started by MPI (or plainly).

    mpiexec -host localhost -n 2 -x LOCAL_SIZE=2 python -m dynamoe.launcher.run -m dynamoe.examples.helloworld ...
    python -m dynamoe.launcher.run script.py args...          # one process: WORLD_SIZE=1

MPI tells each process its rank (OMPI_COMM_WORLD_*, PMI_*, MV2_COMM_WORLD_*, SLURM_*); this maps them to
what torch.distributed reads (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_SIZE, MASTER_ADDR, MASTER_PORT),
keeping anything already set (torchrun's variables win), and gives each rank its share of the
cores for OMP_NUM_THREADS (cores / ranks on this node, at least 1) unless the user set it. Then it
runs ``-m module`` or ``script.py`` in this process with the remaining arguments.
With torchrun none of this is needed: ``torchrun --nproc_per_node=N -m dynamoe.examples.helloworld``.
"""
from __future__ import annotations

import os
import runpy
import sys

__all__ = ["mpi_environment", "main"]

_RANK = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK", "SLURM_PROCID")
_SIZE = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "SLURM_NTASKS")
_LOCAL_RANK = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")
_LOCAL_SIZE = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "MV2_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")


def _first(env, names, default=None):
    for n in names:
        if env.get(n, "") != "":
            return env[n]
    return default


def _as_int(name: str, value) -> int:
    try:
        v = int(str(value).split("(")[0])
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if v < 0:
        raise ValueError(f"{name} must be >= 0, got {v}")
    return v


def mpi_environment(env: dict, cpu_count: int | None = None) -> dict:
    """The torch.distributed variables for this process (a new dict; ``env`` is not changed)."""
    out = dict(env)
    rank = _as_int("RANK", env.get("RANK") or _first(env, _RANK, 0))
    size = _as_int("WORLD_SIZE", env.get("WORLD_SIZE") or _first(env, _SIZE, 1))
    if size < 1 or rank >= size:
        raise ValueError(f"rank {rank} is not in a world of {size}")
    local_rank = _as_int("LOCAL_RANK", env.get("LOCAL_RANK") or _first(env, _LOCAL_RANK, rank))
    local_size = _as_int("LOCAL_SIZE", env.get("LOCAL_SIZE") or _first(env, _LOCAL_SIZE, size))
    if local_size < 1 or local_rank >= local_size:
        raise ValueError(f"local rank {local_rank} is not in a node of {local_size} ranks (set LOCAL_SIZE)")
    out.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(local_rank), LOCAL_SIZE=str(local_size))
    out.setdefault("MASTER_ADDR", "127.0.0.1")
    out.setdefault("MASTER_PORT", "29500")
    if not env.get("OMP_NUM_THREADS"):
        cores = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
        out["OMP_NUM_THREADS"] = str(max(1, cores // local_size))
    return out


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if argv else 2)
    try:
        os.environ.update(mpi_environment(dict(os.environ)))
    except ValueError as e:
        print(f"dynamoe.launcher.run: {e}", file=sys.stderr)
        raise SystemExit(2)
    if argv[0] == "-m":
        if len(argv) < 2:
            print("dynamoe.launcher.run: -m needs a module name", file=sys.stderr)
            raise SystemExit(2)
        sys.argv = [argv[1]] + argv[2:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        if not os.path.isfile(argv[0]):
            print(f"dynamoe.launcher.run: no such script: {argv[0]}", file=sys.stderr)
            raise SystemExit(2)
        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
