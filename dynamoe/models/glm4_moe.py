"""GLM-4.5 / GLM-4.6 (``model_type: glm4_moe``): GQA with q/k/v biases (``attention_bias``; o_proj has
none), optional per-head q/k RMSNorm before RoPE (``use_qk_norm``), RoPE on the first
``partial_rotary_factor`` of each head (0.5 unless the config says otherwise), half-split; dense SwiGLU
MLPs in the first ``first_k_dense_replace`` layers, then DeepSeek-style MoE layers (sigmoid scores,
selection bias, group-limited top-k with ``n_group`` usually 1, ``routed_scaling_factor``, shared
experts).

Checkpoint: as DeepSeek-V3's MoE names (``mlp.gate.weight``, ``mlp.gate.e_score_correction_bias``,
``mlp.experts.{e}.*``, ``mlp.shared_experts.*``); attention ``q_proj``/``k_proj``/``v_proj`` (+ bias),
``o_proj``, ``q_norm``/``k_norm``. The multi-token-prediction layer (``model.layers.{num_hidden_layers}``)
loads as the model's ``mtp`` head when the checkpoint has it (:mod:`dynamoe.models.mtp`; the engine drafts
with it).
"""
from __future__ import annotations

from .attention import Attention
from .base import CausalLM, DecoderLayer
from .config import ModelConfig
from .deepseek_v3 import DEEPSEEK_RENAMES, deepseek_mlp
from .mtp import MTPHeads
from .norms import RMSNorm
from .rope import RotaryEmbedding
from .weights import PerExpert

__all__ = ["Glm4MoeForCausalLM"]


class Glm4MoeForCausalLM(MTPHeads, CausalLM):
    checkpoint_renames = DEEPSEEK_RENAMES
    expert_layout = PerExpert("gate_proj", "up_proj", "down_proj")

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> DecoderLayer:
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        attn = Attention(D, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, i, rotary,
                         qkv_bias=cfg.attention_bias, o_bias=False, qk_norm=cfg.use_qk_norm, norm_eps=eps, dtype=dtype)
        return DecoderLayer(attn, deepseek_mlp(cfg, i, dtype), RMSNorm(D, eps, dtype=dtype), RMSNorm(D, eps, dtype=dtype))
