"""Kimi-Linear (``model_type: kimi_linear``): a hybrid decoder whose ``layer_types`` mix

* ``linear_attention`` -- Kimi Delta Attention (:class:`~dynamoe.models.kda.KimiDeltaAttention`): the
  gated delta rule with per-channel decay, short convolutions on q/k/v, a sigmoid-gated output norm;
  a conv window and a recurrent state per sequence, no KV cache;
* ``full_attention`` -- DeepSeek's Multi-head Latent Attention (:class:`~dynamoe.models.mla.MLAttention`)
  with no position encoding at all (NoPE: the qk_rope_head_dim part is not rotated), softmax scale
  (qk_nope + qk_rope)^-1/2;

with plain RMSNorms, dense SwiGLU MLPs where ``mlp_layer_types`` says 'dense' (default: the first
``first_k_dense_replace`` = 1) and DeepSeek-V3's MoE elsewhere: sigmoid scores, selection-only
``e_score_correction_bias``, group-limited top-k, renormalised (``moe_renormalize``), times
``routed_scaling_factor`` (2.446), plus shared experts. No multi-token prediction.

The hub's config.json uses its own names (``num_experts_per_token``, ``moe_renormalize``,
``num_expert_group``, ``num_shared_experts``, ``model_max_length``) and nests the KDA sizes in
``linear_attn_config`` (``head_dim``, ``num_heads``, ``short_conv_kernel_size``, and 1-based
``full_attn_layers`` / ``kda_layers``), as transformers' KimiLinearConfig reads them
(:mod:`dynamoe.models.config`).

Checkpoint (the hub's layout, which transformers also saves): ``self_attn.{q_proj, k_proj, v_proj,
q_conv1d, k_conv1d, v_conv1d, f_a_proj, f_b_proj, dt_bias, A_log [1, 1, H, 1], b_proj, g_a_proj,
g_b_proj, o_norm, o_proj}`` or MLA's ``self_attn.{q_proj | q_a_proj..., kv_a_proj_with_mqa, kv_a_layernorm,
kv_b_proj, o_proj}``; MoE layers under ``block_sparse_moe.`` (``gate.weight``, ``gate.e_score_correction_bias``,
``experts.{e}.w1|w3|w2`` = gate / up / down, ``shared_experts.*``); dense layers under ``mlp.`` (the hub)
or ``block_sparse_moe.`` (transformers' save_pretrained), whichever the checkpoint has.
"""
from __future__ import annotations

import re

from .base import CausalLM, DecoderLayer
from .config import ModelConfig
from .deepseek_v3 import DEEPSEEK_RENAMES, deepseek_mlp
from .kda import KimiDeltaAttention
from .mla import MLAttention
from .norms import RMSNorm
from .weights import PerExpert

__all__ = ["KimiLinearForCausalLM"]

_LAYER_MLP = re.compile(r"model\.layers\.(\d+)\.mlp\.")
_MOE_PREFIX = "block_sparse_moe"


class KimiLinearForCausalLM(CausalLM):
    """Kimi-Linear (see the module docstring)."""

    #: per-sequence recurrent state (the KDA layers): no prefix reuse, see dynamoe.models.linear_attention
    recurrent_state = True
    #: ... but speculative decoding can cut it back past rejected drafts: its layers record their state after every
    #: token of a verification forward (dynamoe.models.cache.KVCache.begin_history)
    recurrent_rollback = True
    checkpoint_renames = DEEPSEEK_RENAMES
    expert_layout = PerExpert("w1", "w3", "w2")
    #: chunk length of the prefill's delta rule (any value gives the same result up to rounding)
    chunk_size = 64

    def __init__(self, config: ModelConfig, dtype=None):
        missing = [n for n in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                               "linear_num_key_heads", "linear_key_head_dim", "linear_conv_kernel_dim")
                   if getattr(config, n) is None]
        if missing:
            raise ValueError(f"config fields {missing} are required for {config.model_type!r}")
        super().__init__(config, dtype)
        #: where the checkpoint keeps the dense MLPs ('mlp' on the hub; see adapt_to_checkpoint)
        self.dense_mlp_prefix = "mlp"

    def build_rotary(self, cfg: ModelConfig) -> None:
        return None  # NoPE: no layer rotates anything

    def build_layer(self, cfg: ModelConfig, i: int, rotary, dtype) -> DecoderLayer:
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        kind = cfg.layer_types[i]
        if kind == "linear_attention":
            mixer = KimiDeltaAttention(D, cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_conv_kernel_dim,
                                       i, eps, activation=cfg.hidden_act, chunk_size=self.chunk_size,
                                       checks_position=i == cfg.layer_types.index(kind), dtype=dtype)
        elif kind == "full_attention":
            qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
            mixer = MLAttention(D, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim,
                                cfg.qk_rope_head_dim, cfg.v_head_dim, i, None, qk ** -0.5, bias=cfg.attention_bias,
                                dtype=dtype)
        else:
            raise ValueError(f"config field 'layer_types' entry {i} must be 'linear_attention' or 'full_attention' "
                             f"for {cfg.model_type}, got {kind!r}")
        return DecoderLayer(mixer, deepseek_mlp(cfg, i, dtype), RMSNorm(D, eps, dtype=dtype), RMSNorm(D, eps, dtype=dtype))

    def set_absorb(self, absorb) -> None:
        """MLA weight absorption for the full-attention layers (see DeepseekV3ForCausalLM.set_absorb)."""
        for layer in self.model.layers:
            if isinstance(layer.self_attn, MLAttention):
                layer.self_attn.absorb = absorb

    def adapt_to_checkpoint(self, names) -> None:
        """Called by the loader with the checkpoint's tensor names: the dense MLPs are read from
        ``mlp.`` or ``block_sparse_moe.``, whichever the checkpoint holds."""
        dense = [i for i in range(self.config.num_hidden_layers) if not self.config.is_moe_layer(i)]
        if dense and any(n.startswith(f"model.layers.{dense[0]}.{_MOE_PREFIX}.") for n in names):
            self.dense_mlp_prefix = _MOE_PREFIX

    def checkpoint_name(self, name: str) -> str:
        name = super().checkpoint_name(name)
        m = _LAYER_MLP.match(name)
        if m is None:
            return name
        prefix = _MOE_PREFIX if self.config.is_moe_layer(int(m.group(1))) else self.dense_mlp_prefix
        return name.replace(".mlp.", f".{prefix}.", 1)
