"""Hy4 (``model_type: hy_v4``) and the text model of Hy4-VL (``hy_v4_vl``, HYV4VLForConditionalGeneration; or a
``hy_v4_vl_text`` config): DeepSeek-V3.2's Multi-head Latent Attention (half-split RoPE on the qk_rope share of each
head, YaRN's softmax-scale correction) through the DSA indexer (RoPE on the last qk_rope dims of its heads; 'shared'
``indexer_types`` layers reuse the previous full layer's selection: by default every 4th from layer 1 runs its own;
RoPE half-split for Hy4, on interleaved pairs for Hy4-VL)
with a learned sink per head and each head's output times sigmoid(``gate_proj``(x)); the residual widened to
``hc_mult`` streams joined by independent hyper-connections (:class:`~dynamoe.models.hyper_connections.
IndependentHyperConnection`: pre collapses, ``hc_magnitude`` sigmoid spreads, no mixing; ``hc_head`` collapses
at the end); plain RMSNorms; a dense SwiGLU MLP on the first layer, then DeepSeek-V3's MoE (sigmoid scores,
selection-only bias, group-limited top-k, renormalised, times ``routed_scaling_factor``) whose routed experts clamp
their gate above and their up projection to +-``swiglu_limit`` (none when <= 0), plus an unclamped shared expert.
Hy4-VL's multimodal RoPE is the plain one for text (its three position ids are equal).

Checkpoint: transformers' names as it saves them -- ``self_attn.{q_a_proj, q_a_layernorm, q_b_proj,
kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj, indexer.*}``, ``self_attn.learnable_sink_param``,
``self_attn.linear_gate``, the hyper-connections under ``hc_pre.hc_attn_layer.hc_*`` / ``hc_mlp_layer`` and
``hc_head.hc_head_*``, ``mlp.gate.weight``, ``mlp.gate.e_score_correction_bias``, the routed experts fused
(``mlp.experts.gate_up_proj`` [E, 2F, D], ``mlp.experts.down_proj``) -- or the other spellings of those names
transformers reads (``hc_attn_layer`` without ``hc_pre``, ``gate_proj`` for ``linear_gate``, ...): each tensor is
looked up under its spellings in a fixed order. Hy4-VL keeps its vision tower under ``vit.`` (not loaded; the server
refuses images naming the model). No fused decode kernels:
hyper-connected layers, sinks and an output gate on MLA.

Multi-token prediction: the hub's ``model.mtp_layers.{j}`` (``enorm``, ``hnorm``, ``eh_proj``, ``final_layernorm``
and a plain pre-norm layer: ``self_attn.*`` with its own indexer, ``mlp.*``, ``input_layernorm``,
``post_attention_layernorm``; no hyper-connections) load as the ``mtp`` heads (:mod:`dynamoe.models.mtp`; the engine
drafts with the first, ``draft="mtp"``) as SGLang's HYV4ForCausalLMNextN computes them: it reads the model's final
(collapsed, normed) states, no embedding masked at position 0, its output ``final_layernorm``'d (what a further draft
reads), the model's embedding and lm_head. SGLang may reuse the first draft step's index selection at later steps
(IndexTopKShareState); here the head's indexer selects at every step (drafts only propose).
"""
from __future__ import annotations

import re

from .base import CausalLM, DecoderLayer
from .config import ModelConfig
from .hyper_connections import HyperHeadNorm, IndependentHyperConnection, IndependentHyperDecoderLayer, StreamEmbedding
from .indexer import Indexer, SharedIndex
from .mla import MLAttention, mla_softmax_scale
from .moe_block import GatedMLP, SparseMoeBlock, glu_kind
from .mtp import MTPHeads, NextTokenPredictor
from .norms import RMSNorm
from .rope import RotaryEmbedding
from .weights import Stacked
from .wrapped import TextOfWrapper, WrapperLayout

__all__ = ["HyV4ForCausalLM", "hy_fields"]


def _positive(raw: dict, name: str, default, kind=int):
    v = raw.get(name, default)
    v = default if v is None else v
    ok = isinstance(v, int) and v >= 1 if kind is int else isinstance(v, (int, float)) and v > 0
    if isinstance(v, bool) or not ok:
        raise ValueError(f"config field {name!r} must be {'an int >= 1' if kind is int else 'a number > 0'}, got {v!r}")
    return kind(v)


def hy_fields(cfg: ModelConfig) -> tuple[int, float, float]:
    """(``hc_mult``, ``hc_eps``, ``hc_magnitude``) as HYV4Config reads them (defaults 4, 1e-6, 2)."""
    raw = cfg.raw
    return _positive(raw, "hc_mult", 4), _positive(raw, "hc_eps", 1e-6, float), _positive(raw, "hc_magnitude", 2.0, float)


# our name's part -> the spellings a checkpoint may use for it, in the order they are tried (see the module docstring)
_SPELLINGS = (
    (re.compile(r"\.attn_hc\.(fn|base|scale)$"), (r".hc_pre.hc_attn_layer.hc_\1", r".hc_attn_layer.hc_\1",
                                                  r".attn_hc.\1")),
    (re.compile(r"\.ffn_hc\.(fn|base|scale)$"), (r".hc_pre.hc_mlp_layer.hc_\1", r".hc_mlp_layer.hc_\1", r".ffn_hc.\1")),
    (re.compile(r"\.norm\.hc_head\.hc_(fn|base|scale)$"), (r".hc_pre.hc_head.hc_head_\1", r".hc_head.hc_pre.hc_head_\1",
                                                            r".hc_head.hc_head_\1", r".hc_head.hc_\1")),
    (re.compile(r"\.self_attn\.sinks$"), (r".self_attn.learnable_sink_param", r".self_attn.sinks")),
    (re.compile(r"\.gate_proj\.weight$"), (r".linear_gate.weight", r".gate_proj.weight")),
)


_MTP_DEPTH = re.compile(r"(?:^|\.)mtp_layers\.(\d+)\.")


class HyV4ForCausalLM(TextOfWrapper, MTPHeads, CausalLM):
    """Hy4 / Hy4-VL's text model (see the module docstring)."""

    checkpoint_renames = ((".mlp.moe.gates.0.wg.", ".mlp.gate."), (".mlp.moe.gates.0.", ".mlp.gate."),
                          (".mlp.moe.", ".mlp."))
    expert_layout = Stacked("gate_up_proj", "down_proj", suffix="")
    use_decode_plan = False   # (hyper-connected layers: no fused kernels to lay out)
    wrapper_layouts = {"hy_v4_vl": WrapperLayout("model.", unused=("vit.",))}
    mtp_renames = (("shared_head.norm.", "final_layernorm."),)

    def __init__(self, config: ModelConfig, dtype=None):
        missing = [n for n in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                               "index_topk", "index_head_dim", "index_n_heads") if getattr(config, n) is None]
        if missing:
            raise ValueError(f"config fields {missing} are required for {config.model_type!r}")
        streams, hc_eps, magnitude = hy_fields(config)
        object.__setattr__(self, "streams", streams)
        object.__setattr__(self, "hc_eps", hc_eps)
        object.__setattr__(self, "hc_magnitude", magnitude)
        object.__setattr__(self, "shared_index", SharedIndex())
        object.__setattr__(self, "checkpoint_names", None)
        super().__init__(config, dtype)
        self.model.embed_tokens.__class__ = StreamEmbedding
        self.model.embed_tokens.streams = self.streams

    @property
    def text_only_reason(self) -> str | None:
        """What the server tells a request with an image: Hy4-VL's vision tower is not loaded (Hy4 reads text)."""
        if self.config.model_type in ("hy_v4_vl", "hy_v4_vl_text"):
            return "its vision tower is not loaded (dynamoe serves the Hy4-VL text model only)"
        return None

    @property
    def unused_checkpoint_prefixes(self) -> tuple:
        return TextOfWrapper.unused_checkpoint_prefixes.fget(self) + (() if self.has_mtp else ("model.mtp_layers.",))

    def build_rotary(self, cfg: ModelConfig) -> RotaryEmbedding:
        return RotaryEmbedding(cfg.rope, cfg.qk_rope_head_dim, cfg.max_position_embeddings)

    def build_norm(self, cfg: ModelConfig, dim: int, dtype) -> HyperHeadNorm:
        return HyperHeadNorm(dim, self.streams, cfg.rms_norm_eps, self.hc_eps, dtype=dtype)

    def build_attention(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype, mtp: bool = False
                        ) -> MLAttention:
        """Layer i's attention (``mtp``: an MTP layer's -- its own indexer, which no later layer shares)."""
        D = cfg.hidden_size
        indexer = None
        if mtp or not (cfg.indexer_types and cfg.indexer_types[i] == "shared"):
            indexer = Indexer(D, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim,
                              cfg.index_topk, i, rotary, rope_interleaved=cfg.rope_interleave,
                              shared=None if mtp else self.shared_index, rope_at_end=True,
                              k_norm_eps=cfg.rms_norm_eps, dtype=dtype)
        elif i == 0:
            raise ValueError("config field 'indexer_types' must start with a 'full' layer (layer 0 is 'shared')")
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        return MLAttention(D, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim,
                           cfg.qk_rope_head_dim, cfg.v_head_dim, i, rotary, mla_softmax_scale(cfg.rope, qk),
                           rope_interleaved=cfg.rope_interleave, bias=cfg.attention_bias, indexer=indexer,
                           shared_index=self.shared_index if indexer is None else None, sinks=True, output_gate=True,
                           dtype=dtype)

    def build_mlp(self, cfg: ModelConfig, i: int, dtype):
        glu = glu_kind(cfg.hidden_act)
        if cfg.is_moe_layer(i):
            limit = cfg.swiglu_limit
            clamped = limit is not None and limit > 0 and glu == "silu"
            return SparseMoeBlock(cfg, "sigmoid", normalize=cfg.norm_topk_prob, glu="silu_clamp_in" if clamped else glu,
                                  num_shared_experts=cfg.n_shared_experts, glu_limit=limit if clamped else None,
                                  shared_glu=glu if clamped else None, dtype=dtype)
        if cfg.intermediate_size is None:
            raise ValueError(f"config field 'intermediate_size' is required: layer {i} has a dense MLP")
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, glu, dtype=dtype)

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> IndependentHyperDecoderLayer:
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        hcs = [IndependentHyperConnection(D, self.streams, self.hc_magnitude, self.hc_eps, eps) for _ in range(2)]
        return IndependentHyperDecoderLayer(self.build_attention(cfg, i, rotary, dtype), self.build_mlp(cfg, i, dtype),
                                            RMSNorm(D, eps, dtype=dtype), RMSNorm(D, eps, dtype=dtype), *hcs)

    # ---- multi-token prediction (model.mtp_layers.{j}; dynamoe.models.mtp) --------------------------------
    def mtp_prefix(self, j: int) -> str:
        return f"{self.checkpoint_prefix}model.mtp_layers.{j}."

    def mtp_depth_of(self, name: str) -> int | None:
        m = _MTP_DEPTH.search(name)
        return int(m.group(1)) if m else None

    def build_mtp_layer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype, names: set) -> DecoderLayer:
        # SGLang's HYV4MTPDecoderLayer: a plain pre-norm layer (no hyper-connections), MLA with its own indexer,
        # sinks and output gate, the MoE with an unclamped shared expert
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        return DecoderLayer(self.build_attention(cfg, i, rotary, dtype, mtp=True), self.build_mlp(cfg, i, dtype),
                            RMSNorm(D, eps, dtype=dtype), RMSNorm(D, eps, dtype=dtype))

    def new_mtp_head(self, cfg: ModelConfig, block: DecoderLayer, dtype) -> NextTokenPredictor:
        # its output final_layernorm'd (what a further draft reads); no embedding masked at position 0
        return NextTokenPredictor(block, cfg.hidden_size, cfg.vocab_size, cfg.rms_norm_eps, dtype=dtype,
                                  mask_first=False, norm_output=True)

    def adapt_to_checkpoint(self, names) -> None:
        object.__setattr__(self, "checkpoint_names", frozenset(names))
        super().adapt_to_checkpoint(names)

    def checkpoint_name(self, name: str) -> str:
        name = super().checkpoint_name(name)
        for pattern, spellings in _SPELLINGS:
            m = pattern.search(name)
            if m is None:
                continue
            tried = [name[:m.start()] + m.expand(s) for s in spellings]
            have = self.checkpoint_names
            return next((t for t in tried if have is not None and t in have), tried[0])
        return name

    def set_absorb(self, absorb) -> None:
        """MLA weight absorption (see DeepseekV3ForCausalLM.set_absorb)."""
        for layer in self.model.layers:
            layer.self_attn.absorb = absorb
