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
}
# wrapper model_type -> the sub-config keys down to its text model's config
WRAPPED = {"qwen3_5_moe": ("text_config",), "qwen3_vl_moe": ("text_config",), "glm4v_moe": ("text_config",),
           "qwen3_omni_moe_thinker": ("text_config",), "qwen3_omni_moe": ("thinker_config", "text_config"),
           "llama4": ("text_config",), "step3p7": ("text_config",), "glm5_next": ("text_config",),
           "mistral_large4": ("text_config",), "hy_v4_vl": ("text_config",), "dots3_note": ("text_config",)}
STEP = {"step3p5", "step3p7"}
GLM5 = {"glm5_next_text", "glm5_next"}
ML4 = {"mistral_large4_text", "mistral_large4"}
HY4 = {"hy_v4", "hy_v4_vl_text", "hy_v4_vl"}
DOTS3 = {"dots3_note_text", "dots3_note"}
LLAMA4 = {"llama4_text", "llama4"}
QWEN3_RULE = {"qwen3_moe", "qwen2_moe", "qwen3_next", "qwen3_vl_moe", "qwen3_vl_moe_text", "qwen3_omni_moe_thinker",
              "qwen3_omni_moe", "flint"}
HYBRID = {"qwen3_next", "qwen3_5_moe_text", "qwen3_5_moe"}
DEEPSEEK_LIKE = {"deepseek_v2", "deepseek_v3", "kimi_k2", "glm4_moe", "glm4_moe_lite", "deepseek_v32", "glm_moe_dsa",
                 "dots1", "glm4v_moe", "glm4v_moe_text", "sarvam_mla"}
MLA_FAMILIES = ((DEEPSEEK_LIKE - {"glm4_moe", "dots1", "glm4v_moe", "glm4v_moe_text"})
                | {"kimi_linear", "mistral4", "longcat_flash", "axk1", "axk2"} | GLM5 | HY4 | DOTS3)
# DeepSeek-V3's routing fields under these families' own config classes
DEEPSEEK_ROUTING = DEEPSEEK_LIKE | {"kimi_linear", "mimo_v2_flash", "mistral4", "axk1", "axk2"} | GLM5 | HY4 | DOTS3
# no single rope_parameters dict: Kimi-Linear has no RoPE, MiMo-V2-Flash one per layer type
NO_SINGLE_ROPE = {"kimi_linear", "mimo_v2_flash", "deepseek_v4"} | STEP | GLM5 | DOTS3
ROPE_PER_LAYER_TYPE = {"mimo_v2_flash", "deepseek_v4"} | STEP | DOTS3
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


def _glm5(cfg):
    from dynamoe.models.glm5_next import glm5_fields

    return glm5_fields(cfg)


def _v4(cfg):
    from dynamoe.models.deepseek_v4 import v4_fields

    return v4_fields(cfg)


def _hf_moe_layers(hf, mt):
    """Which layers have routed experts, by each transformers modeling file's rule."""
    n = hf.num_layers if mt == "longcat_flash" else hf.num_hidden_layers
    if mt in QWEN3_RULE:
        return [i not in hf.mlp_only_layers and hf.num_experts > 0 and (i + 1) % hf.decoder_sparse_step == 0
                for i in range(n)]
    if mt in ("mixtral", "gpt_oss", "olmoe", "minimax_m2", "granitemoe", "granitemoeshared", "granitemoe_swa", "flex_olmo",
              "hunyuan_v1_moe", "dbrx", "qwen3_5_moe_text", "qwen3_5_moe", "phimoe", "longcat_flash"):
        return [True] * n
    if mt == "ernie4_5_moe":
        return [(i + 1) % hf.moe_layer_interval == 0 and hf.moe_layer_start_index <= i <= hf.moe_layer_end_index
                for i in range(n)]
    if mt in LLAMA4:
        return [i in hf.moe_layers for i in range(n)]
    if mt in ("deepseek_v32", "glm_moe_dsa", "glm4_moe_lite", "exaone_moe", "kimi_linear", "mimo_v2_flash", "step3p5",
              "step3p7") or mt in GLM5:
        return [t == "sparse" for t in hf.mlp_layer_types]
    if mt == "afmoe":
        return [i >= hf.num_dense_layers for i in range(n)]
    if mt in ML4 | HY4 | DOTS3 | {"axk1", "axk2"}:
        return [t == "sparse" for t in hf.mlp_layer_types]
    if mt == "deepseek_v4":  # (hash-routed or not, every layer is MoE)
        return [True] * n
    return [i >= hf.first_k_dense_replace for i in range(n)]


def _hf_windows(hf, mt):
    """The sliding window of each layer (None: full attention), as the modeling files read it."""
    n = hf.num_layers if mt == "longcat_flash" else hf.num_hidden_layers
    if mt in ("qwen3_moe", "mixtral", "phimoe", "deepseek_v4"):  # (V4's compressed layers slide too)
        return [hf.sliding_window] * n
    if mt in ("gpt_oss", "qwen2_moe", "dots1", "exaone_moe", "mimo_v2_flash", "flint", "granitemoe_swa", "step3p5",
              "step3p7", "afmoe") or mt in DOTS3:
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
    "num_attention_heads": (lambda hf, mt: hf.num_attention_heads, None, None),
    # MLA ignores it (keys and values have a head per query head)
    "num_key_value_heads": (lambda hf, mt: hf.num_key_value_heads, None, GQA_FAMILIES),
    # the modeling files: getattr(config, "head_dim", None) or hidden // heads; MLA configs set qk_rope_head_dim
    "head_dim": (lambda hf, mt: getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads, None, None),
    "max_position_embeddings": (lambda hf, mt: hf.max_position_embeddings, None, None),
    # DBRX's LayerNorms: torch's default eps (its config has no field)
    "rms_norm_eps": (lambda hf, mt: 1e-5 if mt == "dbrx" else hf.rms_norm_eps, None, None),
    "rope": (lambda hf, mt: _hf_rope(hf), lambda cfg: _our_rope(cfg), set(FAMILIES) - NO_SINGLE_ROPE),
    # (MiMo's modeling code reads each layer type's partial_rotary_factor with a default of 0.334, Step's of 1)
    "rope_by_layer_type": (lambda hf, mt: {k: {**_hf_rope(p), "partial_rotary_factor": p.get(
                                               "partial_rotary_factor", 0.334 if mt == "mimo_v2_flash" else 1.0)}
                                           for k, p in hf.rope_parameters.items()},
                           lambda cfg: {k: _our_rope(r) for k, r in cfg.rope_by_layer_type}, ROPE_PER_LAYER_TYPE),
    "hidden_act": (lambda hf, mt: hf.hidden_act, None, set(FAMILIES) - {"gpt_oss", "dbrx"}),  # GPT-OSS: its own SwiGLU
    # DBRX: clip_qkv in attn_config
    "clip_qkv_dbrx": (lambda hf, mt: hf.attn_config.clip_qkv, lambda cfg: cfg.clip_qkv, {"dbrx"}),
    "tie_word_embeddings": (lambda hf, mt: hf.tie_word_embeddings, None, None),
    # Mixtral's attention has no biases (and no attention_bias field)
    "attention_bias": (lambda hf, mt: getattr(hf, "attention_bias", False), None, None),
    "layer_windows": (lambda hf, mt: _hf_windows(hf, mt),
                      lambda cfg: [cfg.layer_sliding_window(i) for i in range(cfg.num_hidden_layers)], None),
    "num_experts": (lambda hf, mt: hf.ffn_config.moe_num_experts if mt == "dbrx" else
                    next(getattr(hf, k) for k in ("num_local_experts", "num_experts", "n_routed_experts") if hasattr(hf, k)),
                    None, None),
    "num_experts_per_tok": (lambda hf, mt: hf.moe_topk if mt == "hunyuan_v1_moe" else hf.ffn_config.moe_top_k
                            if mt == "dbrx" else hf.num_experts_per_tok, None, None),
    # Mixtral and GPT-OSS size their experts with intermediate_size
    "expert_hidden_size": (lambda hf, mt: hf.ffn_config.ffn_hidden_size if mt == "dbrx" else hf.intermediate_size if mt in {"mixtral", "gpt_oss", "olmoe", "minimax_m2",
                                                                          "granitemoe", "granitemoeshared", "granitemoe_swa", "flex_olmo",
                                                                          "hunyuan_v1_moe", "phimoe"} | LLAMA4
                           else hf.moe_intermediate_size, None, None),
    "moe_layers": (lambda hf, mt: _hf_moe_layers(hf, mt),
                   lambda cfg: [cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)], None),
    "bos_token_id": (lambda hf, mt: hf.bos_token_id, None, None),
    "eos_token_id": (lambda hf, mt: _eos(hf.eos_token_id), None, None),
    "pad_token_id": (lambda hf, mt: hf.pad_token_id, None, None),
    # Qwen3-MoE
    "norm_topk_prob": (lambda hf, mt: hf.norm_topk_prob, None, {"qwen3_moe", "qwen2_moe", "olmoe", "flex_olmo",
                                                                  "qwen3_next", "qwen3_omni_moe_thinker", "qwen3_omni_moe", "flint"}
                       | DEEPSEEK_ROUTING),
    # Qwen3-VL-MoE's router has no norm_topk_prob: it always renormalises
    "norm_topk_prob_vl": (lambda hf, mt: True, lambda cfg: cfg.norm_topk_prob, {"qwen3_vl_moe", "qwen3_vl_moe_text"}),
    # GraniteMoE (a shared MLP only in granitemoeshared, and only when its size is > 0)
    **{name: (lambda hf, mt, name=name: getattr(hf, name), None, {"granitemoe", "granitemoeshared", "granitemoe_swa"})
       for name in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")},
    "shared_expert_intermediate_size": (lambda hf, mt: hf.shared_expert_intermediate_size if mt in {"qwen2_moe", "flint"} | HYBRID
                                        else hf.shared_intermediate_size or None, None,
                                        {"qwen2_moe", "granitemoeshared", "flint", "granitemoe_swa"} | HYBRID),
    # K-EXAONE: DeepSeek routing, shared experts under their own name
    # (keys of their own: the DeepSeek entries above keep theirs)
    **{f"{name}_exaone": (lambda hf, mt, name=name: getattr(hf, name), lambda cfg, name=name: getattr(cfg, name),
                          {"exaone_moe"})
       for name in ("n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob")},
    "n_shared_experts_exaone": (lambda hf, mt: hf.num_shared_experts, lambda cfg: cfg.n_shared_experts, {"exaone_moe"}),
    # ERNIE-4.5 (shared experts under its own name)
    "n_shared_experts_ernie": (lambda hf, mt: hf.moe_num_shared_experts, lambda cfg: cfg.n_shared_experts, {"ernie4_5_moe"}),
    # OLMoE
    "clip_qkv": (lambda hf, mt: hf.clip_qkv, None, {"olmoe"}),
    "decoder_sparse_step": (lambda hf, mt: hf.decoder_sparse_step, None, QWEN3_RULE),
    "mlp_only_layers": (lambda hf, mt: tuple(hf.mlp_only_layers), None, QWEN3_RULE),
    # Qwen3-Next / Qwen3.5-MoE: layer kinds (from full_attention_interval), Gated DeltaNet sizes
    "layer_types": (lambda hf, mt: tuple(hf.layer_types), None,
                    HYBRID | {"kimi_linear", "mimo_v2_flash", "flint", "granitemoe_swa", "afmoe", "deepseek_v4"} | LLAMA4
                    | STEP | GLM5 | DOTS3),
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
    "intermediate_size": (lambda hf, mt: hf.intermediate_size, None, {"qwen3_next"} | set(WRAPPED) - {"qwen3_5_moe"}
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
    "topk_method": (lambda hf, mt: hf.topk_method, None, {"deepseek_v2"}),
    "routed_scaling_factor": (lambda hf, mt: hf.routed_scaling_factor, None, DEEPSEEK_ROUTING),
    # MiMo-V2-Flash has no shared experts (and no such field)
    "n_shared_experts": (lambda hf, mt: getattr(hf, "n_shared_experts", 0), None, DEEPSEEK_ROUTING),
    "first_k_dense_replace": (lambda hf, mt: hf.first_k_dense_replace, None,
                              (DEEPSEEK_LIKE - {"glm4_moe_lite"}) | {"mistral4"}),
    "use_qk_norm": (lambda hf, mt: hf.use_qk_norm, None, {"glm4_moe"}),
    "num_nextn_predict_layers": (lambda hf, mt: hf.num_nextn_predict_layers, None,
                                 {"deepseek_v3", "kimi_k2", "glm4_moe", "sarvam_mla"}),
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
    # GLM-5.3: the clamp, the dense MLPs' width, hyper-connections, KDA's decay bound, the indexer's pools
    "swiglu_limit_glm5": (lambda hf, mt: hf.swiglu_limit, lambda cfg: cfg.swiglu_limit, GLM5),
    "intermediate_size_glm5": (lambda hf, mt: hf.intermediate_size, lambda cfg: cfg.intermediate_size, GLM5),
    **{f"{name}_glm5": (lambda hf, mt, name=name: getattr(hf, name), lambda cfg, name=name: getattr(_glm5(cfg), name),
                        GLM5)
       for name in ("hc_mult", "hc_sinkhorn_iters", "hc_eps", "linear_lower_bound", "index_kpool")},
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
    if mt in STEP | DOTS3:  # (head counts vary by layer: the global one is the full layers'; step_heads /
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
    # GLM-5: rms_norm_eps 1e-5
    "glm_moe_dsa": ("GlmMoeDsaForCausalLM", "GlmMoeDsaConfig",
                    dict(**MLA, n_routed_experts=8, num_experts_per_tok=2, index_topk=8, index_head_dim=16,
                         index_n_heads=4), ("rms_norm_eps",)),
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
