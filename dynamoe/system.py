"""Tutel's ``system`` module: ``from dynamoe import system`` where Tutel scripts had ``from tutel import system``.

``init_data_model_parallel(group_count=1, backend='nccl')`` joins the process group from torchrun's (or
Open MPI's) environment -- one process when there is none -- and returns the groups of
:func:`dynamoe.parallel.net.create_groups_from_world` with ``is_cuda`` added: ``global_rank``,
``global_size``, ``model_group`` / ``model_rank`` / ``model_size``, ``data_group`` / ``data_rank`` /
``group_count``, ``global_group``, ``local_device``, ``is_distributed`` and ``dist_print``. On a machine
without CUDA the 'nccl' backend (Tutel's default) becomes gloo on the CPU, so Tutel's scripts run
unchanged there. The session is kept for :func:`get_local_session`; the process group is destroyed
at exit.
"""
from __future__ import annotations

import atexit
import logging
import os
import re
import sys
import time

import torch

from .parallel import net

__all__ = ["init_data_model_parallel", "get_local_session", "record_time", "apply_rank_size_from_pattern",
           "save", "load", "cache", "LocalCache", "init_affinity_at_program_beginning"]

_SESSION: dict = {}
_logger = logging.getLogger(__name__)


def init_data_model_parallel(group_count: int = 1, backend: str = "nccl") -> net.ParallelGroups:
    """Join the launcher's process group with ``backend`` ('nccl'; without CUDA: gloo) and split the
    world into ``group_count`` data-parallel groups of model-parallel ranks (Tutel's layout). Returns
    the session (see the module docstring); calling it again returns the same groups."""
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
    result = net.create_groups_from_world(group_count=group_count, include_init=backend)
    result.is_cuda = result.local_device is not None and result.local_device.type == "cuda"
    _logger.info("Registering device global rank %d: data_rank = %d, model_rank = %d",
                 result.global_rank, result.data_rank, result.model_rank)
    if "session" not in _SESSION:
        atexit.register(_on_quit)
    _SESSION["session"] = result
    return result


def _on_quit() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def get_local_session() -> net.ParallelGroups:
    """The session of the last :func:`init_data_model_parallel` call."""
    if "session" not in _SESSION:
        raise ValueError("no session: call dynamoe.system.init_data_model_parallel() first "
                         "(or time with system.record_time(is_cuda=False))")
    return _SESSION["session"]


def record_time(is_cuda: bool | None = None) -> float:
    """``time.time()`` after a CUDA synchronize when the session (or ``is_cuda``) is on CUDA."""
    is_cuda = get_local_session().is_cuda if is_cuda is None else is_cuda
    if is_cuda:
        torch.cuda.synchronize()
    return time.time()


def apply_rank_size_from_pattern(filename: str, rank: int, size: int, create_dir: bool = True) -> str:
    """``filename`` with ``{rank}`` and ``{size}`` replaced (Tutel's per-rank checkpoint names, e.g.
    ``ckpt-{rank}-of-{size}.pt``); its folder is created unless ``create_dir=False``. A pattern without
    ``{rank}`` is used as is, with a warning: every rank would then read and write the same file."""
    if not re.search(r"\{rank\}", filename):
        _logger.warning("Keyword `{rank}` is not found in file pattern: %s, which may cause collision in file access.", filename)
    filename = filename.replace("{size}", str(size)).replace("{rank}", str(rank))
    folder = os.path.dirname(filename)
    if create_dir and folder:
        os.makedirs(folder, exist_ok=True)
    return filename


def save(t: torch.Tensor, path: str) -> None:
    """Save a tensor as a NumPy ``.npy`` file."""
    import numpy as np
    np.save(path, t.detach().cpu().numpy())


def load(path: str, device=None) -> torch.Tensor:
    """Load a NumPy ``.npy`` file as a tensor."""
    import numpy as np
    return torch.tensor(np.load(path), device=device)


class LocalCache:
    """A process-wide key/value store (Tutel's ``system.cache()``)."""

    _CACHE: dict = {}

    @staticmethod
    def reset() -> None:
        LocalCache._CACHE = {}

    @staticmethod
    def set(key, val) -> None:
        LocalCache._CACHE[key] = val

    @staticmethod
    def get(key=None):
        """The value of ``key``; every value (a list) when ``key`` is absent or None."""
        if key not in LocalCache._CACHE:
            return list(LocalCache._CACHE.values())
        return LocalCache._CACHE[key]


def cache() -> type[LocalCache]:
    return LocalCache


def init_affinity_at_program_beginning() -> None:
    """Pin this process to the CPUs of one NUMA node, chosen by ``LOCAL_RANK // NUMA_TYPE`` (Tutel's
    ``NUMA_TYPE``, default 1; 0 or less: do nothing). Without NUMA information it does nothing."""
    numa_type = int(os.environ.get("NUMA_TYPE", "1"))
    root = "/sys/devices/system/node"
    if numa_type <= 0 or not os.path.isdir(root) or not hasattr(os, "sched_setaffinity"):
        return
    nodes = sorted(int(x[4:]) for x in os.listdir(root) if re.fullmatch(r"node[0-9]+", x))
    if not nodes:
        return
    node = nodes[(int(os.environ.get("LOCAL_RANK", "0")) // numa_type) % len(nodes)]
    cpus = sorted(int(x[3:]) for x in os.listdir(f"{root}/node{node}") if re.fullmatch(r"cpu[0-9]+", x))
    if cpus:
        os.sched_setaffinity(0, cpus)
