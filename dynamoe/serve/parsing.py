"""Generated text -> reasoning, content and tool calls, as it streams.

A chat model's output is plain text with markers; which markers depends on the family (the chat template
that teaches them is how :func:`tool_parser_for` / :func:`uses_harmony` pick):

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
                       ``<|channel|>``); see :class:`HarmonyParser`
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
from typing import Callable, Iterable

__all__ = ["Part", "ToolCall", "ReasoningParser", "ToolCallParser", "HarmonyParser", "OutputParser",
           "hermes_tool_parser", "glm_tool_parser", "deepseek_tool_parser", "kimi_tool_parser", "mistral_tool_parser",
           "tool_parser_for", "uses_harmony", "think_tags_for", "prompt_opens_think", "string_params",
           "mistral_call_id", "new_id"]

THINK_START, THINK_END = "<think>", "</think>"
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
GLM_KEY, GLM_KEY_END, GLM_VALUE, GLM_VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
KIMI_SECTION_BEGIN, KIMI_SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL_BEGIN, KIMI_ARGS, KIMI_CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
H_START, H_CHANNEL, H_CONSTRAIN, H_MESSAGE = "<|start|>", "<|channel|>", "<|constrain|>", "<|message|>"
H_END, H_CALL, H_RETURN = "<|end|>", "<|call|>", "<|return|>"

_NAME = re.compile(r"[\w.:\-]+")   # a function name: no spaces, no markup
_ALNUM = string.ascii_letters + string.digits


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


# --- tool-call bodies -----------------------------------------------------------------------------
# Each ``_parse_*`` takes the text between a format's markers and returns the calls in it, or None when
# the text is not a well-formed call (it is then passed on as content).

StringParams = dict[str, frozenset[str]]


def string_params(tools: Iterable[dict] | None) -> StringParams:
    """Function name -> its parameters declared ``"type": "string"``, from OpenAI-style tool definitions.
    Formats that write argument values as bare text (GLM, Qwen3-Coder) need it: ``42`` is the string
    "42" for a string parameter and the number 42 for any other."""
    out: StringParams = {}
    for t in tools or []:
        fn = t.get("function", t) if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            continue
        params = fn.get("parameters")
        props = params.get("properties") if isinstance(params, dict) else None
        names = set()
        for k, schema in (props.items() if isinstance(props, dict) else ()):
            kind = schema.get("type") if isinstance(schema, dict) else None
            kinds = [kind] if isinstance(kind, str) else [x for x in kind or [] if x != "null"]
            if kinds == ["string"]:
                names.add(k)
        out[fn["name"]] = frozenset(names)
    return out


def _arg_value(raw: str, is_string: bool):
    """A bare-text argument value: JSON when it parses as JSON (and the schema does not say string)."""
    if is_string:
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


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


def _between(body: str, begin: str, end: str) -> list[str] | None:
    """The texts between ``begin`` and ``end`` in ``body`` (the last may run to the end of ``body``);
    None when there are none, or when anything but whitespace lies outside them."""
    out, pos = [], 0
    while True:
        i = body.find(begin, pos)
        if i < 0:
            break
        if body[pos:i].strip():
            return None
        i += len(begin)
        j = body.find(end, i)
        k = body.find(begin, i)
        if j < 0 or 0 <= k < j:   # unterminated: up to the next call or the end
            j = len(body) if k < 0 else k
            out.append(body[i:j])
            pos = j
        else:
            out.append(body[i:j])
            pos = j + len(end)
    return out if out and not body[pos:].strip() else None


_XML_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)(?:</function>|$)", re.S)
_XML_PARAMETER = re.compile(r"<parameter=([^>\s]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)


def _parse_hermes(body: str, strings: StringParams | None = None) -> list[ToolCall] | None:
    """``{"name": ..., "arguments": {...}}`` (Qwen3 / Hermes) or Qwen3-Coder's ``<function=...>`` XML."""
    text = body.strip()
    m = _XML_FUNCTION.search(text)
    if m and text.startswith("<function="):
        name, declared = m.group(1), (strings or {}).get(m.group(1), frozenset())
        args = {pm.group(1): _arg_value(pm.group(2).strip("\n"), pm.group(1) in declared)
                for pm in _XML_PARAMETER.finditer(m.group(2))}
        return [ToolCall(name, json.dumps(args, ensure_ascii=False))]
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = _json_object_text(obj.get("arguments", obj.get("parameters", {})))
    return None if args is None else [ToolCall(obj["name"], args)]


_GLM_ARG = re.compile(re.escape(GLM_KEY) + r"(.*?)" + re.escape(GLM_KEY_END) + r"\s*" + re.escape(GLM_VALUE)
                      + r"(.*?)(?:" + re.escape(GLM_VALUE_END) + r"|$)", re.S)


def _parse_glm(body: str, strings: StringParams | None = None) -> list[ToolCall] | None:
    """GLM-4.5 ... GLM-5: ``NAME`` then ``<arg_key>K</arg_key><arg_value>V</arg_value>`` pairs (newlines
    between them or not). A value is JSON when it parses as JSON, unless the tool's schema declares the
    parameter a string (the template writes strings bare and everything else as JSON)."""
    text = body.strip()
    if text.startswith("{"):
        return _parse_hermes(text, strings)
    i = text.find(GLM_KEY)
    name = (text if i < 0 else text[:i]).strip()
    if not _NAME.fullmatch(name):
        return None
    declared = (strings or {}).get(name, frozenset())
    args, rest, pos = {}, text[len(text) if i < 0 else i:], 0
    for m in _GLM_ARG.finditer(rest):
        if rest[pos:m.start()].strip():
            return None
        key = m.group(1).strip()
        args[key] = _arg_value(m.group(2), key in declared)
        pos = m.end()
    if rest[pos:].strip():
        return None
    return [ToolCall(name, json.dumps(args, ensure_ascii=False))]


def _parse_deepseek(body: str) -> list[ToolCall] | None:
    """DeepSeek-V3 / R1 (``function<sep>NAME\\n```json\\nARGS\\n```'') and V3.1 / V3.2 (``NAME<sep>ARGS``)."""
    calls = []
    for call in _between(body, DS_CALL_BEGIN, DS_CALL_END) or []:
        if DS_SEP not in call:
            return None
        left, right = call.split(DS_SEP, 1)
        name, args = left.strip(), _json_object_text(right.strip())
        if name == "function" and "\n" in right and args is None:   # V3: the type, then name and fenced JSON
            name, fenced = right.split("\n", 1)
            name = name.strip()
            args = _json_object_text(re.sub(r"^\s*```(?:json)?\s*|\s*```\s*$", "", fenced))
        if args is None or not _NAME.fullmatch(name):
            return None
        calls.append(ToolCall(name, args))
    return calls or None


_KIMI_ID = re.compile(r"(?:functions\.)?(.+?)(?::\d+)?")


def _parse_kimi(body: str) -> list[ToolCall] | None:
    """Kimi-K2: ``<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>``
    calls; ``functions.NAME:IDX`` is kept as the call's id (the template writes the id back there)."""
    calls = []
    for call in _between(body, KIMI_CALL_BEGIN, KIMI_CALL_END) or []:
        head, sep, raw = call.partition(KIMI_ARGS)
        head = head.strip()
        m = _KIMI_ID.fullmatch(head)
        args = _json_object_text(raw.strip())
        if not sep or m is None or args is None or not _NAME.fullmatch(m.group(1)):
            return None
        calls.append(ToolCall(m.group(1), args, id=head))
    return calls or None


def _mistral_id(value) -> str:
    return value if isinstance(value, str) and len(value) == 9 and value.isalnum() else mistral_call_id()


def _parse_mistral(body: str) -> list[ToolCall] | None:
    """What follows one ``[TOOL_CALLS]``: a JSON array of ``{"name", "arguments"}`` (v3 tokenizers, Mixtral),
    or ``NAME[ARGS]{json}`` / ``NAME[CALL_ID]ID[ARGS]{json}`` / ``NAME{json}`` (v11+, one call each)."""
    text = body.strip()
    if text.startswith(("[", "{")):
        try:
            obj = json.loads(text)
        except ValueError:
            return None
        calls = []
        for c in obj if isinstance(obj, list) else [obj]:
            if not isinstance(c, dict) or not isinstance(c.get("name"), str):
                return None
            args = _json_object_text(c.get("arguments", c.get("parameters", {})))
            if args is None:
                return None
            calls.append(ToolCall(c["name"], args, id=_mistral_id(c.get("id"))))
        return calls or None
    head, sep, raw = text.partition(MISTRAL_ARGS)
    if not sep:
        i = text.find("{")
        head, raw = (text[:i], text[i:]) if i > 0 else ("", "")
    name, _, call_id = head.partition(MISTRAL_CALL_ID)
    name, args = name.strip(), _json_object_text(raw.strip())
    if args is None or not _NAME.fullmatch(name):
        return None
    return [ToolCall(name, args, id=_mistral_id(call_id.strip()))]


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


def hermes_tool_parser(tools: list[dict] | None = None) -> ToolCallParser:
    strings = string_params(tools)
    return ToolCallParser(TOOL_CALL_START, TOOL_CALL_END, lambda body: _parse_hermes(body, strings))


def glm_tool_parser(tools: list[dict] | None = None) -> ToolCallParser:
    strings = string_params(tools)
    return ToolCallParser(TOOL_CALL_START, TOOL_CALL_END, lambda body: _parse_glm(body, strings),
                          [GLM_KEY, GLM_KEY_END, GLM_VALUE, GLM_VALUE_END])


def deepseek_tool_parser(tools: list[dict] | None = None) -> ToolCallParser:
    return ToolCallParser(DS_CALLS_BEGIN, DS_CALLS_END, _parse_deepseek, [DS_CALL_BEGIN, DS_CALL_END, DS_SEP])


def kimi_tool_parser(tools: list[dict] | None = None) -> ToolCallParser:
    return ToolCallParser(KIMI_SECTION_BEGIN, KIMI_SECTION_END, _parse_kimi,
                          [KIMI_CALL_BEGIN, KIMI_ARGS, KIMI_CALL_END])


def mistral_tool_parser(tools: list[dict] | None = None) -> ToolCallParser:
    return ToolCallParser(MISTRAL_CALLS, None, _parse_mistral, [MISTRAL_ARGS, MISTRAL_CALL_ID])


def uses_harmony(template: str | None) -> bool:
    """Whether the chat template speaks OpenAI's harmony format (GPT-OSS): its output goes through
    :class:`HarmonyParser`, reasoning and tool calls alike."""
    return bool(template) and H_CHANNEL in template


def tool_parser_for(template: str | None) -> Callable[..., ToolCallParser] | None:
    """The tool-call format a chat template teaches its model, told by the markers it writes: GLM's
    ``<arg_key>``, Kimi-K2's ``<|tool_calls_section_begin|>``, DeepSeek's ``<｜tool▁calls▁begin｜>``,
    Mistral's ``[TOOL_CALLS]`` / ``[AVAILABLE_TOOLS]``, else Hermes / Qwen3's ``<tool_call>`` (also the
    default for templates that render ``tools`` some other way). None when the template has no tools,
    and for harmony templates (see :func:`uses_harmony`). A factory: ``factory(tools) -> parser``."""
    if not template or uses_harmony(template):
        return None
    if GLM_KEY in template:
        return glm_tool_parser
    if KIMI_SECTION_BEGIN in template:
        return kimi_tool_parser
    if DS_CALLS_BEGIN in template:
        return deepseek_tool_parser
    if MISTRAL_CALLS in template or "[AVAILABLE_TOOLS]" in template:
        return mistral_tool_parser
    if TOOL_CALL_START in template or "tools" in template:
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


# --- harmony (GPT-OSS) ----------------------------------------------------------------------------

_H_MARKERS = (H_START, H_CHANNEL, H_CONSTRAIN, H_MESSAGE, H_END, H_CALL, H_RETURN)
_H_CLOSE = (H_END, H_CALL, H_RETURN)
# how a message header may begin: after <|start|> (the prompt ends with "<|start|>assistant") comes the
# role, a recipient ("to=functions.f") and/or "<|channel|>"
_H_HEADS = (H_START, H_CHANNEL, H_CONSTRAIN, "to=", "assistant" + H_CHANNEL, "assistant to=", "assistant" + H_CONSTRAIN)
_H_CHANNEL_NAME = re.compile(re.escape(H_CHANNEL) + r"\s*(\w+)")
_H_RECIPIENT = re.compile(r"to=([^\s<]+)")


def _strip_markers(text: str) -> str:
    for m in _H_MARKERS:
        text = text.replace(m, "")
    return text


def _first(buf: str, markers: Iterable[str]) -> tuple[int, str]:
    """(index, marker) of the first of ``markers`` in ``buf``; (-1, "") when none occurs."""
    best = (-1, "")
    for m in markers:
        i = buf.find(m)
        if i >= 0 and (best[0] < 0 or i < best[0]):
            best = (i, m)
    return best


class HarmonyParser:
    """GPT-OSS output (OpenAI's harmony format) -> parts, message by message.

    A message is a header, ``<|message|>``, a body and ``<|end|>`` / ``<|call|>`` / ``<|return|>`` (the
    last two are stop tokens, so the output usually just ends). The header holds the channel
    (``<|channel|>analysis``) and maybe a recipient (``to=functions.f``, before or after the channel)
    and a content type (``<|constrain|>json`` or `` json``). ``analysis`` bodies are reasoning; a body
    sent to ``functions.f`` is a call of ``f`` (with ``tools``; its JSON arguments, whole); every other
    body (``final``, ``commentary`` preambles, built-in tools) is content. Headers never reach the
    client; text outside any message, or a header broken by a newline or a closing marker, is content.
    """

    markers = list(_H_MARKERS)
    stop_markers = [H_RETURN, H_CALL]

    def __init__(self, tools: bool = True):
        self.tools = tools
        self.state = "between"    # between messages | header | body
        self._kind = "content"    # the body's: reasoning | content | call
        self._name = ""
        self._buf = ""
        self._fresh = False       # the body has shown nothing yet
        self._after_start = False  # the header follows <|start|>: surely markup, even cut off
        self._last = ""           # kind of the last text shown (messages of one kind are set apart)
        self.num_calls = 0

    def _text(self, kind: str, text: str, out: list[Part]) -> None:
        if not text:
            return
        if self._fresh and self._last == kind:
            text = "\n\n" + text
        self._fresh, self._last = False, kind
        out.append(Part(kind, text))

    def _open(self, header: str) -> None:
        """Start a body after ``header``."""
        recipient = _H_RECIPIENT.search(header)
        channel = _H_CHANNEL_NAME.search(header)
        if recipient is not None:
            to = recipient.group(1)
            self._kind, self._name = ("call", to[len("functions."):]) \
                if self.tools and to.startswith("functions.") else ("content", "")
        else:
            self._kind = "reasoning" if channel is not None and channel.group(1) == "analysis" else "content"
        self.state, self._fresh = "body", True

    def _call(self, body: str, out: list[Part]) -> None:
        args = _json_object_text(body.strip())
        if args is None or not _NAME.fullmatch(self._name):
            self._text("content", _strip_markers(body), out)
            return
        self.num_calls += 1
        out.append(Part("tool_call", call=ToolCall(self._name, args)))

    def push(self, text: str) -> list[Part]:
        self._buf += text
        out: list[Part] = []
        while True:
            buf = self._buf
            if self.state == "between":
                s = buf.lstrip()
                self._buf = s
                if not s:
                    return _merge(out)
                closing = next((m for m in _H_CLOSE if s.startswith(m)), None)
                if closing is not None:   # a stray closing marker
                    self._buf = s[len(closing):]
                elif s.startswith(H_START):
                    self._buf, self.state, self._after_start = s[len(H_START):], "header", True
                elif any(s.startswith(h) for h in _H_HEADS):
                    self.state, self._after_start = "header", False
                elif any(h.startswith(s) for h in _H_HEADS):
                    return _merge(out)    # maybe a header, in pieces
                else:
                    self.state, self._kind, self._fresh = "body", "content", True   # plain text
                continue
            if self.state == "header":
                i = buf.find(H_MESSAGE)
                header = buf if i < 0 else buf[:i]
                j, _ = _first(header, (H_START, *_H_CLOSE, "\n"))
                if j >= 0:    # not a header after all: its text is content
                    self._fresh = True
                    self._text("content", _strip_markers(buf[:j]), out)
                    self._buf, self.state, self._kind = buf[j:], "body", "content"
                    continue
                if i < 0:
                    return _merge(out)
                self._open(header)
                self._buf = buf[i + len(H_MESSAGE):]
                continue
            # body: up to the message's end, or a new message that did not wait for one
            i, marker = _first(buf, _H_MARKERS)
            if self._kind == "call":
                if i >= 0 and marker in (H_MESSAGE, H_CONSTRAIN):
                    i, marker = _first(buf, (H_START, H_CHANNEL, *_H_CLOSE))
                if i < 0:
                    return _merge(out)
                self._call(buf[:i], out)
            else:
                if i < 0:
                    cut = len(buf) - max(_held_prefix(buf, m) for m in _H_MARKERS)
                    self._text(self._kind, buf[:cut], out)
                    self._buf = buf[cut:]
                    return _merge(out)
                self._text(self._kind, buf[:i], out)
                if marker in (H_MESSAGE, H_CONSTRAIN):   # stray markup inside a body: dropped
                    self._buf = buf[i + len(marker):]
                    continue
            if marker == H_START:
                self._buf, self.state, self._after_start = buf[i + len(H_START):], "header", True
            elif marker == H_CHANNEL:
                self._buf, self.state, self._after_start = buf[i:], "header", False
            else:
                self._buf, self.state = buf[i + len(marker):], "between"

    def flush(self) -> list[Part]:
        out: list[Part] = []
        buf, self._buf = self._buf, ""
        if self.state == "body" and self._kind == "call":
            self._call(buf, out)   # <|call|> is a stop token: the output ends right after the arguments
        elif self.state == "body":
            self._text(self._kind, buf, out)
        elif self.state == "header":
            # a header cut off (max_tokens) is dropped; plain text that only looked like one ("to=me") is not
            if not self._after_start and not any(m in buf for m in _H_MARKERS):
                self._fresh = True
                self._text("content", buf, out)
        else:
            self._fresh = True
            self._text("content", buf, out)
        self.state = "between"
        return _merge(out)


# --- the whole output -----------------------------------------------------------------------------

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
