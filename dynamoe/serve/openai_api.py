"""OpenAI-compatible routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``.

Streams are SSE ``data: {json}`` chunks ending with ``data: [DONE]`` (see /work/shared/specs/SERVING.md
for what the SDKs need). Reasoning goes out as ``reasoning_content`` (and ``reasoning``), tool calls as
``tool_calls`` (whole calls, arguments in one fragment). Extensions beyond OpenAI's fields, as vLLM
names them: ``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ``chat_template_kwargs``.
"""
from __future__ import annotations

import asyncio
import json
import time
from datetime import datetime, timezone
from typing import Annotated, Any, AsyncIterator

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema
from starlette.requests import Request
from starlette.responses import JSONResponse

from .body import Int, SamplingFields, read_json
from .openapi import request_body
from .errors import APIError, sse_error
from .parsing import OutputParser, Part, new_id
from .runner import Generation
from .sse import GenerationResponse, events_while_connected
from .state import ServerState

__all__ = ["router", "ChatCompletionRequest", "CompletionRequest", "openai_messages"]

router = APIRouter()
MAX_N = 64
MAX_SEQUENCES = 128   # prompts x n of one request: more would fill the queue for everyone else
MAX_TOP_LOGPROBS = 20

_MESSAGES_SCHEMA = {"type": "array", "minItems": 1, "items": {
    "type": "object", "required": ["role"],
    "properties": {"role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
                   "content": {"anyOf": [{"type": "string"}, {"type": "null"}, {"type": "array", "items": {
                       "type": "object", "required": ["type", "text"],
                       "properties": {"type": {"enum": ["text"]}, "text": {"type": "string"}}}}]},
                   "name": {"type": "string"}, "tool_call_id": {"type": "string"},
                   "reasoning_content": {"type": "string"},
                   "tool_calls": {"type": "array", "items": {
                       "type": "object", "required": ["function"],
                       "properties": {"id": {"type": "string"}, "type": {"enum": ["function"]},
                                      "function": {"type": "object", "required": ["name"],
                                                   "properties": {"name": {"type": "string"},
                                                                  "arguments": {"type": "string"}}}}}}}}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool = False


class _Common(SamplingFields):
    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Int = Field(1, json_schema_extra={"minimum": 1, "maximum": MAX_N})
    ignore_eos: bool = False


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions`` (messages are checked by :func:`openai_messages`)."""
    messages: Annotated[list[dict[str, Any]], WithJsonSchema(_MESSAGES_SCHEMA)]
    max_completion_tokens: Int | None = Field(None, json_schema_extra={"minimum": 1})
    logprobs: bool | None = False
    top_logprobs: Int | None = Field(None, json_schema_extra={"minimum": 0, "maximum": MAX_TOP_LOGPROBS})
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Common):
    """``POST /v1/completions``: a prompt as text, texts, token ids or lists of token ids."""
    prompt: str | list[str] | list[Int] | list[list[Int]]
    logprobs: Int | None = Field(None, json_schema_extra={"minimum": 0, "maximum": MAX_TOP_LOGPROBS})
    echo: bool = False


BODY_MODELS = [ChatCompletionRequest, CompletionRequest]


def server(request: Request) -> ServerState:
    return request.app.state.server


# --- request -> engine inputs ---------------------------------------------------------------------

_IMAGE_PARTS = ("image_url", "input_image", "image")
_AUDIO_PARTS = ("input_audio", "audio_url")


def _text(content, where: str, images: str | None = None, audio: str | None = None) -> str:
    """OpenAI message content: a string, or parts of which only text is supported (``images`` / ``audio``: what
    an image / audio part is told)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text", "output_text"):
                out.append(str(part.get("text", "")))
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                if kind in _IMAGE_PARTS and images:
                    raise APIError(400, f"{where}[{j}] is an {kind!r} part: {images}; send text parts only", param=where)
                if kind in _AUDIO_PARTS and audio:
                    raise APIError(400, f"{where}[{j}] is an {kind!r} part: {audio}; send text parts only", param=where)
                raise APIError(400, f"{where}[{j}] is a {kind!r} part; this server takes text only", param=where)
        return "".join(out)
    raise APIError(400, f"{where} must be a string or a list of text parts, got {type(content).__name__}", param=where)


def _arguments(value):
    """Tool-call arguments for a template: a dict when the text parses to one (most templates want that)."""
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError:
            return value
        return parsed if isinstance(parsed, dict) else value
    return value if value is not None else {}


def openai_messages(messages: list[dict], images: str | None = None, audio: str | None = None) -> list[dict]:
    """OpenAI chat messages -> the chat template's messages (``developer`` is a system message;
    text parts joined; reasoning as ``reasoning_content``; tool calls with dict arguments). ``images`` /
    ``audio``: the error an image / audio part gets (:attr:`ServerState.no_images`, :attr:`ServerState.no_audio`)."""
    if not messages:
        raise APIError(400, "messages must not be empty", param="messages")
    out = []
    for i, m in enumerate(messages):
        role = m.get("role")
        role = "system" if role == "developer" else role
        if role not in ("system", "user", "assistant", "tool"):
            raise APIError(400, f"messages[{i}].role must be one of system, developer, user, assistant, tool; "
                                f"got {m.get('role')!r}", param=f"messages[{i}].role")
        msg: dict[str, Any] = {"role": role, "content": _text(m.get("content"), f"messages[{i}].content", images,
                                                              audio)}
        if role == "assistant":
            reasoning = m.get("reasoning_content") or m.get("reasoning")
            if isinstance(reasoning, str) and reasoning:
                msg["reasoning_content"] = reasoning
            calls = m.get("tool_calls") or []
            if not isinstance(calls, list):
                raise APIError(400, f"messages[{i}].tool_calls must be a list", param=f"messages[{i}].tool_calls")
            if calls:
                msg["tool_calls"] = []
                for tc in calls:
                    fn = tc.get("function") if isinstance(tc, dict) else None
                    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                        raise APIError(400, f"messages[{i}].tool_calls entries need function.name",
                                       param=f"messages[{i}].tool_calls")
                    msg["tool_calls"].append({"id": tc.get("id"), "type": "function",
                                              "function": {"name": fn["name"],
                                                           "arguments": _arguments(fn.get("arguments"))}})
        if role == "tool":
            msg["tool_call_id"] = m.get("tool_call_id")
            if m.get("name"):
                msg["name"] = m["name"]
        out.append(msg)
    return out


def _stops(stop) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stops):
        raise APIError(400, "stop strings must not be empty", param="stop")
    return stops


def _check_unsupported(body: ChatCompletionRequest) -> None:
    """Options whose meaning we cannot honour get a 400 rather than being silently ignored."""
    fmt = (body.response_format or {}).get("type", "text")
    if fmt != "text":
        raise APIError(400, f"response_format type {fmt!r} is not supported (no constrained decoding); "
                            "omit response_format or use {'type': 'text'}", param="response_format")
    choice = body.tool_choice
    if choice is not None and choice not in ("auto", "none"):
        raise APIError(400, f"tool_choice {choice!r} is not supported: only 'auto' and 'none' (the model decides "
                            "whether to call a tool; forcing a call needs constrained decoding)", param="tool_choice")


def _check_n(n: int, prompts: int = 1) -> None:
    if not 1 <= n <= MAX_N:
        raise APIError(400, f"n must be an int in [1, {MAX_N}], got {n}", param="n")
    if prompts * n > MAX_SEQUENCES:
        raise APIError(400, f"{prompts} prompts x n={n} asks for {prompts * n} sequences; one request may ask for "
                            f"at most {MAX_SEQUENCES} (send fewer prompts or a lower n)",
                       param="n" if n > 1 else "prompt")


def _check_top_logprobs(value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not 0 <= value <= MAX_TOP_LOGPROBS):
        raise APIError(400, f"top_logprobs must be an int in [0, {MAX_TOP_LOGPROBS}], got {value!r}",
                       param="top_logprobs")


def _check_token_ids(st: ServerState, prompts: list[list[int]]) -> None:
    """Token-id prompts: every id in the vocabulary (before anything decodes them, e.g. for ``echo``)."""
    vocab = st.engine.vocab_size or (st.tokenizer.vocab_size if st.tokenizer is not None else None)
    for k, ids in enumerate(prompts):
        bad = [t for t in ids if not 0 <= t < (vocab if vocab is not None else 2**63)]
        if bad:
            where = "prompt" if len(prompts) == 1 else f"prompt[{k}]"
            raise APIError(400, f"{where} holds token id {bad[0]}, outside the vocabulary [0, {vocab})",
                           param="prompt")


def _sampling_fields(body: _Common) -> dict:
    return {k: getattr(body, k) for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                                          "presence_penalty", "frequency_penalty", "seed")}


def _add_choices(st: ServerState, gen: Generation, prompts: list[list[int]], n: int, fields: dict,
                 max_tokens: int | None, stop: list[str], ignore_eos: bool, param: str,
                 options: dict | None = None) -> None:
    seed = fields.get("seed")
    for ids in prompts:
        st.check_prompt(ids, param)
        for j in range(n):
            f = dict(fields, seed=None if seed is None else (seed + j) % 2**64)
            params = st.sampling(**f)
            try:
                gen.add(ids, params, max_tokens, stop, ignore_eos=ignore_eos, **(options or {}))
            except ValueError as err:
                raise APIError(400, str(err), param=param) from None


# --- output pieces --------------------------------------------------------------------------------

def _chat_logprob(st: ServerState, lp) -> dict:
    def entry(tok, val):
        text = st.token_text(tok)
        return {"token": text, "logprob": val, "bytes": list(text.encode("utf-8"))}
    return {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}


def _completion_logprobs(st: ServerState, lps: list, offset: int = 0) -> dict:
    tokens, values, tops, offsets = [], [], [], []
    for lp in lps:
        text = st.token_text(lp.token_id)
        tokens.append(text)
        values.append(lp.logprob)
        tops.append({st.token_text(t): v for t, v in lp.top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def _finish(reason: str | None, parser: OutputParser | None) -> str:
    if reason in ("length", "context"):   # OpenAI has one reason for max_tokens and a full context
        return "length"
    if parser is not None and parser.num_tool_calls:
        return "tool_calls"
    return "stop"


def _delta(part: Part, tool_index: int) -> dict:
    if part.kind == "reasoning":
        return {"reasoning_content": part.text, "reasoning": part.text}
    if part.kind == "tool_call":
        c = part.call
        return {"tool_calls": [{"index": tool_index, "id": c.id, "type": "function",
                                "function": {"name": c.name, "arguments": c.arguments}}]}
    return {"content": part.text}


def _usage(gen: Generation, prompt_tokens: int, cached: bool = False) -> dict:
    """OpenAI usage; ``cached``: add ``prompt_tokens_details.cached_tokens`` (one prompt, n choices: the
    prompt tokens every choice found in the engine's prefix cache)."""
    done = sum(len(r.output_ids) for r in gen.requests)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": done, "total_tokens": prompt_tokens + done}
    if cached:
        usage["prompt_tokens_details"] = {"cached_tokens": min((r.stats.cached_tokens for r in gen.requests), default=0)}
    return usage


# --- chat completions -----------------------------------------------------------------------------

@router.post("/v1/chat/completions", openapi_extra=request_body(
    ChatCompletionRequest, chat={"messages": [{"role": "user", "content": "Why mixture of experts?"}], "max_tokens": 16},
    logprobs={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True, "top_logprobs": 2}))
async def chat_completions(request: Request):
    st = server(request)
    body = await read_json(request, st.config.max_request_bytes, ChatCompletionRequest)
    st.check_model(body.model)
    _check_n(body.n)
    _check_unsupported(body)
    messages = openai_messages(body.messages, images=st.no_images, audio=st.no_audio)
    use_tools = bool(body.tools) and body.tool_choice != "none"
    kwargs = dict(body.chat_template_kwargs or {})
    thinking = kwargs.pop("enable_thinking", kwargs.pop("thinking", None))
    prompt_text, ids = await asyncio.to_thread(
        st.render_chat, messages, tools=body.tools if use_tools else None, enable_thinking=thinking,
        reasoning_effort=body.reasoning_effort, template_kwargs=kwargs)
    max_tokens = st.max_tokens(body.max_completion_tokens, "max_completion_tokens") \
        if body.max_completion_tokens is not None else st.max_tokens(body.max_tokens, "max_tokens")
    fields = _sampling_fields(body)
    want_lp = bool(body.logprobs)
    _check_top_logprobs(body.top_logprobs)
    if want_lp:
        fields["logprobs"] = body.top_logprobs or 0
    elif body.top_logprobs is not None:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    parsers = [st.output_parser(prompt_text, body.tools if use_tools else None) for _ in range(body.n)]
    gen = st.runner.generation()
    try:
        _add_choices(st, gen, [ids], body.n, fields, max_tokens, _stops(body.stop), body.ignore_eos, "messages",
                     st.decode_options(parsers[0], body.ignore_eos))
    except BaseException:
        gen.cancel()
        raise
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        stream = _chat_stream(st, gen, parsers, len(ids), include_usage, want_lp, request.url.path)
        return GenerationResponse(gen, stream)
    async with gen:
        return JSONResponse(await _chat_collect(st, request, gen, parsers, len(ids), want_lp))


async def _chat_collect(st, request, gen, parsers, prompt_tokens, want_lp) -> dict:
    n = len(parsers)
    parts: list[list[Part]] = [[] for _ in range(n)]
    lps: list[list] = [[] for _ in range(n)]
    reasons: list[str | None] = [None] * n
    async for i, ev in events_while_connected(request, gen):
        if ev.logprob is not None and want_lp:
            lps[i].append(_chat_logprob(st, ev.logprob))
        if ev.text:
            parts[i].extend(parsers[i].push(ev.text))
        if ev.finish_reason is not None:
            if ev.finish_reason == "error":
                raise APIError(500, f"generation failed: {ev.error}")
            parts[i].extend(parsers[i].flush())
            reasons[i] = ev.finish_reason
    choices = []
    for i in range(n):
        reasoning = "".join(p.text for p in parts[i] if p.kind == "reasoning")
        content = "".join(p.text for p in parts[i] if p.kind == "content")
        calls = [p.call for p in parts[i] if p.kind == "tool_call"]
        msg: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
        if reasoning:
            msg["reasoning_content"] = msg["reasoning"] = reasoning
        if calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        choices.append({"index": i, "message": msg, "logprobs": {"content": lps[i]} if want_lp else None,
                        "finish_reason": _finish(reasons[i], parsers[i])})
    return {"id": new_id("chatcmpl-"), "object": "chat.completion", "created": int(time.time()),
            "model": st.model_name, "choices": choices, "usage": _usage(gen, prompt_tokens, cached=True)}


async def _chat_stream(st, gen, parsers, prompt_tokens, include_usage, want_lp, path) -> AsyncIterator[str]:
    cid, created = new_id("chatcmpl-"), int(time.time())
    n = len(parsers)

    def chunk(choices, usage=None) -> str:
        d = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": st.model_name,
             "choices": choices}
        if include_usage:
            d["usage"] = usage
        return f"data: {json.dumps(d, ensure_ascii=False)}\n\n"

    def choice(i, delta, finish=None, lp=None) -> dict:
        c = {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}
        if want_lp and lp:
            c["logprobs"] = {"content": lp}
        return c

    for i in range(n):
        yield chunk([choice(i, {"role": "assistant", "content": ""})])
    pending: list[list] = [[] for _ in range(n)]
    tools_sent = [0] * n
    async for item in gen.events(keepalive=st.config.keepalive_s):
        if item is None:
            yield ": ping\n\n"
            continue
        i, ev = item
        if ev.logprob is not None and want_lp:
            pending[i].append(_chat_logprob(st, ev.logprob))
        parts = parsers[i].push(ev.text) if ev.text else []
        if ev.finish_reason == "error":
            yield sse_error(path, f"generation failed: {ev.error}")
            return
        if ev.finish_reason is not None:
            parts += parsers[i].flush()
        for p in parts:
            yield chunk([choice(i, _delta(p, tools_sent[i]), lp=pending[i])])
            pending[i] = []
            tools_sent[i] += p.kind == "tool_call"
        if ev.finish_reason is not None:
            yield chunk([choice(i, {}, _finish(ev.finish_reason, parsers[i]), lp=pending[i])])
            pending[i] = []
    if include_usage:
        yield chunk([], _usage(gen, prompt_tokens, cached=True))
    yield "data: [DONE]\n\n"


# --- completions ----------------------------------------------------------------------------------

@router.post("/v1/completions", openapi_extra=request_body(
    CompletionRequest, text={"prompt": "Mixture of experts", "max_tokens": 16},
    token_ids_echoed={"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 2, "echo": True, "logprobs": 1}))
async def completions(request: Request):
    st = server(request)
    body = await read_json(request, st.config.max_request_bytes, CompletionRequest)
    st.check_model(body.model)
    _check_n(body.n)
    p = body.prompt
    if isinstance(p, str):
        texts, prompts = [p], None
    elif p and all(isinstance(x, str) for x in p):
        texts, prompts = list(p), None
    elif p and all(isinstance(x, int) for x in p):
        texts, prompts = [None], [list(p)]
    elif p and all(isinstance(x, list) for x in p):
        texts, prompts = [None] * len(p), [list(x) for x in p]
    else:
        raise APIError(400, "prompt must be a string, a list of strings, token ids or lists of token ids, "
                            "and not empty", param="prompt")
    _check_n(body.n, len(texts))
    if prompts is None:
        prompts = [await asyncio.to_thread(st.encode_text, t) for t in texts]
    else:
        _check_token_ids(st, prompts)
    if body.echo and any(t is None for t in texts):
        texts = [t if t is not None else st.tokenizer.decode(ids) for t, ids in zip(texts, prompts)]
    fields = _sampling_fields(body)
    want_lp = body.logprobs is not None
    if want_lp:
        fields["logprobs"] = body.logprobs
    max_tokens = st.max_tokens(body.max_tokens if body.max_tokens is not None else 16, "max_tokens")
    gen = st.runner.generation()
    try:
        _add_choices(st, gen, prompts, body.n, fields, max_tokens, _stops(body.stop), body.ignore_eos, "prompt")
    except BaseException:
        gen.cancel()
        raise
    echo = [texts[k // body.n] if body.echo else "" for k in range(len(gen.requests))]
    prompt_tokens = sum(len(x) for x in prompts)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return GenerationResponse(gen, _completion_stream(st, gen, echo, prompt_tokens, include_usage, want_lp,
                                                          request.url.path))
    async with gen:
        k = len(gen.requests)
        text, lps, reasons = [""] * k, [[] for _ in range(k)], [None] * k
        async for i, ev in events_while_connected(request, gen):
            text[i] += ev.text
            if ev.logprob is not None:
                lps[i].append(ev.logprob)
            if ev.finish_reason == "error":
                raise APIError(500, f"generation failed: {ev.error}")
            if ev.finish_reason is not None:
                reasons[i] = ev.finish_reason
        choices = [{"index": i, "text": echo[i] + text[i], "finish_reason": _finish(reasons[i], None),
                    "logprobs": _completion_logprobs(st, lps[i], len(echo[i])) if want_lp else None}
                   for i in range(k)]
        return JSONResponse({"id": new_id("cmpl-"), "object": "text_completion", "created": int(time.time()),
                             "model": st.model_name, "choices": choices, "usage": _usage(gen, prompt_tokens)})


async def _completion_stream(st, gen, echo, prompt_tokens, include_usage, want_lp, path) -> AsyncIterator[str]:
    cid, created = new_id("cmpl-"), int(time.time())
    offsets = [len(e) for e in echo]

    def chunk(choices, usage=None) -> str:
        d = {"id": cid, "object": "text_completion", "created": created, "model": st.model_name, "choices": choices}
        if include_usage:
            d["usage"] = usage
        return f"data: {json.dumps(d, ensure_ascii=False)}\n\n"

    for i, e in enumerate(echo):
        if e:
            yield chunk([{"index": i, "text": e, "logprobs": None, "finish_reason": None}])
    async for item in gen.events(keepalive=st.config.keepalive_s):
        if item is None:
            yield ": ping\n\n"
            continue
        i, ev = item
        if ev.finish_reason == "error":
            yield sse_error(path, f"generation failed: {ev.error}")
            return
        lp = None
        if want_lp and ev.logprob is not None:
            lp = _completion_logprobs(st, [ev.logprob], offsets[i])
        offsets[i] += len(ev.text)
        finish = _finish(ev.finish_reason, None) if ev.finish_reason is not None else None
        if ev.text or lp or finish:
            yield chunk([{"index": i, "text": ev.text, "logprobs": lp, "finish_reason": finish}])
    if include_usage:
        yield chunk([], _usage(gen, prompt_tokens))
    yield "data: [DONE]\n\n"


# --- models ---------------------------------------------------------------------------------------

def _model_card(st: ServerState, anthropic: bool) -> dict:
    if anthropic:
        created = datetime.fromtimestamp(st.created, timezone.utc).isoformat().replace("+00:00", "Z")
        return {"type": "model", "id": st.model_name, "display_name": st.model_name, "created_at": created}
    return {"id": st.model_name, "object": "model", "created": st.created, "owned_by": "dynamoe",
            "max_model_len": st.config.max_seq_len}


@router.get("/v1/models")
async def list_models(request: Request):
    st = server(request)
    if "anthropic-version" in request.headers:   # Anthropic's SDK lists models in its own shape
        card = _model_card(st, True)
        return {"data": [card], "has_more": False, "first_id": card["id"], "last_id": card["id"]}
    return {"object": "list", "data": [_model_card(st, False)]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request):
    st = server(request)
    anthropic = "anthropic-version" in request.headers
    if not anthropic:
        st.check_model(model_id)
    return _model_card(st, anthropic)
