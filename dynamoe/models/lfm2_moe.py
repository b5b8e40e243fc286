"""Liquid LFM2-MoE (``model_type: lfm2_moe``): gated short-convolution layers
(:class:`~dynamoe.models.short_conv.ShortConv`) and GQA attention layers by ``layer_types`` ('conv' /
'full_attention'; the hub's ``full_attn_idxs`` otherwise) -- the attention with per-head q/k RMSNorms before
RoPE (base 1e6) --, each followed by a dense SwiGLU MLP (the first ``num_dense_layers`` layers) or an MoE: sigmoid
scores, top-k chosen on scores + the selection-only ``expert_bias`` (``use_expert_bias``), the chosen scores
renormalised (``norm_topk_prob``) and times ``routed_scaling_factor``; SwiGLU experts of ``moe_intermediate_size``.
Pre-norm residuals (``operator_norm``, ``ffn_norm``), RMSNorms of ``norm_eps``; the final norm is named
``embedding_norm``; the embeddings are tied by default.

transformers renormalises the chosen scores by their sum + 1e-6 (dynamoe's sigmoid router: the plain sum): the
weights differ by under 1e-6 relative, far below the fp32 parity tolerance.

Checkpoint: ``model.layers.{i}.conv.{in_proj, conv, out_proj}`` or ``self_attn.{q,k,v}_proj, out_proj,
q_layernorm, k_layernorm``; ``feed_forward.gate.weight`` [E, D], ``feed_forward.expert_bias`` [E],
``feed_forward.experts.{e}.{w1,w3,w2}.weight`` (gate, up, down) or a dense ``feed_forward.{w1,w3,w2}``;
``operator_norm``, ``ffn_norm``; ``model.embedding_norm``.

The model keeps per-sequence recurrent state (the conv windows: ``recurrent_state = True``, no prefix reuse).
"""
from __future__ import annotations

from torch import nn

from .attention import Attention
from .base import CausalLM, DecoderLayer
from .config import ModelConfig
from .mamba import MixerDecoderLayer
from .moe_block import GatedMLP, SparseMoeBlock, glu_kind
from .norms import RMSNorm
from .rope import RotaryEmbedding
from .short_conv import ShortConv
from .weights import PerExpert

__all__ = ["Lfm2MoeForCausalLM"]


class Lfm2MoeForCausalLM(CausalLM):
    """LFM2-MoE (see the module docstring)."""

    #: the conv layers' windows summarise a slot's last inputs: no prefix reuse
    recurrent_state = True
    #: ... but speculative decoding can cut it back past rejected drafts: its layers record their state after every
    #: token of a verification forward (dynamoe.models.cache.KVCache.begin_history)
    recurrent_rollback = True
    checkpoint_renames = ((".mlp.moe.gates.0.wg.", ".feed_forward.gate."),
                          (".mlp.moe.gates.0.e_score_correction_bias", ".feed_forward.expert_bias"),
                          (".mlp.moe.", ".feed_forward."), (".mlp.gate_proj.", ".feed_forward.w1."),
                          (".mlp.up_proj.", ".feed_forward.w3."), (".mlp.down_proj.", ".feed_forward.w2."),
                          (".self_attn.o_proj.", ".self_attn.out_proj."), (".self_attn.q_norm.", ".self_attn.q_layernorm."),
                          (".self_attn.k_norm.", ".self_attn.k_layernorm."), (".input_layernorm.", ".operator_norm."),
                          (".post_attention_layernorm.", ".ffn_norm."), ("model.norm.", "model.embedding_norm."))
    expert_layout = PerExpert("w1", "w3", "w2")

    def __init__(self, config: ModelConfig, dtype=None):
        use_bias = config.raw.get("use_expert_bias", True)
        if not isinstance(use_bias, bool):
            raise ValueError(f"config field 'use_expert_bias' must be true or false, got {use_bias!r}")
        super().__init__(config, dtype)
        if not use_bias:  # no selection bias: the sigmoid router's buffer goes (the checkpoint has none)
            for _, block in self.moe_layers():
                block.moe.gates[0].e_score_correction_bias = None

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> nn.Module:
        D, eps, kind = cfg.hidden_size, cfg.rms_norm_eps, cfg.layer_types[i]
        glu = glu_kind(cfg.hidden_act)
        if cfg.is_moe_layer(i):
            mlp: nn.Module = SparseMoeBlock(cfg, "sigmoid", normalize=cfg.norm_topk_prob, glu=glu, router_groups=False,
                                            route_scale=cfg.routed_scaling_factor, dtype=dtype)
        else:
            mlp = GatedMLP(D, cfg.intermediate_size, glu, dtype=dtype)
        norms = RMSNorm(D, eps, dtype=dtype), RMSNorm(D, eps, dtype=dtype)
        if kind == "conv":
            ssm = cfg.ssm
            conv = ShortConv(D, ssm.conv_kernel, i, bias=ssm.conv_bias, checks_position=i == cfg.layer_types.index(kind),
                             dtype=dtype)
            return MixerDecoderLayer(conv, mlp, *norms, mixer_name="conv")
        if kind != "full_attention":
            raise ValueError(f"config field 'layer_types' entry {i} must be 'conv' or 'full_attention' for lfm2_moe, "
                             f"got {kind!r}")
        attn = Attention(D, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, i, rotary, qk_norm=True,
                         norm_eps=eps, dtype=dtype)
        return DecoderLayer(attn, mlp, *norms)   # (the plain layer: its decode steps may run the fused kernels)
