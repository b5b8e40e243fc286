"""Lara-4-Mini (``model_type: lara_mini``): a hybrid decoder whose ``layer_types`` (by default the released pattern
linear, sliding, linear, full, sliding, repeated) mix

* ``linear_attention`` -- Qwen3.5's Gated DeltaNet (:class:`~dynamoe.models.linear_attention.GatedDeltaNet`: conv +
  delta-rule recurrent state per sequence, no KV cache), its gated output norm multiplying by the weight in fp32;
* ``sliding_attention`` -- Qwen3's GQA (per-head q/k RMSNorms) over a window of ``sliding_window`` keys, with RoPE
  over the whole head;
* ``full_attention`` -- the same without any position encoding (NoPE);

RMSNorms that multiply by their weight in fp32 (not Qwen3-Next's 1 + w); on every layer an MoE: softmax over fp32
router logits, top-k (renormalised when ``norm_topk_prob``), plus an ungated shared SwiGLU expert of
``shared_expert_intermediate_size`` added in full.

Checkpoint: the hub's (and transformers' saved) fused ``linear_attn.in_proj`` [q | k | v | z | b | a rows] is read as
our four projections (``checkpoint_rows``), its ``linear_attn.out_norm`` as ``norm``; checkpoints with the split
names (``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``, ``norm``) load too. ``self_attn.{q,k,v,o}_proj``,
``self_attn.{q,k}_norm``, ``mlp.gate.weight``, ``mlp.experts.gate_up_proj`` [E, 2F, D] / ``down_proj`` [E, D, F],
``mlp.shared_expert.*``.

The model keeps per-sequence recurrent state, so the engine does not share prefixes for it.
"""
from __future__ import annotations

import torch
from torch import nn

from ..ops.fused import Unfusable
from .attention import Attention
from .base import CausalLM, DecoderLayer
from .config import ModelConfig
from .linear_attention import GatedDeltaNet
from .moe_block import SparseMoeBlock, glu_kind
from .norms import RMSNorm
from .qwen3_next import HybridDecoderLayer
from .rope import RotaryEmbedding
from .weights import Stacked

__all__ = ["LaraMiniForCausalLM", "LaraAttention"]

_SPLIT = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


class LaraAttention(Attention):
    """Qwen3's GQA whose q/k norms multiply by their weight in fp32; NoPE where ``rotary`` is None."""

    def __init__(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding | None, dtype=None):
        d, eps = cfg.head_dim, cfg.rms_norm_eps
        super().__init__(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, d, i, rotary,
                         qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, qk_norm=True, norm_eps=eps,
                         sliding_window=cfg.layer_sliding_window(i), use_rope=rotary is not None, dtype=dtype)
        self.q_norm = RMSNorm(d, eps, weight_in_fp32=True, dtype=dtype)
        self.k_norm = RMSNorm(d, eps, weight_in_fp32=True, dtype=dtype)

    def _decode_weights(self, kernels, holds, norm, dtype):
        if dtype != torch.float32:  # (the kernel multiplies q/k by their norms' weights in the step's dtype)
            raise Unfusable("q/k norms that multiply by their weight in fp32, in a step of lower precision")
        return super()._decode_weights(kernels, holds, norm, dtype)


class LaraMiniForCausalLM(CausalLM):
    """Lara-4-Mini (see the module docstring)."""

    #: per-sequence recurrent state (the Gated DeltaNet layers): no prefix reuse (see dynamoe.models.qwen3_next)
    recurrent_state = True
    #: ... but speculative decoding can cut it back past rejected drafts: its layers record their state after every
    #: token of a verification forward (dynamoe.models.cache.KVCache.begin_history)
    recurrent_rollback = True
    checkpoint_renames = ((".mlp.moe.gates.0.wg.", ".mlp.gate."), (".mlp.moe.shared_experts.", ".mlp.shared_expert."),
                          (".mlp.moe.", ".mlp."))
    expert_layout = Stacked("gate_up_proj", "down_proj", suffix="")
    #: chunk length of the prefill's delta rule (any value gives the same result up to rounding)
    chunk_size = 64

    def __init__(self, config: ModelConfig, dtype=None):
        if config.shared_expert_intermediate_size is None:
            raise ValueError("config field 'shared_expert_intermediate_size' is required for lara_mini (an int >= 1)")
        object.__setattr__(self, "fused_in_proj", True)
        super().__init__(config, dtype)
        v = config.linear_num_value_heads
        sizes = (2 * config.linear_num_key_heads * config.linear_key_head_dim + v * config.linear_value_head_dim,
                 v * config.linear_value_head_dim, v, v)
        rows, start = {}, 0
        for name, n in zip(_SPLIT, sizes):
            rows[name], start = (start, start + n), start + n
        object.__setattr__(self, "in_proj_rows", {name: (a, b, start) for name, (a, b) in rows.items()})

    def build_norm(self, cfg: ModelConfig, dim: int, dtype) -> RMSNorm:
        return RMSNorm(dim, cfg.rms_norm_eps, weight_in_fp32=True, dtype=dtype)

    def build_rotary(self, cfg: ModelConfig) -> RotaryEmbedding:
        # (transformers' default RoPE here rotates the whole head, whatever a partial factor says)
        dim = cfg.head_dim if cfg.rope.rope_type == "default" else int(cfg.head_dim * cfg.rope.partial_rotary_factor)
        return RotaryEmbedding(cfg.rope, dim, cfg.max_position_embeddings)

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> nn.Module:
        D, kind = cfg.hidden_size, cfg.layer_types[i]
        mlp = SparseMoeBlock(cfg, "softmax", normalize=cfg.norm_topk_prob, glu=glu_kind(cfg.hidden_act),
                             num_shared_experts=1, shared_hidden_size=cfg.shared_expert_intermediate_size, dtype=dtype)
        norms = (self.build_norm(cfg, D, dtype), self.build_norm(cfg, D, dtype))
        if kind == "linear_attention":
            mixer = GatedDeltaNet(D, cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                  cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim, i, cfg.rms_norm_eps,
                                  projection="split", activation=cfg.hidden_act, chunk_size=self.chunk_size,
                                  checks_position=i == cfg.layer_types.index(kind), dtype=dtype,
                                  norm_weight_in_fp32=True)
            return HybridDecoderLayer(mixer, mlp, *norms)
        if kind not in ("sliding_attention", "full_attention"):
            raise ValueError(f"config field 'layer_types' entry {i} must be 'linear_attention', 'sliding_attention' or "
                             f"'full_attention' for lara_mini, got {kind!r}")
        attn = LaraAttention(cfg, i, rotary if kind == "sliding_attention" else None, dtype=dtype)
        return DecoderLayer(attn, mlp, *norms)

    # ---- checkpoint names: the fused in_proj / out_norm (the hub's, and what transformers saves) or the split ones
    def adapt_to_checkpoint(self, names) -> None:
        object.__setattr__(self, "fused_in_proj", any(n.endswith(".linear_attn.in_proj.weight") for n in names))

    def checkpoint_rows(self, name: str):
        parts = name.split(".")
        if self.fused_in_proj and len(parts) >= 3 and parts[-3] == "linear_attn" and parts[-2] in self.in_proj_rows:
            return self.in_proj_rows[parts[-2]]
        return None

    def checkpoint_name(self, name: str) -> str:
        name = super().checkpoint_name(name)
        if self.fused_in_proj and ".linear_attn." in name:
            for split in _SPLIT:
                name = name.replace(f".linear_attn.{split}.", ".linear_attn.in_proj.")
            name = name.replace(".linear_attn.norm.", ".linear_attn.out_norm.")
        return name
