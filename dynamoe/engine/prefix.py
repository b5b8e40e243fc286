"""Prefix caching over the paged KV cache: full blocks are shared by every request whose tokens begin
with the same prefix, concurrent requests included.

Each request keeps the prefix keys of its full blocks (:func:`~dynamoe.models.blocks.prefix_keys`: a
digest of all tokens up to the end of the block). After every forward the blocks it filled are
registered in the cache's :class:`~dynamoe.models.blocks.BlockPool` under those keys; a request being
admitted looks its keys up and starts on the blocks found (held, never written: it computes only the
positions after them). A block nobody holds stays cached until the pool needs it (least recently
released first). The last token of a request's tokens is always computed -- its logits start the output --
so at most ``(n - 1) // block_size`` blocks are taken from the cache.

Multi-token-prediction heads (the engine's ``draft="mtp"``, :mod:`dynamoe.models.mtp`) keep cache entries of
their own in the same blocks, and the head's entry at position p depends on the token *after* p as well. So
the prefix cache remembers, per registered block, the token that followed it when the head wrote the block's
entries (none when the head did not run there: a sampled request's blocks, say). A request that runs the head
takes a cached block only where that token is its own next one (the block's key says the rest), and computes
the other positions itself: it never reads head entries that were not written, or written for another
continuation. A block with head entries takes over the key of an equal block without them.

Where keys and values depend on where the prompt ended (``prompt_scope``, the model's
``positions_independent_of_prompt``), the blocks past the positions that do not are keyed with the prompt length
too: Unlimited-OCR's attention keeps the prompt in sight and slides over generated tokens, so a block wholly inside
the prompt keys as usual and the ones from the first block that reaches past it are salted; dynamic NTK RoPE past
max_position_embeddings rotates a whole prompt with its length, so all its blocks are. A preempted request finds
its own blocks again, and a request whose prompt holds another's output (a chat's next turn) computes those
positions as its prompt instead of reading keys and values made as output.
"""
from __future__ import annotations

import hashlib

from ..models.blocks import prefix_keys
from .request import Request

__all__ = ["PrefixCache"]


class PrefixCache:
    """The engine's use of the pool's prefix keys (``enabled`` False: requests share nothing)."""

    def __init__(self, cache, enabled: bool, prompt_scope=None):
        """``prompt_scope(prompt_tokens) -> int | None``: the leading positions whose keys and values do not depend
        on where the prompt ends (None: all; the model's ``positions_independent_of_prompt``)."""
        self.cache, self.enabled, self.prompt_scope = cache, bool(enabled), prompt_scope
        # registered block -> the token after it when its MTP head entries were written (absent: not written)
        self._head_next: dict[int, int] = {}

    def _keys(self, r: Request, blocks: int) -> list[bytes]:
        """``r``'s first ``blocks`` prefix keys (computed once, extended as it grows)."""
        keys = r._keys
        bs = self.cache.block_size
        # blocks before ``inside`` key by their tokens alone; the later ones by the prompt length too (see the module
        # docstring)
        free = None if self.prompt_scope is None else self.prompt_scope(len(r.prompt_ids))
        inside = blocks if free is None else free // bs
        while len(keys) < blocks:
            start = len(keys)
            end = min(blocks, inside) if start < inside else blocks
            parent = keys[-1] if keys else None
            if start == inside:
                salt = hashlib.blake2b(parent or b"", digest_size=16)
                salt.update(b"prompt length %d" % len(r.prompt_ids))
                parent = salt.digest()
            new = prefix_keys(r.tokens(start * bs, end * bs), bs, parent=parent)
            keys.extend(new)
            if len(new) < end - start:   # (fewer tokens than blocks asked for: the keys there are)
                break
        return keys[:blocks]

    def attach(self, r: Request) -> int:
        """Start the newly admitted ``r`` (in its empty slot) on the cached blocks of its longest cached
        prefix; returns the positions it need not compute. A request that runs the MTP head (``r._mtp_draft``
        not None) takes only blocks whose head entries were written for its own next token."""
        r._head_len = 0
        if not self.enabled:
            r._computed = r._registered = 0
            return 0
        bs = self.cache.block_size
        usable = None
        if r._mtp_draft is not None:
            def usable(i: int, block: int) -> bool:
                return self._head_next.get(block) == r.tokens((i + 1) * bs, (i + 1) * bs + 1)[0]
        blocks = self.cache.pool.lookup(self._keys(r, (r.num_tokens - 1) // bs), usable)
        n = len(blocks) * bs
        self.cache.attach(r.slot, blocks, n)
        r._computed = n
        r._registered = len(blocks)
        if r._mtp_draft is not None:
            r._head_len = n
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
                head = r._head_len >= (i + 1) * bs   # the MTP head ran over the block, its last position too
                held = pool.holder(keys[i])
                # a block with head entries takes the key from one without (requests drafting with the head can
                # use it; the others, whatever block it is)
                replace = head and held is not None and held != blocks[i] and held not in self._head_next
                if pool.register(blocks[i], keys[i], replace=replace):
                    if head:
                        self._head_next[blocks[i]] = r.tokens((i + 1) * bs, (i + 1) * bs + 1)[0]
                    else:
                        self._head_next.pop(blocks[i], None)
            r._registered = full
