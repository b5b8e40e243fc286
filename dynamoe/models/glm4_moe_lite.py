"""GLM-4.7-Flash (``model_type: glm4_moe_lite``): DeepSeek-V3's architecture under GLM's defaults --
Multi-head Latent Attention (:mod:`dynamoe.models.mla`, RoPE on interleaved pairs unless
``rope_interleave`` is false), DeepSeek routing (sigmoid scores, selection-only
``e_score_correction_bias``, group-limited top-k, renormalised, ``routed_scaling_factor``) with shared
experts; ``mlp_layer_types`` says which layers are dense (default: only layer 0).

Checkpoint: DeepSeek-V3's names (see :mod:`dynamoe.models.deepseek_v3`); the multi-token-prediction
layer (``model.layers.{num_hidden_layers}``) loads as the ``mtp`` head when present (:mod:`dynamoe.models.mtp`).
"""
from __future__ import annotations

from .deepseek_v3 import DeepseekV3ForCausalLM

__all__ = ["Glm4MoeLiteForCausalLM"]


class Glm4MoeLiteForCausalLM(DeepseekV3ForCausalLM):
    pass
