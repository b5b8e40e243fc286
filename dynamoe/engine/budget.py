"""How many prompt tokens a step may prefill beside running decodes: the largest chunk whose time stays
within a target (a few decode steps), from a cost model fitted as the engine runs.

A prefill chunk of ``n`` tokens costs about ``a + b * n`` seconds: ``a`` is what a forward costs whatever
its size (reading the weights, the attention over the cached keys -- large for a long context), ``b`` each
token's own share. :class:`ChunkCost` fits ``a`` and ``b`` by least squares over exponentially weighted
past chunks (their sizes vary as the budget moves, which is what makes the fit possible) and answers the
largest ``n`` within a time. Where even one token costs more than the target (the fixed part alone is
over it: a long context on a slow machine), stalls cannot be kept within it by chunk size; then the chunk
is sized so that its own tokens cost as much as the fixed part (``n = a / b``): at most twice the least
possible stall, for a useful amount of progress. (While it has seen one chunk size only, and that took longer than
the target, it asks for twice that size once: one size cannot tell a fixed part from a per-token cost, and reading
it all as per-token cost would keep every later chunk at the least size, however large the fixed part.) The fit is
trusted only near the chunk sizes it saw: an
answer is at most twice their (weighted) mean plus one (or :data:`GROWTH_FLOOR`), so the budget grows step
by step, never by a jump a noisy fit suggests.
"""
from __future__ import annotations

__all__ = ["ChunkCost"]

#: the least spread of the chunk sizes seen (standard deviation / mean) the fit reads a slope from
SPREAD = 0.2

#: a chunk the fit may always ask for, whatever sizes it saw (short prompts alone would hold it down)
GROWTH_FLOOR = 128


class ChunkCost:
    """Online least-squares fit of chunk time = a + b * tokens (see the module docstring)."""

    def __init__(self, weight: float = 0.15):
        self.weight = weight
        self._m = None   # weighted means of n, t, n*n, n*t

    def observe(self, tokens: int, seconds: float) -> None:
        x = (float(tokens), seconds, float(tokens) ** 2, tokens * seconds)
        if self._m is None:
            self._m = list(x)
        else:
            w = self.weight
            self._m = [m + w * (v - m) for m, v in zip(self._m, x)]

    def fit(self) -> tuple[float, float] | None:
        """(a, b) seconds, or None before anything was seen."""
        if self._m is None:
            return None
        n, t, nn, nt = self._m
        if self._degenerate():   # one chunk size so far: all of it per token (the cautious reading)
            return 0.0, t / max(n, 1.0)
        b = max((nt - n * t) / (nn - n * n), 1e-12)
        a = max(t - b * n, 0.0)
        return a, b

    def tokens_within(self, seconds: float, cap: int) -> int | None:
        """The largest chunk (1..cap) expected to take at most ``seconds``; None before any observation."""
        ab = self.fit()
        if ab is None:
            return None
        a, b = ab
        seen = self._m[0]
        if self._m[1] > seconds and self._degenerate():
            # one chunk size so far, and it took longer than the target: whether a smaller chunk would be quicker
            # (per-token cost) or not (a fixed part) cannot be told from one size -- try twice the size once, so that
            # the fit sees two (a fixed part over the target then gets chunks of a / b tokens, not the least ones)
            # (where the cap holds it at that size, half of it)
            size = int(seen)
            return max(1, min(cap, 2 * size) if size < cap else size // 2)
        n = (seconds - a) / b if seconds > a + b else a / b
        return max(1, min(cap, int(n), max(int(2 * seen) + 1, GROWTH_FLOOR)))

    def _degenerate(self) -> bool:
        """Whether the sizes seen are (about) one: their spread under a fifth of their mean -- two nearby sizes
        give a slope that is all noise."""
        n, _, nn, _ = self._m
        return nn - n * n <= (SPREAD * n) ** 2

