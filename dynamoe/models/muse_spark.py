"""Muse Spark's language model, from its multimodal checkpoint (``model_type: muse_spark``; the text model
``muse_spark_text``, on Muse Glimmer's decoder).

Legend: B batch rows, T tokens, D model dim, M the MoE's pooled width, H query heads, d head dim, E experts, k experts
per token.

* Embeddings RMS-normed without a weight; final RMSNorm (weight); logits times ``output_multiplier``, then
  tanh-softcapped at ``final_logit_softcapping``.
* Layers of two kinds (``layer_types``; by default every 4th counted back from the last full attention, the others
  sliding over ``sliding_window`` keys), RoPE over the whole head (one base) except on the layers whose
  ``layer_rope_theta`` is 0 (NoPE; by default the full ones). Attention: q and k RMS-normed without a weight, q times
  ``qk_scale_factor``, softmax scale d^-1/2, the output RMS-normed per head (no weight), times sigmoid(``gate_proj``(x)),
  then ``o_proj``.
* h = g1(h, post_attention_layernorm(attn(input_layernorm(h)))); h = g2(h, post_feedforward_layernorm(ffn(
  pre_feedforward_layernorm(h)))): zero-centred norms (scale 1 + w) before the sublayers, a weightless one after the
  attention and an input-scaled one (x (1 + w), then normed) after the feed-forward; the residual gates g(r, f) =
  alpha r + beta f with beta = sigmoid(gate / ``residual_gate_temperature``), alpha = sqrt(max(sigmoid(-gate / t)
  (1 + beta), 1e-3)), in fp32.
* MoE (``mlp_layer_types`` 'sparse'; dense SwiGLU elsewhere): sigmoid of the fp32 router logits times
  ``output_multiplier``, the top-k by score plus a selection bias, renormalised, times ``routed_scaling_factor``; the
  experts run at width M: ``pre_expert_proj`` [M, D], a zero-centred norm, SwiGLU experts ``experts.gate_up_proj``
  [E, 2F, M] / ``down_proj`` [E, M, F] whose outputs are each normed (``experts.post_expert_norm``, input-scaled)
  before their routing weight, ``post_expert_proj`` [D, M]. (That per-expert norm is why the experts run here, not
  through the MoE layer, whose combine has no such step: no fused kernels and no routing statistics.)

The wrapper keeps the text model under ``model.language_model.``; its vision and audio towers, adapter and projection
are not loaded (the server refuses images naming the model).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import Attention
from .base import CausalLM
from .cache import KVCache
from .config import ModelConfig
from .gemma4 import rms
from .moe_block import GatedMLP, glu_kind
from .norms import RMSNorm
from .rope import RotaryEmbedding, apply_rope
from .wrapped import TextOfWrapper, WrapperLayout

__all__ = ["MuseSparkForCausalLM", "MuseSparkAttention", "MuseSparkMoE", "MuseSparkDecoderLayer"]

_ACT = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


def _number(raw: dict, name: str, positive: bool = True) -> float:
    v = raw.get(name)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (positive and not v > 0):
        raise ValueError(f"config field {name!r} must be a number{' > 0' if positive else ''}, got {v!r}")
    return float(v)


class InputScaledRMSNorm(nn.Module):
    """y = rms_norm(x (1 + w)): the zero-centred weight scales the input (in fp32, rounded to x's dtype), then the
    result is RMS-normed in fp32 (Muse Spark's post-feed-forward and post-expert norms)."""

    def __init__(self, dim: int, eps: float, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        h = (x.float() * (1.0 + self.weight.float())).to(x.dtype).float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class _WeightlessNorm(nn.Module):
    """RMSNorm without a weight (no parameters; eps)."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms(x, self.eps)


class ResidualGate(nn.Module):
    """alpha * residual + beta * f with the fp32 ``gate`` [D] (see the module docstring)."""

    def __init__(self, dim: int, temperature: float):
        super().__init__()
        self.temperature = temperature
        self.gate = nn.Parameter(torch.zeros(dim, dtype=torch.float32))

    def forward(self, residual: Tensor, f: Tensor) -> Tensor:
        w = self.gate.float() / self.temperature
        beta = torch.sigmoid(w)
        alpha = torch.sqrt(torch.clamp(torch.sigmoid(-w) * (1.0 + beta), min=1e-3))
        return (alpha * residual + beta * f).to(residual.dtype)


class MuseSparkAttention(Attention):
    """GQA with weightless q/k norms (q times ``qk_scale``), RoPE unless NoPE (``rotary`` None), a weightless norm on
    each head's output and a sigmoid output gate (``gate_proj``)."""

    def __init__(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding | None, dtype=None):
        D, H, d = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        super().__init__(D, H, cfg.num_key_value_heads, d, i, rotary, qkv_bias=cfg.attention_bias,
                         o_bias=cfg.attention_bias, sliding_window=cfg.layer_sliding_window(i),
                         use_rope=rotary is not None, dtype=dtype)
        self.eps, self.qk_scale = cfg.rms_norm_eps, _number(cfg.raw, "qk_scale_factor")
        self.gate_proj = nn.Linear(D, H * d, bias=False, dtype=dtype)

    def _decode_weights(self, kernels, holds, norm, dtype):
        from ..ops.fused import Unfusable

        raise Unfusable("weightless q/k and output norms and an output gate (the fused kernel has none)")

    def forward(self, x_BTD: Tensor, positions_BT: Tensor, cache: KVCache | None = None, slots: Tensor | None = None,
                kv_len: int | None = None) -> Tensor:
        B, T, _ = x_BTD.shape
        H, K, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self._project_qkv(x_BTD)
        q = rms(q.view(B, T, H, d).transpose(1, 2), self.eps) * self.qk_scale                  # [B, H, T, d]
        k = rms(k.view(B, T, K, d).transpose(1, 2), self.eps)
        v = v.view(B, T, K, d).transpose(1, 2)
        if self.use_rope:
            cos, sin = self.rotary(positions_BT, q.dtype)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.attend_cached(q, k, v, positions_BT, cache, slots, kv_len, self.sliding_window)
        out = rms(out.transpose(1, 2), self.eps).reshape(B, T, H * d) * torch.sigmoid(self.gate_proj(x_BTD))
        return self.o_proj(out)


class _Router(nn.Module):
    """``weight`` [E, D] (fp32) and the selection-only ``e_score_correction_bias`` [E] (fp32)."""

    def __init__(self, num_experts: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))


class _Experts(nn.Module):
    """SwiGLU experts at the pooled width, each output normed before its weight (see the module docstring)."""

    def __init__(self, num_experts: int, width: int, pooled: int, glu: str, eps: float, dtype=None):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(num_experts, 2 * width, pooled, dtype=dtype))
        self.down_proj = nn.Parameter(torch.zeros(num_experts, pooled, width, dtype=dtype))
        self.post_expert_norm = InputScaledRMSNorm(pooled, eps, dtype=dtype)
        self.act = _ACT[glu]

    def forward(self, x_TM: Tensor, ids_TK: Tensor, w_TK: Tensor) -> Tensor:
        out = torch.zeros_like(x_TM)
        flat = ids_TK.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.gate_up_proj.size(0)).tolist()
        tokens = order // ids_TK.size(1)
        start = 0
        for e, n in enumerate(counts):   # the experts that have tokens, each over its tokens
            if not n:
                continue
            sel = order[start:start + n]
            t = tokens[start:start + n]
            start += n
            gate, up = F.linear(x_TM[t], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = self.post_expert_norm(F.linear(self.act(gate) * up, self.down_proj[e]))
            out.index_add_(0, t, (y * w_TK.reshape(-1)[sel, None]).to(out.dtype))
        return out


class MuseSparkMoE(nn.Module):
    """Muse Spark's MoE (see the module docstring): ``gate``, ``pre_expert_proj``, ``pre_expert_norm``, ``experts``,
    ``post_expert_proj``."""

    def __init__(self, cfg: ModelConfig, dtype=None):
        super().__init__()
        D, E = cfg.hidden_size, cfg.num_experts
        M = cfg.raw.get("moe_hidden_size")
        if isinstance(M, bool) or not isinstance(M, int) or M < 1:
            raise ValueError(f"config field 'moe_hidden_size' must be an int >= 1, got {M!r}")
        self.k, self.multiplier = cfg.num_experts_per_tok, _number(cfg.raw, "output_multiplier")
        self.scale = cfg.routed_scaling_factor
        self.gate = _Router(E, D)
        self.pre_expert_proj = nn.Linear(D, M, bias=False, dtype=dtype)
        self.pre_expert_norm = RMSNorm(M, cfg.rms_norm_eps, zero_centered=True, dtype=dtype)
        self.experts = _Experts(E, cfg.expert_hidden_size, M, glu_kind(cfg.hidden_act),
                                _number(cfg.raw, "post_norm_eps"), dtype=dtype)
        self.post_expert_proj = nn.Linear(M, D, bias=False, dtype=dtype)

    def forward(self, x_BTD: Tensor) -> Tensor:
        x_TD = x_BTD.reshape(-1, x_BTD.size(-1))
        scores = torch.sigmoid(F.linear(x_TD.float(), self.gate.weight.float()) * self.multiplier)   # fp32 [T, E]
        ids_TK = (scores + self.gate.e_score_correction_bias).topk(self.k, dim=-1, sorted=False).indices
        w = scores.gather(1, ids_TK)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-15) * self.scale
        h = self.pre_expert_norm(self.pre_expert_proj(x_TD))
        return self.post_expert_proj(self.experts(h, ids_TK, w)).view(x_BTD.shape)


class MuseSparkDecoderLayer(nn.Module):
    """One Muse Spark layer (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, self_attn: MuseSparkAttention, mlp: nn.Module, dtype=None):
        super().__init__()
        D, eps, post = cfg.hidden_size, cfg.rms_norm_eps, _number(cfg.raw, "post_norm_eps")
        temperature = _number(cfg.raw, "residual_gate_temperature")
        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm = RMSNorm(D, eps, zero_centered=True, dtype=dtype)
        self.post_attention_layernorm = _WeightlessNorm(post)
        self.pre_feedforward_layernorm = RMSNorm(D, eps, zero_centered=True, dtype=dtype)
        self.post_feedforward_layernorm = InputScaledRMSNorm(D, post, dtype=dtype)
        self.post_attention_residual_gate = ResidualGate(D, temperature)
        self.post_feedforward_residual_gate = ResidualGate(D, temperature)

    def forward(self, h_BTD: Tensor, positions_BT: Tensor, cache=None, slots=None, kv_len=None) -> Tensor:
        a = self.self_attn(self.input_layernorm(h_BTD), positions_BT, cache, slots, kv_len)
        h_BTD = self.post_attention_residual_gate(h_BTD, self.post_attention_layernorm(a))
        m = self.mlp(self.pre_feedforward_layernorm(h_BTD))
        return self.post_feedforward_residual_gate(h_BTD, self.post_feedforward_layernorm(m))


class _NormedEmbedding(nn.Embedding):
    """nn.Embedding followed by a weightless RMSNorm of eps ``eps``."""

    eps = 1e-6

    def forward(self, ids: Tensor) -> Tensor:
        return rms(super().forward(ids), self.eps)


class _MuseHead(nn.Linear):
    """nn.Linear whose logits are cap * tanh(logits * multiplier / cap)."""

    multiplier, cap = 1.0, 1.0

    def forward(self, h: Tensor) -> Tensor:
        return torch.tanh(super().forward(h) * self.multiplier / self.cap) * self.cap


class MuseSparkForCausalLM(TextOfWrapper, CausalLM):
    """Muse Spark's language model (see the module docstring); from a ``muse_spark`` checkpoint, text only."""

    checkpoint_renames = ()
    wrapper_layouts = {"muse_spark": WrapperLayout("model.language_model.", "", unused=(
        "model.vision_tower.", "model.audio_tower.", "model.vision_adapter.", "model.vision_projection.",
        "model.audio_adapter.", "model.audio_projection."))}
    text_only_reason = "its vision and audio towers are not loaded (dynamoe serves the Muse Spark text model only)"
    use_decode_plan = False   # (the layers are this module's own: no fused kernels to lay out)

    def __init__(self, config: ModelConfig, dtype=None):
        cap = _number(config.raw, "final_logit_softcapping")
        multiplier = _number(config.raw, "output_multiplier")
        super().__init__(config, dtype)
        emb = self.model.embed_tokens
        emb.__class__, emb.eps = _NormedEmbedding, config.rms_norm_eps
        self.lm_head.__class__ = _MuseHead
        self.lm_head.multiplier, self.lm_head.cap = multiplier, cap

    def build_norm(self, cfg: ModelConfig, dim: int, dtype) -> RMSNorm:
        return RMSNorm(dim, cfg.rms_norm_eps, weight_in_fp32=True, dtype=dtype)

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> MuseSparkDecoderLayer:
        kind = cfg.layer_types[i]
        if kind not in ("full_attention", "sliding_attention"):
            raise ValueError(f"config field 'layer_types' entry {i} must be 'full_attention' or 'sliding_attention' "
                             f"for muse_spark_text, got {kind!r}")
        attn = MuseSparkAttention(cfg, i, rotary if cfg.layer_uses_rope(i) else None, dtype=dtype)
        if cfg.is_moe_layer(i):
            mlp = MuseSparkMoE(cfg, dtype=dtype)
        else:
            if cfg.intermediate_size is None:
                raise ValueError(f"config field 'intermediate_size' is required: layer {i} has a dense MLP")
            mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, glu_kind(cfg.hidden_act), dtype=dtype)
        return MuseSparkDecoderLayer(cfg, attn, mlp, dtype=dtype)
