"""MiniMax-M2 (``model_type: minimax_m2``): GQA whose q and k are RMS-normalised over all heads at once
(one norm over the H*d query dims, one over the K*d key dims, before RoPE), RoPE on the first
``partial_rotary_factor`` of each head (hub configs: ``rotary_dim``), half-split; every layer
sparse: sigmoid scores (fp32), a selection-only ``e_score_correction_bias``, top-k without groups,
the chosen scores renormalised (no scaling factor), SwiGLU experts of ``intermediate_size``.

Checkpoint (Mixtral's names): ``block_sparse_moe.gate.weight`` [E, D],
``block_sparse_moe.e_score_correction_bias`` [E], ``block_sparse_moe.experts.{e}.w1`` (gate), ``w3`` (up),
``w2`` (down); ``self_attn.q_norm.weight`` [H*d], ``self_attn.k_norm.weight`` [K*d].
"""
from __future__ import annotations

from .attention import Attention
from .base import CausalLM, DecoderLayer
from .config import ModelConfig
from .moe_block import SparseMoeBlock, glu_kind
from .norms import RMSNorm
from .rope import RotaryEmbedding
from .weights import PerExpert

__all__ = ["MiniMaxM2ForCausalLM"]


class MiniMaxM2ForCausalLM(CausalLM):
    checkpoint_renames = ((".mlp.moe.gates.0.e_score_correction_bias", ".block_sparse_moe.e_score_correction_bias"),
                          (".mlp.moe.gates.0.wg.", ".block_sparse_moe.gate."), (".mlp.moe.", ".block_sparse_moe."))
    expert_layout = PerExpert("w1", "w3", "w2")

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> DecoderLayer:
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        attn = Attention(D, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, i, rotary,
                         qk_norm="all", norm_eps=eps, dtype=dtype)
        # transformers' MiniMaxM2 router: no groups, no scaling factor, always renormalised
        mlp = SparseMoeBlock(cfg, "sigmoid", normalize=True, glu=glu_kind(cfg.hidden_act), router_groups=False,
                             route_scale=1.0, dtype=dtype)
        return DecoderLayer(attn, mlp, RMSNorm(D, eps, dtype=dtype), RMSNorm(D, eps, dtype=dtype))
