"""GLM-5.3's sparse-attention indexer over pools of keys (``glm5_next``): the layer's MLA attends to the tokens of the
pools it keeps plus the query's own incomplete pool.

Legend: B batch rows, T new tokens, L keys (cache positions 0..L-1), I indexer heads, i indexer head dim, P pool
size (``index_kpool``), W complete pools, Q q_lora_rank, D model dim.

As transformers' Glm5NextTextIndexer computes it (no position encoding anywhere):

    k = LayerNorm(wk(x)) [B, T, i], gate = x index_kpool_compress_gate^T [B, T, i]   (one of each per position)
    pool j (positions jP .. jP + P - 1): per channel c, sum_t softmax_t(gate[t, c] + ape[t - jP, c]) k[t, c]
    q = wq_b(q_resid) [B, T, I, i];  w = weights_proj(x) * I^-1/2 (fp32)
    score[t, j] = sum_h w[t, h] relu(q[t, h] . pool_j * i^-1/2)

A query at position p may pick a pool once it is complete (its last position <= p); it keeps its best
``index_topk / P`` complete pools (all of them when there are no more) and sees their tokens and, always, the
tokens of its own incomplete pool (floor((p + 1) / P) P .. p). Every pool key is cached at its pool's last position
(and the keys and gates per position, for the pool still filling), so chunked prefill and rows at different
positions need nothing special. Ties: relu makes a score exactly 0 when every head's dot product is negative;
which of tied pools survives is up to ``torch.topk``, as in transformers.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .cache import KVCache
from .deepseek_v4 import new_window_ends
from .indexer import SharedIndex, keep_top

__all__ = ["KPoolIndexer"]


class KPoolIndexer(nn.Module):
    """One layer's pooled indexer (names as the checkpoints': ``wq_b``, ``wk``, ``k_norm`` (LayerNorm with bias),
    ``weights_proj``, ``index_kpool_compress_ape`` [P, i], ``index_kpool_compress_gate`` [i, D]).

    ``forward(x [B, T, D], q_resid [B, T, Q], positions [B, T], k_pos, cache, slots, kv_len) -> bool [B, 1, T, L]``:
    True where the query may attend (the interface of :class:`~dynamoe.models.indexer.Indexer`)."""

    def __init__(self, hidden_size: int, q_lora_rank: int, n_heads: int, head_dim: int, topk: int, pool: int,
                 layer_idx: int, shared: SharedIndex | None = None, dtype=None):
        super().__init__()
        if pool < 1 or topk % pool:
            raise ValueError(f"config field 'index_topk' ({topk}) must be a multiple of 'index_kpool' ({pool}, >= 1)")
        self.layer_idx, self.n_heads, self.head_dim, self.topk, self.pool = layer_idx, n_heads, head_dim, topk, pool
        self.wq_b = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False, dtype=dtype)
        self.wk = nn.Linear(hidden_size, head_dim, bias=False, dtype=dtype)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6, dtype=dtype)
        self.weights_proj = nn.Linear(hidden_size, n_heads, bias=False, dtype=dtype)
        self.index_kpool_compress_ape = nn.Parameter(torch.zeros(pool, head_dim, dtype=dtype))
        self.index_kpool_compress_gate = nn.Parameter(torch.zeros(head_dim, hidden_size, dtype=dtype))
        object.__setattr__(self, "shared", shared)

    def extra_repr(self) -> str:
        return f"layer={self.layer_idx}, heads={self.n_heads}, head_dim={self.head_dim}, topk={self.topk}, pool={self.pool}"

    def _pool(self, k_BWPi: Tensor, gate_BWPi: Tensor) -> Tensor:
        """The pool keys [B, W, i] of complete pools given their keys and gates [B, W, P, i]."""
        logits = gate_BWPi.float() + self.index_kpool_compress_ape.float()
        return (logits.softmax(dim=2).to(k_BWPi.dtype) * k_BWPi).sum(dim=2)

    def _pools(self, x_BTD: Tensor, positions_BT: Tensor, cache: KVCache | None, slots, kv_len) -> tuple[Tensor, int]:
        """(every complete pool's key [B, W, i], L): the T tokens' (no cache), or the slots' keys 0..kv_len - 1
        after writing the new tokens' keys, gates and newly completed pools (only the positions needed are read)."""
        k = self.k_norm(self.wk(x_BTD))
        gate = F.linear(x_BTD, self.index_kpool_compress_gate)
        P, B = self.pool, x_BTD.size(0)
        if cache is None:
            T = x_BTD.size(1)
            W = T // P
            return self._pool(*(t[:, :W * P].reshape(B, W, P, -1) for t in (k, gate))), T
        pools = cache.put(self.layer_idx, slots, positions_BT, index_k=k.unsqueeze(1), index_gate=gate.unsqueeze(1))
        ends = new_window_ends(positions_BT, P)
        if ends is not None:
            at = (ends - P + 1)[..., None] + torch.arange(P, device=ends.device)     # [B, N, P]
            rows = [cache.gather(pools[n], slots, at.reshape(B, -1))[:, 0].view(*at.shape, -1).to(k.dtype)
                    for n in ("index_k", "index_gate")]
            cache.put(self.layer_idx, slots, ends, index_pool=self._pool(*rows).unsqueeze(1))
        at = torch.arange(P - 1, max(kv_len, P - 1), P, device=x_BTD.device).expand(B, -1)
        stored = cache.gather(cache.kv_pool(self.layer_idx, "index_pool", 1, self.head_dim), slots, at)
        return stored[:, 0].to(x_BTD.dtype), kv_len

    def forward(self, x_BTD: Tensor, q_resid: Tensor, positions_BT: Tensor, k_pos_BL: Tensor | None = None,
                cache: KVCache | None = None, slots: Tensor | None = None, kv_len: int | None = None) -> Tensor:
        B, T, _ = x_BTD.shape
        P = self.pool
        pools, L = self._pools(x_BTD, positions_BT, cache, slots, kv_len)             # [B, W, i]
        W = pools.size(1)
        key_pos = torch.arange(L, device=x_BTD.device)
        p = positions_BT[:, :, None]                                                   # [B, T, 1]
        allowed = (key_pos >= torch.div(p + 1, P, rounding_mode="floor") * P) & (key_pos <= p)   # own open pool
        if W:
            q = self.wq_b(q_resid).view(B, T, self.n_heads, self.head_dim)
            scores = F.relu(torch.matmul(q.float(), pools.float().transpose(-1, -2).unsqueeze(1)) * self.head_dim ** -0.5)
            w = self.weights_proj(x_BTD).float() * self.n_heads ** -0.5                 # [B, T, I]
            index = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)                  # [B, T, W]
            complete = (torch.arange(W, device=x_BTD.device) + 1) * P - 1 <= p          # [B, T, W]
            index = index.masked_fill(~complete, float("-inf"))
            chosen = keep_top(index, self.topk // P) & complete
            in_pool = torch.div(key_pos, P, rounding_mode="floor").clamp(max=W - 1)
            allowed = allowed | (chosen.gather(-1, in_pool.expand(B, T, L)) & (key_pos < W * P))
        allowed = allowed.unsqueeze(1)
        if self.shared is not None:
            self.shared.put(positions_BT, allowed)
        return allowed
