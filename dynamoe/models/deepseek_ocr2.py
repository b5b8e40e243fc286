"""DeepSeek-OCR-2's language model, from its multimodal checkpoint (``model_type: deepseek_ocr2``; the text model
``deepseek_ocr2_text``): DeepSeek-V2's MoE decoder under Llama attention -- GQA with RoPE over the whole head
(half-split), no MLA --; dense SwiGLU MLPs or MoE layers by ``mlp_layer_types``: softmax routing in fp32,
``topk_method`` 'greedy' or 'group_limited_greedy', the chosen probabilities times ``routed_scaling_factor`` (not
renormalised), plus ``n_shared_experts`` shared experts (one MLP of n x ``moe_intermediate_size``).

Checkpoint (what transformers saves, the hub's layout): ``model.embed_tokens``, ``model.layers.{i}.self_attn.{q,k,v,o}_proj``,
``mlp.gate.weight`` [E, D], ``mlp.experts.{e}.{gate,up,down}_proj``, ``mlp.shared_experts.*``, ``model.norm``,
``lm_head``; the vision encoders (``model.sam_model.*``, ``model.qwen2_model.*``), the projector and the view
separator are not loaded (the server refuses images naming the model).
"""
from __future__ import annotations

from .attention import Attention
from .base import CausalLM, DecoderLayer
from .config import ModelConfig
from .deepseek_v2 import TOPK_METHODS
from .moe_block import GatedMLP, SparseMoeBlock, glu_kind
from .norms import RMSNorm
from .rope import RotaryEmbedding
from .weights import PerExpert
from .wrapped import TextOfWrapper, WrapperLayout

__all__ = ["DeepseekOcr2ForCausalLM"]


class DeepseekOcr2ForCausalLM(TextOfWrapper, CausalLM):
    """DeepSeek-OCR-2's text model (see the module docstring)."""

    checkpoint_renames = ((".mlp.moe.gates.0.wg.", ".mlp.gate."), (".mlp.moe.", ".mlp."))
    expert_layout = PerExpert("gate_proj", "up_proj", "down_proj")
    wrapper_layouts = {"deepseek_ocr2": WrapperLayout("model.", "", unused=(
        "model.sam_model.", "model.qwen2_model.", "model.projector.", "model.view_seperator", "model.image_newline"))}
    text_only_reason = "its vision encoders are not loaded (dynamoe serves the DeepSeek-OCR-2 text model only)"

    #: the text model's model_type (in error messages)
    text_type = "deepseek_ocr2_text"
    #: whether 'group_limited_greedy' needs n_group and topk_group in the file (DeepseekOcr2TextConfig's are null)
    group_fields_required = True

    def __init__(self, config: ModelConfig, dtype=None):
        self.check_config(config)
        super().__init__(config, dtype)

    def check_config(self, config: ModelConfig) -> None:
        """ValueError naming the field where the config asks for what the model cannot run."""
        t = self.text_type
        if config.num_experts and not config.mlp_layer_types:
            raise ValueError(f"config field 'mlp_layer_types' is required for {t} (which layers are "
                             "'dense' and which 'sparse': its model has no other rule)")
        if config.num_experts and not config.num_experts_per_tok:
            raise ValueError(f"config field 'num_experts_per_tok' is required for {t} (no default)")
        if config.topk_method not in TOPK_METHODS:
            raise ValueError(f"config field 'topk_method' must be one of {list(TOPK_METHODS)}, got {config.topk_method!r}")
        if (self.group_fields_required and config.topk_method == "group_limited_greedy"
                and (config.raw.get("n_group") is None or config.raw.get("topk_group") is None)):
            raise ValueError("config fields 'n_group' and 'topk_group' are required with topk_method "
                             "'group_limited_greedy'")
        if config.raw.get("mlp_bias"):
            raise ValueError(f"config field 'mlp_bias' must be false for {t} (biased MLPs are not "
                             "supported; the published checkpoints have none)")

    def build_attention(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> Attention:
        """Layer i's attention: Llama's GQA, RoPE over the whole head (extension point: Unlimited-OCR's)."""
        return Attention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, i, rotary,
                         qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, dtype=dtype)

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> DecoderLayer:
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        attn = self.build_attention(cfg, i, rotary, dtype)
        glu = glu_kind(cfg.hidden_act)
        if cfg.is_moe_layer(i):
            mlp = SparseMoeBlock(cfg, "softmax", normalize=False, glu=glu, num_shared_experts=cfg.n_shared_experts,
                                 router_groups=cfg.topk_method == "group_limited_greedy",
                                 route_scale=cfg.routed_scaling_factor, dtype=dtype)
        else:
            if cfg.intermediate_size is None:
                raise ValueError(f"config field 'intermediate_size' is required: layer {i} has a dense MLP")
            mlp = GatedMLP(D, cfg.intermediate_size, glu, dtype=dtype)
        return DecoderLayer(attn, mlp, RMSNorm(D, eps, dtype=dtype), RMSNorm(D, eps, dtype=dtype))
