"""Rhymes Aria's language model (``model_type: aria_text``; the text model of the ``aria`` vision-language
wrapper, ``AriaForConditionalGeneration``): Llama's GQA (biases on q/k/v/o when ``attention_bias``, RoPE over the whole
head), and an MoE on every layer: top-k of the router logits weighted by a softmax over the k (``moe_topk`` of
``moe_num_experts``), SwiGLU experts of ``intermediate_size``, plus a shared SwiGLU of ``moe_num_shared_experts`` x
``intermediate_size`` (biases on it when ``mlp_bias``; the routed experts have none) added in full.

Checkpoint (the hub's names, which transformers saves): ``mlp.router.weight`` [E, D], ``mlp.experts.fc1.weight``
[E, D, 2F] (stored in->out: gate columns, then up columns) and ``mlp.experts.fc2.weight`` [E, F, D],
``mlp.shared_experts.{gate,up,down}_proj``. The wrapper keeps the text model under ``language_model.model.`` and
``language_model.lm_head``; its vision tower (``vision_tower.*``) and projector (``multi_modal_projector.*``) are not
loaded (a request with an image is refused by the server).
"""
from __future__ import annotations

from .attention import Attention
from .base import CausalLM, DecoderLayer
from .config import ModelConfig
from .moe_block import SparseMoeBlock, glu_kind
from .norms import RMSNorm
from .rope import RotaryEmbedding
from .weights import FusedGateUp
from .wrapped import TextOfWrapper, WrapperLayout

__all__ = ["AriaTextForCausalLM"]


class AriaTextForCausalLM(TextOfWrapper, CausalLM):
    """Aria's text model (see the module docstring); from an ``aria`` checkpoint, text only."""

    checkpoint_renames = ((".mlp.moe.gates.0.wg.", ".mlp.router."), (".mlp.moe.", ".mlp."))
    expert_layout = FusedGateUp("fc1.weight", "fc2.weight", in_out=True)
    wrapper_layouts = {"aria": WrapperLayout("language_model.model.", "language_model.",
                                             unused=("vision_tower.", "multi_modal_projector."))}
    text_only_reason = "its vision tower is not loaded (dynamoe serves the Aria text model only)"

    def __init__(self, config: ModelConfig, dtype=None):
        bias = config.raw.get("mlp_bias")
        if not isinstance(bias, bool):
            raise ValueError(f"config field 'mlp_bias' must be true or false, got {bias!r}")
        super().__init__(config, dtype)

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> DecoderLayer:
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        if cfg.intermediate_size is None:
            raise ValueError("config field 'intermediate_size' (the experts' width) is required for aria_text")
        attn = Attention(D, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, i, rotary,
                         qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, dtype=dtype)
        # (softmax over the top-k logits = the softmax over all renormalised over the k)
        mlp = SparseMoeBlock(cfg, "softmax", normalize=True, glu=glu_kind(cfg.hidden_act),
                             num_shared_experts=cfg.n_shared_experts, shared_bias=cfg.raw["mlp_bias"], dtype=dtype)
        return DecoderLayer(attn, mlp, RMSNorm(D, eps, dtype=dtype), RMSNorm(D, eps, dtype=dtype))
