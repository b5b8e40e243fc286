"""Qwen3-Omni-MoE's thinker text model (``model_type: qwen3_omni_moe``, ``qwen3_omni_moe_thinker``, or a
``qwen3_omni_moe_text`` config): Qwen3-MoE's decoder (GQA with per-head q/k RMSNorm, softmax top-k routing
renormalised when ``norm_topk_prob``, SwiGLU experts), attention that never slides.

Positions: the thinker's multimodal RoPE (``mrope_section``, interleaved) is the ordinary half-split RoPE
for text, whose temporal, height and width position ids are all the token's position.

Checkpoint: the thinker keeps the text model under ``model.`` (``lm_head`` beside it) with its vision and
audio encoders under ``visual.`` and ``audio_tower.``; the full Omni model puts the thinker under
``thinker.`` beside the speech ``talker.`` and ``code2wav.``. Only the text model loads (the other parts
are skipped and logged); the server refuses a request with an image, and dynamoe generates no speech.
Experts per expert: ``mlp.experts.{e}.gate_proj|up_proj|down_proj.weight``, ``mlp.gate.weight`` [E, D].
"""
from __future__ import annotations

from .qwen3_moe import Qwen3MoeForCausalLM
from .wrapped import TextOfWrapper, WrapperLayout

__all__ = ["Qwen3OmniMoeForCausalLM"]

_ENCODERS = ("visual.", "audio_tower.")


class Qwen3OmniMoeForCausalLM(TextOfWrapper, Qwen3MoeForCausalLM):
    """The thinker's text model of a Qwen3-Omni checkpoint (text in, text out)."""

    wrapper_layouts = {
        "qwen3_omni_moe_thinker": WrapperLayout("model.", unused=_ENCODERS),
        "qwen3_omni_moe": WrapperLayout("thinker.model.", "thinker.",
                                        unused=tuple("thinker." + p for p in _ENCODERS) + ("talker.", "code2wav.")),
    }
    text_only_reason = ("its vision and audio encoders are not loaded (dynamoe serves the Qwen3-Omni thinker's "
                        "text model only, without speech output)")
