"""Step-3.5 (``model_type: step3p5``: Step-3.5-Flash, and the text model of Step-3.7's ``step3p7`` wrapper,
:class:`Step3p7ForCausalLM`):
GQA decoder layers of two kinds (``layer_types``: 'full_attention' and 'sliding_attention' with a window of
``sliding_window`` keys), each kind with its own RoPE (half-split on the first ``partial_rotary_factor`` of each
head) and the sliding layers with their own query-head count (``num_sliding_attention_heads``, the hub's
``attention_other_setting``; the KV heads are the same); Gemma-style RMSNorms (the scale is 1 + weight) on the
residual stream and on each head's queries and keys (before RoPE); softmax scale ``query_pre_attn_scalar``^-1/2;
each head's output times sigmoid of its own gate logit (``g_proj`` [H, D]) before ``o_proj``. Dense SwiGLU MLPs on
the ``mlp_layer_types`` 'dense' layers (default: 0-2), MoE on the others: sigmoid scores, a selection-only bias,
top-k renormalised, times ``moe_router_scaling_factor``, plus one shared SwiGLU expert of ``share_expert_dim``.
``swiglu_limits`` (routed) and ``swiglu_limits_shared`` (shared expert and dense MLPs) clamp a layer's SwiGLU
(silu(gate) <= limit, |up| <= limit: GLU kind 'silu_clamp'); 0 or null: no clamp.

Checkpoint (the hub's names, which transformers also saves): ``self_attn.{q,k,v,o,g}_proj``,
``self_attn.{q,k}_norm``, ``moe.gate.weight`` [E, D], ``moe.router_bias`` [E], ``moe.{gate,up}_proj.weight``
[E, F, D], ``moe.down_proj.weight`` [E, D, F], ``share_expert.{gate,up,down}_proj``, dense ``mlp.*_proj``.

Multi-token prediction: the trailing layers ``model.layers.{N + j}`` (``enorm``, ``hnorm``, ``eh_proj``,
``transformer.shared_head.{norm,output}``, a Step-3.5 decoder layer) load as the ``mtp`` heads
(:mod:`dynamoe.models.mtp`; the engine drafts with the first, ``draft="mtp"``) as vLLM's Step3p5MTP computes them:
zero-centred enorm / hnorm / head norm, no embedding masked at position 0, each layer's attention kind, RoPE and
SwiGLU clamps from the hub's per-layer lists' entries past num_hidden_layers (``mtp_layer_entries``), MoE where it
has a router. A config without those entries (transformers' saved one) says nothing of the layer's attention
kind: it is then not loaded, and the log says so.

Decode: the fused kernels take the layers (the attention kernel's sigmoid gate per head, zero-centred norms in the
attention and MLP kernels); each refusal says why where one does not apply.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .attention import Attention
from .base import CausalLM, DecoderLayer
from .cache import KVCache
from .config import ModelConfig
from .mimo_v2_flash import RotaryByLayerType
from .moe_block import GatedMLP, SparseMoeBlock
from .mtp import MTPHeads, NextTokenPredictor
from .norms import RMSNorm
from .rope import RotaryEmbedding
from .weights import SplitStacked
from .wrapped import TextOfWrapper, WrapperLayout

log = logging.getLogger(__name__)

__all__ = ["Step3p5ForCausalLM", "Step3p7ForCausalLM", "Step3p5Attention", "StepFields", "step_fields"]


@dataclass(frozen=True)
class StepFields:
    """Step-3.5's per-layer values, read once from the config (see :func:`step_fields`): ``heads[i]`` query heads,
    ``scale`` the softmax scale, ``limits[i]`` / ``shared_limits[i]`` the routed / shared-and-dense SwiGLU clamp of
    layer i (None: no clamp), ``sliding_heads`` the sliding layers' query heads unless per_layer_config says."""

    heads: tuple
    scale: float
    limits: tuple
    shared_limits: tuple
    sliding_heads: int = 0


def _limits(cfg: ModelConfig, name: str) -> tuple:
    v = cfg.raw.get(name)
    n = cfg.num_hidden_layers
    if v is None:
        return (None,) * n
    if (not isinstance(v, (list, tuple)) or len(v) != n
            or any(x is not None and (isinstance(x, bool) or not isinstance(x, (int, float)) or not x >= 0) for x in v)):
        raise ValueError(f"config field {name!r} must be null or a list of {n} numbers >= 0 or nulls (one per layer; "
                         f"0 or null: no clamp), got {v!r}")
    return tuple(float(x) if x else None for x in v)


def step_fields(cfg: ModelConfig) -> StepFields:
    """The per-layer head counts, softmax scale and SwiGLU clamps of a step3p5 config, as Step3p7TextConfig and
    its modeling code read them (``per_layer_config`` entries win over ``num_sliding_attention_heads``, which
    defaults to the hub's ``attention_other_setting.num_attention_heads``, then to num_attention_heads); ValueError
    naming the field for what the model does not support."""
    raw, n, H, K = cfg.raw, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads
    if raw.get("use_bidirectional_attention"):
        raise ValueError("config field 'use_bidirectional_attention' must be false for step3p5: a causal LM "
                         "(the bidirectional variant is not supported)")
    gating = raw.get("gating", True)
    if gating is not True and gating != "per-head":
        raise ValueError(f"config field 'gating' must be true or 'per-head' (a sigmoid gate per attention head), got "
                         f"{gating!r}")
    if raw.get("mlp_bias"):
        raise ValueError("config field 'mlp_bias' must be false for step3p5 (biases on the dense and shared MLPs are "
                         "not supported)")
    sliding = raw.get("num_sliding_attention_heads")
    if sliding is None:
        other = raw.get("attention_other_setting") or {}
        if not isinstance(other, dict):
            raise ValueError(f"config field 'attention_other_setting' must be a dict, got {other!r}")
        sliding = other.get("num_attention_heads", H)
    per_layer = raw.get("per_layer_config") or {}
    if not isinstance(per_layer, dict):
        raise ValueError(f"config field 'per_layer_config' must be a dict (layer -> overrides), got {per_layer!r}")
    heads = []
    for i in range(n):
        h = sliding if cfg.layer_types[i] == "sliding_attention" else H
        over = per_layer.get(str(i), per_layer.get(i))
        if over is not None:
            if not isinstance(over, dict) or set(over) - {"num_attention_heads"}:
                raise ValueError(f"config field 'per_layer_config' entry {i} must override num_attention_heads only, "
                                 f"got {over!r}")
            h = over.get("num_attention_heads", h)
        if isinstance(h, bool) or not isinstance(h, int) or h < 1 or h % K:
            raise ValueError(f"the query heads of layer {i} (num_sliding_attention_heads / per_layer_config) must be "
                             f"a positive multiple of num_key_value_heads={K}, got {h!r}")
        heads.append(h)
    qpas = raw.get("query_pre_attn_scalar")
    qpas = cfg.head_dim if qpas is None else qpas
    if isinstance(qpas, bool) or not isinstance(qpas, (int, float)) or not math.isfinite(qpas) or qpas <= 0:
        raise ValueError(f"config field 'query_pre_attn_scalar' must be a number > 0, got {qpas!r}")
    return StepFields(tuple(heads), float(qpas) ** -0.5, _limits(cfg, "swiglu_limits"),
                      _limits(cfg, "swiglu_limits_shared"), sliding)


class Step3p5Attention(Attention):
    """GQA with zero-centred per-head q/k RMSNorms before RoPE and a sigmoid gate per head on the output
    (``g_proj`` [H, D]); window and scale as :class:`Attention`'s."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, layer_idx: int,
                 rotary: RotaryEmbedding, bias: bool = False, norm_eps: float = 1e-5, sliding_window: int | None = None,
                 scale: float | None = None, dtype=None):
        super().__init__(hidden_size, num_heads, num_kv_heads, head_dim, layer_idx, rotary, qkv_bias=bias, o_bias=bias,
                         qk_norm=True, norm_eps=norm_eps, sliding_window=sliding_window, scale=scale, dtype=dtype)
        self.q_norm = RMSNorm(head_dim, norm_eps, zero_centered=True, dtype=dtype)
        self.k_norm = RMSNorm(head_dim, norm_eps, zero_centered=True, dtype=dtype)
        self.g_proj = nn.Linear(hidden_size, num_heads, bias=False, dtype=dtype)

    def _decode_gate(self, kernels, holds, dtype):
        return self._gate_weights(kernels, holds, dtype, "g_proj", "sigmoid")

    def forward(self, x_BTD: Tensor, positions_BT: Tensor, cache: KVCache | None = None, slots: Tensor | None = None,
                kv_len: int | None = None) -> Tensor:
        B, T, _ = x_BTD.shape
        H, d = self.num_heads, self.head_dim
        q, k, v = self.heads(x_BTD, positions_BT)                             # [B, H|K, T, d]
        out = self.attend_cached(q, k, v, positions_BT, cache, slots, kv_len, self.sliding_window, self.sinks)
        gate_BHT1 = torch.sigmoid(self.g_proj(x_BTD)).transpose(1, 2).unsqueeze(-1)
        return self.o_proj((out * gate_BHT1).transpose(1, 2).reshape(B, T, H * d))


class Step3p5ForCausalLM(MTPHeads, CausalLM):
    """Step-3.5 (see the module docstring)."""

    checkpoint_renames = ((".mlp.moe.gates.0.wg.", ".moe.gate."),
                          (".mlp.moe.gates.0.e_score_correction_bias", ".moe.router_bias"),
                          (".mlp.moe.shared_experts.", ".share_expert."),
                          (".mlp.moe.experts", ".moe"))
    expert_layout = SplitStacked()
    mtp_renames = (("shared_head.head.", "transformer.shared_head.output."),
                   ("shared_head.norm.", "transformer.shared_head.norm."))

    def __init__(self, config: ModelConfig, dtype=None):
        object.__setattr__(self, "_step", step_fields(config))  # (before the layers are built)
        super().__init__(config, dtype)

    def build_norm(self, cfg: ModelConfig, dim: int, dtype) -> RMSNorm:
        return RMSNorm(dim, cfg.rms_norm_eps, zero_centered=True, dtype=dtype)

    def build_rotary(self, cfg: ModelConfig) -> RotaryByLayerType:
        return RotaryByLayerType({kind: RotaryEmbedding(r, int(cfg.head_dim * r.partial_rotary_factor),
                                                        cfg.max_position_embeddings)
                                  for kind, r in cfg.rope_by_layer_type})

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryByLayerType, dtype) -> DecoderLayer:
        step = self._step
        return self._step_layer(cfg, i, rotary, dtype, cfg.layer_types[i], step.heads[i], step.limits[i],
                                step.shared_limits[i], cfg.is_moe_layer(i))

    def _step_layer(self, cfg: ModelConfig, i: int, rotary: RotaryByLayerType, dtype, kind: str, heads: int,
                    limit: float | None, shared: float | None, moe: bool) -> DecoderLayer:
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        if kind not in ("full_attention", "sliding_attention"):
            raise ValueError(f"config field 'layer_types' entry {i} must be 'full_attention' or 'sliding_attention' "
                             f"for step3p5, got {kind!r}")
        attn = Step3p5Attention(D, heads, cfg.num_key_value_heads, cfg.head_dim, i, rotary[kind],
                                bias=cfg.attention_bias, norm_eps=eps,
                                sliding_window=cfg.sliding_window if kind == "sliding_attention" else None,
                                scale=self._step.scale, dtype=dtype)
        shared_glu = "silu" if shared is None else "silu_clamp"
        if moe:
            mlp = SparseMoeBlock(cfg, "sigmoid", normalize=True, glu="silu" if limit is None else "silu_clamp",
                                 glu_limit=limit, num_shared_experts=1,
                                 shared_hidden_size=cfg.shared_expert_intermediate_size, shared_glu=shared_glu,
                                 shared_glu_limit=shared, router_groups=False, route_scale=cfg.routed_scaling_factor,
                                 dtype=dtype)
        else:
            if cfg.intermediate_size is None:
                raise ValueError(f"config field 'intermediate_size' is required: layer {i} has a dense MLP")
            mlp = GatedMLP(D, cfg.intermediate_size, shared_glu, limit=7.0 if shared is None else shared, dtype=dtype)
        return DecoderLayer(attn, mlp, RMSNorm(D, eps, zero_centered=True, dtype=dtype),
                            RMSNorm(D, eps, zero_centered=True, dtype=dtype))

    # ---- multi-token prediction (model.layers.{N + j}; dynamoe.models.mtp) ------------------------------
    def build_mtp_layer(self, cfg: ModelConfig, i: int, rotary: RotaryByLayerType, dtype,
                        names: set) -> DecoderLayer | None:
        """The decoder layer of MTP layer i, by the hub's per-layer lists' entries past num_hidden_layers
        (``mtp_layer_entries``: its attention kind, RoPE, SwiGLU clamps; MoE where ``mlp_layer_types`` says so, else
        where it has ``moe.gate.weight``). None (logged) where the config does not say its attention kind or its
        RoPE differs from the decoder layers' of that kind (one RoPE per kind here)."""
        j, entries = i - cfg.num_hidden_layers, cfg.raw.get("mtp_layer_entries") or {}

        def entry(name):
            v = entries.get(name)
            return v[j] if isinstance(v, (list, tuple)) and j < len(v) else None

        kind = entry("layer_types")
        if kind not in ("full_attention", "sliding_attention"):
            log.info("step3p5: multi-token-prediction layer model.layers.%d not loaded: its attention kind is known "
                     "only from the hub's layer_types entry %d (lists of num_hidden_layers + num_nextn_predict_layers "
                     "entries), and the config has %r", i, i, kind)
            return None
        rope = dict(cfg.rope_by_layer_type)[kind]
        theta, partial = entry("rope_theta"), entry("partial_rotary_factors")
        if (theta is not None and float(theta) != rope.theta) or (partial is not None
                                                                  and float(partial) != rope.partial_rotary_factor):
            log.info("step3p5: multi-token-prediction layer model.layers.%d not loaded: its RoPE (rope_theta %s, "
                     "partial_rotary_factors %s) is not the %s layers' (%s, %s), and the model keeps one per kind",
                     i, theta, partial, kind, rope.theta, rope.partial_rotary_factor)
            return None
        heads = self._step.sliding_heads if kind == "sliding_attention" else cfg.num_attention_heads
        over = (cfg.raw.get("per_layer_config") or {})
        over = over.get(str(i), over.get(i)) or {}
        heads = over.get("num_attention_heads", heads)
        limits = [entry(n) for n in ("swiglu_limits", "swiglu_limits_shared")]
        limits = [float(x) if x else None for x in limits]
        mlp = entry("mlp_layer_types")
        moe = (mlp == "sparse" if mlp is not None
               else self.mtp_checkpoint_name(j, "block.mlp.moe.gates.0.wg.weight")[len(self.checkpoint_prefix):]
               in names)
        return self._step_layer(cfg, i, rotary, dtype, kind, heads, *limits, moe)

    def new_mtp_head(self, cfg: ModelConfig, block: DecoderLayer, dtype) -> NextTokenPredictor:
        # Step-3.5's enorm / hnorm / shared_head.norm are its zero-centred norms; no embedding masked at position 0
        # (vLLM's Step3p5MTP)
        D = cfg.hidden_size
        return NextTokenPredictor(block, D, cfg.vocab_size, cfg.rms_norm_eps, dtype=dtype,
                                  norm=lambda: self.build_norm(cfg, D, dtype), mask_first=False)


class Step3p7ForCausalLM(TextOfWrapper, Step3p5ForCausalLM):
    """The text model of a Step-3.7 checkpoint (``step3p7``: text only, no vision tower). transformers saves the
    wrapper with the hub's names, the text model's where a step3p5 checkpoint keeps them (``model.*``,
    ``lm_head``); the vision tower (``vision_model.*``) and its projector are not loaded."""

    wrapper_layouts = {"step3p7": WrapperLayout("model.", unused=("vision_model.", "vit_large_projector."))}
    text_only_reason = "its vision tower is not loaded (dynamoe serves the Step-3.7 text model only)"
