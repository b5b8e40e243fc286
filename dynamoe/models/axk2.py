"""A.X-K2 (``model_type: axk2``, SK Telecom): DeepSeek-V3.2's sparse MLA (:mod:`dynamoe.models.mla` through the DSA
:class:`~dynamoe.models.indexer.Indexer`, every layer its own; RoPE on interleaved pairs for MLA, half-split on the
indexer's first dims) whose ``q_b_proj`` reads [q_a_layernorm(q_a(x)) | q_a(x)] and gives each head its query and a
sigmoid gate on its output; self-gated RMSNorms -- y = RMSNorm(x), y * sigmoid(W_up(silu(W_down(y)))) -- before
every attention and before every MoE block (plain ones before the dense MLPs); DeepSeek-V3's sigmoid routing with a
selection bias (group-limited only when ``n_group`` is set), renormalised, times ``routed_scaling_factor``, plus
shared experts. The MLP kinds come from ``mlp_layer_types``, else from the hub's ``first_k_dense_replace`` /
``moe_layer_freq``.

Group-limited routing: transformers masks the experts of the dropped groups with a score of 0 (not -inf); the two
agree unless a kept expert's biased score is below 0, which dynamoe's router (DeepSeek-V3's) never picks over a
dropped one -- configs whose groups limit the choice are refused for that reason (the released ones route
without groups).

Checkpoint (the hub's names, which transformers saves back): DeepSeek-V3.2's attention names with ``q_b_proj``
[H (qk + v), 2 Q], the norms' ``norm.weight``, ``W_down.weight`` [rank, D], ``W_up.weight`` [D, rank],
``mlp.gate.weight``, ``mlp.gate.e_score_correction_bias``, ``mlp.experts.{e}.{gate,up,down}_proj``,
``mlp.shared_experts.*``. No fused decode kernels: the kernels take plain RMSNorms before the sublayers (each
refusal says so).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import DecoderLayer
from .config import ModelConfig
from .deepseek_v3 import DeepseekV3ForCausalLM, deepseek_mlp
from .indexer import Indexer
from .mla import MLAttention, mla_softmax_scale
from .norms import RMSNorm
from .rope import RotaryEmbedding

__all__ = ["AXK2ForCausalLM", "SelfGatedRMSNorm"]


class SelfGatedRMSNorm(nn.Module):
    """y = RMSNorm(x) (``norm``); y * sigmoid(``W_up``(silu(``W_down``(y)))) (the gate in fp32), in x's dtype."""

    def __init__(self, dim: int, rank: int, eps: float, dtype=None):
        super().__init__()
        self.norm = RMSNorm(dim, eps, dtype=dtype)
        self.W_down = nn.Linear(dim, rank, bias=False, dtype=dtype)
        self.W_up = nn.Linear(rank, dim, bias=False, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        y = self.norm(x)
        return (y * torch.sigmoid(self.W_up(F.silu(self.W_down(y))).float())).to(y.dtype)


class AXK2ForCausalLM(DeepseekV3ForCausalLM):
    """A.X-K2 (see the module docstring)."""

    mla_rope_interleaved = True

    def __init__(self, config: ModelConfig, dtype=None):
        missing = [n for n in ("q_lora_rank", "index_topk", "index_head_dim", "index_n_heads")
                   if getattr(config, n) is None]
        if missing:
            raise ValueError(f"config fields {missing} are required for axk2 (its indexer and output gates read the "
                             "query LoRA bottleneck)")
        if config.topk_group < config.n_group:
            raise ValueError(f"config fields 'n_group' / 'topk_group' ({config.n_group} / {config.topk_group}) must not "
                             "limit the groups for axk2 (null, or topk_group = n_group): transformers masks the dropped "
                             "groups' experts with score 0, which dynamoe's group-limited router does not reproduce "
                             "(see dynamoe.models.axk2)")
        rank = config.raw.get("gated_norm_rank", 16)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"config field 'gated_norm_rank' must be an int >= 1, got {rank!r}")
        object.__setattr__(self, "gated_norm_rank", rank)
        super().__init__(config, dtype)

    def build_attention(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> MLAttention:
        indexer = Indexer(cfg.hidden_size, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim,
                          cfg.index_topk, i, rotary, rope_interleaved=False, dtype=dtype)
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        return MLAttention(cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank,
                           cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, i, rotary,
                           mla_softmax_scale(cfg.rope, qk), rope_interleaved=True, bias=cfg.attention_bias,
                           indexer=indexer, gated_queries=True, dtype=dtype)

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> DecoderLayer:
        D, eps, rank = cfg.hidden_size, cfg.rms_norm_eps, self.gated_norm_rank
        post = SelfGatedRMSNorm(D, rank, eps, dtype) if cfg.is_moe_layer(i) else RMSNorm(D, eps, dtype=dtype)
        return DecoderLayer(self.build_attention(cfg, i, rotary, dtype), deepseek_mlp(cfg, i, dtype),
                            SelfGatedRMSNorm(D, rank, eps, dtype), post)
