"""Flint (``model_type: flint``): Qwen3-MoE's attention (per-head q/k RMSNorm) with a learned per-head
sink logit on every layer (GPT-OSS's sinks; the checkpoint's ``self_attn.softmax_offset``), two layer
kinds (``layer_types``: full attention without any position encoding on layers 0, 1, every 4th from 1
and the last; sliding-window attention with RoPE elsewhere), RMSNorm weights applied in fp32; dense
SwiGLU MLPs on ``mlp_only_layers`` ([0, 1]), elsewhere a sigmoid router without selection bias, groups
or scale (top-k of the fp32 sigmoid scores, renormalised when ``norm_topk_prob``) plus an ungated shared
expert of ``shared_expert_intermediate_size`` added in full.

Checkpoint: ``self_attn.{q_proj, k_proj, v_proj, o_proj, q_norm, k_norm, softmax_offset}``, ``mlp.gate.weight``
(fp32), ``mlp.experts.{e}.{gate,up,down}_proj``, ``mlp.shared_expert.*``, dense ``mlp.*_proj``.
"""
from __future__ import annotations

from .attention import Attention
from .base import CausalLM, DecoderLayer
from .config import ModelConfig
from .moe_block import GatedMLP, SparseMoeBlock, glu_kind
from .norms import RMSNorm
from .rope import RotaryEmbedding
from .weights import PerExpert

__all__ = ["FlintForCausalLM"]


class FlintForCausalLM(CausalLM):
    """Flint (see the module docstring)."""

    checkpoint_renames = ((".self_attn.sinks", ".self_attn.softmax_offset"), (".mlp.moe.gates.0.wg.", ".mlp.gate."),
                          (".mlp.moe.shared_experts.", ".mlp.shared_expert."), (".mlp.moe.", ".mlp."))
    expert_layout = PerExpert("gate_proj", "up_proj", "down_proj")

    def build_norm(self, cfg: ModelConfig, dim: int, dtype) -> RMSNorm:
        return RMSNorm(dim, cfg.rms_norm_eps, weight_in_fp32=True, dtype=dtype)

    def build_mlp(self, cfg: ModelConfig, i: int, dtype):
        glu = glu_kind(cfg.hidden_act)
        if not cfg.is_moe_layer(i):
            if cfg.intermediate_size is None:
                raise ValueError(f"config field 'intermediate_size' is required: layer {i} has a dense MLP")
            return GatedMLP(cfg.hidden_size, cfg.intermediate_size, glu, dtype=dtype)
        if cfg.shared_expert_intermediate_size is None:
            raise ValueError("config field 'shared_expert_intermediate_size' is required for flint (an int >= 1)")
        block = SparseMoeBlock(cfg, "sigmoid", normalize=cfg.norm_topk_prob, glu=glu, router_groups=False, route_scale=1.0,
                               num_shared_experts=1, shared_hidden_size=cfg.shared_expert_intermediate_size, dtype=dtype)
        block.moe.gates[0].e_score_correction_bias = None  # (the sigmoid gate's selection bias: Flint has none)
        return block

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> DecoderLayer:
        D = cfg.hidden_size
        window = cfg.layer_sliding_window(i)
        attn = Attention(D, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, i, rotary,
                         qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, qk_norm=True, norm_eps=cfg.rms_norm_eps,
                         sinks=True, sliding_window=window, use_rope=window is not None, dtype=dtype)
        return DecoderLayer(attn, self.build_mlp(cfg, i, dtype), self.build_norm(cfg, D, dtype), self.build_norm(cfg, D, dtype))
