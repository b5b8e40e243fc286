"""Server-sent event responses tied to a :class:`~dynamoe.serve.runner.Generation`."""
from __future__ import annotations

import time
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import StreamingResponse

from ..engine import TokenEvent
from .runner import Generation

__all__ = ["SSE_HEADERS", "GenerationResponse", "events_while_connected"]

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class GenerationResponse(StreamingResponse):
    """A stream that cancels its generation however it ends: finished, client gone mid-stream (Starlette
    cancels the body iterator), or gone before the first byte. ``media_type`` defaults to SSE."""

    def __init__(self, gen: Generation, content, media_type: str = "text/event-stream", **kw):
        super().__init__(content, media_type=media_type, headers=SSE_HEADERS, **kw)
        self.gen = gen

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.gen.cancel()


async def events_while_connected(request: Request, gen: Generation,
                                 check_every: float = 1.0) -> AsyncIterator[tuple[int, TokenEvent]]:
    """The events of a non-streamed generation; ends early (the caller then cancels) if the client left
    (checked about every ``check_every`` seconds, whether tokens flow or not)."""
    next_check = time.monotonic() + check_every
    async for item in gen.events(keepalive=check_every):
        if time.monotonic() >= next_check:
            if await request.is_disconnected():
                return
            next_check = time.monotonic() + check_every
        if item is not None:
            yield item
