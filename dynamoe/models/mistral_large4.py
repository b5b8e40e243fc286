"""Mistral-Large-4 (``model_type: mistral_large4``, the text model of MistralLarge4ForConditionalGeneration; or a
``mistral_large4_text`` config): DeepSeek's Multi-head Latent Attention without query LoRA (``q_proj``) and with

* LeRoPE: YaRN (x2048, attention factor 1 by default) on interleaved pairs whose frequencies are scaled by a learned
  exp(``alpha``) (one per frequency, shared by the layers); NoPE layers where ``no_rope_layers`` says 0 (default
  every 4th): there the whole head is "nope" (qk_nope + qk_rope dims) and nothing rotates;
* queries scaled per head by ``scale`` * ln(position + 1) + ``bias`` (:class:`~dynamoe.models.mla.LogPositionScale`);
* sparse attention through the DSA indexer (:mod:`dynamoe.models.indexer`) whose queries are wq_b(LayerNorm(x)),
  scaled per head the same way, roped (interleaved, on the first qk_rope_head_dim dims) on RoPE layers only;
  ``indexer_types`` 'shared' layers reuse the previous full layer's selection;
* KV sharing: a layer whose ``kv_source_layers`` entry is an earlier layer j has no ``wkv_a_with_mqa`` /
  ``kv_a_norm`` and attends to layer j's cached latents (j of the same RoPE kind);

plain RMSNorms, a dense SwiGLU MLP on the first ``first_k_dense_replace`` layers, then Mistral's MoE (softmax over the
experts, group-limited by the sum of each group's two best, top-k, always renormalised, times
``routed_scaling_factor``, plus shared experts); the logits soft-capped: c tanh(logits / c), c =
``final_logit_softcapping`` (30).

Checkpoint: Mistral's own names, which transformers also saves: ``tok_embeddings``, ``norm``, ``output``,
``lerope.alpha``, ``layers.{i}.attention.{wq, wkv_a_with_mqa, kv_a_norm, wkv_b, wo, ssmax_scaling.{s,b}}``,
``attention.indexer.{wq_b, wk, k_norm, q_input_norm, weights_proj, ssmax_scaling.{s,b}}``, ``attention_norm``,
``ffn_norm``, dense ``feed_forward.w{1,2,3}``, ``gate.weight``, ``experts.{e}.w{1,2,3}``, ``shared_experts.w{1,2,3}``
(w1 gate, w2 down, w3 up); the wrapper's vision parts (``vision_encoder.``, ``patch_merger.``,
``pre_mm_projector_norm.``, ``vision_language_adapter.``) and the draft head (``mtp_dspark.``) are not loaded; the
server refuses images naming the model.
"""
from __future__ import annotations

import re

import torch
from torch import Tensor, nn

from .base import CausalLM, DecoderLayer
from .config import ModelConfig
from .indexer import Indexer, SharedIndex
from .mla import MLAttention, SharedLatents, mla_softmax_scale
from .moe_block import GatedMLP, SparseMoeBlock, glu_kind
from .norms import RMSNorm
from .rope import RotaryEmbedding
from .weights import PerExpert

__all__ = ["MistralLarge4ForCausalLM", "LeRotaryEmbedding", "kv_sources"]


class LeRotaryEmbedding(RotaryEmbedding):
    """RoPE whose inverse frequencies are scaled by exp(``alpha``) (learned, one per frequency; LeRoPE)."""

    def __init__(self, rope, dim: int, max_position_embeddings: int):
        super().__init__(rope, dim, max_position_embeddings)
        self.alpha = nn.Parameter(torch.zeros(dim // 2, dtype=torch.float32))

    def forward(self, positions_BT: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        last = self._last
        if last is not None and last[0] is positions_BT and last[1] == dtype:
            return last[2], last[3]
        freqs = positions_BT[..., None].float() * (self.inv_freq.float() * self.alpha.float().exp())
        cos = (freqs.cos() * self.attention_scaling).to(dtype)
        sin = (freqs.sin() * self.attention_scaling).to(dtype)
        self._last = (positions_BT, dtype, cos, sin)
        return cos, sin


def kv_sources(cfg: ModelConfig) -> tuple:
    """Each layer's ``kv_source_layers`` entry (default its own index), checked as MistralLarge4TextConfig does
    (an earlier layer that owns its cache), and of the same RoPE kind with no other cache owner of that kind between
    them (transformers hands a reusing layer the latest owner of its kind)."""
    n = cfg.num_hidden_layers
    v = cfg.raw.get("kv_source_layers")
    if v is None:
        return tuple(range(n))
    if (not isinstance(v, (list, tuple)) or len(v) != n
            or any(isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= i or v[s] != s for i, s in enumerate(v))):
        raise ValueError(f"config field 'kv_source_layers' must list, for each of the {n} layers, itself or an earlier "
                         f"layer that is its own source, got {v!r}")
    owners = {s for i, s in enumerate(v) if s != i}
    for i, s in enumerate(v):
        if s == i:
            continue
        if cfg.layer_uses_rope(i) != cfg.layer_uses_rope(s):
            raise ValueError(f"config field 'kv_source_layers': layer {i} reuses layer {s}'s latents, but one of them "
                             "has RoPE and the other not (no_rope_layers)")
        between = [j for j in owners if s < j < i and cfg.layer_uses_rope(j) == cfg.layer_uses_rope(i)]
        if between:
            raise ValueError(f"config field 'kv_source_layers': layer {i} reuses layer {s}, but layer {between[0]} "
                             "in between also shares its latents with the same RoPE kind (transformers would hand "
                             "layer {i} that one's)")
    return tuple(v)


class _SoftcappedLMHead(nn.Linear):
    """nn.Linear whose logits are soft-capped: cap * tanh(logits / cap) (same parameter, same name)."""

    cap = 30.0

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(super().forward(x) / self.cap) * self.cap


# our names -> Mistral's (see the module docstring), applied in order to the part after "model.layers.{i}."
_LAYER_NAMES = (
    ("self_attn.indexer.softmax_scaling.scale", "attention.indexer.ssmax_scaling.s"),
    ("self_attn.indexer.softmax_scaling.bias", "attention.indexer.ssmax_scaling.b"),
    ("self_attn.indexer.", "attention.indexer."),
    ("self_attn.softmax_scaling.scale", "attention.ssmax_scaling.s"),
    ("self_attn.softmax_scaling.bias", "attention.ssmax_scaling.b"),
    ("self_attn.q_proj.", "attention.wq."), ("self_attn.kv_a_proj_with_mqa.", "attention.wkv_a_with_mqa."),
    ("self_attn.kv_a_layernorm.", "attention.kv_a_norm."), ("self_attn.kv_b_proj.", "attention.wkv_b."),
    ("self_attn.o_proj.", "attention.wo."), ("input_layernorm.", "attention_norm."),
    ("post_attention_layernorm.", "ffn_norm."),
    ("mlp.moe.gates.0.wg.", "gate."), ("mlp.moe.experts", "experts"),
    ("mlp.moe.shared_experts.gate_proj.", "shared_experts.w1."), ("mlp.moe.shared_experts.up_proj.", "shared_experts.w3."),
    ("mlp.moe.shared_experts.down_proj.", "shared_experts.w2."),
    ("mlp.gate_proj.", "feed_forward.w1."), ("mlp.up_proj.", "feed_forward.w3."), ("mlp.down_proj.", "feed_forward.w2."),
)
_TOP_NAMES = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
              "lm_head.weight": "output.weight", "model.rotary_emb.alpha": "lerope.alpha"}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.*)")


class MistralLarge4ForCausalLM(CausalLM):
    """Mistral-Large-4's text model (see the module docstring)."""

    expert_layout = PerExpert("w1", "w3", "w2")
    text_only_reason = "its vision tower is not loaded (dynamoe serves the Mistral-Large-4 text model only)"

    def __init__(self, config: ModelConfig, dtype=None):
        missing = [n for n in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "index_topk",
                               "index_head_dim", "index_n_heads") if getattr(config, n) is None]
        if missing:
            raise ValueError(f"config fields {missing} are required for {config.model_type!r}")
        if config.q_lora_rank is not None:
            raise ValueError(f"config field 'q_lora_rank' must be null for Mistral-Large-4 (its queries are q_proj(x)), "
                             f"got {config.q_lora_rank}")
        cap = config.raw.get("final_logit_softcapping", 30.0)
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap <= 0):
            raise ValueError(f"config field 'final_logit_softcapping' must be a number > 0 or null, got {cap!r}")
        object.__setattr__(self, "sources", kv_sources(config))
        object.__setattr__(self, "shared_index", SharedIndex())
        object.__setattr__(self, "shared_latents", SharedLatents())
        super().__init__(config, dtype)
        if cap is not None:
            self.lm_head.__class__ = _SoftcappedLMHead
            self.lm_head.cap = float(cap)

    @property
    def unused_checkpoint_prefixes(self) -> tuple:
        return ("vision_encoder.", "patch_merger.", "pre_mm_projector_norm.", "vision_language_adapter.", "mtp_dspark.")

    def build_rotary(self, cfg: ModelConfig) -> LeRotaryEmbedding:
        return LeRotaryEmbedding(cfg.rope, cfg.qk_rope_head_dim, cfg.max_position_embeddings)

    def build_attention(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> MLAttention:
        D, H, eps = cfg.hidden_size, cfg.num_attention_heads, cfg.rms_norm_eps
        rope = cfg.layer_uses_rope(i)
        n, r = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim) if rope else (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, 0)
        indexer = None
        if not (cfg.indexer_types and cfg.indexer_types[i] == "shared"):
            indexer = Indexer(D, D, cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim, cfg.index_topk, i,
                              rotary if rope else None, rope_interleaved=True, shared=self.shared_index,
                              query_norm=True, head_scale=True, dtype=dtype)
        elif i == 0:
            raise ValueError("config field 'indexer_types' must start with a 'full' layer (layer 0 is 'shared')")
        owner = i in self.sources[i + 1:]
        source = self.sources[i] if self.sources[i] != i else None
        return MLAttention(D, H, None, cfg.kv_lora_rank, n, r, cfg.v_head_dim, i, rotary if rope else None,
                           mla_softmax_scale(cfg.rope, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim),
                           rope_interleaved=True, bias=cfg.attention_bias, norm_eps=eps, indexer=indexer,
                           shared_index=self.shared_index if indexer is None else None, position_log_scale=True,
                           shared_latents=self.shared_latents if owner or source is not None else None,
                           latent_source=source, dtype=dtype)

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> DecoderLayer:
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        glu = glu_kind(cfg.hidden_act)
        if cfg.is_moe_layer(i):
            mlp = SparseMoeBlock(cfg, "softmax", normalize=True, glu=glu, num_shared_experts=cfg.n_shared_experts,
                                 router_groups=True, group_rank="top2_sum", route_scale=cfg.routed_scaling_factor,
                                 dtype=dtype)
        else:
            if cfg.intermediate_size is None:
                raise ValueError(f"config field 'intermediate_size' is required: layer {i} has a dense MLP")
            mlp = GatedMLP(D, cfg.intermediate_size, glu, dtype=dtype)
        return DecoderLayer(self.build_attention(cfg, i, rotary, dtype), mlp, RMSNorm(D, eps, dtype=dtype),
                            RMSNorm(D, eps, dtype=dtype))

    def checkpoint_name(self, name: str) -> str:
        top = _TOP_NAMES.get(name)
        if top is not None:
            return top
        m = _LAYER.fullmatch(name)
        if m is None:
            return name
        rest = m.group(2)
        for ours, theirs in _LAYER_NAMES:
            if rest.startswith(ours):
                return f"layers.{m.group(1)}.{theirs}{rest[len(ours):]}"
        return f"layers.{m.group(1)}.{rest}"

    def set_absorb(self, absorb) -> None:
        """MLA weight absorption (see DeepseekV3ForCausalLM.set_absorb)."""
        for layer in self.model.layers:
            layer.self_attn.absorb = absorb
