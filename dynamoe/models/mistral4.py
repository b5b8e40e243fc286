"""Mistral-Small-4 (``model_type: mistral4``): DeepSeek-V3's Multi-head Latent Attention
(:mod:`dynamoe.models.mla`; RoPE on interleaved pairs unless ``rope_interleave`` is false, YaRN x128 by
default with its softmax-scale correction) whose queries are also scaled by Llama-4's position factor
1 + beta ln(1 + floor(position / original_max_position_embeddings)) (``rope_parameters.llama_4_scaling_beta``,
0.1: 1 for the first 8192 positions), and Mistral's routing: softmax over the experts (no selection
bias; group-limited when ``topk_group`` < ``n_group``: the groups ranked by the sum of their two best
probabilities, GateConfig.group_rank 'top2_sum'), top-k, renormalised (``norm_topk_prob``), times
``routed_scaling_factor``, plus shared experts;
dense SwiGLU MLPs in the first ``first_k_dense_replace`` layers (default none).

Checkpoint: DeepSeek-V3's names (``self_attn.{q_a_proj, q_a_layernorm, q_b_proj | q_proj, kv_a_proj_with_mqa,
kv_a_layernorm, kv_b_proj, o_proj}``, ``mlp.gate.weight`` [E, D], ``mlp.shared_experts.*``, dense
``mlp.*_proj``) without ``e_score_correction_bias``; the routed experts fused as transformers keeps them (it
has no conversion for mistral4): ``mlp.experts.gate_up_proj`` [E, 2F, D] (gate rows, then up rows) and
``mlp.experts.down_proj`` [E, D, F].

The fused decode kernel's router has no 'top2_sum' ranking: with limited groups the MoE layers decode
through the general path (MoELayer reports why); the published checkpoints use one group.
"""
from __future__ import annotations

from .base import DecoderLayer
from .config import ModelConfig
from .deepseek_v3 import DeepseekV3ForCausalLM
from .mla import MLAttention
from .moe_block import GatedMLP, SparseMoeBlock, glu_kind
from .norms import RMSNorm
from .rope import RotaryEmbedding
from .weights import Stacked

__all__ = ["Mistral4ForCausalLM"]


def _check(cfg: ModelConfig) -> None:
    if cfg.rope.llama_4_scaling_beta is None or cfg.rope.original_max_position_embeddings is None:
        raise ValueError("config fields 'rope_parameters.llama_4_scaling_beta' and "
                         "'rope_parameters.original_max_position_embeddings' are required for mistral4 (its attention "
                         f"scales the queries by them), got {cfg.rope.llama_4_scaling_beta!r} and "
                         f"{cfg.rope.original_max_position_embeddings!r}")


class Mistral4ForCausalLM(DeepseekV3ForCausalLM):
    """Mistral-Small-4 (see the module docstring)."""

    expert_layout = Stacked("gate_up_proj", "down_proj", suffix="")

    def __init__(self, config: ModelConfig, dtype=None):
        _check(config)
        super().__init__(config, dtype)

    def build_attention(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> MLAttention:
        attn = super().build_attention(cfg, i, rotary, dtype)
        attn.llama4_scaling = (cfg.rope.llama_4_scaling_beta, cfg.rope.original_max_position_embeddings)
        return attn

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> DecoderLayer:
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        glu = glu_kind(cfg.hidden_act)
        if cfg.is_moe_layer(i):
            mlp = SparseMoeBlock(cfg, "softmax", normalize=cfg.norm_topk_prob, glu=glu,
                                 num_shared_experts=cfg.n_shared_experts, router_groups=True, group_rank="top2_sum",
                                 route_scale=cfg.routed_scaling_factor, dtype=dtype)
        else:
            if cfg.intermediate_size is None:
                raise ValueError(f"config field 'intermediate_size' is required: layer {i} has a dense MLP")
            mlp = GatedMLP(D, cfg.intermediate_size, glu, dtype=dtype)
        return DecoderLayer(self.build_attention(cfg, i, rotary, dtype), mlp, RMSNorm(D, eps, dtype=dtype),
                            RMSNorm(D, eps, dtype=dtype))
