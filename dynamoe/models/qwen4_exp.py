"""Qwen4-Exp's text model (``model_type: qwen4_exp_text``, or the language model of the ``qwen4_exp`` vision-language
wrapper, Qwen4ExpForConditionalGeneration): Qwen3.5's hybrid decoder (:mod:`dynamoe.models.qwen3_next`) whose
``layer_types`` mix

* ``linear_attention`` -- Gated DeltaNet with Qwen3.5's split projections, its output gate through
  ``output_gate_type`` (silu or sigmoid; default ``hidden_act``);
* ``indexed_attention`` (the released configs say ``full_attention``) -- Qwen3.5's gated GQA (zero-centred q/k norms,
  RoPE on the ``partial_rotary_factor`` share of each head: the whole head by default) over the keys the QSA indexer
  keeps (:mod:`dynamoe.models.qsa_indexer`: the best ``indexer_budget / indexer_compress_ratio`` blocks of
  ``indexer_compress_ratio`` tokens plus the query's own incomplete block);

with the residual widened to ``hc_count`` streams: each sublayer reads the streams through a gated residual
(:class:`~dynamoe.models.hyper_connections.GatedStreamMixer`, no norm of its own) and adds its output to every stream
times a per-stream weight; the final collapse is one more mixer (``model.hyper_connection_mixer``, no final norm).
Every layer is MoE: softmax top-k (renormalised with ``norm_topk_prob``) plus a shared expert gated by
sigmoid(``shared_expert_gate``). The linear layers named by ``ple_layer_ids`` first add per-layer embeddings of hashed
token n-grams to the streams (:mod:`dynamoe.models.ngram_embedding`). For text the multimodal RoPE is plain RoPE.

Checkpoint: transformers' names -- ``linear_attn.*`` / ``self_attn.{q,k,v,o}_proj``, ``q_norm``, ``k_norm``,
``self_attn.indexer.{index_qk_proj, q_layernorm, k_layernorm}``, ``mlp.gate.weight``,
``mlp.experts.{e}.{gate,up,down}_proj``, ``mlp.shared_expert.*``, ``mlp.shared_expert_gate``,
``{attn,mlp}_hyper_connection.{hc_norm, input_mix_weight_down, input_mix_weight_up, block_inject_weight}``,
``ple.*`` (the n-gram table in ``ple.ple_embedding.ngram_embedding.shard_{k}`` chunks), ``model.hyper_connection_mixer``;
the wrapper keeps the text model under ``model.language_model.`` and the vision tower under ``model.visual.`` (not
loaded: the server refuses images naming the model). No fused decode kernels (hyper-connected layers).

Batch invariance: the indexer keeps the earliest of blocks whose scores tie at its budget's boundary (transformers'
``torch.topk`` an arbitrary one; see the indexer's module docstring); everything else is transformers' computation.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .attention import _sdpa, attention_mask, cached_length, write_kv
from .base import CausalLM
from .cache import KVCache
from .config import ModelConfig
from .family_fields import Qwen4Fields, qwen4_fields
from .hyper_connections import GatedStreamMixer, StreamEmbedding
from .linear_attention import GatedDeltaNet
from .ngram_embedding import DERIVED_BUFFERS, NGramEmbedding, PerLayerEmbedding
from .qsa_indexer import QSAIndexer
from .qwen3_next import GatedAttention, SharedExpertMoeBlock
from .rope import RotaryEmbedding
from .weights import PerExpert
from .wrapped import TextOfWrapper, WrapperLayout

__all__ = ["Qwen4ExpForCausalLM", "QSAGatedAttention", "Qwen4DecoderLayer"]


class QSAGatedAttention(GatedAttention):
    """:class:`~dynamoe.models.qwen3_next.GatedAttention` over the keys its ``indexer`` (:class:`QSAIndexer`) keeps."""

    def __init__(self, *args, indexer: QSAIndexer, **kwargs):
        super().__init__(*args, **kwargs)
        self.indexer = indexer

    def forward(self, x_BTD: Tensor, positions_BT: Tensor, cache: KVCache | None = None, slots: Tensor | None = None,
                kv_len: int | None = None) -> Tensor:
        B, T, _ = x_BTD.shape
        H, d = self.num_heads, self.head_dim
        if cache is not None:
            kv_len = cached_length(positions_BT, slots, kv_len)
        allowed = self.indexer(x_BTD, positions_BT, cache, slots, kv_len)              # [B, 1, T, L] or None
        q, k, v, gate = self.gated_heads(x_BTD, positions_BT)
        if allowed is None:
            out = self.attend_cached(q, k, v, positions_BT, cache, slots, kv_len)
        else:
            k_pos = positions_BT
            if cache is not None:
                kv = write_kv(cache, self.layer_idx, slots, positions_BT, kv_len, k=k, v=v)
                k, v = kv["k"], kv["v"]
                k_pos = torch.arange(kv_len, device=x_BTD.device).expand(B, kv_len)
            out = _sdpa(q, k, v, allowed & attention_mask(positions_BT, k_pos, None), self.scale, causal=False)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, H * d) * torch.sigmoid(gate.reshape(B, T, H * d)))


class _ForwardState:
    """The token ids of the forward running (set by the model's forward, cleared after): the PLE layers read them."""

    def __init__(self):
        self.input_ids: Tensor | None = None


class Qwen4DecoderLayer(nn.Module):
    """[h += ple(h, ids)]; h = attn_hyper_connection.residual(mixer(x)); h = mlp_hyper_connection.residual(mlp(x)),
    x each time the mixer's collapse of the streams h [B, T, N, D] (names as transformers': ``linear_attn`` or
    ``self_attn``, ``mlp``, ``ple``, ``attn_hyper_connection``, ``mlp_hyper_connection``)."""

    def __init__(self, mixer: nn.Module, mlp: nn.Module, attn_hc: GatedStreamMixer, mlp_hc: GatedStreamMixer,
                 ple: PerLayerEmbedding | None, state: _ForwardState):
        super().__init__()
        if isinstance(mixer, GatedDeltaNet):
            self.linear_attn = mixer
        else:
            self.self_attn = mixer
        self.mlp, self.attn_hyper_connection, self.mlp_hyper_connection, self.ple = mlp, attn_hc, mlp_hc, ple
        object.__setattr__(self, "state", state)

    @property
    def mixer(self) -> nn.Module:
        mixer = self._modules.get("linear_attn")
        return self._modules["self_attn"] if mixer is None else mixer

    def forward(self, h_BTND: Tensor, positions_BT: Tensor, cache: KVCache | None = None, slots: Tensor | None = None,
                kv_len: int | None = None) -> Tensor:
        if self.ple is not None:
            ids = self.state.input_ids
            if ids is None:
                raise RuntimeError("a Qwen4-Exp layer with per-layer embeddings runs inside the model's forward only "
                                   "(it reads the forward's token ids)")
            h_BTND = h_BTND + self.ple(h_BTND, ids, positions_BT, cache, slots)
        x, inject = self.attn_hyper_connection(h_BTND)
        h_BTND = GatedStreamMixer.residual(h_BTND, inject, self.mixer(x, positions_BT, cache, slots, kv_len))
        x, inject = self.mlp_hyper_connection(h_BTND)
        return GatedStreamMixer.residual(h_BTND, inject, self.mlp(x))


class Qwen4ExpForCausalLM(TextOfWrapper, CausalLM):
    """Qwen4-Exp's text model (see the module docstring)."""

    #: per-sequence recurrent state (Gated DeltaNet, the PLE convolutions and n-gram context): no prefix reuse
    recurrent_state = True
    #: ... but speculative decoding can cut it back past rejected drafts: its layers record their state after every
    #: token of a verification forward (dynamoe.models.cache.KVCache.begin_history)
    recurrent_rollback = True
    checkpoint_renames = (("model.norm.", "model.hyper_connection_mixer."), (".mlp.moe.gates.0.wg.", ".mlp.gate."),
                          (".mlp.moe.", ".mlp."))
    expert_layout = PerExpert("gate_proj", "up_proj", "down_proj")
    use_decode_plan = False   # (hyper-connected layers: no fused kernels to lay out)
    wrapper_layouts = {"qwen4_exp": WrapperLayout("model.language_model.", unused=("model.visual.",))}
    #: chunk length of the prefill's delta rule (any value gives the same result up to rounding)
    chunk_size = 64

    def __init__(self, config: ModelConfig, dtype=None):
        fields = qwen4_fields(config)
        object.__setattr__(self, "fields", fields)
        object.__setattr__(self, "state", _ForwardState())
        super().__init__(config, dtype)
        self.model.embed_tokens.__class__ = StreamEmbedding
        self.model.embed_tokens.streams = fields.hc_count

    @property
    def text_only_reason(self) -> str | None:
        """What the server tells a request with an image: the wrapper's vision tower is not loaded (a qwen4_exp_text
        checkpoint has none: the server's generic answer)."""
        if self.config.model_type == "qwen4_exp":
            return "its vision tower is not loaded (dynamoe serves the Qwen4-Exp text model only)"
        return None

    def build_norm(self, cfg: ModelConfig, dim: int, dtype) -> GatedStreamMixer:
        """The final collapse of the streams (``model.hyper_connection_mixer`` on disk): no norm follows it."""
        f: Qwen4Fields = self.fields
        return GatedStreamMixer(dim, f.hc_count, f.hc_lowrank, cfg.rms_norm_eps, inject=False, dtype=dtype)

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> Qwen4DecoderLayer:
        f: Qwen4Fields = self.fields
        D, eps, kind = cfg.hidden_size, cfg.rms_norm_eps, cfg.layer_types[i]
        if kind == "linear_attention":
            mixer = GatedDeltaNet(D, cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                  cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim, i, eps, projection="split",
                                  activation=cfg.hidden_act, chunk_size=self.chunk_size,
                                  checks_position=i == cfg.layer_types.index(kind), dtype=dtype,
                                  gate_activation=f.output_gate_type)
        else:
            indexer = QSAIndexer(D, cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk, f.indexer_compress_ratio, i,
                                 rotary, eps, dtype=dtype)
            mixer = QSAGatedAttention(D, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, i, rotary,
                                      bias=cfg.attention_bias, norm_eps=eps, dtype=dtype, indexer=indexer)
        ple = None
        if i in f.ple_layers:
            k = f.ple_layers.index(i)
            table = NGramEmbedding(cfg.vocab_size, f.ple_embed_dim, f.ngram_size, f.heads_per_ngram,
                                   f.ngram_vocab_size_base, f.make_ngram_vocab_size_divisible_by, f.split_ngram_parts,
                                   k, f.seed, dtype=dtype)
            ple = PerLayerEmbedding(D, f.hc_count, f.ple_embed_dim, f.ple_conv_kernel_size, f.ple_eos, i,
                                    table, eps, dtype=dtype)
        hcs = [GatedStreamMixer(D, f.hc_count, f.hc_lowrank, eps, dtype=dtype) for _ in range(2)]
        return Qwen4DecoderLayer(mixer, SharedExpertMoeBlock(cfg, cfg.norm_topk_prob, dtype=dtype), *hcs, ple,
                                 self.state)

    def ignores_checkpoint_tensor(self, name: str) -> bool:
        """The n-gram tables' hash buffers: functions of the config (see :mod:`dynamoe.models.ngram_embedding`)."""
        return ".ple.ple_embedding." in name and name.rsplit(".", 1)[-1] in DERIVED_BUFFERS

    def forward(self, input_ids: Tensor, cache: KVCache | None = None, slots: Tensor | None = None,
                logits_to_keep: int = 0, return_hidden: bool = False):
        self.state.input_ids = input_ids
        try:
            return super().forward(input_ids, cache, slots, logits_to_keep, return_hidden)
        finally:
            self.state.input_ids = None
