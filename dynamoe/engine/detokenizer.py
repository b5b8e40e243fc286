"""Streaming text out of a token stream: per-token text deltas and stop strings.

:class:`IncrementalDecoder` turns token ids into text deltas whose concatenation is the decoded
text. Decoding one token at a time is wrong twice over: a UTF-8 character may span several
byte-level tokens (each alone decodes to U+FFFD), and sentencepiece-style decoders drop the space of
a leading '▁'. So it decodes a short window of previous tokens with and without the new ones and
emits the new suffix, and holds text back while it ends with U+FFFD (an unfinished character).

:class:`StopStrings` cuts the text at the first stop string and holds back any tail that could be the
start of one, so no part of a stop string ever reaches the client.

:func:`decode_keeping` decodes like ``skip_special_tokens=True`` but keeps the special tokens it is
given: the markers an output parser reads (GPT-OSS's ``<|channel|>``, GLM's ``<tool_call>``...).
"""
from __future__ import annotations

from typing import Callable, Collection, Sequence

__all__ = ["IncrementalDecoder", "StopStrings", "special_token_ids", "decode_keeping"]

_REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    """Text deltas for a growing token sequence.

    ``decode`` is a function ``list[int] -> str`` (e.g. ``Tokenizer.decode``). ``context`` are tokens
    already shown (the prompt's tail), used only so that the first new token decodes in context.
    ``max_pending`` bounds how many tokens are held back while the text ends in U+FFFD (a model can
    emit bytes that never form a character); past it, the text is emitted as is.
    """

    def __init__(self, decode, context: Sequence[int] = (), max_pending: int = 8):
        self._decode = decode
        ctx = list(context)[-6:]
        self.ids: list[int] = ctx
        self._prefix = 0           # start of the decode window
        self._read = len(ctx)      # tokens before this are emitted
        self._prefix_text = self._decode(ctx) if ctx else ""
        self.max_pending = max_pending

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while a character is unfinished)."""
        self.ids.append(int(token_id))
        text = self._decode(self.ids[self._prefix:])
        if len(text) > len(self._prefix_text) and (not text.endswith(_REPLACEMENT)
                                                   or len(self.ids) - self._read > self.max_pending):
            return self._advance(text)
        return ""

    def flush(self) -> str:
        """Text still held back (an unfinished character decodes to U+FFFD); call once at the end."""
        if len(self.ids) == self._read:
            return ""
        text = self._decode(self.ids[self._prefix:])
        return self._advance(text) if len(text) > len(self._prefix_text) else ""

    def _advance(self, text: str) -> str:
        delta = text[len(self._prefix_text):]
        # the next window starts at the tokens just emitted, so it begins on a character boundary
        self._prefix, self._read = self._read, len(self.ids)
        self._prefix_text = self._decode(self.ids[self._prefix:self._read])
        return delta


def special_token_ids(tokenizer) -> frozenset[int]:
    """Ids of the tokens ``tokenizer.decode(..., skip_special_tokens=True)`` skips: the added tokens marked
    special (``tokenizer`` is a :class:`~dynamoe.engine.Tokenizer` or a ``tokenizers.Tokenizer``)."""
    backend = getattr(tokenizer, "backend", tokenizer)
    added = backend.get_added_tokens_decoder() if hasattr(backend, "get_added_tokens_decoder") else {}
    return frozenset(i for i, t in added.items() if t.special)


def decode_keeping(tokenizer, keep_ids: Collection[int], special_ids: Collection[int] | None = None
                   ) -> Callable[[Sequence[int]], str]:
    """A ``decode(ids) -> str`` that skips special tokens except ``keep_ids``; plain ``tokenizer.decode``
    when there is nothing to keep. ``special_ids``: :func:`special_token_ids` of ``tokenizer``, if known."""
    keep = frozenset(int(i) for i in keep_ids)
    if not keep:
        return tokenizer.decode
    drop = frozenset(special_token_ids(tokenizer) if special_ids is None else special_ids) - keep

    def decode(ids: Sequence[int]) -> str:
        return tokenizer.decode([i for i in ids if i not in drop], skip_special_tokens=False)
    return decode


class StopStrings:
    """Cut streamed text at the first of ``stops``; hold back text that may begin a stop string.

    ``push(delta) -> (text to emit, matched stop string or None)``; after a match nothing more is
    emitted. ``flush()`` returns the held-back text once the stream ends without a match.
    """

    def __init__(self, stops: Sequence[str] = ()):
        if isinstance(stops, str):
            stops = [stops]
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty str, got {s!r}")
        self.stops = list(dict.fromkeys(stops))
        self._held = ""
        self.matched: str | None = None

    def push(self, delta: str) -> tuple[str, str | None]:
        if self.matched is not None:
            return "", self.matched
        if not self.stops:
            return delta, None
        buf = self._held + delta
        best = None
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            self._held = ""
            self.matched = best[1]
            return buf[: best[0]], best[1]
        # hold the longest tail that is a prefix of some stop string
        keep = 0
        for k in range(min(len(buf), max(map(len, self.stops)) - 1), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                keep = k
                break
        self._held = buf[len(buf) - keep:]
        return buf[: len(buf) - keep], None

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.matched is not None else held
