"""Qwen4-Exp's QSA indexer: which keys each query of an ``indexed_attention`` layer attends to -- the tokens of its best
compressed blocks plus those of its own incomplete block.

Legend: B batch rows, T new tokens, L keys (cache positions 0..L-1), I indexer query heads, i indexer head dim, R rotary
dims (the first R of the i), P block size (``indexer_compress_ratio``), W complete blocks, D model dim.

As transformers' Qwen4ExpTextQSAIndexer computes it:

    [q | k] = index_qk_proj(x)           q [B, T, I, i] -> q_layernorm -> RoPE at the query's position
                                         k [B, T, i]: one raw key per position (cached as is)
    block j (positions jP .. jP + P - 1): mean of its raw keys (fp32, cast back) -> k_layernorm -> RoPE at jP
    score[t, j] = sum_h relu(q[t, h] . block_j) / sqrt(i)                      (fp32)

(both norms zero-centred RMSNorms over i; RoPE the attention's, half-split, on the first R dims). A query at position p
may pick a block once it is complete (jP + P - 1 <= p); it keeps its best ``indexer_budget / P`` complete blocks (all
of them when there are no more) and, always, the tokens of its own incomplete block (floor((p + 1) / P) P .. p). Each
block key is cached at its block's last position once complete, the raw keys per position for the block still filling,
so chunked prefill and rows at different positions need nothing special. While no query has more complete blocks than
it keeps, nothing is scored (plain causal attention: None).

Ties: relu makes a score exactly 0 when every head's dot product is negative; ``torch.topk`` (transformers) keeps an
arbitrary one of tied blocks, which can change with the number of blocks that follow; :func:`~dynamoe.models.indexer.
keep_top` keeps the earliest (a function of the query's own scores: batch-, padding- and chunking-invariant). Where the
boundary is not tied the kept set is transformers'.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .cache import KVCache
from .deepseek_v4 import new_window_ends
from .indexer import keep_top
from .norms import RMSNorm
from .rope import RotaryEmbedding, apply_rope

__all__ = ["QSAIndexer"]


class QSAIndexer(nn.Module):
    """One layer's QSA indexer (names as transformers': ``index_qk_proj`` [(I + 1) i, D], ``q_layernorm``,
    ``k_layernorm``). ``forward(x [B, T, D], positions [B, T], cache, slots, kv_len) -> bool [B, 1, T, L] or None``:
    True where the query may attend (causal and selected), None when every causal key is kept."""

    #: at most this many per-head scores (fp32) exist at once; longer prefills are scored in query chunks
    MAX_SCORES = 1 << 26

    def __init__(self, hidden_size: int, n_heads: int, head_dim: int, budget: int, block: int, layer_idx: int,
                 rotary: RotaryEmbedding, eps: float = 1e-6, dtype=None):
        super().__init__()
        if block < 1 or budget < block or budget % block:
            raise ValueError(f"config field 'indexer_budget' ({budget}) must be a positive multiple of "
                             f"'indexer_compress_ratio' ({block}, >= 1)")
        self.layer_idx, self.n_heads, self.head_dim, self.block, self.keep = layer_idx, n_heads, head_dim, block, budget // block
        self.index_qk_proj = nn.Linear(hidden_size, (n_heads + 1) * head_dim, bias=False, dtype=dtype)
        self.q_layernorm = RMSNorm(head_dim, eps, zero_centered=True, dtype=dtype)
        self.k_layernorm = RMSNorm(head_dim, eps, zero_centered=True, dtype=dtype)
        object.__setattr__(self, "rotary", rotary)

    def extra_repr(self) -> str:
        return f"layer={self.layer_idx}, heads={self.n_heads}, head_dim={self.head_dim}, keep={self.keep}, block={self.block}"

    def _block_keys(self, raw_BWPi: Tensor, starts_BW: Tensor) -> Tensor:
        """The normed, roped keys [B, W, i] of complete blocks from their raw keys [B, W, P, i] and first positions."""
        pooled = self.k_layernorm(raw_BWPi.float().mean(dim=2).to(raw_BWPi.dtype))
        cos, sin = self.rotary(starts_BW, pooled.dtype)
        return apply_rope(pooled.unsqueeze(1).contiguous(), cos, sin).squeeze(1)

    def _blocks(self, raw_BTi: Tensor, positions_BT: Tensor, cache: KVCache | None, slots, kv_len) -> tuple[Tensor, int]:
        """(every complete block's key [B, W, i], L): the T tokens' (no cache: positions 0..T-1), or the slots' blocks
        within 0..kv_len - 1 after writing the new raw keys and the blocks they complete (only those positions read)."""
        P, B = self.block, raw_BTi.size(0)
        if cache is None:
            T = raw_BTi.size(1)
            W = T // P
            starts = (torch.arange(W, device=raw_BTi.device) * P).expand(B, W)
            return self._block_keys(raw_BTi[:, :W * P].reshape(B, W, P, -1), starts), T
        pools = cache.put(self.layer_idx, slots, positions_BT, index_raw_k=raw_BTi.unsqueeze(1))
        ends = new_window_ends(positions_BT, P)
        if ends is not None:
            at = (ends - P + 1)[..., None] + torch.arange(P, device=ends.device)              # [B, N, P]
            raw = cache.gather(pools["index_raw_k"], slots, at.reshape(B, -1))[:, 0].view(*at.shape, -1)
            keys = self._block_keys(raw.to(raw_BTi.dtype), ends - P + 1)
            cache.put(self.layer_idx, slots, ends, index_block_k=keys.unsqueeze(1))
        at = torch.arange(P - 1, max(kv_len, P - 1), P, device=raw_BTi.device).expand(B, -1)
        stored = cache.gather(cache.kv_pool(self.layer_idx, "index_block_k", 1, self.head_dim), slots, at)
        return stored[:, 0].to(raw_BTi.dtype), kv_len

    def forward(self, x_BTD: Tensor, positions_BT: Tensor, cache: KVCache | None = None, slots: Tensor | None = None,
                kv_len: int | None = None) -> Tensor | None:
        B, T, _ = x_BTD.shape
        P, I, d = self.block, self.n_heads, self.head_dim
        q, raw = self.index_qk_proj(x_BTD).split([I * d, d], dim=-1)
        blocks, L = self._blocks(raw, positions_BT, cache, slots, kv_len)                 # [B, W, i]
        if L // P <= self.keep:   # no query has more complete blocks than it keeps: every causal key stays
            return None
        q = self.q_layernorm(q.view(B, T, I, d))
        cos, sin = self.rotary(positions_BT, q.dtype)
        q = apply_rope(q.transpose(1, 2).contiguous(), cos, sin).transpose(1, 2)          # [B, T, I, i]
        W = blocks.size(1)
        kT = blocks.float().transpose(-1, -2).unsqueeze(1)                                 # [B, 1, i, W]
        # the per-head scores [B, t, I, W] are the big intermediate (relu keeps the heads apart): a long prefill
        # takes its queries in chunks of at most MAX_SCORES of them
        step = max(1, self.MAX_SCORES // max(1, B * I * W))
        index = torch.cat([F.relu(torch.matmul(q[:, t0:t0 + step].float(), kT)).sum(dim=2) / d ** 0.5
                           for t0 in range(0, T, step)], dim=1)                            # [B, T, W]
        p = positions_BT[:, :, None]                                                       # [B, T, 1]
        complete = (torch.arange(W, device=x_BTD.device) + 1) * P - 1 <= p                 # [B, T, W]
        chosen = keep_top(index.masked_fill(~complete, float("-inf")), self.keep) & complete
        key_pos = torch.arange(L, device=x_BTD.device)
        allowed = (key_pos >= torch.div(p + 1, P, rounding_mode="floor") * P) & (key_pos <= p)   # own open block
        in_block = torch.div(key_pos, P, rounding_mode="floor").clamp(max=W - 1)
        allowed = allowed | (chosen.gather(-1, in_block.expand(B, T, L)) & (key_pos < W * P))
        return allowed.unsqueeze(1)
