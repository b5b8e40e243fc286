"""MoE ``model_type``\\ s of transformers that dynamoe does not load, each with the reason.

:meth:`dynamoe.models.ModelConfig.from_dict` refuses these before it parses a single field, with a
ValueError ``"<model_type>: <reason>"`` -- instead of whatever a parser written for another family
would trip over first (a missing ``hidden_size`` in a vision wrapper, ``layer_types`` of a hybrid).
A family registered in :mod:`dynamoe.models.registry` is never refused (registering one of these
replaces its entry). tests/test_models_moe_coverage.py walks the installed transformers and fails
for an MoE model_type that is neither registered nor listed here.

Kinds of entries: multimodal wrappers (their ``text_config`` holds the language model), text models
of wrappers, encoder-decoder or non-causal models, hybrids with recurrent / linear-attention
layers, and decoder-only families whose building blocks are not implemented yet (named per entry).
"""
from __future__ import annotations

__all__ = ["UNSUPPORTED", "refusal"]

_VLM = ("a multimodal (vision-language) wrapper around a language model in text_config whose text model dynamoe does "
        "not load (see the entry of its text model type)")
_OMNI = "a multimodal (audio / vision / speech) wrapper whose text model dynamoe does not load"


def _text_of(wrapper: str, what: str) -> str:
    return f"the language model of the {wrapper} wrapper, not implemented yet: {what}"


#: model_type -> why it does not load (kept sorted)
UNSUPPORTED: dict[str, str] = {
    "aria": _VLM,
    "aria_text": _text_of("aria", "the MoE text model's expert and shared-expert layout is not ported"),
    "bailing_hybrid": "Ling hybrid (bailing_hybrid) mixes MLA with linear-attention / convolution layers: "
                      "recurrent layers are not supported yet",
    "beam": "Beam is not implemented yet: per-layer mlp_layer_types and attention layer_types of its own",
    "cohere2_moe": "Cohere2-MoE is not implemented yet: one norm feeding attention and MLP in parallel (one residual), "
                   "dense/sparse mlp_layer_types, a sliding-window layer pattern and logit_scale",
    "deepseek_ocr2": _VLM,
    "deepseek_ocr2_text": _text_of("deepseek_ocr2", "the OCR model's text decoder is not ported"),
    "diffusion_gemma": _VLM + " (and a diffusion, not autoregressive, decoder)",
    "diffusion_gemma_text": "a bidirectional diffusion language model, not an autoregressive causal LM",
    "doge": "Doge is not implemented yet: dynamic-mask attention (keep_window_size) and CDMoE "
            "(cross-domain MoE with product-key expert retrieval)",
    "dots3_note_vision_encoder": "a vision encoder (part of dots3_note), not a causal LM",
    "ernie4_5_vl_moe": _VLM,
    "ernie4_5_vl_moe_text": _text_of("ernie4_5_vl_moe", "each MoE layer holds separate text and vision expert groups "
                                     "of different sizes with their own routers; text routes through the text group "
                                     "alone, but the checkpoint keeps both groups in one expert list (and one selection "
                                     "bias) that the loader would have to split"),
    "gemma4": _VLM,
    "gemma4_text": _text_of("gemma4", "per-layer embeddings, sliding/global layers and MoE beside a dense MLP"),
    "granitemoehybrid": "GraniteMoE-Hybrid mixes Mamba-2 layers with attention: state-space layers are not "
                        "supported yet",
    "hy_v3": "Hy3 is not implemented yet: its router_scaling_factor routing and layer kinds",
    "inkling2": _VLM,
    "inkling2_loop": _VLM,
    "inkling2_loop_text": _text_of("inkling2_loop", "short-convolution layers with looped blocks and sinks"),
    "inkling2_text": _text_of("inkling2", "short-convolution layers, sliding windows and sinks"),
    "inkling_mm_model": _VLM,
    "inkling_text": _text_of("inkling", "short-convolution layers and multi-token prediction"),
    "jamba": "Jamba mixes Mamba layers with attention: state-space layers are not supported yet",
    "jetmoe": "JetMoE is not implemented yet: mixture-of-attention-heads (MoA) experts in attention",
    "kolibri1": "Kolibri-1 is not implemented yet: sliding/full attention layer pattern of its own",
    "laguna": "Laguna is not implemented yet: softplus output gates on attention (gating) and its layer kinds",
    "lara_mini": "Lara mixes Gated DeltaNet linear attention with full attention: not implemented yet (the Gated "
                 "DeltaNet layers exist, for qwen3_next; its own layer kinds and blocks are not ported)",
    "lfm2_moe": "LFM2-MoE mixes short-convolution layers with attention: convolution layers are not supported yet",
    "mellum": "Mellum is not implemented yet: per-layer mlp_layer_types with its attention layer kinds",
    "minimax": "MiniMax-Text-01 mixes lightning attention (linear attention with a fixed per-head decay) with "
               "softmax attention: lightning-attention layers are not implemented yet (dynamoe has Gated DeltaNet "
               "and Kimi Delta Attention, not lightning attention)",
    "minimax_m3_vl": _VLM,
    "minimax_m3_vl_text": _text_of("minimax_m3_vl", "lightning (linear) attention layers"),
    "muse_spark": _OMNI,
    "muse_spark_text": _text_of("muse_spark", "its convolution and sliding layer kinds"),
    "nemo_speechlm": _OMNI + " (its default language model is Nemotron-H, a Mamba-2 hybrid)",
    "nemotron_h": "Nemotron-H mixes Mamba-2 layers with attention: state-space layers are not supported yet",
    "nemotron_h_omni": _OMNI + " (its language model is Nemotron-H, a Mamba-2 hybrid)",
    "nllb-moe": "NLLB-MoE is an encoder-decoder translation model, not a decoder-only causal LM",
    "openai_privacy_filter": "a bidirectional token classifier, not a causal LM",
    "qwen3_omni_moe_talker_text": "the speech talker of Qwen3-Omni, not a text causal LM",
    "qwen4_exp": _VLM,
    "qwen4_exp_text": _text_of("qwen4_exp", "its layer kinds"),
    "sarvam_moe": "Sarvam-30B is not implemented yet: its routing and multi-token-prediction layout",
    "solar_open": "Solar-Open is not implemented yet: its DeepSeek-like routing and attention",
    "switch_transformers": "Switch Transformers is an encoder-decoder (T5) model, not a decoder-only causal LM",
    "unlimited_ocr": _VLM,
    "unlimited_ocr_text": _text_of("unlimited_ocr", "the OCR model's text decoder is not ported"),
    "vitpose": "a pose-estimation vision model, not a causal LM",
    "vitpose_backbone": "a vision backbone (ViTPose), not a causal LM",
    "zaya": "ZAYA1 is not implemented yet: CCA attention projections, residual scaling and an MLP router",
}


def refusal(model_type: str):
    """Why ``model_type`` does not load (a sentence), or None when it is not refused: not listed, or
    registered since (a family in :mod:`dynamoe.models.registry` wins over the list)."""
    reason = UNSUPPORTED.get(model_type)
    if reason is None:
        return None
    from .registry import is_registered   # (registry imports config, which imports this module)

    return None if is_registered(model_type) else reason
