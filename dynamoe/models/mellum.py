"""JetBrains Mellum 2 (``model_type: mellum``): Qwen3-MoE's layers -- GQA with per-head q/k RMSNorms before RoPE,
softmax top-k routing renormalised when ``norm_topk_prob`` -- in two attention kinds (``layer_types``: 'full_attention',
the default for every layer, and 'sliding_attention' over ``sliding_window`` keys), each kind with its own RoPE
(``rope_parameters`` by layer type; by default base 5e5 for the full layers, 1e4 for the sliding ones; always over
the whole head: transformers' Mellum attention fails on a partial factor, which is refused by name), and dense SwiGLU MLPs where ``mlp_layer_types`` says 'dense' (by default
none).

Checkpoint: Qwen3-MoE's names (``mlp.gate.weight`` [E, D], ``mlp.experts.{e}.{gate,up,down}_proj``); the
multi-token-prediction module (``mtp.*``, ``num_mtp_layers``) is not loaded (the loader logs its tensor count): no
public source gives its architecture -- transformers' MellumForCausalLM drops ``mtp.*``, and neither vLLM nor SGLang
has a Mellum MTP model -- so there is nothing to check a head against.
"""
from __future__ import annotations

from .config import ModelConfig
from .laguna import LagunaForCausalLM
from .qwen3_moe import Qwen3MoeForCausalLM

__all__ = ["MellumForCausalLM"]


class MellumForCausalLM(Qwen3MoeForCausalLM):
    """Mellum 2 (see the module docstring): Qwen3-MoE layers, each with the RoPE of its layer type."""

    unused_checkpoint_prefixes = ("mtp.",)
    build_rotary = LagunaForCausalLM.build_rotary  # (one RotaryEmbedding per layer type: RotaryByLayerType)

    def __init__(self, config: ModelConfig, dtype=None):
        for kind, rope in config.rope_by_layer_type:  # (Qwen3's attention rotates q and k whole: transformers fails)
            if rope.partial_rotary_factor != 1.0:
                raise ValueError(f"config field 'rope_parameters.{kind}.partial_rotary_factor' must be 1 for mellum "
                                 f"(its attention rotates the whole head), got {rope.partial_rotary_factor!r}")
        super().__init__(config, dtype)

    def build_layer(self, cfg: ModelConfig, i: int, rotary, dtype):
        kind = cfg.layer_types[i]
        if kind not in ("full_attention", "sliding_attention"):
            raise ValueError(f"config field 'layer_types' entry {i} must be 'full_attention' or 'sliding_attention' "
                             f"for mellum, got {kind!r}")
        return super().build_layer(cfg, i, rotary[kind], dtype)
