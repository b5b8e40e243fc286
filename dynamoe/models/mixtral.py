"""Mixtral (``model_type: mixtral``): GQA with half-split RoPE (optional sliding window on every
layer), softmax top-k routing renormalised over the k, SwiGLU experts in every layer.

Checkpoint: ``block_sparse_moe.gate.weight`` [E, D]; ``block_sparse_moe.experts.{e}.w1`` (gate),
``w3`` (up), ``w2`` (down).
"""
from __future__ import annotations

from .attention import Attention
from .base import CausalLM, DecoderLayer
from .config import ModelConfig
from .moe_block import SparseMoeBlock, glu_kind
from .norms import RMSNorm
from .rope import RotaryEmbedding
from .weights import PerExpert

__all__ = ["MixtralForCausalLM"]


class MixtralForCausalLM(CausalLM):
    checkpoint_renames = ((".mlp.moe.gates.0.wg.", ".block_sparse_moe.gate."), (".mlp.moe.", ".block_sparse_moe."))
    expert_layout = PerExpert("w1", "w3", "w2")

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> DecoderLayer:
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        attn = Attention(D, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, i, rotary,
                         qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias,
                         sliding_window=cfg.layer_sliding_window(i), dtype=dtype)
        mlp = SparseMoeBlock(cfg, "softmax", normalize=True, glu=glu_kind(cfg.hidden_act), dtype=dtype)
        return DecoderLayer(attn, mlp, RMSNorm(D, eps, dtype=dtype), RMSNorm(D, eps, dtype=dtype))
