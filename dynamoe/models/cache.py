"""The paged KV cache: sequence slots whose positions live in fixed-size blocks of one shared pool.

Slots are what continuous batching needs: a sequence runs in a slot (``model(ids[B, T], cache=cache,
slots=tensor([s0, ...]))``, every row at its own position ``cache.lengths[slot]``), and ``cache.free(slot)``
makes the slot reusable at once. A slot holds no memory of its own: its *block table* lists the pool
blocks (``block_size`` positions each) that hold its positions in order, taken from the pool as the
sequence grows (:meth:`KVCache.check_room`, or ahead of time with :meth:`KVCache.reserve`) and given back
when it ends. Memory is ``num_blocks`` blocks however the positions are spread over the slots, so a pool
far smaller than ``num_slots * max_seq_len`` serves long contexts beside short ones. Full blocks can be
shared: :meth:`KVCache.attach` starts a sequence on blocks another one filled (the engine's prefix cache,
:mod:`dynamoe.models.blocks`).

Storage, per attention layer, by name (allocated on first use):

* :meth:`KVCache.kv_pool` -- paged tensors [K, num_blocks, block_size, d]: GQA's "k" and "v", MLA's latent
  and rope key, the sparse-attention indexer's keys. Layers write and read them through :meth:`KVCache.write`
  (positions -> blocks via the table); a sequence whose blocks are consecutive reads them as one view. A layer
  that reads only some positions (a window, every m-th) writes with :meth:`KVCache.put` and reads with
  :meth:`KVCache.gather`.
* :meth:`KVCache.buffer` -- per-slot tensors [num_slots, *shape]: fixed-size state of a sequence (e.g. a
  linear-attention layer's recurrent state), whatever its length. Such state summarises the whole prefix, so
  :meth:`KVCache.truncate` cannot cut it back -- except to a position inside the last forward, when that forward
  ran between :meth:`KVCache.begin_history` and :meth:`KVCache.end_history` (speculative decoding: a verification
  forward whose rejected drafts are cut off): then the layers recorded each buffer's value after every token
  (:meth:`KVCache.record`; :meth:`KVCache.record_windows` for a window of past inputs) and truncate puts the
  slot's back to the value after its last kept token -- or refuses, naming it, a buffer no layer recorded.

The model advances ``lengths`` once per forward, after all layers.

Each slot also knows where its sequence's prompt ends (:attr:`KVCache.prompt_lengths`): the engine declares it
when a request starts (:meth:`KVCache.declare_prompt`), else the first forward into the empty slot is the prompt
(:meth:`KVCache.prompt_lengths_for`). Only layers whose attention depends on it read it (Unlimited-OCR's
reference sliding window: the prompt stays in sight, generated tokens slide).

A cache whose every layer attends only to its last ``window`` positions (sliding-window attention on
all layers) gives back, on :meth:`KVCache.trim`, the blocks no later query can see: a long sequence then
holds about ``window`` positions of blocks, not all of its length.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from .blocks import BlockPool, OutOfBlocks

__all__ = ["KVCache", "OutOfBlocks", "DEFAULT_BLOCK_SIZE"]

#: positions per block: small enough that a shared prefix loses little at its end, large enough that the
#: block tables and the prefix keys cost nothing next to the attention itself
DEFAULT_BLOCK_SIZE = 16


def _positive_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    return v


class KVCache:
    """``num_slots`` sequences of up to ``max_seq_len`` positions over a pool of ``num_blocks`` blocks of
    ``block_size`` positions (default: enough blocks for every slot to fill up)."""

    def __init__(self, num_slots: int, max_seq_len: int, num_layers: int, dtype: torch.dtype = torch.float32,
                 device=None, *, block_size: int = DEFAULT_BLOCK_SIZE, num_blocks: int | None = None,
                 window: int | None = None):
        for name, v in (("num_slots", num_slots), ("max_seq_len", max_seq_len), ("num_layers", num_layers),
                        ("block_size", block_size)):
            _positive_int(name, v)
        self.num_slots, self.max_seq_len, self.block_size = num_slots, max_seq_len, block_size
        self.blocks_per_seq = -(-max_seq_len // block_size)
        self.num_blocks = _positive_int("num_blocks", num_slots * self.blocks_per_seq if num_blocks is None
                                        else num_blocks)
        if window is not None:
            _positive_int("window", window)
        self.window = window
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.pool = BlockPool(self.num_blocks)
        self.lengths = torch.zeros(num_slots, dtype=torch.long, device=self.device)
        #: where each slot's prompt ends (0: not declared yet)
        self.prompt_lengths = torch.zeros(num_slots, dtype=torch.long, device=self.device)
        self.block_tables = torch.zeros(num_slots, self.blocks_per_seq, dtype=torch.long, device=self.device)
        self.layers: list[dict[str, Tensor]] = [{} for _ in range(num_layers)]
        self._paged: list[Tensor] = []        # the kv_pool tensors of every layer
        self._blocks: list[list[int]] = [[] for _ in range(num_slots)]   # the tables, as lists
        self._consecutive = [0] * num_slots   # leading blocks of each table that are b0, b0+1, ...
        self._dropped = [0] * num_slots       # leading blocks given back by trim (out of every layer's window)
        self._mirror = False                  # tables set by set_blocks (a follower rank): never allocate
        self._history: list | None = None     # (layer, name, values [B, T, ...]) of one forward, see begin_history
        self._history_rows: dict[int, tuple[int, int]] = {}   # slot -> (row, first position) of that forward
        self._recorded: set[tuple[int, str]] = set()         # the (layer, name) of the history's records
        self._slot_buffers: list[tuple[int, str]] = []        # every per-slot buffer's (layer, name)

    # --- storage ------------------------------------------------------------------------------------
    def kv_pool(self, layer: int, name: str, heads: int, dim: int, dtype: torch.dtype | None = None) -> Tensor:
        """Layer ``layer``'s paged tensor ``name``, [heads, num_blocks, block_size, dim], zeros on first use
        (positions never written are read only under a mask, and must not be NaN)."""
        bufs = self.layers[layer]
        t = bufs.get(name)
        if t is None:
            t = torch.zeros(heads, self.num_blocks, self.block_size, dim, dtype=dtype or self.dtype, device=self.device)
            bufs[name] = t
            self._paged.append(t)
        return t

    def buffer(self, layer: int, name: str, *shape: int, dtype: torch.dtype | None = None) -> Tensor:
        """Layer ``layer``'s per-slot tensor ``name`` of shape [num_slots, *shape], zeros on first use. A
        sequence's state there is whatever its slot's previous user left: a layer treats it as empty when
        the row starts at position 0."""
        bufs = self.layers[layer]
        t = bufs.get(name)
        if t is None:
            t = torch.zeros(self.num_slots, *shape, dtype=dtype or self.dtype, device=self.device)
            bufs[name] = t
            self._slot_buffers.append((layer, name))
        return t

    @property
    def slot_state_bytes(self) -> int:
        """Bytes of one slot's per-slot buffers (conv windows, recurrent states) made so far: what a history keeps
        per row and token (:meth:`begin_history`)."""
        return sum(self.layers[layer][name][0].numel() * self.layers[layer][name].element_size()
                   for layer, name in self._slot_buffers)

    # --- per-token history of the per-slot buffers (rolling recurrent state back) --------------------------
    def begin_history(self) -> None:
        """Until :meth:`end_history`, keep what layers :meth:`record` of ONE forward: each per-slot buffer's value
        after every token, so that :meth:`truncate` can put a slot's buffers back to any position of that forward
        (cost: T copies of every recorded buffer for the batch, until end_history)."""
        self._history, self._history_rows, self._recorded = [], {}, set()

    def end_history(self) -> None:
        self._history, self._history_rows, self._recorded = None, {}, set()

    @property
    def keeps_history(self) -> bool:
        """Whether layers should :meth:`record` their per-slot buffers' values after every token."""
        return self._history is not None

    def record(self, layer: int, name: str, slots_B: Tensor, values_BT: Tensor) -> None:
        """``buffer(layer, name)``'s rows for ``slots_B`` after each of the forward's T tokens, [B, T, *shape]
        (the last equals what the layer leaves in the buffer); only while :attr:`keeps_history`."""
        if self._history is None:
            raise ValueError("record() is only meaningful between begin_history() and end_history()")
        if (layer, name) in self._recorded:
            raise ValueError(f"layer {layer} recorded {name!r} twice: a history holds one forward (call "
                             f"begin_history() before each)")
        if not self._history_rows:   # (every record of a forward has its slots: one host sync per forward; the
            # lengths are the rows' first positions, the model advances them after all layers)
            starts = self.lengths[slots_B.to(self.lengths.device)]
            self._history_rows = {s: (b, n) for b, (s, n) in enumerate(zip(slots_B.tolist(), starts.tolist()))}
        self._history.append((layer, name, values_BT))
        self._recorded.add((layer, name))

    def record_windows(self, layer: int, name: str, slots_B: Tensor, stream: Tensor, width: int) -> None:
        """:meth:`record` for a buffer that holds a sliding window -- the last ``width`` entries, along the last dim,
        of a per-sequence stream (a convolution's past inputs, the last token ids): ``stream`` [B, ..., width + T] is
        the window before the forward followed by its T new entries, and the window after each token, [B, T, ...,
        width], is recorded in the buffer's dtype."""
        T = stream.size(-1) - width
        if width:
            windows = stream.unfold(-1, width, 1)[..., 1:, :]                    # [B, ..., T, width]
        else:
            windows = stream.new_zeros(*stream.shape[:-1], T, 0)
        self.record(layer, name, slots_B, windows.movedim(-2, 1).to(self.layers[layer][name].dtype))

    def _rewind(self, slot: int, length: int) -> None:
        """Put ``slot``'s recorded buffers back to their values after position ``length - 1`` (inside the
        recorded forward)."""
        row = self._history_rows.get(slot)
        if row is None:
            if self._history_rows or not self._slot_buffers:
                return   # (a slot the recorded forward did not hold, or a cache without per-slot state)
            raise ValueError(f"slot {slot}: cannot roll its per-slot state back: no layer recorded its buffers "
                             "(KVCache.record) in the history's forward")
        missing = [key for key in self._slot_buffers if key not in self._recorded]
        if missing:
            raise ValueError(f"slot {slot}: cannot roll its per-slot state back: layer {missing[0][0]}'s buffer "
                             f"{missing[0][1]!r} was not recorded (KVCache.record) in the history's forward; a model "
                             "that says recurrent_rollback must record every per-slot buffer")
        b, start = row
        t = length - start - 1
        if t < 0:
            raise ValueError(f"slot {slot}: cannot roll its per-slot state back to {length} positions, before the "
                             f"recorded forward's first ({start})")
        with torch.inference_mode():   # (buffers made by forwards under inference mode, as the engine runs them)
            for layer, name, values in self._history:
                self.layers[layer][name][slot] = values[b, t]

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block over every paged tensor allocated so far."""
        return sum(t[:, 0].numel() * t.element_size() for t in self._paged)

    def write(self, layer: int, slots_B: Tensor, positions_BT: Tensor, kv_len: int, **new: Tensor) -> dict[str, Tensor]:
        """Write each new tensor [B, K, T, d] at its rows' positions into the paged tensor of that name and
        return the batch's slots' first ``kv_len`` positions of each, [B, K, kv_len, d], in the new tensors'
        dtype (rows shorter than ``kv_len`` read finite filler past their end: mask it)."""
        pools = self.put(layer, slots_B, positions_BT, **new)
        return {name: self.rows(pools[name], slots_B, kv_len).to(t.dtype) for name, t in new.items()}

    def put(self, layer: int, slots_B: Tensor, positions_BT: Tensor, **new: Tensor) -> dict[str, Tensor]:
        """:meth:`write` without reading back: each new tensor [B, K, T, d] goes to its rows' positions in the paged
        tensor of that name; returns those paged tensors by name (for :meth:`gather`)."""
        pools = {}
        one_row = slots_B.device.type == "cpu" and positions_BT.device.type == "cpu" and slots_B.numel() == 1
        bs = self.block_size
        blk_BT = off_BT = None
        for name, t in new.items():
            _, K, T, d = t.shape
            pool = self.kv_pool(layer, name, K, d)
            if one_row and T == 1:  # one sequence's decode step: a plain copy, not an index_put
                p = int(positions_BT[0, 0])
                pool[:, self._blocks[int(slots_B[0])][p // bs], p % bs].copy_(t[0, :, 0])
            else:
                if blk_BT is None:
                    blk_BT = self.block_tables[slots_B[:, None], positions_BT // bs]
                    off_BT = positions_BT % bs
                # pool[:, blk, off] for every (b, t): adjacent advanced indices -> [K, B, T, d]
                pool[:, blk_BT, off_BT] = t.transpose(0, 1).to(pool.dtype)
            pools[name] = pool
        return pools

    def gather(self, pool: Tensor, slots_B: Tensor, positions_BN: Tensor) -> Tensor:
        """A paged tensor's entries at the given positions of each slot, [B, K, N, d] (a copy): where a layer reads
        a few positions, not all its keys (a window's, one every m). Positions must be within the slots' tables."""
        bs = self.block_size
        blk_BN = self.block_tables[slots_B[:, None], torch.div(positions_BN, bs, rounding_mode="floor")]
        return pool[:, blk_BN, positions_BN % bs].transpose(0, 1)               # [K, B, N, d] -> [B, K, N, d]

    def rows(self, pool: Tensor, slots_B: Tensor, kv_len: int) -> Tensor:
        """The slots' first ``kv_len`` positions of a paged tensor, [B, K, kv_len, d]: a view when one
        sequence's blocks are consecutive (checked on the CPU, where reading ``slots`` costs nothing), else a
        gathered copy."""
        K, _, bs, d = pool.shape
        n = -(-kv_len // bs)
        if slots_B.device.type == "cpu" and slots_B.numel() == 1:
            s = int(slots_B[0])
            if self._consecutive[s] >= n:
                b0 = self._blocks[s][0]
                return pool[:, b0:b0 + n].reshape(K, n * bs, d)[None, :, :kv_len]
        B = slots_B.numel()
        idx = self.block_tables[slots_B, :n].reshape(-1)        # [B * n]; index_select copies whole blocks,
        rows = pool.index_select(1, idx).view(K, B, n, bs, d)   # ~8x faster than advanced indexing here
        return rows.transpose(0, 1).reshape(B, K, n * bs, d)[:, :, :kv_len]

    def spans(self, pools: Sequence[Tensor], slot: int, start: int, stop: int,
              most: int) -> tuple[list[Tensor], ...] | None:
        """Slot ``slot``'s positions ``start``..``stop``-1 of each paged tensor in ``pools`` (a layer's keys and
        values: one block table) as views [1, K, n_i, d], one per run of consecutive blocks, in order (no copy:
        attention can go over each and merge, where :meth:`rows` would gather a sequence whose blocks are in
        several runs -- a prefix-cached prompt's own blocks after its shared ones), or None when they are more
        than ``most`` runs."""
        bs = self.block_size
        if stop <= start:
            return tuple([] for _ in pools)
        first, last = start // bs, -(-stop // bs)
        table = self.block_tables[slot, first:last]
        cuts = (torch.nonzero(table[1:] != table[:-1] + 1).view(-1) + 1).tolist()
        if len(cuts) >= most:
            return None
        out = tuple([] for _ in pools)
        for a, b in zip([0] + cuts, cuts + [last - first]):
            b0 = int(table[a])
            lo, hi = max(start, (first + a) * bs), min(stop, (first + b) * bs)
            off = lo - (first + a) * bs
            for pool, views in zip(pools, out):
                K, d = pool.size(0), pool.size(-1)
                views.append(pool[:, b0:b0 + b - a].reshape(K, (b - a) * bs, d)[None, :, off:off + hi - lo])
        return out

    # --- positions and blocks -----------------------------------------------------------------------
    def check_room(self, slots: Tensor, new_tokens: int) -> Tensor:
        """Positions [B] where the new tokens of each slot start, with the blocks for them in place (taken
        from the pool where missing); a clear error when a slot would pass ``max_seq_len``, and
        :class:`OutOfBlocks` when the pool has too few blocks left."""
        if slots.dim() != 1 or slots.dtype != torch.long:
            raise ValueError(f"slots must be a 1-D LongTensor, got {tuple(slots.shape)} {slots.dtype}")
        slot_list = slots.tolist()
        if len(slot_list) == 1:  # one sequence's step: plain ints (the general checks cost more than a decode op)
            if not 0 <= slot_list[0] < self.num_slots:
                raise ValueError(f"slots must be in [0, {self.num_slots}), got {slot_list}")
        else:
            if slot_list and (min(slot_list) < 0 or max(slot_list) >= self.num_slots):
                raise ValueError(f"slots must be in [0, {self.num_slots}), got {slot_list}")
            if len(set(slot_list)) != len(slot_list):
                raise ValueError(f"slots must be distinct, got {slot_list}")
        start = self.lengths[slots]
        if slot_list:
            longest = int(start.max()) + new_tokens
            if longest > self.max_seq_len:
                raise ValueError(f"sequence length {longest} exceeds max_seq_len={self.max_seq_len}")
            for s, n in zip(slot_list, start.tolist()):
                self.reserve(s, n + new_tokens)
        return start

    def reserve(self, slot: int, length: int) -> None:
        """Make slot ``slot``'s table cover positions 0..length-1, taking blocks from the pool: all it needs
        or none (:class:`OutOfBlocks`)."""
        have = self._blocks[slot]
        need = -(-length // self.block_size) - len(have)
        if need <= 0:
            return
        if length > self.max_seq_len:
            raise ValueError(f"sequence length {length} exceeds max_seq_len={self.max_seq_len}")
        if self._mirror:
            raise RuntimeError(f"slot {slot} of a mirrored cache needs {need} more blocks than its leader sent")
        if need > self.pool.num_free:
            raise OutOfBlocks(f"{need} KV cache blocks needed, {self.pool.num_free} of {self.num_blocks} free")
        new = []
        for _ in range(need):   # each after the one before when it is free: the sequence stays one view
            new.append(self.pool.allocate(prefer=(new[-1] if new else have[-1]) + 1 if new or have else None))
        self._append(slot, new)

    def room(self, slot: int) -> int:
        """The length ``slot`` can reach with the blocks it has and those free now (what :meth:`reserve` can
        take without :class:`OutOfBlocks`), at most ``max_seq_len``."""
        return min(self.max_seq_len, (len(self._blocks[slot]) + self.pool.num_free) * self.block_size)

    def _append(self, slot: int, blocks: list[int]) -> None:
        have = self._blocks[slot]
        n0 = len(have)
        have.extend(blocks)
        self.block_tables[slot, n0:n0 + len(blocks)] = torch.tensor(blocks, dtype=torch.long)
        c = self._consecutive[slot]
        if c == n0:
            while c < len(have) and (c == 0 or have[c] == have[c - 1] + 1):
                c += 1
            self._consecutive[slot] = c

    def declare_prompt(self, slot: int, length: int) -> None:
        """Say that slot ``slot``'s sequence has a prompt of ``length`` tokens (before its first forward, or again
        when it recomputes after a preemption): positions below it are the prompt whatever forwards compute
        them -- one or several chunks, a recompute of prompt and output at once."""
        _positive_int("prompt length", length)
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot must be in [0, {self.num_slots}), got {slot}")
        self.prompt_lengths[slot] = length

    def prompt_lengths_for(self, slots_B: Tensor, positions_BT: Tensor) -> Tensor:
        """Where the prompt of each row of a forward (at ``positions``, before the cache advances) ends, [B]: the
        declared length (:meth:`declare_prompt`), else -- a slot used without declaring one -- the end of this
        forward, which is then recorded (as transformers' cache takes its first update as the prompt)."""
        slots_B = slots_B.to(self.prompt_lengths.device)
        P_B = self.prompt_lengths[slots_B]
        P_B = torch.where(P_B > 0, P_B, positions_BT[:, -1].to(P_B.device) + 1)
        self.prompt_lengths[slots_B] = P_B
        return P_B

    def blocks(self, slot: int) -> list[int]:
        """The blocks of ``slot``'s table, in position order (a copy)."""
        return list(self._blocks[slot])

    def length(self, slot: int) -> int:
        return int(self.lengths[slot])

    def attach(self, slot: int, blocks: list[int], length: int) -> None:
        """Start slot ``slot`` afresh on ``blocks`` (already retained for it, e.g. by :meth:`BlockPool.lookup`)
        holding its first ``length`` positions; whatever the slot held before is given back."""
        if not 0 <= length <= len(blocks) * self.block_size:
            raise ValueError(f"length must be in [0, {len(blocks) * self.block_size}], got {length}")
        self.free(slot)
        if blocks:
            self._append(slot, list(blocks))
        self.lengths[slot] = length

    def set_blocks(self, slot: int, blocks: list[int], length: int, prompt_length: int = 0) -> None:
        """Set ``slot``'s table, length and prompt length (0: not declared) as another cache has them (a follower
        rank mirroring rank 0's cache: the pool's own bookkeeping is not used, and this cache never allocates
        again)."""
        self._mirror = True
        if len(blocks) > self.blocks_per_seq or any(not 0 <= b < self.num_blocks for b in blocks):
            raise ValueError(f"blocks must be at most {self.blocks_per_seq} ids in [0, {self.num_blocks})")
        self._blocks[slot], self._consecutive[slot] = [], 0
        if blocks:
            self._append(slot, list(blocks))
        self.lengths[slot] = length
        self.prompt_lengths[slot] = prompt_length

    def advance(self, slots: Tensor, new_tokens: int) -> None:
        self.lengths[slots] += new_tokens

    def free(self, slot: int) -> None:
        """Forget slot ``slot``'s tokens and give its blocks back (blocks other sequences share stay theirs)."""
        self.truncate(slot, 0)

    def truncate(self, slot: int, length: int) -> None:
        """Keep only the first ``length`` tokens of ``slot``; blocks past them go back to the pool. While a history
        is kept (:meth:`begin_history`), the slot's recorded per-slot buffers go back to their values at ``length``."""
        if not 0 <= length <= int(self.lengths[slot]):
            raise ValueError(f"length must be in [0, {int(self.lengths[slot])}], got {length}")
        if self._history is not None and length:
            self._rewind(slot, length)
        keep = -(-length // self.block_size)
        have = self._blocks[slot]
        dropped = self._dropped[slot]
        if 0 < keep < dropped:
            raise ValueError(f"slot {slot}: cannot keep {length} positions, its first {dropped * self.block_size} "
                             f"were given back (out of the window)")
        if len(have) > keep:
            if not self._mirror:
                self.pool.release(have[max(keep, dropped):])
            del have[keep:]
            self._consecutive[slot] = min(self._consecutive[slot], keep)
            self._dropped[slot] = min(dropped, keep)
        if length % self.block_size and not self._mirror and self.pool.shared(have[-1]):
            self._own_last_block(slot)
        self.lengths[slot] = length
        if length == 0:   # a new sequence may come: its prompt is its own
            self.prompt_lengths[slot] = 0

    def trim(self, slot: int) -> int:
        """Give back ``slot``'s blocks that no later query can see (every position before ``length - window +
        1``; a cache with a ``window`` only); returns how many. Reads of the slot gather from then on."""
        if self.window is None or self._mirror:
            return 0
        dead = max(0, (int(self.lengths[slot]) - self.window + 1) // self.block_size)
        d0 = self._dropped[slot]
        if dead <= d0:
            return 0
        self.pool.release(self._blocks[slot][d0:dead])
        self._dropped[slot] = dead
        self._consecutive[slot] = 0
        return dead - d0

    def _own_last_block(self, slot: int) -> None:
        """Make the partly kept last block of ``slot`` its own before it writes there: a block only it holds
        just forgets its prefix key; one that others hold is copied (copy on write)."""
        have = self._blocks[slot]
        old = have[-1]
        if self.pool.refcount(old) == 1:
            self.pool.unregister(old)
            return
        new = self.pool.allocate()
        for t in self._paged:
            t[:, new].copy_(t[:, old])
        self.pool.release([old])
        have[-1] = new
        self.block_tables[slot, len(have) - 1] = new
        self._consecutive[slot] = min(self._consecutive[slot], len(have) - 1)
