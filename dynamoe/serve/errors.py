"""Errors as each API shapes them.

OpenAI routes (and the server's own): ``{"error": {"message", "type", "param", "code"}}``.
Anthropic routes (``/v1/messages...``): ``{"type": "error", "error": {"type", "message"}}``.
Handlers raise :class:`APIError`; the app turns it (and any other failure) into the route's shape.
"""
from __future__ import annotations

import json

__all__ = ["APIError", "is_anthropic_path", "error_body", "sse_error"]

_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                 404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
                 503: "service_unavailable"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                    429: "rate_limit_error", 503: "overloaded_error"}


class APIError(Exception):
    """An error answer: HTTP ``status``, a message for the client, and OpenAI's ``param`` / ``code``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_body(path: str, status: int, message: str, *, param: str | None = None, code: str | None = None,
               type: str | None = None) -> dict:
    if is_anthropic_path(path):
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}
    return {"error": {"message": message, "type": type or _OPENAI_TYPES.get(status, "server_error"),
                      "param": param, "code": code}}


def sse_error(path: str, message: str, status: int = 500) -> str:
    """An error in the middle of a stream (the status line is already sent)."""
    body = error_body(path, status, message)
    if is_anthropic_path(path):
        return f"event: error\ndata: {json.dumps(body)}\n\n"
    return f"data: {json.dumps(body)}\n\n"
