"""GLM-4.5V / GLM-4.6V's text model (``model_type: glm4v_moe``, ``Glm4vMoeForConditionalGeneration``; or a
``glm4v_moe_text`` config): GLM-4.5's decoder (:mod:`dynamoe.models.glm4_moe`: GQA with q/k/v biases, RoPE
on the first half of each head, dense first layers, then sigmoid-routed experts with a selection bias,
``routed_scaling_factor`` and a shared expert), without q/k norms.

Positions: the model's multimodal RoPE splits the rotated frequencies into ``mrope_section`` blocks
(temporal, height, width) that rotate by their own position id; for text all three are the token's
position, so it is the ordinary (partial, half-split) RoPE.

Checkpoint: the wrapper keeps the text model under ``model.language_model.`` (``lm_head`` at the top) and
the vision tower under ``model.visual.`` (not loaded; a request with an image is refused by the server);
the MoE names are GLM-4.5's (``mlp.gate.weight``, ``mlp.gate.e_score_correction_bias``,
``mlp.experts.{e}.*``, ``mlp.shared_experts.*``).
"""
from __future__ import annotations

from .glm4_moe import Glm4MoeForCausalLM
from .wrapped import TextOfWrapper, WrapperLayout

__all__ = ["Glm4vMoeForCausalLM"]


class Glm4vMoeForCausalLM(TextOfWrapper, Glm4MoeForCausalLM):
    """The text model of a GLM-4.5V checkpoint (text only: no vision tower)."""

    wrapper_layouts = {"glm4v_moe": WrapperLayout("model.language_model.", unused=("model.visual.",))}
    text_only_reason = "its vision tower is not loaded (dynamoe serves the GLM-4.5V text model only)"
