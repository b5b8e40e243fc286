"""A config.json that leaves a field out parses as transformers reads it: for every family, a config with
only the sizes dynamoe requires gives, field by field, the values transformers' configuration class
(and its modeling code's derivations: head size, MoE layers, sliding layers) gives; and tiny random
checkpoints whose config.json lost a defaulted field (rms_norm_eps, expert counts, swiglu_limit,
num_key_value_heads) still load to transformers' logits."""
import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_logits, randomize_, save_tiny
from models_mla_util import MLA, edit_config, ids, make_pair

transformers = pytest.importorskip("transformers")

import dynamoe.models as dm  # noqa: E402
from dynamoe.models import ModelConfig  # noqa: E402
from dynamoe.models.config import RopeConfig  # noqa: E402

# ------------------------------------------------------------------------------ field by field
SIZES = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=8)
# model_type: (transformers' config class, the sizes the family needs beyond SIZES). Kimi-K2 has no
# config class of its own in transformers: it is DeepSeek-V3.
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(moe_intermediate_size=32)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(moe_intermediate_size=32, num_attention_heads=16)),  # 16 KV heads by default
    "mixtral": ("MixtralConfig", dict(intermediate_size=32)),
    "olmoe": ("OlmoeConfig", dict(intermediate_size=32)),
    "flex_olmo": ("FlexOlmoConfig", dict(intermediate_size=32)),
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", dict(intermediate_size=32)),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", dict(intermediate_size=96, moe_intermediate_size=32)),
    # DbrxConfig takes the standard names through its attribute_map; experts and top-k sit in ffn_config
    "dbrx": ("DbrxConfig", {}),
    "exaone_moe": ("ExaoneMoeConfig", dict(intermediate_size=96, moe_intermediate_size=32, num_attention_heads=32)),
    "granitemoe": ("GraniteMoeConfig", dict(intermediate_size=32)),
    "granitemoeshared": ("GraniteMoeSharedConfig", dict(intermediate_size=32)),
    "minimax_m2": ("MiniMaxM2Config", dict(intermediate_size=32)),
    "gpt_oss": ("GptOssConfig", dict(intermediate_size=32)),
    "deepseek_v3": ("DeepseekV3Config", dict(intermediate_size=96, moe_intermediate_size=32)),
    # DeepseekV2Config has no top-k default (its model cannot run without one)
    "deepseek_v2": ("DeepseekV2Config", dict(intermediate_size=96, moe_intermediate_size=32, num_experts_per_tok=2)),
    "kimi_k2": ("DeepseekV3Config", dict(intermediate_size=96, moe_intermediate_size=32)),
    "glm4_moe": ("Glm4MoeConfig", dict(intermediate_size=96, moe_intermediate_size=32)),
    "glm4_moe_lite": ("Glm4MoeLiteConfig", dict(intermediate_size=96, moe_intermediate_size=32)),
    # Dots1Config has no expert count, top-k or shared-expert default (null), and 32 KV heads
    "dots1": ("Dots1Config", dict(intermediate_size=96, moe_intermediate_size=32, num_attention_heads=32,
                                  n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1)),
    "deepseek_v32": ("DeepseekV32Config", dict(intermediate_size=96, moe_intermediate_size=32)),
    "glm_moe_dsa": ("GlmMoeDsaConfig", dict(intermediate_size=96, moe_intermediate_size=32)),
    # hybrid linear/full attention; Qwen3.5-MoE's multimodal config nests the text model under text_config
    "qwen3_next": ("Qwen3NextConfig", {}),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", {}),
    "qwen3_5_moe": ("Qwen3_5MoeConfig", {}),
    # the text models of vision-language / omni wrappers (the wrapper configs nest them, see WRAPPED)
    "qwen3_vl_moe": ("Qwen3VLMoeConfig", dict(moe_intermediate_size=32, num_attention_heads=16)),
    "qwen3_vl_moe_text": ("Qwen3VLMoeTextConfig", dict(moe_intermediate_size=32, num_attention_heads=16)),
    "glm4v_moe": ("Glm4vMoeConfig", dict(intermediate_size=96, moe_intermediate_size=32)),
    "glm4v_moe_text": ("Glm4vMoeTextConfig", dict(intermediate_size=96, moe_intermediate_size=32)),
    "qwen3_omni_moe_thinker": ("Qwen3OmniMoeThinkerConfig", dict(moe_intermediate_size=32)),
    "qwen3_omni_moe": ("Qwen3OmniMoeConfig", dict(moe_intermediate_size=32)),
    # Kimi-Linear (KDA + NoPE MLA), MiMo-V2-Flash (a RoPE per layer type), Mistral-4 (MLA)
    "kimi_linear": ("KimiLinearConfig", dict(intermediate_size=96, moe_intermediate_size=32)),
    "mimo_v2_flash": ("MiMoV2FlashConfig", dict(intermediate_size=96, moe_intermediate_size=32)),
    "mistral4": ("Mistral4Config", dict(intermediate_size=96, moe_intermediate_size=32)),
    "flint": ("FlintConfig", {}),
    "granitemoe_swa": ("GraniteMoeSWAConfig", dict(intermediate_size=32)),
    # Llama-4's text model, and the vision wrapper around it
    "llama4_text": ("Llama4TextConfig", {}),
    "llama4": ("Llama4Config", {}),
    "phimoe": ("PhimoeConfig", dict(intermediate_size=32)),
    # LongCat-Flash: its own names; transformers' num_hidden_layers is twice its num_layers (two sublayers each)
    "longcat_flash": ("LongcatFlashConfig", {}),
    # Step-3.5 (Step-3.7's text model): its own names; per-layer head counts, clamps and a RoPE per layer type
    "step3p5": ("Step3p7TextConfig", {}),
    "step3p7": ("Step3p7Config", {}),
    # Arcee AFMoE: its own names for the dense layers, shared experts and route scale
    "afmoe": ("AfmoeConfig", {}),
    # Cohere2-MoE: LayerNorms unless rms_norm_eps, its own layer patterns, shared-expert combination, logit scale
    "cohere2_moe": ("Cohere2MoeConfig", {}),
    # Solar-Open: GLM-4.5's routing on every layer, no dense layers or q/k norms
    "solar_open": ("SolarOpenConfig", {}),
    # Hy3: its own names for the shared experts and route scale, a dense first layer, mlp_bias
    "hy_v3": ("HYV3Config", {}),
    # JetMoE: query heads = KV heads x top-k (the file's num_attention_heads is not read), kv_channels, its activation
    "jetmoe": ("JetMoeConfig", {}),
    # Sarvam-30B (run as GLM-4.5): its own names for expert counts, shared experts, MTP layers and q/k/v bias
    "sarvam_moe": ("SarvamMoEConfig", {}),
    # Laguna: full layers unless layer_types, a RoPE per layer type, heads per layer, softplus gates, its routing
    "laguna": ("LagunaConfig", {}),
    # Mellum 2: Qwen3-MoE's with full layers unless layer_types, a RoPE per layer type, dense layers by mlp_layer_types
    "mellum": ("MellumConfig", dict(moe_intermediate_size=32)),
    # Kolibri-1: every 5th layer full (NoPE), the others sliding; every layer MoE with a shared expert
    "kolibri1": ("Kolibri1Config", {}),
    # Beam: every 6th and the last layer full (NoPE), 3 dense layers, DeepSeek routing without shared experts
    "beam": ("BeamConfig", {}),
    # ZAYA1: its own layer kind names ('hybrid', 'hybrid_sliding'), a RoPE per kind, the router's and CCA's sizes
    "zaya": ("ZayaConfig", {}),
    # Doge: dense unless is_moe, dynamic-mask attention's keep_window_size, a window on every layer when set
    "doge": ("DogeConfig", {}),
    # Aria's text model, alone and in its vision-language wrapper: its own names for the experts and top-k
    "aria_text": ("AriaTextConfig", {}),
    "aria": ("AriaConfig", {}),
    # Mamba hybrids: Jamba (Mamba-1; attention and MoE layers by period and offset)
    "jamba": ("JambaConfig", {}),
    # GraniteMoE-Hybrid (Mamba-2, GraniteMoE-Shared's MoE; mamba_d_head 'auto' needs heads dividing 2 x hidden)
    "granitemoehybrid": ("GraniteMoeHybridConfig", dict(mamba_n_heads=8)),
    # Nemotron-H: blocks by kind (its default: M, E, *, -), DeepSeek-V3 routing
    "nemotron_h": ("NemotronHConfig", {}),
    # ... and in its multimodal wrappers: Nemotron-3-Nano-Omni, Nemotron-3.5-Transcribe (a text_config given as a dict
    # takes NemotronHConfig's defaults, not the transcription config's released sizes: those fill in a missing one)
    "nemotron_h_omni": ("NemotronH_Omni_Reasoning_V3_Config", {}),
    "nemo_speechlm": ("Nemotron3_5TranscribeConfig", {}),
    # LFM2-MoE: short convolutions and attention (its config class derives no layer_types: the model needs them)
    "lfm2_moe": ("Lfm2MoeConfig", dict(layer_types=["conv", "conv", "full_attention", "conv"])),
    # MiniMax-Text-01: lightning and softmax attention alternating, Mixtral's MoE, residual factors
    "minimax": ("MiniMaxConfig", dict(intermediate_size=32)),
    # Ling-3: KDA + gated MLA, DeepSeek-V3 routing under Kimi-Linear's names
    "bailing_hybrid": ("BailingHybridConfig", {}),
    # MiniMax-M3's language model: full and block-sparse (indexed) attention, dense / MoE SwiGLU-OAI MLPs
    "minimax_m3_vl_text": ("MiniMaxM3VLTextConfig", {}),
    "minimax_m3_vl": ("MiniMaxM3VLConfig", {}),
    # DeepSeek-V4: compressed attention kinds, hyper-connections, hash routing, a "main" and a "compress" RoPE
    "deepseek_v4": ("DeepseekV4Config", {}),
    # GLM-5.3: KDA + NoPE MLA with the pooled indexer, hyper-connections (its config class wants as many KV heads
    # as query heads); the vision-language wrapper nests it
    "glm5_next_text": ("Glm5NextTextConfig", dict(num_key_value_heads=8)),
    "glm5_next": ("Glm5NextConfig", dict(num_key_value_heads=8)),
    # Mistral-Large-4: MLA without query LoRA, LeRoPE / NoPE layers, KV sharing; the vision wrapper nests it
    "mistral_large4_text": ("MistralLarge4TextConfig", {}),
    "mistral_large4": ("MistralLarge4Config", {}),
    # Hy4 and Hy4-VL's text model: DSA MLA with sinks and an output gate, independent hyper-connections
    "hy_v4": ("HYV4Config", {}),
    "hy_v4_vl_text": ("HYV4VLTextConfig", {}),
    "hy_v4_vl": ("HYV4VLConfig", {}),
    # Sarvam-105B: DeepSeek-V3 (transformers builds DeepseekV3ForCausalLM) with its own defaults and hub names
    "sarvam_mla": ("SarvamMLAConfig", dict(intermediate_size=96, moe_intermediate_size=32)),
    # A.X-K1: DeepSeek-V3 with a post-MoE norm; MLP kinds from the hub's first_k_dense_replace / moe_layer_freq
    "axk1": ("AXK1Config", dict(intermediate_size=96, moe_intermediate_size=32)),
    # A.X-K2: sparse MLA with gated queries, self-gated norms; no groups by default
    "axk2": ("AXK2Config", dict(intermediate_size=96, moe_intermediate_size=32)),
    # dots3_note: MLA with DSA and sliding layers of their own sizes and RoPE; the vision / audio wrapper nests it
    "dots3_note_text": ("Dots3NoteTextConfig", dict(num_key_value_heads=8)),
    # (its towers' adapters default to the released text width: the config class checks they match)
    "dots3_note": ("Dots3NoteConfig", dict(num_key_value_heads=8, hidden_size=5120)),
    # Gemma 4's language model (dense unless enable_moe_block), alone and in its multimodal wrapper: sliding / full
    # layers with a RoPE per kind ('proportional' on the full ones) and their own head sizes, per-layer inputs
    "gemma4_text": ("Gemma4TextConfig", {}),
    "gemma4": ("Gemma4Config", {}),
    # Lara-4-Mini: Gated DeltaNet, sliding RoPE and full NoPE layers (its released pattern), MoE with a shared expert
    "lara_mini": ("LaraMiniConfig", {}),
    # Inkling's language model: no RoPE (a relative bias), sliding layers of their own sizes, short convolutions
    "inkling_text": ("InklingTextConfig", {}),
    "inkling_mm_model": ("InklingConfig", {}),
    # Inkling-2's language model: block attention residuals, sliding / full layers of their own sizes, dynamic
    # convolutions, softcapped experts; its multimodal config checks the vision tower's text width (4608 by default)
    "inkling2_text": ("Inkling2TextConfig", {}),
    "inkling2": ("Inkling2Config", dict(hidden_size=4608)),
    # Inkling-2-Loop: Inkling-2's decoder with looped middle layers (the vision tower's text width 2304 by default)
    "inkling2_loop_text": ("Inkling2LoopTextConfig", dict(num_hidden_layers=24)),
    "inkling2_loop": ("Inkling2LoopConfig", dict(num_hidden_layers=24, hidden_size=2304)),
    # ERNIE-4.5-VL's multimodal config: its text model's [text, vision] expert widths, a dense first layer
    "ernie4_5_vl_moe": ("Ernie4_5_VLMoeConfig", {}),
    # DeepSeek-OCR-2's multimodal config: DeepSeek-V2's routing under Llama attention; its text config has no top-k
    # or MLP-kind defaults (its model cannot run without them)
    "deepseek_ocr2": ("DeepseekOcr2Config", dict(num_experts_per_tok=2, mlp_layer_types=["dense"] + ["sparse"] * 3,
                                                 moe_intermediate_size=32)),
    # Unlimited-OCR's multimodal config (10 KV heads by default): DeepSeek-OCR-2's decoder with top-k and MLP-kind
    # defaults, reference sliding attention on every layer
    "unlimited_ocr": ("UnlimitedOcrConfig", dict(moe_intermediate_size=32, hidden_size=80, num_attention_heads=10)),
    # Muse Spark's multimodal config (16 KV heads by default; its audio adapter checks the text width): sliding / full
    # NoPE layers, the pooled MoE
    "muse_spark": ("MuseSparkConfig", dict(num_key_value_heads=8, hidden_size=8192)),
    # Qwen4-Exp's language model, alone and in its vision-language wrapper: Qwen3.5's hybrid with QSA-indexed attention
    # (whose five fields have no defaults: its attention layers cannot be built without them), hyper-connection
    # streams, per-layer n-gram embeddings
    "qwen4_exp_text": ("Qwen4ExpTextConfig", dict(indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=256,
                                                  indexer_budget=64, indexer_compress_ratio=16)),
    "qwen4_exp": ("Qwen4ExpConfig", dict(indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=256, indexer_budget=64,
                                         indexer_compress_ratio=16)),
}
# wrapper model_type -> the sub-config keys down to its text model's config
WRAPPED = {"qwen3_5_moe": ("text_config",), "qwen3_vl_moe": ("text_config",), "glm4v_moe": ("text_config",),
           "qwen3_omni_moe_thinker": ("text_config",), "qwen3_omni_moe": ("thinker_config", "text_config"),
           "llama4": ("text_config",), "step3p7": ("text_config",), "aria": ("text_config",),
           "minimax_m3_vl": ("text_config",), "glm5_next": ("text_config",), "mistral_large4": ("text_config",),
           "hy_v4_vl": ("text_config",), "dots3_note": ("text_config",), "gemma4": ("text_config",),
           "inkling_mm_model": ("text_config",), "inkling2": ("text_config",), "inkling2_loop": ("text_config",),
           "ernie4_5_vl_moe": ("text_config",),
           "deepseek_ocr2": ("text_config",), "muse_spark": ("text_config",), "qwen4_exp": ("text_config",),
           "unlimited_ocr": ("text_config",), "nemotron_h_omni": ("text_config",), "nemo_speechlm": ("text_config",)}
INKLING = {"inkling_text", "inkling_mm_model"}
INKLING2 = {"inkling2_text", "inkling2", "inkling2_loop_text", "inkling2_loop"}
INKLING2_LOOP = {"inkling2_loop_text", "inkling2_loop"}
GEMMA4 = {"gemma4_text", "gemma4"}
ARIA = {"aria", "aria_text"}
STEP = {"step3p5", "step3p7"}
GLM5 = {"glm5_next_text", "glm5_next"}
ML4 = {"mistral_large4_text", "mistral_large4"}
HY4 = {"hy_v4", "hy_v4_vl_text", "hy_v4_vl"}
DOTS3 = {"dots3_note_text", "dots3_note"}
LLAMA4 = {"llama4_text", "llama4"}
QWEN3_RULE = {"qwen3_moe", "qwen2_moe", "qwen3_next", "qwen3_vl_moe", "qwen3_vl_moe_text", "qwen3_omni_moe_thinker",
              "qwen3_omni_moe", "flint"}
QWEN4 = {"qwen4_exp_text", "qwen4_exp"}
HYBRID = {"qwen3_next", "qwen3_5_moe_text", "qwen3_5_moe", "lara_mini"} | QWEN4
NEMOTRON = {"nemotron_h", "nemotron_h_omni", "nemo_speechlm"}
MAMBA = {"jamba", "granitemoehybrid", "lfm2_moe", "minimax", "bailing_hybrid", "minimax_m3_vl_text", "minimax_m3_vl"} | NEMOTRON
DEEPSEEK_LIKE = {"deepseek_v2", "deepseek_v3", "kimi_k2", "glm4_moe", "glm4_moe_lite", "deepseek_v32", "glm_moe_dsa",
                 "dots1", "glm4v_moe", "glm4v_moe_text", "sarvam_mla"}
MLA_FAMILIES = ((DEEPSEEK_LIKE - {"glm4_moe", "dots1", "glm4v_moe", "glm4v_moe_text"})
                | {"kimi_linear", "bailing_hybrid", "mistral4", "longcat_flash", "axk1", "axk2"} | GLM5 | HY4 | DOTS3)
# DeepSeek-V3's routing fields under these families' own config classes
DEEPSEEK_ROUTING = (DEEPSEEK_LIKE | {"kimi_linear", "bailing_hybrid", "mimo_v2_flash", "mistral4", "solar_open",
                                     "sarvam_moe", "beam", "axk1", "axk2"} | GLM5 | HY4 | DOTS3)
# no single rope_parameters dict: Kimi-Linear and Jamba have no RoPE, MiMo-V2-Flash one per layer type
NO_SINGLE_ROPE = ({"kimi_linear", "mimo_v2_flash", "laguna", "mellum", "beam", "zaya", "jamba",
                   "deepseek_v4"} | INKLING | INKLING2 | STEP | GLM5 | DOTS3 | GEMMA4 | NEMOTRON)
ROPE_PER_LAYER_TYPE = {"mimo_v2_flash", "laguna", "mellum", "beam", "zaya", "deepseek_v4"} | STEP | DOTS3 | GEMMA4
# ZAYA's layer kind names -> dynamoe's
ZAYA_KINDS = {"hybrid": "full_attention", "hybrid_sliding": "sliding_attention"}
GQA_FAMILIES = set(FAMILIES) - MLA_FAMILIES - ML4  # (Mistral-Large-4's MLA: num_key_value_heads is unused)


def _step(cfg):
    from dynamoe.models.step3p5 import step_fields

    return step_fields(cfg)


def _dots3_fields():
    from dynamoe.models.config import DOTS3_LAYER_FIELDS

    return DOTS3_LAYER_FIELDS


def _dots3_sizes(cfg):
    from dynamoe.models.config import dots3_layer_sizes

    return dots3_layer_sizes(cfg.raw, cfg.layer_types)


def _hy4(cfg):
    from dynamoe.models.hy_v4 import hy_fields

    return hy_fields(cfg)


def _ml4_sources(cfg):
    from dynamoe.models.mistral_large4 import kv_sources

    return kv_sources(cfg)


def _loop(cfg):
    from dynamoe.models.family_fields import inkling2_loop_layers

    loop = inkling2_loop_layers(cfg)
    return loop.start, loop.end, loop.passes, loop.gate_rank


def _glm5(cfg):
    from dynamoe.models.glm5_next import glm5_fields

    return glm5_fields(cfg)


def _qwen4(cfg):
    from dynamoe.models.family_fields import qwen4_fields

    return qwen4_fields(cfg)


def _v4(cfg):
    from dynamoe.models.deepseek_v4 import v4_fields

    return v4_fields(cfg)


def _gemma4_layers(cfg):
    from dynamoe.models.family_fields import gemma4_attention_layers

    return tuple((g.head_dim, g.num_key_value_heads, g.kv_source) for g in gemma4_attention_layers(cfg))


def _hf_gemma4_layers(hf):
    modes = hf.kv_sharing_modes
    return tuple((hf.per_layer_config[i].head_dim, hf.per_layer_config[i].num_key_value_heads,
                  max(j for j in range(i) if modes[j] != "reuse" and hf.layer_types[j] == t) if modes[i] == "reuse"
                  else i) for i, t in enumerate(hf.layer_types))


def _hf_moe_layers(hf, mt):
    """Which layers have routed experts, by each transformers modeling file's rule."""
    n = hf.num_layers if mt == "longcat_flash" else hf.num_hidden_layers
    if mt in GEMMA4:
        return [hf.enable_moe_block and bool(hf.num_experts)] * n
    if mt in QWEN3_RULE:
        return [i not in hf.mlp_only_layers and hf.num_experts > 0 and (i + 1) % hf.decoder_sparse_step == 0
                for i in range(n)]
    if mt in ("mixtral", "minimax", "gpt_oss", "olmoe", "minimax_m2", "granitemoe", "granitemoeshared", "granitemoe_swa",
              "flex_olmo", "hunyuan_v1_moe", "dbrx", "qwen3_5_moe_text", "qwen3_5_moe", "phimoe", "longcat_flash",
              "solar_open", "jetmoe", "kolibri1", "zaya", "aria", "aria_text", "lara_mini") or mt in QWEN4 or mt in INKLING2:
        return [True] * n
    if mt == "ernie4_5_moe":
        return [(i + 1) % hf.moe_layer_interval == 0 and hf.moe_layer_start_index <= i <= hf.moe_layer_end_index
                for i in range(n)]
    if mt in LLAMA4:
        return [i in hf.moe_layers for i in range(n)]
    if mt in ("deepseek_v32", "glm_moe_dsa", "glm4_moe_lite", "exaone_moe", "kimi_linear", "bailing_hybrid",
              "minimax_m3_vl_text", "minimax_m3_vl", "mimo_v2_flash", "step3p5", "step3p7", "cohere2_moe", "hy_v3",
              "laguna", "mellum", "beam", "ernie4_5_vl_moe", "deepseek_ocr2", "muse_spark", "unlimited_ocr") or mt in \
            GLM5 | INKLING:
        return [t == "sparse" for t in hf.mlp_layer_types]
    if mt == "afmoe":
        return [i >= hf.num_dense_layers for i in range(n)]
    if mt == "doge":
        return [hf.is_moe] * n
    if mt == "jamba":
        return [e > 1 for e in hf.layers_num_experts]
    if mt == "granitemoehybrid":
        return [hf.num_local_experts > 0] * n
    if mt in NEMOTRON:
        return [t == "moe" for t in hf.layers_block_type]
    if mt == "lfm2_moe":
        return [i >= hf.num_dense_layers for i in range(n)]
    if mt in ML4 | HY4 | DOTS3 | {"axk1", "axk2"}:
        return [t == "sparse" for t in hf.mlp_layer_types]
    if mt == "deepseek_v4":  # (hash-routed or not, every layer is MoE)
        return [True] * n
    return [i >= hf.first_k_dense_replace for i in range(n)]


def _hf_windows(hf, mt):
    """The sliding window of each layer (None: full attention), as the modeling files read it."""
    n = hf.num_layers if mt == "longcat_flash" else hf.num_hidden_layers
    if mt in ("qwen3_moe", "mixtral", "phimoe", "doge", "deepseek_v4"):  # (V4's compressed layers slide too)
        return [hf.sliding_window] * n
    if mt == "zaya" or mt in INKLING | INKLING2:
        return [hf.sliding_window if t == "hybrid_sliding" else None for t in hf.layer_types]
    if mt in ("gpt_oss", "qwen2_moe", "dots1", "exaone_moe", "mimo_v2_flash", "flint", "granitemoe_swa", "step3p5",
              "step3p7", "afmoe", "cohere2_moe", "laguna", "mellum", "kolibri1", "beam", "lara_mini", "muse_spark") or mt in DOTS3 | GEMMA4:
        return [hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types]
    return [None] * n


def _hf_rope(hf):
    """transformers' RoPE parameters of a config (or of one layer type's rope_parameters dict)."""
    p = dict(hf if isinstance(hf, dict) else hf.rope_parameters)
    out = {"rope_type": p.get("rope_type", "default"), "theta": p["rope_theta"],
           "partial_rotary_factor": p.get("partial_rotary_factor", 1.0)}
    if out["rope_type"] == "yarn":
        out.update(factor=p["factor"], original_max_position_embeddings=p["original_max_position_embeddings"],
                   beta_fast=p.get("beta_fast", 32.0), beta_slow=p.get("beta_slow", 1.0),
                   truncate=p.get("truncate", True))
    return out


def _our_rope(cfg):
    r = cfg if isinstance(cfg, RopeConfig) else cfg.rope
    out = {"rope_type": r.rope_type, "theta": r.theta, "partial_rotary_factor": r.partial_rotary_factor}
    if r.rope_type == "yarn":
        out.update(factor=r.factor, original_max_position_embeddings=r.original_max_position_embeddings,
                   beta_fast=r.beta_fast, beta_slow=r.beta_slow, truncate=r.truncate)
    return out


def _eos(v):
    return () if v is None else tuple(v) if isinstance(v, (list, tuple)) else (v,)


# dynamoe's name -> (transformers' value, dynamoe's value, the families it applies to; None = all).
# Where the names or shapes differ, the two getters say how they correspond.
FIELDS = {
    "vocab_size": (lambda hf, mt: hf.vocab_size, None, None),
    "hidden_size": (lambda hf, mt: hf.hidden_size, None, None),
    # (LongCat: dynamoe's decoder layers are its num_layers, transformers' num_hidden_layers counts the sublayers)
    "num_hidden_layers": (lambda hf, mt: hf.num_layers if mt == "longcat_flash" else hf.num_hidden_layers, None, None),
    # (JetMoE's modeling code runs num_key_value_heads heads per chosen attention expert, whatever the attribute says)
    "num_attention_heads": (lambda hf, mt: hf.num_key_value_heads * hf.num_experts_per_tok if mt == "jetmoe"
                            else hf.num_attention_heads, None, None),
    # MLA ignores it (keys and values have a head per query head)
    "num_key_value_heads": (lambda hf, mt: hf.num_key_value_heads, None, GQA_FAMILIES),
    # the modeling files: getattr(config, "head_dim", None) or hidden // heads; MLA configs set qk_rope_head_dim
    "head_dim": (lambda hf, mt: getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads, None, None),
    "max_position_embeddings": (lambda hf, mt: hf.max_position_embeddings, None, None),
    # DBRX's LayerNorms: torch's default eps (its config has no field)
    # (Nemotron-H: layer_norm_epsilon; LFM2: norm_eps; Cohere2-MoE: LayerNorms of layer_norm_eps when rms_norm_eps is
    # null)
    "rms_norm_eps": (lambda hf, mt: 1e-5 if mt == "dbrx" else hf.layer_norm_epsilon if mt in NEMOTRON
                     else hf.norm_eps if mt == "lfm2_moe"
                     else hf.layer_norm_eps if getattr(hf, "rms_norm_eps", 0) is None else hf.rms_norm_eps, None, None),
    "layer_norm": (lambda hf, mt: getattr(hf, "rms_norm_eps", 0) is None, None, None),
    "rope": (lambda hf, mt: _hf_rope(hf), lambda cfg: _our_rope(cfg), set(FAMILIES) - NO_SINGLE_ROPE),
    # (MiMo's modeling code reads each layer type's partial_rotary_factor with a default of 0.334, Step's of 1)
    "rope_by_layer_type": (lambda hf, mt: {k: {**_hf_rope(p), "partial_rotary_factor": p.get(
                                               "partial_rotary_factor", 0.334 if mt == "mimo_v2_flash" else 1.0)}
                                           for k, p in hf.rope_parameters.items() if p is not None}  # (Beam: NoPE)
                           if mt != "zaya" else {ZAYA_KINDS[k]: {**_hf_rope(p), "partial_rotary_factor": p.get(
                               "partial_rotary_factor", 1.0)} for k, p in hf.rope_parameters.items()},
                           lambda cfg: {k: _our_rope(r) for k, r in cfg.rope_by_layer_type}, ROPE_PER_LAYER_TYPE),
    # GPT-OSS: its own SwiGLU; Nemotron-H: mlp_hidden_act / mamba_hidden_act (see ssm_nemotron); JetMoE:
    # activation_function
    "hidden_act": (lambda hf, mt: hf.activation_function if mt == "jetmoe" else hf.hidden_activation if mt in GEMMA4
                   else hf.hidden_act, None,
                   set(FAMILIES) - {"gpt_oss", "dbrx", "lfm2_moe"} - NEMOTRON),
    # DBRX: clip_qkv in attn_config
    "clip_qkv_dbrx": (lambda hf, mt: hf.attn_config.clip_qkv, lambda cfg: cfg.clip_qkv, {"dbrx"}),
    # (Inkling never ties: its checkpoints keep embed and unembed apart, whatever the attribute says; nor does
    # Nemotron-H: NemotronHForCausalLM has no tied weights)
    "tie_word_embeddings": (lambda hf, mt: mt not in INKLING | INKLING2 | NEMOTRON and hf.tie_word_embeddings, None,
                            None),
    # Mixtral's attention has no biases (and no attention_bias field)
    # (Kolibri-1's attention has no biases, whatever a config attribute says)
    "attention_bias": (lambda hf, mt: mt != "kolibri1" and getattr(hf, "attention_bias", False), None, None),
    "layer_windows": (lambda hf, mt: _hf_windows(hf, mt),
                      lambda cfg: [cfg.layer_sliding_window(i) for i in range(cfg.num_hidden_layers)], None),
    "num_experts": (lambda hf, mt: hf.ffn_config.moe_num_experts if mt == "dbrx" else hf.moe_num_experts if mt in ARIA
                    else (hf.num_experts or 0) if mt in GEMMA4
                    else next(getattr(hf, k) for k in ("num_local_experts", "num_experts", "n_routed_experts")
                              if hasattr(hf, k)),
                    None, None),
    "num_experts_per_tok": (lambda hf, mt: hf.moe_topk if mt in {"hunyuan_v1_moe"} | ARIA else (hf.top_k_experts or 0)
                            if mt in GEMMA4 else hf.ffn_config.moe_top_k
                            if mt == "dbrx" else hf.num_experts_per_tok, None, None),
    # Mixtral and GPT-OSS size their experts with intermediate_size
    "expert_hidden_size": (lambda hf, mt: hf.ffn_config.ffn_hidden_size if mt == "dbrx" else hf.intermediate_size if mt in {"jamba", "granitemoehybrid", "minimax", "minimax_m3_vl_text", "minimax_m3_vl", "mixtral", "gpt_oss", "olmoe", "minimax_m2",
                                                                          "granitemoe", "granitemoeshared", "granitemoe_swa", "flex_olmo",
                                                                          "hunyuan_v1_moe", "phimoe", "cohere2_moe", "jetmoe",
                                                                          "doge"} | ARIA
                           | LLAMA4
                           # (Gemma 4's dense models have no expert width: dynamoe's falls back to the dense one)
                           else (hf.moe_intermediate_size or hf.intermediate_size) if mt in GEMMA4
                           # (ERNIE-4.5-VL: [text, vision]; dynamoe runs the text group)
                           else hf.moe_intermediate_size[0] if mt == "ernie4_5_vl_moe"
                           else hf.moe_intermediate_size, None, None),
    "moe_layers": (lambda hf, mt: _hf_moe_layers(hf, mt),
                   lambda cfg: [cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)], None),
    "bos_token_id": (lambda hf, mt: hf.bos_token_id, None, None),
    "eos_token_id": (lambda hf, mt: _eos(hf.eos_token_id), None, None),
    "pad_token_id": (lambda hf, mt: hf.pad_token_id, None, None),
    # Qwen3-MoE
    "norm_topk_prob": (lambda hf, mt: hf.norm_topk_prob, None, {"qwen3_moe", "qwen2_moe", "olmoe", "flex_olmo",
                                                                  "qwen3_next", "qwen3_omni_moe_thinker", "qwen3_omni_moe", "flint",
                                                                  "mellum", "kolibri1"}
                       | DEEPSEEK_ROUTING | QWEN4),
    # Qwen3-VL-MoE's router has no norm_topk_prob: it always renormalises
    "norm_topk_prob_vl": (lambda hf, mt: True, lambda cfg: cfg.norm_topk_prob, {"qwen3_vl_moe", "qwen3_vl_moe_text"}),
    # GraniteMoE (a shared MLP only in granitemoeshared, and only when its size is > 0)
    **{name: (lambda hf, mt, name=name: getattr(hf, name), None, {"granitemoe", "granitemoeshared", "granitemoe_swa",
                                                                   "granitemoehybrid"})
       for name in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")},
    "shared_expert_intermediate_size": (lambda hf, mt: hf.shared_expert_intermediate_size if mt in {"qwen2_moe", "flint", "laguna", "kolibri1"} | HYBRID
                                        else hf.shared_intermediate_size or None, None,
                                        {"qwen2_moe", "granitemoeshared", "flint", "granitemoe_swa", "laguna",
                                         "kolibri1", "granitemoehybrid"}
                                        | HYBRID),
    # K-EXAONE: DeepSeek routing, shared experts under their own name
    # (keys of their own: the DeepSeek entries above keep theirs)
    **{f"{name}_exaone": (lambda hf, mt, name=name: getattr(hf, name), lambda cfg, name=name: getattr(cfg, name),
                          {"exaone_moe"})
       for name in ("n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob")},
    "n_shared_experts_exaone": (lambda hf, mt: hf.num_shared_experts, lambda cfg: cfg.n_shared_experts, {"exaone_moe"}),
    # ERNIE-4.5 (shared experts under its own name)
    "n_shared_experts_ernie": (lambda hf, mt: hf.moe_num_shared_experts, lambda cfg: cfg.n_shared_experts,
                               {"ernie4_5_moe", "ernie4_5_vl_moe"}),
    "ernie_vl_widths": (lambda hf, mt: tuple(hf.moe_intermediate_size),
                        lambda cfg: (cfg.moe_intermediate_size, cfg.raw.get("vision_moe_intermediate_size")),
                        {"ernie4_5_vl_moe"}),
    # OLMoE
    "clip_qkv": (lambda hf, mt: hf.clip_qkv, None, {"olmoe"}),
    "decoder_sparse_step": (lambda hf, mt: hf.decoder_sparse_step, None, QWEN3_RULE),
    "mlp_only_layers": (lambda hf, mt: tuple(hf.mlp_only_layers), None, QWEN3_RULE),
    # Qwen3-Next / Qwen3.5-MoE: layer kinds (from full_attention_interval), Gated DeltaNet sizes
    "layer_types": (lambda hf, mt: tuple(hf.layer_types), None,
                    HYBRID | {"kimi_linear", "mimo_v2_flash", "flint", "granitemoe_swa", "afmoe", "cohere2_moe", "laguna",
                             "mellum", "kolibri1", "beam", "deepseek_v4", "muse_spark"} | LLAMA4 | STEP | MAMBA | GLM5
                    | DOTS3 | GEMMA4),
    # Llama-4: chunked RoPE layers, NoPE layers with temperature tuning, L2 q/k norm, the dense layers' width
    "layer_uses_rope": (lambda hf, mt: [bool(r) for r in hf.no_rope_layers[:hf.num_hidden_layers]],
                        lambda cfg: [cfg.layer_uses_rope(i) for i in range(cfg.num_hidden_layers)], LLAMA4),
    **{name: (lambda hf, mt, name=name: getattr(hf, name), None, LLAMA4)
       for name in ("attention_chunk_size", "attn_temperature_tuning", "floor_scale", "attn_scale", "use_qk_norm",
                    "intermediate_size_mlp", "intermediate_size")},
    # Kimi-Linear: one head count and size for KDA's keys and values
    **{f"{ours}_kimi": (lambda hf, mt, theirs=theirs: getattr(hf, theirs), lambda cfg, ours=ours: getattr(cfg, ours),
                        {"kimi_linear"} | GLM5)
       for ours, theirs in (("linear_conv_kernel_dim", "linear_conv_kernel_dim"), ("linear_key_head_dim", "linear_head_dim"),
                            ("linear_value_head_dim", "linear_head_dim"), ("linear_num_key_heads", "linear_num_heads"),
                            ("linear_num_value_heads", "linear_num_heads"))},
    # MiMo-V2-Flash
    "v_head_dim_mimo": (lambda hf, mt: hf.v_head_dim, lambda cfg: cfg.v_head_dim, {"mimo_v2_flash"}),
    "attention_value_scale": (lambda hf, mt: hf.attention_value_scale,
                              lambda cfg: cfg.raw.get("attention_value_scale"), {"mimo_v2_flash"}),
    **{name: (lambda hf, mt, name=name: getattr(hf, name), None, HYBRID)
       for name in ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                    "linear_num_value_heads")},
    "intermediate_size": (lambda hf, mt: hf.intermediate_size, None, {"qwen3_next", "sarvam_moe", "mellum"} | set(WRAPPED) - {"qwen3_5_moe", "qwen4_exp"}
                          | {"qwen3_vl_moe_text", "glm4v_moe_text"}),
    # LongCat-Flash: zero-computation experts, route scale, the dense MLPs' width
    "zero_experts": (lambda hf, mt: hf.zero_expert_num, None, {"longcat_flash"}),
    **{f"{name}_longcat": (lambda hf, mt, name=name: getattr(hf, name), lambda cfg, name=name: getattr(cfg, name),
                           {"longcat_flash"})
       for name in ("routed_scaling_factor", "intermediate_size")},
    # Phi-3.5-MoE: SparseMixer's margin, the lm_head bias
    **{name: (lambda hf, mt, name=name: getattr(hf, name), None, {"phimoe"})
       for name in ("router_jitter_noise", "lm_head_bias", "intermediate_size")},
    # Step-3.5: the shared expert's size, the route scale, per-layer query heads, softmax scale and clamps
    "shared_expert_intermediate_size_step": (lambda hf, mt: hf.share_expert_dim,
                                             lambda cfg: cfg.shared_expert_intermediate_size, STEP),
    "routed_scaling_factor_step": (lambda hf, mt: hf.moe_router_scaling_factor, lambda cfg: cfg.routed_scaling_factor,
                                   STEP),
    "step_heads": (lambda hf, mt: tuple(hf.per_layer_config[i].num_attention_heads for i in range(hf.num_hidden_layers)),
                   lambda cfg: _step(cfg).heads, STEP),
    "step_scale": (lambda hf, mt: hf.query_pre_attn_scalar ** -0.5, lambda cfg: _step(cfg).scale, STEP),
    "step_limits": (lambda hf, mt: tuple((hf.swiglu_limits[i] or None) if hf.swiglu_limits else None
                                         for i in range(hf.num_hidden_layers)), lambda cfg: _step(cfg).limits, STEP),
    "step_shared_limits": (lambda hf, mt: tuple((hf.swiglu_limits_shared[i] if hf.swiglu_limits_shared else 0) or None
                                                for i in range(hf.num_hidden_layers)),
                           lambda cfg: _step(cfg).shared_limits, STEP),
    "num_nextn_predict_layers_step": (lambda hf, mt: hf.num_nextn_predict_layers,
                                      lambda cfg: cfg.num_nextn_predict_layers, STEP),
    # AFMoE: shared experts, route scale, the dense layers' width
    **{f"{ours}_afmoe": (lambda hf, mt, theirs=theirs: getattr(hf, theirs), lambda cfg, ours=ours: getattr(cfg, ours),
                         {"afmoe"})
       for ours, theirs in (("n_shared_experts", "num_shared_experts"), ("routed_scaling_factor", "route_scale"),
                            ("intermediate_size", "intermediate_size"))},
    # Cohere2-MoE: RoPE on the sliding layers and (prefix pattern 1) the dense ones; its own names and switches
    "layer_uses_rope_cohere": (lambda hf, mt: [t == "sliding_attention" or (m == "dense" and
                                                                           hf.prefix_dense_sliding_window_pattern == 1)
                                               for t, m in zip(hf.layer_types, hf.mlp_layer_types)],
                               lambda cfg: [cfg.layer_uses_rope(i) for i in range(cfg.num_hidden_layers)], {"cohere2_moe"}),
    "n_shared_experts_cohere": (lambda hf, mt: hf.num_shared_experts, lambda cfg: cfg.n_shared_experts, {"cohere2_moe"}),
    **{f"{name}_cohere": (lambda hf, mt, name=name: getattr(hf, name), lambda cfg, name=name: cfg.raw.get(name),
                          {"cohere2_moe"})
       for name in ("logit_scale", "expert_selection_fn", "shared_expert_combination_strategy",
                    "prefix_dense_intermediate_size")},
    **{f"{name}_cohere": (lambda hf, mt, name=name: getattr(hf, name), lambda cfg, name=name: getattr(cfg, name),
                          {"cohere2_moe"})
       for name in ("norm_topk_prob", "intermediate_size")},
    # Hy3
    "n_shared_experts_hy": (lambda hf, mt: hf.num_shared_experts, lambda cfg: cfg.n_shared_experts, {"hy_v3"}),
    "routed_scaling_factor_hy": (lambda hf, mt: hf.router_scaling_factor, lambda cfg: cfg.routed_scaling_factor,
                                 {"hy_v3"}),
    "intermediate_size_hy": (lambda hf, mt: hf.intermediate_size, lambda cfg: cfg.intermediate_size, {"hy_v3"}),
    **{f"{name}_hy": (lambda hf, mt, name=name: getattr(hf, name), lambda cfg, name=name: cfg.raw.get(name), {"hy_v3"})
       for name in ("mlp_bias", "enable_moe_fp32_combine")},
    # Laguna: the route scale under its own name, the dense layers' width, per-layer heads and its switches
    "routed_scaling_factor_laguna": (lambda hf, mt: hf.moe_routed_scaling_factor, lambda cfg: cfg.routed_scaling_factor,
                                     {"laguna"}),
    "intermediate_size_laguna": (lambda hf, mt: hf.intermediate_size, lambda cfg: cfg.intermediate_size, {"laguna"}),
    "heads_laguna": (lambda hf, mt: list(hf.num_attention_heads_per_layer),
                     lambda cfg: cfg.raw.get("num_attention_heads_per_layer") or [cfg.num_attention_heads]
                     * cfg.num_hidden_layers, {"laguna"}),
    **{f"{name}_laguna": (lambda hf, mt, name=name: getattr(hf, name), lambda cfg, name=name: cfg.raw.get(name),
                          {"laguna"})
       for name in ("gating", "moe_router_logit_softcapping", "moe_apply_router_weight_on_input")},
    # Beam: NoPE on the layer types without RoPE parameters, the dense layers' width, the logit softcap
    "layer_uses_rope_beam": (lambda hf, mt: [hf.rope_parameters[t] is not None for t in hf.layer_types],
                             lambda cfg: [cfg.layer_uses_rope(i) for i in range(cfg.num_hidden_layers)], {"beam"}),
    "intermediate_size_beam": (lambda hf, mt: hf.intermediate_size, lambda cfg: cfg.intermediate_size, {"beam"}),
    "final_logit_softcapping_beam": (lambda hf, mt: hf.final_logit_softcapping,
                                     lambda cfg: cfg.raw.get("final_logit_softcapping"), {"beam"}),
    # ZAYA1: its layer kinds under dynamoe's names, the router's and the convolutions' sizes, the lm_head bias
    "layer_types_zaya": (lambda hf, mt: tuple(ZAYA_KINDS[t] for t in hf.layer_types), lambda cfg: cfg.layer_types,
                         {"zaya"}),
    **{f"{name}_zaya": (lambda hf, mt, name=name: getattr(hf, name), lambda cfg, name=name: cfg.raw.get(name), {"zaya"})
       for name in ("router_hidden_size", "cca_time0", "cca_time1", "lm_head_bias")},
    # Doge
    **{f"{name}_doge": (lambda hf, mt, name=name: getattr(hf, name), lambda cfg, name=name: cfg.raw.get(name),
                        {"doge"})
       for name in ("keep_window_size", "is_moe", "mlp_bias")},
    # Aria: shared experts under its own name, the bias switch of the shared experts, the dense width
    "n_shared_experts_aria": (lambda hf, mt: hf.moe_num_shared_experts, lambda cfg: cfg.n_shared_experts, ARIA),
    "mlp_bias_aria": (lambda hf, mt: hf.mlp_bias, lambda cfg: cfg.raw.get("mlp_bias"), ARIA),
    # Mamba layers: dynamoe's SSMConfig under each config class's names
    "ssm_jamba": (lambda hf, mt: ("mamba1", hf.mamba_expand * hf.hidden_size, hf.mamba_d_state, hf.mamba_d_conv,
                                  hf.mamba_conv_bias, hf.mamba_proj_bias, hf.hidden_act, hf.mamba_dt_rank),
                  lambda cfg: (cfg.ssm.kind, cfg.ssm.intermediate_size, cfg.ssm.state_size, cfg.ssm.conv_kernel,
                               cfg.ssm.conv_bias, cfg.ssm.proj_bias, cfg.ssm.activation, cfg.ssm.dt_rank), {"jamba"}),
    "intermediate_size_jamba": (lambda hf, mt: hf.intermediate_size, lambda cfg: cfg.intermediate_size, {"jamba"}),
    "ssm_granite": (lambda hf, mt: ("mamba2", hf.mamba_expand * hf.hidden_size, hf.mamba_d_state, hf.mamba_d_conv,
                                    hf.mamba_conv_bias, hf.mamba_proj_bias, hf.hidden_act, hf.mamba_n_heads,
                                    hf.mamba_d_head, hf.mamba_n_groups, hf.mamba_chunk_size, tuple(hf.time_step_limit)),
                    lambda cfg: (cfg.ssm.kind, cfg.ssm.intermediate_size, cfg.ssm.state_size, cfg.ssm.conv_kernel,
                                 cfg.ssm.conv_bias, cfg.ssm.proj_bias, cfg.ssm.activation, cfg.ssm.num_heads,
                                 cfg.ssm.head_dim, cfg.ssm.n_groups, cfg.ssm.chunk_size, cfg.ssm.time_step_limit),
                    {"granitemoehybrid"}),
    # GraniteMoE-Hybrid: RoPE in the attention layers only with position_embedding_type 'rope'
    "ssm_nemotron": (lambda hf, mt: ("mamba2", hf.mamba_num_heads * hf.mamba_head_dim, hf.ssm_state_size,
                                     hf.conv_kernel, hf.use_conv_bias, hf.use_bias, hf.mamba_hidden_act,
                                     hf.mamba_num_heads, hf.mamba_head_dim, hf.n_groups, hf.chunk_size,
                                     (hf.time_step_min, float("inf"))),
                     lambda cfg: (cfg.ssm.kind, cfg.ssm.intermediate_size, cfg.ssm.state_size, cfg.ssm.conv_kernel,
                                  cfg.ssm.conv_bias, cfg.ssm.proj_bias, cfg.ssm.activation, cfg.ssm.num_heads,
                                  cfg.ssm.head_dim, cfg.ssm.n_groups, cfg.ssm.chunk_size, cfg.ssm.time_step_limit),
                     NEMOTRON),
    **{f"{ours}_nemotron": (lambda hf, mt, theirs=theirs: getattr(hf, theirs), lambda cfg, ours=ours: getattr(cfg, ours),
                            NEMOTRON)
       for ours, theirs in (("n_group", "n_group"), ("topk_group", "topk_group"), ("norm_topk_prob", "norm_topk_prob"),
                            ("routed_scaling_factor", "routed_scaling_factor"), ("intermediate_size", "intermediate_size"),
                            ("shared_expert_intermediate_size", "moe_shared_expert_intermediate_size"))},
    "ssm_lfm2": (lambda hf, mt: ("short_conv", hf.hidden_size, hf.conv_L_cache, hf.conv_bias, hf.conv_bias),
                 lambda cfg: (cfg.ssm.kind, cfg.ssm.intermediate_size, cfg.ssm.conv_kernel, cfg.ssm.conv_bias,
                              cfg.ssm.proj_bias), {"lfm2_moe"}),
    **{f"{ours}_lfm2": (lambda hf, mt, theirs=theirs: getattr(hf, theirs), lambda cfg, ours=ours: getattr(cfg, ours),
                        {"lfm2_moe"})
       for ours, theirs in (("norm_topk_prob", "norm_topk_prob"), ("routed_scaling_factor", "routed_scaling_factor"),
                            ("intermediate_size", "intermediate_size"), ("first_k_dense_replace", "num_dense_layers"))},
    "use_expert_bias_lfm2": (lambda hf, mt: hf.use_expert_bias, lambda cfg: cfg.raw["use_expert_bias"], {"lfm2_moe"}),
    "ssm_lightning": (lambda hf, mt: ("lightning", hf.num_attention_heads, hf.head_dim or hf.hidden_size // hf.num_attention_heads,
                                      hf.block_size, hf.hidden_act),
                      lambda cfg: (cfg.ssm.kind, cfg.ssm.num_heads, cfg.ssm.head_dim, cfg.ssm.chunk_size,
                                   cfg.ssm.activation), {"minimax"}),
    **{name: (lambda hf, mt, name=name: getattr(hf, name), lambda cfg, name=name: cfg.raw[name], {"minimax"})
       for name in ("full_attn_alpha_factor", "full_attn_beta_factor", "linear_attn_alpha_factor",
                    "linear_attn_beta_factor", "mlp_alpha_factor", "mlp_beta_factor")},
    # MiniMax: a sliding_window slides every softmax-attention layer (its family reads it so)
    "minimax_windows": (lambda hf, mt: [hf.sliding_window if t == "full_attention" else None for t in hf.layer_types],
                        lambda cfg: [cfg.sliding_window if t == "full_attention" else None for t in cfg.layer_types],
                        {"minimax"}),
    # Ling-3: the KDA sizes from head_dim, the heads and short_conv_kernel_size; MTP layers; dense layers
    **{f"{ours}_bailing": (lambda hf, mt, theirs=theirs: getattr(hf, theirs), lambda cfg, ours=ours: getattr(cfg, ours),
                           {"bailing_hybrid"})
       for ours, theirs in (("linear_conv_kernel_dim", "linear_conv_kernel_dim"), ("linear_key_head_dim", "linear_head_dim"),
                            ("linear_value_head_dim", "linear_head_dim"), ("linear_num_key_heads", "linear_num_heads"),
                            ("linear_num_value_heads", "linear_num_heads"), ("num_nextn_predict_layers", "num_mtp_layers"),
                            ("first_k_dense_replace", "first_k_dense_replace"), ("intermediate_size", "intermediate_size"))},
    **{name: (lambda hf, mt, name=name: getattr(hf, name), lambda cfg, name=name: cfg.raw[name], {"bailing_hybrid"})
       for name in ("kda_safe_gate", "kda_lower_bound")},
    # MiniMax-M3: the indexer, the MLP widths, SwiGLU-OAI, the route scale
    **{f"{name}_m3": (lambda hf, mt, name=name: getattr(hf, name), lambda cfg, name=name: cfg.raw[name],
                      {"minimax_m3_vl_text", "minimax_m3_vl"})
       for name in ("index_block_size", "index_topk_blocks", "index_local_blocks", "dense_intermediate_size",
                    "rotary_dim")},
    **{f"{ours}_m3": (lambda hf, mt, theirs=theirs: getattr(hf, theirs), lambda cfg, ours=ours: getattr(cfg, ours),
                      {"minimax_m3_vl_text", "minimax_m3_vl"})
       for ours, theirs in (("index_n_heads", "index_n_heads"), ("index_head_dim", "index_head_dim"),
                            ("shared_expert_intermediate_size", "shared_intermediate_size"),
                            ("routed_scaling_factor", "routed_scaling_factor"), ("swiglu_alpha", "swiglu_alpha"),
                            ("swiglu_limit", "swiglu_limit"))},
    "layer_uses_rope_granite": (lambda hf, mt: [hf.position_embedding_type == "rope"] * hf.num_hidden_layers,
                                lambda cfg: [cfg.layer_uses_rope(i) for i in range(cfg.num_hidden_layers)],
                                {"granitemoehybrid"}),
    # DeepSeek-V4: routing, clamp, low-rank queries and output, the indexer, hyper-connections, compression
    **{f"{name}_v4": (lambda hf, mt, name=name: getattr(hf, name), lambda cfg, name=name: getattr(cfg, name),
                      {"deepseek_v4"})
       for name in ("scoring_func", "routed_scaling_factor", "n_shared_experts", "swiglu_limit", "q_lora_rank",
                    "index_topk", "index_head_dim", "index_n_heads", "num_nextn_predict_layers")},
    **{f"{name}_v4": (lambda hf, mt, name=name: getattr(hf, name), lambda cfg, name=name: getattr(_v4(cfg), name),
                      {"deepseek_v4"})
       for name in ("hc_mult", "hc_sinkhorn_iters", "hc_eps", "o_groups", "o_lora_rank")},
    "compress_rates_v4": (lambda hf, mt: tuple(0 if t == "sliding_attention" else hf.compress_rates[t]
                                               for t in hf.layer_types),
                          lambda cfg: _v4(cfg).compress_rates, {"deepseek_v4"}),
    "hash_layers_v4": (lambda hf, mt: tuple(t == "hash_moe" for t in hf.mlp_layer_types),
                       lambda cfg: _v4(cfg).hash_layers, {"deepseek_v4"}),
    # Qwen2-MoE
    "qkv_bias": (lambda hf, mt: hf.qkv_bias, None, {"qwen2_moe"}),
    # GPT-OSS
    "swiglu_limit": (lambda hf, mt: hf.swiglu_limit, None, {"gpt_oss"}),
    "swiglu_alpha": (lambda hf, mt: hf.swiglu_alpha, None, {"gpt_oss"}),
    # DeepSeek routing (DeepSeek-V3 / Kimi-K2, GLM-4.5, V3.2, GLM-5)
    # DeepSeek-V2's greedy routing leaves them null: one group
    "n_group": (lambda hf, mt: hf.n_group or 1, None, DEEPSEEK_ROUTING),
    "topk_group": (lambda hf, mt: hf.topk_group or 1, None, DEEPSEEK_ROUTING),
    "topk_method": (lambda hf, mt: hf.topk_method, None, {"deepseek_v2", "deepseek_ocr2", "unlimited_ocr"}),
    **{f"{name}_ocr2": (lambda hf, mt, name=name: getattr(hf, name) or 1, lambda cfg, name=name: getattr(cfg, name),
                        {"deepseek_ocr2", "unlimited_ocr"})
       for name in ("n_group", "topk_group")},
    **{f"{name}_ocr2": (lambda hf, mt, name=name: getattr(hf, name), lambda cfg, name=name: getattr(cfg, name),
                        {"deepseek_ocr2", "unlimited_ocr"})
       for name in ("routed_scaling_factor", "n_shared_experts")},
    # Unlimited-OCR: the window of each reference sliding-window layer (the prompt stays in sight; None: full)
    "reference_windows": (lambda hf, mt: [hf.sliding_window if t == "reference_sliding_attention" else None
                                          for t in hf.layer_types],
                          lambda cfg: [cfg.layer_reference_window(i) for i in range(cfg.num_hidden_layers)],
                          {"unlimited_ocr"}),
    "routed_scaling_factor": (lambda hf, mt: hf.routed_scaling_factor, None, DEEPSEEK_ROUTING),
    # MiMo-V2-Flash has no shared experts (and no such field)
    "n_shared_experts": (lambda hf, mt: getattr(hf, "n_shared_experts", 0), None, DEEPSEEK_ROUTING),
    "first_k_dense_replace": (lambda hf, mt: hf.first_k_dense_replace, None,
                              (DEEPSEEK_LIKE - {"glm4_moe_lite"}) | {"mistral4", "sarvam_moe"}),
    "use_qk_norm": (lambda hf, mt: hf.use_qk_norm, None, {"glm4_moe", "sarvam_moe"}),
    "num_nextn_predict_layers": (lambda hf, mt: hf.num_nextn_predict_layers, None,
                                 {"deepseek_v3", "kimi_k2", "glm4_moe", "sarvam_moe", "sarvam_mla"}),
    # MLA
    **{name: (lambda hf, mt, name=name: getattr(hf, name), None, MLA_FAMILIES)
       for name in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")},
    # V3.2 / GLM-5 always interleave MLA's RoPE (the family classes say so); V3 reads the field
    "rope_interleave": (lambda hf, mt: hf.rope_interleave, None, {"deepseek_v3", "kimi_k2", "glm4_moe_lite", "mistral4",
                                                                  "sarvam_mla", "axk1"}),
    # the sparse-attention indexer
    **{name: (lambda hf, mt, name=name: getattr(hf, name), None,
              {"deepseek_v32", "glm_moe_dsa", "axk2"} | GLM5 | HY4 | DOTS3)
       for name in ("index_topk", "index_head_dim", "index_n_heads")},
    # GLM-5's indexer kinds: dynamoe's () means every layer runs its indexer
    "indexer_types": (lambda hf, mt: list(hf.indexer_types),
                      lambda cfg: list(cfg.indexer_types) or ["full"] * cfg.num_hidden_layers,
                      {"glm_moe_dsa"} | GLM5 | HY4),
    # Hy4: the routed experts' clamp, the dense MLP's width, RoPE layout, hyper-connections
    "swiglu_limit_hy4": (lambda hf, mt: hf.swiglu_limit, lambda cfg: cfg.swiglu_limit, HY4),
    "intermediate_size_hy4": (lambda hf, mt: hf.intermediate_size, lambda cfg: cfg.intermediate_size, HY4),
    "rope_interleave_hy4": (lambda hf, mt: mt != "hy_v4", lambda cfg: cfg.rope_interleave, HY4),
    "hc_hy4": (lambda hf, mt: (hf.hc_mult, hf.hc_eps, hf.hc_magnitude), lambda cfg: _hy4(cfg), HY4),
    # Mistral-Large-4: MLA sizes, routing, the indexer, RoPE / NoPE layers, KV sharing, the logits' cap
    **{f"{name}_ml4": (lambda hf, mt, name=name: getattr(hf, name), lambda cfg, name=name: getattr(cfg, name), ML4)
       for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_group", "topk_group",
                    "routed_scaling_factor", "n_shared_experts", "index_topk", "index_head_dim", "index_n_heads",
                    "intermediate_size")},
    "layer_uses_rope_ml4": (lambda hf, mt: [bool(r) for r in hf.no_rope_layers],
                            lambda cfg: [cfg.layer_uses_rope(i) for i in range(cfg.num_hidden_layers)], ML4),
    "indexer_types_ml4": (lambda hf, mt: list(hf.indexer_types),
                          lambda cfg: list(cfg.indexer_types) or ["full"] * cfg.num_hidden_layers, ML4),
    "kv_source_layers": (lambda hf, mt: tuple(hf.kv_source_layers), lambda cfg: _ml4_sources(cfg), ML4),
    "final_logit_softcapping": (lambda hf, mt: hf.final_logit_softcapping,
                                lambda cfg: cfg.raw.get("final_logit_softcapping", 30.0), ML4),
    # dots3_note: each layer's MLA sizes, the shared experts' width, the dense MLPs' width
    "dots3_layer_sizes": (lambda hf, mt: tuple(tuple(getattr(hf.per_layer_config[i], f) for f in _dots3_fields())
                                               for i in range(hf.num_hidden_layers)),
                          lambda cfg: tuple(tuple(s[f] for f in _dots3_fields()) for s in _dots3_sizes(cfg)), DOTS3),
    "shared_experts_intermediate_size": (lambda hf, mt: hf.shared_experts_intermediate_size,
                                         lambda cfg: cfg.raw.get("shared_experts_intermediate_size"), DOTS3),
    "intermediate_size_dots3": (lambda hf, mt: hf.intermediate_size, lambda cfg: cfg.intermediate_size, DOTS3),
    # Muse Spark: NoPE where layer_rope_theta is 0, its scales and widths
    "layer_uses_rope_muse": (lambda hf, mt: [bool(t) for t in hf.layer_rope_theta],
                             lambda cfg: [cfg.layer_uses_rope(i) for i in range(cfg.num_hidden_layers)], {"muse_spark"}),
    **{f"{name}_muse": (lambda hf, mt, name=name: getattr(hf, name), lambda cfg, name=name: cfg.raw.get(name),
                        {"muse_spark"})
       for name in ("qk_scale_factor", "output_multiplier", "post_norm_eps", "moe_hidden_size",
                    "residual_gate_temperature", "final_logit_softcapping")},
    **{f"{name}_muse": (lambda hf, mt, name=name: getattr(hf, name), lambda cfg, name=name: getattr(cfg, name),
                        {"muse_spark"})
       for name in ("routed_scaling_factor", "intermediate_size")},
    # Gemma 4: each layer's head size, KV heads and KV source; per-layer inputs, switches, the logits' cap
    "gemma4_layers": (lambda hf, mt: _hf_gemma4_layers(hf), lambda cfg: _gemma4_layers(cfg), GEMMA4),
    **{f"{name}_gemma4": (lambda hf, mt, name=name: getattr(hf, name), lambda cfg, name=name: cfg.raw.get(name), GEMMA4)
       for name in ("final_logit_softcapping", "hidden_size_per_layer_input", "vocab_size_per_layer_input",
                    "attention_k_eq_v", "num_kv_shared_layers", "enable_moe_block", "use_double_wide_mlp",
                    "use_bidirectional_attention")},
    "intermediate_size_gemma4": (lambda hf, mt: hf.intermediate_size, lambda cfg: cfg.intermediate_size, GEMMA4),
    # Inkling: layer kinds under dynamoe's names, the sliding layers' sizes, the bias, convolutions, router, head
    "layer_types_inkling": (lambda hf, mt: tuple(ZAYA_KINDS[t] for t in hf.layer_types), lambda cfg: cfg.layer_types,
                            INKLING),
    **{f"{name}_inkling": (lambda hf, mt, name=name: getattr(hf, name), lambda cfg, name=name: cfg.raw.get(name),
                           INKLING)
       for name in ("swa_num_attention_heads", "swa_num_key_value_heads", "swa_head_dim", "d_rel", "rel_extent",
                    "log_scaling_n_floor", "log_scaling_alpha", "conv_kernel_size", "route_scale",
                    "logits_mup_width_multiplier", "unpadded_vocab_size")},
    **{f"{name}_inkling": (lambda hf, mt, name=name: getattr(hf, name), lambda cfg, name=name: getattr(cfg, name),
                           INKLING)
       for name in ("n_shared_experts", "intermediate_size")},
    # Inkling-2: layer kinds under dynamoe's names, the sliding layers' sizes, the bias, clips, log scaling, the
    # residual blocks, convolutions, router, softcaps, head
    "layer_types_inkling2": (lambda hf, mt: tuple(ZAYA_KINDS[t] for t in hf.layer_types), lambda cfg: cfg.layer_types,
                             INKLING2),
    **{f"{name}_inkling2": (lambda hf, mt, name=name: getattr(hf, name), lambda cfg, name=name: cfg.raw.get(name),
                            INKLING2)
       for name in ("swa_num_attention_heads", "swa_num_key_value_heads", "swa_head_dim", "d_rel", "rel_extent",
                    "log_scaling_n_floor", "log_scaling_alpha", "conv_kernel_size", "route_scale", "unpadded_vocab_size",
                    "qk_l2_clip_threshold", "rel_l2_clip_threshold", "n_layers_per_attn_res_block",
                    "mlp_gate_softcap", "mlp_up_softcap", "final_logit_softcapping", "scoring_func")},
    "loop_inkling2": (lambda hf, mt: (hf.loop_layer_index_start, hf.loop_layer_index_end, hf.loop_num_passes,
                                      hf.loop_gate_rank), lambda cfg: _loop(cfg), INKLING2_LOOP),
    # GLM-5.3: the clamp, the dense MLPs' width, hyper-connections, KDA's decay bound, the indexer's pools
    "swiglu_limit_glm5": (lambda hf, mt: hf.swiglu_limit, lambda cfg: cfg.swiglu_limit, GLM5),
    "intermediate_size_glm5": (lambda hf, mt: hf.intermediate_size, lambda cfg: cfg.intermediate_size, GLM5),
    **{f"{name}_glm5": (lambda hf, mt, name=name: getattr(hf, name), lambda cfg, name=name: getattr(_glm5(cfg), name),
                        GLM5)
       for name in ("hc_mult", "hc_sinkhorn_iters", "hc_eps", "linear_lower_bound", "index_kpool")},
    # Qwen4-Exp: the QSA indexer under our index_* names, the linear attention's output gate (hidden_act when null),
    # hyper-connections, per-layer n-gram embeddings (one-based ids in transformers, 0-based layers here)
    **{f"{ours}_qwen4": (lambda hf, mt, theirs=theirs: getattr(hf, theirs), lambda cfg, ours=ours: getattr(cfg, ours),
                         QWEN4)
       for ours, theirs in (("index_n_heads", "indexer_n_heads"), ("index_head_dim", "indexer_head_dim"),
                            ("index_topk", "indexer_budget"))},
    "output_gate_type_qwen4": (lambda hf, mt: hf.output_gate_type or hf.hidden_act,
                               lambda cfg: _qwen4(cfg).output_gate_type, QWEN4),
    "ple_layers_qwen4": (lambda hf, mt: tuple(i - 1 for i in hf.ple_layer_ids), lambda cfg: _qwen4(cfg).ple_layers,
                         QWEN4),
    **{f"{name}_qwen4": (lambda hf, mt, name=name: getattr(hf, name), lambda cfg, name=name: getattr(_qwen4(cfg), name),
                         QWEN4)
       for name in ("hc_count", "hc_lowrank", "indexer_compress_ratio", "ple_embed_dim", "ple_conv_kernel_size",
                    "ngram_size", "heads_per_ngram", "ngram_vocab_size_base", "make_ngram_vocab_size_divisible_by",
                    "seed", "split_ngram_parts")},
}


def _compare(mt: str, d: dict):
    cls_name = FAMILIES[mt][0]
    fields = {k: v for k, v in d.items() if k != "model_type"}
    if mt in WRAPPED:  # the multimodal config: its text model, as the ConditionalGeneration class reads it
        path = WRAPPED[mt]
        nested = fields
        for key in reversed(path):
            nested = {key: nested}
        d = {"model_type": mt, **nested}
        parent = getattr(transformers, cls_name).from_dict(nested)
        for key in path[:-1]:
            parent = getattr(parent, key)
        hf = getattr(parent, path[-1])
        if mt != "llama4":  # (the level above the text model ties its lm_head; Llama-4 ties by its text config)
            hf.tie_word_embeddings = getattr(parent, "tie_word_embeddings", False)  # (Step3p7Config has none: false)
    else:
        hf = getattr(transformers, cls_name).from_dict(fields)
    if mt in STEP | DOTS3 | GEMMA4:  # (head counts vary by layer: the global one is the full layers'; step_heads /
        # dots3_layer_sizes check each)
        hf.allow_global_per_layer_attribute_access = True
    cfg = ModelConfig.from_dict(dict(d))
    checked, wrong = [], {}
    for name, (hf_get, our_get, families) in FIELDS.items():
        if families is not None and mt not in families:
            continue
        want = hf_get(hf, mt)
        got = our_get(cfg) if our_get else getattr(cfg, name)
        checked.append(name)
        if got != want:
            wrong[name] = {"dynamoe": got, "transformers": want}
    assert not wrong, f"{mt}: fields where dynamoe's default differs from {cls_name}'s: {wrong}"
    return checked


@pytest.mark.parametrize("mt", sorted(FAMILIES))
def test_omitted_fields_default_as_transformers(mt):
    d = {"model_type": mt, **SIZES, **FAMILIES[mt][1]}
    checked = _compare(mt, d)
    rope = {"rope_by_layer_type"} if mt in ROPE_PER_LAYER_TYPE else set() if mt in NO_SINGLE_ROPE else {"rope"}
    assert {"rms_norm_eps", "num_experts", "num_experts_per_tok", "max_position_embeddings"} | rope <= set(checked)


@pytest.mark.parametrize("mt,extra", [
    ("qwen3_moe", {"sliding_window": 64}),                               # a window without use_sliding_window: none
    ("qwen3_moe", {"sliding_window": 64, "use_sliding_window": True}),   # ... with it: every layer
    ("mixtral", {"sliding_window": 64}),                                 # Mixtral has no switch: every layer
    ("qwen2_moe", {"sliding_window": 64, "use_sliding_window": True}),   # even layers below max_window_layers (28)
    ("qwen2_moe", {"sliding_window": 8, "use_sliding_window": True, "max_window_layers": 3}),
    ("mixtral", {"head_dim": None}),                                     # null: hidden // heads
    ("gpt_oss", {"rope_theta": 50000.0, "rope_scaling": None}),          # hub style: YaRN stays the default
    ("glm4_moe", {"rope_theta": 1e6}),                                   # half RoPE at the file's base
    ("minimax_m2", {"rotary_dim": 64}),
    ("dots1", {"sliding_window": 64, "max_window_layers": 2}),           # layers 2, 3 slide
    ("dots1", {"sliding_window": None}),                                 # no window: every layer full
    ("ernie4_5_moe", {"moe_layer_start_index": 0, "moe_layer_end_index": 2, "moe_layer_interval": 2}),
    ("exaone_moe", {"sliding_window_pattern": 2, "sliding_window": 64, "first_k_dense_replace": 2}),                                  # hub style: half of head_dim 128 rotates
    ("deepseek_v3", {"head_dim": 8}),                                    # MLA: head_dim is qk_rope_head_dim
    ("qwen3_next", {"full_attention_interval": 2}),                      # every 2nd layer full attention
    ("qwen3_5_moe", {"full_attention_interval": 2, "partial_rotary_factor": 0.5}),  # inside text_config
    ("qwen3_next", {"layer_types": ["full_attention", "linear_attention"] * 2}),
    # fields the wrappers' text models do not read: no window, always renormalised (Qwen3-VL), no q/k norm (GLM-4.5V)
    ("qwen3_vl_moe", {"norm_topk_prob": False, "sliding_window": 64, "use_sliding_window": True}),
    ("qwen3_omni_moe", {"sliding_window": 64, "use_sliding_window": True, "norm_topk_prob": False}),
    ("glm4v_moe", {"use_qk_norm": True, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5,
                                                            "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0]}}),
    # the hub's Kimi-Linear config: its own names, the KDA sizes and 1-based layer lists in linear_attn_config
    ("kimi_linear", {"linear_attn_config": {"full_attn_layers": [2, 4], "kda_layers": [1, 3], "head_dim": 16,
                                            "num_heads": 4, "short_conv_kernel_size": 3},
                     "num_experts_per_token": 2, "moe_renormalize": False, "num_expert_group": 2, "num_shared_experts": 2,
                     "model_max_length": 512, "first_k_dense_replace": 2, "num_experts": 8}),
    ("kimi_linear", {"linear_head_dim": 32, "linear_attn_config": {"head_dim": 16}}),   # the nested one wins
    ("mimo_v2_flash", {"sliding_window_size": 64, "routed_scaling_factor": None}),       # window + 1; null: 1
    ("mimo_v2_flash", {"layer_types": ["sliding_attention", "full_attention"] * 2,
                       "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                           "sliding_attention": {"rope_type": "default", "rope_theta": 1e3,
                                                                 "partial_rotary_factor": 0.5}}}),
    ("granitemoe_swa", {"sliding_window": 32, "shared_intermediate_size": 16}),
    ("flint", {"num_hidden_layers": 9, "mlp_only_layers": [], "sliding_window": 64}),
    ("mistral4", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "llama_4_scaling_beta": 0.2}}),
    # LongCat-Flash: the hub's names, a YaRN RoPE, num_hidden_layers given instead of num_layers
    ("longcat_flash", {"num_layers": 3, "moe_topk": 4, "n_routed_experts": 16, "zero_expert_num": 8,
                       "ffn_hidden_size": 96, "expert_ffn_hidden_size": 32}),
    ("longcat_flash", {"num_hidden_layers": 6, "zero_expert_num": 0}),
    # Phi-3.5-MoE: a window slides every layer; the hub's longrope
    ("phimoe", {"sliding_window": 64}),
    ("phimoe", {"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
                                 "short_mscale": 1.2, "long_mscale": 1.2, "original_max_position_embeddings": 1024},
                "rope_theta": 1e4, "original_max_position_embeddings": 1024}),
    # Llama-4: MoE every 2nd layer, NoPE every 2nd, no chunking; explicit lists; the hub's llama3 RoPE
    ("llama4_text", {"interleave_moe_layer_step": 2, "no_rope_layer_interval": 2, "attention_chunk_size": None}),
    ("llama4_text", {"moe_layers": [0, 3], "no_rope_layers": [0, 1, 1, 0], "use_qk_norm": False}),
    # Step-3.5: the hub's names and per-layer lists padded with an MTP entry, a scalar rope_theta, nested RoPE
    ("step3p5", {"moe_num_experts": 16, "moe_top_k": 4, "num_attention_groups": 2, "share_expert_dims": 48,
                 "num_nextn_predict_layers": 1, "sliding_window": 8, "moe_layers_enum": "1,2,3,4",
                 "layer_types": ["full_attention", "sliding_attention", "sliding_attention", "full_attention"] * 1
                 + ["full_attention"], "attention_other_setting": {"num_attention_heads": 16},
                 "rope_theta": [1e4, 2e4, 3e4, 4e4, 5e4], "partial_rotary_factors": [0.5, 1.0, 1.0, 0.5, 0.5],
                 "swiglu_limits": [0, 0, 7, 7, 7], "swiglu_limits_shared": [16, 0, 0, 0, 0],
                 "rope_scaling": {"rope_type": "llama3", "factor": 2.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                 "query_pre_attn_scalar": 64, "moe_router_scaling_factor": 3.0}),
    ("step3p5", {"rope_theta": 3e4, "mlp_layer_types": ["sparse"] * 4, "num_sliding_attention_heads": 16,
                 "layer_types": ["sliding_attention"] * 4, "sliding_window": 16}),
    ("step3p5", {"layer_types": ["sliding_attention", "full_attention"] * 2, "sliding_window": 16,
                 "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 1e3,
                                                           "partial_rotary_factor": 0.5}}}),
    ("step3p7", {"moe_layers_enum": "0,3", "num_nextn_predict_layers": 2, "swiglu_limits": [0, 1, 2, 3, 4, 5],
                 "layer_types": ["sliding_attention"] * 6, "sliding_window": 8}),
    ("afmoe", {"global_attn_every_n_layers": 3, "num_dense_layers": 2, "num_shared_experts": 1, "route_scale": 2.0,
               "sliding_window": 64, "num_key_value_heads": 2}),
    ("afmoe", {"layer_types": ["full_attention"] * 2 + ["sliding_attention"] * 2}),
    # Cohere2-MoE: a dense prefix by its own pattern (first_k_dense_replace is read, not kept), RMSNorms
    ("cohere2_moe", {"first_k_dense_replace": 3, "prefix_dense_sliding_window_pattern": 2, "sliding_window_pattern": 1,
                     "rms_norm_eps": 1e-6, "num_shared_experts": 2, "prefix_dense_intermediate_size": 48}),
    ("cohere2_moe", {"first_k_dense_replace": 1, "sliding_window": 64, "num_key_value_heads": 2, "layer_norm_eps": 1e-6}),
    # Solar-Open: a hub config's GLM-only fields are not read; the RoPE base given
    ("solar_open", {"first_k_dense_replace": 2, "use_qk_norm": True, "intermediate_size": 96, "rope_theta": 5e5,
                    "n_group": 2, "topk_group": 1, "num_local_experts": 16}),
    # Hy3: the hub's names; dense layers by mlp_layer_types; DeepSeek's routing switches are not read
    ("hy_v3", {"num_shared_experts": 2, "router_scaling_factor": 1.0, "mlp_bias": True, "num_local_experts": 16,
               "mlp_layer_types": ["dense", "dense", "sparse", "sparse"], "n_group": 4, "topk_group": 2,
               "norm_topk_prob": False, "n_shared_experts": 3, "routed_scaling_factor": 9.0}),
    # JetMoE: the hub's names; the file's num_attention_heads is not what transformers uses
    ("jetmoe", {"num_key_value_heads": 4, "num_experts_per_tok": 3, "num_local_experts": 6, "kv_channels": 16,
                "activation_function": "gelu", "num_attention_heads": 5, "rms_norm_eps": 1e-5}),
    # Sarvam-30B: the hub's names (attribute_map)
    ("sarvam_moe", {"num_experts": 16, "num_shared_experts": 2, "use_qkv_bias": True, "num_mtp_layers": 1,
                    "first_k_dense_replace": 2, "use_qk_norm": False, "rope_theta": 1e6}),
    # Laguna: sliding layers, RoPE dicts without a partial factor (1), Qwen2-MoE's routing fields not read
    ("laguna", {"layer_types": ["sliding_attention", "full_attention"] * 2, "sliding_window": 64,
                "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e3}},
                "num_attention_heads_per_layer": [8, 16, 8, 16], "norm_topk_prob": False,
                "moe_routed_scaling_factor": 2.0, "routed_scaling_factor": 5.0, "mlp_layer_types": ["sparse"] * 4}),
    # Mellum 2: sliding layers with their RoPEs, dense layers, an MTP layer (not loaded), Qwen3's switches not read
    ("mellum", {"layer_types": ["sliding_attention", "full_attention"] * 2, "sliding_window": 64,
                "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e3}},
                "mlp_layer_types": ["dense", "sparse", "dense", "sparse"], "num_mtp_layers": 1,
                "use_sliding_window": False, "mlp_only_layers": [1], "decoder_sparse_step": 2, "intermediate_size": 96}),
    # Kolibri-1: a pattern of its own; Qwen3's dense-layer switches and attention bias are not read
    ("kolibri1", {"layer_types": ["full_attention", "sliding_attention"] * 2, "sliding_window": 64,
                  "mlp_only_layers": [0], "decoder_sparse_step": 2, "attention_bias": True, "intermediate_size": 96,
                  "norm_topk_prob": True, "num_key_value_heads": 2}),
    # Beam: RoPE on the full layers too, its own layer and MLP patterns, no softcap, Qwen3's switches not read
    ("beam", {"layer_types": ["full_attention", "sliding_attention"] * 2, "sliding_window": 64,
              "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 1e3}},
              "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"], "final_logit_softcapping": None,
              "n_group": 2, "topk_group": 1, "mlp_only_layers": [1], "decoder_sparse_step": 2}),
    ("beam", {"num_hidden_layers": 2}),   # fewer layers than the dense prefix: all dense; the last layer full
    # ZAYA1: sliding kinds, RoPE dicts by ZAYA's names (a missing partial factor: 1)
    ("zaya", {"layer_types": ["hybrid_sliding", "hybrid"] * 2, "sliding_window": 64, "cca_time0": 3,
              "rope_parameters": {"hybrid": {"rope_type": "default", "rope_theta": 1e6},
                                  "hybrid_sliding": {"rope_type": "default", "rope_theta": 1e3,
                                                     "partial_rotary_factor": 0.25}},
              "router_hidden_size": 32, "lm_head_bias": True}),
    # Doge: a window on every layer, the CDMoE switch (parsed; the model refuses it), GQA
    ("doge", {"sliding_window": 64, "keep_window_size": 16, "num_key_value_heads": 2, "mlp_bias": True}),
    ("doge", {"is_moe": True, "num_experts": 64, "num_experts_per_tok": 4, "intermediate_size": 96}),
    # Aria: its names, the generic expert names not read
    ("aria_text", {"moe_num_experts": 16, "moe_topk": 4, "moe_num_shared_experts": 1, "num_experts": 3,
                   "num_experts_per_tok": 1, "mlp_bias": True, "num_key_value_heads": 2, "head_dim": 16}),
    ("aria", {"moe_num_experts": 4, "moe_topk": 1, "rope_theta": 5e5}),
    # Lara-4-Mini: its own layer kinds; Qwen3-Next's dense-layer fields are not read (every layer MoE)
    ("lara_mini", {"layer_types": ["sliding_attention", "linear_attention", "full_attention", "linear_attention"],
                   "intermediate_size": 96, "decoder_sparse_step": 2, "mlp_only_layers": [0], "norm_topk_prob": False}),
    # Inkling: the hub's names (sconv_kernel_size, model_max_length, dense_intermediate_size, dense_mlp_idx)
    ("inkling_text", {"sconv_kernel_size": 2, "model_max_length": 512, "dense_intermediate_size": 32,
                      "intermediate_size": 16, "dense_mlp_idx": 2, "local_layer_ids": [1, 2], "sliding_window": 64}),
    # Inkling-2: the config class's other names; layer kinds given; fields it does not read (dense MLP kinds)
    ("inkling2_text", {"sconv_kernel_size": 2, "model_max_length": 512, "intermediate_size": 32,
                       "routed_scaling_factor": 3.0, "sliding_window": 64, "mlp_layer_types": ["dense"] * 4,
                       "layer_types": ["hybrid", "hybrid_sliding"] * 2, "n_layers_per_attn_res_block": 3}),
    # Inkling-2-Loop: the hub's loop_config wins over the flat loop fields
    ("inkling2_loop_text", {"num_hidden_layers": 12, "loop_config": {"core_start": 6, "core_end": 12, "num_passes": 2,
                                                                     "gate_rank": 8}, "loop_num_passes": 4}),
    # ERNIE-4.5-VL: its own expert widths and names, another RoPE base with an mrope_section
    ("ernie4_5_vl_moe", {"moe_intermediate_size": [32, 16], "moe_num_experts": 8, "moe_k": 2,
                         "moe_num_shared_experts": 1, "mlp_layer_types": ["dense", "dense", "sparse", "sparse"],
                         "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 2, 4]}}),
    # Gemma 4: the MoE, keys as values with their own KV heads and head size on the full layers, KV-shared last layers
    ("gemma4_text", {"enable_moe_block": True, "num_experts": 8, "top_k_experts": 2, "moe_intermediate_size": 16,
                     "attention_k_eq_v": True, "num_global_key_value_heads": 2, "global_head_dim": 32,
                     "num_kv_shared_layers": 2, "layer_types": ["full_attention", "sliding_attention",
                                                                "sliding_attention", "full_attention"]}),
    ("gemma4", {"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                    "full_attention": {"rope_type": "proportional", "rope_theta": 1e4}},
                "hidden_activation": "gelu", "final_logit_softcapping": 30.0, "hidden_size_per_layer_input": 0,
                "sliding_window": 16, "tie_word_embeddings": False}),
    ("cohere2_moe", {"layer_types": ["sliding_attention"] * 4, "mlp_layer_types": ["dense", "sparse", "dense", "sparse"]}),
    ("jamba", {"attn_layer_period": 2, "attn_layer_offset": 0, "expert_layer_period": 4, "expert_layer_offset": 3,
               "mamba_dt_rank": 7, "mamba_expand": 3, "mamba_d_state": 4, "mamba_conv_bias": False}),
    ("jamba", {"num_experts": 1, "num_experts_per_tok": 1}),             # one expert: every MLP dense
    # Nemotron-H, the hub's way: a pattern (its length is the layer count) and mamba_* names that win
    ("nemotron_h", {"hybrid_override_pattern": "M*EM-", "mamba_n_groups": 4, "n_groups": 2, "mamba_dt_min": 0.01,
                    "mamba_d_conv": 3, "mamba_chunk_size": 64, "mamba_conv_bias": False, "n_routed_experts": 16,
                    "mamba_num_heads": 8, "mamba_head_dim": 8}),
    ("nemotron_h", {"layers_block_type": ["mamba", "attention", "moe"], "layer_norm_epsilon": 1e-6}),
    ("nemotron_h", {"tie_word_embeddings": True}),                       # never tied
    # ... inside its wrappers (the hub's names in text_config; never tied, at either level)
    ("nemotron_h_omni", {"hybrid_override_pattern": "ME*-", "mamba_n_groups": 4, "mamba_dt_min": 0.01,
                         "tie_word_embeddings": True}),
    ("nemo_speechlm", {"hybrid_override_pattern": "MEM*E", "n_routed_experts": 16, "num_experts_per_tok": 4,
                       "routed_scaling_factor": 2.5, "tie_word_embeddings": True}),
    ("minimax", {"sliding_window": 64, "block_size": 32, "mlp_alpha_factor": 0.5, "head_dim": 16,
                 "layer_types": ["linear_attention"] * 3 + ["full_attention"]}),
    # Ling-3, the hub's way: its names, a group size of 2, an explicit mlp_layer_types, MTP layers
    ("bailing_hybrid", {"num_experts_per_token": 2, "num_experts": 8, "num_expert_group": 2, "topk_group": 1,
                        "num_shared_experts": 2,
                        "moe_renormalize": False, "model_max_length": 512, "layer_group_size": 2, "head_dim": 32,
                        "short_conv_kernel_size": 3, "num_mtp_layers": 2, "kda_safe_gate": False,
                        "mlp_layer_types": ["sparse", "dense", "sparse", "sparse"], "rope_theta": 1e5}),
    # MiniMax-M3, the hub's way: sparse_attention_config (its names win over the flat ones) and moe_layer_freq
    ("minimax_m3_vl_text", {"sparse_attention_config": {"sparse_attention_freq": [0, 1, 1, 0], "sparse_num_index_heads": 2,
                                                        "sparse_index_dim": 64, "sparse_block_size": 32,
                                                        "sparse_topk_blocks": 4, "sparse_local_block": 2},
                            "moe_layer_freq": [0, 1, 1, 1], "index_n_heads": 8, "hidden_act": "gelu"}),
    # LFM2-MoE, the hub's way: tie_embedding wins, norm_eps, a route scale, no expert bias
    ("lfm2_moe", {"tie_embedding": False, "norm_eps": 1e-6, "routed_scaling_factor": 2.5, "use_expert_bias": False,
                  "num_dense_layers": 1, "conv_L_cache": 4, "conv_bias": True}),
    # the hub's names (layers_block_type, legacy 'mamba' / 'attention'), RoPE, a time-step limit, no experts
    ("granitemoehybrid", {"layers_block_type": ["mamba", "attention", "mamba", "mamba"], "position_embedding_type": "rope",
                          "time_step_limit": [0.001, 100.0], "mamba_d_head": 16, "mamba_n_groups": 2,
                          "num_local_experts": 0, "shared_intermediate_size": 48}),
    # DeepSeek-V4: the hub's legacy names, its YaRN under rope_scaling; explicit kinds and a longer layer list
    ("deepseek_v4", {"compress_ratios": [0, 4, 128, 4], "num_hash_layers": 1, "compress_rate_csa": 8,
                     "qk_rope_head_dim": 128, "rope_theta": 5e4, "compress_rope_theta": 4e5,
                     "rope_scaling": {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4096,
                                      "beta_fast": 32, "beta_slow": 1}}),
    ("deepseek_v4", {"layer_types": ["sliding_attention", "compressed_sparse_attention"] * 3,
                     "mlp_layer_types": ["moe", "hash_moe", "moe", "moe"], "hc_mult": 2, "scoring_func": "sigmoid",
                     "compress_rates": {"compressed_sparse_attention": 2, "heavily_compressed_attention": 16},
                     "partial_rotary_factor": 0.25, "sliding_window": 32}),
    # GLM-5.3: the hub's linear_attn_config (nested sizes and decay bound win), 'full_attention' read as MLA
    ("glm5_next_text", {"linear_attn_config": {"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 3,
                                               "gate_lower_bound": None, "safe_gate": True},
                        "linear_head_dim": 32, "layer_types": ["full_attention", "linear_attention"] * 2,
                        "mlp_layer_types": ["sparse"] * 4, "hc_mult": 2, "index_kpool": 8, "index_topk": 64}),
    ("glm5_next", {"linear_lower_bound": None, "indexer_types": ["full", "shared", "full", "shared"],
                   "n_group": 2, "topk_group": 1}),
    # Mistral-Large-4: explicit RoPE layers and KV sharing, an interval for the default NoPE layers, the hub's YaRN
    ("mistral_large4_text", {"no_rope_layers": [1, 0, 1, 0], "kv_source_layers": [0, 1, 0, 1], "head_dim": 32,
                             "index_topk_pattern": "FFSF", "first_k_dense_replace": 2, "num_experts": 16}),
    ("mistral_large4", {"no_rope_layer_interval": 2, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6,
                                                                        "factor": 8.0,
                                                                        "original_max_position_embeddings": 4096}}),
    # Hy4: explicit indexer kinds and MLP kinds, hyper-connection sizes, a window-free YaRN
    ("hy_v4", {"indexer_types": ["full", "shared", "shared", "full"], "mlp_layer_types": ["sparse"] * 4, "hc_mult": 2,
               "hc_magnitude": 1.5, "num_key_value_heads": 2, "head_dim": 7, "index_topk_freq": 2}),
    ("hy_v4_vl", {"num_hidden_layers": 9, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5,
                                                              "mrope_section": [16, 8, 8]}}),
    # Sarvam-105B: the hub's names and its 'deepseek_yarn' rope_scaling
    ("sarvam_mla", {"num_experts": 16, "num_shared_experts": 2, "num_mtp_layers": 1, "head_dim": 576, "q_head_dim": 192,
                    "rope_theta": 5e4, "rope_scaling": {"type": "deepseek_yarn", "factor": 40.0,
                                                        "original_max_position_embeddings": 4096, "beta_fast": 32,
                                                        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}}),
    ("axk1", {"first_k_dense_replace": 2, "moe_layer_freq": 2, "num_hidden_layers": 6, "rope_interleave": False}),
    ("axk1", {"mlp_layer_types": ["sparse", "dense", "sparse", "dense"], "first_k_dense_replace": 3}),
    ("axk2", {"first_k_dense_replace": 0, "moe_layer_freq": 3, "n_group": 2, "topk_group": 2, "gated_norm_rank": 4}),
    # dots3_note: no DSA, no sliding layers, the hub's names, a per-layer moe_layer_freq, an explicit per-layer config
    ("dots3_note_text", {"use_dsa": False, "sliding_window_size": 64, "moe_layer_freq": [1, 0, 1, 1],
                         "swa_head_dim": 128, "swa_qk_nope_head_dim": 96, "swa_num_attention_heads": 4, "swa_num_key_value_heads": 4,
                         "swa_rope_theta": 1e4}),
    ("dots3_note_text", {"use_sliding_window": False, "first_k_dense_replace": 2, "rope_theta": 1e6}),
    ("dots3_note", {"layer_types": ["indexed_attention", "sliding_attention"] * 2, "sliding_window": 32,
                    "per_layer_config": {str(i): {"num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 64,
                                                  "qk_rope_head_dim": 32, "head_dim": 160} for i in (1, 3)}}),
    ("llama4", {"rope_scaling": {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                                 "original_max_position_embeddings": 8192}, "rope_theta": 5e5}),
    # Qwen4-Exp: 'full_attention' is its QSA-indexed attention; PLE layers (one-based, unsorted, repeated), its width
    # by default the hidden size; the output gate's own activation; layer kinds from full_attention_interval
    ("qwen4_exp_text", {"layer_types": ["linear_attention", "full_attention", "linear_attention", "indexed_attention"],
                        "ple_layer_ids": [3, 1, 3], "eos_token_id": [5, 6], "output_gate_type": "sigmoid"}),
    ("qwen4_exp", {"full_attention_interval": 2, "ple_layer_ids": [1], "eos_token_id": 2, "hc_count": 3,
                   "ngram_size": 4, "heads_per_ngram": 4, "ple_embed_dim": 48,
                   "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25}}),
    # Unlimited-OCR: the dense prefix from first_k_dense_replace, a full layer among reference sliding ones, no top-k
    ("unlimited_ocr", {"first_k_dense_replace": 2, "sliding_window": 16, "n_routed_experts": 8,
                       "layer_types": ["reference_sliding_attention", "full_attention"] * 2}),
    ("unlimited_ocr", {"mlp_layer_types": ["sparse", "dense", "sparse", "sparse"], "head_dim": 7,
                       "topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1}),
], ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}={v[k]}" for k in v))
def test_given_fields_derive_as_transformers(mt, extra):
    _compare(mt, {"model_type": mt, **SIZES, **FAMILIES[mt][1], **extra})


# ------------------------------------------------------------------------------ logits parity
def _drop(path, *names):
    """Delete fields from a saved config.json (the expert count under every alias)."""
    if "num_experts" in names:
        names = names + ("num_local_experts", "n_routed_experts")
    edit_config(path, **{n: None for n in names})


def _tiny_mixtral():
    # transformers' defaults: 8 experts, top-2, rms_norm_eps 1e-5
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None, eos_token_id=None))


def _tiny_gpt_oss():
    # transformers' defaults: rms_norm_eps 1e-5, swiglu_limit 7 (big gate/up weights make the clamp clip)
    return transformers.GptOssForCausalLM(transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
        max_position_embeddings=256, bos_token_id=None, eos_token_id=None))


def _tiny_qwen3():
    # transformers' defaults: 4 KV heads, 128 experts, top-8
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=8, num_hidden_layers=2, num_attention_heads=8,
        head_dim=16, max_position_embeddings=256, bos_token_id=None, eos_token_id=None))


def _tiny_qwen3_next():
    # transformers' defaults: layer_types from full_attention_interval 4, conv kernel 4, norm_topk_prob
    return transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, num_hidden_layers=4, num_attention_heads=4, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        num_experts=8, num_experts_per_tok=2, max_position_embeddings=256, bos_token_id=None, eos_token_id=None))


PARITY = {
    # name: (build the transformers model, how to randomize it, the fields config.json loses)
    "mixtral": (_tiny_mixtral, {}, ("rms_norm_eps", "num_experts", "num_experts_per_tok")),
    "gpt_oss": (_tiny_gpt_oss, {"experts.gate_up_proj": 0.5, "experts.down_proj": 0.05, "sinks": 1.0},
                ("rms_norm_eps", "swiglu_limit")),
    "qwen3_moe": (_tiny_qwen3, {}, ("num_key_value_heads", "num_experts", "num_experts_per_tok")),
    # (a small lm_head: see tests/test_models_qwen3_next.py's SCALES)
    "qwen3_next": (_tiny_qwen3_next, {"lm_head": 0.05},
                   ("layer_types", "linear_conv_kernel_dim", "norm_topk_prob", "num_key_value_heads")),
}
# weights where transformers' own fp32 logits are within 1e-4 of its fp64 ones (with seed 2 this tiny
# Qwen3-Next's are 2.5e-4 apart: rounding, amplified by the random layers, not a default)
SEEDS = {"qwen3_next": 4}


@pytest.mark.parametrize("name", sorted(PARITY))
def test_logits_without_defaulted_fields(name, tmp_path):
    build, scales, dropped = PARITY[name]
    torch.manual_seed(0)
    hf = build().eval()
    randomize_(hf, seed=SEEDS.get(name, 2), scales=scales)
    path = save_tiny(hf, tmp_path / name)
    _drop(path, *dropped)
    ours = dm.load(path, progress=False)
    check_logits(hf, ours, ids())


DEEPSEEK_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=8,
                     num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                     bos_token_id=None, eos_token_id=None, first_k_dense_replace=1)
MLA_PARITY = {
    # GLM-4.5: rms_norm_eps 1e-5, 128 experts, top-8
    "glm4_moe": ("Glm4MoeForCausalLM", "Glm4MoeConfig", dict(num_key_value_heads=2, head_dim=16),
                 ("rms_norm_eps", "num_experts", "num_experts_per_tok")),
    # GLM-5: rms_norm_eps 1e-5 (16 index heads: with few, exact-zero scores tie at the top-k boundary, where
    # transformers' torch.topk keeps arbitrary keys and dynamoe the earliest -- dynamoe.models.indexer.keep_top)
    "glm_moe_dsa": ("GlmMoeDsaForCausalLM", "GlmMoeDsaConfig",
                    dict(**MLA, n_routed_experts=8, num_experts_per_tok=2, index_topk=8, index_head_dim=16,
                         index_n_heads=16), ("rms_norm_eps",)),
    # DeepSeek-V3: 256 experts in 8 groups (4 eligible), top-8
    "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(**MLA), ("num_experts", "num_experts_per_tok")),
}


@pytest.mark.parametrize("name", sorted(MLA_PARITY))
def test_deepseek_like_logits_without_defaulted_fields(name, tmp_path):
    model_cls, config_cls, sizes, dropped = MLA_PARITY[name]
    hf, path = make_pair(getattr(transformers, model_cls),
                         getattr(transformers, config_cls)(**{**DEEPSEEK_BASE, **sizes}), tmp_path / name)
    _drop(path, *dropped)
    check_logits(hf, dm.load(path, progress=False), ids())
