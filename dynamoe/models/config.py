"""A checkpoint's ``config.json`` parsed once into typed dataclasses (:class:`ModelConfig`, :class:`RopeConfig`).

Both config styles are accepted and give the same result:

* hub style: ``rope_theta`` at the top, ``rope_scaling: {type | rope_type, factor, ...}`` (or null);
* transformers-5 style: ``rope_parameters: {rope_type, rope_theta, factor, ...}``.

The expert count is read from ``num_experts`` / ``num_local_experts`` / ``n_routed_experts``
(whichever is present). Fields that only some families use (DeepSeek's MLA ranks, GLM's groups, the
V3.2 indexer) are parsed here too, so a family module reads typed values, never the raw dict; the raw
dict stays on ``ModelConfig.raw`` for anything a later family needs before it gets a typed field.

A multimodal wrapper's config (:data:`TEXT_WRAPPERS`: Kimi-K2.5, Qwen3.5-MoE, Qwen3-VL-MoE, GLM-4.5V,
Qwen3-Omni, ...) nests its language model under ``text_config`` (Qwen3-Omni: ``thinker_config.text_config``):
:func:`unwrap_text_config` flattens it, one path for every wrapper, and the result parses as the text model
(``text_config_nested`` records that its weights sit where the wrapper keeps them).

Family defaults that transformers applies in its config classes (``rms_norm_eps``, expert counts and
top-k, ``max_position_embeddings``, GPT-OSS's YaRN, ``swiglu_limit`` and alternating sliding layers,
per-family ``rope_theta``, ...) live in ``_FAMILY_DEFAULTS`` below, so a config.json that omits them
parses as transformers reads it (tests/test_models_config_defaults.py compares every field).
"""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from .unsupported import refusal

log = logging.getLogger(__name__)

__all__ = ["ModelConfig", "RopeConfig", "SSMConfig", "NEMOTRON_BLOCKS", "ROPE_TYPES", "LAYER_TYPES", "MLP_LAYER_TYPES", "INDEXER_TYPES", "parse_rope",
           "TEXT_WRAPPERS", "TextWrapper", "unwrap_text_config", "Gemma4Layer", "gemma4_attention_layers",
           "inkling_attention_sizes", "Qwen4Fields", "qwen4_fields"]

# 'proportional' (Gemma 4's global layers): RoPE over the whole head whose first partial_rotary_factor share of
# frequency pairs rotate (exponents over the whole head dim) and the rest stand still
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope", "proportional")
# 'chunked_attention' (Llama-4's local attention within chunks of attention_chunk_size positions) is a layer type
# of the families that build it only (their _FAMILY_DEFAULTS entry says "chunked_layers"): anywhere else it is
# refused, not read as full attention
# 'indexed_attention': DeepSeek-V3.2 / GLM-5 MLA with the sparse-attention indexer (full causal otherwise);
# 'linear_attention': Qwen3-Next / Qwen3.5 Gated DeltaNet (a recurrent state per sequence, no KV cache)
LAYER_TYPES = ("full_attention", "sliding_attention", "indexed_attention", "linear_attention")
MLP_LAYER_TYPES = ("dense", "sparse")
INDEXER_TYPES = ("full", "shared")
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")

@dataclass(frozen=True)
class TextWrapper:
    """How a multimodal wrapper's config.json holds its language model (see :func:`unwrap_text_config`).

    ``path``: the sub-config keys from the top level down to the text model's config; ``text_types``: the
    text model types it may hold (the first is the default when that config names none); ``tie_default``:
    the wrapper config class's ``tie_word_embeddings`` when the file omits it (the flag of the level right
    above the text config ties the wrapper's lm_head in transformers); ``tie_from_text``: a text config's
    own ``tie_word_embeddings: true`` ties too (GLM-4.5V's rule for configs saved before transformers 5);
    ``tie_by_text``: only the text config's own flag decides (default false), the wrapper's is not read
    (Llama-4: its language model is a model of its own that ties by its own config)."""

    path: tuple
    text_types: tuple
    tie_default: bool = False
    tie_from_text: bool = False
    tie_by_text: bool = False
    #: a key older configs nest the text model under instead of ``path`` (one level; read when ``path`` is absent or
    #: null, whatever model_type it says: the wrapper's text config class takes it as its own), and fields those
    #: configs keep on the wrapper that belong to the text model
    legacy_key: str = ""
    legacy_fields: tuple = ()


#: multimodal checkpoints whose config.json nests the text model (dynamoe loads the text model only):
#: outer model_type -> where and what it is
TEXT_WRAPPERS: dict[str, TextWrapper] = {
    "kimi_k25": TextWrapper(("text_config",), ("deepseek_v3", "kimi_k2"), tie_default=True),
    "qwen3_5_moe": TextWrapper(("text_config",), ("qwen3_5_moe_text",)),
    "qwen3_vl_moe": TextWrapper(("text_config",), ("qwen3_vl_moe_text",)),
    "glm4v_moe": TextWrapper(("text_config",), ("glm4v_moe_text",), tie_from_text=True),
    "qwen3_omni_moe_thinker": TextWrapper(("text_config",), ("qwen3_omni_moe_text",)),
    "qwen3_omni_moe": TextWrapper(("thinker_config", "text_config"), ("qwen3_omni_moe_text",)),
    "llama4": TextWrapper(("text_config",), ("llama4_text",), tie_by_text=True),
    # (Step3p7ForConditionalGeneration ties by the wrapper's flag alone, default false)
    "step3p7": TextWrapper(("text_config",), ("step3p5",)),
    # (AriaForConditionalGeneration ties by the wrapper's flag alone, default false)
    "aria": TextWrapper(("text_config",), ("aria_text",)),
    "minimax_m3_vl": TextWrapper(("text_config",), ("minimax_m3_vl_text",)),
    "glm5_next": TextWrapper(("text_config",), ("glm5_next_text",)),
    "mistral_large4": TextWrapper(("text_config",), ("mistral_large4_text",)),
    "dots3_note": TextWrapper(("text_config",), ("dots3_note_text",)),
    "hy_v4_vl": TextWrapper(("text_config",), ("hy_v4_vl_text",)),
    # (Qwen4ExpForConditionalGeneration ties by the wrapper's flag, default false)
    "qwen4_exp": TextWrapper(("text_config",), ("qwen4_exp_text",)),
    # (DeepseekOcr2ForConditionalGeneration ties by the wrapper's flag, default false)
    "deepseek_ocr2": TextWrapper(("text_config",), ("deepseek_ocr2_text",)),
    # (UnlimitedOcrForConditionalGeneration ties by the wrapper's flag, default false; the hub's config nests the text
    # model under language_config and keeps sliding_window on the wrapper, as UnlimitedOcrConfig reads it)
    "unlimited_ocr": TextWrapper(("text_config",), ("unlimited_ocr_text",), legacy_key="language_config",
                                 legacy_fields=("sliding_window",)),
    # (Ernie4_5_VLMoeForConditionalGeneration ties by the wrapper's flag, default true)
    "ernie4_5_vl_moe": TextWrapper(("text_config",), ("ernie4_5_vl_moe_text",), tie_default=True),
    # (MuseSparkConfig has no tie flag: its text config's decides)
    "muse_spark": TextWrapper(("text_config",), ("muse_spark_text",), tie_by_text=True),
    # (InklingForConditionalGeneration never ties: inkling_text ignores the flag)
    "inkling_mm_model": TextWrapper(("text_config",), ("inkling_text",)),
    # (Inkling2ForConditionalGeneration never ties: inkling2_text ignores the flag)
    "inkling2": TextWrapper(("text_config",), ("inkling2_text",)),
    "inkling2_loop": TextWrapper(("text_config",), ("inkling2_loop_text",)),
    # (Gemma4ForConditionalGeneration ties by the wrapper's flag, default true)
    "gemma4": TextWrapper(("text_config",), ("gemma4_text",), tie_default=True),
    # Nemotron-3-Nano-Omni (NemotronH_Omni_Reasoning_V3): its language model is a NemotronHForCausalLM, which never
    # ties (nemotron_h ignores the flag); released configs nest it under llm_config (the config class's legacy name)
    "nemotron_h_omni": TextWrapper(("text_config",), ("nemotron_h",), legacy_key="llm_config"),
    # Nemotron-3.5-Transcribe (Nemotron3_5TranscribeForConditionalGeneration never ties: no tied weights)
    "nemo_speechlm": TextWrapper(("text_config",), ("nemotron_h",)),
}
#: fields that describe the whole checkpoint: the outermost level that gives one wins (as transformers'
#: generation config reads token ids: the wrapper's, else its text config's)
_WRAPPER_FIELDS = ("architectures", "bos_token_id", "eos_token_id", "pad_token_id")

# What transformers' config classes (5.x, configuration_<family>.py) fill in when config.json leaves a
# field out. "fields": plain config.json fields, read as if the file had them; "num_experts" /
# "num_experts_per_tok": the expert count and top-k when none of their aliases is given; the other keys
# are defaults of derived values (RoPE, layer kinds, head size). Fields not named here default as
# ModelConfig's own defaults, which equal transformers' for every family here.
_DEEPSEEK = {  # DeepseekV3Config's structural defaults (MLA ranks and dims, routing, token ids), shared by V3.2 / GLM-5
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "n_shared_experts": 1, "first_k_dense_replace": 3,
    "norm_topk_prob": True, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "bos_token_id": 0, "eos_token_id": 1,
}
# MLA: transformers' head_dim defaults to qk_rope_head_dim (the attention head size is qk_nope + qk_rope); keys
# and values have as many heads as the queries, so num_key_value_heads keeps its default (the query heads)
_MLA = {"num_experts": 256, "num_experts_per_tok": 8, "head_dim_is_rope": True}
# Qwen3NextConfig / Qwen3_5MoeTextConfig: Gated DeltaNet sizes, shared expert, RoPE on a quarter of each head,
# layer_types from full_attention_interval (4: every 4th layer full attention, the others linear)
_HYBRID_FIELDS = {"num_key_value_heads": 2, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "head_dim": 256,
                  "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                  "linear_num_key_heads": 16, "linear_num_value_heads": 32, "moe_intermediate_size": 512,
                  "shared_expert_intermediate_size": 512}
# HYV4Config's and HYV4VLTextConfig's common defaults
_HY4 = {"max_position_embeddings": 262144, "rms_norm_eps": 1e-5, "pad_token_id": 120002, "bos_token_id": 120000,
        "eos_token_id": 120025, "n_shared_experts": 1, "routed_scaling_factor": 2.827, "norm_topk_prob": True,
        "n_group": 1, "topk_group": 1, "kv_lora_rank": 512, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64,
        "v_head_dim": 256, "index_topk": 2048, "index_head_dim": 128, "swiglu_limit": 10.0}
_QWEN3_5_MOE = {"partial_rotary_factor": 0.25, "full_attention_interval": 4, "num_experts": 256,
                "num_experts_per_tok": 8, "fields": _HYBRID_FIELDS}
# Qwen4ExpTextConfig: Qwen3.5's hybrid sizes, but RoPE over the whole head (its config class skips Qwen3.5's 0.25),
# 512 experts, top-10, and 'indexed_attention' (QSA) layers every full_attention_interval-th ('full_attention' read
# as such: "qwen4_layers"); the QSA indexer sizes under our index_* names; hyper-connections, per-layer n-gram
# embeddings and the QSA block size in dynamoe.models.qwen4_exp (qwen4_fields)
_QWEN4_EXP_TEXT = {"full_attention_interval": 4, "qwen4_layers": True, "num_experts": 512, "num_experts_per_tok": 10,
                   "aliases": {"index_n_heads": "indexer_n_heads", "index_head_dim": "indexer_head_dim",
                               "index_topk": "indexer_budget"},
                   "fields": {**_HYBRID_FIELDS, "norm_topk_prob": True}}
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen4_exp_text": _QWEN4_EXP_TEXT,
    "qwen3_next": {"partial_rotary_factor": 0.25, "full_attention_interval": 4, "num_experts": 512,
                   "num_experts_per_tok": 10,
                   "fields": {**_HYBRID_FIELDS, "intermediate_size": 5632, "norm_topk_prob": True}},
    "qwen3_5_moe": _QWEN3_5_MOE,
    "qwen3_5_moe_text": _QWEN3_5_MOE,
    "qwen3_moe": {"num_experts": 128, "num_experts_per_tok": 8,
                  # Qwen3MoeConfig drops sliding_window unless use_sliding_window
                  "fields": {"num_key_value_heads": 4, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
                             "use_sliding_window": False}},
    "mixtral": {"rope_theta": 1e6, "num_experts": 8, "num_experts_per_tok": 2,
                "fields": {"num_key_value_heads": 8, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                           "bos_token_id": 1, "eos_token_id": 2}},
    "gpt_oss": {
        "rope_theta": 150000.0,
        "rope": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096},
        "sliding_window": 128, "attention_bias": True, "alternating_layers": True, "head_dim": 64,
        "num_experts": 128, "num_experts_per_tok": 4,
        "fields": {"num_key_value_heads": 8, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                   "swiglu_limit": 7.0},
    },
    "deepseek_v3": {**_MLA, "rope_interleave": True, "fields": {**_DEEPSEEK, "num_nextn_predict_layers": 1}},
    "kimi_k2": {**_MLA, "rope_interleave": True, "fields": {**_DEEPSEEK, "num_nextn_predict_layers": 1}},
    # SarvamMLAConfig (Sarvam-105B): DeepSeek-V3's model and defaults but 128 experts, no query LoRA, one group, one
    # dense layer; the hub's names num_shared_experts / num_mtp_layers (attribute_map), its rope_scaling type
    # 'deepseek_yarn' read as YaRN ("deepseek_yarn"), head_dim / q_head_dim derived ("ignored")
    # AXK1Config (A.X-K1): DeepSeek-V3's with 192 experts; its MLP kinds from mlp_layer_types, else from the hub's
    # first_k_dense_replace / moe_layer_freq ("axk_mlp_layers"); no MTP fields (its class has none)
    "axk1": {**_MLA, "num_experts": 192, "rope_interleave": True, "axk_mlp_layers": True,
             "ignored": ("head_dim", "num_nextn_predict_layers"),
             "fields": {**_DEEPSEEK, "intermediate_size": 18432, "moe_intermediate_size": 2048,
                        "max_position_embeddings": 32768, "bos_token_id": 163691, "eos_token_id": 163691,
                        "first_k_dense_replace": 1, "moe_layer_freq": 1}},
    # AXK2Config (A.X-K2): DeepSeek-V3.2's sparse MLA with gated queries and self-gated norms; no groups by default
    # (null: one); MLP kinds as A.X-K1's; its MLA always interleaves RoPE (no such field)
    "axk2": {**_MLA, "num_experts": 128, "axk_mlp_layers": True, "ignored": ("head_dim", "rope_interleave"),
             "fields": {**_DEEPSEEK, "intermediate_size": 5120, "moe_intermediate_size": 512, "kv_lora_rank": 128,
                        "q_lora_rank": 384, "qk_rope_head_dim": 32, "v_head_dim": 64, "qk_nope_head_dim": 64,
                        "n_group": None, "topk_group": None, "max_position_embeddings": 131072,
                        "bos_token_id": 163691, "eos_token_id": 163691, "first_k_dense_replace": 1,
                        "moe_layer_freq": 1, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 16}},
    # Dots3NoteTextConfig (dots.llm3 / dots3_note's text model): MLA on every layer, DSA ('indexed_attention') on layers
    # 0, 1 and every 4th from 1, sliding windows elsewhere, with their own MLA sizes (per_layer_config, else the swa_*
    # defaults) and RoPE ("dots3_layers"); MLP kinds as A.X-K1's (moe_layer_freq may be a per-layer list)
    "dots3_note_text": {"num_experts": 256, "num_experts_per_tok": 8, "head_dim": 256, "dots3_layers": True,
                        "axk_mlp_layers": True, "aliases": {"sliding_window": "sliding_window_size"},
                        "ignored": ("num_key_value_heads",),   # (MLA: one KV head per query head)
                        "fields": {"intermediate_size": 13824, "moe_intermediate_size": 1536, "head_dim": 256,
                                   "n_shared_experts": 1, "routed_scaling_factor": 1.0, "kv_lora_rank": 512,
                                   "q_lora_rank": 1024, "qk_rope_head_dim": 64, "v_head_dim": 128,
                                   "qk_nope_head_dim": 128, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
                                   "max_position_embeddings": 524288, "rms_norm_eps": 1e-5, "pad_token_id": 151659,
                                   "bos_token_id": 151643, "eos_token_id": 151668, "index_topk": 2048,
                                   "index_head_dim": 128, "index_n_heads": 64, "sliding_window_size": 512,
                                   "shared_experts_intermediate_size": 1536, "first_k_dense_replace": 1,
                                   "moe_layer_freq": 1}},
    "sarvam_mla": {**_MLA, "num_experts": 128, "rope_interleave": True, "deepseek_yarn": True,
                   "ignored": ("head_dim", "q_head_dim"),
                   "aliases": {"n_shared_experts": "num_shared_experts", "num_nextn_predict_layers": "num_mtp_layers"},
                   "fields": {**{k: v for k, v in _DEEPSEEK.items() if k != "n_shared_experts"}, "q_lora_rank": None,
                              "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "intermediate_size": 16384,
                              "num_shared_experts": 1, "num_mtp_layers": 0}},
    "deepseek_v32": {**_MLA, "fields": {**_DEEPSEEK, "max_position_embeddings": 163840, "index_topk": 2048,
                                        "index_head_dim": 128, "index_n_heads": 64}},
    "glm_moe_dsa": {**_MLA, "fields": {**_DEEPSEEK, "q_lora_rank": 2048, "qk_nope_head_dim": 192, "v_head_dim": 256,
                                       "n_group": 1, "topk_group": 1, "max_position_embeddings": 202752,
                                       "rms_norm_eps": 1e-5, "index_topk": 2048, "index_head_dim": 128,
                                       "index_n_heads": 32}},
    # Qwen2MoeConfig: q/k/v biases, a gated shared expert; with use_sliding_window, the even layers below
    # max_window_layers slide ("qwen2_windows"); sliding_window is saved as 0 when it is off
    "qwen2_moe": {"num_experts": 60, "num_experts_per_tok": 4, "qwen2_windows": True,
                  "fields": {"num_key_value_heads": 16, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
                             "qkv_bias": True, "shared_expert_intermediate_size": 5632, "use_sliding_window": False,
                             "sliding_window": 4096, "max_window_layers": 28}},
    "olmoe": {"num_experts": 64, "num_experts_per_tok": 8,
              "fields": {"max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "pad_token_id": 1,
                         "eos_token_id": 50279}},
    # DeepseekV2Config: no top-k default (a config must say num_experts_per_tok), greedy routing
    "deepseek_v2": {"num_experts": 64, "head_dim_is_rope": True,
                    "fields": {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                               "v_head_dim": 128, "n_shared_experts": 2, "topk_method": "greedy",
                               "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "bos_token_id": 1,
                               "eos_token_id": 2}},
    # MiniMaxM2Config: hub configs give the rotated dims as rotary_dim (partial_rotary_factor = rotary_dim / head_dim)
    "minimax_m2": {"rope_theta": 5e6, "head_dim": 128, "num_experts": 256, "num_experts_per_tok": 8, "rotary_dim": True,
                   "fields": {"num_key_value_heads": 8, "max_position_embeddings": 196608, "rms_norm_eps": 1e-6,
                              "bos_token_id": 200034, "eos_token_id": 200020}},
    # Glm4MoeLiteConfig (GLM-4.7-Flash): DeepSeek-V3's MLA and routing; without mlp_layer_types only layer 0 is dense
    "glm4_moe_lite": {**_MLA, "num_experts": 64, "num_experts_per_tok": 4, "rope_interleave": True, "first_layer_dense": True,
                      "fields": {**_DEEPSEEK, "q_lora_rank": 768, "qk_nope_head_dim": 192, "v_head_dim": 256, "n_group": 1,
                                 "topk_group": 1, "routed_scaling_factor": 1.8, "first_k_dense_replace": 0,
                                 "rms_norm_eps": 1e-5, "max_position_embeddings": 202752}},
    # Dots1Config: no expert-count, top-k or shared-expert defaults (null); without layer_types, the layers from
    # max_window_layers on slide ("windows_from_max_window_layers")
    "dots1": {"windows_from_max_window_layers": True,
              "fields": {"num_key_value_heads": 32, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
                         "sliding_window": 4096, "max_window_layers": 62, "first_k_dense_replace": 0,
                         "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": False}},
    "flex_olmo": {"rope_theta": 500000.0, "num_experts": 7, "num_experts_per_tok": 5,
                  "fields": {"max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "pad_token_id": 100277,
                             "eos_token_id": 100257}},
    # DbrxConfig: its own top-level names, the attention and FFN fields in attn_config / ffn_config ("nested":
    # read as if at the top; the file's own top-level values win). attn_config.rope_theta (hub configs: 500000)
    # is DBRX's RoPE base when the file has no top-level rope_theta / rope_parameters.
    "dbrx": {"num_experts": 4, "num_experts_per_tok": 1,
             "aliases": {"hidden_size": "d_model", "num_attention_heads": "n_heads", "num_hidden_layers": "n_layers",
                         "max_position_embeddings": "max_seq_len"},
             "nested": {"attn_config": {"kv_n_heads": "num_key_value_heads", "clip_qkv": "clip_qkv",
                                        "rope_theta": "rope_theta"},
                        "ffn_config": {"ffn_hidden_size": "intermediate_size", "moe_num_experts": "num_experts",
                                       "moe_top_k": "num_experts_per_tok"}},
             "fields": {"d_model": 2048, "n_heads": 16, "n_layers": 24, "max_seq_len": 2048, "num_key_value_heads": 1,
                        "intermediate_size": 3584, "rms_norm_eps": 1e-5}},
    # Ernie4_5_MoeConfig: moe_* names; MoE layers (i+1) % moe_layer_interval == 0 within
    # [moe_layer_start_index, moe_layer_end_index] (-1: the last layer), the others dense ("ernie_moe_layers")
    "ernie4_5_moe": {"rope_theta": 500000.0, "num_experts": 64, "num_experts_per_tok": 6, "ernie_moe_layers": True,
                     "aliases": {"num_experts": "moe_num_experts", "num_experts_per_tok": "moe_k",
                                 "n_shared_experts": "moe_num_shared_experts"},
                     "fields": {"num_key_value_heads": 4, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                                "tie_word_embeddings": True, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
                                "moe_num_shared_experts": 2, "moe_layer_start_index": 1, "moe_layer_end_index": -1,
                                "moe_layer_interval": 1, "use_bias": False}},
    # ExaoneMoeConfig: DeepSeek routing (scale 2.5) with num_shared_experts; without layer_types every
    # sliding_window_pattern-th layer is global, the others slide ("exaone_windows")
    "exaone_moe": {"num_experts": 64, "num_experts_per_tok": 8, "exaone_windows": True,
                   "aliases": {"n_shared_experts": "num_shared_experts"},
                   "fields": {"num_key_value_heads": 32, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
                              "bos_token_id": 1, "eos_token_id": 53, "pad_token_id": 0, "sliding_window": 4096,
                              "sliding_window_pattern": 4, "first_k_dense_replace": 1, "num_shared_experts": 1,
                              "norm_topk_prob": True, "routed_scaling_factor": 2.5, "n_group": 1, "topk_group": 1}},
    # HunYuanMoEV1Config: top-k is moe_topk; both it and num_experts may be per-layer lists (one value here); its
    # experts are intermediate_size wide (hub configs' moe_intermediate_size is not read by transformers: "ignored")
    "hunyuan_v1_moe": {"num_experts": 1, "num_experts_per_tok": 1, "aliases": {"num_experts_per_tok": "moe_topk"},
                       "ignored": ("moe_intermediate_size",),
                       "per_layer_lists": ("num_experts", "moe_topk"),
                       "fields": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "pad_token_id": 0,
                                  "bos_token_id": 1, "eos_token_id": 2}},
    # GraniteMoeConfig / GraniteMoeSharedConfig: the multipliers default to 1 (attention_multiplier too: not
    # head_dim^-1/2), no shared MLP unless shared_intermediate_size > 0
    "granitemoe": {"num_experts": 8, "num_experts_per_tok": 2,
                   "fields": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2,
                              "attention_multiplier": 1.0}},
    "granitemoeshared": {"num_experts": 8, "num_experts_per_tok": 2,
                         "fields": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "bos_token_id": 1,
                                    "eos_token_id": 2, "attention_multiplier": 1.0}},
    # Qwen3VLMoeTextConfig: its router always renormalises (no norm_topk_prob field: "ignored", the default
    # says what the model does) and its attention never slides; the multimodal RoPE is plain RoPE for text
    "qwen3_vl_moe_text": {"rope_theta": 500000.0, "num_experts": 60, "num_experts_per_tok": 4,
                          "ignored": ("norm_topk_prob", "sliding_window", "use_sliding_window"),
                          "fields": {"num_key_value_heads": 16, "max_position_embeddings": 128000, "rms_norm_eps": 1e-6,
                                     "intermediate_size": 5632, "moe_intermediate_size": 1408,
                                     "tie_word_embeddings": True, "norm_topk_prob": True}},
    # Qwen3OmniMoeTextConfig (the thinker's text model): Qwen3-MoE's, attention that never slides
    "qwen3_omni_moe_text": {"rope_theta": 1e6, "num_experts": 128, "num_experts_per_tok": 8,
                            "ignored": ("sliding_window", "use_sliding_window"),
                            "fields": {"num_key_value_heads": 4, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
                                       "intermediate_size": 18944, "moe_intermediate_size": 768,
                                       "norm_topk_prob": True}},
    # Glm4vMoeTextConfig: GLM-4.5's decoder without q/k norms or multi-token prediction, half RoPE
    "glm4v_moe_text": {"partial_rotary_factor": 0.5, "num_experts": 128, "num_experts_per_tok": 8,
                       "ignored": ("use_qk_norm", "num_nextn_predict_layers"),
                       "fields": {"num_key_value_heads": 8, "max_position_embeddings": 65536, "rms_norm_eps": 1e-5,
                                  "intermediate_size": 10944, "moe_intermediate_size": 1408, "attention_bias": True,
                                  "n_shared_experts": 1, "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1,
                                  "first_k_dense_replace": 1, "norm_topk_prob": True}},
    # KimiLinearConfig: its own names (attribute_map) for the routing fields and the context length; the KDA sizes
    # in linear_attn_config, which win over top-level ones ("nested_overrides"), linear_head_dim / linear_num_heads
    # for both keys and values; layer_types from its 1-based full_attn_layers / kda_layers ("kimi_layers"), else
    # every 4th layer from layer 4 (0-based) full; MLA without RoPE, q_proj (no q_lora_rank) by default
    "kimi_linear": {"num_experts": 256, "num_experts_per_tok": 8, "head_dim_is_rope": True, "kimi_layers": True,
                    "nested_overrides": True,
                    "aliases": {"max_position_embeddings": "model_max_length", "norm_topk_prob": "moe_renormalize",
                                "n_group": "num_expert_group", "num_experts_per_tok": "num_experts_per_token",
                                "n_shared_experts": "num_shared_experts", "linear_key_head_dim": "linear_head_dim",
                                "linear_value_head_dim": "linear_head_dim", "linear_num_key_heads": "linear_num_heads",
                                "linear_num_value_heads": "linear_num_heads"},
                    "nested": {"linear_attn_config": {"head_dim": "linear_head_dim", "num_heads": "linear_num_heads",
                                                      "short_conv_kernel_size": "linear_conv_kernel_dim"}},
                    "fields": {"intermediate_size": 9216, "moe_intermediate_size": 1024, "kv_lora_rank": 512,
                               "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "num_expert_group": 1,
                               "topk_group": 1, "routed_scaling_factor": 2.446, "num_shared_experts": 1,
                               "first_k_dense_replace": 1, "moe_renormalize": True, "model_max_length": 1048576,
                               "rms_norm_eps": 1e-5, "bos_token_id": 163584, "eos_token_id": 163586,
                               "pad_token_id": 163839, "linear_head_dim": 128, "linear_num_heads": 32,
                               "linear_conv_kernel_dim": 4}},
    # MiMoV2FlashConfig: layer 0 and every 6th layer full attention, the others sliding ("mimo_layers"); a RoPE per
    # layer type ("rope_by_layer_type": the defaults, each partial 0.334 unless its dict says otherwise); the hub's
    # sliding_window_size is the window without the query ("window_size_plus_one"); routed_scaling_factor null: 1
    "mimo_v2_flash": {"num_experts": 256, "num_experts_per_tok": 8, "head_dim": 192, "mimo_layers": True,
                      "first_layer_dense": True, "window_size_plus_one": True,
                      "rope_by_layer_type": {
                          "full_attention": {"rope_type": "default", "rope_theta": 5_000_000.0,
                                             "partial_rotary_factor": 0.334},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0,
                                                "partial_rotary_factor": 0.334}},
                      "fields": {"intermediate_size": 16384, "moe_intermediate_size": 2048, "num_key_value_heads": 4,
                                 "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "bos_token_id": 1,
                                 "v_head_dim": 128, "sliding_window": 129, "attention_value_scale": 0.707,
                                 "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0}},
    # Mistral4Config: DeepSeek-V3's MLA (head_dim = qk_nope + qk_rope: "head_dim_is_qk"), YaRN x128 with Llama-4's
    # attention scaling by default, RoPE on the qk_rope share of each head ("partial_is_rope_share"), softmax routing
    "mistral4": {"num_experts": 128, "num_experts_per_tok": 4, "rope_interleave": True, "head_dim_is_qk": True,
                 "partial_is_rope_share": True,
                 "ignored": ("num_key_value_heads",),  # (32 by default, saved, unused: MLA has a KV head per query head)
                 "rope": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 128.0,
                          "original_max_position_embeddings": 8192, "beta_fast": 32.0, "beta_slow": 1.0,
                          "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1},
                 "fields": {"intermediate_size": 12288, "moe_intermediate_size": 2048, "n_shared_experts": 1,
                            "routed_scaling_factor": 1.0, "kv_lora_rank": 256, "q_lora_rank": 1024,
                            "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 64, "n_group": 1,
                            "topk_group": 1, "first_k_dense_replace": 0, "norm_topk_prob": True,
                            "max_position_embeddings": 1048576, "rms_norm_eps": 1e-6, "pad_token_id": 11,
                            "bos_token_id": 1, "eos_token_id": 2}},
    # FlintConfig: full attention on layers 0, 1, every 4th from 1 and the last, sliding elsewhere ("flint_layers");
    # dense MLPs on mlp_only_layers [0, 1]; an ungated shared expert
    "flint": {"num_experts": 256, "num_experts_per_tok": 6, "head_dim": 128, "flint_layers": True,
              "fields": {"intermediate_size": 6144, "num_key_value_heads": 4, "max_position_embeddings": 262144,
                         "sliding_window": 513, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 1024,
                         "norm_topk_prob": True, "mlp_only_layers": [0, 1], "rms_norm_eps": 1e-6}},
    # GraniteMoeSWAConfig: GraniteMoeShared's defaults, window 128, every 4th layer (from 0) full, the others sliding
    "granitemoe_swa": {"num_experts": 8, "num_experts_per_tok": 2, "granite_swa_layers": True,
                       "fields": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "bos_token_id": 1,
                                  "eos_token_id": 2, "attention_multiplier": 1.0, "sliding_window": 128}},
    # Llama4TextConfig: MoE on moe_layers (else every interleave_moe_layer_step-th layer, from step - 1), dense MLPs of
    # intermediate_size_mlp elsewhere; RoPE on the layers where no_rope_layers says 1 (else all but every
    # no_rope_layer_interval-th), those chunked ("chunked_attention", attention_chunk_size) unless it is null, the
    # others NoPE full attention with temperature tuning; L2 q/k norm on the RoPE layers (use_qk_norm)
    "llama4_text": {"rope_theta": 500000.0, "num_experts": 16, "num_experts_per_tok": 1, "head_dim": 128,
                    "llama4_layers": True, "chunked_layers": True,
                    "fields": {"num_key_value_heads": 8, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                               "bos_token_id": 1, "eos_token_id": 2, "intermediate_size": 8192,
                               "intermediate_size_mlp": 16384, "interleave_moe_layer_step": 1, "use_qk_norm": True,
                               "no_rope_layer_interval": 4, "attention_chunk_size": 8192,
                               "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1}},
    # PhimoeConfig: SparseMixer routing over router_jitter_noise margins (top-2), LayerNorms (eps rms_norm_eps); a
    # sliding_window, when set, slides every layer
    "phimoe": {"rope_theta": 1e6, "num_experts": 16, "num_experts_per_tok": 2,
               "fields": {"num_key_value_heads": 8, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                          "bos_token_id": 1, "eos_token_id": 2, "intermediate_size": 6400, "router_jitter_noise": 0.01,
                          "lm_head_bias": False}},
    # LongcatFlashConfig: its own names (attribute_map); num_layers decoder layers of two attention sublayers each
    # (transformers' num_hidden_layers is twice it: "num_layers_halved"); MLA with q/kv LoRA scales; softmax routing
    # over n_routed_experts + zero_expert_num (identity) experts with a selection bias, times routed_scaling_factor
    "longcat_flash": {"rope_theta": 1e7, "num_experts": 512, "num_experts_per_tok": 12, "head_dim": 64,
                      "num_layers_halved": 28,
                      "aliases": {"num_experts_per_tok": "moe_topk", "intermediate_size": "ffn_hidden_size",
                                  "moe_intermediate_size": "expert_ffn_hidden_size"},
                      "fields": {"max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                                 "bos_token_id": 1, "eos_token_id": 2, "ffn_hidden_size": 12288,
                                 "expert_ffn_hidden_size": 2048, "q_lora_rank": 1536, "kv_lora_rank": 512,
                                 "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "moe_topk": 12,
                                 "zero_expert_num": 256, "routed_scaling_factor": 6.0}},
    # Step3p7TextConfig (model_type step3p5: Step-3.5-Flash, and Step-3.7's text model): its own names (attribute_map);
    # without mlp_layer_types the hub's moe_layers_enum, else layers 0-2 dense and the others MoE; every layer full
    # attention unless layer_types; a RoPE per layer type from the nested rope_parameters, else from the hub's
    # per-layer rope_theta / partial_rotary_factors lists with rope_scaling on the full layers; the hub's per-layer
    # lists padded with num_nextn_predict_layers trailing MTP entries are cut to the decoder layers ("step_layers")
    "step3p5": {"num_experts": 288, "num_experts_per_tok": 8, "head_dim": 128, "step_layers": True,
                "ignored": ("routed_scaling_factor", "shared_expert_intermediate_size", "hidden_act"),
                "aliases": {"num_experts": "moe_num_experts", "num_experts_per_tok": "moe_top_k",
                            "num_key_value_heads": "num_attention_groups", "share_expert_dim": "share_expert_dims",
                            "shared_expert_intermediate_size": "share_expert_dim",
                            "routed_scaling_factor": "moe_router_scaling_factor",
                            "num_nextn_predict_layers": "num_mtp_layers"},
                "fields": {"intermediate_size": 11264, "moe_intermediate_size": 1280, "share_expert_dims": 1280,
                           "num_attention_groups": 8, "max_position_embeddings": 128000, "rms_norm_eps": 1e-5,
                           "pad_token_id": 1, "moe_router_scaling_factor": 1.0}},
    # AfmoeConfig (Arcee Trinity): every global_attn_every_n_layers-th layer full attention, the others sliding
    # ("afmoe_layers"); dense MLPs on the first num_dense_layers; shared experts and route scale under its own names
    "afmoe": {"num_experts": 64, "num_experts_per_tok": 6, "head_dim": 128, "afmoe_layers": True,
              "ignored": ("first_k_dense_replace", "n_shared_experts", "routed_scaling_factor"),
              "aliases": {"first_k_dense_replace": "num_dense_layers", "n_shared_experts": "num_shared_experts",
                          "routed_scaling_factor": "route_scale"},
              "fields": {"intermediate_size": 6144, "moe_intermediate_size": 1408, "max_position_embeddings": 16384,
                         "rms_norm_eps": 1e-5, "sliding_window": 1024, "num_dense_layers": 1, "num_shared_experts": 2,
                         "route_scale": 1.0, "global_attn_every_n_layers": 4}},
    # Cohere2MoeConfig (Command A): LayerNorms (weight only, eps layer_norm_eps) unless rms_norm_eps is set
    # ("layer_norm_unless_rms"); without layer_types, the first first_k_dense_replace layers (a constructor argument
    # transformers does not keep) follow prefix_dense_sliding_window_pattern, the others sliding_window_pattern (every
    # n-th full), and they are the dense ones; RoPE on the sliding layers (and the dense ones when the prefix pattern
    # is 1: "cohere_layers"); the experts are intermediate_size wide, the dense prefix prefix_dense_intermediate_size
    "cohere2_moe": {"num_experts": 8, "num_experts_per_tok": 2, "head_dim": 128, "cohere_layers": True,
                    "layer_norm_unless_rms": True, "ignored": ("moe_intermediate_size", "n_shared_experts"),
                    "aliases": {"n_shared_experts": "num_shared_experts"},
                    "fields": {"intermediate_size": 22528, "max_position_embeddings": 8192, "layer_norm_eps": 1e-5,
                               "pad_token_id": 0, "bos_token_id": 5, "eos_token_id": 255001, "tie_word_embeddings": True,
                               "sliding_window": 4096, "num_shared_experts": 0, "norm_topk_prob": True,
                               "shared_expert_combination_strategy": "average", "expert_selection_fn": "softmax",
                               "prefix_dense_sliding_window_pattern": 1, "sliding_window_pattern": 4,
                               "logit_scale": 0.0625}},
    # SolarOpenConfig: GLM-4.5's routing on every layer, Llama's attention (no q/k norm, no window), whole-head RoPE
    # at 1e6; the GLM fields it removes are not read when a hub config has them ("ignored")
    "solar_open": {"rope_theta": 1e6, "num_experts": 128, "num_experts_per_tok": 8, "head_dim": 128,
                   "ignored": ("first_k_dense_replace", "use_qk_norm", "mlp_layer_types", "mlp_only_layers",
                               "decoder_sparse_step", "num_nextn_predict_layers", "intermediate_size", "sliding_window",
                               "layer_types", "use_sliding_window"),
                   "fields": {"num_key_value_heads": 8, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                              "moe_intermediate_size": 1280, "n_shared_experts": 1, "routed_scaling_factor": 1.0,
                              "n_group": 1, "topk_group": 1, "norm_topk_prob": True}},
    # HYV3Config (Hy3): its own names for the shared experts and route scale; without mlp_layer_types layer 0 dense;
    # the routing always renormalises and has no groups (norm_topk_prob, n_group: not read); no sliding window
    "hy_v3": {"rope_theta": 11_158_840.0, "num_experts": 192, "num_experts_per_tok": 8, "head_dim": 128,
              "first_layer_dense": True,
              "ignored": ("n_shared_experts", "routed_scaling_factor", "first_k_dense_replace", "norm_topk_prob",
                          "n_group", "topk_group", "sliding_window", "layer_types", "use_sliding_window"),
              "aliases": {"n_shared_experts": "num_shared_experts", "routed_scaling_factor": "router_scaling_factor"},
              "fields": {"intermediate_size": 13312, "num_key_value_heads": 8, "max_position_embeddings": 131072,
                         "rms_norm_eps": 1e-5, "num_shared_experts": 1, "moe_intermediate_size": 1536,
                         "router_scaling_factor": 2.826, "enable_moe_fp32_combine": True, "mlp_bias": False,
                         "norm_topk_prob": True}},
    # JetMoeConfig: mixture-of-attention-heads layers with num_key_value_heads heads per chosen attention expert, so
    # num_attention_heads = num_key_value_heads * num_experts_per_tok whatever the file says ("heads_kv_times_top_k");
    # head_dim is kv_channels, the activation activation_function
    "jetmoe": {"num_experts": 8, "num_experts_per_tok": 2, "heads_kv_times_top_k": True,
               "ignored": ("num_attention_heads", "hidden_act"),
               "aliases": {"head_dim": "kv_channels", "hidden_act": "activation_function"},
               "fields": {"num_key_value_heads": 16, "kv_channels": 128, "intermediate_size": 5632,
                          "max_position_embeddings": 4096, "activation_function": "silu", "bos_token_id": 1,
                          "eos_token_id": 2, "tie_word_embeddings": True, "rms_norm_eps": 1e-6}},
    # SarvamMoEConfig (run as GLM-4.5): whole-head RoPE at 8e6, q/k norms, one dense layer, scale 2.5; its own names
    # for the expert counts, shared experts, MTP layers and q/k/v bias (attribute_map)
    "sarvam_moe": {"rope_theta": 8e6, "num_experts": 128, "num_experts_per_tok": 6, "head_dim": 64,
                   "aliases": {"n_shared_experts": "num_shared_experts", "attention_bias": "use_qkv_bias",
                               "num_nextn_predict_layers": "num_mtp_layers"},
                   "fields": {"intermediate_size": 8192, "num_key_value_heads": 4, "max_position_embeddings": 131072,
                              "rms_norm_eps": 1e-6, "moe_intermediate_size": 1024, "num_shared_experts": 1,
                              "routed_scaling_factor": 2.5, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
                              "norm_topk_prob": True, "use_qk_norm": True, "eos_token_id": 1, "pad_token_id": 0,
                              "num_mtp_layers": 0}},
    # LagunaConfig: every layer full attention unless layer_types ("full_layers_by_default"; sliding_window is for the
    # sliding ones); a RoPE per layer type (a missing partial factor is 1); layer 0 dense; sigmoid routing always
    # renormalised (Qwen2-MoE's routing fields are not read), scaled by moe_routed_scaling_factor
    "laguna": {"num_experts": 256, "num_experts_per_tok": 8, "head_dim": 128, "first_layer_dense": True,
               "full_layers_by_default": True, "rope_partial_default": 1.0,
               "rope_by_layer_type": {
                   "full_attention": {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5},
                   "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}},
               "ignored": ("routed_scaling_factor", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
                           "qkv_bias", "use_sliding_window", "max_window_layers", "n_group", "topk_group"),
               "aliases": {"routed_scaling_factor": "moe_routed_scaling_factor"},
               "fields": {"intermediate_size": 8192, "num_key_value_heads": 8, "max_position_embeddings": 131072,
                          "rms_norm_eps": 1e-6, "sliding_window": 512, "moe_intermediate_size": 512,
                          "shared_expert_intermediate_size": 512, "gating": True, "moe_routed_scaling_factor": 1.0,
                          "moe_apply_router_weight_on_input": False, "moe_router_logit_softcapping": 0.0,
                          "norm_topk_prob": True}},
    # MellumConfig: Qwen3-MoE's with every layer full attention unless layer_types, a RoPE per layer type (whole head
    # unless a kind's dict says otherwise), every layer MoE unless mlp_layer_types; Qwen3's layer switches not read
    "mellum": {"num_experts": 64, "num_experts_per_tok": 8, "head_dim": 128, "full_layers_by_default": True,
               "rope_partial_default": 1.0,
               "rope_by_layer_type": {"full_attention": {"rope_type": "default", "rope_theta": 500000.0},
                                      "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
               "ignored": ("use_sliding_window", "decoder_sparse_step", "mlp_only_layers", "max_window_layers"),
               "aliases": {"num_nextn_predict_layers": "num_mtp_layers"},
               "fields": {"intermediate_size": 7168, "num_key_value_heads": 4, "max_position_embeddings": 131072,
                          "rms_norm_eps": 1e-6, "sliding_window": 1024, "moe_intermediate_size": 896,
                          "norm_topk_prob": True}},
    # Kolibri1Config: without layer_types every 5th layer full attention (NoPE; a window is required), the others
    # sliding; every layer MoE with a shared expert; Qwen3's dense-layer switches and attention bias are not read
    "kolibri1": {"num_experts": 384, "num_experts_per_tok": 6, "head_dim": 128, "full_attention_every": 5,
                 "ignored": ("intermediate_size", "use_sliding_window", "decoder_sparse_step", "mlp_only_layers",
                             "attention_bias", "first_k_dense_replace", "mlp_layer_types", "routed_scaling_factor",
                             "n_group", "topk_group", "max_window_layers"),
                 "fields": {"num_key_value_heads": 4, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
                            "sliding_window": 513, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                            "norm_topk_prob": False}},
    # BeamConfig: every 6th layer and the last full attention, the others sliding ("beam_layers"); RoPE by layer type
    # with the full layers' null (NoPE: "nope_kinds"); the first 3 layers dense; DeepSeek-V3 routing (8 groups, 4
    # kept, scale 2.5) without shared experts; logits softcapped at 30; Qwen3's layer switches are not read
    "beam": {"num_experts": 256, "num_experts_per_tok": 8, "head_dim": 128, "beam_layers": True, "dense_prefix": 3,
             "nope_kinds": True, "rope_partial_default": 1.0,
             "rope_by_layer_type": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": None},
             "ignored": ("use_sliding_window", "decoder_sparse_step", "mlp_only_layers", "max_window_layers",
                         "first_k_dense_replace", "n_shared_experts"),
             "fields": {"intermediate_size": 20480, "num_key_value_heads": 8, "max_position_embeddings": 8192,
                        "rms_norm_eps": 1e-6, "sliding_window": 512, "moe_intermediate_size": 2560,
                        "norm_topk_prob": True, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
                        "final_logit_softcapping": 30.0}},
    # ZayaConfig (ZAYA1): layer kinds 'hybrid' (full attention, the default) and 'hybrid_sliding' ("layer_type_names"),
    # a RoPE per kind on half of each head (5e6 / 1e4); top-1 routing over 16 experts
    "zaya": {"num_experts": 16, "num_experts_per_tok": 1, "head_dim": 128, "full_layers_by_default": True,
             "layer_type_names": {"hybrid": "full_attention", "hybrid_sliding": "sliding_attention"},
             "rope_partial_default": 1.0,
             "rope_by_layer_type": {
                 "full_attention": {"rope_type": "default", "rope_theta": 5_000_000.0, "partial_rotary_factor": 0.5},
                 "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5}},
             "fields": {"num_key_value_heads": 2, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                        "tie_word_embeddings": True, "moe_intermediate_size": 2048, "pad_token_id": 0,
                        "bos_token_id": 2, "eos_token_id": 106, "lm_head_bias": False, "router_hidden_size": 256,
                        "cca_time0": 2, "cca_time1": 2}},
    # DogeConfig: dense unless is_moe (which dynamoe refuses: see models/doge.py); a window slides every layer
    "doge": {"num_experts": 16384, "num_experts_per_tok": 64, "moe_switch": "is_moe",
             "fields": {"intermediate_size": 2048, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
                        "keep_window_size": 2048, "is_moe": False, "mlp_bias": False, "norm_topk_prob": False}},
    # Gemma4TextConfig (Gemma 4's language model): sliding / full attention layers (without layer_types every 6th full,
    # the last always full: "gemma4_layers"), a RoPE per kind (sliding: default 1e4 over the whole head; full:
    # 'proportional' 1e6 on a quarter), the full layers' head size and KV heads from per_layer_config (else
    # global_head_dim, and num_global_key_value_heads when attention_k_eq_v: see gemma4_attention_layers); the MoE beside
    # the dense MLP on every layer when enable_moe_block ("moe_switch"); its names hidden_activation and top_k_experts
    "gemma4_text": {"num_experts": 0, "num_experts_per_tok": 0, "head_dim": 256, "moe_switch": "enable_moe_block",
                    "gemma4_layers": True, "rope_partial_default": 1.0,
                    "rope_by_layer_type": {
                        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                           "rope_theta": 1_000_000.0}},
                    "ignored": ("hidden_act", "num_experts_per_tok", "num_local_experts", "n_routed_experts",
                                "experts_per_token"),
                    "aliases": {"hidden_act": "hidden_activation", "num_experts_per_tok": "top_k_experts"},
                    "fields": {"vocab_size": 262_144, "hidden_size": 2304, "intermediate_size": 9216,
                               "num_hidden_layers": 30, "num_attention_heads": 8, "num_key_value_heads": 4,
                               "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
                               "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "pad_token_id": 0,
                               "eos_token_id": 1, "bos_token_id": 2, "tie_word_embeddings": True, "sliding_window": 512,
                               "vocab_size_per_layer_input": 262_144, "hidden_size_per_layer_input": 256,
                               "attention_k_eq_v": False, "num_kv_shared_layers": 0, "enable_moe_block": False,
                               "use_double_wide_mlp": False}},
    # LaraMiniConfig (Lara-4-Mini): Gated DeltaNet ('linear_attention'), sliding (RoPE) and full (NoPE) attention layers,
    # without layer_types the released period-5 pattern ("lara_layers"); every layer MoE (softmax top-k, fp32 logits)
    # plus an ungated shared expert; Qwen3-Next's dense-layer fields and the top-level partial RoPE are not read
    "lara_mini": {"num_experts": 128, "num_experts_per_tok": 4, "head_dim": 128, "lara_layers": True,
                  "ignored": ("intermediate_size", "decoder_sparse_step", "mlp_only_layers", "partial_rotary_factor",
                              "full_attention_interval", "use_sliding_window"),
                  "fields": {"vocab_size": 151936, "hidden_size": 1024, "num_hidden_layers": 34,
                             "num_attention_heads": 16, "num_key_value_heads": 4, "max_position_embeddings": 131072,
                             "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "eos_token_id": 151643,
                             "sliding_window": 512, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
                             "linear_value_head_dim": 128, "linear_num_key_heads": 8, "linear_num_value_heads": 16,
                             "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                             "norm_topk_prob": True}},
    # InklingTextConfig (Inkling's language model): layer kinds 'hybrid' (full) and 'hybrid_sliding' ("layer_type_names"),
    # without layer_types sliding on local_layer_ids, else on every layer but each 6th ("inkling_layers"); the sliding
    # layers' own heads / head size (swa_*), the window under sliding_window_size; MLP kinds from mlp_layer_types, else
    # the hub's dense_mlp_idx first layers dense; the hub's dense_intermediate_size makes intermediate_size the
    # experts' width (as the config class swaps them); never tied (its checkpoints keep embed and unembed apart)
    "inkling_text": {"num_experts": 256, "num_experts_per_tok": 6, "head_dim": 128, "inkling_layers": True,
                     "layer_type_names": {"hybrid": "full_attention", "hybrid_sliding": "sliding_attention"},
                     "ignored": ("tie_word_embeddings", "num_experts"),
                     "aliases": {"sliding_window": "sliding_window_size"},
                     "overrides": {"conv_kernel_size": "sconv_kernel_size",
                                   "max_position_embeddings": "model_max_length"},
                     "fields": {"vocab_size": 201024, "hidden_size": 6144, "num_hidden_layers": 66,
                                "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
                                "swa_num_attention_heads": 64, "swa_num_key_value_heads": 16, "swa_head_dim": 128,
                                "sliding_window_size": 512, "d_rel": 16, "rel_extent": 1024, "log_scaling_alpha": 0.1,
                                "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "conv_kernel_size": 4,
                                "intermediate_size": 24576, "moe_intermediate_size": 3072, "n_routed_experts": 256,
                                "num_experts_per_tok": 6, "n_shared_experts": 2, "route_scale": 8.0,
                                "logits_mup_width_multiplier": 24.0, "bos_token_id": 1, "eos_token_id": 2,
                                "tie_word_embeddings": False}},
    # Inkling2TextConfig (Inkling-2's language model): layer kinds 'hybrid' (full) and 'hybrid_sliding', without
    # layer_types every 6th layer full; the sliding layers' own heads / head size (swa_*), the window under
    # sliding_window_size; every layer MoE (no dense MLPs, no shared experts); the config class's attribute_map names
    # (sconv_kernel_size, model_max_length, intermediate_size, routed_scaling_factor) read as it reads them; never tied
    "inkling2_text": {"num_experts": 384, "num_experts_per_tok": 8, "head_dim": 128, "full_attention_every": 6,
                      "layer_type_names": {"hybrid": "full_attention", "hybrid_sliding": "sliding_attention"},
                      "ignored": ("tie_word_embeddings", "num_experts", "mlp_layer_types", "mlp_only_layers",
                                  "first_k_dense_replace", "decoder_sparse_step", "n_shared_experts"),
                      "aliases": {"sliding_window": "sliding_window_size", "routed_scaling_factor": "route_scale"},
                      "overrides": {"conv_kernel_size": "sconv_kernel_size",
                                    "max_position_embeddings": "model_max_length",
                                    "moe_intermediate_size": "intermediate_size",
                                    "route_scale": "routed_scaling_factor"},
                      "fields": {"vocab_size": 201024, "unpadded_vocab_size": 200058, "hidden_size": 4608,
                                 "num_hidden_layers": 48, "num_attention_heads": 48, "num_key_value_heads": 8,
                                 "head_dim": 128, "swa_num_attention_heads": 48, "swa_num_key_value_heads": 8,
                                 "swa_head_dim": 128, "sliding_window_size": 1024, "d_rel": 16, "rel_extent": 1024,
                                 "log_scaling_n_floor": 128000, "log_scaling_alpha": 0.1,
                                 "max_position_embeddings": 1048576, "rms_norm_eps": 1e-6, "conv_kernel_size": 4,
                                 "hidden_act": "silu", "moe_intermediate_size": 2304, "n_routed_experts": 384,
                                 "num_experts_per_tok": 8, "route_scale": 8.0, "bos_token_id": None,
                                 "eos_token_id": 200006, "pad_token_id": None,
                                 "qk_l2_clip_threshold": 22.627416997969522, "rel_l2_clip_threshold": 8.0,
                                 "n_layers_per_attn_res_block": 6, "mlp_gate_softcap": 4.0, "mlp_up_softcap": 25.0,
                                 "final_logit_softcapping": 30.0, "scoring_func": "sigmoid",
                                 "tie_word_embeddings": False}},
    # Inkling2LoopTextConfig (Inkling-2-Loop): Inkling-2's fields and rules with its own sizes, and the loop
    # (layers loop_layer_index_start..end - 1 run loop_num_passes times; the hub's loop_config names win, see
    # inkling2_loop_layers)
    "inkling2_loop_text": {"num_experts": 128, "num_experts_per_tok": 8, "head_dim": 128, "full_attention_every": 6,
                           "layer_type_names": {"hybrid": "full_attention", "hybrid_sliding": "sliding_attention"},
                           "ignored": ("tie_word_embeddings", "num_experts", "mlp_layer_types", "mlp_only_layers",
                                       "first_k_dense_replace", "decoder_sparse_step", "n_shared_experts"),
                           "aliases": {"sliding_window": "sliding_window_size", "routed_scaling_factor": "route_scale"},
                           "overrides": {"conv_kernel_size": "sconv_kernel_size",
                                         "max_position_embeddings": "model_max_length",
                                         "moe_intermediate_size": "intermediate_size",
                                         "route_scale": "routed_scaling_factor"},
                           "fields": {"vocab_size": 201024, "unpadded_vocab_size": 200058, "hidden_size": 2304,
                                      "num_hidden_layers": 24, "num_attention_heads": 24, "num_key_value_heads": 8,
                                      "head_dim": 128, "swa_num_attention_heads": 24, "swa_num_key_value_heads": 8,
                                      "swa_head_dim": 128, "sliding_window_size": 1024, "d_rel": 16, "rel_extent": 1024,
                                      "log_scaling_n_floor": 8192, "log_scaling_alpha": 0.1,
                                      "max_position_embeddings": 1048576, "rms_norm_eps": 1e-6, "conv_kernel_size": 4,
                                      "hidden_act": "silu", "moe_intermediate_size": 1152, "n_routed_experts": 128,
                                      "num_experts_per_tok": 8, "route_scale": 8.0, "bos_token_id": None,
                                      "eos_token_id": 200006, "pad_token_id": None,
                                      "qk_l2_clip_threshold": 22.627416997969522, "rel_l2_clip_threshold": 8.0,
                                      "n_layers_per_attn_res_block": 6, "mlp_gate_softcap": 4.0, "mlp_up_softcap": 25.0,
                                      "final_logit_softcapping": 30.0, "scoring_func": "sigmoid",
                                      "tie_word_embeddings": False, "loop_layer_index_start": 6,
                                      "loop_layer_index_end": 18, "loop_num_passes": 3, "loop_gate_rank": 64}},
    # Ernie4_5_VLMoeTextConfig (ERNIE-4.5-VL's language model): ERNIE-4.5-MoE's names; its MoE layers hold a text and a
    # vision expert group, moe_intermediate_size [text, vision] wide ("ernie_vl": the text group's is the experts'
    # width, the vision group's is kept as vision_moe_intermediate_size); the first layer dense unless mlp_layer_types;
    # RoPE 5e5 with an mrope_section (plain RoPE on interleaved pairs for text)
    "ernie4_5_vl_moe_text": {"rope_theta": 500000.0, "num_experts": 64, "num_experts_per_tok": 6, "ernie_vl": True,
                             "first_layer_dense": True,
                             "aliases": {"num_experts": "moe_num_experts", "num_experts_per_tok": "moe_k",
                                         "n_shared_experts": "moe_num_shared_experts"},
                             "fields": {"vocab_size": 103424, "hidden_size": 2560, "intermediate_size": 12288,
                                        "num_hidden_layers": 28, "num_attention_heads": 20, "num_key_value_heads": 4,
                                        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                                        "tie_word_embeddings": True, "use_bias": False, "moe_intermediate_size": [1536, 512],
                                        "moe_k": 6, "moe_num_experts": 64, "moe_num_shared_experts": 2,
                                        "moe_norm_min": 1e-12}},
    # DeepseekOcr2TextConfig (DeepSeek-OCR-2's language model): DeepSeek-V2's routing (softmax, greedy or group-limited,
    # times routed_scaling_factor, shared experts) under Llama attention (no MLA: its fields are not read, head_dim is
    # hidden_size / heads whatever the file says); MLP kinds from mlp_layer_types (required: its model has no other
    # rule), top-k without a default
    "deepseek_ocr2_text": {"num_experts": 64,
                           "ignored": ("head_dim", "first_k_dense_replace", "kv_lora_rank", "q_lora_rank",
                                       "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "norm_topk_prob"),
                           "fields": {"vocab_size": 102400, "hidden_size": 4096, "intermediate_size": 11008,
                                      "moe_intermediate_size": 1407, "num_hidden_layers": 32, "num_attention_heads": 32,
                                      "n_shared_experts": 2, "routed_scaling_factor": 1.0, "topk_method": "greedy",
                                      "n_group": None, "topk_group": None, "max_position_embeddings": 2048,
                                      "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2,
                                      "tie_word_embeddings": False}},
    # UnlimitedOcrTextConfig (Unlimited-OCR's language model): DeepSeek-OCR-2's, with one routing group by default, a
    # top-k default, the first first_k_dense_replace layers dense (1; a constructor argument, not kept) unless
    # mlp_layer_types, and 'reference_sliding_attention' on every layer unless layer_types ("reference_sliding_layers":
    # the prompt stays in sight, generated tokens slide over sliding_window, which it requires)
    "unlimited_ocr_text": {"num_experts": 64, "num_experts_per_tok": 6, "reference_sliding_layers": True,
                           "first_k_dense": 1,
                           "ignored": ("head_dim", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                       "v_head_dim", "norm_topk_prob", "use_sliding_window"),
                           "fields": {"vocab_size": 129280, "hidden_size": 1280, "intermediate_size": 6848,
                                      "moe_intermediate_size": 896, "num_hidden_layers": 12, "num_attention_heads": 10,
                                      "num_key_value_heads": 10, "n_shared_experts": 2, "routed_scaling_factor": 1.0,
                                      "topk_method": "greedy", "n_group": 1, "topk_group": 1,
                                      "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "bos_token_id": 0,
                                      "eos_token_id": 1, "tie_word_embeddings": False, "sliding_window": 128}},
    # MuseSparkTextConfig (Muse Spark's language model, on Muse Glimmer's decoder): without layer_types every 4th layer
    # counted back from the last full attention, the others sliding; those full layers NoPE unless layer_rope_theta
    # says otherwise (0 = NoPE: "muse_layers"); every layer MoE unless mlp_layer_types; its hidden_activation is not
    # read (hidden_act is)
    "muse_spark_text": {"rope_theta": 500_000.0, "num_experts": 256, "num_experts_per_tok": 8, "head_dim": 64,
                        "muse_layers": True, "ignored": ("hidden_activation",),
                        "fields": {"vocab_size": 202_048, "hidden_size": 8192, "intermediate_size": 16384,
                                   "num_hidden_layers": 62, "num_attention_heads": 128, "num_key_value_heads": 16,
                                   "head_dim": 64, "max_position_embeddings": 1_048_576, "rms_norm_eps": 1e-5,
                                   "eos_token_id": 200_001, "bos_token_id": 200_000, "tie_word_embeddings": False,
                                   "sliding_window": 2048, "final_logit_softcapping": 20.0,
                                   "qk_scale_factor": 5.4730064863875, "output_multiplier": 0.1767766952966369,
                                   "post_norm_eps": 1e-8, "moe_intermediate_size": 4096, "routed_scaling_factor": 1.0,
                                   "moe_hidden_size": 4096, "residual_gate_temperature": 0.3}},
    # AriaTextConfig: its own names for the expert count, top-k and shared experts (intermediate_size wide each)
    "aria_text": {"num_experts": 8, "num_experts_per_tok": 2,
                  "ignored": ("num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok",
                              "n_shared_experts", "moe_intermediate_size"),
                  "aliases": {"num_experts": "moe_num_experts", "num_experts_per_tok": "moe_topk",
                              "n_shared_experts": "moe_num_shared_experts"},
                  "fields": {"intermediate_size": 4096, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
                             "pad_token_id": 2, "bos_token_id": 1, "eos_token_id": 2, "mlp_bias": False,
                             "moe_num_experts": 8, "moe_topk": 2, "moe_num_shared_experts": 2}},
    # JambaConfig: Mamba-1 layers ('linear_attention') with attention every attn_layer_period-th layer from
    # attn_layer_offset, MoE every expert_layer_period-th from expert_layer_offset ("jamba_layers"; its layer_types
    # is a property of those four, never read from the file: "ignored"); the experts are intermediate_size wide
    "jamba": {"num_experts": 16, "num_experts_per_tok": 2, "jamba_layers": True, "ssm": "jamba",
              "ignored": ("layer_types", "moe_intermediate_size"),
              "fields": {"intermediate_size": 14336, "num_key_value_heads": 8, "max_position_embeddings": 262144,
                         "rms_norm_eps": 1e-6, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
                         "expert_layer_period": 2, "expert_layer_offset": 1, "attn_layer_period": 8,
                         "attn_layer_offset": 4, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2,
                         "mamba_dt_rank": "auto", "mamba_conv_bias": True, "mamba_proj_bias": False}},
    # GraniteMoeHybridConfig: Mamba-2 layers ('linear_attention'; every layer unless layer_types / the hub's
    # layers_block_type says otherwise, whose legacy 'mamba' / 'attention' names it remaps); attention with RoPE only
    # when position_embedding_type is 'rope' ("rope_switch"); GraniteMoE-Shared's multipliers, experts of
    # intermediate_size and shared MLP
    "granitemoehybrid": {"num_experts": 8, "num_experts_per_tok": 2, "ssm": "granite", "mamba_layers_default": True,
                         "rope_switch": "position_embedding_type", "ignored": ("moe_intermediate_size",),
                         "aliases": {"layer_types": "layers_block_type"},
                         "fields": {"intermediate_size": 11008, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
                                    "bos_token_id": 1, "eos_token_id": 2, "attention_multiplier": 1.0,
                                    "shared_intermediate_size": 1024, "mamba_n_heads": 128, "mamba_n_groups": 1,
                                    "mamba_d_state": 256, "mamba_d_head": "auto", "mamba_d_conv": 4, "mamba_expand": 2,
                                    "mamba_chunk_size": 256, "mamba_conv_bias": True, "mamba_proj_bias": False}},
    # NemotronHConfig: one sublayer per block -- 'linear_attention' (Mamba-2), 'full_attention' (no RoPE), 'moe',
    # 'mlp' -- from layers_block_type / layer_types, else the hub's hybrid_override_pattern (M, *, E, -), else
    # its four-block default; num_hidden_layers is the list's length ("nemotron_layers"). The hub's mamba_* names
    # win over the plain ones (as the config class pops them); DeepSeek-V3's sigmoid routing with a selection
    # bias; the norms' eps is layer_norm_epsilon; experts and shared expert are relu2 MLPs; never tied
    # (NemotronHForCausalLM has no tied weights, whatever tie_word_embeddings says: "ignored")
    "nemotron_h": {"num_experts": 8, "num_experts_per_tok": 2, "head_dim": 128, "ssm": "nemotron",
                   "nemotron_layers": True,
                   "ignored": ("rms_norm_eps", "hidden_act", "scoring_func", "tie_word_embeddings"),
                   "aliases": {"rms_norm_eps": "layer_norm_epsilon", "layer_types": "layers_block_type",
                               "shared_expert_intermediate_size": "moe_shared_expert_intermediate_size"},
                   "fields": {"num_key_value_heads": 8, "max_position_embeddings": 4096, "layer_norm_epsilon": 1e-5,
                              "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "intermediate_size": 21504,
                              "mlp_hidden_act": "relu2", "ssm_state_size": 128, "mamba_num_heads": 128,
                              "mamba_head_dim": 64, "mamba_hidden_act": "silu", "n_groups": 8, "conv_kernel": 4,
                              "time_step_min": 0.001, "use_conv_bias": True, "chunk_size": 128, "use_bias": False,
                              "moe_intermediate_size": 7688, "moe_shared_expert_intermediate_size": 7688,
                              "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
                              "scoring_func": "sigmoid", "mlp_bias": False}},
    # Lfm2MoeConfig (LFM2-MoE): 'conv' (gated short convolution) and 'full_attention' layers by layer_types (else the
    # hub's full_attn_idxs; one of them is required: transformers' model cannot run without); dense MLPs on the first
    # num_dense_layers, then sigmoid routing with a selection-only expert_bias; norm_eps; the hub's tie_embedding wins
    "lfm2_moe": {"rope_theta": 1e6, "num_experts": 32, "num_experts_per_tok": 4, "ssm": "lfm2", "lfm2_layers": True,
                 "ignored": ("rms_norm_eps", "first_k_dense_replace", "scoring_func", "n_group", "topk_group"),
                 "aliases": {"rms_norm_eps": "norm_eps", "first_k_dense_replace": "num_dense_layers"},
                 "overrides": {"tie_word_embeddings": "tie_embedding"},
                 "fields": {"intermediate_size": 7168, "moe_intermediate_size": 1792, "pad_token_id": 0,
                            "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": True,
                            "max_position_embeddings": 128000, "norm_eps": 1e-5, "num_key_value_heads": 8,
                            "conv_bias": False, "conv_L_cache": 3, "num_dense_layers": 2, "use_expert_bias": True,
                            "routed_scaling_factor": 1.0, "norm_topk_prob": True, "scoring_func": "sigmoid"}},
    # MiniMaxConfig (MiniMax-Text-01): lightning-attention ('linear_attention') and softmax-attention layers, by default
    # alternating from full ("minimax_layers"); Mixtral's MoE; residual alpha / beta factors; block_size the lightning
    # prefill's chunk
    "minimax": {"rope_theta": 1e6, "num_experts": 8, "num_experts_per_tok": 2, "ssm": "lightning",
                "minimax_layers": True,
                "fields": {"intermediate_size": 14336, "num_key_value_heads": 8, "max_position_embeddings": 131072,
                           "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2, "block_size": 256,
                           "full_attn_alpha_factor": 1, "full_attn_beta_factor": 1, "linear_attn_alpha_factor": 1,
                           "linear_attn_beta_factor": 1, "mlp_alpha_factor": 1, "mlp_beta_factor": 1}},
    # BailingHybridConfig (Ling-3): Kimi Delta Attention layers and MLA layers (the last of every layer_group_size,
    # "bailing_layers"), DeepSeek-V3 routing under Kimi-Linear's names (attribute_map); head_dim is the KDA heads' size
    # (and their count num_attention_heads, their conv short_conv_kernel_size: "bailing_sizes"), the MLA's RoPE size is
    # qk_rope_head_dim; the linear_* / qk_head_dim it saves are derived (re-derived here, as the class does)
    "bailing_hybrid": {"rope_theta": 6e6, "num_experts": 512, "num_experts_per_tok": 8, "bailing_layers": True,
                       "bailing_sizes": True,
                       # (num_key_value_heads: 32 by default, saved, unused: MLA has a KV head per query head)
                       "ignored": ("num_key_value_heads", "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim",
                                   "qk_head_dim",
                                   "rope_interleave", "n_routed_experts", "linear_key_head_dim", "linear_value_head_dim",
                                   "linear_num_key_heads", "linear_num_value_heads"),
                       "aliases": {"max_position_embeddings": "model_max_length", "norm_topk_prob": "moe_renormalize",
                                   "n_group": "num_expert_group", "num_experts_per_tok": "num_experts_per_token",
                                   "n_shared_experts": "num_shared_experts",
                                   "num_nextn_predict_layers": "num_mtp_layers"},
                       "fields": {"intermediate_size": 6144, "moe_intermediate_size": 768, "num_shared_experts": 1, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
                                  "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
                                  "num_expert_group": 8, "topk_group": 4, "first_k_dense_replace": 2,
                                  "moe_renormalize": True, "model_max_length": 262144, "rms_norm_eps": 1e-6,
                                  "pad_token_id": 156892, "eos_token_id": 156895, "num_mtp_layers": 1, "head_dim": 128,
                                  "short_conv_kernel_size": 4, "layer_group_size": 6, "kda_safe_gate": True,
                                  "kda_lower_bound": -5.0, "scoring_func": "sigmoid"}},
    # MiniMaxM3VLTextConfig (MiniMax-M3's language model): full and block-sparse ('minimax_m3_sparse', with a lightning
    # indexer) attention layers (layer_types, else the hub's sparse_attention_config.sparse_attention_freq, else all
    # full), dense / MoE MLPs (mlp_layer_types, else the hub's moe_layer_freq, else all MoE: "m3_layers"); the hub's
    # sparse_attention_config names win over the flat index_* ones ("nested_overrides"); hidden_act is always silu
    # (unused: the MLPs are SwiGLU-OAI). RoPE: rope_parameters' partial_rotary_factor (default the whole head) -- its
    # rotary_dim field, documented as the rotated dims, is not read by transformers 5.24's config (unlike MiniMax-M2's,
    # which converts it): nor here, for parity
    "minimax_m3_vl_text": {"rope_theta": 5e6, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 4,
                           "m3_layers": True, "nested_overrides": True, "ignored": ("hidden_act",),
                           "nested": {"sparse_attention_config": {
                               "sparse_num_index_heads": "index_n_heads", "sparse_index_dim": "index_head_dim",
                               "sparse_block_size": "index_block_size", "sparse_topk_blocks": "index_topk_blocks",
                               "sparse_local_block": "index_local_blocks"}},
                           "fields": {"num_key_value_heads": 4, "max_position_embeddings": 524288, "rms_norm_eps": 1e-6,
                                      "bos_token_id": 200034, "eos_token_id": 200020, "intermediate_size": 3072,
                                      "dense_intermediate_size": 12288, "shared_intermediate_size": 3072,
                                      "routed_scaling_factor": 2.0, "rotary_dim": 64, "swiglu_alpha": 1.702,
                                      "swiglu_limit": 7.0, "index_n_heads": 4, "index_head_dim": 128,
                                      "index_block_size": 128, "index_topk_blocks": 16, "index_local_blocks": 1}},
    # DeepseekV4Config: single-KV-head attention over a sliding window, plus compressed keys on the
    # 'compressed_sparse_attention' / 'heavily_compressed_attention' layers ("v4_layers": their kinds, the legacy
    # compress_ratios, else two HCA layers then CSA / HCA alternating); a "main" RoPE for the sliding layers and a
    # "compress" one (compress_rope_theta, the file's YaRN) for the others; every layer MoE (mlp_layer_types
    # 'hash_moe' / 'moe' in dynamoe.models.deepseek_v4), sqrt(softplus) router scores
    "deepseek_v4": {"num_experts": 256, "num_experts_per_tok": 6, "head_dim": 512, "v4_layers": True,
                    "scoring_funcs": ("sqrtsoftplus", "sigmoid"),
                    "fields": {"moe_intermediate_size": 2048, "num_key_value_heads": 1, "q_lora_rank": 1024,
                               "n_shared_experts": 1, "scoring_func": "sqrtsoftplus", "norm_topk_prob": True,
                               "routed_scaling_factor": 1.5, "max_position_embeddings": 1048576, "rope_theta": 10000.0,
                               "compress_rope_theta": 160000.0, "swiglu_limit": 10.0, "sliding_window": 128,
                               "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
                               "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-6, "bos_token_id": 0,
                               "eos_token_id": 1}},
    # Glm5NextTextConfig (GLM-5.3): KDA 'linear_attention' layers and NoPE MLA 'indexed_attention' ones (without
    # layer_types every 4th from 3; 'full_attention' read as 'indexed_attention': "glm5_layers"), the first three
    # MLPs dense; one head count and size for KDA's keys and values, from linear_attn_config when it has them
    # (nested ones win); head_dim is derived (0: "ignored"); hyper-connections etc. in dynamoe.models.glm5_next
    "glm5_next_text": {"num_experts": 288, "num_experts_per_tok": 8, "glm5_layers": True, "nested_overrides": True,
                       "ignored": ("head_dim",),
                       "aliases": {"linear_key_head_dim": "linear_head_dim", "linear_value_head_dim": "linear_head_dim",
                                   "linear_num_key_heads": "linear_num_heads",
                                   "linear_num_value_heads": "linear_num_heads"},
                       "nested": {"linear_attn_config": {"head_dim": "linear_head_dim", "num_heads": "linear_num_heads",
                                                         "short_conv_kernel_size": "linear_conv_kernel_dim"}},
                       "fields": {"intermediate_size": 12288, "moe_intermediate_size": 2048, "n_shared_experts": 1,
                                  "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
                                  "qk_rope_head_dim": 0, "v_head_dim": 256, "qk_nope_head_dim": 256, "n_group": 1,
                                  "topk_group": 1, "norm_topk_prob": True, "max_position_embeddings": 1048576,
                                  "rms_norm_eps": 1e-5, "pad_token_id": 154820, "index_topk": 2048,
                                  "index_head_dim": 128, "index_n_heads": 32, "swiglu_limit": 10.0,
                                  "linear_head_dim": 128, "linear_num_heads": 64, "linear_conv_kernel_dim": 4}},
    # MistralLarge4TextConfig: MLA without query LoRA (head_dim is qk_rope_head_dim whatever the file says), YaRN x2048
    # with attention factor 1, RoPE on the layers no_rope_layers says 1 (else all but every no_rope_layer_interval-th:
    # "nope_layers"), the first first_k_dense_replace MLPs dense; its router always renormalises (no such field)
    "mistral_large4_text": {"num_experts": 128, "num_experts_per_tok": 4, "head_dim_is_rope": True, "nope_layers": True,
                            "ignored": ("head_dim", "norm_topk_prob"),
                            "rope": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2048.0,
                                     "original_max_position_embeddings": 512, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "attention_factor": 1.0},
                            "fields": {"intermediate_size": 24576, "moe_intermediate_size": 6144, "n_shared_experts": 1,
                                       "routed_scaling_factor": 1.0, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                                       "v_head_dim": 128, "qk_nope_head_dim": 64, "n_group": 1, "topk_group": 1,
                                       "max_position_embeddings": 1048576, "rms_norm_eps": 1e-5, "bos_token_id": 1,
                                       "eos_token_id": 2, "index_topk": 2048, "index_head_dim": 128,
                                       "index_n_heads": 32, "first_k_dense_replace": 1, "norm_topk_prob": True,
                                       "no_rope_layer_interval": 4}},
    # HYV4Config / HYV4VLTextConfig (Hy4, Hy4-VL's text model): DeepSeek-V3.2's MLA and routing, head_dim and the KV
    # heads derived (qk_rope_head_dim; one per query head), the first MLP dense, indexer_types by default full on
    # layer 0 and every 4th from 1 ("hy_indexers"); Hy4's RoPE half-split, Hy4-VL's on interleaved pairs (its
    # mrope_section is plain RoPE for text: the three position ids are equal)
    "hy_v4": {**_MLA, "num_experts": 256, "num_experts_per_tok": 8, "first_layer_dense": True, "hy_indexers": True,
              "ignored": ("head_dim", "num_key_value_heads", "rope_interleave"),
              "fields": {**_HY4, "intermediate_size": 6912, "moe_intermediate_size": 768, "q_lora_rank": 1536,
                         "index_n_heads": 16}},
    "hy_v4_vl_text": {**_MLA, "num_experts": 256, "num_experts_per_tok": 8, "first_layer_dense": True,
                      "hy_indexers": True, "rope_interleave": True,
                      "ignored": ("head_dim", "num_key_value_heads", "rope_interleave"),
                      "fields": {**_HY4, "intermediate_size": 18432, "moe_intermediate_size": 2048,
                                 "q_lora_rank": 2048, "index_n_heads": 32}},
    # transformers' Glm4MoeConfig: RoPE on half of each head unless the config says otherwise
    "glm4_moe": {"partial_rotary_factor": 0.5, "num_experts": 128, "num_experts_per_tok": 8,
                 "fields": {"n_shared_experts": 1, "first_k_dense_replace": 1, "norm_topk_prob": True,
                            "num_key_value_heads": 8, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                            "num_nextn_predict_layers": 1}},
}


# layer kinds whose (uncompressed) keys are a sliding window of sliding_window positions
_WINDOWED = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
_LINEAR_ATTENTION_FIELDS = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                            "linear_num_key_heads", "linear_num_value_heads")

# ------------------------------------------------------------------------------------------ checks
def _err(name: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"config field {name!r} must be {allowed}, got {value!r}")


def _int(d: dict, name: str, default: Any = None, minimum: int = 1, required: bool = False) -> Optional[int]:
    v = d.get(name, default)
    if v is None:
        if required:
            raise ValueError(f"config field {name!r} is required (an int >= {minimum}) but missing")
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise _err(name, v, f"an int >= {minimum}")
    return v


def _float(d: dict, name: str, default: Any = None, positive: bool = False) -> Optional[float]:
    v = d.get(name, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (positive and v <= 0):
        raise _err(name, v, "a finite number" + (" > 0" if positive else ""))
    return float(v)


def _bool(d: dict, name: str, default: bool) -> bool:
    v = d.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _err(name, v, "true or false")
    return v


def _str(d: dict, name: str, default: Optional[str]) -> Optional[str]:
    v = d.get(name, default)
    if v is not None and not isinstance(v, str):
        raise _err(name, v, "a string")
    return v


def _int_list(d: dict, name: str) -> tuple:
    v = d.get(name)
    if v is None:
        return ()
    if isinstance(v, int) and not isinstance(v, bool):
        return (v,)
    if not isinstance(v, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
        raise _err(name, v, "an int or a list of ints")
    return tuple(v)


def _str_list(d: dict, name: str, length: int, allowed: tuple) -> tuple:
    v = d.get(name)
    if v is None:
        return ()
    if not isinstance(v, (list, tuple)) or len(v) != length or any(t not in allowed for t in v):
        raise _err(name, v, f"a list of {length} entries from {list(allowed)}")
    return tuple(v)


def _indexer_types(d: dict, layers: int) -> tuple:
    """GLM-5's per-layer indexer kinds, as transformers' GlmMoeDsaConfig derives them: ``indexer_types``,
    else ``index_topk_pattern`` ('F' full / 'S' shared per layer), else ``index_topk_freq`` with
    ``index_skip_topk_offset`` (layer i is full when max(i - offset + 1, 0) % freq == 0). () = all full."""
    if d.get("indexer_types") is not None:
        return _str_list(d, "indexer_types", layers, INDEXER_TYPES)
    pattern = d.get("index_topk_pattern")
    if pattern is not None:
        if isinstance(pattern, str):
            if any(c not in "FS" for c in pattern):
                raise _err("index_topk_pattern", pattern, "a string of 'F' (full) and 'S' (shared)")
            pattern = [{"F": "full", "S": "shared"}[c] for c in pattern]
        return _str_list({"index_topk_pattern": pattern}, "index_topk_pattern", layers, INDEXER_TYPES)
    if d.get("index_topk_freq") is None and d.get("index_skip_topk_offset") is None:
        return ()
    freq = max(_int(d, "index_topk_freq", 1, minimum=0), 1)
    offset = _int(d, "index_skip_topk_offset", 2, minimum=0)
    types = tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers))
    return () if all(t == "full" for t in types) else types


def _llama4_rope_layers(d: dict, layers: int) -> tuple:
    """Llama-4's per-layer RoPE switch as Llama4TextConfig derives it: ``no_rope_layers`` (1 = RoPE, 0 = NoPE;
    empty or null: the default), else NoPE on every ``no_rope_layer_interval``-th layer."""
    v = d.get("no_rope_layers")
    if not v:
        every = _int(d, "no_rope_layer_interval")
        return tuple(int((i + 1) % every != 0) for i in range(layers))
    if (not isinstance(v, (list, tuple)) or len(v) < layers
            or any(not isinstance(x, (int, float)) or x not in (0, 1) for x in v)):
        raise _err("no_rope_layers", v, f"a list of at least {layers} entries, each 1 (RoPE) or 0 (NoPE)")
    return tuple(int(x) for x in v[:layers])


def _kimi_layer_types(linear_attn_config: dict, layers: int) -> tuple:
    """Kimi-Linear's layer kinds as KimiLinearConfig derives them: the 1-based ``full_attn_layers`` and
    ``kda_layers`` of ``linear_attn_config`` when it has both (every layer in one of them), else full
    attention on layers 4, 8, ... (0-based) and KDA on the others."""
    if not isinstance(linear_attn_config, dict):
        raise _err("linear_attn_config", linear_attn_config, "a dict")
    full, kda = linear_attn_config.get("full_attn_layers"), linear_attn_config.get("kda_layers")
    if full is None or kda is None:
        return tuple("full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(layers))
    types = [None] * layers
    for name, ids, kind in (("full_attn_layers", full, "full_attention"), ("kda_layers", kda, "linear_attention")):
        if not isinstance(ids, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) or not 1 <= i <= layers
                                                     for i in ids):
            raise _err(f"linear_attn_config.{name}", ids, f"a list of 1-based layer numbers in [1, {layers}]")
        for i in ids:
            types[i - 1] = kind
    if None in types:
        raise _err("linear_attn_config", {"full_attn_layers": full, "kda_layers": kda},
                   f"full_attn_layers and kda_layers that together name every layer 1..{layers}")
    return tuple(types)


def _ropes_by_layer_type(d: dict, max_pos: int, defaults: dict, layer_types: tuple,
                         partial_default: float | None = None, nope_kinds: bool = False) -> tuple:
    """MiMo-V2-Flash: ``rope_parameters`` nested by layer type (``{"full_attention": {...}, "sliding_attention":
    {...}}``; absent or null: ``defaults``) as ((layer type, RopeConfig), ...), each parsed from its own dict
    alone (top-level rope_theta / partial_rotary_factor are not read, as MiMoV2FlashConfig), the partial
    factor defaulting to the family's (``partial_default`` when given: Laguna reads a missing one as 1, whatever
    its defaults say); every layer type in ``layer_types`` must have one. ``nope_kinds``: a kind may map to null (no
    RoPE on its layers: Beam's full layers), left out of the result."""
    params = d.get("rope_parameters")
    if params is None:
        params = defaults
    if not isinstance(params, dict) or not params or any(t not in LAYER_TYPES or not (
            isinstance(p, dict) or (nope_kinds and p is None)) for t, p in params.items()):
        raise _err("rope_parameters", params, f"a dict of RoPE parameters per layer type ({list(defaults)})")
    missing = sorted(set(layer_types) - set(params))
    if missing:
        raise _err("rope_parameters", params, f"RoPE parameters for every layer type in layer_types (missing {missing})")
    out = []
    for kind, p in params.items():
        if p is None:
            continue
        partial = (defaults.get(kind, {}).get("partial_rotary_factor", 1.0) if partial_default is None
                   else partial_default)
        out.append((kind, parse_rope({"rope_parameters": p}, max_pos, 10000.0, None, partial)))
    return tuple(out)


_STEP_PER_LAYER_LISTS = ("layer_types", "mlp_layer_types", "swiglu_limits", "swiglu_limits_shared", "rope_theta",
                         "partial_rotary_factors")


_DOTS3_PER_LAYER_LISTS = ("layer_types", "mlp_layer_types", "moe_layer_freq")


def _step_trim_mtp(d: dict, layers: int, lists: tuple = _STEP_PER_LAYER_LISTS) -> dict:
    """Per-layer lists (Step-3.5's :data:`_STEP_PER_LAYER_LISTS`, dots3_note's :data:`_DOTS3_PER_LAYER_LISTS`)
    padded with one trailing entry per multi-token-prediction layer (``num_nextn_predict_layers``), cut to the decoder
    layers as Step3p7TextConfig does; the cut entries kept under ``mtp_layer_entries`` (list name -> one entry per MTP
    layer: what those layers are, :mod:`dynamoe.models.step3p5`, :mod:`dynamoe.models.dots3_note`)."""
    mtp = _int(d, "num_nextn_predict_layers", 0, minimum=0) or 0
    if not mtp:
        return d
    d = dict(d)
    kept = {}
    for name in lists:
        v = d.get(name)
        if isinstance(v, (list, tuple)) and len(v) == layers + mtp:
            d[name], kept[name] = list(v[:layers]), list(v[layers:])
    if kept:
        d["mtp_layer_entries"] = kept
    return d


def _step_mlp_types(d: dict, layers: int) -> tuple:
    """Step-3.5's MLP kinds without ``mlp_layer_types``: MoE on the hub's ``moe_layers_enum`` (a comma-separated
    string or a list of layer indices), else on every layer from 3 (Step3p7TextConfig's rule)."""
    enum = d.get("moe_layers_enum")
    if enum is None:
        moe = set(range(3, layers))
    else:
        items = enum.split(",") if isinstance(enum, str) else enum
        try:
            if not isinstance(items, (list, tuple)) or any(isinstance(i, bool) for i in items):
                raise ValueError
            moe = {int(i) for i in items if str(i).strip()}
        except ValueError:
            raise _err("moe_layers_enum", enum, "a comma-separated string or a list of layer indices") from None
    return tuple("sparse" if i in moe else "dense" for i in range(layers))


def _step_ropes(d: dict, max_pos: int, layer_types: tuple) -> tuple:
    """Step-3.5's RoPE per layer type as ((layer type, RopeConfig), ...), as Step3p7TextConfig derives it:
    ``rope_parameters`` nested by layer type (what transformers saves; one dict for every layer kind of
    ``layer_types``), else each kind's from its first layer's entry of the hub's ``rope_theta`` (one number, or
    one per layer; default 1e4) and ``partial_rotary_factors`` (one per layer; default: the whole head), the
    full-attention kind updated with ``rope_scaling``. A single (not nested) rope_parameters dict is refused:
    transformers' config class ignores it (it would read the hub's fields instead)."""
    kinds = sorted(set(layer_types), key=layer_types.index)
    params = d.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict) or not all(isinstance(params.get(k), dict) for k in kinds):
            raise _err("rope_parameters", params, f"a dict of RoPE parameters for each layer type {kinds} (Step-3.5 "
                       "nests them by layer type; a single dict is not read by transformers either)")
        return tuple((k, parse_rope({"rope_parameters": params[k]}, max_pos)) for k in kinds)
    n = len(layer_types)
    theta = d.get("rope_theta", 10000.0)
    thetas = theta if isinstance(theta, (list, tuple)) else [theta] * n
    partials = d.get("partial_rotary_factors")
    if len(thetas) != n:
        raise _err("rope_theta", theta, f"a number or a list of {n} numbers (one per layer)")
    if partials is not None and (not isinstance(partials, (list, tuple)) or len(partials) != n):
        raise _err("partial_rotary_factors", partials, f"a list of {n} numbers (one per layer)")
    scaling = d.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise _err("rope_scaling", scaling, "a dict or null")
    out = []
    for k in kinds:
        i = layer_types.index(k)
        p = {"rope_type": "default", "rope_theta": thetas[i]}
        if partials is not None:
            p["partial_rotary_factor"] = partials[i]
        if k == "full_attention" and scaling:
            p.update(scaling)
        out.append((k, parse_rope({"rope_parameters": p}, max_pos)))
    return tuple(out)


V4_LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
_V4_COMPRESS_RATIO_KINDS = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}


def _v4_layer_types(d: dict, layers: int) -> tuple:
    """DeepSeek-V4's attention kinds as DeepseekV4Config derives them: ``layer_types`` (at least num_hidden_layers
    entries, cut to them), else the hub's per-layer ``compress_ratios`` (0 / 4 / 128), else two heavily compressed
    layers, then compressed-sparse and heavily compressed alternating."""
    v, name = d.get("layer_types"), "layer_types"
    if v is None and d.get("compress_ratios") is not None:
        v, name = d["compress_ratios"], "compress_ratios"
        if not isinstance(v, (list, tuple)) or any(isinstance(r, bool) or r not in _V4_COMPRESS_RATIO_KINDS for r in v):
            raise _err(name, v, f"a list of compress ratios from {sorted(_V4_COMPRESS_RATIO_KINDS)} (one per layer)")
        v = [_V4_COMPRESS_RATIO_KINDS[r] for r in v]
    if v is None:
        return (("heavily_compressed_attention",) * min(layers, 2)
                + tuple("compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
                        for i in range(max(layers - 2, 0))))
    if not isinstance(v, (list, tuple)) or len(v) < layers or any(t not in V4_LAYER_TYPES for t in v):
        raise _err(name, v, f"a list of at least {layers} entries from {list(V4_LAYER_TYPES)}")
    return tuple(v[:layers])


def _v4_ropes(d: dict, max_pos: int, head_dim: int) -> tuple:
    """DeepSeek-V4's two RoPEs as (("main", RopeConfig), ("compress", RopeConfig)), as DeepseekV4Config derives them:
    ``rope_parameters`` nested by those labels when it has both, else "main" a plain RoPE of base rope_theta and
    "compress" one of base compress_rope_theta with the file's rope_parameters / rope_scaling (YaRN: its attention
    factor 1 unless given); both on the ``partial_rotary_factor`` share of each head (default: the legacy
    qk_rope_head_dim / head_dim, else 64 / 512)."""
    partial = d.get("partial_rotary_factor")
    if partial is None:
        rope_dim = _int(d, "qk_rope_head_dim")
        partial = rope_dim / head_dim if rope_dim is not None else 64 / 512
    params = d.get("rope_parameters")
    if params is None:
        params = d.get("rope_scaling")
    if params is not None and not isinstance(params, dict):
        raise _err("rope_parameters", params, "a dict or null")
    params = params or {}
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        return tuple((k, parse_rope({"rope_parameters": params[k]}, max_pos)) for k in ("main", "compress"))
    scaling = {k: v for k, v in params.items() if k not in ("main", "compress")}
    main = {"rope_type": "default", "rope_theta": d.get("rope_theta", 10000.0), "partial_rotary_factor": partial}
    compress = {**scaling, "rope_theta": d.get("compress_rope_theta", 160000.0), "partial_rotary_factor": partial}
    if "type" in compress and "rope_type" not in compress:
        compress["rope_type"] = compress.pop("type")
    compress.setdefault("rope_type", "default")
    if compress["rope_type"] == "yarn":
        compress.setdefault("attention_factor", 1.0)
    return tuple((k, parse_rope({"rope_parameters": p}, max_pos)) for k, p in (("main", main), ("compress", compress)))


#: dots3_note's sliding layers' MLA sizes when config.json has no per_layer_config (Dots3NoteTextConfig's swa_* defaults)
_DOTS3_SWA = {"num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 1024, "kv_lora_rank": 1024,
              "head_dim": 256, "qk_nope_head_dim": 192, "v_head_dim": 128}
#: the per-layer MLA sizes dynamoe reads (MLA has one KV head per query head: num_key_value_heads is accepted, unused)
DOTS3_LAYER_FIELDS = tuple(k for k in _DOTS3_SWA if k != "num_key_value_heads") + ("qk_rope_head_dim",)


def _dots3_layer_types(d: dict, layers: int) -> tuple:
    """dots3_note's attention kinds as Dots3NoteTextConfig derives them: ``layer_types``, else DSA ('indexed_attention')
    on layers 0, 1 and every 4th from 1 and sliding elsewhere (all DSA without ``use_sliding_window``); ``use_dsa``
    false (default true, unset when the file has a per_layer_config) turns DSA into plain 'full_attention'."""
    use_dsa = d.get("use_dsa", None if "per_layer_config" in d else True)
    v = d.get("layer_types")
    if v is None:
        full = "full_attention" if use_dsa is False else "indexed_attention"
        sliding = _bool(d, "use_sliding_window", True)
        v = [full if not sliding or i < 2 or i % 4 == 1 else "sliding_attention" for i in range(layers)]
    kinds = ("full_attention", "indexed_attention", "sliding_attention")
    if not isinstance(v, (list, tuple)) or len(v) != layers or any(t not in kinds for t in v):
        raise _err("layer_types", v, f"a list of {layers} entries from {list(kinds)}")
    if use_dsa is not None:
        old, new = ("full_attention", "indexed_attention") if use_dsa else ("indexed_attention", "full_attention")
        v = [new if t == old else t for t in v]
    return tuple(v)


def dots3_layer_sizes(d: dict, layer_types: tuple) -> tuple:
    """Each layer's MLA sizes ({field: value} over :data:`DOTS3_LAYER_FIELDS`) as Dots3NoteTextConfig's per-layer
    views give them: the file's ``per_layer_config`` entry (keyed by layer index) over the top-level fields; without
    a per_layer_config, the sliding layers take the ``swa_*`` fields (defaults :data:`_DOTS3_SWA`; their
    qk_rope_head_dim = head_dim - qk_nope_head_dim unless swa_qk_rope_head_dim)."""
    base = {k: d.get(k) for k in DOTS3_LAYER_FIELDS}
    per_layer = d.get("per_layer_config")
    if per_layer is None:
        swa = {k: d.get(f"swa_{k}", v) for k, v in _DOTS3_SWA.items() if k in DOTS3_LAYER_FIELDS}
        swa["qk_rope_head_dim"] = d.get("swa_qk_rope_head_dim", swa["head_dim"] - swa["qk_nope_head_dim"])
        per_layer = {str(i): swa for i, t in enumerate(layer_types) if t == "sliding_attention"}
    if not isinstance(per_layer, dict):
        raise _err("per_layer_config", per_layer, "a dict of per-layer overrides keyed by layer index")
    out = []
    for i in range(len(layer_types)):
        over = per_layer.get(str(i), per_layer.get(i, {}))
        if not isinstance(over, dict) or any(k not in DOTS3_LAYER_FIELDS + ("num_key_value_heads",) for k in over):
            raise _err(f"per_layer_config.{i}", over, f"a dict over {list(DOTS3_LAYER_FIELDS)} (and num_key_value_heads)")
        sizes = {k: v for k, v in {**base, **over}.items() if k in DOTS3_LAYER_FIELDS}
        if layer_types[i] == "sliding_attention" and isinstance(sizes["head_dim"], int) and (
                sizes["head_dim"] != (sizes["qk_nope_head_dim"] or 0) + (sizes["qk_rope_head_dim"] or 0)):
            raise _err(f"per_layer_config.{i}.head_dim", sizes["head_dim"], "qk_nope_head_dim + qk_rope_head_dim on a "
                       "sliding layer (as Dots3NoteTextConfig checks)")
        for k, v in sizes.items():
            _int(sizes, k, required=k != "q_lora_rank", minimum=1)
            if v is None and k == "q_lora_rank":
                raise ValueError(f"config field 'q_lora_rank' is required for every layer of dots3_note (layer {i})")
        out.append(sizes)
    return tuple(out)


def _dots3_ropes(d: dict, max_pos: int, layer_types: tuple) -> tuple:
    """dots3_note's RoPE per layer type as Dots3NoteTextConfig derives it: ``rope_parameters`` nested by layer type
    (or one dict for every type, or the hub's ``rope_scaling``), else base ``swa_rope_theta`` (5e4) on the sliding
    layers and ``rope_theta`` (8e7) on the others; each on the qk_rope_head_dim / head_dim share of its first layer."""
    params = d.get("rope_parameters")
    if params is None:
        params = d.get("rope_scaling")
    kinds = sorted(set(layer_types), key=layer_types.index)
    if params is None:
        params = {k: {"rope_type": "default", "rope_theta": d.get("swa_rope_theta", 50_000.0)
                      if k == "sliding_attention" else d.get("rope_theta", 80_000_000.0)} for k in kinds}
    if not isinstance(params, dict):
        raise _err("rope_parameters", params, "a dict")
    if not any(k in LAYER_TYPES for k in params):
        params = {k: dict(params) for k in kinds}
    sizes = dots3_layer_sizes(d, layer_types)
    out = []
    for k in kinds:
        p = params.get(k)
        if not isinstance(p, dict):
            raise _err("rope_parameters", params, f"RoPE parameters for every layer type (missing {k!r})")
        first = sizes[layer_types.index(k)]
        p = {**p, "partial_rotary_factor": first["qk_rope_head_dim"] / first["head_dim"]}
        out.append((k, parse_rope({"rope_parameters": p}, max_pos)))
    return tuple(out)


def _rotary_dim_factor(d: dict, head_dim: int) -> float:
    """MiniMax-M2: a hub config's ``rotary_dim`` (rotated dims per head) as a partial_rotary_factor, as
    transformers' MiniMaxM2Config converts it; 1.0 when absent (a saved rope_parameters or a top-level
    partial_rotary_factor still wins in parse_rope)."""
    rotary_dim = _int(d, "rotary_dim")
    if rotary_dim is None:
        return 1.0
    if rotary_dim > head_dim or rotary_dim % 2:
        raise _err("rotary_dim", rotary_dim, f"an even int <= head_dim={head_dim}")
    return rotary_dim / head_dim


# ------------------------------------------------------------------------------------------ RoPE
@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters, whichever style the config used.

    rope_type: 'default' | 'linear' | 'dynamic' | 'yarn' | 'llama3' | 'longrope' | 'proportional' (Gemma 4: the
    whole head rotates as pairs (i, i + d/2), the first partial_rotary_factor share of the pairs at frequencies
    theta^(-2i/d) / factor, the others not at all; see rope.rotary_dims). theta: the base.
    factor: context scaling (linear, dynamic, yarn, llama3). original_max_position_embeddings: the
    pre-training length (yarn, llama3). beta_fast / beta_slow / truncate / mscale / mscale_all_dim /
    attention_factor: YaRN. low_freq_factor / high_freq_factor: llama3.
    partial_rotary_factor: fraction of each head's dims that rotate (GLM-4.5: 0.5).
    """

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: Optional[int] = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    attention_factor: Optional[float] = None
    low_freq_factor: Optional[float] = None
    high_freq_factor: Optional[float] = None
    partial_rotary_factor: float = 1.0
    #: Llama-4's attention scaling (Mistral-4): queries times 1 + beta ln(1 + floor(position /
    #: original_max_position_embeddings)); None: not scaled
    llama_4_scaling_beta: Optional[float] = None
    #: longrope (Phi-3.5): per-frequency divisors of the base frequencies for sequences up to
    #: original_max_position_embeddings (short) and beyond (long), and the cos/sin scale of each (Phi-3.5-MoE)
    short_factor: tuple = ()
    long_factor: tuple = ()
    short_mscale: Optional[float] = None
    long_mscale: Optional[float] = None


def parse_rope(d: dict, max_position_embeddings: int, default_theta: float = 10000.0,
               family_default: Optional[dict] = None, default_partial: float = 1.0) -> RopeConfig:
    """RopeConfig from a config dict in either style (see the module docstring)."""
    params = d.get("rope_parameters")
    if params is None:
        params = d.get("rope_scaling")
    if params is None:
        params = dict(family_default or {})
    if not isinstance(params, dict):
        raise _err("rope_parameters" if "rope_parameters" in d else "rope_scaling", params, "a dict or null")
    if any(k in LAYER_TYPES for k in params):
        raise ValueError(f"config field 'rope_parameters' nested per layer type ({sorted(params)}) is not supported; "
                         "supported: one rope_parameters dict for all layers")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise _err("rope_type", rope_type, f"one of {list(ROPE_TYPES)}")
    theta = params.get("rope_theta", d.get("rope_theta", default_theta))
    partial = params.get("partial_rotary_factor", d.get("partial_rotary_factor", default_partial))
    merged = {**params, "rope_theta": theta, "partial_rotary_factor": partial}
    theta = _float(merged, "rope_theta", positive=True)
    partial = _float(merged, "partial_rotary_factor", positive=True)
    if partial > 1:
        raise _err("partial_rotary_factor", partial, "in (0, 1]")
    beta = _float(merged, "llama_4_scaling_beta")
    if rope_type == "default":
        return RopeConfig("default", theta, partial_rotary_factor=partial, llama_4_scaling_beta=beta,
                          original_max_position_embeddings=_int(merged, "original_max_position_embeddings"))
    if rope_type == "proportional":  # (factor: divides every frequency, default 1)
        return RopeConfig("proportional", theta, _float(merged, "factor", 1.0, positive=True),
                          partial_rotary_factor=partial, llama_4_scaling_beta=beta)
    orig = _int(merged, "original_max_position_embeddings", d.get("original_max_position_embeddings"))
    if rope_type in ("yarn", "llama3") and orig is None:
        orig = max_position_embeddings  # transformers' standardize_rope_params does the same
    if rope_type == "longrope":
        lists = {}
        for name in ("short_factor", "long_factor"):
            v = merged.get(name)
            if (not isinstance(v, (list, tuple)) or not v
                    or any(isinstance(x, bool) or not isinstance(x, (int, float)) or not x > 0 for x in v)):
                raise _err(name, v, "a non-empty list of numbers > 0 (one per rotary frequency) for rope_type 'longrope'")
            lists[name] = tuple(float(x) for x in v)
        if orig is None:
            raise ValueError("config field 'original_max_position_embeddings' is required for rope_type 'longrope' "
                             "but missing")
        # transformers: factor defaults to max_position_embeddings / original, the attention factor to
        # sqrt(1 + ln(factor) / ln(original)) (1 when factor <= 1)
        factor = _float(merged, "factor", positive=True) or max_position_embeddings / orig
        attention = _float(merged, "attention_factor", positive=True)
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
        return RopeConfig("longrope", theta, factor, orig, attention_factor=attention,
                          short_mscale=_float(merged, "short_mscale", positive=True),
                          long_mscale=_float(merged, "long_mscale", positive=True),
                          partial_rotary_factor=partial, llama_4_scaling_beta=beta, **lists)
    factor = merged.get("factor")
    if factor is None and rope_type == "yarn":
        factor = max_position_embeddings / orig
    factor = _float({"factor": factor}, "factor", positive=True)
    if factor is None:
        raise ValueError(f"config field 'factor' is required for rope_type {rope_type!r} but missing")
    if rope_type == "llama3":
        for name in ("low_freq_factor", "high_freq_factor"):
            if merged.get(name) is None:
                raise ValueError(f"config field {name!r} is required for rope_type 'llama3' but missing")
    return RopeConfig(
        rope_type, theta, factor, orig,
        beta_fast=_float(merged, "beta_fast") or 32.0, beta_slow=_float(merged, "beta_slow") or 1.0,
        truncate=_bool(merged, "truncate", True), mscale=_float(merged, "mscale"),
        mscale_all_dim=_float(merged, "mscale_all_dim"), attention_factor=_float(merged, "attention_factor"),
        low_freq_factor=_float(merged, "low_freq_factor"), high_freq_factor=_float(merged, "high_freq_factor"),
        partial_rotary_factor=partial, llama_4_scaling_beta=beta,
    )


# ------------------------------------------------------------------------------------------ state-space layers
#: SSM layer kinds: 'mamba1' (Mamba's selective scan, a state per channel: Jamba), 'mamba2' (Mamba-2's
#: scalar decay per head: GraniteMoE-Hybrid, Nemotron-H) and 'short_conv' (LFM2's gated short convolution: a conv
#: window and no SSM state; state_size 0) and 'lightning' (MiniMax's linear attention with a fixed decay per head:
#: a [head_dim, head_dim] state per head, no conv; conv_kernel 1)
SSM_KINDS = ("mamba1", "mamba2", "short_conv", "lightning")


@dataclass(frozen=True)
class SSMConfig:
    """The recurrent layers' sizes of a family whose _FAMILY_DEFAULTS entry names an "ssm" reader (its
    'linear_attention' layers -- Mamba, lightning attention -- or 'conv' layers), under one set of names whatever
    the config class calls them.

    ``intermediate_size``: the inner width (``expand`` x hidden_size); ``state_size``: N, the state per
    channel (Mamba-1) or per head dim (Mamba-2); ``conv_kernel``: the causal depthwise conv's width.
    Mamba-1: ``dt_rank`` (the low-rank time-step projection). Mamba-2: ``num_heads`` x ``head_dim`` =
    intermediate_size, ``n_groups`` (heads share B and C by group), ``chunk_size`` (the prefill's SSD
    chunk; any value gives the same numbers up to rounding), ``time_step_limit`` (dt clamped to it). Lightning
    attention: ``num_heads`` x ``head_dim`` (a [head_dim, head_dim] state per head: ``state_size`` = head_dim), no
    conv (``conv_kernel`` 1). Short convolution: hidden_size channels, ``conv_kernel`` taps, no state
    (``state_size`` 0)."""

    kind: str
    intermediate_size: int
    state_size: int
    conv_kernel: int
    conv_bias: bool = True
    proj_bias: bool = False
    activation: str = "silu"
    dt_rank: Optional[int] = None
    num_heads: Optional[int] = None
    head_dim: Optional[int] = None
    n_groups: int = 1
    chunk_size: int = 256
    time_step_limit: tuple = (0.0, math.inf)

    @property
    def conv_channels(self) -> int:
        """Channels of the conv (and of its cached window): x (Mamba-1); x, B and C (Mamba-2)."""
        return self.intermediate_size + (2 * self.n_groups * self.state_size if self.kind == "mamba2" else 0)

    @property
    def state_elements(self) -> int:
        """Elements of one layer's recurrent state per sequence."""
        return self.intermediate_size * self.state_size


def _json_float(x):
    """transformers saves a non-finite float in config.json as {"__float__": "Infinity"} (or "-Infinity", "NaN")."""
    if isinstance(x, dict) and set(x) == {"__float__"} and isinstance(x["__float__"], str):
        try:
            return float(x["__float__"])
        except ValueError:
            return x
    return x


def _time_step_limit(d: dict, name: str) -> tuple:
    v = d.get(name) if name else None
    if v is None:
        return (0.0, math.inf)
    if isinstance(v, (list, tuple)):
        v = [_json_float(x) for x in v]
    if (not isinstance(v, (list, tuple)) or len(v) != 2
            or any(isinstance(x, bool) or not isinstance(x, (int, float)) or math.isnan(x) for x in v) or v[0] > v[1]):
        raise _err(name, v, "a pair [low, high] of numbers with low <= high")
    return (float(v[0]), float(v[1]))


def _parse_ssm(d: dict, reader: str, hidden: int) -> SSMConfig:
    """The :class:`SSMConfig` of a config dict whose family reads its Mamba sizes as ``reader`` says:
    'jamba' (JambaConfig's mamba_* names, Mamba-1 with dt_rank 'auto' = ceil(hidden / 16)); 'granite'
    (GraniteMoeHybridConfig's mamba_* names, Mamba-2 with mamba_d_head 'auto' = expand x hidden / heads);
    'nemotron' (NemotronHConfig's, Mamba-2 of mamba_num_heads x mamba_head_dim)."""
    if reader == "jamba":
        rank = d.get("mamba_dt_rank")
        rank = math.ceil(hidden / 16) if rank == "auto" else _int(d, "mamba_dt_rank", required=True)
        return SSMConfig("mamba1", _int(d, "mamba_expand", required=True) * hidden,
                         _int(d, "mamba_d_state", required=True), _int(d, "mamba_d_conv", required=True),
                         conv_bias=_bool(d, "mamba_conv_bias", True), proj_bias=_bool(d, "mamba_proj_bias", False),
                         activation=_str(d, "hidden_act", "silu"), dt_rank=rank)
    if reader == "granite":
        inner = _int(d, "mamba_expand", required=True) * hidden
        heads = _int(d, "mamba_n_heads", required=True)
        head_dim = inner // heads if d.get("mamba_d_head") == "auto" else _int(d, "mamba_d_head", required=True)
        if inner % heads or head_dim * heads != inner:
            raise _err("mamba_n_heads", heads, f"a divisor of mamba_expand x hidden_size = {inner} with mamba_d_head "
                       f"x mamba_n_heads = {inner} (mamba_d_head: {d.get('mamba_d_head')!r})")
        return _mamba2(d, inner, heads, head_dim, "mamba_d_state", "mamba_n_groups", "mamba_d_conv", "mamba_conv_bias",
                       "mamba_proj_bias", "hidden_act", "mamba_chunk_size", "time_step_limit")
    if reader == "lightning":  # the attention heads' sizes; block_size is the prefill's chunk
        heads = _int(d, "num_attention_heads", required=True)
        head_dim = _int(d, "head_dim") or hidden // heads
        return SSMConfig("lightning", heads * head_dim, head_dim, 1, conv_bias=False,
                         activation=_str(d, "hidden_act", "silu"), num_heads=heads, head_dim=head_dim,
                         chunk_size=_int(d, "block_size", 256))
    if reader == "lfm2":  # the gated short convolution: in / out projections with the conv's bias flag
        bias = _bool(d, "conv_bias", False)
        return SSMConfig("short_conv", hidden, 0, _int(d, "conv_L_cache", required=True), conv_bias=bias,
                         proj_bias=bias)
    if reader == "nemotron":  # (the hub's mamba_* names win, as NemotronHConfig pops them over the plain ones)
        def name(plain: str, hub: str) -> str:
            return hub if d.get(hub) is not None else plain

        heads, head_dim = _int(d, "mamba_num_heads", required=True), _int(d, "mamba_head_dim", required=True)
        low = _float(d, name("time_step_min", "mamba_dt_min"), 0.0)
        cfg = _mamba2(d, heads * head_dim, heads, head_dim, "ssm_state_size", name("n_groups", "mamba_n_groups"),
                      name("conv_kernel", "mamba_d_conv"), name("use_conv_bias", "mamba_conv_bias"), "use_bias",
                      "mamba_hidden_act", name("chunk_size", "mamba_chunk_size"), "")
        # the mixer clamps dt below at time_step_min, never above (time_step_limit is not read)
        return dataclasses.replace(cfg, time_step_limit=(low, math.inf))
    raise ValueError(f"unknown SSM reader {reader!r}")  # (a _FAMILY_DEFAULTS entry names one of the above)


def _mamba2(d: dict, inner: int, heads: int, head_dim: int, state: str, groups: str, conv: str, conv_bias: str,
            proj_bias: str, act: str, chunk: str, limit: str) -> SSMConfig:
    """A Mamba-2 :class:`SSMConfig` from the config's fields of these names."""
    n_groups = _int(d, groups, 1)
    if heads % n_groups:
        raise _err(groups, n_groups, f"a divisor of the Mamba heads ({heads})")
    return SSMConfig("mamba2", inner, _int(d, state, required=True), _int(d, conv, required=True),
                     conv_bias=_bool(d, conv_bias, True), proj_bias=_bool(d, proj_bias, False),
                     activation=_str(d, act, "silu"), num_heads=heads, head_dim=head_dim, n_groups=n_groups,
                     chunk_size=_int(d, chunk, 256), time_step_limit=_time_step_limit(d, limit))


def _m3_flags(d: dict, name: str, layers: int, default: int = 0) -> list:
    """MiniMax-M3's per-layer 0/1 flags: ``sparse_attention_freq`` (in ``sparse_attention_config``) or
    ``moe_layer_freq`` (top level); absent: ``default`` for every layer."""
    v = (d.get("sparse_attention_config") or {}).get(name) if name == "sparse_attention_freq" else d.get(name)
    if v is None:
        return [default] * layers
    if not isinstance(v, (list, tuple)) or len(v) != layers or any(f not in (0, 1) for f in v):
        raise _err(name, v, f"a list of {layers} flags (0 / 1 or true / false), one per layer")
    return [bool(f) for f in v]


#: Nemotron-H's feed-forward-only blocks (its layer_types also name them; other families refuse them)
NEMOTRON_BLOCKS = ("moe", "mlp")
_NEMOTRON_PATTERN = {"M": "linear_attention", "*": "full_attention", "E": "moe", "-": "mlp"}


def _nemotron_blocks(d: dict) -> list:
    """Nemotron-H's block kinds as NemotronHConfig derives them: layer_types (legacy names remapped), else the hub's
    hybrid_override_pattern (one character per block: M Mamba, * attention, E MoE, - MLP), else its default."""
    v = d.get("layer_types")
    if v is None:
        pattern = d.get("hybrid_override_pattern")
        if pattern is None:
            return ["linear_attention", "moe", "full_attention", "mlp"]
        if not isinstance(pattern, str) or not pattern or any(c not in _NEMOTRON_PATTERN for c in pattern):
            raise _err("hybrid_override_pattern", pattern, f"a non-empty string of {sorted(_NEMOTRON_PATTERN)}")
        return [_NEMOTRON_PATTERN[c] for c in pattern]
    if not isinstance(v, (list, tuple)) or not v:
        raise _err("layer_types", v, f"a non-empty list of block kinds from {list(_NEMOTRON_PATTERN.values())}")
    return [_LEGACY_LAYER_TYPES.get(t, t) if isinstance(t, str) else t for t in v]


#: the layer kinds' names before transformers 5 (config classes remap them, as here)
_LEGACY_LAYER_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}


def _jamba_layers(d: dict, layers: int, experts: int) -> tuple[tuple, tuple]:
    """Jamba's (layer_types, mlp_layer_types) as JambaConfig derives them: attention where i % attn_layer_period
    == attn_layer_offset (else Mamba: 'linear_attention'); MoE where i % expert_layer_period == expert_layer_offset
    (when there is more than one expert), else a dense MLP."""
    out = []
    for period, offset in (("attn_layer_period", "attn_layer_offset"), ("expert_layer_period", "expert_layer_offset")):
        p, o = _int(d, period, required=True), _int(d, offset, minimum=0, required=True)
        if o >= p:
            raise _err(offset, o, f"an int < {period}={p}")
        out.append([i % p == o for i in range(layers)])
    attn, moe = out
    return (tuple("full_attention" if a else "linear_attention" for a in attn),
            tuple("sparse" if m and experts > 1 else "dense" for m in moe))


# ------------------------------------------------------------------------------------------ model
@dataclass(frozen=True)
class ModelConfig:
    """What the model families read, typed and validated (see :meth:`from_dict`).

    Layer structure: ``layer_types[i]`` is 'full_attention', 'sliding_attention' (window
    ``sliding_window``), 'chunked_attention' (Llama-4: chunks of ``attention_chunk_size``) or
    'indexed_attention' (V3.2 / GLM-5 sparse attention, whose families build it whatever the entry says),
    'linear_attention' (a recurrent layer: Gated DeltaNet, KDA, Mamba, lightning attention, as the family says), or
    a kind of one family only (Nemotron-H's 'moe' / 'mlp' blocks, LFM2's 'conv', MiniMax-M3's 'minimax_m3_sparse');
    :meth:`is_moe_layer` says whether layer i has routed experts;
    ``indexer_types`` (GLM-5) which layers run their own indexer.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    #: Cohere2-MoE: the norms are LayerNorms (mean subtracted; weight, no bias) with eps ``rms_norm_eps`` (read from
    #: ``layer_norm_eps``), not RMSNorms
    layer_norm: bool = False
    architectures: tuple = ()
    #: ((layer type, RopeConfig), ...) where the RoPE differs per layer type (MiMo-V2-Flash; DeepSeek-V4: by the
    #: labels "main" and "compress"; ``rope`` is the
    #: full-attention one); () = ``rope`` for every layer
    rope_by_layer_type: tuple = ()
    intermediate_size: Optional[int] = None        # dense MLP layers
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    #: Qwen2-MoE: biases on q/k/v only (o_proj has none)
    qkv_bias: bool = False
    #: OLMoE: q, k and v are clamped to [-clip_qkv, clip_qkv] after their projections (and norms)
    clip_qkv: Optional[float] = None
    sliding_window: Optional[int] = None
    layer_types: tuple = ()
    # routed experts
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: Optional[int] = None
    #: Qwen2-MoE, Qwen3-Next / Qwen3.5 (and GraniteMoE-Shared's ``shared_intermediate_size``): the hidden size of
    #: the one shared expert
    shared_expert_intermediate_size: Optional[int] = None
    norm_topk_prob: bool = False
    mlp_only_layers: tuple = ()
    decoder_sparse_step: int = 1
    swiglu_limit: Optional[float] = None
    swiglu_alpha: float = 1.702
    # DeepSeek-V3 / Kimi-K2 / GLM-4.5 (and V3.2 / GLM-5 indexer)
    first_k_dense_replace: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    scoring_func: str = "softmax"
    topk_method: Optional[str] = None
    use_qk_norm: bool = False
    q_lora_rank: Optional[int] = None
    kv_lora_rank: Optional[int] = None
    qk_nope_head_dim: Optional[int] = None
    qk_rope_head_dim: Optional[int] = None
    v_head_dim: Optional[int] = None
    rope_interleave: bool = False
    index_topk: Optional[int] = None
    index_head_dim: Optional[int] = None
    index_n_heads: Optional[int] = None
    #: GLM-5: per layer, 'full' (runs its indexer) or 'shared' (reuses the previous full layer's top-k); () = all full
    indexer_types: tuple = ()
    #: DeepSeek-V3.2 / GLM-5: per layer 'dense' or 'sparse' (overrides first_k_dense_replace when given)
    mlp_layer_types: tuple = ()
    num_nextn_predict_layers: int = 0
    #: Phi-3.5-MoE: SparseMixer's relative margin at inference (2 * router_jitter_noise), and a bias on the lm_head
    router_jitter_noise: float = 0.0
    lm_head_bias: bool = False
    #: LongCat-Flash: zero-computation experts (their output is their input) after the routed ones in the routing
    #: pool (``zero_expert_num``); a bias on the router's logits (``router_bias``)
    zero_experts: int = 0
    router_bias: bool = False
    # GraniteMoE (muP): embeddings times embedding_multiplier, each sublayer's output times
    # residual_multiplier before its residual add, softmax scale attention_multiplier (None: head_dim^-1/2),
    # logits divided by logits_scaling
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: Optional[float] = None
    logits_scaling: float = 1.0
    # Qwen3-Next / Qwen3.5: Gated DeltaNet ('linear_attention' layers) and the sigmoid-gated shared expert
    linear_conv_kernel_dim: Optional[int] = None
    linear_key_head_dim: Optional[int] = None
    linear_value_head_dim: Optional[int] = None
    linear_num_key_heads: Optional[int] = None
    linear_num_value_heads: Optional[int] = None
    # Llama-4: 'chunked_attention' layers see the keys of their own chunk of attention_chunk_size positions;
    # no_rope_layers[i] 1 = RoPE in layer i, 0 = NoPE (() = RoPE everywhere); on NoPE layers with
    # attn_temperature_tuning the queries are scaled by 1 + attn_scale * ln(1 + floor((p + 1) / floor_scale));
    # intermediate_size_mlp: the dense layers' MLP width (the experts' and shared expert's: intermediate_size)
    attention_chunk_size: Optional[int] = None
    no_rope_layers: tuple = ()
    attn_temperature_tuning: bool = False
    floor_scale: Optional[float] = None
    attn_scale: Optional[float] = None
    intermediate_size_mlp: Optional[int] = None
    #: the recurrent layers' sizes of Jamba, GraniteMoE-Hybrid, Nemotron-H (Mamba), MiniMax-Text-01 (lightning
    #: attention) and LFM2-MoE (short convolutions); None for the other families
    ssm: Optional[SSMConfig] = None
    #: the config.json nested this model under ``text_config`` (Qwen3.5-MoE's multimodal checkpoint)
    text_config_nested: bool = False
    # tokens
    bos_token_id: Optional[int] = None
    eos_token_id: tuple = ()
    pad_token_id: Optional[int] = None
    quantization_config: Optional[dict] = field(default=None, compare=False)
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    # ---- derived ------------------------------------------------------------------------------
    @property
    def family_type(self) -> str:
        """The model_type whose family defaults apply: a wrapper's text model type, else ``model_type``."""
        return self.raw.get("text_model_type") or self.model_type

    def layer_sliding_window(self, i: int) -> Optional[int]:
        """The sliding window of layer i, or None for full attention (DeepSeek-V4's compressed layers attend over a
        window of uncompressed keys too)."""
        return self.sliding_window if self.layer_types and self.layer_types[i] in _WINDOWED else None

    def layer_reference_window(self, i: int) -> Optional[int]:
        """The window of layer i's reference sliding-window attention (Unlimited-OCR's 'reference_sliding_attention':
        the prompt stays in sight, generated tokens slide over it), or None."""
        return self.sliding_window if self.layer_types and self.layer_types[i] == "reference_sliding_attention" else None

    def layer_attention_chunk(self, i: int) -> Optional[int]:
        """The attention chunk of layer i (Llama-4's 'chunked_attention' layers), or None."""
        return self.attention_chunk_size if self.layer_types and self.layer_types[i] == "chunked_attention" else None

    def layer_uses_rope(self, i: int) -> bool:
        """Whether layer i rotates its queries and keys (``no_rope_layers``; () = every layer)."""
        return not self.no_rope_layers or bool(self.no_rope_layers[i])

    def kv_elements_per_position(self) -> int:
        """Cache elements one position of one sequence takes over all layers: keys and values per KV head
        (GQA), or the compressed latent and the rotary key (MLA), plus the indexer's key (DSA)."""
        if self.model_type == "deepseek_v4":  # the key; a compressed layer's raw rows and entries (see deepseek_v4.py)
            d, i = self.head_dim, self.index_head_dim or 0
            per = {"sliding_attention": d, "heavily_compressed_attention": 4 * d,
                   "compressed_sparse_attention": 6 * d + 5 * i}
            return sum(per[t] for t in self.layer_types)
        if self.family_type in INKLING_TYPES:  # the sliding layers' own KV heads and head size (looped: once a pass)
            return sum(2 * kv * d for _, kv, d in inkling_cache_sizes(self))
        if self.family_type == "gemma4_text":  # own sizes; shared layers none
            return sum(2 * g.num_key_value_heads * g.head_dim for i, g in enumerate(gemma4_attention_layers(self))
                       if g.kv_source == i)
        if self.family_type == "qwen4_exp_text":  # indexed layers: keys, values, the QSA's raw and block keys
            per = 2 * self.num_key_value_heads * self.head_dim + 2 * (self.index_head_dim or 0)
            return per * sum(t == "indexed_attention" for t in self.layer_types)
        if self.kv_lora_rank:
            per_layer = self.kv_lora_rank + (self.qk_rope_head_dim or 0) + (self.index_head_dim or 0)
        elif self.model_type == "mimo_v2_flash":  # values v_head_dim wide; sliding layers have twice the KV heads
            return sum((2 if t == "sliding_attention" else 1) * self.num_key_value_heads * (self.head_dim + self.v_head_dim)
                       for t in self.layer_types)
        else:
            per_layer = 2 * self.num_key_value_heads * self.head_dim
        # linear-attention layers keep a fixed-size state per sequence instead (see linear_attention.py); Nemotron-H's
        # feed-forward blocks keep nothing
        linear = sum(t in ("linear_attention", "conv") + NEMOTRON_BLOCKS for t in self.layer_types)
        sublayers = 2 if self.model_type == "longcat_flash" else 1   # (two attention sublayers per layer)
        # MiniMax-M3's block-sparse layers also cache their indexer's key
        indexed = sum(t == "minimax_m3_sparse" for t in self.layer_types) * (self.index_head_dim or 0)
        return per_layer * sublayers * (self.num_hidden_layers - linear) + indexed

    def state_elements_per_sequence(self) -> dict[str, int]:
        """Fixed-size cache elements one sequence takes over all linear-attention (or Mamba) layers, whatever its
        length: ``conv_state`` (the conv window, in the cache's dtype) and ``recurrent_state`` (fp32);
        zeros for models without such layers."""
        if self.family_type in INKLING_TYPES:  # four short convolutions per layer: keys, values, both outputs
            W = _int(self.raw, "conv_kernel_size", 4) - 1
            return {"conv_state": sum((2 * kv * d + 2 * self.hidden_size) * W
                                      for _, kv, d in inkling_cache_sizes(self)), "recurrent_state": 0}
        linear = sum(t in ("linear_attention", "conv") for t in self.layer_types)
        if not linear:
            return {"conv_state": 0, "recurrent_state": 0}
        if self.ssm is not None:  # Mamba layers: the conv window of x (and B, C) and the SSM state
            return {"conv_state": linear * self.ssm.conv_channels * (self.ssm.conv_kernel - 1),
                    "recurrent_state": linear * self.ssm.state_elements}
        key, value = self.linear_num_key_heads * self.linear_key_head_dim, self.linear_num_value_heads * self.linear_value_head_dim
        conv = linear * (2 * key + value) * (self.linear_conv_kernel_dim - 1)
        if self.family_type == "qwen4_exp_text":  # + each PLE layer's dilated conv window over the streams (and its
            # n - 1 context token ids, int64, not counted)
            f = qwen4_fields(self)
            conv += len(f.ple_layers) * f.hc_count * self.hidden_size * (f.ple_conv_kernel_size - 1) * f.ngram_size
        return {"conv_state": conv,
                "recurrent_state": linear * self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim}

    def is_moe_layer(self, i: int) -> bool:
        """Qwen3-MoE's rule (mlp_only_layers, decoder_sparse_step), DeepSeek's first_k_dense_replace, or
        ``mlp_layer_types`` when the config lists them (DeepSeek-V3.2 / GLM-5)."""
        if self.num_experts == 0:
            return False
        if self.mlp_layer_types:
            # a multi-token-prediction layer (past the list, i >= num_hidden_layers) is sparse, as DeepSeek's are
            return i >= len(self.mlp_layer_types) or self.mlp_layer_types[i] == "sparse"
        if i in self.mlp_only_layers or i < self.first_k_dense_replace:
            return False
        return (i + 1) % self.decoder_sparse_step == 0

    # ---- parsing ------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """Parse an HF config.json dict; ValueError naming the field for bad or missing values. A
        vision-language wrapper (:data:`TEXT_WRAPPERS`) parses as its text model, see :func:`unwrap_text_config`."""
        if not isinstance(d, dict):
            raise ValueError(f"config must be a dict (config.json's contents), got {type(d).__name__}")
        d = unwrap_text_config(d)
        model_type = _str(d, "model_type", None)
        if not model_type:
            raise ValueError("config field 'model_type' is required but missing")
        reason = refusal(model_type)  # before any field: a wrapper or hybrid would fail on one for the wrong reason
        if reason is not None:
            raise ValueError(f"{model_type}: {reason} (model_type {model_type!r} is not supported)")
        text_nested = d.get("text_model_type") is not None
        fam = _FAMILY_DEFAULTS.get(d.get("text_model_type") or model_type, {})
        nested = {}
        for sub, names in fam.get("nested", {}).items():  # DBRX's attn_config / ffn_config, read as top-level fields
            inner = d.get(sub) or {}
            if not isinstance(inner, dict):
                raise _err(sub, inner, "a dict")
            nested.update({ours: inner[theirs] for theirs, ours in names.items() if inner.get(theirs) is not None})
        # the file's own (non-null) fields win over its nested ones, which win over the family's defaults
        # (Kimi-Linear: the nested ones win, as its config class reads them); fields the family's transformers
        # class does not read ("ignored") are dropped from the file (the defaults stay)
        ignored = fam.get("ignored", ())
        own = {k: v for k, v in d.items() if k not in ignored}
        if fam.get("nested_overrides"):
            d = {**fam.get("fields", {}), **own, **nested}
        else:
            d = {**fam.get("fields", {}), **nested, **{k: v for k, v in own.items() if v is not None or k not in nested}}
        for name in fam.get("per_layer_lists", ()):  # one value for every layer, or ValueError
            v = d.get(name)
            if isinstance(v, (list, tuple)):
                if not v or any(x != v[0] for x in v):
                    raise _err(name, v, "an int (or a list of one value for every layer: per-layer values are not supported)")
                d[name] = v[0]
        for ours, theirs in fam.get("aliases", {}).items():
            if d.get(ours) is None and d.get(theirs) is not None:
                d[ours] = d[theirs]
        names = fam.get("layer_type_names")
        if names:  # a family's own layer kind names (ZAYA's 'hybrid' / 'hybrid_sliding') -> ours, also as RoPE keys
            lt = d.get("layer_types")
            if lt is not None:
                if not isinstance(lt, (list, tuple)) or any(not isinstance(t, str) or t not in names for t in lt):
                    raise _err("layer_types", lt, f"a list of entries from {list(names)}")
                d["layer_types"] = [names[t] for t in lt]
            rp = d.get("rope_parameters")
            if isinstance(rp, dict) and rp and all(k in names for k in rp):
                d["rope_parameters"] = {names[k]: v for k, v in rp.items()}
        for ours, theirs in fam.get("overrides", {}).items():  # the hub's name wins whenever given (LFM2's tie_embedding)
            if d.get(theirs) is not None:
                d[ours] = d[theirs]
        scaling = d.get("rope_scaling")
        if (fam.get("deepseek_yarn") and isinstance(scaling, dict)
                and "deepseek_yarn" in (scaling.get("type"), scaling.get("rope_type"))):  # Sarvam: YaRN by another name
            d = {**d, "rope_parameters": {**{k: v for k, v in scaling.items() if k != "type"}, "rope_type": "yarn"}}
            del d["rope_scaling"]
        if fam.get("ernie_vl"):  # [text, vision] expert widths: the text group's is the experts' (dynamoe runs text)
            sizes = d.get("moe_intermediate_size")
            if (not isinstance(sizes, (list, tuple)) or len(sizes) != 2
                    or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in sizes)):
                raise _err("moe_intermediate_size", sizes, "a list of two ints >= 1 (the text and the vision experts' "
                           "widths)")
            d = {**d, "moe_intermediate_size": sizes[0], "vision_moe_intermediate_size": sizes[1]}
        if fam.get("inkling_layers") and d.get("dense_intermediate_size") is not None:
            # (InklingTextConfig: the experts are intermediate_size wide, the dense MLPs dense_intermediate_size)
            d = {**d, "moe_intermediate_size": d.get("intermediate_size"), "intermediate_size": d["dense_intermediate_size"]}
        if fam.get("window_size_plus_one") and d.get("sliding_window_size") is not None:
            d["sliding_window"] = _int(d, "sliding_window_size") + 1
        if d.get("routed_scaling_factor", 0) is None:
            d["routed_scaling_factor"] = 1.0  # (MiMo-V2-Flash's hub config says null: no scaling)
        archs = d.get("architectures") or ()
        if not isinstance(archs, (list, tuple)) or not all(isinstance(a, str) for a in archs):
            raise _err("architectures", archs, "a list of strings")

        if fam.get("heads_kv_times_top_k"):  # JetMoE: K heads per chosen attention expert
            d["num_attention_heads"] = (_int(d, "num_key_value_heads", required=True)
                                        * _int(d, "num_experts_per_tok", fam["num_experts_per_tok"], required=True))
        hidden = _int(d, "hidden_size", required=True)
        heads = _int(d, "num_attention_heads", required=True)
        if fam.get("num_layers_halved"):  # LongCat: our layers are its num_layers (two sublayers each; default: the value)
            given = d.get("num_hidden_layers")   # (LongcatFlashConfig sets it after num_layers: it wins)
            if given is not None:
                n = _int(d, "num_hidden_layers")
                if n % 2:
                    raise _err("num_hidden_layers", given, "an even int (twice num_layers: two sublayers per layer)")
                d["num_layers"] = n // 2
            d["num_hidden_layers"] = _int(d, "num_layers", fam["num_layers_halved"])
        if fam.get("nemotron_layers"):  # the block list decides the layer count (num_hidden_layers is derived)
            d = {**d, "layer_types": _nemotron_blocks(d)}
            d["num_hidden_layers"] = len(d["layer_types"])
        layers = _int(d, "num_hidden_layers", required=True)
        if fam.get("step_layers"):
            d = _step_trim_mtp(d, layers)
        elif fam.get("dots3_layers"):
            d = _step_trim_mtp(d, layers, _DOTS3_PER_LAYER_LISTS)
        kv_heads = _int(d, "num_key_value_heads", heads) or heads  # null: as many as the query heads
        if heads % kv_heads:
            raise _err("num_key_value_heads", kv_heads, f"a divisor of num_attention_heads={heads}")
        if fam.get("bailing_sizes"):  # KDA heads: head_dim wide, num_attention_heads of them; MLA's RoPE: qk_rope
            kda_dim = _int(d, "head_dim", required=True)
            d = {**d, "linear_key_head_dim": kda_dim, "linear_value_head_dim": kda_dim, "linear_num_key_heads": heads,
                 "linear_num_value_heads": heads, "linear_conv_kernel_dim": _int(d, "short_conv_kernel_size", 4),
                 "head_dim": _int(d, "qk_rope_head_dim", required=True)}
        if fam.get("head_dim_is_qk"):  # Mistral-4's config class sets head_dim = qk_nope + qk_rope, whatever the file says
            head_dim = _int(d, "qk_nope_head_dim", required=True) + _int(d, "qk_rope_head_dim", required=True)
        elif fam.get("head_dim_is_rope") and d.get("head_dim") is None and d.get("qk_rope_head_dim") is not None:
            head_dim = _int(d, "qk_rope_head_dim")  # MLA: what transformers sets (and saves) when the file has none
        else:
            head_dim = _int(d, "head_dim", fam.get("head_dim")) or hidden // heads
        max_pos = _int(d, "max_position_embeddings", 4096)

        experts = fam.get("num_experts", 0)
        for key in _EXPERT_COUNT_KEYS:
            if d.get(key) is not None:
                experts = _int(d, key, minimum=0)
                break
        # GPT-OSS's config.json also says experts_per_token
        top_k = _int(d, "num_experts_per_tok", d.get("experts_per_token", fam.get("num_experts_per_tok", 0)), minimum=0)
        top_k = top_k or 0
        if experts and not 1 <= top_k <= experts:
            raise _err("num_experts_per_tok", top_k, f"an int in [1, num_experts={experts}]")

        sliding = _int(d, "sliding_window", fam.get("sliding_window"), minimum=0) or None  # 0: none (Qwen2-MoE)
        layer_types = d.get("layer_types")
        kinds = LAYER_TYPES + (("chunked_attention",) if fam.get("chunked_layers") else ()) + (
            NEMOTRON_BLOCKS if fam.get("nemotron_layers") else ()) + (("conv",) if fam.get("lfm2_layers") else ()) + (
            ("minimax_m3_sparse",) if fam.get("m3_layers") else ())
        if fam.get("reference_sliding_layers"):  # (its model builds no other kinds)
            kinds = ("full_attention", "reference_sliding_attention")
        chunk = _int(d, "attention_chunk_size") if fam.get("chunked_layers") else None
        no_rope_layers = _llama4_rope_layers(d, layers) if fam.get("llama4_layers") or fam.get("nope_layers") else ()
        if fam.get("rope_switch"):  # GraniteMoE-Hybrid: RoPE in every attention layer when the field says 'rope'
            switch = d.get(fam["rope_switch"])
            if switch not in (None, "rope"):
                raise _err(fam["rope_switch"], switch, "'rope' or null (no position encoding)")
            no_rope_layers = (int(switch == "rope"),) * layers
        if fam.get("ssm") and isinstance(layer_types, (list, tuple)):   # (the Mamba families' hub configs)
            layer_types = [_LEGACY_LAYER_TYPES.get(t, t) if isinstance(t, str) else t for t in layer_types]
        if fam.get("v4_layers"):
            layer_types = _v4_layer_types(d, layers)
        elif fam.get("dots3_layers"):
            layer_types = _dots3_layer_types(d, layers)
        elif fam.get("glm5_layers"):  # every 4th layer (from 3) MLA, the others KDA; 'full_attention' is MLA
            if layer_types is None:
                layer_types = ["linear_attention" if i % 4 != 3 else "indexed_attention" for i in range(layers)]
            if isinstance(layer_types, (list, tuple)):
                layer_types = ["indexed_attention" if t == "full_attention" else t for t in layer_types]
            if (not isinstance(layer_types, (list, tuple)) or len(layer_types) != layers
                    or any(t not in ("linear_attention", "indexed_attention") for t in layer_types)):
                raise _err("layer_types", d.get("layer_types"), f"a list of {layers} entries from ['linear_attention', "
                           "'indexed_attention', 'full_attention']")
            layer_types = tuple(layer_types)
        elif fam.get("qwen4_layers"):  # every n-th layer QSA-indexed attention, the others linear; 'full_attention'
            # is read as 'indexed_attention' (the released configs say so of their indexed layers)
            if layer_types is None:
                n = _int(d, "full_attention_interval", fam["full_attention_interval"])
                layer_types = ["indexed_attention" if (i + 1) % n == 0 else "linear_attention" for i in range(layers)]
            if isinstance(layer_types, (list, tuple)):
                layer_types = ["indexed_attention" if t == "full_attention" else t for t in layer_types]
            if (not isinstance(layer_types, (list, tuple)) or len(layer_types) != layers
                    or any(t not in ("linear_attention", "indexed_attention") for t in layer_types)):
                raise _err("layer_types", d.get("layer_types"), f"a list of {layers} entries from ['linear_attention', "
                           "'indexed_attention', 'full_attention']")
            layer_types = tuple(layer_types)
        elif layer_types is not None:
            if (not isinstance(layer_types, (list, tuple)) or len(layer_types) != layers
                    or any(t not in kinds for t in layer_types)):
                raise _err("layer_types", layer_types, f"a list of {layers} entries from {list(kinds)}")
            layer_types = tuple(layer_types)
        elif fam.get("reference_sliding_layers"):
            layer_types = ("reference_sliding_attention",) * layers
        elif fam.get("llama4_layers"):  # the RoPE layers chunked (when there is a chunk size), the NoPE ones full
            layer_types = tuple("chunked_attention" if r and chunk is not None else "full_attention"
                                for r in no_rope_layers)
        elif fam.get("cohere_layers"):  # the dense prefix by its own pattern, the others every n-th full
            k = _int(d, "first_k_dense_replace", 0, minimum=0)
            if k > layers:
                raise _err("first_k_dense_replace", k, f"an int in [0, num_hidden_layers={layers}]")
            p, n = _int(d, "prefix_dense_sliding_window_pattern", required=True), _int(d, "sliding_window_pattern",
                                                                                       required=True)
            layer_types = tuple("sliding_attention" if (i + 1) % p else "full_attention" for i in range(k)) + tuple(
                "sliding_attention" if (i + 1) % n else "full_attention" for i in range(layers - k))
        elif fam.get("full_attention_every"):  # every n-th layer full attention, the others sliding (Kolibri-1)
            n = fam["full_attention_every"]
            layer_types = tuple("full_attention" if (i + 1) % n == 0 else "sliding_attention" for i in range(layers))
        elif fam.get("inkling_layers"):  # sliding on local_layer_ids, else on all but every 6th
            local = d.get("local_layer_ids")
            if local is not None and (not isinstance(local, (list, tuple))
                                      or any(isinstance(i, bool) or not isinstance(i, int) for i in local)):
                raise _err("local_layer_ids", local, "a list of layer indices (the sliding-window layers)")
            local = set(local) if local is not None else {i for i in range(layers) if (i + 1) % 6}
            layer_types = tuple("sliding_attention" if i in local else "full_attention" for i in range(layers))
        elif fam.get("muse_layers"):  # every 4th layer counted back from the last full attention, the others sliding
            layer_types = tuple("full_attention" if (layers - 1 - i) % 4 == 0 else "sliding_attention"
                                for i in range(layers))
        elif fam.get("lara_layers"):  # the released pattern, period 5
            pattern = ("linear_attention", "sliding_attention", "linear_attention", "full_attention", "sliding_attention")
            layer_types = tuple(pattern[i % 5] for i in range(layers))
        elif fam.get("gemma4_layers"):  # every 6th layer full attention, the others sliding (the last: below)
            layer_types = tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers))
        elif fam.get("beam_layers"):  # every 6th layer and the last full attention, the others sliding
            layer_types = tuple("full_attention" if (i + 1) % 6 == 0 or i == layers - 1 else "sliding_attention"
                                for i in range(layers))
        elif fam.get("jamba_layers"):
            layer_types = _jamba_layers(d, layers, experts)[0]
        elif fam.get("m3_layers"):  # MiniMax-M3: the hub's per-layer sparse flags, else every layer full attention
            layer_types = tuple("minimax_m3_sparse" if f else "full_attention"
                                for f in _m3_flags(d, "sparse_attention_freq", layers))
        elif fam.get("bailing_layers"):  # the last layer of every group MLA, the others KDA
            n = _int(d, "layer_group_size", required=True)
            layer_types = tuple("full_attention" if (i + 1) % n == 0 else "linear_attention" for i in range(layers))
        elif fam.get("minimax_layers"):  # MiniMax: even layers softmax attention, odd ones lightning
            layer_types = tuple("full_attention" if (i + 1) % 2 else "linear_attention" for i in range(layers))
        elif fam.get("mamba_layers_default"):   # GraniteMoE-Hybrid: every layer Mamba
            layer_types = ("linear_attention",) * layers
        elif fam.get("lfm2_layers"):  # LFM2: full attention on full_attn_idxs, short convolutions elsewhere
            idxs = d.get("full_attn_idxs")
            if idxs is None:
                raise ValueError(f"config field 'layer_types' (or 'full_attn_idxs') is required for {model_type}: "
                                 "which layers are attention and which short convolutions")
            if (not isinstance(idxs, (list, tuple))
                    or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers for i in idxs)):
                raise _err("full_attn_idxs", idxs, f"a list of layer indices in [0, {layers})")
            layer_types = tuple("full_attention" if i in idxs else "conv" for i in range(layers))
        elif fam.get("afmoe_layers"):  # every n-th layer full attention, the others sliding
            n = _int(d, "global_attn_every_n_layers", required=True)
            layer_types = tuple("sliding_attention" if (i + 1) % n else "full_attention" for i in range(layers))
        elif fam.get("step_layers") or fam.get("full_layers_by_default"):  # every layer full, whatever the window
            layer_types = ("full_attention",) * layers
        elif fam.get("granite_swa_layers"):
            layer_types = tuple("full_attention" if i % 4 == 0 else "sliding_attention" for i in range(layers))
        elif fam.get("flint_layers"):
            layer_types = tuple("full_attention" if i < 2 or i % 4 == 1 or i == layers - 1 else "sliding_attention"
                                for i in range(layers))
        elif fam.get("mimo_layers"):  # layer 0 and every 6th full attention, the others sliding
            layer_types = tuple("full_attention" if i == 0 or (i + 1) % 6 == 0 else "sliding_attention"
                                for i in range(layers))
        elif fam.get("kimi_layers"):
            layer_types = _kimi_layer_types(d.get("linear_attn_config") or {}, layers)
        elif fam.get("full_attention_interval"):  # Qwen3-Next / Qwen3.5: every n-th layer full, the others linear
            n = _int(d, "full_attention_interval", fam["full_attention_interval"])
            layer_types = tuple("full_attention" if (i + 1) % n == 0 else "linear_attention" for i in range(layers))
        elif fam.get("alternating_layers"):  # GPT-OSS: even layers sliding, odd layers full
            layer_types = tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers))
        elif fam.get("exaone_windows"):  # every pattern-th layer global (transformers derives no other pattern)
            pattern = d.get("sliding_window_pattern")
            if sliding is None or isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
                raise ValueError(f"config field 'layer_types' is required for {model_type} unless sliding_window is set "
                                 f"and sliding_window_pattern is an int >= 1 (got {sliding!r}, {pattern!r})")
            layer_types = tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers))
        elif fam.get("windows_from_max_window_layers"):  # dots1: layers >= max_window_layers slide (when windowed)
            start = _int(d, "max_window_layers", minimum=0)
            layer_types = tuple("sliding_attention" if sliding is not None and i >= start else "full_attention"
                                for i in range(layers))
            sliding = sliding if "sliding_attention" in layer_types else None
        elif fam.get("qwen2_windows") and _bool(d, "use_sliding_window", False):  # even layers < max_window_layers
            below = _int(d, "max_window_layers", minimum=0)
            layer_types = tuple("sliding_attention" if i % 2 == 0 and i < below else "full_attention"
                                for i in range(layers))
        elif sliding is not None and _bool(d, "use_sliding_window", True):
            layer_types = ("sliding_attention",) * layers  # Mixtral / Qwen3 with use_sliding_window
        else:
            layer_types = ("full_attention",) * layers
            sliding = None  # as Qwen3MoeConfig: no window unless use_sliding_window
        if fam.get("muse_layers"):  # layer_rope_theta: 0 = NoPE (its other values are not read: one RoPE base)
            thetas = d.get("layer_rope_theta")
            if thetas is None:
                no_rope_layers = tuple(int((layers - 1 - i) % 4 != 0) for i in range(layers))
            elif (not isinstance(thetas, (list, tuple)) or len(thetas) != layers
                  or any(isinstance(t, bool) or not isinstance(t, (int, float)) or t < 0 for t in thetas)):
                raise _err("layer_rope_theta", thetas, f"a list of {layers} numbers >= 0 (0: no RoPE in that layer)")
            else:
                no_rope_layers = tuple(int(bool(t)) for t in thetas)
        if fam.get("gemma4_layers") and layer_types and layer_types[-1] != "full_attention":
            # (Gemma4TextConfig forces the last layer to full attention, with a warning)
            log.warning("config field 'layer_types': the last layer must be 'full_attention', got %r; forcing it as "
                        "transformers does", layer_types[-1])
            layer_types = tuple(layer_types[:-1]) + ("full_attention",)
        if "sliding_attention" in layer_types and sliding is None:
            raise ValueError("config field 'sliding_window' is required when layer_types has 'sliding_attention'")
        if "reference_sliding_attention" in layer_types and sliding is None:
            raise ValueError("config field 'sliding_window' is required (an int >= 1) when layer_types has "
                             f"'reference_sliding_attention', got {d.get('sliding_window')!r}")
        if "chunked_attention" in layer_types and chunk is None:
            raise ValueError("config field 'attention_chunk_size' is required when layer_types has 'chunked_attention'")
        linear_sizes = {name: _int(d, name) for name in _LINEAR_ATTENTION_FIELDS}
        ssm = _parse_ssm(d, fam["ssm"], hidden) if fam.get("ssm") else None
        if "linear_attention" in layer_types and ssm is None:
            for name, v in linear_sizes.items():
                if v is None:
                    raise ValueError(f"config field {name!r} is required when layer_types has 'linear_attention'")
            if linear_sizes["linear_num_value_heads"] % linear_sizes["linear_num_key_heads"]:
                raise _err("linear_num_value_heads", linear_sizes["linear_num_value_heads"],
                           f"a multiple of linear_num_key_heads={linear_sizes['linear_num_key_heads']}")

        # (DeepSeek-V4: every layer MoE; its 'hash_moe' / 'moe' kinds are read by dynamoe.models.deepseek_v4)
        mlp_types = () if fam.get("v4_layers") else _str_list(d, "mlp_layer_types", layers, MLP_LAYER_TYPES)
        if not mlp_types and fam.get("step_layers"):
            mlp_types = _step_mlp_types(d, layers)
        if not mlp_types and fam.get("moe_switch"):  # one switch for every layer (Doge's is_moe)
            mlp_types = ("sparse" if _bool(d, fam["moe_switch"], False) else "dense",) * layers
        if not mlp_types and fam.get("inkling_layers"):  # the hub's first dense_mlp_idx layers dense
            n = min(_int(d, "dense_mlp_idx", 0, minimum=0), layers)
            mlp_types = ("dense",) * n + ("sparse",) * (layers - n)
        if not mlp_types and fam.get("dense_prefix"):  # the first n layers dense (Beam: 3)
            n = min(fam["dense_prefix"], layers)
            mlp_types = ("dense",) * n + ("sparse",) * (layers - n)
        if not mlp_types and fam.get("m3_layers"):  # the hub's moe_layer_freq, else every layer MoE
            mlp_types = tuple("sparse" if f else "dense" for f in _m3_flags(d, "moe_layer_freq", layers, default=1))
        if not mlp_types and fam.get("nemotron_layers"):  # the 'moe' blocks
            mlp_types = tuple("sparse" if t == "moe" else "dense" for t in layer_types)
        if not mlp_types and fam.get("jamba_layers"):
            mlp_types = _jamba_layers(d, layers, experts)[1]
        if not mlp_types and fam.get("axk_mlp_layers"):  # A.X-K1/K2, dots3: MoE from first_k_dense_replace, every freq-th
            first, freq = _int(d, "first_k_dense_replace", minimum=0), d.get("moe_layer_freq")
            if isinstance(freq, (list, tuple)):  # (dots3: one flag per layer)
                if len(freq) < layers:
                    raise _err("moe_layer_freq", freq, f"an int >= 1 or a list of {layers} flags")
                mlp_types = tuple("sparse" if i >= first and bool(freq[i]) else "dense" for i in range(layers))
            else:
                freq = _int(d, "moe_layer_freq")
                mlp_types = tuple("sparse" if i >= first and i % freq == 0 else "dense" for i in range(layers))
        if not mlp_types and fam.get("glm5_layers"):  # the first three dense
            mlp_types = ("dense",) * min(3, layers) + ("sparse",) * max(0, layers - 3)
        if not mlp_types and fam.get("first_k_dense") is not None:  # the first first_k_dense_replace layers dense
            k = min(_int(d, "first_k_dense_replace", fam["first_k_dense"], minimum=0), layers)
            mlp_types = ("dense",) * k + ("sparse",) * (layers - k)
        if not mlp_types and fam.get("first_layer_dense"):
            mlp_types = ("dense",) + ("sparse",) * (layers - 1)
        if not mlp_types and fam.get("llama4_layers"):  # moe_layers, else every step-th layer from step - 1
            moe_ids = d.get("moe_layers")
            if moe_ids is None:
                step = _int(d, "interleave_moe_layer_step")
                moe_ids = range(step - 1, layers, step)
            elif (not isinstance(moe_ids, (list, tuple))
                  or any(isinstance(i, bool) or not isinstance(i, int) for i in moe_ids)):
                raise _err("moe_layers", moe_ids, "a list of layer indices")
            mlp_types = tuple("sparse" if i in set(moe_ids) else "dense" for i in range(layers))
        if not mlp_types and fam.get("ernie_moe_layers"):
            start, every = _int(d, "moe_layer_start_index", minimum=0), _int(d, "moe_layer_interval")
            end = _int(d, "moe_layer_end_index", minimum=-1)
            end = layers - 1 if end == -1 else end
            mlp_types = tuple("sparse" if (i + 1) % every == 0 and start <= i <= end else "dense" for i in range(layers))
        if fam.get("cohere_layers"):  # the first first_k_dense_replace layers dense; RoPE on the sliding layers and,
            # with a prefix pattern of 1 (all full), on the dense ones
            if not mlp_types:
                k = _int(d, "first_k_dense_replace", 0, minimum=0)
                mlp_types = tuple("dense" if i < k else "sparse" for i in range(layers))
            prefix_rope = _int(d, "prefix_dense_sliding_window_pattern", required=True) == 1
            no_rope_layers = tuple(int(t == "sliding_attention" or (m == "dense" and prefix_rope))
                                   for t, m in zip(layer_types, mlp_types))
        if fam.get("hy_indexers"):  # Hy4: indexer_types, else full on layer 0 and every 4th from 1 (no other rule)
            indexer_types = (_str_list(d, "indexer_types", layers, INDEXER_TYPES)
                             or tuple("full" if i == 0 or (i - 1) % 4 == 0 else "shared" for i in range(layers)))
        else:
            indexer_types = _indexer_types(d, layers)
        mlp_only = _int_list(d, "mlp_only_layers")
        if any(not 0 <= i < layers for i in mlp_only):
            raise _err("mlp_only_layers", list(mlp_only), f"layer indices in [0, {layers})")
        eos = _int_list(d, "eos_token_id")
        quant = d.get("quantization_config")
        if quant is not None and not isinstance(quant, dict):
            raise _err("quantization_config", quant, "a dict")
        scoring = _str(d, "scoring_func", "softmax")
        scorings = fam.get("scoring_funcs", ("softmax", "sigmoid"))
        if scoring not in scorings:
            raise _err("scoring_func", scoring, " or ".join(repr(f) for f in scorings))
        n_group = _int(d, "n_group", 1) or 1  # null (DeepSeek-V2's greedy routing): one group
        topk_group = _int(d, "topk_group", 1) or 1
        if topk_group > n_group:
            raise _err("topk_group", topk_group, f"<= n_group={n_group}")

        if fam.get("v4_layers"):
            layer_ropes = _v4_ropes(d, max_pos, head_dim)
            rope = layer_ropes[0][1]
        elif fam.get("dots3_layers"):
            layer_ropes = _dots3_ropes(d, max_pos, layer_types)
            rope = layer_ropes[0][1]
        elif fam.get("rope_by_layer_type") or fam.get("step_layers"):
            layer_ropes = (_step_ropes(d, max_pos, layer_types) if fam.get("step_layers") else
                           _ropes_by_layer_type(d, max_pos, fam["rope_by_layer_type"], layer_types,
                                                fam.get("rope_partial_default"), bool(fam.get("nope_kinds"))))
            if not layer_ropes:
                raise _err("rope_parameters", d.get("rope_parameters"), "RoPE parameters for at least one layer type")
            rope = dict(layer_ropes).get("full_attention", layer_ropes[0][1])
            if fam.get("nope_kinds"):  # the layers of a kind without RoPE parameters are NoPE
                kinds = dict(layer_ropes)
                no_rope_layers = tuple(int(t in kinds) for t in layer_types)
        else:
            layer_ropes = ()
            partial = fam.get("partial_rotary_factor", 1.0)
            if fam.get("rotary_dim"):
                partial = _rotary_dim_factor(d, head_dim)
            elif fam.get("partial_is_rope_share"):
                partial = _int(d, "qk_rope_head_dim") / head_dim
            rope = parse_rope(d, max_pos, fam.get("rope_theta", 10000.0), fam.get("rope"), partial)

        layer_norm = bool(fam.get("layer_norm_unless_rms")) and d.get("rms_norm_eps") is None
        if layer_norm and d.get("layer_norm_eps") is None:
            raise ValueError("config field 'layer_norm_eps' is required (a number > 0) when 'rms_norm_eps' is null")
        cfg = cls(
            model_type=model_type, architectures=tuple(archs),
            vocab_size=_int(d, "vocab_size", required=True), hidden_size=hidden, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=max_pos,
            rms_norm_eps=(_float(d, "layer_norm_eps", positive=True) if layer_norm
                          else _float(d, "rms_norm_eps", 1e-6, positive=True)), layer_norm=layer_norm,
            rope=rope, rope_by_layer_type=layer_ropes,
            intermediate_size=_int(d, "intermediate_size"), hidden_act=_str(d, "hidden_act", "silu"),
            tie_word_embeddings=_bool(d, "tie_word_embeddings", False),
            attention_bias=_bool(d, "attention_bias", fam.get("attention_bias", False)),
            qkv_bias=_bool(d, "qkv_bias", False), clip_qkv=_float(d, "clip_qkv", positive=True),
            sliding_window=sliding, layer_types=layer_types,
            num_experts=experts, num_experts_per_tok=top_k,
            moe_intermediate_size=_int(d, "moe_intermediate_size"),
            shared_expert_intermediate_size=_int(d, "shared_expert_intermediate_size",
                                                 d.get("shared_intermediate_size"), minimum=0) or None,
            router_jitter_noise=_float(d, "router_jitter_noise", 0.0), lm_head_bias=_bool(d, "lm_head_bias", False),
            zero_experts=_int(d, "zero_expert_num", 0, minimum=0) or 0, router_bias=_bool(d, "router_bias", False),
            embedding_multiplier=_float(d, "embedding_multiplier", 1.0, positive=True),
            residual_multiplier=_float(d, "residual_multiplier", 1.0, positive=True),
            attention_multiplier=_float(d, "attention_multiplier", positive=True),
            logits_scaling=_float(d, "logits_scaling", 1.0, positive=True),
            norm_topk_prob=_bool(d, "norm_topk_prob", False), mlp_only_layers=mlp_only,
            decoder_sparse_step=_int(d, "decoder_sparse_step", 1),
            swiglu_limit=_float(d, "swiglu_limit", positive=True),
            swiglu_alpha=_float(d, "swiglu_alpha", 1.702, positive=True),
            first_k_dense_replace=_int(d, "first_k_dense_replace", 0, minimum=0),
            n_group=n_group, topk_group=topk_group,
            routed_scaling_factor=_float(d, "routed_scaling_factor", 1.0, positive=True),
            n_shared_experts=_int(d, "n_shared_experts", 0, minimum=0), scoring_func=scoring,
            topk_method=_str(d, "topk_method", None), use_qk_norm=_bool(d, "use_qk_norm", False),
            q_lora_rank=_int(d, "q_lora_rank"), kv_lora_rank=_int(d, "kv_lora_rank"),
            qk_nope_head_dim=_int(d, "qk_nope_head_dim"), qk_rope_head_dim=_int(d, "qk_rope_head_dim", minimum=0),
            v_head_dim=_int(d, "v_head_dim"), rope_interleave=_bool(d, "rope_interleave", fam.get("rope_interleave", False)),
            index_topk=_int(d, "index_topk"), index_head_dim=_int(d, "index_head_dim"),
            index_n_heads=_int(d, "index_n_heads"), indexer_types=indexer_types, mlp_layer_types=mlp_types,
            num_nextn_predict_layers=_int(d, "num_nextn_predict_layers", 0, minimum=0),
            **linear_sizes,
            attention_chunk_size=chunk, no_rope_layers=no_rope_layers,
            attn_temperature_tuning=_bool(d, "attn_temperature_tuning", False),
            floor_scale=_float(d, "floor_scale", positive=True), attn_scale=_float(d, "attn_scale"),
            intermediate_size_mlp=_int(d, "intermediate_size_mlp"),
            ssm=ssm, text_config_nested=text_nested,
            bos_token_id=_int(d, "bos_token_id", minimum=0), eos_token_id=eos,
            pad_token_id=_int(d, "pad_token_id", minimum=0), quantization_config=quant, raw=dict(d),
        )
        if fam.get("gemma4_layers"):
            bidir = d.get("use_bidirectional_attention")
            if bidir not in (None, "vision"):  # ('vision': image tokens see each other; text stays causal)
                raise _err("use_bidirectional_attention", bidir, "null or 'vision' (dynamoe runs causal language "
                           "models; 'all' makes every layer bidirectional)")
            if _bool(d, "enable_moe_block", False) and not (cfg.num_experts and cfg.num_experts_per_tok
                                                            and cfg.moe_intermediate_size):
                raise ValueError("config fields 'num_experts', 'top_k_experts' and 'moe_intermediate_size' are required "
                                 "when 'enable_moe_block' is true")
            gemma4_attention_layers(cfg)   # (its errors now, not when the model is built)
        if cfg.num_experts and cfg.moe_intermediate_size is None and cfg.intermediate_size is None:
            raise ValueError("config field 'moe_intermediate_size' (or 'intermediate_size') is required for an MoE model")
        return cfg

    @property
    def expert_hidden_size(self) -> int:
        """F of the routed experts: ``moe_intermediate_size`` (Qwen3, DeepSeek, GLM) or ``intermediate_size``
        (Mixtral, GPT-OSS, which have no dense layers)."""
        return self.moe_intermediate_size or self.intermediate_size


#: Inkling's and Inkling-2's language models: the sliding layers' own sizes, four conv windows per layer
INKLING_TYPES = ("inkling_text", "inkling2_text", "inkling2_loop_text")


def inkling_attention_sizes(cfg: "ModelConfig") -> tuple:
    """Inkling's (query heads, KV heads, head dim) per layer: the sliding layers' from ``swa_num_attention_heads`` /
    ``swa_num_key_value_heads`` / ``swa_head_dim``, the full ones' from the plain fields."""
    d = cfg.raw
    swa = (_int(d, "swa_num_attention_heads", required=True), _int(d, "swa_num_key_value_heads", required=True),
           _int(d, "swa_head_dim", required=True))
    if swa[0] % swa[1]:
        raise _err("swa_num_key_value_heads", swa[1], f"a divisor of swa_num_attention_heads={swa[0]}")
    full = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
    return tuple(swa if t == "sliding_attention" else full for t in cfg.layer_types)


@dataclass(frozen=True)
class Qwen4Fields:
    """Qwen4-Exp's own values (:func:`qwen4_fields`): hyper-connection streams and the mixers' rank; the QSA block size
    (its heads, head size and token budget are ``index_n_heads`` / ``index_head_dim`` / ``index_topk``); the per-layer
    n-gram embeddings (PLE: 0-based ``ple_layers``, empty for none; ``ple_eos``, the token their n-grams restart after,
    None without PLE) and the linear attention's output-gate activation.
    """

    hc_count: int
    hc_lowrank: int
    indexer_compress_ratio: int
    output_gate_type: str
    ple_layers: tuple
    ple_embed_dim: int
    ple_conv_kernel_size: int
    ngram_size: int
    heads_per_ngram: int
    ngram_vocab_size_base: int
    make_ngram_vocab_size_divisible_by: int
    seed: int
    split_ngram_parts: int
    ple_eos: int | None


def qwen4_fields(cfg: "ModelConfig") -> Qwen4Fields:
    """Qwen4-Exp's fields as Qwen4ExpTextConfig reads and checks them (defaults: 4 streams, rank 320, no PLE, PLE
    embedding width = hidden size, conv kernel 4, trigrams, 8 heads per n-gram, 20M n-gram vocabulary base padded to
    multiples of 128, seed 1234, 512 checkpoint shards per table). The QSA fields are required together (transformers'
    attention layers cannot be built without them)."""
    d, layers = cfg.raw, cfg.num_hidden_layers
    hc_count = _int(d, "hc_count", 4, minimum=2)
    qsa = {"indexer_n_heads": cfg.index_n_heads, "indexer_head_dim": cfg.index_head_dim, "indexer_budget": cfg.index_topk,
           "indexer_compress_ratio": _int(d, "indexer_compress_ratio"), "indexer_kv_heads": _int(d, "indexer_kv_heads")}
    missing = [k for k, v in qsa.items() if v is None]
    if missing and "indexed_attention" in cfg.layer_types:
        raise ValueError(f"config fields {missing} are required: the 'indexed_attention' layers of {cfg.model_type!r} "
                         "select their keys with the QSA indexer, which needs all of indexer_n_heads, indexer_kv_heads, "
                         "indexer_head_dim, indexer_budget and indexer_compress_ratio")
    ratio = qsa["indexer_compress_ratio"] or 1
    if qsa["indexer_kv_heads"] not in (None, 1):
        raise _err("indexer_kv_heads", qsa["indexer_kv_heads"], "1 (Qwen4-Exp's QSA has one key head)")
    if qsa["indexer_budget"] is not None and qsa["indexer_budget"] % ratio:
        raise _err("indexer_budget", qsa["indexer_budget"], f"a multiple of indexer_compress_ratio={ratio}")
    rotary = int(cfg.head_dim * cfg.rope.partial_rotary_factor)
    if qsa["indexer_head_dim"] is not None and rotary > qsa["indexer_head_dim"]:
        raise _err("indexer_head_dim", qsa["indexer_head_dim"], f"an int >= the attention's rotary dims ({rotary}: "
                   "the indexer's queries and keys take the same RoPE)")
    gate = _str(d, "output_gate_type", None) or cfg.hidden_act
    if gate not in ("silu", "sigmoid"):
        raise _err("output_gate_type", gate, "'silu' or 'sigmoid' (default: hidden_act)")
    ids = d.get("ple_layer_ids")
    if ids is None:
        ids = []
    if (not isinstance(ids, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) for i in ids)
            or any(not 1 <= i <= layers for i in ids)):
        raise _err("ple_layer_ids", ids, f"a list of one-based layer ids in [1, {layers}]")
    ple = tuple(sorted({i - 1 for i in ids}))
    bad = [i + 1 for i in ple if cfg.layer_types[i] != "linear_attention"]
    if bad:
        raise _err("ple_layer_ids", ids, f"ids of 'linear_attention' layers only (layers {bad} are not)")
    ngram, heads = _int(d, "ngram_size", 3, minimum=2), _int(d, "heads_per_ngram", 8)
    width = _int(d, "ple_embed_dim", cfg.hidden_size)
    # (the text config's own eos when a wrapper nests it: transformers' text model reads its config's, whatever the
    # wrapper's says)
    eos = _int_list(d, "text_eos_token_id") if "text_eos_token_id" in d else cfg.eos_token_id
    if ple:
        if width % ((ngram - 1) * heads):
            raise _err("ple_embed_dim", width, f"a multiple of (ngram_size - 1) * heads_per_ngram = {(ngram - 1) * heads}")
        if not eos:
            raise ValueError("config field 'eos_token_id' is required when ple_layer_ids is set (the n-gram "
                             "embeddings restart after it)")
    return Qwen4Fields(hc_count, _int(d, "hc_lowrank", 320), ratio, gate, ple, width,
                       _int(d, "ple_conv_kernel_size", 4), ngram, heads, _int(d, "ngram_vocab_size_base", 20_000_000),
                       _int(d, "make_ngram_vocab_size_divisible_by", 128), _int(d, "seed", 1234, minimum=0),
                       _int(d, "split_ngram_parts", 512), eos[0] if ple else None)


@dataclass(frozen=True)
class LoopLayers:
    """Inkling-2-Loop's loop: layers ``start``..``end`` - 1 run ``passes`` times; ``gate_rank`` the message gates'."""

    start: int
    end: int
    passes: int
    gate_rank: int

    @property
    def extra_layers(self) -> int:
        """Layer runs beyond the model's layers (each with its own cache layer): the loop's, once per extra pass."""
        return (self.passes - 1) * (self.end - self.start)


def inkling2_loop_layers(cfg: "ModelConfig") -> LoopLayers:
    """Inkling-2-Loop's loop (Inkling2LoopTextConfig's rules): ``loop_layer_index_start`` / ``_end`` /
    ``loop_num_passes`` / ``loop_gate_rank``, the hub's ``loop_config`` (``core_start``, ``core_end``, ``num_passes``,
    ``gate_rank``) winning where given; start > 0 and both ends multiples of ``n_layers_per_attn_res_block``."""
    d = dict(cfg.raw)
    loop = d.get("loop_config")
    if loop is not None:
        if not isinstance(loop, dict):
            raise _err("loop_config", loop, "a dict (core_start, core_end, num_passes, gate_rank)")
        for ours, theirs in (("loop_layer_index_start", "core_start"), ("loop_layer_index_end", "core_end"),
                             ("loop_num_passes", "num_passes"), ("loop_gate_rank", "gate_rank")):
            if loop.get(theirs) is not None:
                d[ours] = loop[theirs]
    block = _int(d, "n_layers_per_attn_res_block", 6)
    start, end = _int(d, "loop_layer_index_start", 6), _int(d, "loop_layer_index_end", 18, minimum=0)
    passes, rank = _int(d, "loop_num_passes", 3), _int(d, "loop_gate_rank", 64)
    n = cfg.num_hidden_layers
    if start % block:
        raise _err("loop_layer_index_start", start, f"a multiple of n_layers_per_attn_res_block={block}, > 0")
    if end % block or not start <= end <= n:
        raise _err("loop_layer_index_end", end, f"a multiple of n_layers_per_attn_res_block={block} in "
                   f"[loop_layer_index_start={start}, num_hidden_layers={n}]")
    return LoopLayers(start, end, passes, rank)


def inkling_cache_sizes(cfg: "ModelConfig") -> tuple:
    """:func:`inkling_attention_sizes` of every cache layer: the model's layers, then (Inkling-2-Loop) the loop
    layers' once for each pass after the first."""
    sizes = inkling_attention_sizes(cfg)
    if cfg.family_type != "inkling2_loop_text":
        return sizes
    loop = inkling2_loop_layers(cfg)
    return sizes + sizes[loop.start:loop.end] * (loop.passes - 1)


@dataclass(frozen=True)
class Gemma4Layer:
    """One Gemma 4 attention layer's sizes: ``head_dim`` and ``num_key_value_heads`` (the full layers' differ:
    per_layer_config), and ``kv_source``, the layer whose keys and values it attends over -- itself, or for the last
    ``num_kv_shared_layers`` layers the last earlier layer of its kind that computes its own."""

    head_dim: int
    num_key_value_heads: int
    kv_source: int


_GEMMA4_LAYER_FIELDS = ("head_dim", "num_key_value_heads")


def gemma4_attention_layers(cfg: "ModelConfig") -> tuple:
    """Gemma 4's per-layer attention sizes (:class:`Gemma4Layer` per layer) as Gemma4TextConfig derives them:
    ``per_layer_config`` (layer index -> overrides of head_dim / num_key_value_heads) when the file has one, else
    the full layers get ``global_head_dim`` (512) and, with ``attention_k_eq_v``, ``num_global_key_value_heads`` KV
    heads; layers of one kind must agree (their RoPE is one table). KV sharing: the last ``num_kv_shared_layers``
    reuse the keys and values of the last earlier layer of their kind."""
    d, n, types = cfg.raw, cfg.num_hidden_layers, cfg.layer_types
    over: dict = {}
    per_layer = d.get("per_layer_config")
    if per_layer is None:
        glob = {"head_dim": _int(d, "global_head_dim", 512)}
        if _bool(d, "attention_k_eq_v", False) and d.get("num_global_key_value_heads") is not None:
            glob["num_key_value_heads"] = _int(d, "num_global_key_value_heads")
        over = {i: glob for i, t in enumerate(types) if t == "full_attention"}
    else:
        if not isinstance(per_layer, dict):
            raise _err("per_layer_config", per_layer, "a dict of layer index -> overrides")
        for key, fields in per_layer.items():
            try:
                i = int(key)
            except (TypeError, ValueError):
                i = -1
            if not 0 <= i < n or not isinstance(fields, dict):
                raise _err("per_layer_config", per_layer, f"a dict of layer indices in [0, {n}) -> dicts of overrides")
            bad = sorted(set(fields) - set(_GEMMA4_LAYER_FIELDS))
            if bad:
                raise _err(f"per_layer_config.{key}", fields, f"overrides of {list(_GEMMA4_LAYER_FIELDS)} only (dynamoe "
                           f"does not build other per-layer differences; got {bad})")
            over[i] = {f: _int(fields, f, required=True) for f in fields}
    shared = _int(d, "num_kv_shared_layers", 0, minimum=0) or 0
    if shared >= n:
        raise _err("num_kv_shared_layers", shared, f"an int < num_hidden_layers={n} (some layer must compute the keys "
                   "and values the others share)")
    first = n - shared
    out, by_kind = [], {}
    for i, t in enumerate(types):
        o = over.get(i, {})
        hd, kv = o.get("head_dim", cfg.head_dim), o.get("num_key_value_heads", cfg.num_key_value_heads)
        if cfg.num_attention_heads % kv:
            raise _err(f"num_key_value_heads of layer {i}", kv, f"a divisor of num_attention_heads={cfg.num_attention_heads}")
        if by_kind.setdefault(t, (hd, kv)) != (hd, kv):
            raise _err("per_layer_config", per_layer, f"one head_dim / num_key_value_heads for all {t!r} layers "
                       f"(layer {i} has {(hd, kv)}, an earlier one {by_kind[t]})")
        src = i
        if i >= first:
            earlier = [j for j in range(first) if types[j] == t]
            if not earlier:
                raise _err("num_kv_shared_layers", shared, f"a count that leaves a {t!r} layer before the shared ones "
                           f"(layer {i} would share one)")
            src = earlier[-1]
        out.append(Gemma4Layer(hd, kv, src))
    return tuple(out)


def unwrap_text_config(d: dict) -> dict:
    """A multimodal wrapper's config.json (outer ``model_type`` in :data:`TEXT_WRAPPERS`, e.g. Kimi-K2.5's
    ``kimi_k25`` around a DeepSeek-V3 text model) as one flat dict of its text model, the one path every
    wrapper takes: the text config's fields; ``architectures`` and token ids from the outermost level that
    gives them; ``tie_word_embeddings`` from the level right above the text config (else the wrapper's
    default; or the text config's own flag alone where the wrapper says ``tie_by_text``: :class:`TextWrapper`); ``quantization_config`` from whichever level has it (ValueError if two
    differ); ``model_type`` the outer one and ``text_model_type`` the inner one (whose family defaults
    apply); ``text_eos_token_id`` the text config's own eos (what a text model's layers read, Qwen4-Exp's n-gram
    embeddings); ``vision_config`` kept for reference. Any other dict comes back as it is."""
    outer_type = d.get("model_type")
    spec = TEXT_WRAPPERS.get(outer_type)
    if spec is None:
        return d
    if spec.legacy_key and d.get(spec.path[0]) is None:
        legacy = d.get(spec.legacy_key)
        legacy = {} if legacy is None else legacy
        if not isinstance(legacy, dict):
            raise _err(spec.legacy_key, legacy, f"a dict (the text model's config, which a {outer_type!r} config nests)")
        moved = {k: d[k] for k in spec.legacy_fields if k in d}
        d = {k: v for k, v in d.items() if k not in spec.legacy_fields and k != spec.legacy_key}
        d[spec.path[0]] = {**legacy, **moved, "model_type": spec.text_types[0]}
    levels, where = [d], []
    for key in spec.path:
        where.append(key)
        sub = levels[-1].get(key)
        if not isinstance(sub, dict):
            raise _err(".".join(where), sub, f"a dict (the text model's config, which a {outer_type!r} config nests)")
        levels.append(sub)
    text, parent, name = levels[-1], levels[-2], ".".join(where)
    inner_type = text.get("model_type", spec.text_types[0])
    if inner_type not in spec.text_types:
        raise _err(f"{name}.model_type", inner_type, f"one of {list(spec.text_types)} (a {outer_type!r} "
                   f"checkpoint's text model)")
    flat = dict(text)
    flat["text_eos_token_id"] = text.get("eos_token_id")
    for key in _WRAPPER_FIELDS:
        given = [level[key] for level in levels[:-1] if level.get(key) is not None]
        if given:
            flat[key] = given[0]
    tie = parent.get("tie_word_embeddings")
    tie = spec.tie_default if tie is None else tie
    flat["tie_word_embeddings"] = tie or (spec.tie_from_text and text.get("tie_word_embeddings") is True)
    if spec.tie_by_text:
        flat["tie_word_embeddings"] = text.get("tie_word_embeddings") is True
    quant = {}
    for level, at in zip(levels, ["", *(".".join(where[:i + 1]) + "." for i in range(len(where)))]):
        if level.get("quantization_config") is not None:
            quant[at + "quantization_config"] = level["quantization_config"]
    found = list(quant.values())
    if any(q != found[0] for q in found[1:]):
        raise ValueError(f"config fields {sorted(quant)} are all given and differ: which one describes the tensors "
                         "is ambiguous")
    if quant:
        flat["quantization_config"] = next(iter(quant.values()))
    flat["model_type"], flat["text_model_type"] = outer_type, inner_type
    if "vision_config" in d:
        flat["vision_config"] = d["vision_config"]
    return flat
