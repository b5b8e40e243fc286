"""DeepSeek-V2 / V2-Lite / Coder-V2 (``model_type: deepseek_v2``): Multi-head Latent Attention
(:mod:`dynamoe.models.mla`, RoPE on interleaved pairs, the YaRN softmax-scale correction) as in
DeepSeek-V3; dense SwiGLU MLPs in the first ``first_k_dense_replace`` layers, then MoE layers with
softmax routing (fp32): ``topk_method`` 'greedy' (plain top-k) or 'group_limited_greedy' (``n_group``
groups ranked by their best expert, the best ``topk_group`` kept, top-k inside them), the chosen
probabilities times ``routed_scaling_factor`` (not renormalised), plus ``n_shared_experts``
always-on shared experts. No selection bias (that is V3's).

Checkpoint: as DeepSeek-V3's (``self_attn.{q_a_proj, q_a_layernorm, q_b_proj | q_proj,
kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}``, ``mlp.gate.weight`` [E, D],
``mlp.experts.{e}.*``, ``mlp.shared_experts.*``, dense ``mlp.*_proj``) without
``e_score_correction_bias``.
"""
from __future__ import annotations

from .base import DecoderLayer
from .config import ModelConfig
from .deepseek_v3 import DeepseekV3ForCausalLM
from .moe_block import GatedMLP, SparseMoeBlock, glu_kind
from .norms import RMSNorm
from .rope import RotaryEmbedding

__all__ = ["DeepseekV2ForCausalLM", "TOPK_METHODS"]

TOPK_METHODS = ("greedy", "group_limited_greedy")


def _check_routing(cfg: ModelConfig) -> None:
    if cfg.topk_method not in TOPK_METHODS:
        raise ValueError(f"config field 'topk_method' must be one of {list(TOPK_METHODS)} for deepseek_v2, "
                         f"got {cfg.topk_method!r}")
    if cfg.topk_method == "group_limited_greedy" and (cfg.raw.get("n_group") is None or cfg.raw.get("topk_group") is None):
        raise ValueError("config fields 'n_group' and 'topk_group' are required with topk_method 'group_limited_greedy'")
    if cfg.raw.get("mlp_bias"):
        raise ValueError("config field 'mlp_bias' must be false for deepseek_v2 (biased dense and shared MLPs are "
                         "not supported; the published checkpoints have none)")
    if cfg.norm_topk_prob:
        # transformers' DeepseekV2 router ignores the flag, DeepSeek's own code renormalises: refuse to pick one
        raise ValueError("config field 'norm_topk_prob' must be false for deepseek_v2 (transformers ignores it, "
                         "DeepSeek's reference code renormalises; the published checkpoints say false)")


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    mla_rope_interleaved = True  # (V2 rotates complex pairs; its config has no rope_interleave)

    def __init__(self, config: ModelConfig, dtype=None):
        _check_routing(config)
        super().__init__(config, dtype)

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> DecoderLayer:
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        glu = glu_kind(cfg.hidden_act)
        if cfg.is_moe_layer(i):
            mlp = SparseMoeBlock(cfg, "softmax", normalize=False, glu=glu, num_shared_experts=cfg.n_shared_experts,
                                 router_groups=cfg.topk_method == "group_limited_greedy",
                                 route_scale=cfg.routed_scaling_factor, dtype=dtype)
        else:
            if cfg.intermediate_size is None:
                raise ValueError(f"config field 'intermediate_size' is required: layer {i} has a dense MLP")
            mlp = GatedMLP(D, cfg.intermediate_size, glu, dtype=dtype)
        return DecoderLayer(self.build_attention(cfg, i, rotary, dtype), mlp, RMSNorm(D, eps, dtype=dtype),
                            RMSNorm(D, eps, dtype=dtype))
