"""The engine thread and the bridge from its events to asyncio handlers.

One daemon thread runs :meth:`GenerationEngine.run_forever`: between decode steps it admits waiting
requests into free slots (continuous batching). A handler opens a :class:`Generation` (one or several
engine requests, e.g. OpenAI's ``n``) and reads ``(index, TokenEvent)`` items from its asyncio queue.
Closing a generation (the handler returns, or the client disconnects and the handler is cancelled)
cancels whatever is still running, which frees the slots at once (or right after the step in flight).

Hand-over: the engine thread appends events to one list and wakes the event loop once for all that
arrive before the loop drains them (about once per step instead of once per sequence: fewer
syscalls and loop wake-ups, which compete with the engine thread for the GIL).
"""
from __future__ import annotations

import asyncio
import itertools
import threading
import time
from typing import AsyncIterator, Sequence

from ..engine import GenerationEngine, Request, SamplingParams, TokenEvent
from .metrics import Metrics

__all__ = ["EngineRunner", "Generation"]


class EngineRunner:
    """Owns ``engine``'s stepping thread; hands out :class:`Generation` objects."""

    def __init__(self, engine: GenerationEngine, metrics: Metrics | None = None):
        self.engine = engine
        self.metrics = metrics or Metrics()
        self._stop: threading.Event | None = None
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._pending: list[tuple[Generation, int, TokenEvent]] = []
        self._wake_scheduled = False

    def start(self) -> None:
        if self._stop is None:
            self._stop = self.engine.start()

    def stop(self, timeout: float = 10.0) -> None:
        if self._stop is not None:
            self._stop.set()
            t = self.engine._loop_thread
            if t is not None:
                t.join(timeout)
            self._stop = None

    @property
    def alive(self) -> bool:
        t = self.engine._loop_thread
        return t is not None and t.is_alive()

    def generation(self) -> "Generation":
        """A new generation for the running event loop (call from a handler)."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop = loop
        return Generation(self, f"gen-{next(self._ids)}")

    # --- events: engine thread -> event loop ----------------------------------------------------------

    def _deliver(self, gen: "Generation", index: int, ev: TokenEvent) -> None:
        """Called on the engine thread (or on the loop by ``cancel``): queue ``ev`` for ``gen``."""
        with self._lock:
            self._pending.append((gen, index, ev))
            if self._wake_scheduled:
                return
            self._wake_scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:   # the event loop is gone (shutdown)
            pass

    def _drain(self) -> None:
        with self._lock:
            items, self._pending = self._pending, []
            self._wake_scheduled = False
        for gen, index, ev in items:
            gen._put(index, ev)


class Generation:
    """A group of engine requests whose events arrive on one asyncio queue as ``(index, TokenEvent)``.
    Use as ``async with runner.generation() as gen: gen.add(...); async for i, ev in gen.events(): ...``."""

    def __init__(self, runner: EngineRunner, gen_id: str):
        self.runner = runner
        self.id = gen_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.requests: list[Request] = []
        self._recorded: set[int] = set()
        self._last_event = time.monotonic()

    def add(self, prompt_ids: Sequence[int], params: SamplingParams, max_tokens: int | None,
            stop: Sequence[str] = (), ignore_eos: bool = False, *, stop_token_ids: Sequence[int] = (),
            keep_special_ids: Sequence[int] = ()) -> Request:
        """Queue one engine request (ValueError for a prompt that does not fit, bad stops...).
        ``stop_token_ids`` and ``keep_special_ids``: see :meth:`GenerationEngine.add_request`."""
        index = len(self.requests)
        deliver = self.runner._deliver

        def on_event(ev: TokenEvent) -> None:   # engine thread, under its lock: hand over and return
            deliver(self, index, ev)

        req = self.runner.engine.add_request(list(prompt_ids), params, max_tokens, stop, stop_token_ids,
                                             clip_max_tokens=True, ignore_eos=ignore_eos,
                                             request_id=f"{self.id}-{index}", on_event=on_event,
                                             keep_special_ids=keep_special_ids)
        self.requests.append(req)
        return req

    def _put(self, index: int, ev: TokenEvent) -> None:
        self._last_event = time.monotonic()
        self.queue.put_nowait((index, ev))

    async def events(self, keepalive: float | None = None) -> AsyncIterator[tuple[int, TokenEvent] | None]:
        """Events until every request has finished; ``None`` after ``keepalive`` seconds without one
        (lets a stream send a ping, or a handler check its client)."""
        loop = asyncio.get_running_loop()
        timer = None

        def tick():
            nonlocal timer
            idle = time.monotonic() - self._last_event
            if idle >= keepalive:
                self.queue.put_nowait(None)
                self._last_event = time.monotonic()
                idle = 0.0
            timer = loop.call_later(keepalive - idle, tick)

        if keepalive:
            self._last_event = time.monotonic()
            timer = loop.call_later(keepalive, tick)
        try:
            left = len(self.requests)
            while left:
                item = await self.queue.get()
                if item is None:
                    yield None
                    continue
                i, ev = item
                if ev.finish_reason is not None:
                    left -= 1
                    self._record(i, ev.finish_reason)
                yield item
        finally:
            if timer is not None:
                timer.cancel()

    def _record(self, i: int, reason: str | None) -> None:
        if i in self._recorded or i >= len(self.requests):
            return
        self._recorded.add(i)
        r = self.requests[i]
        st = r.stats
        end = st.finished if st.finished is not None else time.perf_counter()
        self.runner.metrics.generation_done(len(r.prompt_ids), len(r.output_ids), reason, end - st.arrival,
                                            st.time_to_first_token_s)

    def cancel(self) -> None:
        """Cancel every unfinished request (frees its slot) and count it as cancelled."""
        for i, r in enumerate(self.requests):
            if not r.finished:
                self.runner.engine.cancel(r)
            self._record(i, r.finish_reason or "cancelled")

    async def __aenter__(self) -> "Generation":
        return self

    async def __aexit__(self, *exc) -> None:
        self.cancel()
