"""The FastAPI application: routes, API-key check, errors in each API's shape, request metrics.

``create_app(engine, tokenizer, config)`` builds it; the engine thread starts with the app (lifespan)
and stops with it. Routes: ``POST /chat`` (plain-text stream), the OpenAI routes
(:mod:`.openai_api`), the Anthropic routes (:mod:`.anthropic_api`), ``GET /health``, ``GET /metrics``
(Prometheus text), ``GET``/``HEAD /`` (the web UI with ``--serve webui``, else a JSON summary),
``GET /openapi.json`` (the API's description, :mod:`.openapi`) and ``GET /docs`` (FastAPI's page over it).

With an API key, every route but ``/health`` and the static page at ``/`` (which holds no data and asks
the browser user for the key) needs ``Authorization: Bearer KEY`` or ``x-api-key: KEY``. A path that is no
route gets a 404 with or without one (clients probe, e.g. Claude Code's ``HEAD /api/hello``).
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from pydantic import ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse

from .. import __version__
from ..engine import GenerationEngine, Tokenizer
from . import anthropic_api, openai_api
from .body import SamplingFields, read_json
from .errors import APIError, error_body
from .openapi import openapi_schema, request_body
from .sse import GenerationResponse
from .state import ServerConfig, ServerState

__all__ = ["create_app"]

log = logging.getLogger("dynamoe.serve")

ROUTES = {"/", "/chat", "/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions",
          "/v1/messages", "/v1/messages/count_tokens", "/openapi.json", "/docs", "/docs/oauth2-redirect"}
OPEN_ROUTES = {"/health"}


class ChatRequest(SamplingFields):
    """``POST /chat``: ``text`` as one user turn (through the chat template unless ``raw``)."""
    model_config = ConfigDict(extra="forbid", strict=True)
    text: str
    system: str | None = None
    raw: bool = False
    enable_thinking: bool | None = None


def _route_label(path: str) -> str:
    if path in ROUTES:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{id}"
    return "other"


def _is_route(path: str) -> bool:
    return path in ROUTES or path.startswith("/v1/")


class _Guard:
    """ASGI middleware: API key on every route but the open ones, and the per-route request counter."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state
        self.key = state.config.api_key.encode() if state.config.api_key else None

    def _authorised(self, scope) -> bool:
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"x-api-key")
        auth = headers.get(b"authorization", b"")
        if given is None and auth[:7].lower() == b"bearer ":
            given = auth[7:].strip()
        return given is not None and hmac.compare_digest(given, self.key)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        status = {"code": 500}

        async def send_(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            page = path == "/" and scope.get("method") in ("GET", "HEAD")
            guarded = _is_route(path) and path not in OPEN_ROUTES and not page
            if self.key is not None and guarded and not self._authorised(scope):
                body = error_body(path, 401, "invalid or missing API key: send 'Authorization: Bearer KEY' or "
                                             "'x-api-key: KEY'", code="invalid_api_key")
                await JSONResponse(body, status_code=401)(scope, receive, send_)
                return
            await self.app(scope, receive, send_)
        finally:
            self.state.metrics.http_request(_route_label(path), status["code"])


def create_app(engine: GenerationEngine, tokenizer: Tokenizer | None, config: ServerConfig,
               start_engine: bool = True) -> FastAPI:
    """The server for ``engine`` (its model) and ``tokenizer``. ``start_engine``: run the engine thread
    for the app's lifetime (lifespan); False when the caller drives it."""
    state = ServerState(engine, tokenizer, config)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if start_engine:
            state.runner.start()
        try:
            yield
        finally:
            if start_engine:
                state.runner.stop()

    app = FastAPI(title="dynamoe", version=__version__, lifespan=lifespan, docs_url="/docs", redoc_url=None,
                  openapi_url="/openapi.json")
    app.state.server = state
    app.include_router(openai_api.router)
    app.include_router(anthropic_api.router)
    app.openapi = lambda: openapi_schema(app, [ChatRequest, *openai_api.BODY_MODELS, *anthropic_api.BODY_MODELS],
                                         __version__)

    # --- errors in each API's shape --------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        body = error_body(request.url.path, err.status, err.message, param=err.param, code=err.code, type=err.type)
        return JSONResponse(body, status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException):
        msg = {404: f"no route {request.method} {request.url.path}",
               405: f"method {request.method} not allowed on {request.url.path}"}.get(err.status_code, str(err.detail))
        return JSONResponse(error_body(request.url.path, err.status_code, msg), status_code=err.status_code,
                            headers=getattr(err, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, err: RequestValidationError):
        return JSONResponse(error_body(request.url.path, 400, f"invalid request: {err.errors()}"), status_code=400)

    @app.exception_handler(Exception)
    async def _server_error(request: Request, err: Exception):
        log.exception("request %s %s failed", request.method, request.url.path)
        return JSONResponse(error_body(request.url.path, 500, f"internal error: {type(err).__name__}: {err}"),
                            status_code=500)

    # --- the server's own routes -----------------------------------------------------------------
    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def index(request: Request):
        if config.webui:
            from .webui import page
            return HTMLResponse(page(config.model_name))
        return {"name": "dynamoe", "model": config.model_name, "routes": sorted(ROUTES)}

    @app.get("/health")
    async def health():
        ok = state.runner.alive or not start_engine
        body = {"status": "ok" if ok else "engine stopped", "model": config.model_name,
                "running": engine.num_running, "waiting": engine.num_waiting}
        kv = getattr(engine, "cache_stats", None)
        if kv is not None:
            body["kv_cache"] = kv()
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        load = await asyncio.to_thread(state.expert_load.snapshot)
        text = state.metrics.render(model_name=config.model_name, waiting=engine.num_waiting,
                                    running=engine.num_running, max_num_seqs=engine.max_batch, expert_load=load,
                                    engine_totals=dict(engine.totals),
                                    kv_cache=engine.cache_stats() if hasattr(engine, "cache_stats") else None)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/chat", openapi_extra=request_body(ChatRequest))
    async def chat(request: Request):
        body: ChatRequest = await read_json(request, config.max_request_bytes, ChatRequest)
        if body.raw or not state.has_template:
            ids = await asyncio.to_thread(state.encode_text, body.text)
        else:
            messages: list[dict[str, Any]] = [{"role": "user", "content": body.text}]
            if body.system is not None:
                messages.insert(0, {"role": "system", "content": body.system})
            _, ids = await asyncio.to_thread(state.render_chat, messages, enable_thinking=body.enable_thinking)
        state.check_prompt(ids, "text")
        params = state.sampling(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
                                repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
                                frequency_penalty=body.frequency_penalty, seed=body.seed)
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        max_tokens = state.max_tokens(body.max_tokens, "max_tokens")
        if any(not s for s in stops):
            raise APIError(400, "stop strings must not be empty", param="stop")
        gen = state.runner.generation()
        try:
            gen.add(ids, params, max_tokens, stops)
        except ValueError as err:
            gen.cancel()
            raise APIError(400, str(err)) from None

        async def text():
            async for item in gen.events(keepalive=None):
                _, ev = item
                if ev.text:
                    yield ev.text
                if ev.finish_reason == "error":
                    yield f"\n[error: {ev.error}]\n"

        return GenerationResponse(gen, text(), media_type="text/plain; charset=utf-8")

    app.add_middleware(_Guard, state=state)
    return app

