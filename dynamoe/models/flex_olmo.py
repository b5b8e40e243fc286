"""FlexOlmo (``model_type: flex_olmo``): OLMo-2's post-norm decoder layers -- h += norm1(attn(h));
h += norm2(moe(h)), no norm before the sublayers -- with OLMoE's attention (q and k RMS-normalised
over the whole projection, before half-split RoPE) and softmax top-k routing (fp32), renormalised
when ``norm_topk_prob``, SwiGLU experts of ``intermediate_size`` in every layer.

Checkpoint: ``post_attention_layernorm``, ``post_feedforward_layernorm``; ``self_attn.q_norm.weight``
[H*d], ``self_attn.k_norm.weight`` [K*d]; ``mlp.gate.weight`` [E, D]; ``mlp.experts.{e}.*``.
"""
from __future__ import annotations

from torch import Tensor, nn

from .attention import Attention
from .base import CausalLM
from .config import ModelConfig
from .moe_block import SparseMoeBlock, glu_kind
from .norms import RMSNorm
from .rope import RotaryEmbedding
from .weights import PerExpert

__all__ = ["FlexOlmoForCausalLM", "PostNormDecoderLayer"]


class PostNormDecoderLayer(nn.Module):
    """h += post_attention_layernorm(attn(h)); h += post_feedforward_layernorm(mlp(h)) (OLMo-2)."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, post_attention_layernorm: nn.Module,
                 post_feedforward_layernorm: nn.Module):
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        self.post_attention_layernorm, self.post_feedforward_layernorm = post_attention_layernorm, post_feedforward_layernorm

    def forward(self, h_BTD: Tensor, positions_BT: Tensor, cache=None, slots=None, kv_len=None) -> Tensor:
        h_BTD = h_BTD + self.post_attention_layernorm(self.self_attn(h_BTD, positions_BT, cache, slots, kv_len))
        return h_BTD + self.post_feedforward_layernorm(self.mlp(h_BTD))


class FlexOlmoForCausalLM(CausalLM):
    checkpoint_renames = ((".mlp.moe.gates.0.wg.", ".mlp.gate."), (".mlp.moe.", ".mlp."))
    expert_layout = PerExpert("gate_proj", "up_proj", "down_proj")

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> PostNormDecoderLayer:
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        attn = Attention(D, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, i, rotary,
                         qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, qk_norm="all", norm_eps=eps, dtype=dtype)
        mlp = SparseMoeBlock(cfg, "softmax", normalize=cfg.norm_topk_prob, glu=glu_kind(cfg.hidden_act), dtype=dtype)
        return PostNormDecoderLayer(attn, mlp, RMSNorm(D, eps, dtype=dtype), RMSNorm(D, eps, dtype=dtype))
