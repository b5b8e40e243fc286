"""Anthropic-compatible routes: ``POST /v1/messages`` (also ``?beta=true``, as Claude Code calls it) and
``POST /v1/messages/count_tokens``.

Any model name is accepted and served by the one loaded model (clients such as Claude Code use several
names). Requests are converted into the chat template's messages: ``system`` (string or text blocks)
becomes a system message, and so does a ``system`` message inside ``messages`` (kept at its place when
the template renders it there, else folded into the leading system prompt); ``tool_use`` blocks become
the assistant's ``tool_calls``, ``tool_result`` blocks become ``tool`` messages, ``thinking`` blocks
become ``reasoning_content``; ``tools`` are rendered as OpenAI-style function definitions
(``tool_choice`` none drops them, tool offers only the named one); ``thinking.type`` enabled / adaptive /
between_tools / disabled switches the template's thinking mode, ``output_config.effort`` becomes its
``reasoning_effort`` and ``output_config.format`` (a JSON schema) an instruction in the system prompt.
Unknown fields and any ``anthropic-beta`` header are ignored; the API's own ranges are enforced, errors
name the field (``messages.1.content.0.type``). Sampling fields (``temperature``, ``top_p``, ``top_k``)
are honoured when sent. A generation that fills ``max_seq_len`` before ``max_tokens`` stops with
``model_context_window_exceeded``. Streams follow the event order in /work/shared/specs/SERVING.md.
"""
from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any, AsyncIterator, Literal

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema
from starlette.requests import Request
from starlette.responses import JSONResponse

from .body import Int, NonNegativeInt, read_json
from .openapi import request_body
from .errors import APIError, sse_error
from .parsing import OutputParser, Part, new_id
from .runner import Generation
from .sse import GenerationResponse, events_while_connected
from .state import ServerState

__all__ = ["router", "MessagesRequest", "anthropic_messages", "anthropic_tools", "AnthropicEvents", "stop_reason"]

router = APIRouter()


_SYSTEM_SCHEMA = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"$ref": "#/components/schemas/TextBlock"}},
                            {"type": "null"}]}
_THINKING_SCHEMA = {"anyOf": [{"type": "null"}, {"type": "object", "required": ["type"], "properties": {
    "type": {"enum": ["enabled", "adaptive", "disabled", "between_tools"]},
    "budget_tokens": {"type": "integer", "minimum": 1024}, "display": {"type": "string", "examples": ["summarized", "omitted"]}}}]}
_TOOL_CHOICE_SCHEMA = {"anyOf": [{"type": "null"}, {"type": "object", "required": ["type"], "properties": {
    "type": {"enum": ["auto", "any", "tool", "none"]}, "name": {"type": "string"},
    "disable_parallel_tool_use": {"type": "boolean"}}}]}
_TOOLS_SCHEMA = {"anyOf": [{"type": "null"}, {"type": "array", "items": {
    "type": "object", "required": ["name", "input_schema"],
    "properties": {"name": {"type": "string", "minLength": 1}, "description": {"type": "string"},
                   "input_schema": {"type": "object"}}}}]}
_OUTPUT_CONFIG_SCHEMA = {"anyOf": [{"type": "null"}, {"type": "object", "properties": {
    "effort": {"enum": ["low", "medium", "high", "xhigh", "max", None]},
    "format": {"anyOf": [{"type": "null"}, {"type": "object", "required": ["type", "schema"], "properties": {
        "type": {"enum": ["json_schema"]}, "schema": {"type": "object"}}}]}}}]}
_MESSAGES_SCHEMA = {"type": "array", "minItems": 1, "items": {
    "type": "object", "required": ["role", "content"],
    "properties": {"role": {"enum": ["user", "assistant", "system"]},
                   "content": {"anyOf": [{"type": "string"},
                                         {"type": "array", "items": {"$ref": "#/components/schemas/ContentBlock"}}]}}}}


class TextBlock(BaseModel):
    """A text block (of a message, the system prompt or a tool result); ``cache_control`` is accepted."""
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class ContentBlock(BaseModel):
    """A block of a message's content (what the published schema says; the handler checks each kind)."""
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "thinking", "redacted_thinking", "tool_use", "tool_result"]
    text: str | None = None
    thinking: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None


class _Base(BaseModel):
    """Fields of both routes. Unknown fields (``metadata``, ``context_management``, ``service_tier``...) are
    accepted and ignored; ``messages`` and ``system`` are checked by :func:`anthropic_messages`."""
    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    messages: Annotated[list[dict[str, Any]], WithJsonSchema(_MESSAGES_SCHEMA)]
    system: Annotated[str | list[dict[str, Any]] | None, WithJsonSchema(_SYSTEM_SCHEMA)] = None
    tools: Annotated[list[dict[str, Any]] | None, WithJsonSchema(_TOOLS_SCHEMA)] = None
    tool_choice: Annotated[dict[str, Any] | None, WithJsonSchema(_TOOL_CHOICE_SCHEMA)] = None
    thinking: Annotated[dict[str, Any] | None, WithJsonSchema(_THINKING_SCHEMA)] = None
    output_config: Annotated[dict[str, Any] | None, WithJsonSchema(_OUTPUT_CONFIG_SCHEMA)] = None
    metadata: dict[str, Any] | None = None


class MessagesRequest(_Base):
    """``POST /v1/messages``; the API's own ranges: temperature and top_p in [0, 1], top_k >= 0."""
    max_tokens: Int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)
    top_p: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)
    top_k: NonNegativeInt | None = None


class CountTokensRequest(_Base):
    """``POST /v1/messages/count_tokens``: the prompt fields of a message request."""


BODY_MODELS = [MessagesRequest, CountTokensRequest, TextBlock, ContentBlock]


def server(request: Request) -> ServerState:
    return request.app.state.server


# --- request -> chat template messages ------------------------------------------------------------

# Claude Code puts this line first in its system prompt; it is request metadata (it changes with the
# client's version and request kind), not an instruction, and kept in it would spoil the prefix cache
_BILLING_HEADER = "x-anthropic-billing-header:"
_USER_BLOCKS = ("text", "tool_result")
_ASSISTANT_BLOCKS = ("text", "tool_use", "thinking", "redacted_thinking")


def _bad(where: str, message: str) -> APIError:
    return APIError(400, f"{where}: {message}", param=where)


def _kind(b, where: str) -> str:
    if not isinstance(b, dict):
        raise _bad(where, f"a content block must be an object, got {type(b).__name__}")
    kind = b.get("type")
    if not isinstance(kind, str):
        raise _bad(f"{where}.type", f"a content block needs a string 'type', got {kind!r}")
    return kind


def _text_of(b: dict, where: str) -> str:
    text = b.get("text")
    if not isinstance(text, str):
        raise _bad(f"{where}.text", f"a text block needs a string 'text', got {type(text).__name__}")
    return text


def _blocks_text(content, where: str, images_ok: bool = False, drop_billing: bool = False) -> str:
    """A string, or text blocks (a tool result's, a system prompt's) joined by newlines. With ``images_ok``
    (tool results: a screenshot tool must not end the session), an image or document becomes a note."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(where, f"must be a string or a list of text blocks, got {type(content).__name__}")
    out = []
    for j, b in enumerate(content):
        kind = _kind(b, f"{where}.{j}")
        if images_ok and kind in ("image", "document"):
            out.append(f"[{kind} omitted: this model reads text only]")
        elif images_ok and kind == "tool_reference":   # a tool search's result: that tool is offered now
            out.append(f"[tool {b.get('tool_name')} loaded]")
        elif images_ok and kind == "search_result":
            out.append("\n".join(str(x) for x in (b.get("title"), b.get("source")) if x)
                       + "\n" + _blocks_text(b.get("content"), f"{where}.{j}.content"))
        elif kind == "text":
            text = _text_of(b, f"{where}.{j}")
            if not (drop_billing and text.startswith(_BILLING_HEADER)):
                out.append(text)
        else:
            allowed = "text, search_result, tool_reference (image and document become a note)" if images_ok else "text"
            raise _bad(f"{where}.{j}.type", f"{kind!r} blocks are not supported here; allowed: {allowed}")
    return "\n".join(out)


def anthropic_messages(system, messages: list[dict], images: str | None = None) -> list[dict]:
    """Anthropic ``system`` + ``messages`` -> the chat template's messages (see the module docstring);
    ``images``: the error an image block of a message gets (:attr:`ServerState.no_images`).
    A ``system`` message inside ``messages`` stays at its place (:meth:`ServerState.render_chat` folds it
    into the leading system prompt when the template cannot render it there)."""
    out: list[dict] = []
    sys_text = _blocks_text(system, "system", drop_billing=True)
    if sys_text:
        out.append({"role": "system", "content": sys_text})
    if not messages:
        raise _bad("messages", "at least one message is required")
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        where = f"messages.{i}.content"
        if role not in ("user", "assistant", "system"):
            raise _bad(f"messages.{i}.role", f"must be 'user', 'assistant' or 'system', got {role!r}")
        if content is None:
            raise _bad(where, "a message needs 'content' (a string or a list of content blocks)")
        if role == "system":
            text = _blocks_text(content, where)
            if text:
                out.append({"role": "system", "content": text})
            continue
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise _bad(where, f"must be a string or a list of content blocks, got {type(content).__name__}")
        texts: list[str] = []
        reasoning: list[str] = []
        calls: list[dict] = []
        for j, b in enumerate(content):
            at = f"{where}.{j}"
            kind = _kind(b, at)
            allowed = _USER_BLOCKS if role == "user" else _ASSISTANT_BLOCKS
            if kind not in allowed:
                hint = ("" if kind not in ("image", "document") else
                        f"; {images}" if images and kind == "image" else "; this model reads text only")
                raise _bad(f"{at}.type", f"{kind!r} blocks are not supported in {'an' if role == 'assistant' else 'a'} "
                                         f"{role} message{hint}; "
                                         f"allowed: {', '.join(allowed)}")
            if kind == "text":
                texts.append(_text_of(b, at))
            elif kind == "tool_result":
                if not isinstance(b.get("tool_use_id"), str):
                    raise _bad(f"{at}.tool_use_id", "a tool_result block needs the string id of its tool_use")
                result = _blocks_text(b.get("content"), f"{at}.content", images_ok=True)
                if b.get("is_error"):
                    result = f"Error: {result}"
                out.append({"role": "tool", "content": result, "tool_call_id": b["tool_use_id"]})
            elif kind == "tool_use":
                if not isinstance(b.get("name"), str):
                    raise _bad(f"{at}.name", "a tool_use block needs a string name")
                args = b.get("input", {})
                if not isinstance(args, dict):
                    raise _bad(f"{at}.input", f"must be an object, got {type(args).__name__}")
                calls.append({"id": b.get("id"), "type": "function", "function": {"name": b["name"], "arguments": args}})
            elif kind == "thinking":
                if isinstance(b.get("thinking"), str):
                    reasoning.append(b["thinking"])
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


def anthropic_tools(tools: list[dict] | None, tool_choice: dict | None = None,
                    loaded: set[str] = frozenset()) -> list[dict] | None:
    """Client tools as the function definitions chat templates render; server tools (a ``type`` such as
    ``web_search_20250305`` and no ``input_schema``) are left out, and so are ``defer_loading`` tools until
    a tool_reference block (``loaded``) names them. ``tool_choice`` none: no tools; tool: only the named
    one (a hint: there is no constrained decoding to force the call)."""
    out = []
    for i, t in enumerate(tools or []):
        if not isinstance(t, dict):
            raise _bad(f"tools.{i}", f"a tool must be an object, got {type(t).__name__}")
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise _bad(f"tools.{i}.name", "a tool needs a non-empty string name")
        if "input_schema" not in t and t.get("type") not in (None, "custom"):
            continue   # a server tool: runs on Anthropic's side, nothing for this model to call
        if t.get("defer_loading") is True and t["name"] not in loaded:
            continue
        if not isinstance(t.get("input_schema"), dict):
            raise _bad(f"tools.{i}.input_schema", "a client tool needs a JSON schema object")
        desc = t.get("description", "")
        if not isinstance(desc, str):
            raise _bad(f"tools.{i}.description", "must be a string")
        out.append({"type": "function", "function": {"name": t["name"], "description": desc,
                                                     "parameters": t["input_schema"]}})
    choice = _tool_choice(tool_choice, [t["function"]["name"] for t in out])
    if choice == "none":
        return None
    if isinstance(choice, str) and choice not in ("auto", "any"):
        out = [t for t in out if t["function"]["name"] == choice]
    return out or None


def _tool_choice(choice: dict | None, names: list[str]) -> str:
    """'auto', 'any', 'none' or the name of the tool to use."""
    if choice is None:
        return "auto"
    kind = choice.get("type")
    if kind not in ("auto", "any", "tool", "none"):
        raise _bad("tool_choice.type", f"must be one of auto, any, tool, none, got {kind!r}")
    dpt = choice.get("disable_parallel_tool_use")
    if dpt is not None and not isinstance(dpt, bool):
        raise _bad("tool_choice.disable_parallel_tool_use", f"must be a boolean, got {dpt!r}")
    if kind != "tool":
        return kind
    name = choice.get("name")
    if not isinstance(name, str):
        raise _bad("tool_choice.name", "tool_choice of type 'tool' needs the name of a tool")
    if name not in names:
        raise _bad("tool_choice.name", f"{name!r} is not among the tools sent ({', '.join(names) or 'none'})")
    return name


def _loaded_tools(messages: list[dict]) -> set[str]:
    """The tools that tool_reference blocks in tool results name (deferred tools a tool search loaded)."""
    names = set()
    for m in messages:
        for b in m.get("content") if isinstance(m.get("content"), list) else ():
            if isinstance(b, dict) and b.get("type") == "tool_result" and isinstance(b.get("content"), list):
                names.update(r.get("tool_name") for r in b["content"]
                             if isinstance(r, dict) and r.get("type") == "tool_reference")
    return names


THINKING_TYPES = ("enabled", "adaptive", "disabled", "between_tools")


def _thinking(thinking: dict | None) -> tuple[bool | None, bool]:
    """(the template's enable_thinking: None = its default, whether thinking text is omitted from the
    answer). ``enabled``, ``adaptive`` and ``between_tools`` think (the template decides what that
    means; ``budget_tokens`` is checked, not enforced), ``disabled`` does not. ``display`` 'omitted'
    leaves the thinking text out; other display modes show it."""
    if thinking is None:
        return None, False
    kind = thinking.get("type")
    if kind not in THINKING_TYPES:
        raise _bad("thinking.type", f"must be one of {', '.join(THINKING_TYPES)}, got {kind!r}")
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1024:
            raise _bad("thinking.budget_tokens", f"must be an int >= 1024 with type 'enabled', got {budget!r}")
    display = thinking.get("display")
    # 'summarized' and 'omitted', and the modes betas add (Claude Code 2.1.332 sends 'updates' with
    # thinking-display-updates-2026-08-18): any of those shows the thinking text, only 'omitted' hides it
    if display is not None and not isinstance(display, str):
        raise _bad("thinking.display", f"must be a string ('summarized', 'omitted', ...), got {display!r}")
    return kind != "disabled", display == "omitted"


EFFORTS = ("low", "medium", "high", "xhigh", "max")


def _output_config(output_config: dict | None) -> tuple[str | None, str | None]:
    """(``effort`` as a template's reasoning_effort low|medium|high, an instruction for ``format``).
    A JSON schema ``format`` is asked for in the system prompt: there is no constrained decoding."""
    cfg = output_config or {}
    effort = cfg.get("effort")
    if effort is not None and effort not in EFFORTS:
        raise _bad("output_config.effort", f"must be one of {', '.join(EFFORTS)}, got {effort!r}")
    fmt = cfg.get("format")
    instruction = None
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise _bad("output_config.format", "must be {'type': 'json_schema', 'schema': {...}}")
        instruction = ("Answer with one JSON value, and nothing else, that matches this JSON schema:\n"
                       + json.dumps(fmt["schema"], ensure_ascii=False))
    return {"xhigh": "high", "max": "high"}.get(effort, effort), instruction


async def _render(st: ServerState, body: _Base) -> tuple[str, list[int], list[dict] | None, bool]:
    """(prompt text, its token ids, the tools offered, whether thinking text is omitted from the answer)."""
    messages = anthropic_messages(body.system, body.messages, images=st.no_images)
    tools = anthropic_tools(body.tools, body.tool_choice, _loaded_tools(body.messages))
    enable_thinking, omit_thinking = _thinking(body.thinking)
    effort, instruction = _output_config(body.output_config)
    if instruction:
        if messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + instruction}
        else:
            messages.insert(0, {"role": "system", "content": instruction})
    text, ids = await asyncio.to_thread(st.render_chat, messages, tools=tools, enable_thinking=enable_thinking,
                                        reasoning_effort=effort)
    return text, ids, tools, omit_thinking


def stop_reason(finish_reason: str | None, stop, parser: OutputParser) -> tuple[str, str | None]:
    """(Anthropic stop_reason, stop_sequence) of an engine finish."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "context":   # max_seq_len full before max_tokens: not the client's limit
        return "model_context_window_exceeded", None
    if parser.num_tool_calls:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


# --- routes ---------------------------------------------------------------------------------------

@router.post("/v1/messages/count_tokens", openapi_extra=request_body(
    CountTokensRequest, text={"model": "any", "messages": [{"role": "user", "content": "hi"}]}))
async def count_tokens(request: Request):
    st = server(request)
    body = await read_json(request, st.config.max_request_bytes, CountTokensRequest)
    _, ids, _, _ = await _render(st, body)
    return {"input_tokens": len(ids)}


@router.post("/v1/messages", openapi_extra=request_body(
    MessagesRequest, text={"model": "any", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]},
    claude_code_like={"model": "claude-x", "max_tokens": 64000, "stream": True, "thinking": {"type": "adaptive"},
                      "system": [{"type": "text", "text": "You help.", "cache_control": {"type": "ephemeral"}}],
                      "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                                   {"role": "system", "content": "Be brief."}],
                      "tools": [{"name": "Read", "description": "read a file", "input_schema": {
                          "type": "object", "properties": {"path": {"type": "string"}}}}],
                      "output_config": {"effort": "high"}, "metadata": {"user_id": "u"}}))
async def messages(request: Request):
    st = server(request)
    body = await read_json(request, st.config.max_request_bytes, MessagesRequest)
    prompt_text, ids, tools, omit_thinking = await _render(st, body)
    st.check_prompt(ids, "messages", anthropic=True)
    max_tokens = st.max_tokens(body.max_tokens, "max_tokens")
    params = st.sampling(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k)
    stops = list(body.stop_sequences or [])
    if any(not s for s in stops):
        raise _bad("stop_sequences", "must not hold empty strings")
    parser = st.output_parser(prompt_text, tools)
    gen = st.runner.generation()
    try:
        gen.add(ids, params, max_tokens, stops, **st.decode_options(parser))
    except ValueError as err:
        gen.cancel()
        raise APIError(400, str(err)) from None
    msg_id = new_id("msg_")
    if body.stream:
        return GenerationResponse(gen, _stream(st, gen, parser, msg_id, len(ids), request.url.path, omit_thinking))
    async with gen:
        return JSONResponse(await _collect(st, request, gen, parser, msg_id, len(ids), omit_thinking))


def _content_blocks(parts: list[Part], omit_thinking: bool = False) -> list[dict]:
    """The answer's blocks; with ``omit_thinking`` (``thinking.display`` omitted) thinking blocks are empty."""
    blocks: list[dict] = []
    for p in parts:
        if p.kind == "tool_call":
            blocks.append({"type": "tool_use", "id": _tool_use_id(p.call), "name": p.call.name,
                           "input": p.call.input})
        elif p.kind == "reasoning":
            text = "" if omit_thinking else p.text
            if blocks and blocks[-1]["type"] == "thinking":
                blocks[-1]["thinking"] += text
            else:
                blocks.append({"type": "thinking", "thinking": text, "signature": ""})
        elif blocks and blocks[-1]["type"] == "text":
            blocks[-1]["text"] += p.text
        else:
            blocks.append({"type": "text", "text": p.text})
    return blocks


def _tool_use_id(call) -> str:
    return "toolu_" + call.id.removeprefix("call_")


def _usage(prompt_tokens: int, output_tokens: int, cached_tokens: int = 0) -> dict:
    """Anthropic's usage: ``input_tokens`` are the prompt tokens computed, ``cache_read_input_tokens`` those
    read from the prefix cache (the two add up to the prompt); the cache is written as a side effect of
    every request, not billed apart, so ``cache_creation_input_tokens`` is 0."""
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached_tokens}


async def _collect(st: ServerState, request: Request, gen: Generation, parser: OutputParser, msg_id: str,
                   input_tokens: int, omit_thinking: bool = False) -> dict:
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
            "content": _content_blocks(parts, omit_thinking), "stop_reason": reason, "stop_sequence": seq,
            "usage": _usage(input_tokens, len(gen.requests[0].output_ids), gen.requests[0].stats.cached_tokens)}


def sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class AnthropicEvents:
    """The SSE events of one streamed message, from output parts: opens a block per kind change,
    closes the open block before the next, one block per tool call. ``omit_thinking``: thinking blocks
    open and close without their text (``thinking.display`` omitted)."""

    def __init__(self, msg_id: str, model: str, input_tokens: int, omit_thinking: bool = False):
        self.msg_id, self.model, self.input_tokens = msg_id, model, input_tokens
        self.omit_thinking = omit_thinking
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
                if not self.omit_thinking:
                    out.append(self._delta({"type": "thinking_delta", "thinking": p.text}))
            else:
                if self.open != "text":
                    out.append(self._open("text", {"type": "text", "text": ""}))
                out.append(self._delta({"type": "text_delta", "text": p.text}))
        return "".join(out)

    def finish(self, stop_reason: str, stop_sequence: str | None, output_tokens: int, cached_tokens: int = 0) -> str:
        """The last events; their usage is the whole message's (message_start's was sent before the prefix
        cache was looked up: it counts every prompt token as input)."""
        out = ""
        if self.index < 0:   # no output at all: one empty text block, as Anthropic's API sends
            out += self._open("text", {"type": "text", "text": ""})
        out += self._close()
        out += sse("message_delta", {"type": "message_delta",
                                     "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                     "usage": _usage(self.input_tokens, output_tokens, cached_tokens)})
        return out + sse("message_stop", {"type": "message_stop"})


async def _stream(st: ServerState, gen: Generation, parser: OutputParser, msg_id: str, input_tokens: int,
                  path: str, omit_thinking: bool = False) -> AsyncIterator[str]:
    events = AnthropicEvents(msg_id, st.model_name, input_tokens, omit_thinking)
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
            req = gen.requests[0]
            yield events.finish(reason, seq, len(req.output_ids), req.stats.cached_tokens)
