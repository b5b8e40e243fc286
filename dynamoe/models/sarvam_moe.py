"""Sarvam-30B (``model_type: sarvam_moe``): transformers runs it as GLM-4.5 (``Glm4MoeForCausalLM``) with Sarvam's
config -- GQA with per-head q/k RMSNorms before RoPE (``use_qk_norm``, on by default) over the whole head (base 8e6),
q/k/v biases when ``attention_bias`` (``use_qkv_bias``), dense SwiGLU MLPs on the first ``first_k_dense_replace``
layers, then DeepSeek-style MoE (sigmoid scores, selection-only bias, group-limited top-k, renormalised when
``norm_topk_prob``, times ``routed_scaling_factor`` 2.5, plus ``n_shared_experts`` shared experts).

Checkpoint (the hub's names, which transformers also saves): ``model.word_embeddings``, ``attention.query_key_value``
(q, k and v rows in one tensor [(H + 2K) d, D], read as three: ``checkpoint_rows``), ``attention.dense`` (o_proj),
``attention.{query,key}_layernorm`` (q/k norms), ``mlp.gate.weight``, ``mlp.gate.expert_bias`` (the selection bias),
``mlp.experts.{e}.*``, ``mlp.shared_experts.*``. The released checkpoints have no multi-token-prediction layers
(``num_mtp_layers`` 0); any (``model.layers.{N}``) build no draft head and are left unread (logged): no public source
gives Sarvam's MTP architecture (transformers drops the layers, vLLM runs Sarvam as Bailing-MoE without an MTP
model for it, SGLang has none), so GLM-4.5's head, which this class would inherit, is not assumed.
"""
from __future__ import annotations

from .config import ModelConfig
from .glm4_moe import Glm4MoeForCausalLM

__all__ = ["SarvamMoeForCausalLM"]

_QKV = ("q_proj", "k_proj", "v_proj")


class SarvamMoeForCausalLM(Glm4MoeForCausalLM):
    """Sarvam-30B (see the module docstring): GLM-4.5's layers under Sarvam's checkpoint names."""

    checkpoint_renames = (("model.embed_tokens.", "model.word_embeddings."),
                          *((f".self_attn.{p}.", ".attention.query_key_value.") for p in _QKV),
                          (".self_attn.o_proj.", ".attention.dense."),
                          (".self_attn.q_norm.", ".attention.query_layernorm."),
                          (".self_attn.k_norm.", ".attention.key_layernorm."),
                          (".mlp.moe.gates.0.wg.", ".mlp.gate."),
                          (".mlp.moe.gates.0.e_score_correction_bias", ".mlp.gate.expert_bias"),
                          (".mlp.moe.", ".mlp."))

    mtp_unsupported = ("Sarvam's multi-token-prediction architecture has no public source (not transformers, vLLM or "
                       "SGLang); its layers are left unread")

    def __init__(self, config: ModelConfig, dtype=None):
        super().__init__(config, dtype)
        H, K, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        rows, start = {}, 0
        for p, n in zip(_QKV, (H * d, K * d, K * d)):
            rows[p], start = (start, start + n), start + n
        self._qkv_rows = {p: (a, b, start) for p, (a, b) in rows.items()}

    def checkpoint_rows(self, name: str):
        parts = name.split(".")
        if len(parts) >= 3 and parts[-3] == "self_attn" and parts[-2] in self._qkv_rows:
            return self._qkv_rows[parts[-2]]
        return None
