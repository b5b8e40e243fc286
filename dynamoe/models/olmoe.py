"""OLMoE (``model_type: olmoe``): GQA whose q and k are RMS-normalised over the whole projection (one
norm over all H*d query dims and one over the K*d key dims, before the heads are split and RoPE'd,
half-split), q/k/v optionally clamped to [-clip_qkv, clip_qkv]; every layer sparse: softmax top-k
routing (fp32), renormalised when ``norm_topk_prob``, SwiGLU experts of ``intermediate_size``.

Checkpoint: ``self_attn.q_norm.weight`` [H*d], ``self_attn.k_norm.weight`` [K*d]; ``mlp.gate.weight``
[E, D]; ``mlp.experts.{e}.gate_proj|up_proj|down_proj.weight``.
"""
from __future__ import annotations

from .attention import Attention
from .base import CausalLM, DecoderLayer
from .config import ModelConfig
from .moe_block import SparseMoeBlock, glu_kind
from .norms import RMSNorm
from .rope import RotaryEmbedding
from .weights import PerExpert

__all__ = ["OlmoeForCausalLM"]


class OlmoeForCausalLM(CausalLM):
    checkpoint_renames = ((".mlp.moe.gates.0.wg.", ".mlp.gate."), (".mlp.moe.", ".mlp."))
    expert_layout = PerExpert("gate_proj", "up_proj", "down_proj")

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> DecoderLayer:
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        attn = Attention(D, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, i, rotary,
                         qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, qk_norm="all", norm_eps=eps,
                         clip_qkv=cfg.clip_qkv, dtype=dtype)
        mlp = SparseMoeBlock(cfg, "softmax", normalize=cfg.norm_topk_prob, glu=glu_kind(cfg.hidden_act), dtype=dtype)
        return DecoderLayer(attn, mlp, RMSNorm(D, eps, dtype=dtype), RMSNorm(D, eps, dtype=dtype))
