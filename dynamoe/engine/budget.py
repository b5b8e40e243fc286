"""How many prompt tokens a step may prefill beside running decodes: the largest chunk whose time stays
within a target (a few decode steps), from a cost model fitted as the engine runs.

A prefill chunk of ``n`` tokens costs about ``a + b * n`` seconds: ``a`` is what a forward costs whatever
its size (reading the weights, the attention over the cached keys -- large for a long context), ``b`` each
token's own share. :class:`ChunkCost` fits ``a`` and ``b`` by least squares over exponentially weighted
past chunks (their sizes vary as the budget moves, which is what makes the fit possible) and answers the
largest ``n`` within a time. Where even one token costs more than the target (the fixed part alone is
over it: a long context on a slow machine), stalls cannot be kept within it by chunk size; then the chunk
is sized so that its own tokens cost as much as the fixed part (``n = a / b``): at most twice the least
possible stall, for a useful amount of progress. (While it has seen about one chunk size only, and that took
longer than the target, it asks for half that size: one size cannot tell a fixed part from a per-token cost, and
reading it all as per-token cost would keep every later chunk at the least size, however large the fixed part.
Half, not twice: the probe stalls no longer than the last chunk; twice only from the least chunk the caller
runs. Once the budget settles on one size, the sizes are about one again: the fit then keeps the last slope it
could read, scaled to what that size takes now -- a growing context makes every chunk dearer -- instead of
probing again.) The fit is trusted only near the chunk sizes it saw: an answer is at most twice their
(weighted) mean plus one (or :data:`GROWTH_FLOOR`), so the budget grows step by step, never by a jump a noisy
fit suggests.
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
        self._shape = None   # the last (a, b) read from sizes that were not about one

    def observe(self, tokens: int, seconds: float) -> None:
        x = (float(tokens), seconds, float(tokens) ** 2, tokens * seconds)
        if self._m is None:
            self._m = list(x)
        else:
            w = self.weight
            self._m = [m + w * (v - m) for m, v in zip(self._m, x)]
        if not self._degenerate():
            n, t, nn, nt = self._m
            b = max((nt - n * t) / (nn - n * n), 1e-12)
            self._shape = (max(t - b * n, 0.0), b)

    def fit(self) -> tuple[float, float] | None:
        """(a, b) seconds, or None before anything was seen."""
        if self._m is None:
            return None
        n, t, _, _ = self._m
        if not self._degenerate():
            return self._shape
        if self._shape is None:   # one chunk size so far: all of it per token (the cautious reading)
            return 0.0, t / max(n, 1.0)
        a, b = self._shape        # settled on one size: the last slope read, scaled to that size's time now
        f = t / (a + b * n)
        return a * f, b * f

    def tokens_within(self, seconds: float, cap: int, least: int = 1) -> int | None:
        """The largest chunk (1..cap) expected to take at most ``seconds``; None before any observation. ``least``:
        the smallest chunk the caller runs (a probe for a second size goes up from there)."""
        ab = self.fit()
        if ab is None:
            return None
        a, b = ab
        seen = self._m[0]
        if self._m[1] > seconds and self._degenerate() and self._shape is None:
            # one chunk size so far, and it took longer than the target: whether a smaller chunk would be quicker
            # (per-token cost) or not (a fixed part) cannot be told from one size -- try half the size, so that the
            # fit sees two (a fixed part over the target then gets chunks of a / b tokens, not the least ones);
            # twice the size would tell as well, but stall twice as long -- unless half is below the least chunk.
            size = min(cap, int(seen))
            return size // 2 if size // 2 >= max(least, 1) else max(1, min(cap, 2 * size))
        n = (seconds - a) / b if seconds > a + b else a / b
        return max(1, min(cap, int(n), max(int(2 * seen) + 1, GROWTH_FLOOR)))

    def _degenerate(self) -> bool:
        """Whether the sizes seen are (about) one: their spread under a fifth of their mean -- two nearby sizes
        give a slope that is all noise."""
        n, _, nn, _ = self._m
        return nn - n * n <= (SPREAD * n) ** 2

