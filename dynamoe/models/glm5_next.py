"""GLM-5.3 (``model_type: glm5_next``, the text model of Glm5NextForConditionalGeneration; or a ``glm5_next_text``
config): a hybrid decoder whose ``layer_types`` mix

* ``linear_attention`` -- Kimi Delta Attention (:class:`~dynamoe.models.kda.KimiDeltaAttention`) with the "safe"
  bounded decay g = ``linear_lower_bound`` * sigmoid(exp(A_log) * (f_b(f_a(x)) + dt_bias)) (softplus form when the
  bound is null); a conv window and a recurrent state per sequence (no prefix reuse);
* ``indexed_attention`` -- Multi-head Latent Attention without position encoding (qk_rope_head_dim 0, softmax scale
  qk_nope_head_dim^-1/2), sparse through the pooled indexer (:mod:`dynamoe.models.kpool_indexer`: pools of
  ``index_kpool`` keys, the best ``index_topk / index_kpool`` kept, plus the query's own open pool); 'shared'
  ``indexer_types`` layers reuse the previous full layer's selection;

with the residual widened to ``hc_mult`` streams joined by hyper-connections
(:mod:`dynamoe.models.hyper_connections`; the final collapse is the streams' mean), plain RMSNorms, dense SwiGLU
MLPs on the 'dense' ``mlp_layer_types`` (default: the first three) and DeepSeek-V3's MoE elsewhere (sigmoid scores,
selection-only bias, group-limited top-k, renormalised, times ``routed_scaling_factor``, plus shared experts); every
SwiGLU (dense, routed, shared) clamps its gate above and its up projection to +-``swiglu_limit`` before the product.

Checkpoint: the wrapper keeps the text model under ``model.language_model.`` (``lm_head`` at the top) and the vision
tower under ``model.visual.`` (not loaded; the server refuses images naming the model); transformers' names
(``self_attn.{q,k,v}_proj``, ``{q,k,v}_conv1d``, ``f_a_proj``, ``f_b_proj``, ``dt_bias``, ``A_log`` [H], ``b_proj``,
``g_a_proj``, ``g_b_proj``, ``o_norm``, ``o_proj`` or MLA's with ``indexer.*``; ``hc_{attn,ffn}_{fn,base,scale}``;
``mlp.gate.weight``, ``mlp.gate.e_score_correction_bias``, ``mlp.experts.{e}.{gate,up,down}_proj``,
``mlp.shared_experts.*``, dense ``mlp.*_proj``). No fused decode kernels: the layers are hyper-connected (their own
forward) and the clamped SwiGLU has no kernel.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from .base import CausalLM
from .config import ModelConfig
from .deepseek_v3 import DEEPSEEK_RENAMES
from .hyper_connections import HyperConnection, HyperDecoderLayer, StreamEmbedding
from .indexer import SharedIndex
from .kda import KimiDeltaAttention
from .kpool_indexer import KPoolIndexer
from .mla import MLAttention
from .moe_block import GatedMLP, SparseMoeBlock
from .norms import RMSNorm
from .weights import PerExpert
from .wrapped import TextOfWrapper, WrapperLayout

__all__ = ["Glm5NextForCausalLM", "Glm5Fields", "glm5_fields"]


@dataclass(frozen=True)
class Glm5Fields:
    """GLM-5.3's own values (see :func:`glm5_fields`)."""

    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    linear_lower_bound: float | None
    index_kpool: int


def _number(raw: dict, name: str, default, kind=int, allow_none: bool = False):
    v = raw.get(name, default)
    if v is None and allow_none:
        return None
    ok = isinstance(v, int) and v >= 1 if kind is int else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok:
        raise ValueError(f"config field {name!r} must be {'an int >= 1' if kind is int else 'a number'}, got {v!r}")
    return kind(v)


def glm5_fields(cfg: ModelConfig) -> Glm5Fields:
    """The hyper-connection sizes, KDA's decay bound (``linear_attn_config.gate_lower_bound`` wins; with its
    ``safe_gate`` (default true) a null bound is -5) and the indexer's pool size, as Glm5NextTextConfig reads them."""
    raw = cfg.raw
    bound = _number(raw, "linear_lower_bound", -5.0, float, allow_none=True)
    nested = raw.get("linear_attn_config")
    if nested is not None:
        if not isinstance(nested, dict):
            raise ValueError(f"config field 'linear_attn_config' must be a dict, got {nested!r}")
        if "gate_lower_bound" in nested:
            bound = _number(nested, "gate_lower_bound", None, float, allow_none=True)
        if nested.get("safe_gate", True) and bound is None:
            bound = -5.0
    if bound is not None and bound >= 0:
        raise ValueError(f"config field 'linear_lower_bound' must be < 0 (the decay's lower bound) or null, got {bound}")
    if raw.get("index_kpool_always_select_tail", True) is not True:
        raise ValueError("config field 'index_kpool_always_select_tail' must be true: without its open pool a query "
                         "before the first complete pool would see no key at all (transformers' eager path then "
                         "attends everywhere); dynamoe does not reproduce that")
    return Glm5Fields(_number(raw, "hc_mult", 4), _number(raw, "hc_sinkhorn_iters", 20),
                      _number(raw, "hc_eps", 1e-6, float), bound, _number(raw, "index_kpool", 16))


class StreamMeanNorm(RMSNorm):
    """The streams [B, T, N, D] averaged, then the model's RMSNorm."""

    def forward(self, h: Tensor) -> Tensor:
        return super().forward(h.mean(dim=-2))


class Glm5NextForCausalLM(TextOfWrapper, CausalLM):
    """GLM-5.3's text model (see the module docstring)."""

    #: per-sequence recurrent state (the KDA layers): no prefix reuse, see dynamoe.models.linear_attention
    recurrent_state = True
    #: ... but speculative decoding can cut it back past rejected drafts: its layers record their state after every
    #: token of a verification forward (dynamoe.models.cache.KVCache.begin_history)
    recurrent_rollback = True
    checkpoint_renames = ((".attn_hc.", ".hc_attn_"), (".ffn_hc.", ".hc_ffn_")) + DEEPSEEK_RENAMES
    expert_layout = PerExpert("gate_proj", "up_proj", "down_proj")
    use_decode_plan = False   # (hyper-connected layers: no fused kernels to lay out)
    wrapper_layouts = {"glm5_next": WrapperLayout("model.language_model.", unused=("model.visual.",))}
    text_only_reason = "its vision tower is not loaded (dynamoe serves the GLM-5.3 text model only)"
    #: chunk length of the prefill's delta rule (any value gives the same result up to rounding)
    chunk_size = 64

    def __init__(self, config: ModelConfig, dtype=None):
        missing = [n for n in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "index_topk",
                               "index_head_dim", "index_n_heads") if getattr(config, n) is None]
        if missing:
            raise ValueError(f"config fields {missing} are required for {config.model_type!r}")
        if config.qk_rope_head_dim:
            raise ValueError(f"config field 'qk_rope_head_dim' must be 0 for GLM-5.3 (its MLA has no position "
                             f"encoding), got {config.qk_rope_head_dim}")
        object.__setattr__(self, "fields", glm5_fields(config))
        object.__setattr__(self, "shared_index", SharedIndex())
        super().__init__(config, dtype)
        self.model.embed_tokens.__class__ = StreamEmbedding
        self.model.embed_tokens.streams = self.fields.hc_mult

    def build_rotary(self, cfg: ModelConfig) -> None:
        return None  # NoPE: no layer rotates anything

    def build_norm(self, cfg: ModelConfig, dim: int, dtype) -> StreamMeanNorm:
        return StreamMeanNorm(dim, cfg.rms_norm_eps, dtype=dtype)

    def build_mixer(self, cfg: ModelConfig, i: int, dtype):
        kind, D, eps = cfg.layer_types[i], cfg.hidden_size, cfg.rms_norm_eps
        if kind == "linear_attention":
            return KimiDeltaAttention(D, cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_conv_kernel_dim,
                                      i, eps, activation=cfg.hidden_act, chunk_size=self.chunk_size,
                                      checks_position=i == cfg.layer_types.index(kind),
                                      gate_lower_bound=self.fields.linear_lower_bound,
                                      a_log_shape=(cfg.linear_num_key_heads,), dtype=dtype)
        if kind != "indexed_attention":
            raise ValueError(f"config field 'layer_types' entry {i} must be 'linear_attention' or 'indexed_attention' "
                             f"(or 'full_attention') for {cfg.model_type}, got {kind!r}")
        indexer = shared = None
        if cfg.indexer_types and cfg.indexer_types[i] == "shared":
            if not any(t == "indexed_attention" and (not cfg.indexer_types or cfg.indexer_types[j] == "full")
                       for j, t in enumerate(cfg.layer_types[:i])):
                raise ValueError(f"config field 'indexer_types' entry {i} is 'shared' but no earlier attention layer "
                                 "runs a full indexer")
            shared = self.shared_index
        else:
            indexer = KPoolIndexer(D, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk,
                                   self.fields.index_kpool, i, self.shared_index, dtype=dtype)
        return MLAttention(D, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, 0,
                           cfg.v_head_dim, i, None, cfg.qk_nope_head_dim ** -0.5, bias=cfg.attention_bias,
                           norm_eps=eps, indexer=indexer, shared_index=shared, dtype=dtype)

    def build_mlp(self, cfg: ModelConfig, i: int, dtype):
        limit = cfg.swiglu_limit
        glu = "silu" if limit is None else "silu_clamp_in"
        if cfg.is_moe_layer(i):
            return SparseMoeBlock(cfg, "sigmoid", normalize=cfg.norm_topk_prob, glu=glu,
                                  num_shared_experts=cfg.n_shared_experts, glu_limit=limit, dtype=dtype)
        if cfg.intermediate_size is None:
            raise ValueError(f"config field 'intermediate_size' is required: layer {i} has a dense MLP")
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, glu, limit=limit or 7.0, dtype=dtype)

    def build_layer(self, cfg: ModelConfig, i: int, rotary, dtype) -> HyperDecoderLayer:
        f, D, eps = self.fields, cfg.hidden_size, cfg.rms_norm_eps
        hcs = [HyperConnection(D, f.hc_mult, f.hc_sinkhorn_iters, f.hc_eps, eps) for _ in range(2)]
        return HyperDecoderLayer(self.build_mixer(cfg, i, dtype), self.build_mlp(cfg, i, dtype),
                                 RMSNorm(D, eps, dtype=dtype), RMSNorm(D, eps, dtype=dtype), *hcs)

    def set_absorb(self, absorb) -> None:
        """MLA weight absorption for the attention layers (see DeepseekV3ForCausalLM.set_absorb)."""
        for layer in self.model.layers:
            if isinstance(layer.self_attn, MLAttention):
                layer.self_attn.absorb = absorb

