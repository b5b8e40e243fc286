"""The text model of a multimodal wrapper checkpoint (Qwen3.5-MoE, Qwen3-VL-MoE, GLM-4.5V, Qwen3-Omni, Llama 4,
Nemotron-3-Nano-Omni, Nemotron-3.5-Transcribe, ...): where the wrapper keeps the decoder stack and the lm_head, and
which of its parts the text model does not load (the vision tower, an audio encoder, a speech talker).

Its config.json is flattened by :func:`dynamoe.models.config.unwrap_text_config` (``text_config_nested``
then says the weights sit where the wrapper keeps them); a config of the text model itself uses our names.
dynamoe serves the text model only: the server refuses a request with an image, saying
:attr:`TextOfWrapper.text_only_reason`.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["WrapperLayout", "TextOfWrapper"]


@dataclass(frozen=True)
class WrapperLayout:
    """``stack``: the checkpoint prefix that holds our ``model.`` (embed_tokens, layers, norm); ``head``: the
    prefix before ``lm_head``; ``unused``: prefixes of the wrapper's other parts (skipped, logged once);
    ``renames``: the text model's ``checkpoint_renames`` inside this wrapper, in place of the family's (None: the
    family's; Nemotron-3.5-Transcribe keeps its Nemotron-H under NeMo's names, not transformers')."""

    stack: str
    head: str = ""
    unused: tuple = ()
    renames: tuple | None = None


class TextOfWrapper:
    """Mixin before :class:`~dynamoe.models.base.CausalLM`: checkpoint names by the config's outer
    ``model_type`` (:attr:`wrapper_layouts`) when the config nested the text model."""

    #: outer model_type -> where that wrapper keeps the text model
    wrapper_layouts: dict = {}
    #: what the server says when a request holds an image
    text_only_reason = "its vision tower is not loaded (dynamoe serves the text model only)"

    def wrapper_layout(self) -> WrapperLayout | None:
        if not self.config.text_config_nested:
            return None
        layout = self.wrapper_layouts.get(self.config.model_type)
        if layout is None:
            raise ValueError(f"{type(self).__name__} has no checkpoint layout for a {self.config.model_type!r} "
                             f"wrapper; known: {sorted(self.wrapper_layouts)}")
        return layout

    @property
    def unused_checkpoint_prefixes(self) -> tuple:
        layout = self.wrapper_layout()
        return () if layout is None else layout.unused

    def checkpoint_name(self, name: str) -> str:
        layout = self.wrapper_layout()
        if layout is not None and layout.renames is not None:   # (first match, as CausalLM.checkpoint_name)
            name = self.checkpoint_prefix + next((name.replace(ours, theirs, 1) for ours, theirs in layout.renames
                                                  if ours in name), name)
        else:
            name = super().checkpoint_name(name)
        if layout is None:
            return name
        if name.startswith("model."):
            return layout.stack + name[len("model."):]
        return layout.head + name
