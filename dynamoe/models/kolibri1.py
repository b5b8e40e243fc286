"""Aleph Alpha Kolibri-1 (``model_type: kolibri1``): GQA layers of two kinds (``layer_types``; by default every 5th
layer full attention, the others sliding over ``sliding_window`` keys) with per-head q/k RMSNorms before RoPE, RoPE
on the sliding layers only (the full ones are NoPE; a config without a window is refused, as transformers' model fails
on one);
GLM-4's sandwich norms around both sublayers (h += post_norm(f(pre_norm(h)))); every layer MoE: fp32 router logits,
top-k of the logits *plus* a selection-only bias (added to the logits, not to the sigmoid scores), weighted by the
chosen logits' sigmoids (renormalised when ``norm_topk_prob``), plus a shared SwiGLU of
``shared_expert_intermediate_size``. No biases anywhere.

Checkpoint (the hub's names, which transformers saves): ``self_attn.{q,k,v,o}_proj``, ``self_attn.{q,k}_norm``,
``input_layernorm``, ``post_attn_norm`` (after the attention), ``post_attention_layernorm`` (before the MLP),
``post_ffn_norm`` (after it), ``mlp.gate.weight`` [E, D], ``moe.router.expert_bias`` [E],
``mlp.experts.{e}.{gate,up,down}_proj``, ``mlp.shared_experts.*``.

No fused decode kernels: the layers have their own forward (sandwich norms; the kernels add the residual right after
the sublayer), the attention kernel refuses the NoPE layers and the MoE kernel a bias on the logits, each saying so.
"""
from __future__ import annotations

from .afmoe import SandwichDecoderLayer
from .attention import Attention
from .base import CausalLM
from .config import ModelConfig
from .moe_block import SparseMoeBlock, glu_kind
from .norms import RMSNorm
from .rope import RotaryEmbedding
from .weights import PerExpert

__all__ = ["Kolibri1ForCausalLM"]


class Kolibri1ForCausalLM(CausalLM):
    """Kolibri-1 (see the module docstring)."""

    checkpoint_renames = ((".mlp.moe.gates.0.e_score_correction_bias", ".moe.router.expert_bias"),
                          (".mlp.moe.gates.0.wg.", ".mlp.gate."), (".mlp.moe.", ".mlp."),
                          (".post_attention_layernorm.", ".post_attn_norm."),
                          (".pre_mlp_layernorm.", ".post_attention_layernorm."),
                          (".post_mlp_layernorm.", ".post_ffn_norm."))
    expert_layout = PerExpert("gate_proj", "up_proj", "down_proj")

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> SandwichDecoderLayer:
        D, eps, kind = cfg.hidden_size, cfg.rms_norm_eps, cfg.layer_types[i]
        if kind not in ("full_attention", "sliding_attention"):
            raise ValueError(f"config field 'layer_types' entry {i} must be 'full_attention' or 'sliding_attention' "
                             f"for kolibri1, got {kind!r}")
        if cfg.shared_expert_intermediate_size is None:
            raise ValueError("config field 'shared_expert_intermediate_size' is required for kolibri1 (an int >= 1)")
        if cfg.sliding_window is None:  # (transformers builds the sliding mask whatever the layers: it fails too)
            raise ValueError("config field 'sliding_window' is required for kolibri1 (an int >= 1)")
        sliding = kind == "sliding_attention"
        attn = Attention(D, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, i, rotary, qk_norm=True,
                         norm_eps=eps, sliding_window=cfg.layer_sliding_window(i), use_rope=sliding, dtype=dtype)
        mlp = SparseMoeBlock(cfg, "sigmoid", normalize=cfg.norm_topk_prob, glu=glu_kind(cfg.hidden_act),
                             num_shared_experts=1, shared_hidden_size=cfg.shared_expert_intermediate_size,
                             router_groups=False, route_scale=1.0, bias_on_logits=True, dtype=dtype)
        return SandwichDecoderLayer(attn, mlp, *(RMSNorm(D, eps, dtype=dtype) for _ in range(4)))
