"""Reading a request body: size limit (413), JSON (400), and validation into a pydantic model (400)."""
from __future__ import annotations

import json
from typing import Annotated, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from starlette.requests import Request

from .errors import APIError

__all__ = ["read_json", "validation_message", "SamplingFields", "Int", "NonNegativeInt"]

M = TypeVar("M", bound=BaseModel)


def _integral(value):
    """A float with an integral value (``264.0``: JSON does not tell the two apart) as an int."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


# an int field under strict validation (no "5", no true) that takes 5.0 as JSON Schema's integer does
Int = Annotated[int, BeforeValidator(_integral)]
NonNegativeInt = Annotated[int, Field(ge=0), BeforeValidator(_integral)]   # the bound first: it is published


def _range(lo=None, hi=None, **exclusive) -> dict:
    """A published range (JSON schema) for a field whose values SamplingParams checks, with its messages."""
    out = {k: v for k, v in (("minimum", lo), ("maximum", hi)) if v is not None}
    return Field(None, json_schema_extra={**out, **exclusive})


class SamplingFields(BaseModel):
    """The sampling fields every generating route accepts (validated later by SamplingParams)."""
    model_config = ConfigDict(strict=True)
    max_tokens: Int | None = Field(None, json_schema_extra={"minimum": 1})
    temperature: float | None = _range(0)
    top_p: float | None = _range(hi=1, exclusiveMinimum=0)
    top_k: Int | None = _range(-1)
    min_p: float | None = _range(0, 1)
    repetition_penalty: float | None = _range(exclusiveMinimum=0)
    presence_penalty: float | None = _range(-2, 2)
    frequency_penalty: float | None = _range(-2, 2)
    seed: Int | None = _range(0, 2**64 - 1)
    stop: str | list[str] | None = None


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none", "literal", "union"}


def _field_path(loc) -> str:
    """A pydantic error location as the field's path (``messages.0.content``): without the names pydantic
    gives the members of a union (``str``, ``list[dict[str,any]]``)."""
    return ".".join(str(x) for x in loc if not (isinstance(x, str) and ("[" in x or x in _TYPE_NAMES)))


def validation_message(err: ValidationError) -> tuple[str, str | None]:
    """A one-line message and the first offending field of a pydantic error; the errors of one field
    (one per member of a union) are one clause: ``system: Input should be a valid string or ...``."""
    clauses: dict[str, list[str]] = {}
    got: dict[str, str] = {}
    for e in err.errors():
        loc = _field_path(e.get("loc", ()))
        if loc not in clauses and len(clauses) == 5:
            break
        msgs = clauses.setdefault(loc, [])
        if str(e.get("msg")) not in msgs:
            msgs.append(str(e.get("msg")))
        value = e.get("input")
        if e.get("type") != "missing" and not isinstance(value, (dict, list)):
            text = repr(value)
            got[loc] = text if len(text) <= 80 else text[:77] + "..."
    parts = []
    for loc, msgs in clauses.items():
        msg = " or ".join(msgs) + (f", got {got[loc]}" if loc in got else "")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "invalid request: " + "; ".join(parts), next(iter(clauses), None) or None


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
