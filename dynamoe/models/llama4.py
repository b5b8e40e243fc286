"""Llama 4 (Scout, Maverick): the text model (``model_type: llama4_text``, ``Llama4ForCausalLM``) and the text
tower of the vision wrapper (``llama4``, ``Llama4ForConditionalGeneration``).

Legend: B batch rows, T new tokens, L keys, H query heads, K key/value heads, d head dim, D model dim.

Attention: GQA of two kinds by layer (``no_rope_layers``: 1 = RoPE, by default all but every 4th layer):

* RoPE layers rotate q and k by adjacent pairs (transformers' complex RoPE: ``rope_interleave``), with
  ``rope_parameters`` as given (the hub's 'llama3' scaling), then, with ``use_qk_norm``, L2-normalise each head
  (an RMSNorm without weight, eps ``rms_norm_eps``); their ``layer_types`` entry is 'chunked_attention': a query
  at position p sees the keys of its own chunk of ``attention_chunk_size`` positions only (p // C == j // C,
  j <= p), an exact mask over the cached keys (:func:`dynamoe.models.attention.attend`'s ``chunk``);
* NoPE layers (no rotation, no q/k norm) attend to every earlier key and, with ``attn_temperature_tuning``,
  scale their queries by 1 + ``attn_scale`` * ln(1 + floor((p + 1) / ``floor_scale``)) (temperature tuning).

Feed-forward: on ``moe_layers`` (by default every ``interleave_moe_layer_step``-th layer) a router (logits
x W^T, top-k of them, each chosen expert weighted by the sigmoid of its logit, no renormalisation) whose
weight scales the expert's *input*, expert(w * x) -- an MoE layer with ``is_postscore=False`` -- plus an
ungated shared expert; elsewhere a dense SwiGLU MLP of ``intermediate_size_mlp``.

Checkpoint (transformers' names, no conversion): ``self_attn.{q,k,v,o}_proj``; ``feed_forward.router.weight``
[E, D], ``feed_forward.experts.gate_up_proj`` [E, D, 2F] (in->out, gate columns then up columns) and
``feed_forward.experts.down_proj`` [E, F, D], ``feed_forward.shared_expert.{gate,up,down}_proj``; dense
``feed_forward.{gate,up,down}_proj``. The wrapper keeps the text model under ``language_model.`` (``model.*``
and ``lm_head``) and the vision tower under ``vision_model.`` and ``multi_modal_projector.`` (not loaded; a
request with an image is refused by the server).

No fused attention or MoE-layer kernel: the attention kernel has no chunked mask, L2 norm after RoPE or
temperature tuning, and the MoE layer kernel scales the experts' outputs (MoELayer refuses it for input-scaled
experts); a decode step routes in torch and runs its experts in the experts' kernel on rows prescaled by their
weights (MoELayer._prescaled_decode); the dense MLP layers keep their kernel.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..ops.fused import Unfusable
from .attention import Attention
from .base import CausalLM, DecoderLayer
from .cache import KVCache
from .config import ModelConfig
from .moe_block import GatedMLP, SparseMoeBlock, glu_kind
from .norms import RMSNorm
from .rope import RotaryEmbedding, apply_rope
from .weights import FusedGateUp
from .wrapped import TextOfWrapper, WrapperLayout

__all__ = ["Llama4ForCausalLM", "Llama4Attention", "l2_norm", "temperature_scales"]


def l2_norm(x: Tensor, eps: float) -> Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dim in fp32, cast back (Llama-4's weightless q/k norm)."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def temperature_scales(positions_BT: Tensor, floor_scale: float, attn_scale: float) -> Tensor:
    """fp32 [B, T]: 1 + attn_scale * ln(1 + floor((p + 1) / floor_scale)) (Llama-4's NoPE temperature tuning)."""
    return torch.log1p(torch.floor((positions_BT.float() + 1.0) / floor_scale)) * attn_scale + 1.0


class Llama4Attention(Attention):
    """GQA with Llama-4's per-layer options (see the module docstring): ``use_rope`` (interleaved pairs),
    ``l2_qk_norm`` (L2 q/k norm after RoPE, eps ``norm_eps``), ``chunk`` (chunked local attention) and
    ``temperature`` ((floor_scale, attn_scale) for NoPE layers, or None)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, layer_idx: int,
                 rotary: RotaryEmbedding | None, use_rope: bool = True, l2_qk_norm: bool = False, norm_eps: float = 1e-5,
                 chunk: int | None = None, temperature: tuple | None = None, bias: bool = False, dtype=None):
        super().__init__(hidden_size, num_heads, num_kv_heads, head_dim, layer_idx, rotary, qkv_bias=bias, o_bias=bias,
                         norm_eps=norm_eps, rope_interleaved=True, use_rope=use_rope, dtype=dtype)
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"chunk must be an int >= 1 or None, got {chunk!r}")
        self.l2_qk_norm, self.norm_eps, self.chunk, self.temperature = l2_qk_norm, norm_eps, chunk, temperature

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", rope={self.use_rope}, l2_qk_norm={self.l2_qk_norm}, chunk={self.chunk}"
                + (f", temperature={self.temperature}" if self.temperature else ""))

    def _decode_weights(self, kernels, holds, norm, dtype):
        raise Unfusable("Llama-4 attention (chunked local attention, L2 q/k norm after RoPE, NoPE temperature tuning: "
                        "the fused kernel has none of them)")

    def forward(self, x_BTD: Tensor, positions_BT: Tensor, cache: KVCache | None = None, slots: Tensor | None = None,
                kv_len: int | None = None) -> Tensor:
        B, T, _ = x_BTD.shape
        H, K, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self._project_qkv(x_BTD)
        q = q.reshape(B, T, H, d).transpose(1, 2)                              # [B, H, T, d]
        k = k.reshape(B, T, K, d).transpose(1, 2)                              # [B, K, T, d]
        v = v.reshape(B, T, K, d).transpose(1, 2)
        if self.use_rope:  # in fp32, as transformers' complex product (the rotated dims come out half-split:
            cos, sin = self.rotary(positions_BT, torch.float32)  # q and k alike, so q.k and the L2 norms are unchanged)
            q = apply_rope(q.float(), cos, sin, interleaved=True).to(q.dtype)
            k = apply_rope(k.float(), cos, sin, interleaved=True).to(k.dtype)
        if self.l2_qk_norm:
            q, k = l2_norm(q, self.norm_eps), l2_norm(k, self.norm_eps)
        if self.temperature is not None:
            scales = temperature_scales(positions_BT, *self.temperature)       # [B, T]
            q = (q * scales[:, None, :, None]).to(q.dtype)
        out = self.attend_cached(q, k, v, positions_BT, cache, slots, kv_len, chunk=self.chunk)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, H * d))


class Llama4ForCausalLM(TextOfWrapper, CausalLM):
    """Llama 4's text model (see the module docstring)."""

    checkpoint_renames = ((".mlp.moe.gates.0.wg.", ".feed_forward.router."),
                          (".mlp.moe.shared_experts.", ".feed_forward.shared_expert."),
                          (".mlp.moe.experts", ".feed_forward.experts"), (".mlp.", ".feed_forward."))
    expert_layout = FusedGateUp("gate_up_proj", "down_proj", in_out=True)
    wrapper_layouts = {"llama4": WrapperLayout("language_model.model.", head="language_model.",
                                               unused=("vision_model.", "multi_modal_projector."))}
    text_only_reason = "its vision tower is not loaded (dynamoe serves the Llama-4 text model only)"

    def build_norm(self, cfg: ModelConfig, dim: int, dtype) -> RMSNorm:
        return RMSNorm(dim, cfg.rms_norm_eps, dtype=dtype)

    def build_mlp(self, cfg: ModelConfig, i: int, dtype):
        glu = glu_kind(cfg.hidden_act)
        if not cfg.is_moe_layer(i):
            if cfg.intermediate_size_mlp is None:
                raise ValueError(f"config field 'intermediate_size_mlp' is required: layer {i} has a dense MLP")
            return GatedMLP(cfg.hidden_size, cfg.intermediate_size_mlp, glu, dtype=dtype)
        if cfg.intermediate_size is None:
            raise ValueError("config field 'intermediate_size' is required for llama4 (the experts' width)")
        block = SparseMoeBlock(cfg, "sigmoid", normalize=False, glu=glu, router_groups=False, route_scale=1.0,
                               num_shared_experts=1, shared_hidden_size=cfg.intermediate_size, prescale=True,
                               dtype=dtype)
        block.moe.gates[0].e_score_correction_bias = None  # (the sigmoid gate's selection bias: Llama-4 has none)
        return block

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> DecoderLayer:
        D = cfg.hidden_size
        rope = cfg.layer_uses_rope(i)
        tuned = cfg.attn_temperature_tuning and not rope
        if tuned and (cfg.floor_scale is None or cfg.attn_scale is None):
            raise ValueError("config fields 'floor_scale' and 'attn_scale' are required with attn_temperature_tuning")
        attn = Llama4Attention(D, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, i, rotary,
                               use_rope=rope, l2_qk_norm=cfg.use_qk_norm and rope, norm_eps=cfg.rms_norm_eps,
                               chunk=cfg.layer_attention_chunk(i), bias=cfg.attention_bias,
                               temperature=(cfg.floor_scale, cfg.attn_scale) if tuned else None, dtype=dtype)
        return DecoderLayer(attn, self.build_mlp(cfg, i, dtype), self.build_norm(cfg, D, dtype),
                            self.build_norm(cfg, D, dtype))
