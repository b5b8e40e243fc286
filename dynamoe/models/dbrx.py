"""DBRX (``model_type: dbrx``): GQA from one fused ``Wqkv`` projection clamped to [-clip_qkv, clip_qkv],
half-split RoPE, no biases; LayerNorms without bias (pre-norm, and the final one); every layer sparse:
softmax top-k routing whose chosen weights are divided by their p-norm (``moe_normalize_expert_weights``:
1 = renormalised, null = raw), GLU experts (``ffn_act_fn``, SwiGLU by default). Sizes and options sit in
DbrxConfig's own names (``d_model``, ``n_heads``, ``n_layers``, ``max_seq_len``) and its ``attn_config`` /
``ffn_config`` (parsed as top-level fields, see dynamoe.models.config). A hub config's
``attn_config.rope_theta`` (500000 for DBRX) is the RoPE base when there is no top-level one -- where
transformers 5.24 ignores it (10000) -- and ``clip_qkv`` may be null (transformers needs one).

Checkpoint: ``transformer.wte``, ``transformer.blocks.{i}.norm_attn_norm.{norm_1, attn.Wqkv, attn.out_proj,
norm_2}``, ``transformer.blocks.{i}.ffn.router.layer.weight`` [E, D], experts
``transformer.blocks.{i}.ffn.experts.mlp.w1`` / ``v1`` / ``w2`` [E*F, D] (see weights.RowStacked),
``transformer.norm_f``, ``lm_head``.
"""
from __future__ import annotations

from torch import Tensor, nn

from .attention import Attention
from .base import CausalLM, DecoderLayer
from .config import ModelConfig
from .moe_block import SparseMoeBlock, glu_kind
from .rope import RotaryEmbedding
from .weights import RowStacked

__all__ = ["DbrxForCausalLM", "DbrxAttention"]


class DbrxAttention(Attention):
    """:class:`Attention` whose q, k and v come from one ``Wqkv`` linear [(H + 2K) d, D] (DBRX's tensor)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *args, dtype=None, **kw):
        super().__init__(hidden_size, num_heads, num_kv_heads, head_dim, *args, dtype=dtype, **kw)
        del self.q_proj, self.k_proj, self.v_proj
        self.Wqkv = nn.Linear(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias=False, dtype=dtype)

    def fuse_qkv_(self) -> bool:
        return False  # (already one matmul)

    def _project_qkv(self, x_BTD: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        nq, nk = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return self.Wqkv(x_BTD).split([nq, nk, nk], dim=-1)


def _ffn(cfg: ModelConfig) -> dict:
    ffn = cfg.raw.get("ffn_config") or {}
    if not isinstance(ffn, dict):
        raise ValueError(f"config field 'ffn_config' must be a dict, got {ffn!r}")
    return ffn


class DbrxForCausalLM(CausalLM):
    checkpoint_renames = ((".input_layernorm.", ".norm_attn_norm.norm_1."),
                          (".post_attention_layernorm.", ".norm_attn_norm.norm_2."),
                          (".self_attn.o_proj.", ".norm_attn_norm.attn.out_proj."), (".self_attn.", ".norm_attn_norm.attn."),
                          (".mlp.moe.gates.0.wg.", ".ffn.router.layer."), (".mlp.moe.experts", ".ffn.experts.mlp"),
                          ("model.embed_tokens.", "transformer.wte."), ("model.norm.", "transformer.norm_f."))
    expert_layout = RowStacked("w1", "v1", "w2")

    def __init__(self, config: ModelConfig, dtype=None):
        p = _ffn(config).get("moe_normalize_expert_weights", 1.0)
        if p not in (None, 1, 1.0):
            raise ValueError(f"config field 'ffn_config.moe_normalize_expert_weights' must be 1 (renormalise) or null "
                             f"(raw weights) for dbrx, got {p!r}")
        super().__init__(config, dtype)

    def checkpoint_name(self, name: str) -> str:
        name = super().checkpoint_name(name)  # the infix (first matching rename), then the blocks' prefix
        return "transformer.blocks." + name[len("model.layers."):] if name.startswith("model.layers.") else name

    def build_norm(self, cfg: ModelConfig, dim: int, dtype) -> nn.Module:
        return nn.LayerNorm(dim, eps=1e-5, bias=False, dtype=dtype)  # (DBRX's norms use LayerNorm's default eps)

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> DecoderLayer:
        D = cfg.hidden_size
        attn = DbrxAttention(D, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, i, rotary,
                             clip_qkv=cfg.clip_qkv, dtype=dtype)
        ffn = _ffn(cfg)
        act = (ffn.get("ffn_act_fn") or {}).get("name", "silu")
        mlp = SparseMoeBlock(cfg, "softmax", normalize=ffn.get("moe_normalize_expert_weights", 1.0) is not None,
                             glu=glu_kind(act), dtype=dtype)
        return DecoderLayer(attn, mlp, self.build_norm(cfg, D, dtype), self.build_norm(cfg, D, dtype))
