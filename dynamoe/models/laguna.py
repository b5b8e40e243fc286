"""Laguna (``model_type: laguna``): GQA decoder layers of two kinds (``layer_types``: 'full_attention', the default
for every layer, and 'sliding_attention' over ``sliding_window`` keys), each kind with its own RoPE (half-split on the
first ``partial_rotary_factor`` of each head; by default base 5e5 on half the head for full layers, 1e4 on all of it
for sliding ones), a query-head count per layer (``num_attention_heads_per_layer``; the KV heads are the same),
per-head q/k RMSNorms before RoPE, and a softplus output gate before ``o_proj``: one gate per head (``gating`` true /
'per-head', ``g_proj`` [H, D]) or per channel (false / 'per-element', [H*d, D]). Layer 0 dense (``mlp_layer_types``), the
others MoE: fp32 sigmoid scores of the router logits (tanh-softcapped at ``moe_router_logit_softcapping`` when > 0),
top-k chosen on the scores plus a selection-only bias, renormalised, times ``moe_routed_scaling_factor``, plus an
ungated shared SwiGLU of ``shared_expert_intermediate_size``.

Checkpoint (the hub's names, which transformers saves): ``self_attn.{q,k,v,o,g}_proj``, ``self_attn.{q,k}_norm``,
``mlp.gate.weight`` [E, D], ``mlp.experts.e_score_correction_bias`` [E], ``mlp.experts.{e}.{gate,up,down}_proj``,
``mlp.shared_expert.*``, dense ``mlp.*_proj``.

Decode: the fused attention kernel runs the softplus gate (per head or per channel); the MoE kernel runs the layers'
routing unless the logits are softcapped (the kernel computes plain logits: such a gate refuses it).
``moe_apply_router_weight_on_input`` (the weights scaling the experts' inputs) is refused, as transformers does.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..moe.gates import LinearGate
from .attention import Attention
from .base import CausalLM, DecoderLayer
from .cache import KVCache
from .config import ModelConfig
from .mimo_v2_flash import RotaryByLayerType
from .moe_block import GatedMLP, SparseMoeBlock, glu_kind
from .norms import RMSNorm
from .rope import RotaryEmbedding
from .weights import PerExpert

__all__ = ["LagunaForCausalLM", "LagunaAttention", "SoftcappedLinearGate"]


def _gate_per_head(gating) -> bool:
    """transformers' rule: true or 'per-head' gates each head, anything else (false, 'per-element') each channel;
    values that are neither a bool nor one of the two strings are refused."""
    if not isinstance(gating, bool) and gating not in ("per-head", "per-element"):
        raise ValueError(f"config field 'gating' must be true / 'per-head' (a softplus gate per head) or false / "
                         f"'per-element' (one per channel), got {gating!r}")
    return gating is True or gating == "per-head"


class LagunaAttention(Attention):
    """GQA with per-head q/k RMSNorms before RoPE and a softplus gate on the output, one per head (``gate_per_head``,
    ``g_proj`` [H, D]) or one per channel ([H*d, D]); window and scale as :class:`Attention`'s."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, layer_idx: int,
                 rotary: RotaryEmbedding, bias: bool = False, norm_eps: float = 1e-6, sliding_window: int | None = None,
                 gate_per_head: bool = True, dtype=None):
        super().__init__(hidden_size, num_heads, num_kv_heads, head_dim, layer_idx, rotary, qkv_bias=bias, o_bias=bias,
                         qk_norm=True, norm_eps=norm_eps, sliding_window=sliding_window, dtype=dtype)
        self.gate_per_head = gate_per_head
        self.g_proj = nn.Linear(hidden_size, num_heads if gate_per_head else num_heads * head_dim, bias=False,
                                dtype=dtype)

    def _decode_gate(self, kernels, holds, dtype):
        return self._gate_weights(kernels, holds, dtype, "g_proj", "softplus")

    def forward(self, x_BTD: Tensor, positions_BT: Tensor, cache: KVCache | None = None, slots: Tensor | None = None,
                kv_len: int | None = None) -> Tensor:
        B, T, _ = x_BTD.shape
        H, d = self.num_heads, self.head_dim
        q, k, v = self.heads(x_BTD, positions_BT)                             # [B, H|K, T, d]
        out = self.attend_cached(q, k, v, positions_BT, cache, slots, kv_len, self.sliding_window)
        out = out.transpose(1, 2)                                              # [B, T, H, d]
        gate = F.softplus(self.g_proj(x_BTD).float()).to(out.dtype)            # (fp32 softplus, as transformers)
        out = out * (gate.unsqueeze(-1) if self.gate_per_head else gate.view(B, T, H, d))
        return self.o_proj(out.reshape(B, T, H * d))


class SoftcappedLinearGate(LinearGate):
    """LinearGate whose logits are tanh-softcapped: c * tanh(logits / c), ``softcap`` c > 0 (Laguna's
    ``moe_router_logit_softcapping``). The fused decode kernels compute plain logits from ``fp32_linear``: this gate
    offers none, so they leave its layer to the general path."""

    softcap = 0.0

    def forward(self, x_TD: Tensor) -> Tensor:
        logits = super().forward(x_TD).float()
        return torch.tanh(logits / self.softcap) * self.softcap

    def fp32_linear(self):
        return None


class LagunaForCausalLM(CausalLM):
    """Laguna (see the module docstring)."""

    checkpoint_renames = ((".mlp.moe.gates.0.wg.", ".mlp.gate."),
                          (".mlp.moe.gates.0.e_score_correction_bias", ".mlp.experts.e_score_correction_bias"),
                          (".mlp.moe.shared_experts.", ".mlp.shared_expert."), (".mlp.moe.", ".mlp."))
    expert_layout = PerExpert("gate_proj", "up_proj", "down_proj")

    def __init__(self, config: ModelConfig, dtype=None):
        raw, n, K = config.raw, config.num_hidden_layers, config.num_key_value_heads
        _gate_per_head(raw.get("gating"))
        if raw.get("moe_apply_router_weight_on_input"):
            raise ValueError("config field 'moe_apply_router_weight_on_input' must be false for laguna (transformers "
                             "does not implement the weights scaling the experts' inputs either)")
        cap = raw.get("moe_router_logit_softcapping")
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap >= 0:
            raise ValueError(f"config field 'moe_router_logit_softcapping' must be a number >= 0 (0: none), got {cap!r}")
        heads = raw.get("num_attention_heads_per_layer")
        heads = [config.num_attention_heads] * n if heads is None else heads
        if (not isinstance(heads, (list, tuple)) or len(heads) != n
                or any(isinstance(h, bool) or not isinstance(h, int) or h < 1 or h % K for h in heads)):
            raise ValueError(f"config field 'num_attention_heads_per_layer' must be null or a list of {n} positive "
                             f"multiples of num_key_value_heads={K}, got {heads!r}")
        object.__setattr__(self, "_heads", tuple(heads))  # (before the layers are built)
        super().__init__(config, dtype)

    def build_rotary(self, cfg: ModelConfig) -> RotaryByLayerType:
        return RotaryByLayerType({kind: RotaryEmbedding(r, int(cfg.head_dim * r.partial_rotary_factor),
                                                        cfg.max_position_embeddings)
                                  for kind, r in cfg.rope_by_layer_type})

    def build_mlp(self, cfg: ModelConfig, i: int, dtype) -> nn.Module:
        glu = glu_kind(cfg.hidden_act)
        if not cfg.is_moe_layer(i):
            if cfg.intermediate_size is None:
                raise ValueError(f"config field 'intermediate_size' is required: layer {i} has a dense MLP")
            return GatedMLP(cfg.hidden_size, cfg.intermediate_size, glu, dtype=dtype)
        if cfg.shared_expert_intermediate_size is None:
            raise ValueError("config field 'shared_expert_intermediate_size' is required for laguna (an int >= 1)")
        block = SparseMoeBlock(cfg, "sigmoid", normalize=True, glu=glu, num_shared_experts=1,
                               shared_hidden_size=cfg.shared_expert_intermediate_size, router_groups=False,
                               route_scale=cfg.routed_scaling_factor, dtype=dtype)
        cap = float(cfg.raw["moe_router_logit_softcapping"])
        if cap > 0:  # (the same parameters and names: loading is unchanged)
            gate = block.moe.gates[0]
            gate.__class__ = SoftcappedLinearGate
            gate.softcap = cap
        return block

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryByLayerType, dtype) -> DecoderLayer:
        D, eps, kind = cfg.hidden_size, cfg.rms_norm_eps, cfg.layer_types[i]
        if kind not in ("full_attention", "sliding_attention"):
            raise ValueError(f"config field 'layer_types' entry {i} must be 'full_attention' or 'sliding_attention' "
                             f"for laguna, got {kind!r}")
        attn = LagunaAttention(D, self._heads[i], cfg.num_key_value_heads, cfg.head_dim, i, rotary[kind],
                               bias=cfg.attention_bias, norm_eps=eps, sliding_window=cfg.layer_sliding_window(i),
                               gate_per_head=_gate_per_head(cfg.raw["gating"]), dtype=dtype)
        return DecoderLayer(attn, self.build_mlp(cfg, i, dtype), RMSNorm(D, eps, dtype=dtype),
                            RMSNorm(D, eps, dtype=dtype))
