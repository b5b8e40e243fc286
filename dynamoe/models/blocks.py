"""The block allocator of the paged KV cache: fixed-size blocks of positions from one pool, reference
counted, and full blocks remembered by the tokens they hold so that other sequences can share them.

A block is *in use* while some sequence's block table holds it (refcount > 0). When its last user lets
go it becomes *free* -- or, when it is full and registered under its prefix key (:func:`prefix_keys`),
*cached*: still free for allocation, but it keeps its contents and can be taken back by
:meth:`BlockPool.lookup` until it is evicted. Allocation takes uncached free blocks first, then evicts the
least recently released cached block.

Placement keeps each sequence's blocks consecutive where it can, because the cache reads a consecutive run
as one view and must gather (copy) anything else on every forward -- at an 11k-token context that copy cost
as much as the attention itself. A sequence's next block is the one after its last when that is free; a
new run (a sequence's first block, or the next one when its neighbour took the block after it) starts in the
middle of the largest run of free blocks (at its start when nothing precedes it), leaving room on both sides:
for whoever ends just before that run, and for the new sequence to grow. Sequences that grow side by side --
a long prompt prefilling in chunks beside decoding streams -- then each stay one run.

Pure Python, no tensors: the KV cache (:mod:`dynamoe.models.cache`) owns the storage and the block tables.
"""
from __future__ import annotations

import collections
import hashlib
import re
from array import array
from typing import Callable, Iterable, Sequence

__all__ = ["BlockPool", "OutOfBlocks", "prefix_keys"]

_FREE_RUN = re.compile(rb"\x01+")   # a run of set bytes in BlockPool._is_free


class OutOfBlocks(RuntimeError):
    """The pool has no free block left (every block is held by some sequence)."""


def prefix_keys(tokens: Sequence[int], block_size: int, start: int = 0, parent: bytes | None = None) -> list[bytes]:
    """Key of every full block of ``tokens`` from block ``start`` on: a 128-bit digest of the whole prefix up to
    the end of that block (chained: each key hashes the previous one with the block's tokens), so equal keys mean
    equal prefixes. ``parent``: the key of block ``start - 1`` (None at block 0)."""
    keys = []
    prev = parent or b""
    for b in range(start, len(tokens) // block_size):
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(array("q", tokens[b * block_size:(b + 1) * block_size]).tobytes())
        prev = h.digest()
        keys.append(prev)
    return keys


class BlockPool:
    """``num_blocks`` blocks: allocation, reference counts and the prefix-keyed cache of full blocks."""

    def __init__(self, num_blocks: int):
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._is_free = bytearray(b"\x01") * num_blocks  # 1 for each uncached free block
        self._n_free = num_blocks
        self._refs = [0] * num_blocks
        self._key_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # refcount 0, keyed; LRU first
        self.hits = self.queries = 0                   # blocks found / looked up (prefix-cache hit rate)

    # --- counts -------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now (uncached free ones and evictable cached ones)."""
        return self._n_free + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Free blocks that still hold a registered prefix."""
        return len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def refcount(self, block: int) -> int:
        return self._refs[block]

    # --- allocation ---------------------------------------------------------------------------------
    def allocate(self, prefer: int | None = None) -> int:
        """A block for new contents (refcount 1): ``prefer`` when it is free and uncached, else the start of a new
        run in the largest run of free blocks (see the module docstring), else the least recently released cached
        one; :class:`OutOfBlocks` when none is free."""
        if prefer is not None and 0 <= prefer < self.num_blocks and self._is_free[prefer]:
            b = prefer
        elif self._n_free:
            b = self._new_run_start()
        elif self._cached:
            b, _ = self._cached.popitem(last=False)   # evict the least recently released prefix
            del self._block_of[self._key_of.pop(b)]
            self._refs[b] = 1
            return b
        else:
            raise OutOfBlocks(f"all {self.num_blocks} KV cache blocks are in use")
        self._is_free[b] = 0
        self._n_free -= 1
        self._refs[b] = 1
        return b

    def _new_run_start(self) -> int:
        """Where a new run of blocks starts: the middle of the largest run of uncached free blocks (the first of the
        largest), or its start when it begins at block 0. (Called only when a free block exists.)"""
        best = max(_FREE_RUN.finditer(self._is_free), key=lambda m: m.end() - m.start())
        a, z = best.span()
        return a if a == 0 else a + (z - a) // 2

    def allocate_many(self, n: int) -> list[int]:
        """``n`` blocks, as one run where the pool has one free (see :meth:`allocate`), or none at all
        (:class:`OutOfBlocks`) when fewer are free."""
        if n > self.num_free:
            raise OutOfBlocks(f"{n} KV cache blocks needed, {self.num_free} of {self.num_blocks} free")
        out: list[int] = []
        for _ in range(n):
            out.append(self.allocate(prefer=out[-1] + 1 if out else None))
        return out

    def retain(self, block: int) -> None:
        """One more user of ``block`` (a cached block is taken out of the evictable set)."""
        if self._refs[block] == 0:
            if block not in self._cached:
                raise ValueError(f"block {block} is free; only held or cached blocks can be retained")
            del self._cached[block]
        self._refs[block] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """One user fewer of each block; a block nobody holds becomes cached (when keyed) or free."""
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} released more often than it was held")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._key_of:
                    self._cached[b] = None
                else:
                    self._push_free(b)

    # --- the prefix cache ---------------------------------------------------------------------------
    def register(self, block: int, key: bytes, replace: bool = False) -> bool:
        """Remember that held block ``block`` is full and holds the prefix ``key``. A key already held by
        another block keeps that one (the new block stays a private copy) unless ``replace``: then the other block
        just loses its key (its holders keep it; unheld, it is free). True when ``block`` is now the one
        :meth:`lookup` finds for ``key``."""
        if self._refs[block] <= 0:
            raise ValueError(f"block {block} is not held; only a sequence's own full blocks are registered")
        if block in self._key_of:
            return self._key_of[block] == key
        old = self._block_of.get(key)
        if old is not None:
            if not replace:
                return False
            del self._key_of[old]
            if old in self._cached:
                del self._cached[old]
                self._push_free(old)
        self._key_of[block] = key
        self._block_of[key] = block
        return True

    def holder(self, key: bytes) -> int | None:
        """The block :meth:`lookup` finds for ``key`` (None), without retaining it."""
        return self._block_of.get(key)

    def shared(self, block: int) -> bool:
        """Whether writing into ``block`` would change what others read: another sequence holds it too, or it
        is registered (a later sequence may take it by its prefix)."""
        return self._refs[block] > 1 or block in self._key_of

    def unregister(self, block: int) -> None:
        """Forget ``block``'s prefix key (its holder is about to overwrite it)."""
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._block_of[key]

    def lookup(self, keys: Sequence[bytes], usable: Callable[[int, int], bool] | None = None) -> list[int]:
        """The blocks holding the longest run of ``keys`` from the first, each retained for the caller;
        ``usable(i, block)`` False for the i-th block found ends the run there (a caller that needs more of a
        block than its key says)."""
        found = []
        for k in keys:
            b = self._block_of.get(k)
            if b is None or (usable is not None and not usable(len(found), b)):
                break
            self.retain(b)
            found.append(b)
        self.queries += len(keys)
        self.hits += len(found)
        return found

    def forget_cached(self) -> int:
        """Drop every cached (unheld) prefix, e.g. after the model's weights changed; returns how many."""
        n = len(self._cached)
        for b in self._cached:
            del self._block_of[self._key_of.pop(b)]
            self._push_free(b)
        self._cached.clear()
        return n

    def _push_free(self, b: int) -> None:
        self._is_free[b] = 1
        self._n_free += 1

    def check(self) -> None:
        """Assert the invariants (tests): every block exactly one of held / cached / free, keys consistent."""
        free = {b for b in range(self.num_blocks) if self._is_free[b]}
        assert self._n_free == len(free)
        for b in range(self.num_blocks):
            states = (self._refs[b] > 0) + (b in self._cached) + (b in free)
            assert states == 1, f"block {b}: refs {self._refs[b]}, cached {b in self._cached}, free {b in free}"
            assert self._refs[b] >= 0
        for b in self._cached:
            assert b in self._key_of
        assert all(self._block_of[k] == b for b, k in self._key_of.items())
        assert len(self._block_of) == len(self._key_of)
