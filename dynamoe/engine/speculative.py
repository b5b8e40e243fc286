"""Speculative decoding with n-gram (prompt lookup) drafts: no draft model.

A decoding request's last ``n`` tokens (``n`` from ``max_ngram`` down to ``min_ngram``) are looked up in
everything before them (prompt and output); the ``k`` tokens that followed their most recent earlier
occurrence are the draft. The engine feeds the last token and the draft in one forward and keeps the
draft's longest prefix that equals the model's own greedy choices, plus the model's next token after it:
1..k+1 tokens for one pass over the weights, exactly the tokens greedy decoding makes one at a time. Code
edits, quoted documents and an agent harness's repeated context (Claude Code re-sends files it read) are
where drafts hit.

:class:`NgramIndex` keeps, per ``n``, the position after the most recent occurrence of every n-gram, grown
incrementally, so drafting costs a few dictionary lookups per step whatever the context length.
"""
from __future__ import annotations

__all__ = ["NgramIndex", "DEFAULT_MAX_NGRAM", "DEFAULT_MIN_NGRAM"]

#: longest and shortest suffix looked up: longer matches first (they predict better), down to ...
DEFAULT_MAX_NGRAM = 4
DEFAULT_MIN_NGRAM = 2


class NgramIndex:
    """Where each n-gram of a growing token list last ended (see the module docstring)."""

    def __init__(self, max_ngram: int = DEFAULT_MAX_NGRAM, min_ngram: int = DEFAULT_MIN_NGRAM):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.sizes = range(max_ngram, min_ngram - 1, -1)
        self._ends: dict[tuple, int] = {}   # n-gram -> position right after its most recent indexed occurrence
        self._indexed = 0                   # n-grams ending at positions < this are in _ends

    def draft(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest suffix of
        ``tokens`` found; [] when none is."""
        L = len(tokens)
        ends = self._ends
        for e in range(max(self._indexed, 1), L):   # index every n-gram ending before the suffix's end
            for n in self.sizes:
                if e >= n:
                    ends[tuple(tokens[e - n:e])] = e
        self._indexed = max(self._indexed, L)
        for n in self.sizes:
            if L <= n:
                continue
            p = ends.get(tuple(tokens[L - n:]))
            if p is not None:
                return tokens[p:p + k]
        return []

    def forget_after(self, length: int) -> None:
        """The list was cut back to ``length`` tokens (not needed while it only grows)."""
        if length < self._indexed:
            self._ends = {g: e for g, e in self._ends.items() if e < length}
            self._indexed = length
