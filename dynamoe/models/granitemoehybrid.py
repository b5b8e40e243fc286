"""IBM GraniteMoE-Hybrid (``model_type: granitemoehybrid``: Granite-4.0-H): Mamba-2 layers
(:class:`~dynamoe.models.mamba2.Mamba2Mixer`) and GQA attention layers by ``layer_types`` (the hub's
``layers_block_type`` with its 'mamba' / 'attention' names), each followed by GraniteMoE-Shared's MLP block --
routed experts (top-k on the logits, softmax over the k; ``input_linear`` / ``output_linear`` stacked, of
``intermediate_size``) plus an ungated shared SwiGLU MLP of ``shared_intermediate_size`` (only the shared MLP
when ``num_local_experts`` is 0) -- with GraniteMoE's muP multipliers: embeddings times ``embedding_multiplier``,
both sublayers' outputs times ``residual_multiplier``, the softmax scale ``attention_multiplier``, the logits
divided by ``logits_scaling``. The attention rotates q/k only when ``position_embedding_type`` is 'rope' (the
default, null, has no position encoding).

Checkpoint: ``model.layers.{i}.mamba.{in_proj, conv1d.{weight,bias}, dt_bias, A_log, D, norm.weight, out_proj}``
or ``self_attn.{q,k,v,o}_proj``; ``block_sparse_moe.router.layer.weight`` [E, D],
``block_sparse_moe.input_linear.weight`` [E, 2F, D], ``block_sparse_moe.output_linear.weight`` [E, D, F];
``shared_mlp.input_linear.weight`` [2S, D] (gate rows, then up rows), ``shared_mlp.output_linear.weight``.

The model keeps per-sequence recurrent state (``recurrent_state = True``: no prefix reuse).
"""
from __future__ import annotations

from torch import Tensor, nn

from ..ops.activations import glu_activation
from .attention import Attention
from .base import CausalLM
from .config import ModelConfig
from .granitemoe import _ScaledEmbedding, _ScaledLMHead
from .mamba import MixerDecoderLayer
from .mamba2 import Mamba2Mixer
from .moe_block import SparseMoeBlock, glu_kind
from .norms import RMSNorm
from .rope import RotaryEmbedding
from .weights import Stacked

__all__ = ["GraniteMoeHybridForCausalLM", "FusedGateUpMLP"]


class FusedGateUpMLP(nn.Module):
    """output_linear(act(gate) * up), [gate | up] = input_linear(x) (GraniteMoE-Shared's shared MLP, alone)."""

    def __init__(self, hidden_size: int, intermediate_size: int, glu: str = "silu", dtype=None):
        super().__init__()
        self.glu = glu
        self.input_linear = nn.Linear(hidden_size, 2 * intermediate_size, bias=False, dtype=dtype)
        self.output_linear = nn.Linear(intermediate_size, hidden_size, bias=False, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.input_linear(x).chunk(2, dim=-1)
        return self.output_linear(glu_activation(gate, up, self.glu))


class GraniteMoeHybridForCausalLM(CausalLM):
    """GraniteMoE-Hybrid (see the module docstring)."""

    #: the Mamba layers' conv window and SSM state summarise a slot's whole prefix: no prefix reuse
    recurrent_state = True
    #: ... but speculative decoding can cut it back past rejected drafts: its layers record their state after every
    #: token of a verification forward (dynamoe.models.cache.KVCache.begin_history)
    recurrent_rollback = True
    checkpoint_renames = ((".mlp.moe.gates.0.wg.", ".block_sparse_moe.router.layer."),
                          (".mlp.moe.shared_experts.gate_up_proj.", ".shared_mlp.input_linear."),
                          (".mlp.moe.shared_experts.down_proj.", ".shared_mlp.output_linear."),
                          (".mlp.moe.experts", ".block_sparse_moe"), (".mlp.", ".shared_mlp."))
    expert_layout = Stacked("input_linear", "output_linear")

    def __init__(self, config: ModelConfig, dtype=None):
        super().__init__(config, dtype)
        # the multipliers as subclasses of the same modules: names, parameters and tying unchanged
        self.model.embed_tokens.__class__ = _ScaledEmbedding
        self.model.embed_tokens.multiplier = config.embedding_multiplier
        self.lm_head.__class__ = _ScaledLMHead
        self.lm_head.divisor = config.logits_scaling

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> MixerDecoderLayer:
        D, eps, kind, ssm = cfg.hidden_size, cfg.rms_norm_eps, cfg.layer_types[i], cfg.ssm
        if kind == "linear_attention":
            mixer = Mamba2Mixer(D, ssm.num_heads, ssm.head_dim, ssm.state_size, ssm.n_groups, ssm.conv_kernel, i,
                                norm_eps=eps, conv_bias=ssm.conv_bias, proj_bias=ssm.proj_bias,
                                activation=ssm.activation, chunk_size=ssm.chunk_size,
                                time_step_limit=ssm.time_step_limit,
                                checks_position=i == cfg.layer_types.index(kind), dtype=dtype)
        elif kind == "full_attention":
            mixer = Attention(D, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, i, rotary,
                              qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, scale=cfg.attention_multiplier,
                              use_rope=cfg.layer_uses_rope(i), dtype=dtype)
        else:
            raise ValueError(f"config field 'layer_types' entry {i} must be 'linear_attention' (Mamba) or "
                             f"'full_attention' for granitemoehybrid, got {kind!r}")
        glu, shared = glu_kind(cfg.hidden_act), cfg.shared_expert_intermediate_size
        if shared is None:
            raise ValueError("config field 'shared_intermediate_size' must be an int >= 1 for granitemoehybrid "
                             "(every layer has its shared MLP)")
        if cfg.num_experts:
            mlp: nn.Module = SparseMoeBlock(cfg, "softmax", normalize=True, glu=glu, num_shared_experts=1,
                                            shared_hidden_size=shared, shared_fused_gate_up=True, dtype=dtype)
        else:
            mlp = FusedGateUpMLP(D, shared, glu, dtype=dtype)
        return MixerDecoderLayer(mixer, mlp, RMSNorm(D, eps, dtype=dtype), RMSNorm(D, eps, dtype=dtype),
                                 mixer_name="mamba" if kind == "linear_attention" else "self_attn", residual_multiplier=cfg.residual_multiplier)
