"""IBM GraniteMoE and GraniteMoE-Shared (``model_type: granitemoe``, ``granitemoeshared``): Mixtral's
architecture with muP multipliers -- the embeddings times ``embedding_multiplier``, every attention and
MoE output times ``residual_multiplier`` before its residual add, the softmax scale
``attention_multiplier`` (instead of head_dim^-1/2), the logits divided by ``logits_scaling``; routing
is top-k on the logits, softmax over the k. GraniteMoE-Shared adds an ungated shared SwiGLU MLP of
``shared_intermediate_size`` (0: none) to every MoE output.

Checkpoint: ``block_sparse_moe.router.layer.weight`` [E, D]; stacked experts
``block_sparse_moe.input_linear.weight`` [E, 2F, D] (gate rows, then up rows) and
``block_sparse_moe.output_linear.weight`` [E, D, F]; ``shared_mlp.input_linear.weight`` [2S, D],
``shared_mlp.output_linear.weight`` [D, S].
"""
from __future__ import annotations

from torch import Tensor, nn

from .attention import Attention
from .base import CausalLM, DecoderLayer
from .config import ModelConfig
from .moe_block import SparseMoeBlock, glu_kind
from .norms import RMSNorm
from .rope import RotaryEmbedding
from .weights import Stacked

__all__ = ["GraniteMoeForCausalLM", "ScaledResidualLayer"]


class ScaledResidualLayer(DecoderLayer):
    """h += m * attn(norm1(h)); h += m * mlp(norm2(h)), m = ``residual_multiplier``."""

    def __init__(self, *args, residual_multiplier: float):
        super().__init__(*args)
        self.residual_multiplier = residual_multiplier

    def forward(self, h_BTD: Tensor, positions_BT: Tensor, cache=None, slots=None, kv_len=None) -> Tensor:
        m = self.residual_multiplier
        h_BTD = h_BTD + m * self.self_attn(self.input_layernorm(h_BTD), positions_BT, cache, slots, kv_len)
        return h_BTD + m * self.mlp(self.post_attention_layernorm(h_BTD))


class _ScaledEmbedding(nn.Embedding):
    """nn.Embedding whose output is multiplied by ``multiplier`` (same parameter, same name)."""

    multiplier = 1.0

    def forward(self, ids: Tensor) -> Tensor:
        return super().forward(ids) * self.multiplier


class _ScaledLMHead(nn.Linear):
    """nn.Linear whose output is divided by ``divisor`` (same parameter, same name; may stay tied)."""

    divisor = 1.0

    def forward(self, h: Tensor) -> Tensor:
        return super().forward(h) / self.divisor


class GraniteMoeForCausalLM(CausalLM):
    checkpoint_renames = ((".mlp.moe.gates.0.wg.", ".block_sparse_moe.router.layer."),
                          (".mlp.moe.shared_experts.gate_up_proj.", ".shared_mlp.input_linear."),
                          (".mlp.moe.shared_experts.down_proj.", ".shared_mlp.output_linear."),
                          (".mlp.moe.experts", ".block_sparse_moe"))
    expert_layout = Stacked("input_linear", "output_linear")

    def __init__(self, config: ModelConfig, dtype=None):
        super().__init__(config, dtype)
        # the multipliers as subclasses of the same modules: names, parameters and tying unchanged
        self.model.embed_tokens.__class__ = _ScaledEmbedding
        self.model.embed_tokens.multiplier = config.embedding_multiplier
        self.lm_head.__class__ = _ScaledLMHead
        self.lm_head.divisor = config.logits_scaling

    def build_attention(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> Attention:
        return Attention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, i, rotary,
                         qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, scale=cfg.attention_multiplier,
                         dtype=dtype)

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> DecoderLayer:
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        attn = self.build_attention(cfg, i, rotary, dtype)
        shared = cfg.shared_expert_intermediate_size if cfg.model_type in ("granitemoeshared", "granitemoe_swa") else None
        mlp = SparseMoeBlock(cfg, "softmax", normalize=True, glu=glu_kind(cfg.hidden_act), num_shared_experts=int(bool(shared)),
                             shared_hidden_size=shared, shared_fused_gate_up=bool(shared), dtype=dtype)
        return ScaledResidualLayer(attn, mlp, RMSNorm(D, eps, dtype=dtype), RMSNorm(D, eps, dtype=dtype),
                                   residual_multiplier=cfg.residual_multiplier)
