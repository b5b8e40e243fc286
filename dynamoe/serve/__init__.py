"""Serving: ``dynamoe serve`` -- an HTTP server over :class:`~dynamoe.engine.GenerationEngine`.

FastAPI + uvicorn; one engine thread does continuous batching, handlers stream its events (SSE).
Routes: ``POST /chat`` (plain-text stream), OpenAI ``/v1/chat/completions``, ``/v1/completions``,
``/v1/models``; Anthropic ``/v1/messages`` (``?beta=true`` too), ``/v1/messages/count_tokens``;
``GET /health``, ``GET /metrics`` (Prometheus, with per-layer expert load), ``GET /`` (web UI).

``create_app(engine, tokenizer, ServerConfig(...))`` builds the app in-process; FastAPI is imported
on first use of these names.

Files: ``app`` (routes, auth, error shapes), ``openai_api``, ``anthropic_api``, ``parsing`` (reasoning
and tool-call parsers), ``runner`` (engine thread <-> asyncio), ``state`` (shared request steps),
``metrics``, ``body``, ``errors``, ``sse``, ``webui``, ``cli``, ``multirank`` (``dynamoe serve`` under torchrun:
expert parallel, HTTP on rank 0).
"""
from __future__ import annotations

__all__ = ["create_app", "ServerConfig"]


def __getattr__(name):
    if name == "create_app":
        from .app import create_app
        return create_app
    if name == "ServerConfig":
        from .state import ServerConfig
        return ServerConfig
    raise AttributeError(name)
