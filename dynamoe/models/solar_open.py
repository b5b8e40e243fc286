"""Upstage Solar-Open (``model_type: solar_open``): GLM-4.5's MoE decoder without its variations -- Llama's GQA
(q/k/v biases when ``attention_bias``, none on o_proj, no q/k norms), RoPE over the whole head (base 1e6 by
default), and DeepSeek-style MoE on every layer (sigmoid scores, selection-only ``e_score_correction_bias``,
group-limited top-k over ``n_group`` / ``topk_group``, renormalised when ``norm_topk_prob``, times
``routed_scaling_factor``, plus ``n_shared_experts`` shared experts). transformers' SolarOpenConfig has no dense
layers, q/k norms or multi-token-prediction layers: a hub config's ``first_k_dense_replace``, ``use_qk_norm`` and
the like are not read (config.py: "ignored").

Checkpoint: GLM-4.5's names (``mlp.gate.weight`` [E, D] fp32, ``mlp.gate.e_score_correction_bias``,
``mlp.experts.{e}.{gate,up,down}_proj``, ``mlp.shared_experts.*``, ``self_attn.{q,k,v,o}_proj``).
"""
from __future__ import annotations

from .config import ModelConfig
from .glm4_moe import Glm4MoeForCausalLM

__all__ = ["SolarOpenForCausalLM"]


class SolarOpenForCausalLM(Glm4MoeForCausalLM):
    """Solar-Open (see the module docstring): GLM-4.5's layers as its config parses (no q/k norms, every layer MoE)."""

    def __init__(self, config: ModelConfig, dtype=None):
        partial = config.rope.partial_rotary_factor
        if partial != 1.0:  # (Llama's attention rotates q and k whole: transformers' Solar-Open fails on a partial one)
            raise ValueError(f"config field 'partial_rotary_factor' must be 1 for solar_open (its attention rotates the "
                             f"whole head), got {partial!r}")
        super().__init__(config, dtype)
