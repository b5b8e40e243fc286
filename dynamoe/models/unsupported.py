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
    "deepseek_ocr2_text": ("the base language model of DeepSeek-OCR-2 (DeepseekOcr2TextModel: transformers has no causal "
                           "LM with a head for it); its multimodal checkpoints (model_type 'deepseek_ocr2') load, text only"),
    "diffusion_gemma": _VLM + " (and a diffusion, not autoregressive, decoder)",
    "diffusion_gemma_text": "a bidirectional diffusion language model, not an autoregressive causal LM",
    "dots3_note_vision_encoder": "a vision encoder (part of dots3_note), not a causal LM",
    "ernie4_5_vl_moe_text": ("the base language model of ERNIE-4.5-VL (Ernie4_5_VLMoeTextModel: transformers has no "
                             "causal LM with a head for it, and saves it without one); its multimodal checkpoints "
                             "(model_type 'ernie4_5_vl_moe') load, text only"),
    "muse_spark_text": ("the base language model of Muse Spark (MuseSparkTextModel: transformers has no causal LM with "
                        "a head for it); its multimodal checkpoints (model_type 'muse_spark') load, text only"),
    "nllb-moe": "NLLB-MoE is an encoder-decoder translation model, not a decoder-only causal LM",
    "openai_privacy_filter": "a bidirectional token classifier, not a causal LM",
    "qwen3_omni_moe_talker_text": "the speech talker of Qwen3-Omni, not a text causal LM",
    "switch_transformers": "Switch Transformers is an encoder-decoder (T5) model, not a decoder-only causal LM",
    "unlimited_ocr_text": ("the base language model of Unlimited-OCR (UnlimitedOcrTextModel: transformers has no causal "
                           "LM with a head for it); its multimodal checkpoints (model_type 'unlimited_ocr') load, text only"),
    "vitpose": "a pose-estimation vision model, not a causal LM",
    "vitpose_backbone": "a vision backbone (ViTPose), not a causal LM",
}


def refusal(model_type: str):
    """Why ``model_type`` does not load (a sentence), or None when it is not refused: not listed, or
    registered since (a family in :mod:`dynamoe.models.registry` wins over the list)."""
    reason = UNSUPPORTED.get(model_type)
    if reason is None:
        return None
    from .registry import is_registered   # (registry imports config, which imports this module)

    return None if is_registered(model_type) else reason
