"""DeepSeek-V3.2 (``model_type: deepseek_v32``): DeepSeek-V3 (:mod:`dynamoe.models.deepseek_v3`) with
DeepSeek Sparse Attention: every layer's MLA attends, per query, only to the ``index_topk`` keys its
indexer (:mod:`dynamoe.models.indexer`: ``index_n_heads`` heads of ``index_head_dim``, RoPE half-split
on the first ``qk_rope_head_dim`` dims) ranks best among the causal ones. MLA's RoPE is interleaved
(always, as in transformers' DeepseekV32Attention); ``mlp_layer_types`` (else ``first_k_dense_replace``)
says which layers are dense.

Checkpoint: DeepSeek-V3's names plus ``self_attn.indexer.{wq_b, wk, k_norm (weight, bias), weights_proj}``.
The cache keeps, per layer and position, MLA's latent and roped key and the indexer's key ("index_k"). The
multi-token-prediction layer (``model.layers.{num_hidden_layers}``, an MoE layer with its own indexer) loads as
the ``mtp`` head when present (:mod:`dynamoe.models.mtp`).
"""
from __future__ import annotations

from .deepseek_v3 import DeepseekV3ForCausalLM

__all__ = ["DeepseekV32ForCausalLM"]


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    mla_rope_interleaved = True
    indexer_rope_interleaved = False
