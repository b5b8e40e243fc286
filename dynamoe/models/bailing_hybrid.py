"""inclusionAI Ling-3 (``model_type: bailing_hybrid``): a hybrid decoder whose ``layer_types`` (default: the last
layer of every ``layer_group_size`` MLA, the others KDA) mix

* ``linear_attention`` -- Kimi Delta Attention (:class:`BailingDeltaAttention`, the gated delta rule of
  :mod:`dynamoe.models.kda` with a decay per key channel) whose forget gate is bounded: g = ``kda_lower_bound`` x
  sigmoid(exp(``A_log``) (``f_proj``(x) + ``dt_bias``)) (``kda_safe_gate``; else -exp(A_log) softplus(...)), its
  output norm gated by a full-rank ``g_proj``; the q/k/v short convolutions in fp32 (as transformers keeps them);
* ``full_attention`` -- DeepSeek's MLA (interleaved RoPE on qk_rope_head_dim, base 6e6) with a sigmoid gate per
  head on its output (``g_proj`` [H, D]);

with RMSNorms, dense SwiGLU MLPs on the first ``first_k_dense_replace`` layers (or where ``mlp_layer_types`` says
'dense') and DeepSeek-V3's MoE elsewhere (sigmoid scores, selection-only expert bias, group-limited top-k,
renormalised, times ``routed_scaling_factor``, shared experts). The config uses Kimi-Linear's names
(``num_experts_per_token``, ``moe_renormalize``, ``num_expert_group``, ``num_shared_experts``, ``model_max_length``,
``num_mtp_layers``); ``head_dim`` is the KDA heads' size (their count is ``num_attention_heads``).

Checkpoint (the hub's names, which transformers saves): ``model.word_embeddings``; ``model.layers.{i}.attention.*``
-- KDA: ``{q,k,v}_proj, {q,k,v}_conv1d, f_proj, dt_bias, A_log [H], b_proj, g_proj, o_norm, dense``; MLA: ``q_proj``
(or ``q_a_proj, q_a_layernorm, q_b_proj``), ``kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, g_proj, dense`` --;
``mlp.gate.weight``, ``mlp.gate.expert_bias``, ``mlp.experts.{e}.{gate,up,down}_proj``, ``mlp.shared_experts.*``
(or a dense ``mlp.*_proj``).

Multi-token prediction: the layers stored after the decoder's (``model.layers.{N + j}``: ``enorm``, ``hnorm``,
``eh_proj``, an MLA attention layer and MoE under the decoder's names, ``final_layernorm``) load as the ``mtp`` heads
(:mod:`dynamoe.models.mtp`) as vLLM's BailingMoeV3 MTP model computes them: no embedding masked at position 0, the
output ``final_layernorm``'d (what a further draft reads), the model's embedding and lm_head (or the layer's own
copies). ``mtp_fill`` / ``mtp_drafts`` run them, and the engine drafts with them (``draft="mtp"``): its KDA layers
record their state per token while drafts are verified, so the state rolls back past rejected ones.

The model keeps per-sequence recurrent state (``recurrent_state = True``: no prefix reuse).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import CausalLM, DecoderLayer
from .config import ModelConfig
from .deepseek_v3 import deepseek_mlp
from .kda import KimiDeltaAttention
from .mla import MLAttention, mla_softmax_scale
from .mtp import MTPHeads, NextTokenPredictor
from .norms import RMSNorm
from .rope import RotaryEmbedding
from .weights import PerExpert

__all__ = ["BailingHybridForCausalLM", "BailingDeltaAttention"]


class BailingDeltaAttention(KimiDeltaAttention):
    """Kimi Delta Attention with Ling-3's forget gate (``f_proj`` [C, D], ``A_log`` [H], ``dt_bias`` [C]; bounded by
    ``lower_bound`` when ``safe_gate``), a full-rank output gate (``g_proj`` [C, D]) and fp32 convolutions."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, conv_kernel: int, layer_idx: int,
                 norm_eps: float = 1e-6, activation: str = "silu", chunk_size: int = 64, checks_position: bool = False,
                 safe_gate: bool = True, lower_bound: float = -5.0, dtype=None):
        super().__init__(hidden_size, num_heads, head_dim, conv_kernel, layer_idx, norm_eps=norm_eps,
                         activation=activation, chunk_size=chunk_size, checks_position=checks_position, dtype=dtype)
        if safe_gate and not lower_bound < 0:
            raise ValueError(f"config field 'kda_lower_bound' must be < 0 (the log decay's floor), got {lower_bound!r}")
        C = self.channels
        del self.f_a_proj, self.f_b_proj, self.g_a_proj, self.g_b_proj
        self.safe_gate, self.lower_bound = safe_gate, lower_bound
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (
            nn.Conv1d(C, C, conv_kernel, groups=C, padding=conv_kernel - 1, bias=False, dtype=torch.float32)
            for _ in range(3))
        self.f_proj = nn.Linear(hidden_size, C, bias=False, dtype=dtype)
        self.A_log = nn.Parameter(torch.zeros(num_heads, dtype=torch.float32))
        self.g_proj = nn.Linear(hidden_size, C, bias=False, dtype=dtype)

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", safe_gate={self.safe_gate}, lower_bound={self.lower_bound}")

    def decay(self, x_BTD: Tensor) -> Tensor:
        """g, fp32 [B, T, H, k] (see the class docstring)."""
        B, T, _ = x_BTD.shape
        f = self.f_proj(x_BTD).float().view(B, T, self.num_heads, -1) + self.dt_bias.float().view(self.num_heads, -1)
        rate = self.A_log.float().exp().view(self.num_heads, 1)
        if self.safe_gate:
            g = self.lower_bound * torch.sigmoid(rate * f)
        else:
            g = -rate * F.softplus(f)
        return g.to(x_BTD.dtype).float()   # (transformers rounds the gate to the model's dtype)

    def output_gate(self, x_BTD: Tensor) -> Tensor:
        return self.g_proj(x_BTD)


class BailingHybridForCausalLM(MTPHeads, CausalLM):
    """Ling-3 (see the module docstring)."""

    #: per-sequence recurrent state (the KDA layers): no prefix reuse, see dynamoe.models.linear_attention
    recurrent_state = True
    #: ... but speculative decoding can cut it back past rejected drafts: its layers record their state after every
    #: token of a verification forward (dynamoe.models.cache.KVCache.begin_history)
    recurrent_rollback = True
    checkpoint_renames = ((".mlp.moe.gates.0.wg.", ".mlp.gate."),
                          (".mlp.moe.gates.0.e_score_correction_bias", ".mlp.gate.expert_bias"),
                          (".mlp.moe.", ".mlp."), (".self_attn.o_proj.", ".attention.dense."),
                          (".self_attn.", ".attention."), ("model.embed_tokens.", "model.word_embeddings."))
    expert_layout = PerExpert("gate_proj", "up_proj", "down_proj")
    mtp_renames = (("shared_head.norm.", "final_layernorm."),)
    #: chunk length of the prefill's delta rule (any value gives the same result up to rounding)
    chunk_size = 64

    def __init__(self, config: ModelConfig, dtype=None):
        for name, ok in (("kda_safe_gate", lambda v: isinstance(v, bool)),
                         ("kda_lower_bound", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool))):
            if not ok(config.raw.get(name)):
                raise ValueError(f"config field {name!r} must be {'true or false' if name == 'kda_safe_gate' else 'a number'}"
                                 f", got {config.raw.get(name)!r}")
        missing = [n for n in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
                   if getattr(config, n) is None]
        if missing:
            raise ValueError(f"config fields {missing} are required for bailing_hybrid (Multi-head Latent Attention)")
        super().__init__(config, dtype)

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype, kind: str | None = None
                    ) -> DecoderLayer:
        """Decoder layer i (``kind``: given for a layer past the decoder's, an MTP layer)."""
        D, eps, kind = cfg.hidden_size, cfg.rms_norm_eps, cfg.layer_types[i] if kind is None else kind
        if kind == "linear_attention":
            mixer: nn.Module = BailingDeltaAttention(
                D, cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_conv_kernel_dim, i, eps,
                activation=cfg.hidden_act, chunk_size=self.chunk_size, checks_position=i == cfg.layer_types.index(kind),
                safe_gate=cfg.raw["kda_safe_gate"], lower_bound=float(cfg.raw["kda_lower_bound"]), dtype=dtype)
        elif kind == "full_attention":
            qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
            mixer = MLAttention(D, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim,
                                cfg.qk_rope_head_dim, cfg.v_head_dim, i, rotary, mla_softmax_scale(cfg.rope, qk),
                                rope_interleaved=True, bias=cfg.attention_bias, head_gate=True, dtype=dtype)
        else:
            raise ValueError(f"config field 'layer_types' entry {i} must be 'linear_attention' or 'full_attention' "
                             f"for bailing_hybrid, got {kind!r}")
        return DecoderLayer(mixer, deepseek_mlp(cfg, i, dtype), RMSNorm(D, eps, dtype=dtype), RMSNorm(D, eps, dtype=dtype))

    # ---- multi-token prediction (model.layers.{N + j}; dynamoe.models.mtp) ------------------------------
    def build_mtp_layer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype, names: set) -> DecoderLayer:
        # vLLM's BailingMoeV3 MTP layer: MLA attention (never KDA: no recurrent state in the head) and the MoE
        return self.build_layer(cfg, i, rotary, dtype, kind="full_attention")

    def new_mtp_head(self, cfg: ModelConfig, block: DecoderLayer, dtype) -> NextTokenPredictor:
        # its output final_layernorm'd (what a further draft reads), no embedding masked at position 0
        return NextTokenPredictor(block, cfg.hidden_size, cfg.vocab_size, cfg.rms_norm_eps, dtype=dtype,
                                  mask_first=False, norm_output=True)

    def set_absorb(self, absorb) -> None:
        """MLA weight absorption for the full-attention layers (see DeepseekV3ForCausalLM.set_absorb)."""
        for layer in self.model.layers:
            if isinstance(layer.self_attn, MLAttention):
                layer.self_attn.absorb = absorb
