"""Hunyuan-A13B (``model_type: hunyuan_v1_moe``): GQA whose per-head q/k RMSNorms act *after*
half-split RoPE (``query_layernorm`` / ``key_layernorm``), optional q/k/v/o biases; every layer
sparse: softmax top-k routing (fp32 router, ``moe_topk`` experts) renormalised over the k, SwiGLU
experts of ``intermediate_size``, plus an ungated shared SwiGLU MLP of the same size added to every
MoE output.

Checkpoint: ``self_attn.query_layernorm`` / ``key_layernorm`` [d]; ``mlp.gate.wg.weight`` [E, D];
``mlp.experts.{e}.gate_proj|up_proj|down_proj.weight``; ``mlp.shared_mlp.gate_proj|up_proj|down_proj``.
"""
from __future__ import annotations

from .attention import Attention
from .base import CausalLM, DecoderLayer
from .config import ModelConfig
from .moe_block import SparseMoeBlock, glu_kind
from .norms import RMSNorm
from .rope import RotaryEmbedding
from .weights import PerExpert

__all__ = ["HunYuanMoEV1ForCausalLM"]


class HunYuanMoEV1ForCausalLM(CausalLM):
    checkpoint_renames = ((".self_attn.q_norm.", ".self_attn.query_layernorm."),
                          (".self_attn.k_norm.", ".self_attn.key_layernorm."),
                          (".mlp.moe.gates.0.wg.", ".mlp.gate.wg."), (".mlp.moe.shared_experts.", ".mlp.shared_mlp."),
                          (".mlp.moe.", ".mlp."))
    expert_layout = PerExpert("gate_proj", "up_proj", "down_proj")

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> DecoderLayer:
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        if cfg.intermediate_size is None:
            raise ValueError("config field 'intermediate_size' is required for hunyuan_v1_moe (experts and shared MLP)")
        attn = Attention(D, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, i, rotary,
                         qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, qk_norm=True, norm_eps=eps,
                         qk_norm_after_rope=True, dtype=dtype)
        mlp = SparseMoeBlock(cfg, "softmax", normalize=True, glu=glu_kind(cfg.hidden_act), num_shared_experts=1,
                             shared_hidden_size=cfg.intermediate_size, dtype=dtype)
        return DecoderLayer(attn, mlp, RMSNorm(D, eps, dtype=dtype), RMSNorm(D, eps, dtype=dtype))
