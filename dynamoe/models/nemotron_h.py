"""NVIDIA Nemotron-H (``model_type: nemotron_h``): a stack of single-sublayer blocks, h += mixer(norm(h)), each
block one of (``layer_types`` / the hub's ``hybrid_override_pattern``)

* 'linear_attention' (M) -- Mamba-2 (:class:`~dynamoe.models.mamba2.Mamba2Mixer`; dt clamped below at
  ``time_step_min``);
* 'full_attention' (*) -- GQA without position encoding and without biases;
* 'moe' (E) -- DeepSeek-V3's sigmoid routing (selection-only ``e_score_correction_bias``, groups, top-k
  renormalised by ``norm_topk_prob``, times ``routed_scaling_factor``) over non-gated relu2 experts,
  down(relu(up(x))^2), plus a non-gated relu2 shared expert of ``moe_shared_expert_intermediate_size``;
* 'mlp' (-) -- a dense non-gated relu2 MLP of ``intermediate_size``;

RMSNorms (eps ``layer_norm_epsilon``, the weight applied in fp32) before every block and at the end.

The routed experts are dynamoe's non-gated (FFN) experts with the 'relu2' activation: up_proj into
``batched_fc1_w``, down_proj (transposed) into ``batched_fc2_w``. At decode the MoE layer runs its experts through
the FFN expert kernel (relu2 is one of its activations) inside the block's own forward (no fused layer: the block has
its own forward and a non-gated shared expert); a packed (quantized) expert checkpoint is dequantized on load.

Checkpoint: ``backbone.embeddings``, ``backbone.layers.{i}.norm``, ``backbone.layers.{i}.mixer.*`` (Mamba:
``in_proj, conv1d, dt_bias, A_log, D, norm, out_proj``; attention: ``{q,k,v,o}_proj``; MoE: ``gate.weight``,
``gate.e_score_correction_bias``, ``experts.{e}.{up,down}_proj.weight``, ``shared_experts.{up,down}_proj``;
MLP: ``{up,down}_proj``), ``backbone.norm_f``, ``lm_head``. Multi-token-prediction tensors (``mtp.*``) are not
loaded (plain decoding does not run them; the loader names them once).

Not supported (a ValueError naming the field): ``moe_latent_size`` (experts in a projected latent space),
``mlp_bias``, an ``mlp_hidden_act`` other than relu2. The model keeps per-sequence recurrent state
(``recurrent_state = True``: no prefix reuse).
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from .attention import Attention
from .base import CausalLM
from .cache import KVCache
from .config import ModelConfig
from .mamba2 import Mamba2Mixer
from .moe_block import SparseMoeBlock
from .norms import RMSNorm
from .rope import RotaryEmbedding
from .weights import PerExpertFFN

__all__ = ["NemotronHForCausalLM", "NemotronHBlock", "NemotronHMoE", "ReluSquaredMLP"]


class ReluSquaredMLP(nn.Module):
    """down_proj(relu(up_proj(x))^2) (Nemotron-H's dense MLP and shared expert)."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype=None):
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.relu(self.up_proj(x)).square())


class NemotronHMoE(SparseMoeBlock):
    """Sigmoid-routed non-gated relu2 experts plus ``shared_experts``."""

    def __init__(self, cfg: ModelConfig, dtype=None):
        super().__init__(cfg, "sigmoid", normalize=cfg.norm_topk_prob, ffn_activation="relu2", dtype=dtype)
        self.shared_experts = ReluSquaredMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, dtype=dtype)

    def forward(self, x_BTD: Tensor) -> Tensor:
        return super().forward(x_BTD) + self.shared_experts(x_BTD)

    decode_refusal = "a non-gated relu2 shared expert (the fused kernel's shared experts are GLUs)"


class NemotronHBlock(nn.Module):
    """h += mixer(norm(h)); ``mixer`` a Mamba-2 mixer, an attention, an MoE block or an MLP."""

    def __init__(self, mixer: nn.Module, norm: nn.Module):
        super().__init__()
        self.mixer, self.norm = mixer, norm
        self.takes_positions = isinstance(mixer, (Mamba2Mixer, Attention))

    @property
    def mlp(self) -> nn.Module | None:
        """The block's MoE (what :meth:`CausalLM.moe_layers` looks for), or None."""
        return self.mixer if isinstance(self.mixer, SparseMoeBlock) else None

    def forward(self, h_BTD: Tensor, positions_BT: Tensor, cache: KVCache | None = None, slots: Tensor | None = None,
                kv_len: int | None = None) -> Tensor:
        x = self.norm(h_BTD)
        return h_BTD + (self.mixer(x, positions_BT, cache, slots, kv_len) if self.takes_positions else self.mixer(x))


class NemotronHForCausalLM(CausalLM):
    """Nemotron-H (see the module docstring)."""

    #: the Mamba layers' conv window and SSM state summarise a slot's whole prefix: no prefix reuse
    recurrent_state = True
    #: ... but speculative decoding can cut it back past rejected drafts: its layers record their state after every
    #: token of a verification forward (dynamoe.models.cache.KVCache.begin_history)
    recurrent_rollback = True
    checkpoint_renames = ((".mixer.moe.gates.0.wg.", ".mixer.gate."), (".mixer.moe.gates.0.", ".mixer.gate."),
                          (".mixer.moe.", ".mixer."), ("model.embed_tokens.", "model.embeddings."),
                          ("model.norm.", "model.norm_f."))
    expert_layout = PerExpertFFN("up_proj", "down_proj")
    unused_checkpoint_prefixes = ("mtp.",)

    def __init__(self, config: ModelConfig, dtype=None):
        raw = config.raw
        if raw.get("moe_latent_size") is not None:
            raise ValueError(f"config field 'moe_latent_size' must be null for nemotron_h, got {raw['moe_latent_size']!r}"
                             " (experts in a projected latent space are not supported)")
        if raw.get("mlp_bias"):
            raise ValueError("config field 'mlp_bias' must be false for nemotron_h (MLP biases are not supported)")
        if raw.get("mlp_hidden_act", "relu2") != "relu2":
            raise ValueError(f"config field 'mlp_hidden_act' must be 'relu2' for nemotron_h, got "
                             f"{raw.get('mlp_hidden_act')!r}")
        super().__init__(config, dtype)

    def checkpoint_name(self, name: str) -> str:
        """Ours -> the checkpoint's: the renames, then ``model.`` -> ``backbone.``."""
        name = super().checkpoint_name(name)
        return "backbone." + name[len("model."):] if name.startswith("model.") else name

    def build_norm(self, cfg: ModelConfig, dim: int, dtype) -> nn.Module:
        return RMSNorm(dim, cfg.rms_norm_eps, weight_in_fp32=True, dtype=dtype)

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> NemotronHBlock:
        D, kind, ssm = cfg.hidden_size, cfg.layer_types[i], cfg.ssm
        if kind == "linear_attention":
            mixer: nn.Module = Mamba2Mixer(
                D, ssm.num_heads, ssm.head_dim, ssm.state_size, ssm.n_groups, ssm.conv_kernel, i,
                norm_eps=cfg.rms_norm_eps, conv_bias=ssm.conv_bias, proj_bias=ssm.proj_bias, activation=ssm.activation,
                chunk_size=ssm.chunk_size, time_step_limit=ssm.time_step_limit,
                checks_position=i == cfg.layer_types.index(kind), dtype=dtype)
        elif kind == "full_attention":
            mixer = Attention(D, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, i, rotary,
                              use_rope=False, dtype=dtype)
        elif kind == "moe":
            if cfg.shared_expert_intermediate_size is None:
                raise ValueError("config field 'moe_shared_expert_intermediate_size' must be an int >= 1 for "
                                 "nemotron_h's MoE blocks")
            mixer = NemotronHMoE(cfg, dtype=dtype)
        elif kind == "mlp":
            if cfg.intermediate_size is None:
                raise ValueError(f"config field 'intermediate_size' is required: block {i} is an MLP")
            mixer = ReluSquaredMLP(D, cfg.intermediate_size, dtype=dtype)
        else:
            raise ValueError(f"config field 'layer_types' entry {i} must be one of 'linear_attention', "
                             f"'full_attention', 'moe', 'mlp' for nemotron_h, got {kind!r}")
        return NemotronHBlock(mixer, self.build_norm(cfg, D, dtype))
