"""Generated text -> reasoning, content and tool calls, as it streams.

A chat model's output is plain text with markers; which markers depends on the family (the chat template
that teaches them is how :func:`~dynamoe.serve.tool_formats.tool_parser_for` /
:func:`~dynamoe.serve.harmony.uses_harmony` pick; the formats' body parsers are in
:mod:`dynamoe.serve.tool_formats`, harmony's in :mod:`dynamoe.serve.harmony`):

=====================  =======================================================================================
reasoning              ``<think>...</think>`` at the start (Qwen3, DeepSeek-R1/V3.1, GLM, Kimi-K2-Thinking; when
                       the template already opened ``<think>`` in the prompt, the output starts inside it)
Hermes / Qwen3         ``<tool_call>{"name": "f", "arguments": {...}}</tool_call>``; Qwen3-Coder puts
                       ``<function=f><parameter=p>V</parameter></function>`` inside
GLM-4.5 ... GLM-5      ``<tool_call>f\\n<arg_key>k</arg_key>\\n<arg_value>V</arg_value>\\n</tool_call>`` (4.7 / 5:
                       no newlines)
DeepSeek-V3 / R1       ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\\n```json\\n{...}\\n```
                       <｜tool▁call▁end｜><｜tool▁calls▁end｜>``
DeepSeek-V3.1 / V3.2   the same markers around ``f<｜tool▁sep｜>{...}``
Kimi-K2                ``<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>
                       {...}<|tool_call_end|><|tool_calls_section_end|>`` (``functions.f:0`` is also the call id)
Mistral / Mixtral      ``[TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]`` (v3 tokenizers) or
                       ``[TOOL_CALLS]f[ARGS]{...}`` once per call (v11+; ``f[CALL_ID]id[ARGS]{...}``); ids are 9
                       letters and digits (the templates refuse others)
GPT-OSS (harmony)      messages ``<|channel|>analysis<|message|>...<|end|>`` (reasoning), ``<|start|>assistant
                       <|channel|>final<|message|>...`` (content), ``<|channel|>commentary to=functions.f
                       <|constrain|>json<|message|>{...}<|call|>`` (a call; the recipient may come before
                       ``<|channel|>``); see :class:`~dynamoe.serve.harmony.HarmonyParser`
=====================  =======================================================================================

The parsers take text deltas and return :class:`Part` lists. They hold back any tail that could begin
a marker, so a marker never reaches a client in pieces, and a tool call is emitted whole once its end
marker (or the end of the output) is seen. Text that looks like a tool call but does not parse is
passed on as content, never dropped. Many of these markers are special tokens, which a detokenizer
skips by default: :attr:`OutputParser.markers` names the ones to keep in the text the parser reads
(the server passes their ids to the engine; no other special token is kept).
"""
from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable

if TYPE_CHECKING:
    from .harmony import HarmonyParser

__all__ = ["Part", "ToolCall", "ReasoningParser", "ToolCallParser", "OutputParser", "think_tags_for",
           "prompt_opens_think", "mistral_call_id", "new_id"]

THINK_START, THINK_END = "<think>", "</think>"

_ALNUM = string.ascii_letters + string.digits
_NAME = re.compile(r"[\w.:\-]+")   # a function name: no spaces, no markup


def new_id(prefix: str) -> str:
    """A random id like ``call_3f9a...`` (24 hex digits)."""
    return f"{prefix}{secrets.token_hex(12)}"


def mistral_call_id() -> str:
    """A random Mistral tool-call id: 9 letters and digits (Mistral's chat templates refuse any other)."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


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


# --- tool calls in content ------------------------------------------------------------------------

class ToolCallParser:
    """Content text -> content parts and whole tool calls found between ``start`` and ``end``.

    ``parse_body(text between the markers) -> list[ToolCall] | None`` (None: not a tool call; the text
    is passed on as content). ``end=None``: a call runs to the next ``start`` or to the end of the
    output (Mistral). ``markers``: every marker of the format, ``start`` and ``end`` included (the
    special tokens to keep in the text). Whitespace between content and a tool call, or between
    calls, is dropped.
    """

    def __init__(self, start: str, end: str | None, parse_body: Callable[[str], list[ToolCall] | None],
                 markers: Iterable[str] = ()):
        self.start, self.end, self.parse_body = start, end, parse_body
        self.markers = list(dict.fromkeys([start, *([end] if end else []), *markers]))
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

    def _calls(self, body: str, out: list[Part], closed: bool) -> None:
        calls = self.parse_body(body)
        if calls is None:
            self._content(self.start + body + (self.end if closed else ""), out)
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
            if self.end is None:   # the next call's start ends this one
                j = buf.find(self.start)
                if j < 0:
                    return _merge(out)
                self._buf = buf[j + len(self.start):]
                self._calls(buf[:j], out, closed=False)
                continue
            j = buf.find(self.end)
            if j < 0:
                return _merge(out)
            self._buf, self._in_call = buf[j + len(self.end):], False
            self._calls(buf[:j], out, closed=True)

    def flush(self) -> list[Part]:
        out: list[Part] = []
        buf, self._buf = self._buf, ""
        if self._in_call:
            self._in_call = False
            self._calls(buf, out, closed=False)   # the output ended before the end marker
        elif buf:
            self._content(buf, out)
        if self._ws and not self.num_calls:
            out.append(Part("content", self._ws))
        self._ws = ""
        return _merge(out)


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
    Either stage may be off (``think_tags=None`` / ``tool_parser=None``); ``harmony`` replaces both.
    ``markers``: the special tokens whose text the parser reads; ``stop_markers``: tokens that end the
    output (harmony's ``<|call|>`` and ``<|return|>``)."""

    def __init__(self, think_tags: tuple[str, str] | None = None, in_reasoning: bool = False,
                 tool_parser: ToolCallParser | None = None, harmony: HarmonyParser | None = None):
        self.reasoning = ReasoningParser(*think_tags, in_reasoning=in_reasoning) if think_tags and not harmony else None
        self.tools = tool_parser if harmony is None else None
        self.harmony = harmony

    @property
    def num_tool_calls(self) -> int:
        if self.harmony is not None:
            return self.harmony.num_calls
        return self.tools.num_calls if self.tools is not None else 0

    @property
    def markers(self) -> list[str]:
        if self.harmony is not None:
            return list(self.harmony.markers)
        tags = [self.reasoning.start, self.reasoning.end] if self.reasoning else []
        return tags + (self.tools.markers if self.tools is not None else [])

    @property
    def stop_markers(self) -> list[str]:
        return list(self.harmony.stop_markers) if self.harmony is not None else []

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
        if self.harmony is not None:
            return self.harmony.push(text)
        parts = self.reasoning.push(text) if self.reasoning else _merge([Part("content", text)])
        return self._tools(parts, final=False)

    def flush(self) -> list[Part]:
        if self.harmony is not None:
            return self.harmony.flush()
        parts = self.reasoning.flush() if self.reasoning else []
        return self._tools(parts, final=True)
