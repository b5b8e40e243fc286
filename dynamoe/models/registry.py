"""Model families by ``model_type`` (and by ``architectures``, for configs whose model_type we do
not know under that name).

Extension point: ``register("deepseek_v2", "dynamoe.models.deepseek_v2:DeepseekV2ForCausalLM", ("DeepseekV2ForCausalLM",))
register("deepseek_v3", "dynamoe.models.deepseek_v3:DeepseekV3ForCausalLM",
architectures=("DeepseekV3ForCausalLM",), aliases=("kimi_k2",))``. A target is a ``"module:attr"``
string, imported on first use (so importing dynamoe.models stays cheap), or the class itself: any
callable ``(ModelConfig, dtype=...) -> CausalLM``.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Union

from .config import ModelConfig

__all__ = ["register", "family_for", "builder_for", "supported_families", "is_registered"]


@dataclass
class _Family:
    model_type: str
    target: Union[str, Callable]
    architectures: tuple = ()


_FAMILIES: dict[str, _Family] = {}
_ALIASES: dict[str, str] = {}


def register(model_type: str, target: Union[str, Callable], architectures: tuple = (), aliases: tuple = ()) -> None:
    """Register a family builder for ``model_type`` (and its ``aliases``, e.g. ``kimi_k2`` for
    ``deepseek_v3``); ``architectures`` are config ``architectures`` entries that also select it."""
    if not isinstance(model_type, str) or not model_type:
        raise ValueError(f"model_type must be a non-empty string, got {model_type!r}")
    if not (callable(target) or (isinstance(target, str) and ":" in target)):
        raise ValueError(f"target must be a callable or a 'module:attr' string, got {target!r}")
    _FAMILIES[model_type] = _Family(model_type, target, tuple(architectures))
    for a in aliases:
        _ALIASES[a] = model_type


def supported_families() -> list[str]:
    """Every model_type we can build (aliases included), sorted."""
    return sorted(set(_FAMILIES) | set(_ALIASES))


def is_registered(model_type: str) -> bool:
    """Whether ``model_type`` (or an alias) has a registered family."""
    return model_type in _FAMILIES or model_type in _ALIASES


def family_for(config: ModelConfig) -> str:
    """The registered model_type that builds ``config``; ValueError listing the supported ones."""
    mt = _ALIASES.get(config.model_type, config.model_type)
    if mt in _FAMILIES:
        return mt
    for fam in _FAMILIES.values():
        if any(a in fam.architectures for a in config.architectures):
            return fam.model_type
    raise ValueError(f"unsupported model_type {config.model_type!r} (architectures {list(config.architectures)}); "
                     f"supported: {', '.join(supported_families())}")


def builder_for(config: ModelConfig) -> Callable:
    """The callable ``(config, dtype=...) -> CausalLM`` for ``config``'s family."""
    fam = _FAMILIES[family_for(config)]
    if isinstance(fam.target, str):
        module, attr = fam.target.split(":", 1)
        fam.target = getattr(importlib.import_module(module), attr)
    return fam.target


register("qwen3_moe", "dynamoe.models.qwen3_moe:Qwen3MoeForCausalLM", ("Qwen3MoeForCausalLM",))
register("mixtral", "dynamoe.models.mixtral:MixtralForCausalLM", ("MixtralForCausalLM",))
register("gpt_oss", "dynamoe.models.gpt_oss:GptOssForCausalLM", ("GptOssForCausalLM",))
register("deepseek_v2", "dynamoe.models.deepseek_v2:DeepseekV2ForCausalLM", ("DeepseekV2ForCausalLM",))
register("deepseek_v3", "dynamoe.models.deepseek_v3:DeepseekV3ForCausalLM", ("DeepseekV3ForCausalLM",), aliases=("kimi_k2",))
register("glm4_moe", "dynamoe.models.glm4_moe:Glm4MoeForCausalLM", ("Glm4MoeForCausalLM",))
register("deepseek_v32", "dynamoe.models.deepseek_v32:DeepseekV32ForCausalLM", ("DeepseekV32ForCausalLM",))
register("minimax_m2", "dynamoe.models.minimax_m2:MiniMaxM2ForCausalLM", ("MiniMaxM2ForCausalLM",))
register("olmoe", "dynamoe.models.olmoe:OlmoeForCausalLM", ("OlmoeForCausalLM",))
register("qwen2_moe", "dynamoe.models.qwen2_moe:Qwen2MoeForCausalLM", ("Qwen2MoeForCausalLM",))
register("dbrx", "dynamoe.models.dbrx:DbrxForCausalLM", ("DbrxForCausalLM",))
register("dots1", "dynamoe.models.dots1:Dots1ForCausalLM", ("Dots1ForCausalLM",))
register("ernie4_5_moe", "dynamoe.models.ernie4_5_moe:Ernie4_5_MoeForCausalLM", ("Ernie4_5_MoeForCausalLM",))
register("exaone_moe", "dynamoe.models.exaone_moe:ExaoneMoeForCausalLM", ("ExaoneMoeForCausalLM",))
register("flex_olmo", "dynamoe.models.flex_olmo:FlexOlmoForCausalLM", ("FlexOlmoForCausalLM",))
register("glm4_moe_lite", "dynamoe.models.glm4_moe_lite:Glm4MoeLiteForCausalLM", ("Glm4MoeLiteForCausalLM",))
register("granitemoe", "dynamoe.models.granitemoe:GraniteMoeForCausalLM", ("GraniteMoeForCausalLM",))
register("granitemoeshared", "dynamoe.models.granitemoe:GraniteMoeForCausalLM", ("GraniteMoeSharedForCausalLM",))
register("hunyuan_v1_moe", "dynamoe.models.hunyuan_v1_moe:HunYuanMoEV1ForCausalLM", ("HunYuanMoEV1ForCausalLM",))
register("glm_moe_dsa", "dynamoe.models.glm_moe_dsa:GlmMoeDsaForCausalLM", ("GlmMoeDsaForCausalLM",))
register("kimi_k25", "dynamoe.models.kimi_k25:KimiK25ForCausalLM", ("KimiK25ForConditionalGeneration",))
register("qwen3_next", "dynamoe.models.qwen3_next:Qwen3NextForCausalLM", ("Qwen3NextForCausalLM",))
register("qwen3_5_moe", "dynamoe.models.qwen3_next:Qwen3_5MoeForCausalLM",
         ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM"), aliases=("qwen3_5_moe_text",))
register("qwen3_vl_moe", "dynamoe.models.qwen3_vl_moe:Qwen3VLMoeForCausalLM", ("Qwen3VLMoeForConditionalGeneration",),
         aliases=("qwen3_vl_moe_text",))
register("glm4v_moe", "dynamoe.models.glm4v_moe:Glm4vMoeForCausalLM", ("Glm4vMoeForConditionalGeneration",),
         aliases=("glm4v_moe_text",))
register("qwen3_omni_moe", "dynamoe.models.qwen3_omni_moe:Qwen3OmniMoeForCausalLM",
         ("Qwen3OmniMoeForConditionalGeneration", "Qwen3OmniMoeThinkerForConditionalGeneration"),
         aliases=("qwen3_omni_moe_thinker", "qwen3_omni_moe_text"))
register("kimi_linear", "dynamoe.models.kimi_linear:KimiLinearForCausalLM", ("KimiLinearForCausalLM",))
register("mimo_v2_flash", "dynamoe.models.mimo_v2_flash:MiMoV2FlashForCausalLM", ("MiMoV2FlashForCausalLM",))
register("mistral4", "dynamoe.models.mistral4:Mistral4ForCausalLM", ("Mistral4ForCausalLM",))
register("flint", "dynamoe.models.flint:FlintForCausalLM", ("FlintForCausalLM",))
register("granitemoe_swa", "dynamoe.models.granitemoe_swa:GraniteMoeSWAForCausalLM", ("GraniteMoeSWAForCausalLM",))
register("llama4", "dynamoe.models.llama4:Llama4ForCausalLM", ("Llama4ForConditionalGeneration", "Llama4ForCausalLM"),
         aliases=("llama4_text",))
register("phimoe", "dynamoe.models.phimoe:PhimoeForCausalLM", ("PhimoeForCausalLM",))
register("longcat_flash", "dynamoe.models.longcat_flash:LongcatFlashForCausalLM", ("LongcatFlashForCausalLM",))
register("step3p5", "dynamoe.models.step3p5:Step3p5ForCausalLM", ("Step3p5ForCausalLM",))
register("afmoe", "dynamoe.models.afmoe:AfmoeForCausalLM", ("AfmoeForCausalLM",))
register("cohere2_moe", "dynamoe.models.cohere2_moe:Cohere2MoeForCausalLM", ("Cohere2MoeForCausalLM",))
register("solar_open", "dynamoe.models.solar_open:SolarOpenForCausalLM", ("SolarOpenForCausalLM",))
register("hy_v3", "dynamoe.models.hy_v3:HYV3ForCausalLM", ("HYV3ForCausalLM",))
register("jetmoe", "dynamoe.models.jetmoe:JetMoeForCausalLM", ("JetMoeForCausalLM",))
register("sarvam_moe", "dynamoe.models.sarvam_moe:SarvamMoeForCausalLM")
register("laguna", "dynamoe.models.laguna:LagunaForCausalLM", ("LagunaForCausalLM",))
register("mellum", "dynamoe.models.mellum:MellumForCausalLM", ("MellumForCausalLM",))
register("kolibri1", "dynamoe.models.kolibri1:Kolibri1ForCausalLM", ("Kolibri1ForCausalLM",))
register("beam", "dynamoe.models.beam:BeamForCausalLM", ("BeamForCausalLM",))
register("zaya", "dynamoe.models.zaya:ZayaForCausalLM", ("ZayaForCausalLM",))
register("doge", "dynamoe.models.doge:DogeForCausalLM", ("DogeForCausalLM",))
register("aria", "dynamoe.models.aria:AriaTextForCausalLM", ("AriaForConditionalGeneration", "AriaTextForCausalLM"),
         aliases=("aria_text",))
register("step3p7", "dynamoe.models.step3p5:Step3p7ForCausalLM", ("Step3p7ForConditionalGeneration",))
register("jamba", "dynamoe.models.jamba:JambaForCausalLM", ("JambaForCausalLM",))
register("granitemoehybrid", "dynamoe.models.granitemoehybrid:GraniteMoeHybridForCausalLM",
         ("GraniteMoeHybridForCausalLM",))
register("nemotron_h", "dynamoe.models.nemotron_h:NemotronHForCausalLM",
         ("NemotronHForCausalLM", "NemotronH_Omni_Reasoning_V3", "Nemotron3_5TranscribeForConditionalGeneration"),
         aliases=("nemotron_h_omni", "nemo_speechlm"))
register("lfm2_moe", "dynamoe.models.lfm2_moe:Lfm2MoeForCausalLM", ("Lfm2MoeForCausalLM",))
register("minimax", "dynamoe.models.minimax:MiniMaxForCausalLM", ("MiniMaxForCausalLM",))
register("bailing_hybrid", "dynamoe.models.bailing_hybrid:BailingHybridForCausalLM", ("BailingHybridForCausalLM",))
register("minimax_m3_vl_text", "dynamoe.models.minimax_m3:MiniMaxM3ForCausalLM",
         ("MiniMaxM3VLForCausalLM", "MiniMaxM3SparseForConditionalGeneration"), aliases=("minimax_m3_vl",))
register("deepseek_v4", "dynamoe.models.deepseek_v4:DeepseekV4ForCausalLM", ("DeepseekV4ForCausalLM",))
register("glm5_next", "dynamoe.models.glm5_next:Glm5NextForCausalLM", ("Glm5NextForConditionalGeneration",),
         aliases=("glm5_next_text",))
register("mistral_large4", "dynamoe.models.mistral_large4:MistralLarge4ForCausalLM",
         ("MistralLarge4ForConditionalGeneration",), aliases=("mistral_large4_text",))
register("hy_v4", "dynamoe.models.hy_v4:HyV4ForCausalLM", ("HYV4ForCausalLM",))
register("hy_v4_vl", "dynamoe.models.hy_v4:HyV4ForCausalLM", ("HYV4VLForConditionalGeneration",),
         aliases=("hy_v4_vl_text",))
# Sarvam-105B: transformers builds DeepseekV3ForCausalLM for it
register("sarvam_mla", "dynamoe.models.deepseek_v3:DeepseekV3ForCausalLM", ("SarvamMLAForCausalLM",))
register("axk1", "dynamoe.models.axk1:AXK1ForCausalLM", ("AXK1ForCausalLM",))
register("axk2", "dynamoe.models.axk2:AXK2ForCausalLM", ("AXK2ForCausalLM",))
register("dots3_note", "dynamoe.models.dots3_note:Dots3NoteForCausalLM",
         ("Dots3NoteForConditionalGeneration", "Dots3NoteForCausalLM"), aliases=("dots3_note_text",))
register("gemma4", "dynamoe.models.gemma4:Gemma4ForCausalLM", ("Gemma4ForConditionalGeneration", "Gemma4ForCausalLM"),
         aliases=("gemma4_text",))
register("lara_mini", "dynamoe.models.lara_mini:LaraMiniForCausalLM", ("LaraMiniForCausalLM",))
register("inkling_text", "dynamoe.models.inkling:InklingForCausalLM",
         ("InklingForCausalLM", "InklingForConditionalGeneration"), aliases=("inkling_mm_model",))
register("inkling2_text", "dynamoe.models.inkling2:Inkling2ForCausalLM",
         ("Inkling2ForCausalLM", "Inkling2ForConditionalGeneration"), aliases=("inkling2",))
register("inkling2_loop_text", "dynamoe.models.inkling2_loop:Inkling2LoopForCausalLM",
         ("Inkling2LoopForCausalLM", "Inkling2LoopForConditionalGeneration"), aliases=("inkling2_loop",))
register("ernie4_5_vl_moe", "dynamoe.models.ernie4_5_vl_moe:Ernie4_5_VLMoeForCausalLM",
         ("Ernie4_5_VLMoeForConditionalGeneration", "Ernie4_5_VL_MoeForConditionalGeneration"))
register("deepseek_ocr2", "dynamoe.models.deepseek_ocr2:DeepseekOcr2ForCausalLM", ("DeepseekOcr2ForConditionalGeneration",))
register("muse_spark", "dynamoe.models.muse_spark:MuseSparkForCausalLM", ("MuseSparkForConditionalGeneration",))
register("qwen4_exp", "dynamoe.models.qwen4_exp:Qwen4ExpForCausalLM",
         ("Qwen4ExpForConditionalGeneration", "Qwen4ExpForCausalLM"), aliases=("qwen4_exp_text",))
register("unlimited_ocr", "dynamoe.models.unlimited_ocr:UnlimitedOcrForCausalLM", ("UnlimitedOcrForConditionalGeneration",))
