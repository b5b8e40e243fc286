"""ERNIE-4.5-MoE (``model_type: ernie4_5_moe``): GQA with RoPE on interleaved pairs (GLM style), no
q/k norm; dense SwiGLU MLPs outside the MoE layers (``moe_layer_start_index`` ..
``moe_layer_end_index``, every ``moe_layer_interval``-th); softmax routing (fp32) whose experts are
*chosen* on the probabilities plus a selection-only ``e_score_correction_bias`` and weighted by the
unbiased probabilities renormalised over the ``moe_k``, plus ``moe_num_shared_experts`` shared experts.

Checkpoint: ``mlp.gate.weight`` [E, D], ``mlp.moe_statics.e_score_correction_bias`` [1, E] (fp32; the
model keeps that shape), ``mlp.experts.{e}.*``, ``mlp.shared_experts.*``, dense ``mlp.*_proj``.
"""
from __future__ import annotations

import torch

from .attention import Attention
from .base import CausalLM, DecoderLayer
from .config import ModelConfig
from .moe_block import GatedMLP, SparseMoeBlock, glu_kind
from .norms import RMSNorm
from .rope import RotaryEmbedding
from .weights import PerExpert

__all__ = ["Ernie4_5_MoeForCausalLM"]


class Ernie4_5_MoeForCausalLM(CausalLM):
    checkpoint_renames = ((".mlp.moe.gates.0.e_score_correction_bias", ".mlp.moe_statics.e_score_correction_bias"),
                          (".mlp.moe.gates.0.wg.", ".mlp.gate."), (".mlp.moe.", ".mlp."))
    expert_layout = PerExpert("gate_proj", "up_proj", "down_proj")

    def __init__(self, config: ModelConfig, dtype=None):
        if config.raw.get("use_bias"):
            raise ValueError("config field 'use_bias' must be false for ernie4_5_moe (biased attention and MLPs are "
                             "not supported; the published checkpoints have none)")
        super().__init__(config, dtype)

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> DecoderLayer:
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        attn = Attention(D, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, i, rotary,
                         rope_interleaved=True, dtype=dtype)
        glu = glu_kind(cfg.hidden_act)
        if cfg.is_moe_layer(i):
            mlp = SparseMoeBlock(cfg, "softmax", normalize=True, glu=glu, num_shared_experts=cfg.n_shared_experts or 0,
                                 selection_bias=True, dtype=dtype)
            gate = mlp.moe.gates[0]
            gate.e_score_correction_bias = torch.zeros(1, cfg.num_experts, dtype=torch.float32)  # the checkpoint's shape
        else:
            if cfg.intermediate_size is None:
                raise ValueError(f"config field 'intermediate_size' is required: layer {i} has a dense MLP")
            mlp = GatedMLP(D, cfg.intermediate_size, glu, dtype=dtype)
        return DecoderLayer(attn, mlp, RMSNorm(D, eps, dtype=dtype), RMSNorm(D, eps, dtype=dtype))
