"""The sparse-attention indexer of DeepSeek-V3.2 (DSA) and GLM-5: it scores every visible key for each
query and keeps the ``index_topk`` best; the layer's MLA then attends only to those.

Legend: B batch rows, T new tokens, L keys (cache positions 0..L-1), I indexer heads, d indexer head
dim, R rotary dims (the first R of the d), D model dim, Q q_lora_rank.

As transformers computes it (DeepseekV32Indexer / GlmMoeDsaIndexer, the bf16 form of the reference's
Hadamard + FP8 scoring, which preserves dot products):

    q = wq_b(q_resid) [B, T, I, d]      (q_resid = q_a_layernorm(q_a_proj(x)), shared with MLA)
    k = LayerNorm(wk(x)) [B, T, d]       (one key per position, shared by the heads; cached)
    RoPE on the first R dims of q and k (half-split for V3.2, interleaved pairs for GLM-5)
    w = weights_proj(x) * I^-1/2 [B, T, I]                        (fp32)
    score[t, l] = sum_i w[t, i] * relu(q[t, i] . k[l] * d^-1/2)    (fp32)

and each query keeps the top ``index_topk`` keys among its causal ones (all of them when it sees no
more than that many). The kept set does not depend on how many masked keys follow (masked keys
score -inf and rank last), so a slot cache's padding changes nothing. While no query has more than
``index_topk`` keys (every context up to 2048 tokens for the released models) nothing is scored:
the keys are only cached.

Ties: relu makes a score exactly 0 when every head's dot product is negative, so several keys can tie at the
top-k boundary (with 4 heads, within a few dozen tokens). ``torch.topk`` -- transformers' and DeepSeek's
reference -- keeps an arbitrary one of them, and which one changes with the key axis's length: the same request
alone, padded in a batch, chunked or on a cached prefix would attend to different keys and, greedy, drift apart.
:func:`keep_top` keeps the earliest of tied keys instead (a stable sort): the kept set is a function of the
query's own scores, whatever follows them. Where the boundary is not tied it is transformers' set.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import write_kv
from .cache import KVCache
from .rope import RotaryEmbedding, apply_rope

__all__ = ["Indexer", "SharedIndex", "visible_mask", "keep_top"]


def keep_top(index_BTL: Tensor, k: int) -> Tensor:
    """bool [B, T, L]: the ``k`` highest scores of each query's row (masked keys scored -inf), the earliest key
    first among equal scores (see the module docstring), whatever the length of the row's padding."""
    k = min(k, index_BTL.size(-1))
    top = torch.sort(index_BTL, dim=-1, descending=True, stable=True).indices[..., :k]
    return torch.zeros(index_BTL.shape, dtype=torch.bool, device=index_BTL.device).scatter_(-1, top, True)


def visible_mask(q_pos_BT: Tensor, k_pos_BL: Tensor) -> Tensor:
    """bool [B, T, L]: the key at k_pos is at or before the query at q_pos."""
    return k_pos_BL[:, None, :] <= q_pos_BT[:, :, None]


class SharedIndex:
    """The last full indexer's selection, for the layers that reuse it (GLM-5's 'shared' indexer
    layers): one instance per model, written by every full indexer, read by the shared layers of the
    same forward (matched by the positions tensor, which every layer of a forward receives as is)."""

    def __init__(self):
        self.last: tuple | None = None

    def put(self, positions_BT: Tensor, allowed: Tensor | None) -> None:
        self.last = (positions_BT, allowed)

    def get(self, positions_BT: Tensor) -> Tensor | None:
        if self.last is None or self.last[0] is not positions_BT:
            raise RuntimeError("a shared indexer layer needs an earlier full indexer layer in the same forward")
        return self.last[1]


class Indexer(nn.Module):
    """The indexer of one layer (parameter names as the checkpoints': ``wq_b``, ``wk``, ``k_norm``
    (LayerNorm with bias), ``weights_proj``).

    ``forward(x [B, T, D], q_resid [B, T, Q], positions [B, T], k_pos [B, L] or None, cache, slots,
    kv_len) -> bool [B, 1, T, L] or None``: True where the query may attend (causal and selected);
    None when no query has more than ``index_topk`` keys to choose from (plain causal attention).
    Without a cache the keys are the T tokens themselves (k_pos None).

    Mistral-Large-4's variant: ``query_norm`` (``q_input_norm``, a LayerNorm over the hidden size: the queries are
    wq_b(LayerNorm(x)), ``q_lora_rank`` is then the hidden size and q_resid is not read), ``head_scale`` (the queries
    scaled per head by ``softmax_scaling``, :class:`~dynamoe.models.mla.LogPositionScale`) and ``rotary`` None (no
    RoPE: NoPE layers). Hy4's: ``rope_at_end`` (RoPE on the last R dims of q and k, not the first) and
    ``k_norm_eps`` (the key LayerNorm's eps; 1e-6 elsewhere).
    """

    #: at most this many per-head scores (fp32) exist at once; longer prefills are scored in query chunks
    MAX_SCORES = 1 << 26

    def __init__(self, hidden_size: int, q_lora_rank: int, n_heads: int, head_dim: int, rope_dim: int, topk: int,
                 layer_idx: int, rotary: RotaryEmbedding | None, rope_interleaved: bool = False,
                 shared: SharedIndex | None = None, query_norm: bool = False, head_scale: bool = False,
                 rope_at_end: bool = False, k_norm_eps: float = 1e-6, dtype=None):
        super().__init__()
        if rope_dim > head_dim:
            raise ValueError(f"index_head_dim={head_dim} must be >= qk_rope_head_dim={rope_dim}")
        self.layer_idx, self.n_heads, self.head_dim, self.topk = layer_idx, n_heads, head_dim, topk
        self.rope_interleaved, self.rope_at_end = rope_interleaved, rope_at_end
        self.softmax_scale = head_dim ** -0.5
        self.wq_b = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False, dtype=dtype)
        self.wk = nn.Linear(hidden_size, head_dim, bias=False, dtype=dtype)
        self.k_norm = nn.LayerNorm(head_dim, eps=k_norm_eps, dtype=dtype)
        # transformers keeps it in fp32 (_keep_in_fp32_modules): the head weights decide the ranking
        self.weights_proj = nn.Linear(hidden_size, n_heads, bias=False, dtype=torch.float32)
        self.q_input_norm = self.softmax_scaling = None
        if query_norm:
            if q_lora_rank != hidden_size:
                raise ValueError(f"an indexer with its own query norm reads x: q_lora_rank must be hidden_size "
                                 f"({hidden_size}), got {q_lora_rank}")
            self.q_input_norm = nn.LayerNorm(hidden_size, eps=1e-6, dtype=dtype)
        if head_scale:
            from .mla import LogPositionScale   # (mla imports this module)

            self.softmax_scaling = LogPositionScale(n_heads, dtype=dtype)
        object.__setattr__(self, "rotary", rotary)
        object.__setattr__(self, "shared", shared)

    def extra_repr(self) -> str:
        return (f"layer={self.layer_idx}, heads={self.n_heads}, head_dim={self.head_dim}, topk={self.topk}, "
                f"rope_interleaved={self.rope_interleaved}")

    def _rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        if not self.rope_at_end:
            return apply_rope(x, cos, sin, self.rope_interleaved)
        R = 2 * cos.size(-1)
        return torch.cat([x[..., :-R], apply_rope(x[..., -R:].contiguous(), cos, sin, self.rope_interleaved)], dim=-1)

    def _head_weights(self, x_BTD: Tensor) -> Tensor:
        proj = self.weights_proj  # an fp32 nn.Linear, or the loader's QuantizedLinear (a quantized checkpoint)
        x = x_BTD.to(proj.weight.dtype) if isinstance(proj, nn.Linear) else x_BTD
        return proj(x).float() * self.n_heads ** -0.5

    def keys(self, x_BTD: Tensor, positions_BT: Tensor, cache: KVCache | None = None, slots: Tensor | None = None,
             kv_len: int | None = None) -> Tensor:
        """The roped indexer keys [B, 1, L, d]: the T new ones, or with a cache (where they are written
        first) the slots' keys 0..kv_len-1."""
        k = self.k_norm(self.wk(x_BTD)).unsqueeze(1)                                         # [B, 1, T, d]
        if self.rotary is not None:
            cos, sin = self.rotary(positions_BT, k.dtype)
            k = self._rope(k, cos, sin)
        if cache is not None:
            k = write_kv(cache, self.layer_idx, slots, positions_BT, kv_len, index_k=k)["index_k"]
        return k

    def scores(self, x_BTD: Tensor, q_resid: Tensor, positions_BT: Tensor, k_B1Ld: Tensor) -> Tensor:
        """fp32 index scores [B, T, L] of the queries against the keys (before masking)."""
        B, T, _ = x_BTD.shape
        if self.q_input_norm is not None:
            q_resid = self.q_input_norm(x_BTD)
        q = self.wq_b(q_resid).view(B, T, self.n_heads, self.head_dim)
        if self.softmax_scaling is not None:
            q = self.softmax_scaling(q, positions_BT, heads_first=False)
        if self.rotary is not None:
            cos, sin = self.rotary(positions_BT, q.dtype)
            q = self._rope(q.transpose(1, 2), cos, sin).transpose(1, 2)                       # [B, T, I, d]
        w = self._head_weights(x_BTD).unsqueeze(-2)                                           # [B, T, 1, I]
        kT = k_B1Ld.float().transpose(-1, -2)                                                 # [B, 1, d, L]
        # the per-head scores [B, t, I, L] are the big intermediate (relu keeps the heads apart):
        # bound it by taking the queries in chunks (a long prefill would otherwise need T * I * L floats)
        step = max(1, self.MAX_SCORES // max(1, B * self.n_heads * kT.size(-1)))
        out = []
        for t0 in range(0, T, step):
            s = F.relu(torch.matmul(q[:, t0:t0 + step].float(), kT) * self.softmax_scale)  # [B, t, I, L]
            out.append(torch.matmul(w[:, t0:t0 + step], s).squeeze(-2))                     # [B, t, L]
        return out[0] if len(out) == 1 else torch.cat(out, dim=1)

    def forward(self, x_BTD: Tensor, q_resid: Tensor, positions_BT: Tensor, k_pos_BL: Tensor | None = None,
                cache: KVCache | None = None, slots: Tensor | None = None, kv_len: int | None = None) -> Tensor | None:
        k = self.keys(x_BTD, positions_BT, cache, slots, kv_len)
        if k.size(2) <= self.topk:
            # no query has more than topk keys: every causal key is kept, no scoring needed (the keys
            # still go to the cache, for the queries that will have more)
            allowed = None
        else:
            index = self.scores(x_BTD, q_resid, positions_BT, k)
            visible = visible_mask(positions_BT, positions_BT if k_pos_BL is None else k_pos_BL)
            index = index.masked_fill(~visible, float("-inf"))
            allowed = (keep_top(index, self.topk) & visible).unsqueeze(1)
        if self.shared is not None:
            self.shared.put(positions_BT, allowed)
        return allowed
