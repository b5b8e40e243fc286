"""Cohere2-MoE (``model_type: cohere2_moe``: Command A MoE): parallel decoder layers -- one norm feeding both
the attention and the MLP, h + attn(norm(h)) + mlp(norm(h)) --; two layer kinds (``layer_types``: sliding-window
layers with interleaved RoPE, full-attention layers without position encoding, except that dense layers rotate
when ``prefix_dense_sliding_window_pattern`` is 1); dense SwiGLU MLPs of ``prefix_dense_intermediate_size`` on the
``mlp_layer_types`` 'dense' layers, elsewhere routed experts of ``intermediate_size``: top-k of the router logits,
weighted by a softmax over the k (``expert_selection_fn`` 'softmax') or by their sigmoids (renormalised when
``norm_topk_prob``), plus a shared SwiGLU of ``num_shared_experts`` x ``intermediate_size`` that the block averages
with (``shared_expert_combination_strategy`` 'average') or adds to ('sum') the routed output; LayerNorms (weight
only) unless the config sets ``rms_norm_eps`` (then RMSNorms); the logits times ``logit_scale``.

Checkpoint (transformers' names): ``self_attn.{q,k,v,o}_proj``, ``input_layernorm`` (the layer's only norm),
``mlp.gate.weight`` [E, D], ``mlp.experts.{e}.{gate,up,down}_proj``, ``mlp.shared_experts.*``, dense
``mlp.*_proj``.

Decode: the attention's fused kernel gives h + attn(norm(h)) where it applies (RoPE layers after an RMSNorm); the
MLP runs as a module on the same norm(h) (the MoE layer's expert kernel inside); the NoPE layers' attention
refuses the kernel and says so.
"""
from __future__ import annotations

from torch import Tensor, nn

from ..ops.fused import MAX_ROWS
from .attention import Attention
from .base import CausalLM
from .config import ModelConfig
from .moe_block import GatedMLP, SparseMoeBlock, glu_kind
from .norms import LayerNorm, RMSNorm
from .rope import RotaryEmbedding
from .weights import PerExpert

__all__ = ["Cohere2MoeForCausalLM", "ParallelDecoderLayer"]

_SELECTION = ("softmax", "sigmoid")
_COMBINATION = {"average": 0.5, "sum": 1.0}


class ParallelDecoderLayer(nn.Module):
    """h + attn(n) + mlp_scale * mlp(n), n = input_layernorm(h): one norm, one residual (``mlp_scale`` 1/2 averages
    the routed and shared experts' sum, Cohere's 'average')."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, input_layernorm: nn.Module, mlp_scale: float = 1.0):
        super().__init__()
        self.self_attn, self.mlp, self.input_layernorm = self_attn, mlp, input_layernorm
        self.mlp_scale = mlp_scale

    def forward(self, h_BTD: Tensor, positions_BT: Tensor, cache=None, slots=None, kv_len=None) -> Tensor:
        n_BTD = self.input_layernorm(h_BTD)
        fused = None
        if cache is not None and h_BTD.size(1) == 1 and h_BTD.size(0) <= MAX_ROWS:
            # h + attn(norm(h)) in one kernel call where the attention has one (None: the module path)
            fused = self.self_attn.decode_step(h_BTD, self.input_layernorm, positions_BT, cache, slots, kv_len)
        if fused is None:
            fused = h_BTD + self.self_attn(n_BTD, positions_BT, cache, slots, kv_len)
        m_BTD = self.mlp(n_BTD)
        return fused + (m_BTD if self.mlp_scale == 1.0 else m_BTD * self.mlp_scale)


class _ScaledLMHead(nn.Linear):
    """nn.Linear whose output is multiplied by ``multiplier`` (same parameter and name; may stay tied)."""

    multiplier = 1.0

    def forward(self, h: Tensor) -> Tensor:
        return super().forward(h) * self.multiplier


class Cohere2MoeForCausalLM(CausalLM):
    """Cohere2-MoE (see the module docstring)."""

    checkpoint_renames = ((".mlp.moe.gates.0.wg.", ".mlp.gate."), (".mlp.moe.", ".mlp."))
    expert_layout = PerExpert("gate_proj", "up_proj", "down_proj")

    def __init__(self, config: ModelConfig, dtype=None):
        raw = config.raw
        for name, allowed in (("expert_selection_fn", _SELECTION), ("shared_expert_combination_strategy", _COMBINATION)):
            if raw.get(name) not in allowed:
                raise ValueError(f"config field {name!r} must be one of {list(allowed)}, got {raw.get(name)!r}")
        scale = raw.get("logit_scale")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise ValueError(f"config field 'logit_scale' must be a number, got {scale!r}")
        super().__init__(config, dtype)
        self.lm_head.__class__ = _ScaledLMHead  # (the same parameter, name and tying)
        self.lm_head.multiplier = float(scale)

    def build_norm(self, cfg: ModelConfig, dim: int, dtype) -> nn.Module:
        if cfg.layer_norm:
            return LayerNorm(dim, cfg.rms_norm_eps, dtype=dtype)
        return RMSNorm(dim, cfg.rms_norm_eps, dtype=dtype)

    def build_mlp(self, cfg: ModelConfig, i: int, dtype) -> nn.Module:
        glu = glu_kind(cfg.hidden_act)
        if not cfg.is_moe_layer(i):
            width = cfg.raw.get("prefix_dense_intermediate_size") or cfg.intermediate_size
            if isinstance(width, bool) or not isinstance(width, int) or width < 1:
                raise ValueError(f"config field 'prefix_dense_intermediate_size' must be an int >= 1 or null, got "
                                 f"{width!r}")
            return GatedMLP(cfg.hidden_size, width, glu, dtype=dtype)
        if cfg.intermediate_size is None:
            raise ValueError("config field 'intermediate_size' (the experts' width) is required for cohere2_moe")
        sigmoid = cfg.raw["expert_selection_fn"] == "sigmoid"
        # (softmax over the top-k logits = the softmax over all renormalised over the k)
        block = SparseMoeBlock(cfg, "sigmoid" if sigmoid else "softmax", normalize=cfg.norm_topk_prob if sigmoid else True,
                               glu=glu, num_shared_experts=cfg.n_shared_experts, router_groups=False, route_scale=1.0,
                               dtype=dtype)
        if sigmoid:
            block.moe.gates[0].e_score_correction_bias = None  # (no selection bias: top-k of the plain scores)
        return block

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> ParallelDecoderLayer:
        D, kind = cfg.hidden_size, cfg.layer_types[i]
        if kind not in ("full_attention", "sliding_attention"):
            raise ValueError(f"config field 'layer_types' entry {i} must be 'full_attention' or 'sliding_attention' "
                             f"for cohere2_moe, got {kind!r}")
        attn = Attention(D, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, i, rotary,
                         qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias,
                         sliding_window=cfg.layer_sliding_window(i), rope_interleaved=True,
                         use_rope=cfg.layer_uses_rope(i), dtype=dtype)
        mlp = self.build_mlp(cfg, i, dtype)
        shared = isinstance(mlp, SparseMoeBlock) and cfg.n_shared_experts > 0
        scale = _COMBINATION[cfg.raw["shared_expert_combination_strategy"]] if shared else 1.0
        return ParallelDecoderLayer(attn, mlp, self.build_norm(cfg, D, dtype), mlp_scale=scale)
