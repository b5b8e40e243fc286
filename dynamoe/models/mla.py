"""DeepSeek Multi-head Latent Attention (MLA) over the slot KV cache, optionally sparse through the
V3.2 / GLM-5 indexer (:mod:`dynamoe.models.indexer`).

Legend: B batch rows, T new tokens, L keys (cache positions 0..L-1), H heads, n qk_nope_head_dim,
r qk_rope_head_dim, v v_head_dim, C kv_lora_rank, Q q_lora_rank, D model dim.

    q = q_b(RMSNorm(q_a(x)))  (or q_proj(x) when q_lora_rank is null)   -> per head [q_nope (n) | q_rope (r)]
    kv_a(x) = [c (C) | k_rope (r)];  c <- RMSNorm(c)                       (one latent per position)
    kv_b(c) -> per head [k_nope (n) | v (v)]
    RoPE on q_rope and k_rope (interleaved pairs when ``rope_interleaved``; k_rope is shared by the heads)
    softmax scale = (n + r)^-1/2, times yarn_mscale(factor, mscale_all_dim)^2 under YaRN

The cache holds what MLA compresses to: per position the normalised latent ``c`` ("latent",
[slots, 1, S, C]) and the roped ``k_rope`` ("k_rope", [slots, 1, S, r]) -- C + r numbers per token and
layer instead of H * (n + r + v).

Two equal ways to attend (tested equal):

* expanded: k_nope, v = kv_b(c) for every key, then plain attention (cheapest when the queries are
  as many as the keys: prefill);
* absorbed: kv_b folded into the query and the output, q_c[h] = q_nope[h] W_k[h] (W_k[h]: [n, C]),
  scores = q_c . c + q_rope . k_rope, out[h] = (probs @ c) W_v[h]^T -- multi-query attention over the
  cached latents, no per-key expansion (cheapest for decode: few queries, many keys).

``absorb=None`` picks whichever costs fewer multiply-adds for the step's T and L; True / False force one.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ..quant.dequantize import dense
from .attention import _attend_with_sinks, _sdpa, attend, attention_mask, cached_length, write_kv
from .cache import KVCache
from .indexer import Indexer, SharedIndex
from .norms import RMSNorm
from .rope import RotaryEmbedding, apply_rope, yarn_mscale

__all__ = ["MLAttention", "mla_softmax_scale", "LogPositionScale", "SharedLatents", "dense_weight"]


def mla_softmax_scale(rope, qk_head_dim: int) -> float:
    """(n + r)^-1/2, times m^2 with m = yarn_mscale(factor, mscale_all_dim) for a scaled RoPE with
    ``mscale_all_dim`` (what DeepSeek's and transformers' MLA do)."""
    scale = qk_head_dim ** -0.5
    if rope.rope_type != "default" and rope.mscale_all_dim:
        m = yarn_mscale(rope.factor, rope.mscale_all_dim)
        scale = scale * m * m
    return scale


class LogPositionScale(nn.Module):
    """Per-head query scale ``scale`` [H] * ln(position + 1) + ``bias`` [H] (Mistral-Large-4's "ssmax" scaling).
    ``forward(q [B, H, T, d] (or [B, T, H, d] with ``heads_first`` False), positions [B, T])``."""

    def __init__(self, heads: int, dtype=None):
        super().__init__()
        self.scale = nn.Parameter(torch.zeros(heads, dtype=dtype))
        self.bias = nn.Parameter(torch.ones(heads, dtype=dtype))

    def forward(self, q: Tensor, positions_BT: Tensor, heads_first: bool = True) -> Tensor:
        dt = q.dtype
        log_pos = (positions_BT + 1).float().log().to(dt)
        scale, bias = self.scale.to(dt), self.bias.to(dt)
        if heads_first:
            return q * (scale[None, :, None] * log_pos[:, None, :] + bias[None, :, None]).unsqueeze(-1)
        return q * (scale[None, None, :] * log_pos[:, :, None] + bias[None, None, :]).unsqueeze(-1)


class SharedLatents:
    """The latents (normalised latent [B, 1, L, C], roped k_rope [B, 1, L, r]) of the layers others attend to
    (Mistral-Large-4's ``kv_source_layers``), from the forward in progress: one instance per model, written by a
    producing layer, read by the later layers that reuse its cache (matched by the positions tensor, which every
    layer of a forward receives as is)."""

    def __init__(self):
        self.by_layer: dict = {}

    def put(self, layer: int, positions_BT: Tensor, latent: Tensor, k_rope: Tensor) -> None:
        self.by_layer[layer] = (positions_BT, latent, k_rope)

    def get(self, layer: int, positions_BT: Tensor) -> tuple[Tensor, Tensor]:
        got = self.by_layer.get(layer)
        if got is None or got[0] is not positions_BT:
            raise RuntimeError(f"a layer reusing layer {layer}'s latents needs that layer earlier in the same forward")
        return got[1], got[2]


def dense_weight(linear: nn.Module, dtype: torch.dtype) -> Tensor:
    """An nn.Linear's weight, or a QuantizedLinear's dequantized."""
    if isinstance(linear, nn.Linear):
        return linear.weight.to(dtype)
    return dense(linear.qweight, dtype)


class MLAttention(nn.Module):
    """MLA self-attention of one decoder layer (names as the checkpoints': ``q_a_proj``,
    ``q_a_layernorm``, ``q_b_proj`` or ``q_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``,
    ``kv_b_proj``, ``o_proj``, and ``indexer.*`` for sparse attention).

    ``forward(x [B, T, D], positions [B, T], cache=None, slots=None, kv_len=None) -> [B, T, D]``, as
    :class:`~dynamoe.models.attention.Attention`.

    Sparse attention: ``indexer`` is an :class:`Indexer` (this layer scores its keys), or
    ``shared_index`` alone (GLM-5 'shared' layers reuse the previous full indexer's selection).
    ``llama4_scaling`` (beta, L): the queries are scaled by 1 + beta ln(1 + floor(position / L)) after
    RoPE (Mistral-4's Llama-4 attention scaling; None: not). ``lora_scales`` (q, kv): the queries are scaled by
    q and the normalised latent by kv before it is cached (LongCat-Flash's sqrt(D / rank) LoRA scales; None:
    not). ``rotary=None``: no position encoding at all (Kimi-Linear's MLA layers: q_rope and k_rope are
    used as they are projected). ``position_log_scale``: the queries are scaled per head by ``softmax_scaling``
    (:class:`LogPositionScale`, Mistral-Large-4). ``shared_latents`` with ``latent_source`` None: this layer's latents
    are kept there for later layers; with ``latent_source`` j: this layer has no ``kv_a_proj_with_mqa`` /
    ``kv_a_layernorm`` and attends to layer j's latents (already roped: only its queries rotate). ``sinks``: a learned
    sink logit per head in the softmax (``sinks`` [H], fp32; Hy4); ``output_gate``: the output of each head times
    sigmoid(``gate_proj``(x)) (one gate per value dim, [H * v, D]; Hy4). ``gated_queries`` (A.X-K2): ``q_b_proj``
    [H * (n + r + v), 2 Q] reads [q_a_layernorm(q_a(x)) | q_a(x)] and gives each head its query and an output gate
    (the output of each head times sigmoid of it). dots3_note's: ``sliding_window`` (each query sees its last W
    positions), ``head_gate`` (each head's output times sigmoid(``g_proj``(x)), one gate per head, [H, D], the
    sigmoid in fp32; also Ling-3's bailing_hybrid) and
    ``k_rope_norm`` (an RMSNorm ``k_rope_only_layernorm`` on the rotary key before RoPE).
    """

    def __init__(self, hidden_size: int, num_heads: int, q_lora_rank: int | None, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, layer_idx: int,
                 rotary: RotaryEmbedding | None, scale: float, rope_interleaved: bool = True, bias: bool = False,
                 norm_eps: float = 1e-6, indexer: Indexer | None = None, shared_index: SharedIndex | None = None,
                 absorb: bool | None = None, llama4_scaling: tuple | None = None, lora_scales: tuple | None = None,
                 position_log_scale: bool = False, shared_latents: SharedLatents | None = None,
                 latent_source: int | None = None, sinks: bool = False, output_gate: bool = False,
                 gated_queries: bool = False, sliding_window: int | None = None, head_gate: bool = False,
                 k_rope_norm: bool = False, dtype=None):
        super().__init__()
        self.layer_idx, self.num_heads = layer_idx, num_heads
        self.q_lora_rank, self.kv_lora_rank = q_lora_rank, kv_lora_rank
        self.nope, self.rope, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.qk_dim = qk_nope_head_dim + qk_rope_head_dim
        self.scale, self.rope_interleaved, self.absorb = scale, rope_interleaved, absorb
        self.llama4_scaling, self.lora_scales = llama4_scaling, lora_scales
        kw = dict(dtype=dtype)
        H = num_heads
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, H * self.qk_dim, bias=False, **kw)
        else:
            self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=bias, **kw)
            # transformers (and DeepSeek's code) build the two latent norms with the default eps 1e-6
            self.q_a_layernorm = RMSNorm(q_lora_rank, norm_eps, dtype=dtype)
            self.q_b_proj = (nn.Linear(2 * q_lora_rank, H * (self.qk_dim + v_head_dim), bias=False, **kw) if gated_queries
                             else nn.Linear(q_lora_rank, H * self.qk_dim, bias=False, **kw))
        if gated_queries and (q_lora_rank is None or output_gate):
            raise ValueError("gated_queries needs q_lora_rank and excludes output_gate (the queries carry the gate)")
        self.gated_queries = gated_queries
        if latent_source is not None and (shared_latents is None or latent_source >= layer_idx):
            raise ValueError(f"layer {layer_idx} reuses layer {latent_source}'s latents: it needs an earlier layer and "
                             "the model's SharedLatents")
        self.latent_source = latent_source
        if latent_source is None:
            self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=bias, **kw)
            self.kv_a_layernorm = RMSNorm(kv_lora_rank, norm_eps, dtype=dtype)
        self.softmax_scaling = LogPositionScale(num_heads, dtype=dtype) if position_log_scale else None
        self.sinks = nn.Parameter(torch.zeros(num_heads, dtype=torch.float32)) if sinks else None
        self.gate_proj = nn.Linear(hidden_size, H * v_head_dim, bias=False, **kw) if output_gate else None
        self.g_proj = nn.Linear(hidden_size, H, bias=False, **kw) if head_gate else None
        self.k_rope_only_layernorm = RMSNorm(qk_rope_head_dim, norm_eps, dtype=dtype) if k_rope_norm else None
        self.sliding_window = sliding_window
        self.kv_b_proj = nn.Linear(kv_lora_rank, H * (qk_nope_head_dim + v_head_dim), bias=False, **kw)
        self.o_proj = nn.Linear(H * v_head_dim, hidden_size, bias=bias, **kw)
        if indexer is not None and q_lora_rank is None and getattr(indexer, "q_input_norm", None) is None:
            raise ValueError("the sparse-attention indexer reads q_a_layernorm(q_a_proj(x)): it needs q_lora_rank")
        self.indexer = indexer
        object.__setattr__(self, "rotary", rotary)
        object.__setattr__(self, "shared_index", shared_index)
        object.__setattr__(self, "shared_latents", shared_latents)
        self._kv_b_cache: tuple | None = None  # (dtype, device, W_k [H, n, C], W_v [H, v, C]) for absorption

    def extra_repr(self) -> str:
        return (f"layer={self.layer_idx}, heads={self.num_heads}, q_lora={self.q_lora_rank}, "
                f"kv_lora={self.kv_lora_rank}, "
                f"nope={self.nope}, rope={self.rope}, v={self.v_dim}, rope_interleaved={self.rope_interleaved}, "
                f"sparse={'own' if self.indexer is not None else 'shared' if self.shared_index is not None else 'no'}")

    # ---- kv_b split per head, for absorption --------------------------------------------------------
    def _kv_b_heads(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(W_k [H, n, C], W_v [H, v, C]) from kv_b_proj. A packed (quantized) kv_b is dequantized
        once and kept (n + v) * H * C numbers per layer; a dense one is a view, never copied."""
        lin = self.kv_b_proj
        dense = isinstance(lin, nn.Linear)
        cached = self._kv_b_cache
        if not dense and cached is not None and cached[0] == dtype and cached[1] == next(lin.buffers()).device:
            return cached[2], cached[3]
        w = dense_weight(lin, dtype).view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
        w_k, w_v = w[:, :self.nope], w[:, self.nope:]
        if not dense:
            self._kv_b_cache = (dtype, w.device, w_k, w_v)
        return w_k, w_v

    def _use_absorption(self, T: int, L: int) -> bool:
        if self.absorb is not None:
            return self.absorb
        n, r, v, C = self.nope, self.rope, self.v_dim, self.kv_lora_rank
        expanded = L * C * (n + v) + T * L * (n + r + v)   # kv_b over the keys + attention, per head
        absorbed = T * C * (n + v) + T * L * (2 * C + r)   # q/o absorption + attention over latents
        return absorbed < expanded

    # ---- forward --------------------------------------------------------------------------------------
    def forward(self, x_BTD: Tensor, positions_BT: Tensor, cache: KVCache | None = None, slots: Tensor | None = None,
                kv_len: int | None = None) -> Tensor:
        B, T, _ = x_BTD.shape
        H, n, r, C = self.num_heads, self.nope, self.rope, self.kv_lora_rank
        q_resid = None
        if self.q_lora_rank is None:
            q = self.q_proj(x_BTD)
        else:
            q_comp = self.q_a_proj(x_BTD)
            q_resid = self.q_a_layernorm(q_comp)
            if self.gated_queries:  # A.X-K2: [query | output gate] per head from [normalised | raw] low-rank queries
                qg = self.q_b_proj(torch.cat([q_resid, q_comp], dim=-1)).view(B, T, H, self.qk_dim + self.v_dim)
                q, q_gate = qg[..., :self.qk_dim].reshape(B, T, -1), qg[..., self.qk_dim:].reshape(B, T, -1)
            else:
                q = self.q_b_proj(q_resid)
        q = q.view(B, T, H, self.qk_dim).transpose(1, 2)                     # [B, H, T, n + r]
        q_nope, q_rope = q[..., :n], q[..., n:]
        reused = self.latent_source is not None
        if not reused:
            latent, k_rope = self.kv_a_proj_with_mqa(x_BTD).split([C, r], dim=-1)
            latent = self.kv_a_layernorm(latent).unsqueeze(1)                  # [B, 1, T, C]
            k_rope = k_rope.unsqueeze(1)                                       # [B, 1, T, r]
            if self.k_rope_only_layernorm is not None:
                k_rope = self.k_rope_only_layernorm(k_rope)
        if self.lora_scales is not None:  # LongCat-Flash: the queries and the latent (not k_rope) scaled
            sq, skv = self.lora_scales
            q_nope, q_rope, latent = q_nope * sq, q_rope * sq, latent * skv
        if self.rotary is not None:  # (None: NoPE, Kimi-Linear -- the "rope" part stays unrotated)
            cos, sin = self.rotary(positions_BT, q.dtype)
            q_rope = apply_rope(q_rope, cos, sin, self.rope_interleaved)
            if not reused:
                k_rope = apply_rope(k_rope, cos, sin, self.rope_interleaved)
        if self.llama4_scaling is not None:  # Mistral-4: queries times 1 + beta * ln(1 + floor(position / L))
            beta, length = self.llama4_scaling
            s = (1 + beta * torch.log(1 + torch.floor(positions_BT / length))).to(q.dtype)[:, None, :, None]
            q_nope, q_rope = q_nope * s, q_rope * s
        if self.softmax_scaling is not None:  # Mistral-Large-4: per head, scale * ln(position + 1) + bias
            q_nope, q_rope = (self.softmax_scaling(t, positions_BT) for t in (q_nope, q_rope))
        k_pos = None
        if cache is not None:
            kv_len = cached_length(positions_BT, slots, kv_len)
            k_pos = torch.arange(kv_len, device=x_BTD.device).expand(B, kv_len)
        if reused:
            latent, k_rope = self.shared_latents.get(self.latent_source, positions_BT)
        elif cache is not None:
            kv = write_kv(cache, self.layer_idx, slots, positions_BT, kv_len, latent=latent, k_rope=k_rope)
            latent, k_rope = kv["latent"], kv["k_rope"]                        # [B, 1, L, C], [B, 1, L, r]
        if self.shared_latents is not None and not reused:
            self.shared_latents.put(self.layer_idx, positions_BT, latent, k_rope)
        if self.indexer is not None:
            allowed = self.indexer(x_BTD, q_resid, positions_BT, k_pos, cache, slots, kv_len)
        elif self.shared_index is not None:
            allowed = self.shared_index.get(positions_BT)
        else:
            allowed = None
        L = latent.size(2)
        if self._use_absorption(T, L):
            w_k, w_v = self._kv_b_heads(q.dtype)
            q_lat = torch.matmul(q_nope, w_k)                                  # [B, H, T, C]
            out = self._attend(torch.cat([q_lat, q_rope], dim=-1), torch.cat([latent, k_rope], dim=-1), latent,
                               positions_BT, k_pos, allowed)                   # [B, H, T, C]
            out = torch.matmul(out, w_v.transpose(-1, -2))                     # [B, H, T, v]
        else:
            kv = self.kv_b_proj(latent.squeeze(1)).view(B, L, H, n + self.v_dim).transpose(1, 2)
            k_nope, v = kv[..., :n], kv[..., n:]
            k = torch.cat([k_nope, k_rope.expand(B, H, L, r)], dim=-1)
            out = self._attend(torch.cat([q_nope, q_rope], dim=-1), k, v, positions_BT, k_pos, allowed)
        if self.g_proj is not None:  # dots3_note, Ling-3: one sigmoid gate per head (in fp32)
            out = out * torch.sigmoid(self.g_proj(x_BTD).float()).to(out.dtype).transpose(1, 2).unsqueeze(-1)
        out = out.transpose(1, 2).reshape(B, T, H * self.v_dim)
        if self.gate_proj is not None:
            out = out * torch.sigmoid(self.gate_proj(x_BTD))
        elif self.gated_queries:
            out = (out * torch.sigmoid(q_gate.float())).to(out.dtype)
        return self.o_proj(out)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, positions_BT: Tensor, k_pos: Tensor | None,
                allowed: Tensor | None) -> Tensor:
        if self.sinks is not None:
            mask = attention_mask(positions_BT, positions_BT if k_pos is None else k_pos, self.sliding_window)
            return _attend_with_sinks(q, k, v, mask if allowed is None else mask & allowed, self.scale, self.sinks)
        if allowed is None:
            return attend(q, k, v, positions_BT, k_pos, self.scale, self.sliding_window)
        if self.sliding_window is not None:
            allowed = allowed & attention_mask(positions_BT, positions_BT if k_pos is None else k_pos, self.sliding_window)
        return _sdpa(q, k, v, allowed, self.scale, causal=False)
