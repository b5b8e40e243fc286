"""Kimi-K2.5 / K2.6 (``model_type: kimi_k25``, ``KimiK25ForConditionalGeneration``): the text model of a
vision-language checkpoint. Its config.json nests a DeepSeek-V3 text config under ``text_config``
(``model_type`` deepseek_v3 or kimi_k2; :func:`dynamoe.models.config.unwrap_text_config` flattens it, the
outer architectures / token ids / tie flag winning); its tensors are the DeepSeek-V3 ones under
``language_model.`` (``language_model.model.layers...``, ``language_model.lm_head.weight``), beside the
vision tower ``vision_tower.*`` and its projector ``mm_projector.*``, which this text model does not load
(the loader skips them and logs their count once, by prefix): a request with an image is refused by the
server. The released checkpoints keep the routed experts in INT4 (compressed-tensors pack-quantized,
group 32, :mod:`dynamoe.quant.int4`; ``quantization_config`` under ``text_config``) and everything else in
bf16.

Names checked against transformers 5's ``kimi_k25`` weight conversion (``language_model.model`` ->
``model.language_model``, ``language_model.lm_head`` -> ``lm_head``, ``vision_tower.encoder.blocks...``)
and vLLM's ``KimiK25ForConditionalGeneration.load_weights``.
"""
from __future__ import annotations

from .deepseek_v3 import DeepseekV3ForCausalLM

__all__ = ["KimiK25ForCausalLM", "TEXT_PREFIX", "VISION_PREFIXES"]

TEXT_PREFIX = "language_model."
VISION_PREFIXES = ("vision_tower.", "mm_projector.")


class KimiK25ForCausalLM(DeepseekV3ForCausalLM):
    """The DeepSeek-V3 text model of a Kimi-K2.5 checkpoint (text only: no vision tower)."""

    checkpoint_prefix = TEXT_PREFIX
    unused_checkpoint_prefixes = VISION_PREFIXES
    #: what the server says when a request holds an image (dynamoe.serve)
    text_only_reason = "its vision tower is not loaded (dynamoe serves the Kimi-K2.5 text model only)"
