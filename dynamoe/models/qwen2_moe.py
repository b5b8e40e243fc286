"""Qwen1.5-MoE / Qwen2-MoE (``model_type: qwen2_moe``): GQA with q/k/v biases (``qkv_bias``, o_proj
without), half-split RoPE, no q/k norm; softmax top-k routing (fp32), renormalised when
``norm_topk_prob``, SwiGLU experts, plus one shared expert of ``shared_expert_intermediate_size``
whose output is scaled per token by sigmoid(``shared_expert_gate``(x)); layers in ``mlp_only_layers``
or off the ``decoder_sparse_step`` grid have a dense MLP; with ``use_sliding_window`` the
``layer_types`` say which layers slide.

Checkpoint: ``mlp.gate.weight`` [E, D]; ``mlp.experts.{e}.gate_proj|up_proj|down_proj.weight``;
``mlp.shared_expert.gate_proj|up_proj|down_proj.weight``; ``mlp.shared_expert_gate.weight`` [1, D].
"""
from __future__ import annotations

from .attention import Attention
from .base import CausalLM, DecoderLayer
from .config import ModelConfig
from .moe_block import GatedMLP, SparseMoeBlock, glu_kind
from .norms import RMSNorm
from .rope import RotaryEmbedding
from .weights import PerExpert

__all__ = ["Qwen2MoeForCausalLM"]


class Qwen2MoeForCausalLM(CausalLM):
    checkpoint_renames = ((".mlp.moe.gates.0.wg.", ".mlp.gate."), (".mlp.moe.shared_experts.gate.", ".mlp.shared_expert_gate."),
                          (".mlp.moe.shared_experts.", ".mlp.shared_expert."), (".mlp.moe.", ".mlp."))
    expert_layout = PerExpert("gate_proj", "up_proj", "down_proj")

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> DecoderLayer:
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        attn = Attention(D, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, i, rotary,
                         qkv_bias=cfg.qkv_bias, o_bias=False, sliding_window=cfg.layer_sliding_window(i), dtype=dtype)
        glu = glu_kind(cfg.hidden_act)
        if cfg.is_moe_layer(i):
            if cfg.shared_expert_intermediate_size is None:
                raise ValueError("config field 'shared_expert_intermediate_size' is required for qwen2_moe")
            mlp = SparseMoeBlock(cfg, "softmax", normalize=cfg.norm_topk_prob, glu=glu, num_shared_experts=1,
                                 shared_hidden_size=cfg.shared_expert_intermediate_size, shared_gate=True, dtype=dtype)
        else:
            if cfg.intermediate_size is None:
                raise ValueError(f"config field 'intermediate_size' is required: layer {i} has a dense MLP")
            mlp = GatedMLP(D, cfg.intermediate_size, glu, dtype=dtype)
        return DecoderLayer(attn, mlp, RMSNorm(D, eps, dtype=dtype), RMSNorm(D, eps, dtype=dtype))
