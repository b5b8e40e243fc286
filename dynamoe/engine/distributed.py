"""Rank-synchronised generation for expert-parallel serving: rank 0 drives, the other ranks follow.

Under expert parallelism (``dynamoe.models.load(..., group=...)``) every MoE layer exchanges tokens with
every rank, so all ranks must run the same forwards in the same order. Rank 0 runs the usual
:class:`~dynamoe.engine.GenerationEngine` (scheduling, sampling, the HTTP server) over a
:class:`LeaderModel`; every other rank runs :func:`follow`, which repeats rank 0's forwards on its own
copy of the model and KV cache and throws the logits away (they equal rank 0's).

Protocol, on a gloo group of its own (:class:`ControlChannel`; CPU tensors, a timeout of years, since a
follower waits for the next request as long as the server idles):

* header, int64[8] broadcast by rank 0: ``[op, B, T, logits_to_keep, with_cache, a, b, c]``;
* ``NEW_CACHE`` (B = block_size, T = num_blocks, a = num_slots, b = max_seq_len, c = dtype code): followers
  make the same paged KV cache. They keep only the latest (the engine has one); rank 0 refuses a forward
  with any other cache.
* ``FORWARD`` (a = N block ids with a cache): then int64[B*T (+ 4B + N with a cache)] broadcast: input_ids
  [B, T], slots [B], the cache lengths of those slots before the step [B], their prompt lengths (0: not
  declared) [B], how many blocks each slot's table holds for the step [B] and those block ids, slot after slot
  [N]. Followers set their cache's tables, lengths and prompt lengths for those slots (:meth:`KVCache.set_blocks`)
  and run ``model(input_ids, cache, slots,
  logits_to_keep)``. Sending the tables with every step keeps the caches in step without mirroring
  anything else: a forward reads only its own slots' blocks and writes their positions from the length
  on, so a slot freed, preempted, truncated, reused or started on shared prefix blocks on rank 0 needs no
  message of its own.
* ``STOP``: followers return (rank 0 is shutting down).
* status, after every ``FORWARD``: each rank joins an all-reduce (sum) of its failure flag.

  - No rank failed: the usual case.
  - Every rank failed: a deterministic error (same inputs and code everywhere, so the same exception
    at the same point and the MoE collectives stayed paired). Rank 0 re-raises it (the engine ends the
    requests of that forward with an error), followers log it, and everyone goes on.
  - Some failed: the ranks are out of step (say, out of memory on one device). A rank that failed alone
    can leave the others inside an all-to-all of that forward that will never complete, so a failed
    rank waits at most ``fail_timeout_s`` for the status. Then each rank raises
    :class:`RanksOutOfStep`, which ends the job: rank 0's server exits non-zero, torchrun stops the rest,
    and a rank whose peer has died gets a connection error from gloo at once.

Checks that can fail on rank 0 alone (input shapes, which cache, the slots' room in it) run before
anything is sent, so such an error reaches only the engine.
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import threading
import weakref
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["ControlChannel", "LeaderModel", "follow", "RanksOutOfStep", "FORWARD", "NEW_CACHE", "STOP"]

log = logging.getLogger(__name__)

FORWARD, NEW_CACHE, STOP = 1, 2, 3
_HEADER = 8
_CACHE_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)   # dtype code = index
# followers wait for the next request as long as the server idles: no practical timeout
_IDLE_TIMEOUT = datetime.timedelta(days=3650)


class RanksOutOfStep(RuntimeError):
    """The ranks can no longer run forwards together (see the module docstring): the job must end."""


class ControlChannel:
    """The messages from rank 0 of ``group`` (default: the world) to the other ranks, on a gloo group
    of their own. Building it is collective: every rank of the world constructs it, in the same order
    as its other groups. ``fail_timeout_s``: how long a rank whose forward failed waits for the others'
    status before it declares the ranks out of step."""

    def __init__(self, group=None, fail_timeout_s: float = 60.0):
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("ControlChannel needs torch.distributed initialised (init_process_group)")
        if not fail_timeout_s > 0:
            raise ValueError(f"fail_timeout_s must be > 0, got {fail_timeout_s!r}")
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        self.group = dist.new_group(ranks, timeout=_IDLE_TIMEOUT, backend="gloo")
        self.leader = ranks[0]                     # global rank of the group's rank 0
        self.world_size = len(ranks)
        self.rank = ranks.index(dist.get_rank()) if dist.get_rank() in ranks else -1
        self.fail_timeout = datetime.timedelta(seconds=fail_timeout_s)

    # --- rank 0 -----------------------------------------------------------------------------------
    def send(self, header: list[int], payload: Tensor | None = None) -> None:
        h = torch.tensor(header + [0] * (_HEADER - len(header)), dtype=torch.int64)
        try:
            dist.broadcast(h, self.leader, group=self.group)
            if payload is not None:
                dist.broadcast(payload.to(device="cpu", dtype=torch.int64).contiguous(), self.leader, group=self.group)
        except RuntimeError as err:
            raise RanksOutOfStep(f"lost the other ranks while sending to them: {err}") from err

    # --- followers ----------------------------------------------------------------------------------
    def recv_header(self) -> list[int]:
        h = torch.empty(_HEADER, dtype=torch.int64)
        self._recv(h)
        return h.tolist()

    def recv_payload(self, n: int) -> Tensor:
        t = torch.empty(n, dtype=torch.int64)
        self._recv(t)
        return t

    def _recv(self, t: Tensor) -> None:
        try:
            dist.broadcast(t, self.leader, group=self.group)
        except RuntimeError as err:
            raise RanksOutOfStep(f"lost rank 0 while waiting for its next message: {err}") from err

    # --- everyone -----------------------------------------------------------------------------------
    def all_ok(self, ok: bool) -> bool:
        """Whether ``ok`` holds on every rank (collective; waits as long as the slowest rank, e.g. while
        it loads its weights)."""
        t = torch.tensor([int(bool(ok))], dtype=torch.int64)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        except RuntimeError as err:
            raise RanksOutOfStep(f"rank {self.rank}: lost another rank: {err}") from err
        return bool(t)

    def failures(self, failed: bool) -> int:
        """How many ranks' forwards failed (this one's ``failed`` included). A failed rank waits at most
        ``fail_timeout_s``: longer means another rank is stuck in a collective of that forward."""
        t = torch.tensor([int(failed)], dtype=torch.int64)
        try:
            work = dist.all_reduce(t, group=self.group, async_op=True)
            if failed:
                work.wait(timeout=self.fail_timeout)
            else:
                work.wait()
        except RuntimeError as err:
            raise RanksOutOfStep(f"rank {self.rank}: the ranks are out of step: not every rank reported on "
                                 f"the last forward ({err})") from err
        return int(t)


def _on_device(device: torch.device):
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _check_out_of_step(n_failed: int, world: int, rank: int, err: BaseException | None) -> None:
    if 0 < n_failed < world:
        what = f"failed here ({type(err).__name__}: {err})" if err is not None else "succeeded here"
        raise RanksOutOfStep(f"a forward failed on {n_failed} of {world} ranks and {what} (rank {rank}): the "
                             f"ranks are out of step and cannot go on together")


class LeaderModel(nn.Module):
    """Rank 0's view of an expert-parallel model: ``forward`` first tells the followers what to run
    (see the module docstring), then runs it; ``new_cache`` makes the followers make the same cache.
    Honours the engine's model contract (``config``, ``new_cache``, ``forward(input_ids, cache, slots,
    logits_to_keep)``, ``moe_stats``). ``on_fatal(err)``: called once, on the stepping thread, when the
    ranks are out of step (every later forward raises :class:`RanksOutOfStep` too)."""

    def __init__(self, model: nn.Module, channel: ControlChannel, on_fatal: Callable[[BaseException], None] | None = None):
        super().__init__()
        if channel.rank != 0:
            raise ValueError(f"LeaderModel runs on rank 0 of the channel's group; this is rank {channel.rank}")
        self.model = model
        self.config = getattr(model, "config", None)
        self.channel = channel
        self.on_fatal = on_fatal
        self.broken: RanksOutOfStep | None = None
        self._lock = threading.Lock()    # one message sequence at a time (engine thread vs stop())
        self._cache = None               # weakref to the cache the followers mirror
        self._stopped = False

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def moe_layers(self):
        return self.model.moe_layers()

    def moe_stats(self):
        return self.model.moe_stats()

    def positions_independent_of_prompt(self, prompt_tokens: int) -> int | None:
        """The model's (the engine's prefix cache asks: :mod:`dynamoe.engine.prefix`)."""
        own = getattr(self.model, "positions_independent_of_prompt", None)
        return None if own is None else own(prompt_tokens)

    def new_cache(self, num_slots: int, max_seq_len: int, dtype: torch.dtype | None = None, device=None, **paging):
        """A KV cache here and the same one on every follower (each on its own device); ``paging``:
        ``block_size``, ``num_blocks``."""
        if dtype not in _CACHE_DTYPES:
            raise ValueError(f"cache dtype must be one of {list(_CACHE_DTYPES)}, got {dtype!r}")
        cache = self.model.new_cache(num_slots, max_seq_len, dtype=dtype, device=device, **paging)
        with self._lock:
            self._check_usable()
            self._send([NEW_CACHE, cache.block_size, cache.num_blocks, 0, 0, num_slots, max_seq_len,
                        _CACHE_DTYPES.index(dtype)])
            self._cache = weakref.ref(cache)
        return cache

    def forward(self, input_ids: Tensor, cache=None, slots: Tensor | None = None, logits_to_keep: int = 0) -> Tensor:
        if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (torch.long, torch.int32):
            got = f"{input_ids.dtype} {tuple(input_ids.shape)}" if isinstance(input_ids, Tensor) else type(input_ids).__name__
            raise ValueError(f"input_ids must be an int64 (or int32) tensor [batch, tokens], got {got}")
        if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int) or logits_to_keep < 0:
            raise ValueError(f"logits_to_keep must be an int >= 0 (0 = every position), got {logits_to_keep!r}")
        B, T = input_ids.shape
        ids = input_ids.reshape(-1).to("cpu", torch.int64)
        if cache is None:
            if slots is not None:
                raise ValueError("slots are only meaningful with a cache")
            payload = ids
        else:
            if self._cache is None or self._cache() is not cache:
                raise ValueError("cache must be the one made last by this model's new_cache (the other ranks "
                                 "mirror only that one)")
            if slots is None:
                slots = torch.arange(B)
            elif not isinstance(slots, Tensor):
                slots = torch.tensor(slots, dtype=torch.long)
            if slots.dim() != 1 or slots.numel() != B:
                raise ValueError(f"slots must be a LongTensor [{B}] (one per row), got shape {tuple(slots.shape)}")
            starts = cache.check_room(slots.to(cache.lengths.device), T)   # (takes the step's blocks)
            tables = [cache.blocks(int(x)) for x in slots.tolist()]
            prompts = cache.prompt_lengths[slots.to(cache.prompt_lengths.device)]
            payload = torch.cat([ids, slots.to("cpu", torch.int64), starts.to("cpu", torch.int64),
                                 prompts.to("cpu", torch.int64), torch.tensor([len(t) for t in tables], dtype=torch.int64),
                                 torch.tensor([b for t in tables for b in t], dtype=torch.int64)])
        kw = {"logits_to_keep": logits_to_keep} if logits_to_keep else {}
        with self._lock:
            self._check_usable()
            self._send([FORWARD, B, T, logits_to_keep, int(cache is not None), payload.numel() - B * T - 4 * B
                        if cache is not None else 0], payload)
            err = out = None
            try:
                # the engine steps on its own thread, whose current CUDA device is not the main thread's
                with _on_device(input_ids.device):
                    out = self.model(input_ids, cache=cache, slots=slots, **kw) if cache is not None else \
                        self.model(input_ids, **kw)
            except Exception as e:   # noqa: BLE001 -- every rank reports, then the status decides
                err = e
            try:
                _check_out_of_step(self.channel.failures(err is not None), self.channel.world_size, 0, err)
            except RanksOutOfStep as fatal:
                self._fail(fatal)
                raise fatal from err
        if err is not None:
            raise err
        return out

    def stop_followers(self) -> None:
        """Send STOP: the followers' :func:`follow` returns. Idempotent; a no-op once out of step (the
        followers may be stuck; the job is ending anyway)."""
        if not self._lock.acquire(timeout=60):   # a forward still holds it: the ranks are stuck
            log.warning("could not stop the other ranks: a forward is still running after 60 s")
            return
        try:
            if self._stopped or self.broken is not None:
                return
            self._stopped = True
            self.channel.send([STOP])
        except RanksOutOfStep as err:
            log.warning("could not stop the other ranks: %s", err)
        finally:
            self._lock.release()

    # --- internals --------------------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self.broken is not None:
            raise RanksOutOfStep(str(self.broken))
        if self._stopped:
            raise RuntimeError("the other ranks were stopped (stop_followers): no more forwards")

    def _send(self, header: list[int], payload: Tensor | None = None) -> None:
        try:
            self.channel.send(header, payload)
        except RanksOutOfStep as fatal:
            self._fail(fatal)
            raise

    def _fail(self, fatal: RanksOutOfStep) -> None:
        first = self.broken is None
        self.broken = fatal
        if first:
            log.error("%s", fatal)
            if self.on_fatal is not None:
                self.on_fatal(fatal)


def follow(model: nn.Module, channel: ControlChannel) -> None:
    """Run rank 0's forwards on ``model`` (this rank's share of an expert-parallel model) until rank 0
    sends STOP; see the module docstring. Raises :class:`RanksOutOfStep` when the ranks fall out of step
    or rank 0 is gone."""
    if channel.rank <= 0:
        raise ValueError(f"follow runs on the ranks after the first; this is rank {channel.rank} of the channel")
    cache = None
    device = getattr(model, "device", None)
    while True:
        op, B, T, keep, with_cache, a, b, c = channel.recv_header()
        if op == STOP:
            return
        if op == NEW_CACHE:
            cache = None   # free the old one first
            cache = model.new_cache(a, b, dtype=_CACHE_DTYPES[c], block_size=B, num_blocks=T)
            continue
        if op != FORWARD:
            raise RanksOutOfStep(f"rank {channel.rank}: unknown message op {op} from rank 0")
        payload = channel.recv_payload(B * T + (4 * B + a if with_cache else 0))
        ids = payload[:B * T].view(B, T).to(device)
        kw = {"logits_to_keep": keep} if keep else {}
        err = None
        try:
            with torch.inference_mode():
                if with_cache:
                    if cache is None:
                        raise RuntimeError("rank 0 sent a forward with a cache before any NEW_CACHE")
                    slots, starts, prompts, counts = payload[B * T:].split(B)[:4]
                    blocks = payload[B * T + 4 * B:].tolist()
                    at = 0
                    for slot, start, p, n in zip(slots.tolist(), starts.tolist(), prompts.tolist(), counts.tolist()):
                        cache.set_blocks(slot, blocks[at:at + n], start, p)
                        at += n
                    model(ids, cache=cache, slots=slots.to(cache.lengths.device), **kw)
                else:
                    model(ids, **kw)
        except Exception as e:   # noqa: BLE001 -- reported through the status
            err = e
            log.warning("rank %d: forward failed (%s: %s)", channel.rank, type(e).__name__, e)
        _check_out_of_step(channel.failures(err is not None), channel.world_size, channel.rank, err)
