"""LongCat-Flash (``model_type: longcat_flash``): ``num_layers`` decoder layers, each with two attention sublayers,
two dense MLPs and one "shortcut" MoE (transformers' LongcatFlashDecoderLayer):

    h  = h + attn0(norm_a0(h));  x = norm_m0(h);  s = moe(x);  h = h + mlp0(x)
    h  = h + attn1(norm_a1(h));  h = h + mlp1(norm_m1(h)) + s

Attention is DeepSeek-V3's MLA (interleaved RoPE on the rope dims, YaRN's mscale on the softmax when configured)
with LoRA scales: the queries times sqrt(D / q_lora_rank), the normalised latent times sqrt(D / kv_lora_rank)
(:class:`~dynamoe.models.mla.MLAttention`'s ``lora_scales``); the two sublayers of layer i cache as layers 2i and
2i + 1 (the cache has 2 * num_layers attention layers).

MoE: a router over n_routed_experts + ``zero_expert_num`` experts: fp32 logits, softmax, the top ``moe_topk`` of the
probabilities plus a selection-only ``e_score_correction_bias``, weighted by their probabilities (not
renormalised) times ``routed_scaling_factor``; ids past the routed experts are zero-computation experts whose
output is their input (:class:`ZeroComputeExperts`), so a token may spend part of its weight on no computation.

Checkpoint (the hub's names, which transformers 5 also saves): ``self_attn.{0,1}.*`` (MLA), ``mlps.{0,1}.*``,
``input_layernorm.{0,1}``, ``post_attention_layernorm.{0,1}``, ``mlp.router.classifier.weight`` [E + Z, D],
``mlp.router.e_score_correction_bias`` [E + Z], ``mlp.experts.{e}.{gate,up,down}_proj`` for the E routed experts
(transformers' saves add gate/up rows for the zero experts, which nothing reads: skipped).

No fused decode kernels: the layer has its own forward (two sublayers and the shortcut) and the MoE kernels have
no zero-computation experts; a decode step runs the modules (MoELayer refuses its kernels for these experts).
"""
from __future__ import annotations

import dataclasses
import re

import torch
from torch import Tensor, nn

from ..moe.experts import GLUExperts
from .base import CausalLM
from .cache import DEFAULT_BLOCK_SIZE, KVCache
from .config import ModelConfig
from .mla import MLAttention, mla_softmax_scale
from .moe_block import GatedMLP, SparseMoeBlock, glu_kind
from .norms import RMSNorm
from .rope import RotaryEmbedding
from .weights import PerExpert

__all__ = ["LongcatFlashForCausalLM", "LongcatDecoderLayer", "LongcatMoeBlock", "ZeroComputeExperts"]


class ZeroComputeExperts(GLUExperts):
    """``num_local_experts`` GLU experts followed by ``zero_experts`` zero-computation experts (identity), as one pool
    of E + Z experts for the MoE layer: rows routed to ids >= E come back as they went in (times their weight when
    the layer folds it in). Legend: E routed experts, Z zero experts, C capacity, N rows, D model dim."""

    def __init__(self, model_dim: int, hidden_size: int, num_experts: int, zero_experts: int, activation: str = "silu",
                 dtype=None, device=None):
        super().__init__(model_dim, hidden_size, num_experts, activation, dtype=dtype, device=device)
        self.zero_experts = zero_experts

    def extra_repr(self) -> str:
        return super().extra_repr() + f", zero_experts={self.zero_experts}"

    def forward(self, x_ECD: Tensor, ctx=None) -> Tensor:
        E = self.num_local_experts
        return torch.cat([super().forward(x_ECD[:E], ctx), x_ECD[E:].to(self.gate_up_proj.dtype)], dim=0)

    def forward_ragged(self, x_ND: Tensor, counts, row_scale: Tensor | None = None, out: Tensor | None = None) -> Tensor:
        E = self.num_local_experts
        n = sum(counts[:E])   # rows sorted by expert: the zero experts' rows come last
        y_nD = super().forward_ragged(x_ND[:n], list(counts[:E]), None if row_scale is None else row_scale[:n])
        z_ND = x_ND[n:] if row_scale is None else x_ND[n:] * row_scale[n:, None]
        y = torch.cat([y_nD, z_ND.to(y_nD.dtype)], dim=0)
        if out is not None:
            return out.copy_(y)
        return y


class LongcatMoeBlock(SparseMoeBlock):
    """The shortcut MoE of a LongCat-Flash layer (see the module docstring): a softmax router with a selection bias
    and route scale over E + Z experts, the last Z of them zero-computation experts."""

    def __init__(self, cfg: ModelConfig, dtype=None):
        if cfg.router_bias:
            raise ValueError("config field 'router_bias' true is not supported for longcat_flash (a bias on the router "
                             "logits); supported: false")
        E, Z = cfg.num_experts, cfg.zero_experts
        super().__init__(dataclasses.replace(cfg, num_experts=E + Z), "softmax", normalize=False,
                         glu=glu_kind(cfg.hidden_act), router_groups=False, route_scale=cfg.routed_scaling_factor,
                         selection_bias=True, dtype=dtype)
        self.num_experts, self.zero_experts = E, Z   # (the loader reads E routed experts)
        self.moe.experts = ZeroComputeExperts(cfg.hidden_size, cfg.expert_hidden_size, E, Z, glu_kind(cfg.hidden_act),
                                              dtype=dtype)

    @property
    def local_experts(self) -> range:
        return range(self.num_experts)

    def expert_parallel_(self, group) -> None:
        from ..parallel import net

        if net.get_world_size(group) > 1:
            raise ValueError("expert parallelism is not supported for longcat_flash (zero-computation experts)")

    def forward(self, x_BTD: Tensor) -> Tensor:
        if type(self.moe.experts) is not ZeroComputeExperts:
            raise ValueError(f"longcat_flash's MoE needs its zero-computation experts; got "
                             f"{type(self.moe.experts).__name__} (quantized expert checkpoints are not supported here)")
        return super().forward(x_BTD)


class LongcatDecoderLayer(nn.Module):
    """Two attention sublayers, two dense MLPs and the shortcut MoE (see the module docstring); names as
    transformers' (``self_attn.{0,1}``, ``mlps.{0,1}``, ``mlp``, ``input_layernorm.{0,1}``,
    ``post_attention_layernorm.{0,1}``)."""

    def __init__(self, self_attn: list, mlps: list, mlp: nn.Module, input_layernorm: list, post_attention_layernorm: list):
        super().__init__()
        self.self_attn, self.mlps = nn.ModuleList(self_attn), nn.ModuleList(mlps)
        self.mlp = mlp
        self.input_layernorm, self.post_attention_layernorm = nn.ModuleList(input_layernorm), nn.ModuleList(
            post_attention_layernorm)

    def forward(self, h_BTD: Tensor, positions_BT: Tensor, cache: KVCache | None = None, slots: Tensor | None = None,
                kv_len: int | None = None) -> Tensor:
        h_BTD = h_BTD + self.self_attn[0](self.input_layernorm[0](h_BTD), positions_BT, cache, slots, kv_len)
        x_BTD = self.post_attention_layernorm[0](h_BTD)
        shortcut_BTD = self.mlp(x_BTD)
        h_BTD = h_BTD + self.mlps[0](x_BTD)
        h_BTD = h_BTD + self.self_attn[1](self.input_layernorm[1](h_BTD), positions_BT, cache, slots, kv_len)
        return h_BTD + self.mlps[1](self.post_attention_layernorm[1](h_BTD)) + shortcut_BTD


class LongcatFlashForCausalLM(CausalLM):
    """LongCat-Flash (see the module docstring)."""

    checkpoint_renames = ((".mlp.moe.gates.0.wg.", ".mlp.router.classifier."),
                          (".mlp.moe.gates.0.e_score_correction_bias", ".mlp.router.e_score_correction_bias"),
                          (".mlp.moe.", ".mlp."))
    expert_layout = PerExpert("gate_proj", "up_proj", "down_proj")

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> LongcatDecoderLayer:
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        for name in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                     "intermediate_size"):
            if getattr(cfg, name) is None:
                raise ValueError(f"config field {name!r} is required for longcat_flash")
        if cfg.head_dim != cfg.qk_rope_head_dim:  # (the rotary table is head_dim wide, applied to the rope part)
            raise ValueError(f"config field 'head_dim' must equal qk_rope_head_dim={cfg.qk_rope_head_dim} for "
                             f"longcat_flash (its RoPE is sized by head_dim and rotates each head's qk_rope_head_dim "
                             f"channels, as transformers' LongcatFlash does), got {cfg.head_dim}")
        scale = mla_softmax_scale(cfg.rope, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        lora = ((D / cfg.q_lora_rank) ** 0.5, (D / cfg.kv_lora_rank) ** 0.5)
        attns = [MLAttention(D, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim,
                             cfg.qk_rope_head_dim, cfg.v_head_dim, 2 * i + j, rotary, scale, rope_interleaved=True,
                             bias=cfg.attention_bias, lora_scales=lora, dtype=dtype) for j in (0, 1)]
        mlps = [GatedMLP(D, cfg.intermediate_size, glu_kind(cfg.hidden_act), dtype=dtype) for _ in (0, 1)]
        norms = [[RMSNorm(D, eps, dtype=dtype) for _ in (0, 1)] for _ in (0, 1)]
        return LongcatDecoderLayer(attns, mlps, LongcatMoeBlock(cfg, dtype=dtype), norms[0], norms[1])

    def new_cache(self, num_slots: int, max_seq_len: int, dtype=None, device=None, *,
                  block_size: int = DEFAULT_BLOCK_SIZE, num_blocks: int | None = None) -> KVCache:
        """:meth:`CausalLM.new_cache` with two attention layers per decoder layer."""
        return KVCache(num_slots, max_seq_len, 2 * self.config.num_hidden_layers, dtype or self.dtype,
                       self.device if device is None else device, block_size=block_size, num_blocks=num_blocks)

    def ignores_checkpoint_tensor(self, name: str) -> bool:
        """transformers' saves hold gate/up rows for the zero-computation experts (ids >= n_routed_experts): unused."""
        m = re.fullmatch(r"model\.layers\.\d+\.mlp\.experts\.(\d+)\.(gate_proj|up_proj)\.weight", name)
        return bool(m) and int(m.group(1)) >= self.config.num_experts
