"""Anthropic-compatible routes: ``POST /v1/messages`` (also ``?beta=true``, as Claude Code calls it) and
``POST /v1/messages/count_tokens``.

Any model name is accepted and served by the one loaded model (clients such as Claude Code use several
names). Requests are converted into the chat template's messages: ``system`` (string or text blocks)
becomes a system message, ``tool_use`` blocks become the assistant's ``tool_calls``, ``tool_result``
blocks become ``tool`` messages, ``thinking`` blocks become ``reasoning_content``; ``tools`` are
rendered as OpenAI-style function definitions; ``thinking.type`` enabled/disabled switches the
template's thinking mode and ``output_config.effort`` becomes its ``reasoning_effort``. Sampling fields
(``temperature``, ``top_p``, ``top_k``) are honoured when sent (newer SDKs send them only via extra_body).
Streams follow the event order in /work/shared/specs/SERVING.md.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import JSONResponse

from .body import read_json
from .errors import APIError, sse_error
from .parsing import OutputParser, Part, new_id
from .runner import Generation
from .sse import GenerationResponse, events_while_connected
from .state import ServerState

__all__ = ["router", "MessagesRequest", "anthropic_messages", "anthropic_tools", "AnthropicEvents", "stop_reason"]

router = APIRouter()


class _Base(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None


class MessagesRequest(_Base):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None


class CountTokensRequest(_Base):
    pass


def server(request: Request) -> ServerState:
    return request.app.state.server


# --- request -> chat template messages ------------------------------------------------------------

def _blocks_text(content, where: str, images_ok: bool = False) -> str:
    """A string, or text blocks (a tool result's or the system prompt's) joined by newlines. With
    ``images_ok`` (tool results: a screenshot tool must not end the session), an image becomes a note."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of blocks")
    out = []
    for j, b in enumerate(content):
        if images_ok and isinstance(b, dict) and b.get("type") in ("image", "document"):
            out.append(f"[{b['type']} omitted: this model reads text only]")
            continue
        if not isinstance(b, dict) or b.get("type") != "text":
            kind = b.get("type") if isinstance(b, dict) else type(b).__name__
            raise APIError(400, f"{where}[{j}] is a {kind!r} block; this server takes text only")
        out.append(str(b.get("text", "")))
    return "\n".join(out)


def anthropic_messages(system, messages: list[dict]) -> list[dict]:
    """Anthropic ``system`` + ``messages`` -> the chat template's messages (see the module docstring)."""
    out: list[dict] = []
    sys_text = _blocks_text(system, "system")
    if sys_text:
        out.append({"role": "system", "content": sys_text})
    if not messages:
        raise APIError(400, "messages: at least one message is required")
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        where = f"messages.{i}.content"
        if role not in ("user", "assistant"):
            raise APIError(400, f"messages.{i}.role must be 'user' or 'assistant', got {role!r}")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise APIError(400, f"{where} must be a string or a list of content blocks")
        texts: list[str] = []
        reasoning: list[str] = []
        calls: list[dict] = []
        for j, b in enumerate(content):
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text":
                texts.append(str(b.get("text", "")))
            elif kind == "tool_result" and role == "user":
                result = _blocks_text(b.get("content"), f"{where}.{j}.content", images_ok=True)
                if b.get("is_error"):
                    result = f"Error: {result}"
                out.append({"role": "tool", "content": result, "tool_call_id": b.get("tool_use_id")})
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(b.get("name"), str):
                    raise APIError(400, f"{where}.{j}: a tool_use block needs a name")
                args = b.get("input") if isinstance(b.get("input"), dict) else {}
                calls.append({"id": b.get("id"), "type": "function",
                              "function": {"name": b["name"], "arguments": args}})
            elif kind == "thinking" and role == "assistant":
                reasoning.append(str(b.get("thinking", "")))
            elif kind == "redacted_thinking":
                continue
            else:
                raise APIError(400, f"{where}.{j} is a {kind!r} block, which this server does not take in a "
                                    f"{role} message (text, tool_use, tool_result and thinking are supported)")
        if role == "user":
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
            continue
        msg: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
        if reasoning:
            msg["reasoning_content"] = "\n".join(reasoning)
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def anthropic_tools(tools: list[dict] | None) -> list[dict] | None:
    """Client tools as the function definitions chat templates render; server tools (no
    ``input_schema``) are left out."""
    out = [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                             "parameters": t["input_schema"]}}
           for t in tools or [] if isinstance(t, dict) and isinstance(t.get("name"), str) and "input_schema" in t]
    return out or None


def _thinking_switch(thinking: dict | None) -> bool | None:
    kind = (thinking or {}).get("type")
    return True if kind == "enabled" else False if kind == "disabled" else None


def _effort(output_config: dict | None) -> str | None:
    """``output_config.effort`` as a template's reasoning_effort (low|medium|high)."""
    effort = (output_config or {}).get("effort")
    return {"xhigh": "high", "max": "high"}.get(effort, effort) if effort in ("low", "medium", "high", "xhigh", "max") \
        else None


async def _render(st: ServerState, body: _Base) -> tuple[str, list[int], list[dict] | None]:
    messages = anthropic_messages(body.system, body.messages)
    tools = anthropic_tools(body.tools)
    if (body.tool_choice or {}).get("type") == "none":
        tools = None
    text, ids = await asyncio.to_thread(st.render_chat, messages, tools=tools,
                                        enable_thinking=_thinking_switch(body.thinking),
                                        reasoning_effort=_effort(body.output_config))
    return text, ids, tools


def stop_reason(finish_reason: str | None, stop, parser: OutputParser) -> tuple[str, str | None]:
    """(Anthropic stop_reason, stop_sequence) of an engine finish."""
    if finish_reason == "length":
        return "max_tokens", None
    if parser.num_tool_calls:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


# --- routes ---------------------------------------------------------------------------------------

@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request):
    st = server(request)
    body = await read_json(request, st.config.max_request_bytes, CountTokensRequest)
    _, ids, _ = await _render(st, body)
    return {"input_tokens": len(ids)}


@router.post("/v1/messages")
async def messages(request: Request):
    st = server(request)
    body = await read_json(request, st.config.max_request_bytes, MessagesRequest)
    prompt_text, ids, tools = await _render(st, body)
    st.check_prompt(ids, "messages")
    max_tokens = st.max_tokens(body.max_tokens, "max_tokens")
    params = st.sampling(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k)
    stops = list(body.stop_sequences or [])
    if any(not s for s in stops):
        raise APIError(400, "stop_sequences must not hold empty strings")
    parser = st.output_parser(prompt_text, tools)
    gen = st.runner.generation()
    try:
        gen.add(ids, params, max_tokens, stops, **st.decode_options(parser))
    except ValueError as err:
        gen.cancel()
        raise APIError(400, str(err)) from None
    msg_id = new_id("msg_")
    if body.stream:
        return GenerationResponse(gen, _stream(st, gen, parser, msg_id, len(ids), request.url.path))
    async with gen:
        return JSONResponse(await _collect(st, request, gen, parser, msg_id, len(ids)))


def _content_blocks(parts: list[Part]) -> list[dict]:
    blocks: list[dict] = []
    for p in parts:
        if p.kind == "tool_call":
            blocks.append({"type": "tool_use", "id": _tool_use_id(p.call), "name": p.call.name,
                           "input": p.call.input})
        elif p.kind == "reasoning":
            if blocks and blocks[-1]["type"] == "thinking":
                blocks[-1]["thinking"] += p.text
            else:
                blocks.append({"type": "thinking", "thinking": p.text, "signature": ""})
        elif blocks and blocks[-1]["type"] == "text":
            blocks[-1]["text"] += p.text
        else:
            blocks.append({"type": "text", "text": p.text})
    return blocks


def _tool_use_id(call) -> str:
    return "toolu_" + call.id.removeprefix("call_")


def _usage(input_tokens: int, output_tokens: int) -> dict:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0}


async def _collect(st: ServerState, request: Request, gen: Generation, parser: OutputParser, msg_id: str,
                   input_tokens: int) -> dict:
    parts: list[Part] = []
    last = None
    async for _, ev in events_while_connected(request, gen):
        if ev.text:
            parts.extend(parser.push(ev.text))
        if ev.finish_reason == "error":
            raise APIError(500, f"generation failed: {ev.error}")
        if ev.finish_reason is not None:
            parts.extend(parser.flush())
            last = ev
    reason, seq = stop_reason(last.finish_reason if last else None, last.stop if last else None, parser)
    return {"id": msg_id, "type": "message", "role": "assistant", "model": st.model_name,
            "content": _content_blocks(parts), "stop_reason": reason, "stop_sequence": seq,
            "usage": _usage(input_tokens, len(gen.requests[0].output_ids))}


def sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class AnthropicEvents:
    """The SSE events of one streamed message, from output parts: opens a block per kind change,
    closes the open block before the next, one block per tool call."""

    def __init__(self, msg_id: str, model: str, input_tokens: int):
        self.msg_id, self.model, self.input_tokens = msg_id, model, input_tokens
        self.index = -1
        self.open: str | None = None

    def start(self) -> str:
        msg = {"id": self.msg_id, "type": "message", "role": "assistant", "model": self.model, "content": [],
               "stop_reason": None, "stop_sequence": None, "usage": _usage(self.input_tokens, 0)}
        return sse("message_start", {"type": "message_start", "message": msg}) + sse("ping", {"type": "ping"})

    def _close(self) -> str:
        if self.open is None:
            return ""
        self.open = None
        return sse("content_block_stop", {"type": "content_block_stop", "index": self.index})

    def _open(self, kind: str, block: dict) -> str:
        out = self._close()
        self.index += 1
        self.open = kind
        return out + sse("content_block_start", {"type": "content_block_start", "index": self.index,
                                                 "content_block": block})

    def _delta(self, delta: dict) -> str:
        return sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def parts(self, parts: list[Part]) -> str:
        out = []
        for p in parts:
            if p.kind == "tool_call":
                out.append(self._open("tool_use", {"type": "tool_use", "id": _tool_use_id(p.call),
                                                   "name": p.call.name, "input": {}}))
                out.append(self._delta({"type": "input_json_delta", "partial_json": p.call.arguments}))
                out.append(self._close())
            elif p.kind == "reasoning":
                if self.open != "thinking":
                    out.append(self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""}))
                out.append(self._delta({"type": "thinking_delta", "thinking": p.text}))
            else:
                if self.open != "text":
                    out.append(self._open("text", {"type": "text", "text": ""}))
                out.append(self._delta({"type": "text_delta", "text": p.text}))
        return "".join(out)

    def finish(self, stop_reason: str, stop_sequence: str | None, output_tokens: int) -> str:
        out = ""
        if self.index < 0:   # no output at all: one empty text block, as Anthropic's API sends
            out += self._open("text", {"type": "text", "text": ""})
        out += self._close()
        out += sse("message_delta", {"type": "message_delta",
                                     "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                     "usage": {"output_tokens": output_tokens}})
        return out + sse("message_stop", {"type": "message_stop"})


async def _stream(st: ServerState, gen: Generation, parser: OutputParser, msg_id: str, input_tokens: int,
                  path: str) -> AsyncIterator[str]:
    events = AnthropicEvents(msg_id, st.model_name, input_tokens)
    yield events.start()
    async for item in gen.events(keepalive=st.config.keepalive_s):
        if item is None:
            yield sse("ping", {"type": "ping"})
            continue
        _, ev = item
        if ev.finish_reason == "error":
            yield sse_error(path, f"generation failed: {ev.error}")
            return
        parts = parser.push(ev.text) if ev.text else []
        if ev.finish_reason is not None:
            parts += parser.flush()
        if parts:
            yield events.parts(parts)
        if ev.finish_reason is not None:
            reason, seq = stop_reason(ev.finish_reason, ev.stop, parser)
            yield events.finish(reason, seq, len(gen.requests[0].output_ids))
