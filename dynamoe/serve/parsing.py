"""Generated text -> reasoning, content and tool calls, as it streams.

A chat model's output is plain text with markers. Reasoning models think between ``<think>`` and
``</think>`` (Qwen3, DeepSeek-R1; when the chat template already opened ``<think>`` in the prompt, the
output starts inside the block). Tool calls are ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
(Qwen3, Hermes; Qwen3-Coder puts ``<function=NAME><parameter=P>V</parameter></function>`` inside) or
DeepSeek's ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>...<｜tool▁call▁end｜>
<｜tool▁calls▁end｜>``.

The parsers take text deltas and return :class:`Part` lists. They hold back any tail that could begin
a marker, so a marker never reaches a client in pieces, and a tool call is emitted whole once its end
marker (or the end of the output) is seen. Text that looks like a tool call but does not parse is
passed on as content, never dropped.
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["Part", "ToolCall", "ReasoningParser", "ToolCallParser", "OutputParser", "hermes_tool_parser",
           "deepseek_tool_parser", "tool_parser_for", "think_tags_for", "prompt_opens_think", "new_id"]

THINK_START, THINK_END = "<think>", "</think>"
DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def new_id(prefix: str) -> str:
    """A random id like ``call_3f9a...`` (24 hex digits)."""
    return f"{prefix}{secrets.token_hex(12)}"


@dataclass
class ToolCall:
    """One parsed call: ``arguments`` is a JSON object as text (what OpenAI's API carries)."""
    name: str
    arguments: str
    id: str = field(default_factory=lambda: new_id("call_"))

    @property
    def input(self) -> dict:
        """The arguments as a dict (Anthropic's ``input``)."""
        return json.loads(self.arguments)


@dataclass
class Part:
    """A piece of output: kind 'reasoning' or 'content' with ``text``, or 'tool_call' with ``call``."""
    kind: str
    text: str = ""
    call: ToolCall | None = None


def _held_prefix(buf: str, marker: str) -> int:
    """Length of the longest tail of ``buf`` that is a proper prefix of ``marker`` (it may become the marker)."""
    for k in range(min(len(buf), len(marker) - 1), 0, -1):
        if marker.startswith(buf[-k:]):
            return k
    return 0


def _merge(parts: list[Part]) -> list[Part]:
    out: list[Part] = []
    for p in parts:
        if p.kind != "tool_call" and not p.text:
            continue
        if out and p.kind != "tool_call" and out[-1].kind == p.kind:
            out[-1] = Part(p.kind, out[-1].text + p.text)
        else:
            out.append(p)
    return out


class ReasoningParser:
    """Split text into reasoning (inside ``start``...``end``) and content.

    A reasoning block is recognised only at the start of the output (``in_reasoning=True`` when the
    prompt already opened it). Whitespace right after the start marker, right before the end marker
    and right after it is dropped (Qwen3 writes ``<think>\\n...\\n</think>\\n\\n``).
    """

    def __init__(self, start: str = THINK_START, end: str = THINK_END, in_reasoning: bool = False):
        self.start, self.end = start, end
        self.state = "reasoning_start" if in_reasoning else "start"
        self._buf = ""

    def push(self, text: str) -> list[Part]:
        self._buf += text
        out: list[Part] = []
        while True:
            buf = self._buf
            if self.state in ("start", "reasoning_start", "content_start"):
                s = buf.lstrip()
                if not s:
                    if self.state != "start":
                        self._buf = ""
                    return _merge(out)
                if self.state == "start":
                    if s.startswith(self.start):
                        self._buf, self.state = s[len(self.start):], "reasoning_start"
                        continue
                    if self.start.startswith(s):
                        return _merge(out)   # maybe the start marker, in pieces
                    self.state = "content"
                    continue
                self._buf = s
                self.state = "reasoning" if self.state == "reasoning_start" else "content"
                continue
            if self.state == "reasoning":
                i = buf.find(self.end)
                if i >= 0:
                    out.append(Part("reasoning", buf[:i].rstrip()))
                    self._buf, self.state = buf[i + len(self.end):], "content_start"
                    continue
                # hold a possible end marker and trailing whitespace (dropped if the marker follows)
                cut = len(buf) - _held_prefix(buf, self.end)
                cut = len(buf[:cut].rstrip())
                out.append(Part("reasoning", buf[:cut]))
                self._buf = buf[cut:]
                return _merge(out)
            out.append(Part("content", buf))   # content: everything passes
            self._buf = ""
            return _merge(out)

    def flush(self) -> list[Part]:
        buf, self._buf = self._buf, ""
        if self.state == "reasoning":
            return _merge([Part("reasoning", buf.rstrip())])
        if self.state in ("start", "content"):
            return _merge([Part("content", buf)])
        return []


def _json_object_text(value) -> str | None:
    """Tool arguments as JSON-object text: a dict, or text that parses to one."""
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError:
            return None
        return value if isinstance(parsed, dict) else None
    return None


_XML_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)(?:</function>|$)", re.S)
_XML_PARAMETER = re.compile(r"<parameter=([^>\s]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)


def _parse_hermes(body: str) -> list[ToolCall] | None:
    """``{"name": ..., "arguments": {...}}`` (Qwen3 / Hermes) or Qwen3-Coder's ``<function=...>`` XML."""
    text = body.strip()
    m = _XML_FUNCTION.search(text)
    if m and text.startswith("<function="):
        args = {}
        for pm in _XML_PARAMETER.finditer(m.group(2)):
            raw = pm.group(2).strip("\n")
            try:
                args[pm.group(1)] = json.loads(raw)
            except ValueError:
                args[pm.group(1)] = raw
        return [ToolCall(m.group(1), json.dumps(args, ensure_ascii=False))]
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = _json_object_text(obj.get("arguments", obj.get("parameters", {})))
    return None if args is None else [ToolCall(obj["name"], args)]


def _parse_deepseek(body: str) -> list[ToolCall] | None:
    """DeepSeek-V3 (``function<sep>NAME\\n```json\\nARGS\\n```'') and V3.1 (``NAME<sep>ARGS``) calls."""
    calls = []
    for m in re.finditer(re.escape(DS_CALL_BEGIN) + r"(.*?)(?:" + re.escape(DS_CALL_END) + r"|$)", body, re.S):
        if DS_SEP not in m.group(1):
            return None
        left, right = m.group(1).split(DS_SEP, 1)
        if left.strip() == "function" and "\n" in right:
            name, args = right.split("\n", 1)
            args = re.sub(r"^\s*```(?:json)?\s*|\s*```\s*$", "", args)
        else:
            name, args = left, right
        args = _json_object_text(args.strip())
        if args is None or not name.strip():
            return None
        calls.append(ToolCall(name.strip(), args))
    return calls or None


class ToolCallParser:
    """Content text -> content parts and whole tool calls found between ``start`` and ``end``.

    ``parse_body(text between the markers) -> list[ToolCall] | None`` (None: not a tool call; the text
    is passed on as content). Whitespace between content and a tool call, or between calls, is dropped.
    """

    def __init__(self, start: str, end: str, parse_body: Callable[[str], list[ToolCall] | None]):
        self.start, self.end, self.parse_body = start, end, parse_body
        self._buf = ""
        self._ws = ""           # whitespace-only content held until something else follows
        self._in_call = False
        self.num_calls = 0

    def _content(self, text: str, out: list[Part]) -> None:
        # trailing whitespace waits for what follows: dropped before a tool call, else passed on
        text = self._ws + text
        body = text.rstrip()
        self._ws = text[len(body):]
        if body:
            out.append(Part("content", body))

    def _calls(self, body: str, out: list[Part]) -> None:
        calls = self.parse_body(body)
        if calls is None:
            self._content(self.start + body + self.end, out)
            return
        self._ws = ""
        self.num_calls += len(calls)
        out.extend(Part("tool_call", call=c) for c in calls)

    def push(self, text: str) -> list[Part]:
        self._buf += text
        out: list[Part] = []
        while True:
            buf = self._buf
            if not self._in_call:
                i = buf.find(self.start)
                if i >= 0:
                    self._content(buf[:i], out)
                    self._buf, self._in_call = buf[i + len(self.start):], True
                    continue
                cut = len(buf) - _held_prefix(buf, self.start)
                if cut:
                    self._content(buf[:cut], out)
                self._buf = buf[cut:]
                return _merge(out)
            j = buf.find(self.end)
            if j < 0:
                return _merge(out)
            self._buf, self._in_call = buf[j + len(self.end):], False
            self._calls(buf[:j], out)

    def flush(self) -> list[Part]:
        out: list[Part] = []
        buf, self._buf = self._buf, ""
        if self._in_call:
            self._in_call = False
            calls = self.parse_body(buf)   # the output ended before the end marker
            if calls is None:
                self._content(self.start + buf, out)
            else:
                self.num_calls += len(calls)
                out.extend(Part("tool_call", call=c) for c in calls)
        elif buf:
            self._content(buf, out)
        if self._ws and not self.num_calls:
            out.append(Part("content", self._ws))
        self._ws = ""
        return _merge(out)


def hermes_tool_parser() -> ToolCallParser:
    return ToolCallParser("<tool_call>", "</tool_call>", _parse_hermes)


def deepseek_tool_parser() -> ToolCallParser:
    return ToolCallParser(DS_CALLS_BEGIN, DS_CALLS_END, _parse_deepseek)


def tool_parser_for(template: str | None) -> Callable[[], ToolCallParser] | None:
    """The tool-call format a chat template teaches its model: DeepSeek's markers, else Hermes /
    Qwen3's ``<tool_call>`` (also the default for templates that render ``tools`` some other way);
    None when the template has no tools at all."""
    if not template:
        return None
    if "tool▁calls▁begin" in template or "tool_calls_begin" in template:
        return deepseek_tool_parser
    if "<tool_call>" in template or "tools" in template:
        return hermes_tool_parser
    return None


def think_tags_for(template: str | None, vocab_has=lambda token: False) -> tuple[str, str] | None:
    """``("<think>", "</think>")`` when the model reasons in think tags (its template or vocabulary
    knows them), else None."""
    if (template and THINK_END in template) or (vocab_has(THINK_START) and vocab_has(THINK_END)):
        return THINK_START, THINK_END
    return None


def prompt_opens_think(prompt_text: str, tags: tuple[str, str] | None) -> bool:
    """Whether the rendered prompt ends inside an open think block (the template wrote ``<think>``)."""
    if tags is None:
        return False
    return prompt_text.rstrip().endswith(tags[0])


class OutputParser:
    """Reasoning split first, then tool calls in the content: ``push(delta) -> parts``, ``flush() -> parts``.
    Either stage may be off (``think_tags=None`` / ``tool_parser=None``)."""

    def __init__(self, think_tags: tuple[str, str] | None = None, in_reasoning: bool = False,
                 tool_parser: ToolCallParser | None = None):
        self.reasoning = ReasoningParser(*think_tags, in_reasoning=in_reasoning) if think_tags else None
        self.tools = tool_parser

    @property
    def num_tool_calls(self) -> int:
        return self.tools.num_calls if self.tools is not None else 0

    def _tools(self, parts: list[Part], final: bool) -> list[Part]:
        if self.tools is None:
            return parts
        out: list[Part] = []
        for p in parts:
            out.extend(self.tools.push(p.text) if p.kind == "content" else [p])
        if final:
            out.extend(self.tools.flush())
        return _merge(out)

    def push(self, text: str) -> list[Part]:
        parts = self.reasoning.push(text) if self.reasoning else _merge([Part("content", text)])
        return self._tools(parts, final=False)

    def flush(self) -> list[Part]:
        parts = self.reasoning.flush() if self.reasoning else []
        return self._tools(parts, final=True)
