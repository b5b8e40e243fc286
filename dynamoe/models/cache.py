"""The KV cache: a fixed number of sequence slots, each holding up to ``max_seq_len`` positions.

Slots are what continuous batching needs: the engine prefills a new request into a free slot
(``model(ids[1, T], cache=cache, slots=tensor([s]))``), then decodes all live slots together
(``model(ids[B, 1], cache=cache, slots=tensor([s0, s1, ...]))``); every row is at its own position
``cache.lengths[slot]``. ``cache.free(slot)`` makes a slot reusable at once.

Each attention layer keeps its own named tensors (GQA: "k", "v" [slots, kv_heads, S, head_dim];
MLA: the latent and the rope key; the sparse-attention indexer: its keys), allocated on first use
by :meth:`KVCache.buffer`. The model advances ``lengths`` once per forward, after all layers.
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["KVCache"]


class KVCache:
    def __init__(self, num_slots: int, max_seq_len: int, num_layers: int, dtype: torch.dtype = torch.float32,
                 device=None):
        for name, v in (("num_slots", num_slots), ("max_seq_len", max_seq_len), ("num_layers", num_layers)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.lengths = torch.zeros(num_slots, dtype=torch.long, device=self.device)
        self.layers: list[dict[str, Tensor]] = [{} for _ in range(num_layers)]

    def buffer(self, layer: int, name: str, *shape: int, dtype: torch.dtype | None = None) -> Tensor:
        """Layer ``layer``'s tensor ``name`` of shape [num_slots, *shape] (position dim included
        by the caller), zero-initialised on first use."""
        bufs = self.layers[layer]
        t = bufs.get(name)
        if t is None:
            t = torch.zeros(self.num_slots, *shape, dtype=dtype or self.dtype, device=self.device)
            bufs[name] = t
        return t

    def check_room(self, slots: Tensor, new_tokens: int) -> Tensor:
        """Positions [B] where the new tokens of each slot start; a clear error when the slot
        would pass ``max_seq_len``."""
        if slots.dim() != 1 or slots.dtype != torch.long:
            raise ValueError(f"slots must be a 1-D LongTensor, got {tuple(slots.shape)} {slots.dtype}")
        if slots.numel() == 1:  # one sequence's step: plain ints (the general checks cost more than a decode op)
            if not 0 <= int(slots[0]) < self.num_slots:
                raise ValueError(f"slots must be in [0, {self.num_slots}), got {slots.tolist()}")
        else:
            if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= self.num_slots):
                raise ValueError(f"slots must be in [0, {self.num_slots}), got {slots.tolist()}")
            if slots.numel() != torch.unique(slots).numel():
                raise ValueError(f"slots must be distinct, got {slots.tolist()}")
        start = self.lengths[slots]
        if slots.numel() and int(start.max()) + new_tokens > self.max_seq_len:
            raise ValueError(f"sequence length {int(start.max()) + new_tokens} exceeds max_seq_len={self.max_seq_len}")
        return start

    def advance(self, slots: Tensor, new_tokens: int) -> None:
        self.lengths[slots] += new_tokens

    def free(self, slot: int) -> None:
        """Forget slot ``slot``'s tokens (its buffers are overwritten by the next user)."""
        self.lengths[slot] = 0

    def truncate(self, slot: int, length: int) -> None:
        """Keep only the first ``length`` tokens of ``slot`` (e.g. to re-use a shared prompt prefix)."""
        if not 0 <= length <= int(self.lengths[slot]):
            raise ValueError(f"length must be in [0, {int(self.lengths[slot])}], got {length}")
        self.lengths[slot] = length
