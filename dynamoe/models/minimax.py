"""MiniMax-Text-01 (``model_type: minimax``): lightning-attention layers (:class:`~dynamoe.models.lightning.LightningAttention`,
linear attention with a fixed decay per head) and GQA softmax-attention layers with RoPE (base 1e6; sliding over
``sliding_window`` keys when it is set) by ``layer_types`` (default: alternating, from softmax), each followed by
Mixtral's MoE (softmax top-k renormalised, SwiGLU experts of ``intermediate_size``). The residual stream is
re-normalised after every sublayer: h = norm1(h); h = alpha_a h + beta_a attn(h); h = norm2(h); h = alpha_m h +
beta_m moe(h) -- the alpha / beta factors per kind (``full_attn_*``, ``linear_attn_*``, ``mlp_*``).

Checkpoint: ``model.layers.{i}.self_attn.{q,k,v,o}_proj`` or ``self_attn.{qkv_proj, output_gate, norm, out_proj}``
(and transformers' derived ``slope_rate`` / ``query_decay`` / ``key_decay`` / ``diagonal_decay`` buffers, not read:
the slopes follow from the layer's place); ``block_sparse_moe.gate.weight``, ``block_sparse_moe.experts.{e}.{w1,w3,w2}``;
``input_layernorm``, ``post_attention_layernorm``, ``model.norm``.

The model keeps per-sequence recurrent state (the lightning layers' [H, d, d] states: ``recurrent_state = True``, no
prefix reuse).
"""
from __future__ import annotations

import re

from torch import Tensor, nn

from .attention import Attention
from .base import CausalLM
from .cache import KVCache
from .config import ModelConfig
from .lightning import LightningAttention
from .moe_block import SparseMoeBlock, glu_kind
from .norms import RMSNorm
from .rope import RotaryEmbedding
from .weights import PerExpert

__all__ = ["MiniMaxForCausalLM", "ScaledPostNormLayer"]

_DERIVED = re.compile(r"model\.layers\.\d+\.self_attn\.(slope_rate|query_decay|key_decay|diagonal_decay)$")


def _factor(cfg: ModelConfig, name: str) -> float:
    v = cfg.raw.get(name, 1)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"config field {name!r} must be a number, got {v!r}")
    return float(v)


class ScaledPostNormLayer(nn.Module):
    """h = input_layernorm(h); h = a_attn h + b_attn self_attn(h); h = post_attention_layernorm(h);
    h = a_mlp h + b_mlp mlp(h) (MiniMax's decoder layer)."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, input_layernorm: nn.Module,
                 post_attention_layernorm: nn.Module, attn_factors: tuple, mlp_factors: tuple):
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm, self.post_attention_layernorm = input_layernorm, post_attention_layernorm
        self.attn_factors, self.mlp_factors = attn_factors, mlp_factors

    def forward(self, h_BTD: Tensor, positions_BT: Tensor, cache: KVCache | None = None, slots: Tensor | None = None,
                kv_len: int | None = None) -> Tensor:
        (a, b), (am, bm) = self.attn_factors, self.mlp_factors
        h_BTD = self.input_layernorm(h_BTD)
        h_BTD = a * h_BTD + b * self.self_attn(h_BTD, positions_BT, cache, slots, kv_len)
        h_BTD = self.post_attention_layernorm(h_BTD)
        return am * h_BTD + bm * self.mlp(h_BTD)


class MiniMaxForCausalLM(CausalLM):
    """MiniMax-Text-01 (see the module docstring)."""

    #: the lightning layers' states summarise a slot's whole prefix: no prefix reuse
    recurrent_state = True
    #: ... but speculative decoding can cut it back past rejected drafts: its layers record their state after every
    #: token of a verification forward (dynamoe.models.cache.KVCache.begin_history)
    recurrent_rollback = True
    checkpoint_renames = ((".mlp.moe.gates.0.wg.", ".block_sparse_moe.gate."), (".mlp.moe.", ".block_sparse_moe."))
    expert_layout = PerExpert("w1", "w3", "w2")

    def ignores_checkpoint_tensor(self, name: str) -> bool:
        """transformers' derived decay buffers of the lightning layers (recomputed here from the layer's place)."""
        return _DERIVED.match(name) is not None

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> ScaledPostNormLayer:
        D, eps, kind = cfg.hidden_size, cfg.rms_norm_eps, cfg.layer_types[i]
        if kind == "linear_attention":
            ssm = cfg.ssm
            attn: nn.Module = LightningAttention(D, ssm.num_heads, ssm.head_dim, i, cfg.num_hidden_layers,
                                                 activation=ssm.activation, block_size=ssm.chunk_size,
                                                 checks_position=i == cfg.layer_types.index(kind), dtype=dtype)
            prefix = "linear_attn"
        elif kind == "full_attention":
            attn = Attention(D, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, i, rotary,
                             sliding_window=cfg.sliding_window, dtype=dtype)
            prefix = "full_attn"
        else:
            raise ValueError(f"config field 'layer_types' entry {i} must be 'linear_attention' (lightning) or "
                             f"'full_attention' for minimax, got {kind!r}")
        mlp = SparseMoeBlock(cfg, "softmax", normalize=True, glu=glu_kind(cfg.hidden_act), dtype=dtype)
        return ScaledPostNormLayer(attn, mlp, RMSNorm(D, eps, dtype=dtype), RMSNorm(D, eps, dtype=dtype),
                                   (_factor(cfg, f"{prefix}_alpha_factor"), _factor(cfg, f"{prefix}_beta_factor")),
                                   (_factor(cfg, "mlp_alpha_factor"), _factor(cfg, "mlp_beta_factor")))
