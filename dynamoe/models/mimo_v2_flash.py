"""MiMo-V2-Flash (``model_type: mimo_v2_flash``): GQA decoder layers of two kinds (``layer_types``:
layer 0 and every 6th full attention, the others sliding-window), each with its own RoPE
(``rope_parameters`` per layer type: base 5e6 / 1e4, half-split on the first int(0.334 * head_dim)
dims), queries and keys of ``head_dim`` (192) but values of ``v_head_dim`` (128), values scaled by
``attention_value_scale`` (0.707) before they are cached; the sliding layers have twice the KV heads
and a learned per-head sink logit (GPT-OSS's sinks); a window of ``sliding_window`` keys including
the query (the hub's ``sliding_window_size`` + 1). A dense SwiGLU first layer, then DeepSeek-V3's routing without shared
experts: sigmoid scores, selection-only ``e_score_correction_bias``, group-limited top-k, renormalised,
times ``routed_scaling_factor`` (null: 1).

Checkpoint: ``self_attn.{q_proj, k_proj, v_proj, o_proj (no bias), attention_sink_bias (or sinks)}``,
``mlp.gate.weight`` (fp32) + ``mlp.gate.e_score_correction_bias``, ``mlp.experts.{e}.{gate,up,down}_proj``,
dense ``mlp.*_proj``.

Multi-token prediction: the hub's ``model.mtp.layers.{j}.{enorm, hnorm, eh_proj, input_layernorm, self_attn.*,
pre_mlp_layernorm, mlp.{gate,up,down}_proj, final_layernorm}`` (transformers drops them on load) load into ``mtp``, an
:class:`~dynamoe.models.mtp_prefixed.EhPredictor` that the engine drafts with (``draft="mtp"``): each depth's layer is
a sliding-window layer (the sliding layers' KV heads, sinks, window and RoPE) with a dense MLP of
``intermediate_size``, as vLLM's MiMoV2MTPLayer builds it (vllm/model_executor/models/mimo_v2_mtp.py); the model's
embedding and lm_head are shared.

No fused decode kernel: the kernel assumes values as wide as keys and no value scale, so every layer
runs the op-by-op attention.
"""
from __future__ import annotations

from torch import Tensor, nn

from ..ops.fused import Unfusable
from .attention import Attention
from .base import CausalLM, DecoderLayer
from .cache import KVCache
from .config import ModelConfig
from .deepseek_v3 import DEEPSEEK_RENAMES, deepseek_mlp
from .moe_block import GatedMLP, glu_kind
from .mtp_prefixed import EhPredictor, PrefixedMTPHeads, mtp_depths
from .norms import RMSNorm
from .rope import RotaryEmbedding, apply_rope
from .weights import PerExpert

__all__ = ["MiMoV2FlashForCausalLM", "MiMoAttention", "RotaryByLayerType"]


class RotaryByLayerType(nn.Module):
    """One :class:`RotaryEmbedding` per layer type (the model's ``rotary_emb``); ``self[kind]``."""

    def __init__(self, tables: dict):
        super().__init__()
        self.tables = nn.ModuleDict(tables)

    def __getitem__(self, kind: str) -> RotaryEmbedding:
        return self.tables[kind]


class MiMoAttention(Attention):
    """GQA with values of their own width ``v_head_dim``, scaled by ``v_scale`` before the cache, and no
    o_proj bias (see the module docstring); sinks and window as :class:`Attention`'s."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, v_head_dim: int,
                 layer_idx: int, rotary: RotaryEmbedding, bias: bool = False, sinks: bool = False,
                 sliding_window: int | None = None, v_scale: float = 1.0, dtype=None):
        super().__init__(hidden_size, num_heads, num_kv_heads, head_dim, layer_idx, rotary, qkv_bias=bias,
                         sinks=sinks, sliding_window=sliding_window, dtype=dtype)
        self.v_head_dim, self.v_scale = v_head_dim, v_scale
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * v_head_dim, bias=bias, dtype=dtype)
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=False, dtype=dtype)

    def _decode_weights(self, kernels, holds, norm, dtype):
        raise Unfusable("values narrower than keys and a value scale (the fused kernel has neither)")

    def forward(self, x_BTD: Tensor, positions_BT: Tensor, cache: KVCache | None = None, slots: Tensor | None = None,
                kv_len: int | None = None) -> Tensor:
        B, T, _ = x_BTD.shape
        H, K, d, dv = self.num_heads, self.num_kv_heads, self.head_dim, self.v_head_dim
        q, k, v = self._project_qkv(x_BTD)
        q = q.reshape(B, T, H, d).transpose(1, 2)                              # [B, H, T, d]
        k = k.reshape(B, T, K, d).transpose(1, 2)                              # [B, K, T, d]
        v = (v * self.v_scale).reshape(B, T, K, dv).transpose(1, 2)            # [B, K, T, dv]
        cos, sin = self.rotary(positions_BT, q.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.attend_cached(q, k, v, positions_BT, cache, slots, kv_len, self.sliding_window, self.sinks)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, H * dv))


class MiMoV2FlashForCausalLM(PrefixedMTPHeads, CausalLM):
    """MiMo-V2-Flash (see the module docstring)."""

    checkpoint_renames = DEEPSEEK_RENAMES
    expert_layout = PerExpert("gate_proj", "up_proj", "down_proj")
    mtp_checkpoint_prefix = "model.mtp."

    def build_rotary(self, cfg: ModelConfig) -> RotaryByLayerType:
        ropes = dict(cfg.rope_by_layer_type) or {"full_attention": cfg.rope}
        return RotaryByLayerType({kind: RotaryEmbedding(r, int(cfg.head_dim * r.partial_rotary_factor),
                                                        cfg.max_position_embeddings) for kind, r in ropes.items()})

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryByLayerType, dtype) -> DecoderLayer:
        D, eps, kind = cfg.hidden_size, cfg.rms_norm_eps, cfg.layer_types[i]
        if kind not in ("full_attention", "sliding_attention"):
            raise ValueError(f"config field 'layer_types' entry {i} must be 'full_attention' or 'sliding_attention' "
                             f"for {cfg.model_type}, got {kind!r}")
        attn = self._attention(cfg, i, kind, cfg.layer_sliding_window(i), rotary, dtype)
        return DecoderLayer(attn, deepseek_mlp(cfg, i, dtype), RMSNorm(D, eps, dtype=dtype), RMSNorm(D, eps, dtype=dtype))

    @staticmethod
    def _attention(cfg: ModelConfig, i: int, kind: str, window: int | None, rotary: RotaryByLayerType,
                   dtype) -> MiMoAttention:
        sliding = kind == "sliding_attention"
        v_scale = cfg.raw.get("attention_value_scale")
        return MiMoAttention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads * (2 if sliding else 1),
                             cfg.head_dim, cfg.v_head_dim or cfg.head_dim, i, rotary[kind], bias=cfg.attention_bias,
                             sinks=sliding, sliding_window=window, v_scale=1.0 if v_scale is None else float(v_scale),
                             dtype=dtype)

    def build_mtp_layer(self, cfg: ModelConfig, j: int, dtype) -> DecoderLayer:
        """MTP depth j's decoder layer (layer index N + j): sliding-window attention as the sliding layers have it,
        a dense SwiGLU MLP of ``intermediate_size``; ``post_attention_layernorm`` is the hub's ``pre_mlp_layernorm``."""
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        if cfg.sliding_window is None:
            raise ValueError("config field 'sliding_window' is required: the multi-token-prediction layers of "
                             f"{cfg.model_type} are sliding-window layers")
        if cfg.intermediate_size is None:
            raise ValueError("config field 'intermediate_size' is required: the multi-token-prediction layers have a "
                             "dense MLP")
        attn = self._attention(cfg, cfg.num_hidden_layers + j, "sliding_attention", cfg.sliding_window,
                               self.model.rotary_emb, dtype)
        mlp = GatedMLP(D, cfg.intermediate_size, glu_kind(cfg.hidden_act), dtype=dtype)
        return DecoderLayer(attn, mlp, RMSNorm(D, eps, dtype=dtype), RMSNorm(D, eps, dtype=dtype))

    def adapt_to_checkpoint(self, names) -> None:
        """Called by the loader with the checkpoint's tensor names: the sinks are read from
        ``attention_sink_bias`` (the hub's name, which transformers also saves) unless the checkpoint
        has ``sinks`` (transformers' module name); the MTP head ``mtp`` is built with as many depths as the
        ``model.mtp.layers.{j}`` there."""
        object.__setattr__(self, "_sinks_as_named", any(n.endswith(".self_attn.sinks") for n in names))
        if not any(n.startswith("model.mtp.") for n in names):
            return
        count = mtp_depths(names, "model.mtp.")
        if not count:
            raise ValueError("the checkpoint has model.mtp.* tensors but no model.mtp.layers.{j}")
        cfg, dtype, D = self.config, self.dtype, self.config.hidden_size
        self.mtp = EhPredictor([self.build_mtp_layer(cfg, j, dtype) for j in range(count)], D,
                               lambda: RMSNorm(D, cfg.rms_norm_eps, dtype=dtype), self.model.embed_tokens,
                               self.lm_head, dtype=dtype)

    def checkpoint_name(self, name: str) -> str:
        if name.startswith("mtp.layers."):   # ours: mtp.layers.{j}.[block.]x; the hub's: model.mtp.layers.{j}.x
            name = "model." + name.replace(".block.post_attention_layernorm.", ".pre_mlp_layernorm.", 1)
            name = name.replace(".block.", ".", 1)
        else:
            name = super().checkpoint_name(name)
        if name.endswith(".self_attn.sinks") and not self.__dict__.get("_sinks_as_named", False):
            return name[: -len("sinks")] + "attention_sink_bias"
        return name
