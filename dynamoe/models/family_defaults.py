"""What transformers' configuration classes fill in when a ``config.json`` leaves a field out, per ``model_type``
(:data:`FAMILY_DEFAULTS`): read by :meth:`dynamoe.models.config.ModelConfig.from_dict` before it parses a field, so
a file that omits them parses as transformers reads it (tests/test_models_config_defaults.py compares every field).
Data only: one entry a family, the keys explained at the top.
"""
from __future__ import annotations

from typing import Any

__all__ = ["FAMILY_DEFAULTS"]

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
# Inkling2TextConfig's and Inkling2LoopTextConfig's common rules and fields (each adds its sizes)
_INKLING2 = {"num_experts_per_tok": 8, "head_dim": 128, "full_attention_every": 6,
             "layer_type_names": {"hybrid": "full_attention", "hybrid_sliding": "sliding_attention"},
             "ignored": ("tie_word_embeddings", "num_experts", "mlp_layer_types", "mlp_only_layers",
                         "first_k_dense_replace", "decoder_sparse_step", "n_shared_experts"),
             "aliases": {"sliding_window": "sliding_window_size", "routed_scaling_factor": "route_scale"},
             "overrides": {"conv_kernel_size": "sconv_kernel_size", "max_position_embeddings": "model_max_length",
                           "moe_intermediate_size": "intermediate_size", "route_scale": "routed_scaling_factor"}}
_INKLING2_FIELDS = {"vocab_size": 201024, "unpadded_vocab_size": 200058, "num_key_value_heads": 8, "head_dim": 128,
                    "swa_num_key_value_heads": 8, "swa_head_dim": 128, "sliding_window_size": 1024, "d_rel": 16,
                    "rel_extent": 1024, "log_scaling_alpha": 0.1, "max_position_embeddings": 1048576,
                    "rms_norm_eps": 1e-6, "conv_kernel_size": 4, "hidden_act": "silu", "num_experts_per_tok": 8,
                    "route_scale": 8.0, "bos_token_id": None, "eos_token_id": 200006, "pad_token_id": None,
                    "qk_l2_clip_threshold": 22.627416997969522, "rel_l2_clip_threshold": 8.0,
                    "n_layers_per_attn_res_block": 6, "mlp_gate_softcap": 4.0, "mlp_up_softcap": 25.0,
                    "final_logit_softcapping": 30.0, "scoring_func": "sigmoid", "tie_word_embeddings": False}
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
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
    "inkling2_text": {**_INKLING2, "num_experts": 384,
                      "fields": {**_INKLING2_FIELDS, "hidden_size": 4608, "num_hidden_layers": 48,
                                 "num_attention_heads": 48, "swa_num_attention_heads": 48, "log_scaling_n_floor": 128000,
                                 "moe_intermediate_size": 2304, "n_routed_experts": 384}},
    # Inkling2LoopTextConfig (Inkling-2-Loop): Inkling-2's fields and rules with its own sizes, and the loop
    # (layers loop_layer_index_start..end - 1 run loop_num_passes times; the hub's loop_config names win, see
    # inkling2_loop_layers)
    "inkling2_loop_text": {**_INKLING2, "num_experts": 128,
                           "fields": {**_INKLING2_FIELDS, "hidden_size": 2304, "num_hidden_layers": 24,
                                      "num_attention_heads": 24, "swa_num_attention_heads": 24,
                                      "log_scaling_n_floor": 8192, "moe_intermediate_size": 1152, "n_routed_experts": 128,
                                      "loop_layer_index_start": 6, "loop_layer_index_end": 18, "loop_num_passes": 3,
                                      "loop_gate_rank": 64}},
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
