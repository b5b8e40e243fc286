"""Run a function on N gloo ranks over loopback, bounded in time; failures in any rank fail the test."""
from __future__ import annotations

import os
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ports import free_port


def _entry(rank: int, world: int, port: int, fn, args, errors) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      DYNAMOE_COLLECTIVE_TIMEOUT_SEC=os.environ.get("DYNAMOE_COLLECTIVE_TIMEOUT_SEC", "60"))
    torch.set_num_threads(1)
    ok = False
    try:
        from dynamoe.parallel import net
        net.init_process_group("gloo")
        fn(rank, world, *args)
        dist.barrier()
        ok = True
    except BaseException:  # noqa: BLE001 -- report to the parent, whatever it was
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if ok:  # skip the interpreter's shutdown, which gloo's threads occasionally abort (see examples/_common.py)
        import sys
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def run_ranks(world: int, fn, *args, timeout: float = 120.0) -> None:
    """Spawn ``world`` processes running ``fn(rank, world, *args)`` after gloo init; raise on any error
    or when they do not finish within ``timeout`` seconds."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    procs = mp.start_processes(_entry, args=(world, free_port(), fn, args, errors), nprocs=world, join=False,
                               start_method="spawn")
    import time
    deadline = time.monotonic() + timeout
    try:
        while not procs.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world} ranks did not finish within {timeout:.0f} s")
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:  # raised in a rank, or exited non-zero
        msgs = []
        while not errors.empty():
            msgs.append(errors.get())
        raise AssertionError("\n".join(msgs) or str(exc)) from None
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.kill()
