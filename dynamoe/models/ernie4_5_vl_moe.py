"""ERNIE-4.5-VL's language model, from its multimodal checkpoint (``model_type: ernie4_5_vl_moe``, the text model
``ernie4_5_vl_moe_text``): ERNIE-4.5-MoE's decoder (:mod:`dynamoe.models.ernie4_5_moe`: GQA with RoPE on
interleaved pairs -- the text positions of its 3D ``mrope_section`` RoPE are one position on all three axes, which
is plain RoPE --, dense first layer, softmax routing with a selection-only bias, shared experts), whose MoE layers
hold two expert groups: text tokens route through the text group only, image tokens through the vision group.
dynamoe serves text, so it loads the text group, its router and its bias, and not the vision group.

Checkpoint (the hub's layout, which transformers also saves): ``model.layers.{i}.mlp.gate.weight`` [D, E] (the text
router, stored in->out: read transposed), ``mlp.gate.weight_1`` (the vision router: not loaded),
``mlp.moe_statics.e_score_correction_bias`` [2, E] (row 0 the text group's), ``mlp.experts.{e}.*`` for e < E (text;
``moe_intermediate_size[0]`` wide) and E <= e < 2E (vision: not loaded), ``mlp.shared_experts.*``; the vision tower
(``model.vision_model.*``) and the resampler (``model.resampler_model.*``) are not loaded either. The skipped tensors
are named once in the log. The server refuses images naming the model.
"""
from __future__ import annotations

import logging
import re

from .config import ModelConfig
from .ernie4_5_moe import Ernie4_5_MoeForCausalLM
from .wrapped import TextOfWrapper, WrapperLayout

__all__ = ["Ernie4_5_VLMoeForCausalLM"]

log = logging.getLogger(__name__)

_EXPERT = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(\d+)\.")


class Ernie4_5_VLMoeForCausalLM(TextOfWrapper, Ernie4_5_MoeForCausalLM):
    """ERNIE-4.5-VL's text model (see the module docstring)."""

    wrapper_layouts = {"ernie4_5_vl_moe": WrapperLayout("model.", "", unused=("model.vision_model.",
                                                                              "model.resampler_model."))}
    text_only_reason = ("its vision tower and vision experts are not loaded (dynamoe serves the ERNIE-4.5-VL text "
                        "model only)")

    def __init__(self, config: ModelConfig, dtype=None):
        section = (config.raw.get("rope_parameters") or {}).get("mrope_section")
        if section is not None:
            half = config.head_dim // 2
            if (not isinstance(section, (list, tuple)) or len(section) != 3 or section[0] != section[1]
                    or sum(section) != half or any(isinstance(v, bool) or not isinstance(v, int) for v in section)):
                raise ValueError(f"config field 'rope_parameters.mrope_section' must be three ints [h, w, t] with h == w "
                                 f"summing to head_dim / 2 = {half} (as transformers' rotary embedding needs), got "
                                 f"{section!r}")
        if config.rope.rope_type != "default":
            raise ValueError(f"config field 'rope_type' must be 'default' for ERNIE-4.5-VL (transformers refuses any "
                             f"other), got {config.rope.rope_type!r}")
        super().__init__(config, dtype)

    def checkpoint_rows(self, name: str):
        if name.endswith(".mlp.moe.gates.0.e_score_correction_bias"):   # row 0 of [text; vision]
            return 0, 1, 2
        return None

    def checkpoint_transposed(self, name: str) -> bool:
        return name.endswith(".mlp.moe.gates.0.wg.weight")

    def adapt_to_checkpoint(self, names) -> None:
        """Say once which MoE tensors of the checkpoint are the vision group's (not loaded)."""
        E = self.config.num_experts
        skipped = [n for n in names if self.ignores_checkpoint_tensor(n)]
        if skipped:
            log.info("%s: not loading the vision expert group of the MoE layers (experts %d..%d and the vision router "
                     "mlp.gate.weight_1: %d tensors); text tokens route through the text group only",
                     self.config.model_type, E, 2 * E - 1, len(skipped))

    def ignores_checkpoint_tensor(self, name: str) -> bool:
        if name.endswith(".mlp.gate.weight_1"):
            return True
        m = _EXPERT.match(name)
        return m is not None and int(m.group(1)) >= self.config.num_experts
