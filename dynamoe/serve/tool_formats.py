"""The tool-call formats of the model families (the table in :mod:`dynamoe.serve.parsing`): the body
parsers that turn the text between a format's markers into :class:`~dynamoe.serve.parsing.ToolCall`
objects (None when it is not a well-formed call), their :class:`~dynamoe.serve.parsing.ToolCallParser`
factories, and :func:`tool_parser_for`, which tells the format from the chat template."""
from __future__ import annotations

import json
import re
from typing import Callable, Iterable

from .harmony import uses_harmony
from .parsing import _NAME, ToolCall, ToolCallParser, _json_object_text, mistral_call_id

__all__ = ["hermes_tool_parser", "glm_tool_parser", "deepseek_tool_parser", "kimi_tool_parser", "mistral_tool_parser",
           "tool_parser_for", "string_params"]

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
GLM_KEY, GLM_KEY_END, GLM_VALUE, GLM_VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
KIMI_SECTION_BEGIN, KIMI_SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL_BEGIN, KIMI_ARGS, KIMI_CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"

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
