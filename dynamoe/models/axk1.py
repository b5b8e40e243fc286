"""A.X-K1 (``model_type: axk1``, SK Telecom): DeepSeek-V3 (:mod:`dynamoe.models.deepseek_v3`: MLA with query LoRA,
RoPE on interleaved pairs unless ``rope_interleave`` is false, sigmoid group-limited routing with a selection bias,
shared experts) whose MoE layers normalise the block's output, h += post_mlp_layernorm(moe(norm(h))). The MLP kinds
come from ``mlp_layer_types``, else from the hub's ``first_k_dense_replace`` / ``moe_layer_freq`` (MoE where
i >= first_k_dense_replace and i % moe_layer_freq == 0).

Checkpoint: DeepSeek-V3's names with ``model.layers.{i}.post_mlp_layernorm.weight`` on the MoE layers; the hub's
files also hold one on the dense layers, which nothing reads (skipped), and may leave out the routers'
``e_score_correction_bias`` (then zero, as transformers initialises it).
"""
from __future__ import annotations

import re

import torch
from torch import Tensor, nn

from .base import DecoderLayer
from .config import ModelConfig
from .deepseek_v3 import DeepseekV3ForCausalLM
from .norms import RMSNorm
from .rope import RotaryEmbedding

__all__ = ["AXK1ForCausalLM", "PostNormMoeLayer"]

_POST_NORM = re.compile(r"model\.layers\.(\d+)\.post_mlp_layernorm\.weight")


class PostNormMoeLayer(DecoderLayer):
    """h += attn(norm1(h)); h += post_mlp_layernorm(mlp(norm2(h)))."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, input_layernorm: nn.Module,
                 post_attention_layernorm: nn.Module, post_mlp_layernorm: nn.Module):
        super().__init__(self_attn, mlp, input_layernorm, post_attention_layernorm)
        self.post_mlp_layernorm = post_mlp_layernorm

    def forward(self, h_BTD: Tensor, positions_BT: Tensor, cache=None, slots=None, kv_len=None) -> Tensor:
        h_BTD = h_BTD + self.self_attn(self.input_layernorm(h_BTD), positions_BT, cache, slots, kv_len)
        return h_BTD + self.post_mlp_layernorm(self.mlp(self.post_attention_layernorm(h_BTD)))


class AXK1ForCausalLM(DeepseekV3ForCausalLM):
    """A.X-K1 (see the module docstring)."""

    def __init__(self, config: ModelConfig, dtype=None):
        if config.q_lora_rank is None:
            raise ValueError("config field 'q_lora_rank' is required for axk1 (its queries always go through q_a_proj)")
        super().__init__(config, dtype)
        #: MoE layers whose checkpoint has no selection bias (a zero one is made by materialize_buffers)
        self.zero_bias_layers: tuple = ()

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> DecoderLayer:
        layer = super().build_layer(cfg, i, rotary, dtype)
        if not cfg.is_moe_layer(i):
            return layer
        return PostNormMoeLayer(layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm,
                                RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype))

    def ignores_checkpoint_tensor(self, name: str) -> bool:
        m = _POST_NORM.fullmatch(name)   # the hub's post-MLP norms of the dense layers: nothing reads them
        return m is not None and not self.config.is_moe_layer(int(m.group(1)))

    def adapt_to_checkpoint(self, names) -> None:
        """The routers whose ``e_score_correction_bias`` the checkpoint leaves out route without one (zero): the
        loader does not look for it (materialize_buffers makes it)."""
        names = set(names)
        missing = []
        for i, block in self.moe_layers():
            gate = block.moe.gates[0]
            if self.checkpoint_name(f"model.layers.{i}.mlp.moe.gates.0.e_score_correction_bias") not in names:
                gate._non_persistent_buffers_set.add("e_score_correction_bias")
                missing.append(i)
        self.zero_bias_layers = tuple(missing)

    def materialize_buffers(self, device) -> None:
        for i in self.zero_bias_layers:
            gate = self.model.layers[i].mlp.moe.gates[0]
            gate.e_score_correction_bias = torch.zeros(gate.e_score_correction_bias.shape, dtype=torch.float32,
                                                       device=device)
