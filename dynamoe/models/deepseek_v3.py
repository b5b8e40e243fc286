"""DeepSeek-V3 / R1 and Kimi-K2 (``model_type: deepseek_v3``, ``kimi_k2``): Multi-head Latent
Attention (:mod:`dynamoe.models.mla`) with RoPE on interleaved pairs (``rope_interleave``, default
true) and the YaRN softmax-scale correction; dense SwiGLU MLPs in the first ``first_k_dense_replace``
layers, then MoE layers: sigmoid scores, selection-only ``e_score_correction_bias``, group-limited
top-k (``n_group`` / ``topk_group``), renormalised if ``norm_topk_prob``, times
``routed_scaling_factor``, plus ``n_shared_experts`` always-on shared experts (added unscaled).

Checkpoint: ``self_attn.{q_a_proj, q_a_layernorm, q_b_proj | q_proj, kv_a_proj_with_mqa,
kv_a_layernorm, kv_b_proj, o_proj}``; ``mlp.gate.weight`` [E, D] + ``mlp.gate.e_score_correction_bias``
[E]; ``mlp.experts.{e}.gate_proj|up_proj|down_proj.weight``; ``mlp.shared_experts.*``; dense layers
``mlp.gate_proj|up_proj|down_proj``. Multi-token-prediction layers (``model.layers.{N + j}`` past the
``num_hidden_layers`` N, ``num_nextn_predict_layers`` of them) load as the model's ``mtp`` heads when the
checkpoint has them (:mod:`dynamoe.models.mtp`): plain decoding does not run them, the engine drafts with
them (``draft="mtp"``). Blockwise-FP8 checkpoints load every Linear of the layers packed (QuantizedLinear); MLA's
weight absorption dequantizes ``kv_b_proj`` once per layer on first use.

Kimi-K2 (and K2-Thinking) checkpoints say ``model_type: kimi_k2`` with architecture
``DeepseekV3ForCausalLM``: the same model. (Kimi-K2.5 / K2.6, ``kimi_k25``, is a vision-language model
whose ``text_config`` is this architecture: :mod:`dynamoe.models.kimi_k25` loads its text model.)
"""
from __future__ import annotations

import logging
from typing import Optional

from .base import CausalLM, DecoderLayer
from .config import ModelConfig
from .indexer import Indexer, SharedIndex
from .mla import MLAttention, mla_softmax_scale
from .moe_block import GatedMLP, SparseMoeBlock, glu_kind
from .mtp import MTPHeads
from .norms import RMSNorm
from .rope import RotaryEmbedding
from .weights import PerExpert

__all__ = ["DeepseekV3ForCausalLM", "deepseek_mlp"]

log = logging.getLogger(__name__)

# the names of the DeepSeek-style MoE block (also GLM-4.5, V3.2, GLM-5)
DEEPSEEK_RENAMES = ((".mlp.moe.gates.0.wg.", ".mlp.gate."), (".mlp.moe.gates.0.", ".mlp.gate."), (".mlp.moe.", ".mlp."))


def deepseek_mlp(cfg: ModelConfig, i: int, dtype):
    """Layer i's feed-forward block: the sigmoid-routed MoE with shared experts, or a dense SwiGLU MLP."""
    glu = glu_kind(cfg.hidden_act)
    if cfg.is_moe_layer(i):
        return SparseMoeBlock(cfg, "sigmoid", normalize=cfg.norm_topk_prob, glu=glu,
                              num_shared_experts=cfg.n_shared_experts, dtype=dtype)
    if cfg.intermediate_size is None:
        raise ValueError(f"config field 'intermediate_size' is required: layer {i} has a dense MLP")
    return GatedMLP(cfg.hidden_size, cfg.intermediate_size, glu, dtype=dtype)


def _need(cfg: ModelConfig, *names: str) -> None:
    missing = [n for n in names if getattr(cfg, n) is None]
    if missing:
        raise ValueError(f"config fields {missing} are required for {cfg.model_type!r} (Multi-head Latent Attention)")


class DeepseekV3ForCausalLM(MTPHeads, CausalLM):
    checkpoint_renames = DEEPSEEK_RENAMES
    expert_layout = PerExpert("gate_proj", "up_proj", "down_proj")
    #: RoPE layout of MLA: None = the config's ``rope_interleave``; V3.2 / GLM-5 always interleave
    mla_rope_interleaved: Optional[bool] = None
    #: the sparse-attention indexer's RoPE layout (V3.2: half-split, GLM-5: interleaved); None = no indexer
    indexer_rope_interleaved: Optional[bool] = None

    def __init__(self, config: ModelConfig, dtype=None):
        _need(config, "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        if self.indexer_rope_interleaved is not None:
            _need(config, "q_lora_rank", "index_topk", "index_head_dim", "index_n_heads")
        # set before nn.Module.__init__ runs the layer builders (a plain object: no module registration)
        object.__setattr__(self, "shared_index", SharedIndex() if self.indexer_rope_interleaved is not None else None)
        super().__init__(config, dtype)

    def build_rotary(self, cfg: ModelConfig) -> RotaryEmbedding:
        # RoPE covers only the qk_rope_head_dim part of each head (the config's head_dim says the same)
        return RotaryEmbedding(cfg.rope, cfg.qk_rope_head_dim, cfg.max_position_embeddings)

    def build_indexer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> Optional[Indexer]:
        # (a multi-token-prediction layer, past the config's list, runs its own indexer)
        if self.indexer_rope_interleaved is None or (i < len(cfg.indexer_types) and cfg.indexer_types[i] == "shared"):
            return None
        return Indexer(cfg.hidden_size, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim,
                       cfg.index_topk, i, rotary, self.indexer_rope_interleaved, self.shared_index, dtype=dtype)

    def build_attention(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> MLAttention:
        interleaved = cfg.rope_interleave if self.mla_rope_interleaved is None else self.mla_rope_interleaved
        indexer = self.build_indexer(cfg, i, rotary, dtype)
        shared = None
        if self.indexer_rope_interleaved is not None and indexer is None:
            if i == 0:
                raise ValueError("config field 'indexer_types' must start with a 'full' layer (layer 0 is 'shared')")
            shared = self.shared_index
        return MLAttention(cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank,
                           cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, i, rotary,
                           mla_softmax_scale(cfg.rope, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim),
                           rope_interleaved=interleaved, bias=cfg.attention_bias, indexer=indexer,
                           shared_index=shared, dtype=dtype)

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> DecoderLayer:
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        return DecoderLayer(self.build_attention(cfg, i, rotary, dtype), deepseek_mlp(cfg, i, dtype),
                            RMSNorm(D, eps, dtype=dtype), RMSNorm(D, eps, dtype=dtype))

    def build_mtp_layer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype, names: set) -> DecoderLayer:
        """The MTP depth's layer i; with sparse attention (V3.2, GLM-5) it runs its own indexer when the checkpoint
        has one for it, else it attends to every earlier key (no earlier layer of its forward to share a
        selection with)."""
        layer = self.build_layer(cfg, i, rotary, dtype)
        attn = layer.self_attn
        if attn.indexer is not None and f"model.layers.{i}.self_attn.indexer.wk.weight" not in names:
            log.info("%s: the multi-token-prediction layer model.layers.%d has no indexer tensors: its attention "
                     "is dense", cfg.model_type, i)
            attn.indexer = None
        object.__setattr__(attn, "shared_index", None)
        return layer

    def set_absorb(self, absorb: Optional[bool]) -> None:
        """MLA weight absorption for every layer: None = by cost (decode absorbs, prefill expands),
        True / False = always / never."""
        for layer in self.model.layers:
            layer.self_attn.absorb = absorb
