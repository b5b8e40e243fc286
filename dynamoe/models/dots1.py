"""dots.llm1 (``model_type: dots1``): Qwen3's attention (GQA, per-head q/k RMSNorm before half-split
RoPE, optional q/k/v/o biases, ``layer_types`` with sliding layers from ``max_window_layers`` on)
with DeepSeek-V3's feed-forward blocks: dense SwiGLU MLPs in the first ``first_k_dense_replace``
layers, then sigmoid routing with a selection-only ``e_score_correction_bias``, group-limited top-k,
optional renormalisation, ``routed_scaling_factor``, and ``n_shared_experts`` shared experts.

Checkpoint: attention as Qwen3-MoE's (``q_proj``/``k_proj``/``v_proj``/``o_proj``, ``q_norm``/``k_norm``),
feed-forward as DeepSeek-V3's (``mlp.gate.weight``, ``mlp.gate.e_score_correction_bias``,
``mlp.experts.{e}.*``, ``mlp.shared_experts.*``, dense ``mlp.*_proj``).
"""
from __future__ import annotations

from .attention import Attention
from .base import CausalLM, DecoderLayer
from .config import ModelConfig
from .deepseek_v3 import DEEPSEEK_RENAMES, deepseek_mlp
from .norms import RMSNorm
from .rope import RotaryEmbedding
from .weights import PerExpert

__all__ = ["Dots1ForCausalLM"]


class Dots1ForCausalLM(CausalLM):
    checkpoint_renames = DEEPSEEK_RENAMES
    expert_layout = PerExpert("gate_proj", "up_proj", "down_proj")

    def __init__(self, config: ModelConfig, dtype=None):
        # Dots1Config leaves these null (no default): a checkpoint's config.json must say them
        if config.num_experts and config.n_shared_experts is None:
            raise ValueError("config field 'n_shared_experts' is required for dots1 (an int >= 0) but missing")
        super().__init__(config, dtype)

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> DecoderLayer:
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        attn = Attention(D, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, i, rotary,
                         qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, qk_norm=True, norm_eps=eps,
                         sliding_window=cfg.layer_sliding_window(i), dtype=dtype)
        return DecoderLayer(attn, deepseek_mlp(cfg, i, dtype), RMSNorm(D, eps, dtype=dtype), RMSNorm(D, eps, dtype=dtype))
