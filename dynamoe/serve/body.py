"""Reading a request body: size limit (413), JSON (400), and validation into a pydantic model (400)."""
from __future__ import annotations

import json
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from .errors import APIError

__all__ = ["read_json", "validation_message", "SamplingFields"]

M = TypeVar("M", bound=BaseModel)


class SamplingFields(BaseModel):
    """The sampling fields every generating route accepts (validated later by SamplingParams)."""
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None


def validation_message(err: ValidationError) -> tuple[str, str | None]:
    """A one-line message and the first offending field of a pydantic error."""
    parts, param = [], None
    for e in err.errors()[:5]:
        loc = ".".join(str(x) for x in e.get("loc", ()))
        param = param or (loc or None)
        parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
    return "invalid request: " + "; ".join(parts), param


async def read_json(request: Request, limit: int, model: type[M] | None = None):
    """The body as a JSON object (validated into ``model`` when given)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(413, f"request body of {int(length)} bytes is over this server's limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body is over this server's limit of {limit} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as err:
        raise APIError(400, f"the request body is not valid JSON: {type(err).__name__}: {err}") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    if model is None:
        return data
    try:
        return model.model_validate(data)
    except ValidationError as err:
        msg, param = validation_message(err)
        raise APIError(400, msg, param=param) from None
