"""GraniteMoE-SWA (``model_type: granitemoe_swa``): GraniteMoE-Shared (:mod:`dynamoe.models.granitemoe`: muP
multipliers, top-k-then-softmax routing, an optional ungated shared MLP) whose attention has a learned
per-head sink on every layer (transformers scales the output by sigmoid(logsumexp(scores) - sink), the
same as GPT-OSS's extra softmax logit), a sliding window on the ``layer_types`` 'sliding_attention'
layers (default: all but every 4th from layer 0) and its own RoPE base per layer (``layer_rope_theta``;
0: no position encoding in that layer; default: ``rope_theta`` everywhere).

Checkpoint (transformers' names; it has no conversion for this family): ``self_attn.sinks``,
``block_sparse_moe.router.weight`` [E, D], ``block_sparse_moe.experts.gate_up_proj`` [E, 2F, D] (gate rows,
then up rows), ``block_sparse_moe.experts.down_proj`` [E, D, F], ``shared_mlp.input_linear`` /
``output_linear``.
"""
from __future__ import annotations

import dataclasses

from torch import nn

from .attention import Attention
from .config import ModelConfig
from .granitemoe import GraniteMoeForCausalLM
from .rope import RotaryEmbedding
from .weights import Stacked

__all__ = ["GraniteMoeSWAForCausalLM", "RotaryByTheta"]


def layer_thetas(cfg: ModelConfig) -> list:
    """Each layer's RoPE base (0: NoPE): ``layer_rope_theta``, or the config's base everywhere."""
    thetas = cfg.raw.get("layer_rope_theta")
    if thetas is None:
        return [cfg.rope.theta] * cfg.num_hidden_layers
    if (not isinstance(thetas, (list, tuple)) or len(thetas) != cfg.num_hidden_layers
            or any(isinstance(t, bool) or not isinstance(t, (int, float)) or t < 0 for t in thetas)):
        raise ValueError(f"config field 'layer_rope_theta' must be a list of {cfg.num_hidden_layers} numbers >= 0 "
                         f"(0: no RoPE in that layer), got {thetas!r}")
    return [float(t) for t in thetas]


class RotaryByTheta(nn.Module):
    """One :class:`RotaryEmbedding` per distinct non-zero RoPE base of the layers (the model's ``rotary_emb``);
    ``self.get(theta)``."""

    def __init__(self, cfg: ModelConfig, thetas: list):
        super().__init__()
        self.thetas = sorted({t for t in thetas if t})
        dim = int(cfg.head_dim * cfg.rope.partial_rotary_factor)
        self.tables = nn.ModuleList(RotaryEmbedding(dataclasses.replace(cfg.rope, theta=t), dim,
                                                    cfg.max_position_embeddings) for t in self.thetas)

    def get(self, theta: float) -> RotaryEmbedding:
        return self.tables[self.thetas.index(theta)]


class GraniteMoeSWAForCausalLM(GraniteMoeForCausalLM):
    """GraniteMoE-SWA (see the module docstring)."""

    checkpoint_renames = ((".mlp.moe.gates.0.wg.", ".block_sparse_moe.router."),
                          (".mlp.moe.shared_experts.gate_up_proj.", ".shared_mlp.input_linear."),
                          (".mlp.moe.shared_experts.down_proj.", ".shared_mlp.output_linear."),
                          (".mlp.moe.experts", ".block_sparse_moe.experts"))
    expert_layout = Stacked("gate_up_proj", "down_proj", suffix="")

    def build_rotary(self, cfg: ModelConfig) -> RotaryByTheta:
        return RotaryByTheta(cfg, layer_thetas(cfg))

    def build_attention(self, cfg: ModelConfig, i: int, rotary: RotaryByTheta, dtype) -> Attention:
        theta = layer_thetas(cfg)[i]
        return Attention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, i,
                         rotary.get(theta) if theta else None, qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias,
                         scale=cfg.attention_multiplier, sinks=True, sliding_window=cfg.layer_sliding_window(i),
                         use_rope=bool(theta), dtype=dtype)
