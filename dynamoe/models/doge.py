"""SmallDoge's Doge (``model_type: doge``): dynamic-mask attention (DMA) and per-channel residual weights.

Legend: B batch, T new tokens, L keys (cached positions 0..L-1), H query heads, K key/value heads, d head dim.

Attention: GQA with per-head q/k RMSNorms before RoPE; each key position j gets a bias per KV head from its value,
dt_j = exp(A * softplus(dt_proj(v_j))) (``A`` [K], ``dt_proj`` [K, K d]), added to every query's score of that key
(after the softmax scale); keys a query may not see (causal, and ``sliding_window`` when set) are masked, and when
there are more than ``keep_window_size`` keys each query keeps only the ``keep_window_size`` with the largest
biases among them (torch.topk on the row, as transformers: where biases tie at the boundary -- a repeated token has
the same layer-0 bias, up to the rounding of the forward that computed it -- the kept keys depend on the row's
length and rounding, so a full forward and a cached decode may keep different keys, in transformers as here; each
mode gives transformers' logits of that mode). Layers: h = input_residual * h + attn(norm1(h)); h = post_attention_residual * h +
mlp(norm2(h)) (per-channel weights [D]); dense SwiGLU MLPs (biases when ``mlp_bias``).

``is_moe`` (DogeCDMoE, product-key retrieval of single-neuron experts) is refused: transformers splits the router
logits of a forward with ``.view(2, tokens, keys)`` over the whole batch, so a token's experts depend on the other
tokens in the forward (a cached decode step differs from the full forward, a batch from its rows alone) -- not a
per-token routing that a cache or a serving batch could reproduce.

Checkpoint (transformers' names): ``self_attn.{q,k,v,o}_proj``, ``self_attn.{q,k}_norm``, ``self_attn.A``,
``self_attn.dt_proj``, ``input_residual``, ``post_attention_residual``, ``mlp.{gate,up,down}_proj``.

No fused decode kernels: the attention kernel has no dynamic mask (it says so), and the layers have their own
forward (residual weights).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops.fused import Unfusable
from .attention import Attention, attention_mask, cached_length, write_kv
from .base import CausalLM
from .cache import KVCache
from .config import ModelConfig
from .moe_block import GatedMLP, glu_kind
from .norms import RMSNorm
from .rope import RotaryEmbedding, apply_rope

__all__ = ["DogeForCausalLM", "DogeAttention", "WeightedResidualLayer"]


class DogeAttention(Attention):
    """GQA with per-head q/k RMSNorms, RoPE and the dynamic mask (see the module docstring)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, layer_idx: int,
                 rotary: RotaryEmbedding, bias: bool = False, norm_eps: float = 1e-6, sliding_window: int | None = None,
                 keep_window_size: int = 2048, dtype=None):
        super().__init__(hidden_size, num_heads, num_kv_heads, head_dim, layer_idx, rotary, qkv_bias=bias, o_bias=bias,
                         qk_norm=True, norm_eps=norm_eps, sliding_window=sliding_window, dtype=dtype)
        if isinstance(keep_window_size, bool) or not isinstance(keep_window_size, int) or keep_window_size < 1:
            raise ValueError(f"config field 'keep_window_size' must be an int >= 1, got {keep_window_size!r}")
        self.keep_window_size = keep_window_size
        self.A = nn.Parameter(torch.zeros(num_kv_heads, dtype=dtype))
        self.dt_proj = nn.Linear(num_kv_heads * head_dim, num_kv_heads, bias=bias, dtype=dtype)

    def _decode_weights(self, kernels, holds, norm, dtype):
        raise Unfusable("dynamic-mask attention (a learned bias per key and a top-k of the keys): the fused kernel "
                        "has neither")

    def dynamic_bias(self, v_BKLd: Tensor, q_pos_BT: Tensor, k_pos_BL: Tensor) -> Tensor:
        """The additive attention mask [B, H, T, L] in v's dtype: each visible key's bias dt, the most negative value
        elsewhere and, past ``keep_window_size`` keys, outside each query's top ``keep_window_size`` biases."""
        B, K, L, d = v_BKLd.shape
        T = q_pos_BT.size(1)
        dt = self.dt_proj(v_BKLd.transpose(1, 2).reshape(B, L, K * d))                     # [B, L, K]
        dt = torch.exp(self.A * F.softplus(dt)).transpose(1, 2)                              # [B, K, L]
        lowest = torch.finfo(v_BKLd.dtype).min
        visible = attention_mask(q_pos_BT, k_pos_BL, self.sliding_window)                    # [B, 1, T, L]
        bias = dt[:, :, None, :].expand(B, K, T, L).masked_fill(~visible, lowest)
        if L > self.keep_window_size:
            top = bias.topk(self.keep_window_size, dim=-1).indices
            keep = torch.zeros_like(bias, dtype=torch.bool).scatter_(-1, top, True)
            bias = bias.masked_fill(~keep, lowest)
        return bias.repeat_interleave(self.num_heads // K, dim=1)                            # query head h: KV h // G

    def forward(self, x_BTD: Tensor, positions_BT: Tensor, cache: KVCache | None = None, slots: Tensor | None = None,
                kv_len: int | None = None) -> Tensor:
        B, T, _ = x_BTD.shape
        H, K, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self._project_qkv(x_BTD)
        q = self.q_norm(q.reshape(B, T, H, d)).transpose(1, 2)                # [B, H, T, d]
        k = self.k_norm(k.reshape(B, T, K, d)).transpose(1, 2)                # [B, K, T, d]
        v = v.reshape(B, T, K, d).transpose(1, 2)
        cos, sin = self.rotary(positions_BT, q.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            kv_len = cached_length(positions_BT, slots, kv_len)
            kv = write_kv(cache, self.layer_idx, slots, positions_BT, kv_len, k=k, v=v)
            k, v = kv["k"], kv["v"]
            k_pos = torch.arange(kv_len, device=x_BTD.device).expand(B, kv_len)
        else:
            k_pos = positions_BT
        bias = self.dynamic_bias(v, positions_BT, k_pos)
        G = H // K
        k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype), scale=self.scale)   # [B, H, T, d]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, H * d))


class WeightedResidualLayer(nn.Module):
    """h = input_residual * h + attn(norm1(h)); h = post_attention_residual * h + mlp(norm2(h))."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, input_layernorm: nn.Module,
                 post_attention_layernorm: nn.Module, dim: int, dtype=None):
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm, self.post_attention_layernorm = input_layernorm, post_attention_layernorm
        self.input_residual = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.post_attention_residual = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, h_BTD: Tensor, positions_BT: Tensor, cache=None, slots=None, kv_len=None) -> Tensor:
        a = self.self_attn(self.input_layernorm(h_BTD), positions_BT, cache, slots, kv_len)
        h_BTD = self.input_residual * h_BTD + a
        return self.post_attention_residual * h_BTD + self.mlp(self.post_attention_layernorm(h_BTD))


class DogeForCausalLM(CausalLM):
    """Doge (see the module docstring)."""

    def __init__(self, config: ModelConfig, dtype=None):
        raw = config.raw
        if raw.get("is_moe"):
            raise ValueError("config field 'is_moe' must be false for doge: transformers' CDMoE routes each token by "
                             "router logits split over the whole forward (.view(2, tokens, keys)), so a token's "
                             "experts depend on the other tokens in it (a cached decode step differs from the full "
                             "forward); dynamoe loads the dense Doge models only")
        for name in ("mlp_bias", "is_moe"):
            if not isinstance(raw.get(name), bool):
                raise ValueError(f"config field {name!r} must be true or false, got {raw.get(name)!r}")
        super().__init__(config, dtype)

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> WeightedResidualLayer:
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        attn = DogeAttention(D, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, i, rotary,
                             bias=cfg.attention_bias, norm_eps=eps, sliding_window=cfg.sliding_window,
                             keep_window_size=cfg.raw.get("keep_window_size"), dtype=dtype)
        if cfg.intermediate_size is None:
            raise ValueError("config field 'intermediate_size' is required for doge (its MLPs' width)")
        mlp = GatedMLP(D, cfg.intermediate_size, glu_kind(cfg.hidden_act), bias=cfg.raw["mlp_bias"], dtype=dtype)
        return WeightedResidualLayer(attn, mlp, RMSNorm(D, eps, dtype=dtype), RMSNorm(D, eps, dtype=dtype), D, dtype)
