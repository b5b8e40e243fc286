"""Qwen3-VL-MoE's text model (``model_type: qwen3_vl_moe``, ``Qwen3VLMoeForConditionalGeneration``; or a
``qwen3_vl_moe_text`` config): Qwen3-MoE's decoder (GQA with per-head q/k RMSNorm, softmax top-k routing,
SwiGLU experts) whose router always renormalises its top-k (transformers' ``Qwen3VLMoeTextTopKRouter``
reads no ``norm_topk_prob``) and whose attention never slides.

Positions: the model's multimodal RoPE (``mrope_section``, interleaved) rotates each frequency by the
temporal, height or width position id; for text all three are the token's position, so it is the
ordinary half-split RoPE (tests/test_models_qwen3_vl_moe.py checks the logits against transformers').

Checkpoint: the wrapper keeps the text model under ``model.language_model.`` (``lm_head`` at the top) and
the vision tower under ``model.visual.`` (not loaded; a request with an image is refused by the server);
the routed experts are fused (:class:`~dynamoe.models.weights.FusedGateUp`): ``mlp.experts.gate_up_proj``
and ``mlp.experts.down_proj``, in->out as released, out->in as transformers 5 saves them;
``mlp.gate.weight`` [E, D].
"""
from __future__ import annotations

from .qwen3_moe import Qwen3MoeForCausalLM
from .weights import FusedGateUp
from .wrapped import TextOfWrapper, WrapperLayout

__all__ = ["Qwen3VLMoeForCausalLM"]


class Qwen3VLMoeForCausalLM(TextOfWrapper, Qwen3MoeForCausalLM):
    """The text model of a Qwen3-VL-MoE checkpoint (text only: no vision tower)."""

    expert_layout = FusedGateUp()
    wrapper_layouts = {"qwen3_vl_moe": WrapperLayout("model.language_model.", unused=("model.visual.",))}
    text_only_reason = "its vision tower is not loaded (dynamoe serves the Qwen3-VL-MoE text model only)"
