"""``dynamoe serve`` on several ranks (torchrun): an expert-parallel model, HTTP on rank 0 only.

Every rank joins the process group (NCCL on ``cuda:LOCAL_RANK``, else gloo on CPU), builds the control
channel of :mod:`dynamoe.engine.distributed`, loads its 1/W share of the routed experts (everything else
whole) and learns whether every rank loaded. Then rank 0 runs the engine over a
:class:`~dynamoe.engine.distributed.LeaderModel` under uvicorn, and sends STOP to the followers when
uvicorn returns (Ctrl-C, SIGTERM, a failed start, or the ranks falling out of step); the other ranks
bind no port and run :func:`~dynamoe.engine.distributed.follow` until STOP. They ignore SIGINT: a
terminal's Ctrl-C reaches every rank, and rank 0 decides when they stop. Once its process group is up,
a rank leaves with ``os._exit`` (gloo's threads can abort the interpreter's own shutdown; see
``dynamoe/examples/_common.py``), after ``destroy_process_group`` unless the ranks are out of step.
"""
from __future__ import annotations

import os
import signal
import sys

from .cli import announce, build_engine, freeze_startup_heap, server_config

__all__ = ["serve_ranks", "rank_device"]


def rank_device(flag: str | None, local_rank: int, local_size: int):
    """This rank's device: ``--device`` as given, except that ``cuda`` (the default when CUDA is there)
    means ``cuda:LOCAL_RANK``."""
    import torch

    device = torch.device(flag or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        n = torch.cuda.device_count()
        if local_rank >= n:
            raise ValueError(f"LOCAL_RANK={local_rank} needs cuda:{local_rank}, but this node has {n} CUDA device(s): "
                             f"start at most {n} ranks per node (LOCAL_SIZE={local_size}), or pass --device cpu")
        device = torch.device("cuda", local_rank)
    return device


def serve_ranks(args, path: str, api_key: str | None, ranks: tuple[int, int, int, int], err=None) -> int:
    """This rank's part of ``dynamoe serve`` (the flags already checked by serve_command); ``ranks`` =
    (rank, world size, local rank, local size). Returns the exit status only on errors before the
    process group is up; after that the process ends here (status 0 after a clean stop, else 1)."""
    err = err or sys.stderr
    rank, world, local_rank, local_size = ranks
    try:
        device = rank_device(args.device, local_rank, local_size)
    except (ValueError, RuntimeError) as e:
        print(f"dynamoe serve: error: rank {rank}: {e}", file=err)
        return 2

    import torch
    import torch.distributed as dist

    from ..engine.distributed import ControlChannel, RanksOutOfStep
    from ..parallel import net

    if device.type == "cuda":
        torch.cuda.set_device(device)
    net.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        channel = ControlChannel(dist.group.WORLD)
        loaded = _load(args, path, rank, device, err)
        if not channel.all_ok(loaded is not None):
            if loaded is not None:
                print(f"dynamoe serve: error: rank {rank}: another rank could not load the model", file=err)
            _leave(1, clean=True)
        model, tokenizer = loaded
        freeze_startup_heap()   # (every rank: a follower's collection would hold up the whole group's step)
        if rank == 0:
            code = _lead(args, path, api_key, model, tokenizer, channel, world, device, err)
        else:
            code = _follow(model, channel, rank, err)
    except RanksOutOfStep as e:
        print(f"dynamoe serve: error: rank {rank}: {e}", file=err)
        code = _OUT_OF_STEP
    except KeyboardInterrupt:
        code = 1
    except BaseException:   # noqa: BLE001 -- a bug: say where, and do not wait for the other ranks
        import traceback
        traceback.print_exc(file=err)
        code = _OUT_OF_STEP
    _leave(0 if code == 0 else 1, clean=code != _OUT_OF_STEP)


_OUT_OF_STEP = -1


def _load(args, path: str, rank: int, device, err):
    """(model, tokenizer) -- the tokenizer on rank 0 only -- or None after printing why not."""
    import torch.distributed as dist

    from ..engine import Tokenizer
    from ..models import load

    try:
        kwargs = {"dtype": args.dtype} if args.dtype is not None else {}
        model = load(path, device=device, progress=rank == 0, group=dist.group.WORLD, **kwargs)
        for _, block in model.moe_layers():  # every rank runs rank 0's forwards: split large batches
            block.replicated_tokens_()
        tokenizer = Tokenizer.from_dir(path, chat_template=args.chat_template) if rank == 0 else None
        return model, tokenizer
    except (ValueError, OSError) as e:
        print(f"dynamoe serve: error: rank {rank}: {e}", file=err)
        return None


def _lead(args, path, api_key, model, tokenizer, channel, world: int, device, err) -> int:
    import uvicorn

    from ..engine.distributed import LeaderModel
    from .app import create_app

    fatal: list = []
    server = None

    def on_fatal(e: BaseException) -> None:   # the engine thread: the ranks are out of step
        fatal.append(e)
        if server is not None:
            server.should_exit = True

    leader = LeaderModel(model, channel, on_fatal=on_fatal)
    try:
        try:
            engine, max_seq_len = build_engine(args, leader, tokenizer, err)
        except (ValueError, OSError) as e:
            print(f"dynamoe serve: error: {e}", file=err)
            return 1
        config = server_config(args, path, api_key, max_seq_len)
        app = create_app(engine, tokenizer, config)
        params = sum(p.numel() for p in model.parameters())
        announce(args, config, f"{params / 1e6:.1f}M parameters per rank, {device}, expert parallel over {world} ranks",
                 path, err)
        server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.listen_port, log_level=args.log_level,
                                               timeout_graceful_shutdown=5))
        try:
            server.run()
        except (KeyboardInterrupt, SystemExit):   # uvicorn exits on a failed start (port taken...)
            pass
        if fatal:
            print(f"dynamoe serve: error: {fatal[0]}", file=err)
            return _OUT_OF_STEP
        return 0 if server.started else 1
    finally:
        leader.stop_followers()


def _follow(model, channel, rank: int, err) -> int:
    from ..engine.distributed import RanksOutOfStep, follow

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        follow(model, channel)
        return 0
    except RanksOutOfStep as e:
        print(f"dynamoe serve: error: rank {rank}: {e}", file=err)
        return _OUT_OF_STEP


def _leave(code: int, clean: bool) -> None:
    """End this rank's process: ``destroy_process_group`` when the ranks are in step, then ``os._exit``."""
    import torch.distributed as dist

    if clean and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:   # noqa: BLE001 -- leaving anyway
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
