"""Arcee AFMoE (``model_type: afmoe``: Trinity): GQA decoder layers of two kinds (``layer_types``; default
every ``global_attn_every_n_layers``-th layer full attention, the others sliding-window over ``sliding_window``
keys) -- RoPE on the sliding layers only, the full ones without position encoding (NoPE) --, per-head q/k RMSNorms
before RoPE, the attention output times sigmoid(``gate_proj``(x)) (one gate per output feature, [H*d, D]) before
``o_proj``; sandwich norms around both sublayers (h += post_norm(f(pre_norm(h)))); dense SwiGLU MLPs on the first
``num_dense_layers`` layers, MoE after: sigmoid scores with a selection-only ``expert_bias``, top-k renormalised,
times ``route_scale``, plus a shared SwiGLU of ``num_shared_experts`` x ``moe_intermediate_size``; with
``mup_enabled`` the embeddings are scaled by sqrt(hidden_size).

Checkpoint (transformers' names, which the hub's are): ``self_attn.{q,k,v,o,gate}_proj``, ``self_attn.{q,k}_norm``,
``{input,post_attention,pre_mlp,post_mlp}_layernorm``, ``mlp.router.gate.weight`` [E, D], ``mlp.expert_bias`` [E],
``mlp.experts.{e}.{gate,up,down}_proj``, ``mlp.shared_experts.*``, dense ``mlp.*_proj``.

No fused decode kernels: the layers have their own forward (sandwich norms: a norm between the attention and the
residual add, which the attention kernel does not have). The attention alone would fit the kernel (its gate and NoPE
layers are kernel options: ``decode_fused`` gives its weights), but no layer path calls it.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .attention import Attention
from .base import CausalLM
from .cache import KVCache
from .config import ModelConfig
from .granitemoe import _ScaledEmbedding
from .moe_block import GatedMLP, SparseMoeBlock, glu_kind
from .norms import RMSNorm
from .rope import RotaryEmbedding
from .weights import PerExpert

__all__ = ["AfmoeForCausalLM", "AfmoeAttention", "SandwichDecoderLayer"]


class AfmoeAttention(Attention):
    """GQA with per-head q/k RMSNorms before RoPE (none on NoPE layers: ``rotary`` None) and an elementwise sigmoid
    gate on the output (``gate_proj`` [H*d, D]); window and scale as :class:`Attention`'s."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, layer_idx: int,
                 rotary: RotaryEmbedding | None, bias: bool = False, norm_eps: float = 1e-5,
                 sliding_window: int | None = None, dtype=None):
        super().__init__(hidden_size, num_heads, num_kv_heads, head_dim, layer_idx, rotary, qkv_bias=bias, o_bias=bias,
                         qk_norm=True, norm_eps=norm_eps, sliding_window=sliding_window, use_rope=rotary is not None,
                         dtype=dtype)
        self.gate_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False, dtype=dtype)

    def _decode_gate(self, kernels, holds, dtype):
        return self._gate_weights(kernels, holds, dtype, "gate_proj", "sigmoid")

    def forward(self, x_BTD: Tensor, positions_BT: Tensor, cache: KVCache | None = None, slots: Tensor | None = None,
                kv_len: int | None = None) -> Tensor:
        B, T, _ = x_BTD.shape
        H, d = self.num_heads, self.head_dim
        q, k, v = self.heads(x_BTD, positions_BT)                             # [B, H|K, T, d]
        out = self.attend_cached(q, k, v, positions_BT, cache, slots, kv_len, self.sliding_window, self.sinks)
        out = out.transpose(1, 2).reshape(B, T, H * d) * torch.sigmoid(self.gate_proj(x_BTD))
        return self.o_proj(out)


class SandwichDecoderLayer(nn.Module):
    """h += post_attention_layernorm(attn(input_layernorm(h))); h += post_mlp_layernorm(mlp(pre_mlp_layernorm(h)))."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, input_layernorm: nn.Module,
                 post_attention_layernorm: nn.Module, pre_mlp_layernorm: nn.Module, post_mlp_layernorm: nn.Module):
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm, self.post_attention_layernorm = input_layernorm, post_attention_layernorm
        self.pre_mlp_layernorm, self.post_mlp_layernorm = pre_mlp_layernorm, post_mlp_layernorm

    def forward(self, h_BTD: Tensor, positions_BT: Tensor, cache=None, slots=None, kv_len=None) -> Tensor:
        a = self.self_attn(self.input_layernorm(h_BTD), positions_BT, cache, slots, kv_len)
        h_BTD = h_BTD + self.post_attention_layernorm(a)
        return h_BTD + self.post_mlp_layernorm(self.mlp(self.pre_mlp_layernorm(h_BTD)))


class AfmoeForCausalLM(CausalLM):
    """Arcee AFMoE (see the module docstring)."""

    checkpoint_renames = ((".mlp.moe.gates.0.wg.", ".mlp.router.gate."),
                          (".mlp.moe.gates.0.e_score_correction_bias", ".mlp.expert_bias"),
                          (".mlp.moe.", ".mlp."))
    expert_layout = PerExpert("gate_proj", "up_proj", "down_proj")

    def __init__(self, config: ModelConfig, dtype=None):
        mup = config.raw.get("mup_enabled")
        if mup is not None and not isinstance(mup, bool):
            raise ValueError(f"config field 'mup_enabled' must be true or false, got {mup!r}")
        super().__init__(config, dtype)
        if mup:  # (the same parameter and name: loading and tying are unchanged)
            self.model.embed_tokens.__class__ = _ScaledEmbedding
            self.model.embed_tokens.multiplier = math.sqrt(config.hidden_size)

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> SandwichDecoderLayer:
        D, eps, kind = cfg.hidden_size, cfg.rms_norm_eps, cfg.layer_types[i]
        if kind not in ("full_attention", "sliding_attention"):
            raise ValueError(f"config field 'layer_types' entry {i} must be 'full_attention' or 'sliding_attention' "
                             f"for afmoe, got {kind!r}")
        sliding = kind == "sliding_attention"
        attn = AfmoeAttention(D, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, i,
                              rotary if sliding else None, bias=cfg.attention_bias, norm_eps=eps,
                              sliding_window=cfg.layer_sliding_window(i), dtype=dtype)
        glu = glu_kind(cfg.hidden_act)
        if cfg.is_moe_layer(i):
            mlp = SparseMoeBlock(cfg, "sigmoid", normalize=True, glu=glu, num_shared_experts=cfg.n_shared_experts,
                                 router_groups=False, route_scale=cfg.routed_scaling_factor, dtype=dtype)
        else:
            if cfg.intermediate_size is None:
                raise ValueError(f"config field 'intermediate_size' is required: layer {i} has a dense MLP")
            mlp = GatedMLP(D, cfg.intermediate_size, glu, dtype=dtype)
        return SandwichDecoderLayer(attn, mlp, *(RMSNorm(D, eps, dtype=dtype) for _ in range(4)))
