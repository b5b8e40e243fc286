"""GPT-OSS output in OpenAI's harmony format -> reasoning, content and tool-call parts (see the table in
:mod:`dynamoe.serve.parsing`)."""
from __future__ import annotations

import re
from typing import Iterable

from .parsing import _NAME, Part, ToolCall, _held_prefix, _json_object_text, _merge

__all__ = ["HarmonyParser", "uses_harmony"]

H_START, H_CHANNEL, H_CONSTRAIN, H_MESSAGE = "<|start|>", "<|channel|>", "<|constrain|>", "<|message|>"
H_END, H_CALL, H_RETURN = "<|end|>", "<|call|>", "<|return|>"


def uses_harmony(template: str | None) -> bool:
    """Whether the chat template speaks OpenAI's harmony format (GPT-OSS): its output goes through
    :class:`HarmonyParser`, reasoning and tool calls alike."""
    return bool(template) and H_CHANNEL in template


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
