"""Tencent Hy3 (``model_type: hy_v3``): GQA with per-head q/k RMSNorms before RoPE (biases on q/k/v/o when
``attention_bias``), dense SwiGLU MLPs on the ``mlp_layer_types`` 'dense' layers (by default the first), elsewhere
MoE: fp32 sigmoid scores, top-k chosen on the scores plus a selection-only ``e_score_correction_bias``, always
renormalised, times ``router_scaling_factor``, plus a shared SwiGLU of ``num_shared_experts`` x
``moe_intermediate_size`` (biases on the dense and shared MLPs when ``mlp_bias``; the routed experts have none).

Checkpoint (the hub's names, which transformers saves): ``self_attn.{q,k,v,o}_proj``, ``self_attn.{q,k}_norm``,
``mlp.router.gate.weight`` [E, D] fp32, ``mlp.expert_bias`` [E], ``mlp.experts.{e}.{gate,up,down}_proj``,
``mlp.shared_mlp.*``, dense ``mlp.*_proj``.

Multi-token prediction: the layer ``model.layers.{N + j}`` (``enorm``, ``hnorm``, ``eh_proj``, a Hy3 decoder layer,
``final_layernorm``) loads as the ``mtp`` head (:mod:`dynamoe.models.mtp`; the engine drafts with it,
``draft="mtp"``) as vLLM's HYV3MTP computes it: the head's output is ``final_layernorm`` of its layer's (what a
further draft reads), projected by the model's lm_head; the model's embedding. The layer's own ``shared_head.*`` /
``embed_tokens.*`` tensors are not read (vLLM skips them too: HF's inference uses the model's lm_head), and the
loader logs their count.

``enable_moe_fp32_combine`` (the shared output added to the routed one in fp32, then cast) is the same sum as in the
activations' dtype: both are bf16 or fp32 tensors, whose sum torch rounds once either way.
"""
from __future__ import annotations

from .attention import Attention
from .base import CausalLM, DecoderLayer
from .config import ModelConfig
from .moe_block import GatedMLP, SparseMoeBlock, glu_kind
from .mtp import MTPHeads, NextTokenPredictor
from .norms import RMSNorm
from .rope import RotaryEmbedding
from .weights import PerExpert

__all__ = ["HYV3ForCausalLM"]


class HYV3ForCausalLM(MTPHeads, CausalLM):
    """Hy3 (see the module docstring)."""

    checkpoint_renames = ((".mlp.moe.gates.0.wg.", ".mlp.router.gate."),
                          (".mlp.moe.gates.0.e_score_correction_bias", ".mlp.expert_bias"),
                          (".mlp.moe.shared_experts.", ".mlp.shared_mlp."), (".mlp.moe.", ".mlp."))
    expert_layout = PerExpert("gate_proj", "up_proj", "down_proj")
    mtp_renames = (("shared_head.norm.", "final_layernorm."),)
    mtp_own_copies = False
    mtp_ignored = ("shared_head.", "embed_tokens.")

    def __init__(self, config: ModelConfig, dtype=None):
        bias = config.raw.get("mlp_bias")
        if not isinstance(bias, bool):
            raise ValueError(f"config field 'mlp_bias' must be true or false, got {bias!r}")
        super().__init__(config, dtype)

    def build_mlp(self, cfg: ModelConfig, i: int, dtype):
        glu, bias = glu_kind(cfg.hidden_act), cfg.raw["mlp_bias"]
        if cfg.intermediate_size is None:
            raise ValueError("config field 'intermediate_size' is required for hy_v3 (the dense MLPs' width)")
        if not cfg.is_moe_layer(i):
            return GatedMLP(cfg.hidden_size, cfg.intermediate_size, glu, bias=bias, dtype=dtype)
        # (HYV3MLP takes `intermediate_size or config.intermediate_size`: no shared experts means one as wide as the
        # dense MLPs)
        shared = cfg.expert_hidden_size * cfg.n_shared_experts or cfg.intermediate_size
        return SparseMoeBlock(cfg, "sigmoid", normalize=True, glu=glu, num_shared_experts=1, shared_hidden_size=shared,
                              router_groups=False, route_scale=cfg.routed_scaling_factor, shared_bias=bias, dtype=dtype)

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> DecoderLayer:
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        attn = Attention(D, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, i, rotary,
                         qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, qk_norm=True, norm_eps=eps, dtype=dtype)
        return DecoderLayer(attn, self.build_mlp(cfg, i, dtype), RMSNorm(D, eps, dtype=dtype), RMSNorm(D, eps, dtype=dtype))

    def new_mtp_head(self, cfg: ModelConfig, block: DecoderLayer, dtype) -> NextTokenPredictor:
        return NextTokenPredictor(block, cfg.hidden_size, cfg.vocab_size, cfg.rms_norm_eps, dtype=dtype,
                                  norm_output=True)
