"""dots3_note's text model (``model_type: dots3_note``, Dots3NoteForConditionalGeneration; or a ``dots3_note_text``
config, Dots3NoteForCausalLM): Multi-head Latent Attention on every layer (:mod:`dynamoe.models.mla`) -- query LoRA,
the queries and the normalised latent scaled by sqrt(D / q_lora_rank) and sqrt(D / kv_lora_rank), an RMSNorm on the
rotary key before RoPE (interleaved pairs), each head's output times sigmoid(``g_proj``(x)) -- of three kinds
(``layer_types``): 'indexed_attention' sparse through the DSA indexer (interleaved RoPE on its first dims),
'full_attention' (``use_dsa`` false) causal, 'sliding_attention' over the last ``sliding_window`` positions with its
own MLA sizes (``per_layer_config``, else the ``swa_*`` fields) and RoPE base; dense SwiGLU MLPs where
``mlp_layer_types`` (or the hub's ``first_k_dense_replace`` / ``moe_layer_freq``) says 'dense', DeepSeek-V3's MoE
elsewhere (sigmoid scores, selection bias, group-limited top-k, renormalised, times ``routed_scaling_factor``) with
``n_shared_experts`` x ``shared_experts_intermediate_size`` of shared experts.

Checkpoint: transformers' names (DeepSeek-V3.2's attention names plus ``self_attn.g_proj``,
``self_attn.k_rope_only_layernorm``; ``mlp.gate``, ``mlp.experts.{e}.{gate,up,down}_proj``, ``mlp.shared_experts``);
the wrapper's files keep the text model under ``model.`` as well (``lm_head`` at the top) beside the hub's
``vision_encoder.`` and ``audio_encoder.`` (not loaded; the server refuses images naming the model). No fused decode
kernels (MLA has none).

Multi-token prediction: the layer ``model.layers.{N}`` (``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``,
a dots3 decoder layer) with its embedding under ``model.mtp.embed_tokens`` loads as the ``mtp`` head
(:mod:`dynamoe.models.mtp`; the engine drafts with it, ``draft="mtp"``) as vLLM's Dots3NoteMTP computes it: DeepSeek's
head with its output ``shared_head.norm``'d (what a further draft reads) and the model's lm_head; the layer's
attention kind from the config's layer_types entry past num_hidden_layers (else DSA where it has indexer tensors;
else it is not loaded, and the log says so), a dense MLP unless it has a router.
"""
from __future__ import annotations

import logging

from torch import nn

from .base import CausalLM, DecoderLayer
from .config import ModelConfig, dots3_layer_sizes
from .deepseek_v3 import DEEPSEEK_RENAMES
from .indexer import Indexer
from .mla import MLAttention
from .moe_block import GatedMLP, SparseMoeBlock, glu_kind
from .mtp import MTPHeads, NextTokenPredictor
from .norms import RMSNorm
from .rope import RotaryEmbedding
from .weights import PerExpert
from .wrapped import TextOfWrapper, WrapperLayout

log = logging.getLogger(__name__)

__all__ = ["Dots3NoteForCausalLM"]


class Dots3NoteForCausalLM(TextOfWrapper, MTPHeads, CausalLM):
    """dots3_note's text model (see the module docstring)."""

    checkpoint_renames = DEEPSEEK_RENAMES
    expert_layout = PerExpert("gate_proj", "up_proj", "down_proj")
    wrapper_layouts = {"dots3_note": WrapperLayout("model.", unused=("vision_encoder.", "audio_encoder."))}
    text_only_reason = ("its vision and audio towers are not loaded (dynamoe serves the dots3_note text model only)")

    def __init__(self, config: ModelConfig, dtype=None):
        missing = [n for n in ("index_topk", "index_head_dim", "index_n_heads") if getattr(config, n) is None]
        if missing and "indexed_attention" in config.layer_types:
            raise ValueError(f"config fields {missing} are required: layer_types has 'indexed_attention'")
        raw = config.raw
        width = raw.get("moe_shared_expert_intermediate_size", raw.get("shared_experts_intermediate_size"))
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ValueError(f"config field 'shared_experts_intermediate_size' must be an int >= 1, got {width!r}")
        if config.n_shared_experts < 1:
            raise ValueError(f"config field 'n_shared_experts' must be >= 1 for dots3_note, got {config.n_shared_experts}")
        object.__setattr__(self, "layer_sizes", dots3_layer_sizes(raw, config.layer_types))
        object.__setattr__(self, "shared_width", width * config.n_shared_experts)
        super().__init__(config, dtype)

    @property
    def unused_checkpoint_prefixes(self) -> tuple:
        # (with a head, model.mtp.embed_tokens is its embedding: read)
        return TextOfWrapper.unused_checkpoint_prefixes.fget(self) + (() if self.has_mtp else ("model.mtp.",))

    def build_rotary(self, cfg: ModelConfig) -> nn.ModuleDict:
        rotary = nn.ModuleDict()
        for kind, rope in cfg.rope_by_layer_type:
            sizes = self.layer_sizes[cfg.layer_types.index(kind)]
            rotary[kind] = RotaryEmbedding(rope, sizes["qk_rope_head_dim"], cfg.max_position_embeddings)
        return rotary

    def build_attention(self, cfg: ModelConfig, i: int, rotary, dtype, kind: str | None = None,
                        s: dict | None = None) -> MLAttention:
        """Layer i's MLA (``kind`` / ``s``: its kind and sizes, given for a layer past the decoder's)."""
        kind = cfg.layer_types[i] if kind is None else kind
        s, D = self.layer_sizes[i] if s is None else s, cfg.hidden_size
        rope = rotary[kind]
        if rope.dim != s["qk_rope_head_dim"]:
            raise ValueError(f"layer {i}: qk_rope_head_dim {s['qk_rope_head_dim']} differs from its layer type's "
                             f"rotary dims {rope.dim}")
        indexer = None
        if kind == "indexed_attention":
            indexer = Indexer(D, s["q_lora_rank"], cfg.index_n_heads, cfg.index_head_dim, s["qk_rope_head_dim"],
                              cfg.index_topk, i, rope, rope_interleaved=True, dtype=dtype)
        qk = s["qk_nope_head_dim"] + s["qk_rope_head_dim"]
        return MLAttention(D, s["num_attention_heads"], s["q_lora_rank"], s["kv_lora_rank"], s["qk_nope_head_dim"],
                           s["qk_rope_head_dim"], s["v_head_dim"], i, rope, qk ** -0.5, rope_interleaved=True,
                           bias=cfg.attention_bias, norm_eps=cfg.rms_norm_eps, indexer=indexer,
                           lora_scales=((D / s["q_lora_rank"]) ** 0.5, (D / s["kv_lora_rank"]) ** 0.5),
                           sliding_window=cfg.sliding_window if kind == "sliding_attention" else None,
                           head_gate=True, k_rope_norm=True, dtype=dtype)

    def build_layer(self, cfg: ModelConfig, i: int, rotary, dtype, kind: str | None = None, sizes: dict | None = None,
                    moe: bool | None = None) -> DecoderLayer:
        """Decoder layer i (``kind`` / ``sizes`` / ``moe``: given for a layer past the decoder's, an MTP layer)."""
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        glu = glu_kind(cfg.hidden_act)
        if cfg.is_moe_layer(i) if moe is None else moe:
            mlp = SparseMoeBlock(cfg, "sigmoid", normalize=cfg.norm_topk_prob, glu=glu, num_shared_experts=1,
                                 shared_hidden_size=self.shared_width, dtype=dtype)
        else:
            mlp = GatedMLP(D, cfg.intermediate_size, glu, dtype=dtype)
        return DecoderLayer(self.build_attention(cfg, i, rotary, dtype, kind, sizes), mlp,
                            RMSNorm(D, eps, dtype=dtype), RMSNorm(D, eps, dtype=dtype))

    # ---- multi-token prediction (model.layers.{N + j}; dynamoe.models.mtp) ------------------------------
    def build_mtp_layer(self, cfg: ModelConfig, i: int, rotary, dtype, names: set) -> DecoderLayer | None:
        """The MTP layer i as vLLM's Dots3NoteMTP builds it: its attention kind from the config's layer_types entry i
        (a list of num_hidden_layers + num_nextn_predict_layers entries: ``mtp_layer_entries``), else 'indexed_attention'
        where it has indexer tensors; its MLA sizes: per_layer_config entry i, else those of the decoder's layers of its
        kind (vLLM: the swa_* fields for a sliding one); a dense MLP unless it has a router. None (logged) where its kind is not known."""
        j = i - cfg.num_hidden_layers
        listed = (cfg.raw.get("mtp_layer_entries") or {}).get("layer_types")
        kind = listed[j] if isinstance(listed, (list, tuple)) and j < len(listed) else None
        pre = self.mtp_checkpoint_name(j, "block.")[len(self.checkpoint_prefix):]
        if kind is None and pre + "self_attn.indexer.wk.weight" in names:
            kind = "indexed_attention"
        if kind not in ("full_attention", "indexed_attention", "sliding_attention"):
            log.info("dots3_note: multi-token-prediction layer %s not loaded: its attention kind (full or sliding) is "
                     "known only from a layer_types entry %d (num_hidden_layers + num_nextn_predict_layers entries) "
                     "and the config has %r", pre[:-1], i, kind)
            return None
        if kind == "indexed_attention" and cfg.index_topk is None:
            raise ValueError("config fields index_topk / index_head_dim / index_n_heads are required: the "
                             "multi-token-prediction layer is 'indexed_attention'")
        same = [n for n, t in enumerate(cfg.layer_types) if t == kind]
        if str(i) in (cfg.raw.get("per_layer_config") or {}) or not same:
            sizes = dots3_layer_sizes(cfg.raw, (*cfg.layer_types, *([kind] * (j + 1))))[i]
        else:   # (vLLM: the swa_* sizes for a sliding one, the top-level ones else: those of the layers of its kind)
            sizes = self.layer_sizes[same[-1]]
        moe = pre + "mlp.gate.weight" in names
        return self.build_layer(cfg, i, rotary, dtype, kind=kind, sizes=sizes, moe=moe)

    def new_mtp_head(self, cfg: ModelConfig, block: DecoderLayer, dtype) -> NextTokenPredictor:
        # vLLM's Dots3NoteMTP (DeepSeek-V3.2's head): its output is shared_head.norm'd -- what a further draft reads
        return NextTokenPredictor(block, cfg.hidden_size, cfg.vocab_size, cfg.rms_norm_eps, dtype=dtype,
                                  norm_output=True)

    def _mtp_name(self, j: int, rest: str) -> str:
        if rest.startswith("embed_tokens.") and j == 0:   # the hub keeps the head's embedding apart
            return "model.mtp." + rest
        return super()._mtp_name(j, rest)

    def set_absorb(self, absorb) -> None:
        """MLA weight absorption (see DeepseekV3ForCausalLM.set_absorb)."""
        for layer in self.model.layers:
            layer.self_attn.absorb = absorb
