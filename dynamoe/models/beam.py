"""Reflection Beam (``model_type: beam``): GQA decoder layers of two kinds (``layer_types``; by default every 6th
layer and the last full attention, the others sliding over ``sliding_window`` keys), each kind with its RoPE from
``rope_parameters`` by layer type -- a kind mapped to null has none (by default the full layers: NoPE), its queries
then scaled by (1 + (position + 1) / 2048) ** 0.1 (scalable softmax) --; per-head q/k RMSNorms before RoPE; the
attention output times sigmoid(``gate_proj``(x) [H*d] + ``gate_bias`` [H] per head) before ``o_proj``; sandwich norms
whose residual adds are depth-scaled: h = f * n^-1/2 + h * ((n - 1) / n)^1/2 with n = 2(i + 1) after the attention of
layer i and n + 1 after its MLP; RMSNorms multiply by their weight in fp32; dense SwiGLU MLPs on the
``mlp_layer_types`` 'dense' layers (by default the first three), elsewhere DeepSeek-V3's routing (sigmoid scores,
selection-only bias, groups, renormalised when ``norm_topk_prob``, times ``routed_scaling_factor``) without shared
experts; the logits tanh-softcapped at ``final_logit_softcapping`` (fp32 logits; null: none).

Checkpoint (transformers' names): ``self_attn.{q,k,v,o,gate}_proj``, ``self_attn.gate_bias``, ``self_attn.{q,k}_norm``,
``{input,post_attention,pre_feedforward,post_feedforward}_layernorm``, ``mlp.gate.weight`` [E, D] fp32,
``mlp.gate.e_score_correction_bias``, ``mlp.experts.{e}.{gate,up,down}_proj``, dense ``mlp.*_proj``.

No fused decode kernels: the layers have their own forward (sandwich norms, scaled residuals), and the attention
kernel's output gate has no bias per head (the attention says so).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..ops.fused import Unfusable
from .afmoe import SandwichDecoderLayer
from .attention import Attention
from .base import CausalLM
from .cache import KVCache
from .config import ModelConfig
from .deepseek_v3 import DEEPSEEK_RENAMES
from .mimo_v2_flash import RotaryByLayerType
from .moe_block import GatedMLP, SparseMoeBlock, glu_kind
from .norms import RMSNorm
from .rope import RotaryEmbedding
from .weights import PerExpert

__all__ = ["BeamForCausalLM", "BeamAttention", "DepthScaledSandwichLayer"]


def nope_query_scale(positions_BT: Tensor) -> Tensor:
    """Beam's scalable-softmax query scale of the NoPE layers, (1 + (position + 1) / 2048) ** 0.1, fp32 [B, 1, T, 1]."""
    return torch.exp(0.1 * torch.log1p((positions_BT.float() + 1) / 2048))[:, None, :, None]


class BeamAttention(Attention):
    """GQA with per-head q/k RMSNorms (weight in fp32) before RoPE, or on NoPE layers (``rotary`` None) the
    scalable-softmax query scale, and a sigmoid gate per output channel with a bias per head."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, layer_idx: int,
                 rotary: RotaryEmbedding | None, bias: bool = False, norm_eps: float = 1e-6,
                 sliding_window: int | None = None, dtype=None):
        super().__init__(hidden_size, num_heads, num_kv_heads, head_dim, layer_idx, rotary, qkv_bias=bias, o_bias=bias,
                         qk_norm=True, norm_eps=norm_eps, sliding_window=sliding_window, use_rope=rotary is not None,
                         dtype=dtype)
        self.q_norm = RMSNorm(head_dim, norm_eps, weight_in_fp32=True, dtype=dtype)
        self.k_norm = RMSNorm(head_dim, norm_eps, weight_in_fp32=True, dtype=dtype)
        self.gate_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False, dtype=dtype)
        self.gate_bias = nn.Parameter(torch.zeros(num_heads, dtype=dtype))

    def _decode_weights(self, kernels, holds, norm, dtype):
        raise Unfusable("a bias per head on the output gate's logits (gate_bias)"
                        + ("" if self.use_rope else " and the NoPE layers' query scale") + ": the fused kernel has "
                        + ("none" if self.use_rope else "neither"))

    def forward(self, x_BTD: Tensor, positions_BT: Tensor, cache: KVCache | None = None, slots: Tensor | None = None,
                kv_len: int | None = None) -> Tensor:
        B, T, _ = x_BTD.shape
        H, d = self.num_heads, self.head_dim
        q, k, v = self.heads(x_BTD, positions_BT)                             # [B, H|K, T, d]
        if not self.use_rope:
            q = (q.float() * nope_query_scale(positions_BT)).to(q.dtype)
        out = self.attend_cached(q, k, v, positions_BT, cache, slots, kv_len, self.sliding_window)   # [B, H, T, d]
        gate = self.gate_proj(x_BTD).view(B, T, H, d) + self.gate_bias[:, None]
        out = out.transpose(1, 2) * torch.sigmoid(gate)
        return self.o_proj(out.reshape(B, T, H * d))


class DepthScaledSandwichLayer(SandwichDecoderLayer):
    """Sandwich norms whose residual adds are h = f / sqrt(n) + h * sqrt((n - 1) / n), n = ``attn_add`` after the
    attention and ``attn_add`` + 1 after the MLP (Beam: attn_add = 2 (i + 1))."""

    def __init__(self, *args, attn_add: int):
        super().__init__(*args)
        self.attn_add = attn_add

    @staticmethod
    def _add(f: Tensor, h: Tensor, n: int) -> Tensor:
        return f * (1.0 / math.sqrt(n)) + h * math.sqrt((n - 1) / n)

    def forward(self, h_BTD: Tensor, positions_BT: Tensor, cache=None, slots=None, kv_len=None) -> Tensor:
        a = self.self_attn(self.input_layernorm(h_BTD), positions_BT, cache, slots, kv_len)
        h_BTD = self._add(self.post_attention_layernorm(a), h_BTD, self.attn_add)
        return self._add(self.post_mlp_layernorm(self.mlp(self.pre_mlp_layernorm(h_BTD))), h_BTD, self.attn_add + 1)


class _SoftcappedLMHead(nn.Linear):
    """nn.Linear whose logits are c * tanh(logits / c) in fp32 (same parameter and name; may stay tied)."""

    softcap = 30.0

    def forward(self, h: Tensor) -> Tensor:
        c = self.softcap
        return torch.tanh(super().forward(h).float() / c) * c


class BeamForCausalLM(CausalLM):
    """Beam (see the module docstring)."""

    checkpoint_renames = ((".pre_mlp_layernorm.", ".pre_feedforward_layernorm."),
                          (".post_mlp_layernorm.", ".post_feedforward_layernorm."), *DEEPSEEK_RENAMES)
    expert_layout = PerExpert("gate_proj", "up_proj", "down_proj")

    def __init__(self, config: ModelConfig, dtype=None):
        cap = config.raw.get("final_logit_softcapping")
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0):
            raise ValueError(f"config field 'final_logit_softcapping' must be a number > 0 or null, got {cap!r}")
        super().__init__(config, dtype)
        if cap is not None:  # (the same parameter and name: loading and tying are unchanged)
            self.lm_head.__class__ = _SoftcappedLMHead
            self.lm_head.softcap = float(cap)

    def build_norm(self, cfg: ModelConfig, dim: int, dtype) -> RMSNorm:
        return RMSNorm(dim, cfg.rms_norm_eps, weight_in_fp32=True, dtype=dtype)

    def build_rotary(self, cfg: ModelConfig) -> RotaryByLayerType:
        return RotaryByLayerType({kind: RotaryEmbedding(r, int(cfg.head_dim * r.partial_rotary_factor),
                                                        cfg.max_position_embeddings)
                                  for kind, r in cfg.rope_by_layer_type})

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryByLayerType, dtype) -> DepthScaledSandwichLayer:
        D, eps, kind = cfg.hidden_size, cfg.rms_norm_eps, cfg.layer_types[i]
        if kind not in ("full_attention", "sliding_attention"):
            raise ValueError(f"config field 'layer_types' entry {i} must be 'full_attention' or 'sliding_attention' "
                             f"for beam, got {kind!r}")
        attn = BeamAttention(D, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, i,
                             rotary[kind] if cfg.layer_uses_rope(i) else None, bias=cfg.attention_bias, norm_eps=eps,
                             sliding_window=cfg.layer_sliding_window(i), dtype=dtype)
        glu = glu_kind(cfg.hidden_act)
        if cfg.is_moe_layer(i):
            mlp = SparseMoeBlock(cfg, "sigmoid", normalize=cfg.norm_topk_prob, glu=glu, router_groups=True,
                                 route_scale=cfg.routed_scaling_factor, dtype=dtype)
        else:
            if cfg.intermediate_size is None:
                raise ValueError(f"config field 'intermediate_size' is required: layer {i} has a dense MLP")
            mlp = GatedMLP(D, cfg.intermediate_size, glu, dtype=dtype)
        return DepthScaledSandwichLayer(attn, mlp, *(self.build_norm(cfg, D, dtype) for _ in range(4)),
                                        attn_add=2 * (i + 1))
