"""Prefix caching over the paged KV cache: full blocks are shared by every request whose tokens begin
with the same prefix, concurrent requests included.

Each request keeps the prefix keys of its full blocks (:func:`~dynamoe.models.blocks.prefix_keys`: a
digest of all tokens up to the end of the block). After every forward the blocks it filled are
registered in the cache's :class:`~dynamoe.models.blocks.BlockPool` under those keys; a request being
admitted looks its keys up and starts on the blocks found (held, never written: it computes only the
positions after them). A block nobody holds stays cached until the pool needs it (least recently
released first). The last token of a request's tokens is always computed -- its logits start the output --
so at most ``(n - 1) // block_size`` blocks are taken from the cache.
"""
from __future__ import annotations

from ..models.blocks import prefix_keys
from .request import Request

__all__ = ["PrefixCache"]


class PrefixCache:
    """The engine's use of the pool's prefix keys (``enabled`` False: requests share nothing)."""

    def __init__(self, cache, enabled: bool):
        self.cache, self.enabled = cache, bool(enabled)

    def _keys(self, r: Request, blocks: int) -> list[bytes]:
        """``r``'s first ``blocks`` prefix keys (computed once, extended as it grows)."""
        keys = r._keys
        if len(keys) < blocks:
            bs = self.cache.block_size
            tokens = r.tokens(len(keys) * bs, blocks * bs)
            keys.extend(prefix_keys(tokens, bs, parent=keys[-1] if keys else None))
        return keys[:blocks]

    def attach(self, r: Request) -> int:
        """Start the newly admitted ``r`` (in its empty slot) on the cached blocks of its longest cached
        prefix; returns the positions it need not compute."""
        if not self.enabled:
            r._computed = r._registered = 0
            return 0
        blocks = self.cache.pool.lookup(self._keys(r, (r.num_tokens - 1) // self.cache.block_size))
        n = len(blocks) * self.cache.block_size
        self.cache.attach(r.slot, blocks, n)
        r._computed = n
        r._registered = len(blocks)
        return n

    def register(self, reqs: list[Request]) -> None:
        """Register the blocks the last forward filled (of requests still holding their slot)."""
        if not self.enabled:
            return
        bs, pool = self.cache.block_size, self.cache.pool
        for r in reqs:
            full = r._computed // bs
            if r.slot is None or full <= r._registered:
                continue
            keys, blocks = self._keys(r, full), self.cache.blocks(r.slot)
            for i in range(r._registered, full):
                pool.register(blocks[i], keys[i])
            r._registered = full
