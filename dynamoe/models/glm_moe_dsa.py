"""GLM-5 (``model_type: glm_moe_dsa``): the DeepSeek-V3.2 architecture (:mod:`dynamoe.models.deepseek_v32`)
with two differences, as transformers' GlmMoeDsa has them: the indexer's RoPE is interleaved, and
layers whose ``indexer_types`` entry is 'shared' (from ``indexer_types``, ``index_topk_pattern`` or
``index_topk_freq`` / ``index_skip_topk_offset``) have no indexer and reuse the previous full layer's
top-k selection.

Checkpoint: as DeepSeek-V3.2's; 'shared' layers have no ``self_attn.indexer.*`` tensors.
"""
from __future__ import annotations

from .deepseek_v32 import DeepseekV32ForCausalLM

__all__ = ["GlmMoeDsaForCausalLM"]


class GlmMoeDsaForCausalLM(DeepseekV32ForCausalLM):
    mla_rope_interleaved = True
    indexer_rope_interleaved = True
