"""DeepSeek-V4 (``model_type: deepseek_v4``), as transformers' DeepseekV4ForCausalLM computes it.

Legend: B batch rows, T new tokens, L cached positions, H query heads, d head dim (one key = value head shared by
all query heads), R rotary dims, N residual streams (``hc_mult``), D model dim, m compress rate, W compressed
entries, I indexer heads, Q q_lora_rank, G output groups.

Attention of layer i (``layer_types``): queries q_b(RMSNorm(q_a(x))), each head RMS-normalised without a weight;
one key = value per position, RMSNorm(wkv(x)); RoPE on the trailing R dims of each head in interleaved pairs
(the "main" RoPE on 'sliding_attention' layers, the "compress" one elsewhere). Every layer attends over a sliding
window of ``sliding_window`` keys; 'heavily_compressed_attention' (HCA) layers also over compressed entries, one
per m' (``compress_rates``) positions, each a per-channel softmax-weighted sum of its window's wkv rows (weights
wgate(x) + ``ape``), RMSNorm'd and roped at the window's first position; 'compressed_sparse_attention' (CSA) layers
over entries of 2m overlapping positions (two series per position: the first half of the rows feeds the next
window, the second half its own), of which a lightning indexer (its own compressed keys at ``index_head_dim``,
score = sum_h w_h relu(q_h . k)) keeps the best ``index_topk`` per query. A query sees an entry once its window is
complete. Softmax with a learned sink per head (``attn_sink``); the output's RoPE is undone at the query's position
(keys are values), then a grouped low-rank output projection (``wo_a`` per group of heads, ``wo_b``).

Residual: N streams [B, T, N, D] (manifold-constrained hyper-connections): around each sublayer a projection of the
RMS-normalised streams gives pre (collapses the streams into the sublayer's input), post (spreads its output over
the streams) and comb (mixes the streams; Sinkhorn-normalised towards doubly stochastic); the final streams collapse
through ``hc_head`` before the norm. MoE on every layer: sqrt(softplus) (or sigmoid) scores of ``gate`` [E, D],
experts picked by top-k of score + ``gate.bias`` ('moe') or by the token id (``gate.tid2eid`` [V, K]: 'hash_moe',
the first ``num_hash_layers``), weights renormalised times ``routed_scaling_factor``; SwiGLU experts and one shared
expert of ``moe_intermediate_size`` with the gate clamped above and the up projection to +-``swiglu_limit``
before the product.

Checkpoint: the hub's names, which transformers saves back (``attn.{wq_a,q_norm,wq_b,wkv,norm,wo_a,wo_b,attn_sink}``,
``attn.compressor.{wkv,wgate,ape,norm}``, ``attn.indexer.{wq_b,weights_proj,compressor.*}``, ``attn_norm``,
``ffn_norm``, ``hc_{attn,ffn}_{fn,base,scale}``, ``ffn.gate.{weight,bias,tid2eid}``, ``ffn.experts.{e}.w{1,2,3}``,
``ffn.shared_experts.w{1,2,3}``, ``hc_head``, ``head``), under ``model.`` or at the top level (``embed``,
``layers``, ``norm``, ``hc_head_{fn,base,scale}``: the hub's files).

Multi-token prediction (``mtp.{j}.*``, the hub's names in either layout; transformers drops them): depth j loads as
:class:`V4NextTokenPredictor` (``model.mtp[j]``, :mod:`dynamoe.models.mtp`) when the checkpoint has its
``e_proj``, as DeepSeek's reference inference code (``MTPBlock``) and vLLM's DeepSeekV4MTP compute it:
``e_proj(enorm(embed(x_{p+1})))`` added to every stream of ``h_proj(hnorm(streams_p))`` (the main model's final
residual streams, before ``hc_head``), one V4 layer (its attention kind from the config's lists past
num_hidden_layers, else from its tensors: the released layer is a sliding-window one without compressor or
indexer), then its own ``hc_head_{fn,base,scale}``, ``norm`` and the model's ``head`` (or its own ``head`` /
``emb.tok_emb`` copies). Plain decoding does not run it; the engine drafts with it (``draft="mtp"``).

Cache (per layer, per position, so chunked prefill, rows at different positions, prefix sharing and truncation work
as for plain attention): the roped key "kv"; on compressed layers the raw wkv / wgate rows ("ckv", "cgate": what a
window still being filled needs) and each entry ("comp"), stored at its window's last position; CSA layers the
indexer's the same way ("ikv", "igate", "icomp"). No fused decode kernels: attention, residual streams and router
are this module's own (the MoE block says so when asked).
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops.fused import Fused, Holds
from .attention import _attend_with_sinks, attention_mask, cached_length
from .base import CausalLM
from .cache import KVCache
from .config import _V4_COMPRESS_RATIO_KINDS, V4_LAYER_TYPES, ModelConfig, RopeConfig
from .indexer import keep_top
from .hyper_connections import HyperConnection, HyperDecoderLayer, HyperHeadNorm, StreamEmbedding, rms_unweighted
from .mla import dense_weight
from .moe_block import SparseMoeBlock
from .mtp import MTPHeads, NextTokenPredictor
from .norms import RMSNorm
from .rope import RotaryEmbedding
from .weights import PerExpert

__all__ = ["DeepseekV4ForCausalLM", "V4NextTokenPredictor", "V4Fields", "v4_fields", "V4Attention", "V4MoeBlock", "new_window_ends",
           "rope_tail"]

log = logging.getLogger(__name__)

_MLP_KINDS = ("hash_moe", "moe")
_MTP_DEPTH = re.compile(r"mtp\.(\d+)\.")
_DEFAULT_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


@dataclass(frozen=True)
class V4Fields:
    """DeepSeek-V4's own config values, read once (see :func:`v4_fields`): ``compress_rates[i]`` layer i's m (0: a
    sliding-window layer), ``hash_layers[i]`` whether layer i routes by token id, the hyper-connection sizes, the
    grouped output projection's, the two RoPEs (``main`` for sliding layers, ``compress`` for the others);
    ``kind_rates`` the (kind, m) pairs the rates came from (for a layer past the decoder's: an MTP layer)."""

    compress_rates: tuple
    kind_rates: tuple
    hash_layers: tuple
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    o_groups: int
    o_lora_rank: int
    main_rope: RopeConfig
    compress_rope: RopeConfig


def _positive(raw: dict, name: str, default, kind=int):
    v = raw.get(name, default)
    if v is None:
        v = default
    ok = (isinstance(v, int) and v >= 1) if kind is int else (isinstance(v, (int, float)) and v > 0)
    if isinstance(v, bool) or not ok:
        raise ValueError(f"config field {name!r} must be {'an int >= 1' if kind is int else 'a number > 0'}, got {v!r}")
    return kind(v)


def v4_fields(cfg: ModelConfig) -> V4Fields:
    """DeepSeek-V4's values as DeepseekV4Config reads them: ``compress_rates`` (default CSA 4, HCA 128; the hub's
    ``compress_rate_csa`` / ``compress_rate_hca`` win), ``mlp_layer_types`` (at least num_hidden_layers entries
    from 'hash_moe' / 'moe', cut), else the first ``num_hash_layers`` (default 3) hash-routed; ValueError naming the
    field for anything else."""
    raw, n = cfg.raw, cfg.num_hidden_layers
    rates = raw.get("compress_rates")
    rates = dict(_DEFAULT_RATES) if rates is None else rates
    if not isinstance(rates, dict):
        raise ValueError(f"config field 'compress_rates' must be a dict of rates per layer kind, got {rates!r}")
    rates = {**rates}
    for kind, legacy in (("compressed_sparse_attention", "compress_rate_csa"),
                         ("heavily_compressed_attention", "compress_rate_hca")):
        if raw.get(legacy) is not None:
            rates[kind] = raw[legacy]
    per_layer = [_kind_rate(rates, kind) for kind in cfg.layer_types]
    mlp = raw.get("mlp_layer_types")
    if mlp is None:
        hashed = raw.get("num_hash_layers")
        hashed = 3 if hashed is None else hashed
        if isinstance(hashed, bool) or not isinstance(hashed, int) or hashed < 0:
            raise ValueError(f"config field 'num_hash_layers' must be an int >= 0, got {hashed!r}")
        mlp = ["hash_moe"] * min(n, hashed) + ["moe"] * max(0, n - hashed)
    if not isinstance(mlp, (list, tuple)) or len(mlp) < n or any(t not in _MLP_KINDS for t in mlp):
        raise ValueError(f"config field 'mlp_layer_types' must be a list of at least {n} entries from "
                         f"{list(_MLP_KINDS)} (DeepSeek-V4: every layer is MoE), got {mlp!r}")
    ropes = dict(cfg.rope_by_layer_type)
    fields = V4Fields(tuple(per_layer), tuple(sorted(rates.items())), tuple(t == "hash_moe" for t in mlp[:n]),
                      _positive(raw, "hc_mult", 4), _positive(raw, "hc_sinkhorn_iters", 20),
                      _positive(raw, "hc_eps", 1e-6, float), _positive(raw, "o_groups", 8),
                      _positive(raw, "o_lora_rank", 1024), ropes["main"], ropes["compress"])
    if cfg.num_attention_heads * cfg.head_dim % fields.o_groups:
        raise ValueError(f"config field 'o_groups' must divide num_attention_heads * head_dim = "
                         f"{cfg.num_attention_heads * cfg.head_dim}, got {fields.o_groups}")
    if cfg.q_lora_rank is None:
        raise ValueError("config field 'q_lora_rank' is required for deepseek_v4 (its queries are low rank)")
    if any(k == "compressed_sparse_attention" for k in cfg.layer_types):
        missing = [f for f in ("index_topk", "index_head_dim", "index_n_heads") if getattr(cfg, f) is None]
        if missing:
            raise ValueError(f"config fields {missing} are required: layer_types has 'compressed_sparse_attention'")
    return fields


def _kind_rate(rates: dict, kind: str) -> int:
    """Compress rate m of an attention kind (0: sliding window only)."""
    if kind == "sliding_attention":
        return 0
    return _positive({f"compress_rates.{kind}": rates.get(kind)}, f"compress_rates.{kind}", None)


def rope_dim(rope: RopeConfig, head_dim: int) -> int:
    """Rotary dims of a head: int(head_dim * partial_rotary_factor), even (transformers' rule)."""
    dim = int(head_dim * rope.partial_rotary_factor)
    if dim % 2 or dim < 2:
        raise ValueError(f"head_dim * partial_rotary_factor = {head_dim} * {rope.partial_rotary_factor} must give an even "
                         f"number >= 2 of rotary dims, got {dim}")
    return dim


def rope_tail(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the trailing R = 2 * cos.size(-1) dims of ``x`` [B, h, T, e] in interleaved pairs (2j, 2j + 1), in
    place order (V4's layout: its keys are also its values, so the order matters); cos / sin [B, T, R/2]."""
    R = 2 * cos.size(-1)
    c = cos.float().repeat_interleave(2, dim=-1).unsqueeze(1)
    s = sin.float().repeat_interleave(2, dim=-1).unsqueeze(1)
    rot = x[..., -R:].float()
    turned = torch.stack((-rot[..., 1::2], rot[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat([x[..., :-R], (rot * c + turned * s).to(x.dtype)], dim=-1)


class Compressor(nn.Module):
    """One entry per window of m positions (``wkv``, ``wgate`` [c * d, D], ``ape`` [m, c * d], ``norm``): each
    channel a softmax over the window's positions of wgate(x) + ape weighting wkv(x), RMSNorm'd, roped at the
    window's first position. ``overlap`` (CSA, c = 2): an entry pools 2m positions, the previous window's first
    d channels and its own window's last d (the first window: its own only)."""

    def __init__(self, hidden_size: int, dim: int, rate: int, overlap: bool, eps: float, rotary: RotaryEmbedding,
                 dtype=None):
        super().__init__()
        self.dim, self.rate, self.overlap = dim, rate, overlap
        c = 2 if overlap else 1
        self.wkv = nn.Linear(hidden_size, c * dim, bias=False, dtype=dtype)
        self.wgate = nn.Linear(hidden_size, c * dim, bias=False, dtype=dtype)
        self.ape = nn.Parameter(torch.zeros(rate, c * dim, dtype=torch.float32))
        self.norm = RMSNorm(dim, eps, weight_in_fp32=True, dtype=torch.float32)
        object.__setattr__(self, "rotary", rotary)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, rate={self.rate}, overlap={self.overlap}"

    def window_positions(self, ends_BW: Tensor) -> Tensor:
        """The positions [B, W, S] each window ending at ``ends_BW`` pools (S = m, or 2m with overlap: the previous
        window's first); negative where before the sequence (the first window's previous one)."""
        span = torch.arange(-self.rate if self.overlap else 0, self.rate, device=ends_BW.device)
        return (ends_BW - self.rate + 1)[..., None] + span

    def pool_windows(self, kv_BWSc: Tensor, gate_BWSc: Tensor, positions_BWS: Tensor) -> Tensor:
        """The roped entries [B, W, d] of windows given their wkv(x) / wgate(x) rows [B, W, S, c * d] at
        ``positions_BWS`` (:meth:`window_positions`; rows at negative positions are ignored)."""
        m, d = self.rate, self.dim
        valid = (positions_BWS >= 0)[..., None]
        kv, gate = kv_BWSc, gate_BWSc
        if self.overlap:   # the previous window's first series, then this window's second
            kv = torch.cat([kv[:, :, :m, :d], kv[:, :, m:, d:]], dim=2)
            gate = torch.cat([gate[:, :, :m, :d] + self.ape[:, :d], gate[:, :, m:, d:] + self.ape[:, d:]], dim=2)
        else:
            gate = gate + self.ape
        gate = gate.float().masked_fill(~valid, float("-inf"))
        kv = kv.masked_fill(~valid, 0.0)
        pooled = self.norm((kv * gate.softmax(dim=2).to(kv.dtype)).sum(dim=2))   # [B, W, d]
        cos, sin = self.rotary(positions_BWS[..., -m], pooled.dtype)          # (each window's first position)
        return rope_tail(pooled.unsqueeze(1), cos, sin).squeeze(1)

    def entries(self, x_BTD: Tensor, positions_BT: Tensor, cache: KVCache | None, slots: Tensor | None, kv_len: int,
                layer: int, names: tuple) -> tuple[Tensor, Tensor]:
        """(entries [B, W, d], the last position of each one's window [W]): without a cache those of the T tokens
        (positions 0..T-1); with one, the new tokens' raw rows and newly completed entries are written first
        (cache names ``names``: raw kv, raw gate, entries) and the slots' entries 0..kv_len // m - 1 read back
        (only the positions needed are read: each new window's, and one entry every m)."""
        m, (n_kv, n_gate, n_entries) = self.rate, names
        kv, gate = self.wkv(x_BTD), self.wgate(x_BTD)                            # [B, T, c * d]
        B, T, _ = x_BTD.shape
        if cache is None:
            ends = torch.arange(m - 1, max(T, m - 1), m, device=x_BTD.device)
            at = self.window_positions(ends.expand(B, -1))                        # [B, W, S]
            flat = at.clamp(min=0).reshape(B, -1, 1)
            rows = [t.gather(1, flat.expand(-1, -1, t.size(-1))).view(*at.shape, t.size(-1)) for t in (kv, gate)]
            return self.pool_windows(*rows, at), ends
        pools = cache.put(layer, slots, positions_BT, **{n_kv: kv.unsqueeze(1), n_gate: gate.unsqueeze(1)})
        ends_BN = new_window_ends(positions_BT, m)
        if ends_BN is not None:
            at = self.window_positions(ends_BN)                                   # [B, N, S]
            flat = at.clamp(min=0).reshape(B, -1)
            rows = [cache.gather(pools[n], slots, flat)[:, 0].view(*at.shape, -1).to(kv.dtype) for n in (n_kv, n_gate)]
            fresh = self.pool_windows(*rows, at)                                  # [B, N, d]
            cache.put(layer, slots, ends_BN, **{n_entries: fresh.unsqueeze(1)})
        ends = torch.arange(m - 1, max(kv_len, m - 1), m, device=x_BTD.device)
        stored = cache.gather(cache.kv_pool(layer, n_entries, 1, self.dim), slots, ends.expand(B, -1))
        return stored[:, 0].to(x_BTD.dtype), ends                                 # [B, kv_len // m, d]


def new_window_ends(positions_BT: Tensor, m: int) -> Tensor | None:
    """The last positions [B, N] of the windows the new tokens complete, per row (where their entries are computed
    from and stored), or None when no row completes one. A row with fewer than N pads with a copy of its last one
    (the same value written twice), or, with none, with its last new position, which ends no window (its entry slot
    is never read)."""
    first, last = positions_BT[:, 0], positions_BT[:, -1]
    e0 = first + (m - 1 - first) % m                                              # first window end >= first
    n_B = torch.where(e0 <= last, torch.div(last - e0, m, rounding_mode="floor") + 1, torch.zeros_like(e0))
    N = int(n_B.max())
    if N == 0:
        return None
    j = torch.arange(N, device=positions_BT.device)
    ends = e0[:, None] + m * j
    pad = torch.where(n_B > 0, e0 + m * (n_B - 1), last)[:, None]
    valid = j[None] < n_B[:, None]
    return torch.where(valid, ends, pad)


class V4Indexer(nn.Module):
    """The lightning indexer of a CSA layer (``wq_b`` [I * i, Q], ``weights_proj`` [I, D], ``compressor``: its
    own overlapping entries at i = ``index_head_dim``): which compressed entries each query keeps."""

    def __init__(self, hidden_size: int, q_lora_rank: int, heads: int, dim: int, topk: int, rate: int, eps: float,
                 rotary: RotaryEmbedding, dtype=None):
        super().__init__()
        self.heads, self.dim, self.topk = heads, dim, topk
        self.wq_b = nn.Linear(q_lora_rank, heads * dim, bias=False, dtype=dtype)
        self.weights_proj = nn.Linear(hidden_size, heads, bias=False, dtype=dtype)
        self.compressor = Compressor(hidden_size, dim, rate, True, eps, rotary, dtype)
        object.__setattr__(self, "rotary", rotary)

    def forward(self, x_BTD: Tensor, q_res: Tensor, positions_BT: Tensor, cache, slots, kv_len, layer: int) -> Tensor:
        """bool [B, T, W]: the entries each query attends to (complete for it, and among its ``index_topk`` best)."""
        B, T, _ = x_BTD.shape
        keys, ends = self.compressor.entries(x_BTD, positions_BT, cache, slots, kv_len, layer, ("ikv", "igate", "icomp"))
        visible = ends[None, None, :] <= positions_BT[:, :, None]                 # [B, T, W]
        W = keys.size(1)
        if W == 0:
            return visible
        cos, sin = self.rotary(positions_BT, x_BTD.dtype)
        q = self.wq_b(q_res).view(B, T, self.heads, self.dim).transpose(1, 2)
        q = rope_tail(q, cos, sin).transpose(1, 2)                                # [B, T, I, i]
        scores = F.relu(torch.matmul(q.float(), keys.float().transpose(-1, -2).unsqueeze(1))) * self.dim ** -0.5
        weights = self.weights_proj(x_BTD).float() * self.heads ** -0.5          # [B, T, I]
        index = (scores * weights.unsqueeze(-1)).sum(dim=2).masked_fill(~visible, float("-inf"))   # [B, T, W]
        return keep_top(index, self.topk) & visible


class V4Attention(nn.Module):
    """One layer's attention (see the module docstring); ``compress_rate`` 0: sliding window only; ``indexer``
    present on CSA layers. ``forward(x [B, T, D], positions [B, T], cache, slots, kv_len) -> [B, T, D]``."""

    def __init__(self, cfg: ModelConfig, fields: V4Fields, layer_idx: int, rotary: RotaryEmbedding,
                 compress_rotary: RotaryEmbedding, dtype=None, kind: str | None = None):
        super().__init__()
        D, H, d, Q = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank
        eps = cfg.rms_norm_eps
        if kind is None:
            kind, rate = cfg.layer_types[layer_idx], fields.compress_rates[layer_idx]
        else:   # a layer past the decoder's (the MTP layer): its kind given, its rate by kind
            rate = _kind_rate(dict(fields.kind_rates), kind)
        self.layer_idx, self.num_heads, self.head_dim, self.eps = layer_idx, H, d, eps
        self.window, self.scale, self.groups = cfg.sliding_window, d ** -0.5, fields.o_groups   # (every kind)
        kw = dict(bias=False, dtype=dtype)
        self.wq_a = nn.Linear(D, Q, **kw)
        self.q_norm = RMSNorm(Q, eps, weight_in_fp32=True, dtype=torch.float32)
        self.wq_b = nn.Linear(Q, H * d, **kw)
        self.wkv = nn.Linear(D, d, **kw)
        self.norm = RMSNorm(d, eps, weight_in_fp32=True, dtype=torch.float32)
        self.wo_a = nn.Linear(H * d // fields.o_groups, fields.o_groups * fields.o_lora_rank, **kw)
        self.wo_b = nn.Linear(fields.o_groups * fields.o_lora_rank, D, **kw)
        self.attn_sink = nn.Parameter(torch.zeros(H, dtype=torch.float32))
        self.compressor = self.indexer = None
        if rate:
            self.compressor = Compressor(D, d, rate, kind == "compressed_sparse_attention", eps, compress_rotary, dtype)
        if kind == "compressed_sparse_attention":
            self.indexer = V4Indexer(D, Q, cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk, rate, eps,
                                     compress_rotary, dtype)
        object.__setattr__(self, "rotary", compress_rotary if rate else rotary)

    def extra_repr(self) -> str:
        return f"layer={self.layer_idx}, heads={self.num_heads}, head_dim={self.head_dim}, window={self.window}"

    def forward(self, x_BTD: Tensor, positions_BT: Tensor, cache: KVCache | None = None, slots: Tensor | None = None,
                kv_len: int | None = None) -> Tensor:
        B, T, _ = x_BTD.shape
        H, d = self.num_heads, self.head_dim
        cos, sin = self.rotary(positions_BT, x_BTD.dtype)
        q_res = self.q_norm(self.wq_a(x_BTD))                                     # [B, T, Q]
        q = self.wq_b(q_res).view(B, T, H, d).transpose(1, 2)
        q = rope_tail(rms_unweighted(q, self.eps), cos, sin)                                # [B, H, T, d]
        kv = rope_tail(self.norm(self.wkv(x_BTD)).unsqueeze(1), cos, sin)         # [B, 1, T, d]
        k_pos = positions_BT
        if cache is not None:
            kv_len = cached_length(positions_BT, slots, kv_len)
            pool = cache.put(self.layer_idx, slots, positions_BT, kv=kv)["kv"]
            lo = max(0, int(positions_BT.min()) - self.window + 1)   # keys before lo are out of every query's window
            k_pos = torch.arange(lo, kv_len, device=x_BTD.device).expand(B, -1)
            kv = cache.gather(pool, slots, k_pos).to(x_BTD.dtype)                  # [B, 1, L, d]
        mask = attention_mask(positions_BT, k_pos, self.window)                  # [B, 1, T, L]
        if self.compressor is not None:
            entries, ends = self.compressor.entries(x_BTD, positions_BT, cache, slots, kv_len, self.layer_idx,
                                                    ("ckv", "cgate", "comp"))
            if self.indexer is not None:
                seen = self.indexer(x_BTD, q_res, positions_BT, cache, slots, kv_len, self.layer_idx)
            else:
                seen = ends[None, None, :] <= positions_BT[:, :, None]
            kv = torch.cat([kv, entries.unsqueeze(1)], dim=2)
            mask = torch.cat([mask, seen.unsqueeze(1)], dim=-1)
        out = _attend_with_sinks(q, kv, kv, mask, self.scale, self.attn_sink)   # [B, H, T, d]
        out = rope_tail(out, cos, -sin)              # keys are values: undo their rotation at the query's position
        G = self.groups
        grouped = out.transpose(1, 2).reshape(B, T, G, H * d // G)
        w = dense_weight(self.wo_a, grouped.dtype).view(G, -1, H * d // G)         # [G, o, H * d / G]
        return self.wo_b(torch.einsum("btgi,goi->btgo", grouped, w).reshape(B, T, -1))


class _TokenIds:
    """The token ids of the forward in progress, for the hash-routed layers (set by the model's forward)."""

    def __init__(self):
        self.ids: Tensor | None = None


class _HashTable(nn.Module):
    """``tid2eid`` [V, K]: the experts of each token id (hash routing)."""

    def __init__(self, vocab_size: int, k: int):
        super().__init__()
        self.register_buffer("tid2eid", torch.zeros(vocab_size, k, dtype=torch.long))


class V4MoeBlock(SparseMoeBlock):
    """DeepSeek-V4's MoE: sqrt(softplus) (or sigmoid) scores of the fp32 router logits; the experts by top-k of the
    scores plus the selection bias, or (``hash``) looked up by token id; their scores renormalised, times
    ``routed_scaling_factor``; then the experts and the shared expert (:meth:`MoELayer.forward_routed`)."""

    def __init__(self, cfg: ModelConfig, hashed: bool, token_ids: _TokenIds, dtype=None):
        limit = cfg.swiglu_limit
        super().__init__(cfg, "softmax" if hashed else "sigmoid", normalize=True,
                         glu="silu" if limit is None else "silu_clamp_in", num_shared_experts=1,
                         shared_hidden_size=cfg.expert_hidden_size,
                         router_groups=False, route_scale=cfg.routed_scaling_factor, glu_limit=limit, dtype=dtype)
        self.scoring, self.k, self.scale = cfg.scoring_func, cfg.num_experts_per_tok, cfg.routed_scaling_factor
        self.hash = _HashTable(cfg.vocab_size, self.k) if hashed else None
        object.__setattr__(self, "token_ids", token_ids)

    def forward(self, x_BTD: Tensor) -> Tensor:
        x_TD = x_BTD.reshape(-1, self.hidden_size)
        gate = self.moe.gates[0]
        logits = gate(x_TD)                                                       # fp32 [T, E]
        scores = torch.sigmoid(logits) if self.scoring == "sigmoid" else F.softplus(logits).sqrt()
        if self.hash is not None:
            ids = self.token_ids.ids
            if ids is None or ids.numel() != x_TD.size(0):
                raise RuntimeError("a hash-routed DeepSeek-V4 layer needs the forward's token ids (run the model, "
                                   "not the block alone)")
            ids_TK = self.hash.tid2eid[ids.reshape(-1).to(self.hash.tid2eid.device)]
        else:
            ids_TK = (scores + gate.e_score_correction_bias).topk(self.k, dim=-1).indices
        w = scores.gather(1, ids_TK)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20) * self.scale
        y = self.moe.forward_routed(x_BTD, ids_TK, w)
        self.last_stats = y.routing_stats
        return y

    def decode_fused(self, h_TD: Tensor, norm: nn.Module) -> Fused:
        return Fused(None, Holds(), "DeepSeek-V4's router (sqrt(softplus) scores, hash routing by token id) has no "
                                    "kernel; its experts run through the experts' kernel in forward")


class V4NextTokenPredictor(NextTokenPredictor):
    """DeepSeek-V4's MTP depth (``mtp.{j}.``): ``g = layer(e_proj(enorm(embed(x_{p+1}))) + h_proj(hnorm(h_p)))`` on
    the residual streams -- h_p the main model's final streams [B, T, N, D] (before ``hc_head``), each stream
    RMS-normed, the embedding's projection added to every stream --, a V4 decoder layer (hyper-connections,
    its attention kind's cache entries at layer N + j), then its own ``hc_head_{fn,base,scale}`` collapsing the
    streams, its own ``norm`` and the model's ``head``. A hash-routed layer routes by the head's input tokens."""

    def __init__(self, block: nn.Module, cfg: ModelConfig, fields: V4Fields, token_ids: "_TokenIds", dtype=None):
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        super().__init__(block, D, cfg.vocab_size, eps, dtype=dtype, split_proj=True,
                         head_norm=HyperHeadNorm(D, fields.hc_mult, eps, fields.hc_eps, weight_in_fp32=True))
        object.__setattr__(self, "token_ids", token_ids)

    def forward(self, next_ids_BT: Tensor, hidden_BTND: Tensor, positions_BT: Tensor, cache=None, slots=None,
                kv_len: int | None = None) -> Tensor:
        self.token_ids.ids = next_ids_BT
        try:
            return super().forward(next_ids_BT, hidden_BTND, positions_BT, cache, slots, kv_len)
        finally:
            self.token_ids.ids = None


class DeepseekV4ForCausalLM(MTPHeads, CausalLM):
    """DeepSeek-V4 (see the module docstring)."""

    checkpoint_renames = ((".norm.hc_head.", ".hc_head."), (".self_attn.", ".attn."),
                          (".input_layernorm.", ".attn_norm."), (".post_attention_layernorm.", ".ffn_norm."),
                          (".attn_hc.", ".hc_attn_"), (".ffn_hc.", ".hc_ffn_"),
                          (".mlp.moe.gates.0.wg.", ".ffn.gate."), (".mlp.moe.gates.0.e_score_correction_bias",
                                                                    ".ffn.gate.bias"),
                          (".mlp.moe.shared_experts.gate_proj.", ".ffn.shared_experts.w1."),
                          (".mlp.moe.shared_experts.up_proj.", ".ffn.shared_experts.w3."),
                          (".mlp.moe.shared_experts.down_proj.", ".ffn.shared_experts.w2."),
                          (".mlp.moe.experts", ".ffn.experts"), (".mlp.hash.tid2eid", ".ffn.gate.tid2eid"),
                          ("lm_head.", "head."))
    expert_layout = PerExpert("w1", "w3", "w2")
    use_decode_plan = False   # (the layers are this module's own: no fused kernels to lay out)
    hidden_before_norm = True   # (the MTP heads read the residual streams before hc_head)
    mtp_marker = "e_proj.weight"
    mtp_renames = (("shared_head.norm.hc_head.hc_", "hc_head_"), ("shared_head.norm.", "norm."),
                   ("shared_head.head.", "head."), ("embed_tokens.", "emb.tok_emb."))

    @property
    def unused_checkpoint_prefixes(self) -> tuple:
        # mtp.* tensors without a depth's e_proj make no head (adapt_to_checkpoint says so): left unread
        return () if self.has_mtp else ("mtp.",)

    def __init__(self, config: ModelConfig, dtype=None):
        fields = v4_fields(config)
        object.__setattr__(self, "fields", fields)
        object.__setattr__(self, "token_ids", _TokenIds())
        object.__setattr__(self, "hub_names", False)
        super().__init__(config, dtype)
        self.model.embed_tokens.__class__ = StreamEmbedding
        self.model.embed_tokens.streams = fields.hc_mult

    def build_rotary(self, cfg: ModelConfig) -> nn.Module:
        f, d = self.fields, cfg.head_dim
        rotary = nn.Module()
        rotary.main = RotaryEmbedding(f.main_rope, rope_dim(f.main_rope, d), cfg.max_position_embeddings)
        rotary.compress = RotaryEmbedding(f.compress_rope, rope_dim(f.compress_rope, d), cfg.max_position_embeddings)
        if cfg.index_head_dim is not None and rotary.compress.dim > cfg.index_head_dim:
            raise ValueError(f"config field 'index_head_dim' must be >= the rotary dims {rotary.compress.dim}, got "
                             f"{cfg.index_head_dim}")
        return rotary

    def build_norm(self, cfg: ModelConfig, dim: int, dtype) -> nn.Module:
        return HyperHeadNorm(dim, self.fields.hc_mult, cfg.rms_norm_eps, self.fields.hc_eps, weight_in_fp32=True)

    def build_layer(self, cfg: ModelConfig, i: int, rotary: nn.Module, dtype, kind: str | None = None,
                    hashed: bool | None = None) -> HyperDecoderLayer:
        """Decoder layer i (``kind`` / ``hashed``: given for a layer past the decoder's, an MTP layer)."""
        f, D, eps = self.fields, cfg.hidden_size, cfg.rms_norm_eps
        attn = V4Attention(cfg, f, i, rotary.main, rotary.compress, dtype, kind=kind)
        mlp = V4MoeBlock(cfg, f.hash_layers[i] if hashed is None else hashed, self.token_ids, dtype)
        norms = [RMSNorm(D, eps, weight_in_fp32=True, dtype=torch.float32) for _ in range(2)]
        hcs = [HyperConnection(D, f.hc_mult, f.hc_sinkhorn_iters, f.hc_eps, eps) for _ in range(2)]
        return HyperDecoderLayer(attn, mlp, *norms, *hcs)

    def forward(self, input_ids: Tensor, cache: KVCache | None = None, slots: Tensor | None = None,
                logits_to_keep: int = 0, return_hidden: bool = False):
        self.token_ids.ids = input_ids
        try:
            return super().forward(input_ids, cache, slots, logits_to_keep, return_hidden)
        finally:
            self.token_ids.ids = None

    # ---- multi-token prediction (mtp.{j}.*; dynamoe.models.mtp) --------------------------------------
    def mtp_prefix(self, j: int) -> str:
        return f"mtp.{j}."

    def mtp_depth_of(self, name: str) -> int | None:
        m = _MTP_DEPTH.match(name)
        return int(m.group(1)) if m else None

    def build_mtp_layer(self, cfg: ModelConfig, i: int, rotary: nn.Module, dtype, names: set) -> HyperDecoderLayer:
        """The V4 layer of MTP depth j = i - N: its attention kind ``layer_types`` / ``compress_ratios`` entry i
        where the config lists one past the decoder's (the hub's lists do), else what its tensors are (an indexer:
        compressed sparse, a compressor: heavily compressed, neither: sliding window); hash-routed where
        ``mlp_layer_types`` entry i says so, else where it has a ``ffn.gate.tid2eid``."""
        raw, pre = cfg.raw, self.mtp_prefix(i - cfg.num_hidden_layers)
        kind = None
        for field in ("layer_types", "compress_ratios"):
            listed = raw.get(field)
            if isinstance(listed, (list, tuple)) and len(listed) > i:
                kind = listed[i] if field == "layer_types" else _V4_COMPRESS_RATIO_KINDS.get(listed[i], listed[i])
                if kind not in V4_LAYER_TYPES:
                    raise ValueError(f"config field {field!r} entry {i} (the multi-token-prediction layer {pre}) must "
                                     f"give one of {list(V4_LAYER_TYPES)}, got {listed[i]!r}")
                break
        if kind is None:
            kind = ("compressed_sparse_attention" if pre + "attn.indexer.weights_proj.weight" in names else
                    "heavily_compressed_attention" if pre + "attn.compressor.wkv.weight" in names else
                    "sliding_attention")
        if kind == "compressed_sparse_attention":
            missing = [f for f in ("index_topk", "index_head_dim", "index_n_heads") if getattr(cfg, f) is None]
            if missing:
                raise ValueError(f"config fields {missing} are required: the multi-token-prediction layer {pre} is "
                                 f"'compressed_sparse_attention'")
        mlp = raw.get("mlp_layer_types")
        hashed = (mlp[i] == "hash_moe" if isinstance(mlp, (list, tuple)) and len(mlp) > i
                  else pre + "ffn.gate.tid2eid" in names)
        return self.build_layer(cfg, i, rotary, dtype, kind=kind, hashed=hashed)

    def new_mtp_head(self, cfg: ModelConfig, block: nn.Module, dtype) -> V4NextTokenPredictor:
        return V4NextTokenPredictor(block, cfg, self.fields, self.token_ids, dtype)

    # ---- checkpoint names: transformers' files (under model.) or the hub's (top level) ----------------
    def adapt_to_checkpoint(self, names) -> None:
        names = set(names)
        object.__setattr__(self, "hub_names", "embed.weight" in names)
        super().adapt_to_checkpoint(names)
        if not self.has_mtp and any(n.startswith("mtp.") for n in names):
            log.info("deepseek_v4: the checkpoint's mtp.* tensors have no mtp.{j}.e_proj.weight: no "
                     "multi-token-prediction head is built (they are left unread)")

    def checkpoint_name(self, name: str) -> str:
        name = super().checkpoint_name(name)
        if not self.hub_names:
            return name
        name = name.removeprefix("model.")
        if name == "embed_tokens.weight":
            return "embed.weight"
        return name.replace("hc_head.hc_", "hc_head_", 1) if name.startswith("hc_head.") else name

