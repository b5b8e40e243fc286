"""AI21 Jamba (``model_type: jamba``): Mamba-1 layers (:class:`~dynamoe.models.mamba.MambaMixer`, with RMSNorms on
the time step, B and C) mixed with GQA attention layers -- attention where i % ``attn_layer_period`` ==
``attn_layer_offset``, Mamba elsewhere; the attention has no position encoding (the Mamba layers carry the
order) -- and, after either mixer, an MoE block where i % ``expert_layer_period`` == ``expert_layer_offset``
(softmax top-k, the k weights not renormalised; SwiGLU experts of ``intermediate_size``), a dense SwiGLU MLP
of the same width elsewhere. Pre-norm residuals, RMSNorms.

Checkpoint: ``model.layers.{i}.mamba.{in_proj, conv1d.{weight,bias}, x_proj, dt_proj.{weight,bias}, A_log, D,
out_proj, dt_layernorm, b_layernorm, c_layernorm}`` or ``self_attn.{q,k,v,o}_proj``;
``feed_forward.router.weight`` [E, D], ``feed_forward.experts.{e}.{gate,up,down}_proj.weight`` (or a dense
``feed_forward.{gate,up,down}_proj``); ``input_layernorm``, ``pre_ff_layernorm``; ``model.final_layernorm``.

The model keeps per-sequence recurrent state (``recurrent_state = True``: no prefix reuse, see
:mod:`dynamoe.models.mamba`).
"""
from __future__ import annotations

from torch import nn

from .attention import Attention
from .base import CausalLM
from .config import ModelConfig
from .mamba import MambaMixer, MixerDecoderLayer
from .moe_block import GatedMLP, SparseMoeBlock, glu_kind
from .norms import RMSNorm
from .rope import RotaryEmbedding
from .weights import PerExpert

__all__ = ["JambaForCausalLM"]


class JambaForCausalLM(CausalLM):
    """Jamba (see the module docstring)."""

    #: the Mamba layers' conv window and SSM state summarise a slot's whole prefix: no prefix reuse
    recurrent_state = True
    #: ... but speculative decoding can cut it back past rejected drafts: its layers record their state after every
    #: token of a verification forward (dynamoe.models.cache.KVCache.begin_history)
    recurrent_rollback = True
    checkpoint_renames = ((".mlp.moe.gates.0.wg.", ".feed_forward.router."), (".mlp.moe.", ".feed_forward."),
                          (".mlp.", ".feed_forward."), (".post_attention_layernorm.", ".pre_ff_layernorm."),
                          ("model.norm.", "model.final_layernorm."))
    expert_layout = PerExpert("gate_proj", "up_proj", "down_proj")
    #: chunk length of the prefill's selective scan (any value gives the same result up to rounding)
    chunk_size = 64

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> MixerDecoderLayer:
        D, eps, kind, ssm = cfg.hidden_size, cfg.rms_norm_eps, cfg.layer_types[i], cfg.ssm
        if kind == "linear_attention":
            mixer = MambaMixer(D, ssm.intermediate_size, ssm.state_size, ssm.conv_kernel, ssm.dt_rank, i,
                               conv_bias=ssm.conv_bias, proj_bias=ssm.proj_bias, activation=ssm.activation,
                               bcdt_norm_eps=eps, chunk_size=self.chunk_size,
                               checks_position=i == cfg.layer_types.index(kind), dtype=dtype)
        else:  # no RoPE: Jamba's attention layers see no positions
            mixer = Attention(D, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, i, rotary,
                              use_rope=False, dtype=dtype)
        glu = glu_kind(cfg.hidden_act)
        if cfg.is_moe_layer(i):
            mlp: nn.Module = SparseMoeBlock(cfg, "softmax", normalize=False, glu=glu, dtype=dtype)
        else:
            mlp = GatedMLP(D, cfg.intermediate_size, glu, dtype=dtype)
        return MixerDecoderLayer(mixer, mlp, RMSNorm(D, eps, dtype=dtype), RMSNorm(D, eps, dtype=dtype),
                                 mixer_name="mamba" if kind == "linear_attention" else "self_attn")
