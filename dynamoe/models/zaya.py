"""Zyphra ZAYA1 (``model_type: zaya``): Compressed Convolutional Attention (CCA), residual scaling and an MLP router.

Legend: B batch, T tokens, D model dim, H query heads, K key/value heads (G = H / K), d head dim, C = (H + K) d,
W = (``cca_time0`` - 1) + (``cca_time1`` - 1) the convolution's window, R ``router_hidden_size``, E experts.

Attention (CCA, ``self_attn.qkv_proj``): q = q_proj(x) [H d] and k = k_proj(x) [K d] are mixed over time by a
causal depthwise convolution (kernel ``cca_time0``, per channel) then a grouped one (kernel ``cca_time1``, one group
per head), both with biases, plus residual paths: each query head adds (q_h + k_{h // G}) / 2, each key head the mean
of those over its G query heads. The values are half current, half delayed: [v_proj_current(x_t) |
v_proj_delayed(x_{t-1})] (v_proj_delayed(0) before the first token). q and k are then L2-normalised per head to a
norm of sqrt(d), k times a learned per-KV-head ``temp``; RoPE (half-split) on the first ``partial_rotary_factor`` of
each head with a RoPE per layer kind ('hybrid': full attention, 'hybrid_sliding': a window of ``sliding_window``).
With a cache, each sequence keeps the convolution's last W inputs and the last delayed value in its slot (a
recurrent state: ``recurrent_state`` is True, so the engine shares no prefix blocks; a speculative verification
forward records both after every token, so that rejected drafts can be cut off: ``recurrent_rollback``).

Layers: h' = s_h * (attn(norm1(h)) + b_h) + s_r * (h + b_r) (``post_attention_residual_scale``, per-channel scales
and biases), then the same around the MoE (``post_mlp_residual_scale``). The embeddings are (e + b) * s
(``model.input_hidden_states_{bias,scale}``) and the residual stream is fp32 (as transformers keeps it: each norm
reads it in its weight's dtype).

MoE: the router projects x to R dims (``down_proj``), adds the previous layer's router state times
``router_states_scale`` (every layer but the first; the state flows from layer to layer within a forward), and runs
an MLP (RMSNorm, GELU(fc1), GELU(fc2), ``out_proj`` to E + 1 classes); softmax; the top-1 class of the probabilities
plus the ``balancing_biases`` buffer is chosen and weighted by its probability; class E means no expert (weight 0).
The experts are SwiGLU (``experts.gate_up_proj`` [E, 2F, D], gate rows then up rows, ``experts.down_proj`` [E, D, F]).

Checkpoint: transformers' names (see the modules). No fused decode kernels (the attention and the routing are
ZAYA's own); the experts run one matmul pair per chosen expert (top-1).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops.activations import glu_activation
from ..ops.fused import Fused, Holds
from .attention import attend, cached_length, write_kv
from .base import CausalLM
from .cache import KVCache
from .config import ModelConfig
from .linear_attention import slot_states
from .mimo_v2_flash import RotaryByLayerType
from .moe_block import glu_kind
from .norms import RMSNorm
from .rope import RotaryEmbedding, apply_rope

__all__ = ["ZayaForCausalLM", "CCAttention", "ZayaMoE", "ZayaDecoderLayer"]


class _CastingRMSNorm(RMSNorm):
    """RMSNorm that first casts its input to its weight's dtype (ZAYA's fp32 residual stream, as transformers reads it)."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x.to(self.weight.dtype))


class CCAProjection(nn.Module):
    """ZAYA's q/k/v (see the module docstring): ``forward(x [B, T, D], conv_state [B, C, W], v_state [B, K d / 2])
    -> q [B, T, H, d], k [B, T, K, d], v [B, T, K, d], the conv's inputs [B, C, W + T] (the conv state, then the new
    ones: the next conv state is their last W), the delayed values [B, T, K d / 2] (the next value state is the
    last)``."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, time0: int, time1: int,
                 bias: bool = False, dtype=None):
        super().__init__()
        if (num_kv_heads * head_dim) % 2:
            raise ValueError(f"num_key_value_heads * head_dim must be even for zaya (half the values are delayed), "
                             f"got {num_kv_heads} * {head_dim}")
        for name, t in (("cca_time0", time0), ("cca_time1", time1)):
            if isinstance(t, bool) or not isinstance(t, int) or t < 1:
                raise ValueError(f"config field {name!r} must be an int >= 1, got {t!r}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.window = (time0 - 1) + (time1 - 1)
        q_dim, kv_dim = num_heads * head_dim, num_kv_heads * head_dim
        channels = q_dim + kv_dim
        self.q_proj = nn.Linear(hidden_size, q_dim, bias=bias, dtype=dtype)
        self.k_proj = nn.Linear(hidden_size, kv_dim, bias=bias, dtype=dtype)
        self.v_proj_current = nn.Linear(hidden_size, kv_dim // 2, bias=bias, dtype=dtype)
        self.v_proj_delayed = nn.Linear(hidden_size, kv_dim // 2, bias=bias, dtype=dtype)
        self.conv_qk_depthwise = nn.Conv1d(channels, channels, time0, groups=channels, dtype=dtype)
        self.conv_qk_grouped = nn.Conv1d(channels, channels, time1, groups=num_heads + num_kv_heads, dtype=dtype)

    def forward(self, x_BTD: Tensor, conv_BCW: Tensor | None, v_prev_BV: Tensor | None):
        B, T, _ = x_BTD.shape
        H, K, d, W = self.num_heads, self.num_kv_heads, self.head_dim, self.window
        G = H // K
        q, k = self.q_proj(x_BTD), self.k_proj(x_BTD)
        # residual paths: query head h adds (q_h + k_{h // G}) / 2, key head g the mean of its query heads' sums
        q_res = (q.view(B, T, K, G, d) + k.view(B, T, K, 1, d)) * 0.5
        k_res = q_res.mean(dim=3)                                                # [B, T, K, d]
        qk_BCT = torch.cat([q, k], dim=-1).transpose(1, 2)                       # [B, C, T]
        if conv_BCW is None:
            conv_BCW = qk_BCT.new_zeros(B, qk_BCT.size(1), W)
        qk_BCT = torch.cat([conv_BCW.to(qk_BCT.dtype), qk_BCT], dim=-1)          # [B, C, W + T]
        mixed = self.conv_qk_grouped(self.conv_qk_depthwise(qk_BCT)).transpose(1, 2)   # [B, T, C]
        query = mixed[..., :H * d].reshape(B, T, H, d) + q_res.reshape(B, T, H, d)
        key = mixed[..., H * d:].reshape(B, T, K, d) + k_res
        delayed = self.v_proj_delayed(x_BTD)                                     # [B, T, K d / 2]
        if v_prev_BV is None:
            v_prev_BV = self.v_proj_delayed(x_BTD.new_zeros(B, x_BTD.size(-1)))
        v_delayed = torch.cat([v_prev_BV.to(delayed.dtype)[:, None], delayed[:, :-1]], dim=1)
        value = torch.cat([self.v_proj_current(x_BTD), v_delayed], dim=-1).view(B, T, K, d)
        return query, key, value, qk_BCT, delayed


class _QKNorm(nn.Module):
    """q and k scaled to an L2 norm of sqrt(d) per head, k then times ``temp`` [K] (ZAYA's ``qk_norm``)."""

    def __init__(self, num_kv_heads: int, head_dim: int, dtype=None):
        super().__init__()
        self.scale = head_dim ** 0.5
        self.temp = nn.Parameter(torch.zeros(num_kv_heads, dtype=dtype))

    def forward(self, q_BTHd: Tensor, k_BTKd: Tensor) -> tuple[Tensor, Tensor]:
        eps = torch.finfo(q_BTHd.dtype).eps
        q = q_BTHd * (self.scale / q_BTHd.norm(p=2, dim=-1, keepdim=True).clamp_min(eps))
        k = k_BTKd * (self.scale / k_BTKd.norm(p=2, dim=-1, keepdim=True).clamp_min(eps))
        return q, k * self.temp[None, None, :, None]


class CCAttention(nn.Module):
    """ZAYA's attention (see the module docstring); ``forward(x, positions, cache=None, slots=None, kv_len=None)``."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, layer_idx: int,
                 rotary: RotaryEmbedding, time0: int, time1: int, bias: bool = False,
                 sliding_window: int | None = None, checks_position: bool = False, dtype=None):
        super().__init__()
        self.layer_idx, self.num_heads, self.num_kv_heads, self.head_dim = layer_idx, num_heads, num_kv_heads, head_dim
        self.sliding_window, self.checks_position = sliding_window, checks_position
        self.scale = head_dim ** -0.5
        self.qkv_proj = CCAProjection(hidden_size, num_heads, num_kv_heads, head_dim, time0, time1, bias, dtype)
        self.qk_norm = _QKNorm(num_kv_heads, head_dim, dtype)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias, dtype=dtype)
        object.__setattr__(self, "rotary", rotary)  # (owned by the model)

    def decode_fused(self, norm: nn.Module, dtype: torch.dtype) -> Fused:
        return Fused(None, Holds(), "compressed convolutional attention (q/k convolved over time, delayed values): "
                                    "the fused kernel projects each token alone")

    def forward(self, x_BTD: Tensor, positions_BT: Tensor, cache: KVCache | None = None, slots: Tensor | None = None,
                kv_len: int | None = None) -> Tensor:
        B, T, _ = x_BTD.shape
        proj = self.qkv_proj
        conv = v_prev = None
        if cache is not None:
            C = (self.num_heads + self.num_kv_heads) * self.head_dim
            conv_buf, v_buf, conv, v_prev = slot_states(cache, self.layer_idx, slots, positions_BT, T, (C, proj.window),
                                                        (self.num_kv_heads * self.head_dim // 2,), self.checks_position)
            # a new sequence's delayed value before its first token is v_proj_delayed(0), as without a cache
            fresh_B = positions_BT[:, 0] == 0
            if bool(fresh_B.any()):
                v_prev = torch.where(fresh_B[:, None], proj.v_proj_delayed(x_BTD.new_zeros(B, x_BTD.size(-1))).float(),
                                     v_prev)
        q, k, v, conv_in, delayed = proj(x_BTD, conv, v_prev)
        if cache is not None:
            W = proj.window
            conv_buf[slots] = conv_in[..., conv_in.size(-1) - W:].to(conv_buf.dtype)
            v_buf[slots] = delayed[:, -1].float()
            if cache.keeps_history:   # speculative verification: the window and delayed value after every token
                cache.record_windows(self.layer_idx, "conv_state", slots, conv_in, W)
                cache.record(self.layer_idx, "recurrent_state", slots, delayed.float())
        q, k = self.qk_norm(q, k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)      # [B, H|K, T, d]
        cos, sin = self.rotary(positions_BT, q.dtype)
        q, k = apply_rope(q.contiguous(), cos, sin), apply_rope(k.contiguous(), cos, sin)
        k_pos = None
        if cache is not None:
            kv_len = cached_length(positions_BT, slots, kv_len)
            kv = write_kv(cache, self.layer_idx, slots, positions_BT, kv_len, k=k, v=v)
            k, v = kv["k"], kv["v"]
            k_pos = torch.arange(kv_len, device=x_BTD.device).expand(B, kv_len)
        out = attend(q, k, v, positions_BT, k_pos, self.scale, self.sliding_window)     # [B, H, T, d]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class ResidualScaling(nn.Module):
    """(f + b_h) * s_h + (h + b_r) * s_r, per channel (ZAYA's ``*_residual_scale``)."""

    def __init__(self, dim: int, dtype=None):
        super().__init__()
        self.hidden_states_scale = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.hidden_states_bias = nn.Parameter(torch.zeros(dim, dtype=dtype))
        self.residual_scale = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.residual_bias = nn.Parameter(torch.zeros(dim, dtype=dtype))

    def forward(self, f: Tensor, h: Tensor) -> Tensor:
        return (f + self.hidden_states_bias) * self.hidden_states_scale + (h + self.residual_bias) * self.residual_scale


class _RouterMLP(nn.Module):
    def __init__(self, dim: int, classes: int, eps: float, dtype=None):
        super().__init__()
        self.norm = RMSNorm(dim, eps, dtype=dtype)
        self.fc1 = nn.Linear(dim, dim, dtype=dtype)
        self.fc2 = nn.Linear(dim, dim, dtype=dtype)
        self.out_proj = nn.Linear(dim, classes, bias=False, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.out_proj(F.gelu(self.fc2(F.gelu(self.fc1(self.norm(x))))))


class _RouterCarry:
    """The router state flowing from one layer's MoE to the next within a forward (not a module: no parameters)."""

    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state: Tensor | None = None


class ZayaRouter(nn.Module):
    """Top-1 of E + 1 classes (the last: no expert) by an MLP over a low-rank projection plus the previous layer's
    state; ``forward(x [N, D]) -> (expert ids [N], weights [N], this layer's state [N, R])``."""

    def __init__(self, hidden_size: int, num_experts: int, router_hidden: int, eps: float, first: bool, dtype=None):
        super().__init__()
        self.num_experts = num_experts
        self.down_proj = nn.Linear(hidden_size, router_hidden, dtype=dtype)
        self.router_states_scale = None if first else nn.Parameter(torch.ones(router_hidden, dtype=dtype))
        self.router_mlp = _RouterMLP(router_hidden, num_experts + 1, eps, dtype)
        biases = torch.zeros(num_experts + 1, dtype=torch.float32)
        biases[-1] = -1.0
        self.register_buffer("balancing_biases", biases)

    def _apply(self, fn, recurse=True):
        bias = self.balancing_biases   # (a selection-only bias: fp32 whatever .to() says, as transformers keeps it)
        super()._apply(fn, recurse)
        if self.balancing_biases.dtype != torch.float32:
            self.balancing_biases = bias.to(device=self.balancing_biases.device, dtype=torch.float32)
        return self

    def forward(self, x_ND: Tensor, prev_NR: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        state = self.down_proj(x_ND)
        if self.router_states_scale is not None and prev_NR is not None:
            state = state + prev_NR * self.router_states_scale
        probs = torch.softmax(self.router_mlp(state), dim=-1)
        # (topk, not argmax: the same choice among bf16 ties as transformers)
        ids = torch.topk(probs.float() + self.balancing_biases, 1, dim=-1).indices[:, 0]
        weights = probs.gather(1, ids[:, None])[:, 0]
        return ids, weights, state


class ZayaExperts(nn.Module):
    """SwiGLU experts stored as transformers' fused 3D tensors (``gate_up_proj`` [E, 2F, D], ``down_proj`` [E, D, F])."""

    def __init__(self, num_experts: int, hidden_size: int, width: int, glu: str, dtype=None):
        super().__init__()
        self.glu = glu
        self.gate_up_proj = nn.Parameter(torch.zeros(num_experts, 2 * width, hidden_size, dtype=dtype))
        self.down_proj = nn.Parameter(torch.zeros(num_experts, hidden_size, width, dtype=dtype))

    def forward(self, x_ND: Tensor, ids_N: Tensor, weights_N: Tensor) -> Tensor:
        """sum over the rows' one chosen expert each (ids < E; others: zeros) of weight * expert(x)."""
        y = torch.zeros_like(x_ND)
        E = self.gate_up_proj.size(0)
        for e in torch.unique(ids_N).tolist():
            if e >= E:
                continue
            rows = (ids_N == e).nonzero(as_tuple=True)[0]
            gate, up = F.linear(x_ND[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
            out = F.linear(glu_activation(gate, up, self.glu), self.down_proj[e])
            y.index_add_(0, rows, out * weights_N[rows, None].to(out.dtype))
        return y


class ZayaMoE(nn.Module):
    """ZAYA's MoE layer: :class:`ZayaRouter` (``gate``) + :class:`ZayaExperts` (``experts``); the router state
    goes to the next layer through the model's shared carry."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, carry: _RouterCarry, dtype=None):
        super().__init__()
        R = cfg.raw["router_hidden_size"]
        if isinstance(R, bool) or not isinstance(R, int) or R < 1:
            raise ValueError(f"config field 'router_hidden_size' must be an int >= 1, got {R!r}")
        self.gate = ZayaRouter(cfg.hidden_size, cfg.num_experts, R, cfg.rms_norm_eps, layer_idx == 0, dtype)
        self.experts = ZayaExperts(cfg.num_experts, cfg.hidden_size, cfg.expert_hidden_size, glu_kind(cfg.hidden_act),
                                   dtype)
        object.__setattr__(self, "carry", carry)

    def forward(self, x_BTD: Tensor) -> Tensor:
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(B * T, D)
        prev = self.carry.state
        if prev is not None and prev.size(0) != B * T:  # (a state of another forward: never the first layer's input)
            prev = None
        ids, weights, self.carry.state = self.gate(x_ND, prev)
        return self.experts(x_ND, ids, weights).view(B, T, D)


class ZayaDecoderLayer(nn.Module):
    """h = r1(attn(norm1(h)), h); h = r2(moe(norm2(h)), h), r the residual scalings (see the module docstring)."""

    def __init__(self, self_attn: CCAttention, mlp: ZayaMoE, input_layernorm: nn.Module,
                 post_attention_layernorm: nn.Module, dim: int, dtype=None):
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm, self.post_attention_layernorm = input_layernorm, post_attention_layernorm
        self.post_attention_residual_scale = ResidualScaling(dim, dtype)
        self.post_mlp_residual_scale = ResidualScaling(dim, dtype)

    def forward(self, h_BTD: Tensor, positions_BT: Tensor, cache=None, slots=None, kv_len=None) -> Tensor:
        a = self.self_attn(self.input_layernorm(h_BTD), positions_BT, cache, slots, kv_len)
        h_BTD = self.post_attention_residual_scale(a, h_BTD)
        return self.post_mlp_residual_scale(self.mlp(self.post_attention_layernorm(h_BTD)), h_BTD)


class _ZayaEmbedding(nn.Embedding):
    """nn.Embedding whose output is ((e + bias) * scale) in fp32, bias and scale the stack's
    ``input_hidden_states_{bias,scale}`` (same parameter and name; may stay tied)."""

    def forward(self, ids: Tensor) -> Tensor:
        stack = self.__dict__["_stack"]
        e = super().forward(ids)
        return ((e + stack.input_hidden_states_bias) * stack.input_hidden_states_scale).to(torch.float32)


class _CastingLMHead(nn.Linear):
    """The lm_head reading the fp32 stream in its weight's dtype (same parameters and names; may stay tied)."""

    def forward(self, h: Tensor) -> Tensor:
        return super().forward(h.to(self.weight.dtype))


class ZayaForCausalLM(CausalLM):
    """ZAYA1 (see the module docstring)."""

    recurrent_state = True  # (the convolution's window and the delayed value live in the slots: no prefix sharing)
    #: ... but speculative decoding can cut it back past rejected drafts: its layers record their state after every
    #: token of a verification forward (dynamoe.models.cache.KVCache.begin_history)
    recurrent_rollback = True

    def __init__(self, config: ModelConfig, dtype=None):
        raw = config.raw
        if config.num_experts_per_tok != 1:
            raise ValueError(f"config field 'num_experts_per_tok' must be 1 for zaya (top-1 routing with a no-expert "
                             f"class), got {config.num_experts_per_tok}")
        bias = raw.get("lm_head_bias")
        if not isinstance(bias, bool):
            raise ValueError(f"config field 'lm_head_bias' must be true or false, got {bias!r}")
        object.__setattr__(self, "_carry", _RouterCarry())
        super().__init__(config, dtype)
        D = config.hidden_size
        self.model.input_hidden_states_scale = nn.Parameter(torch.ones(D, dtype=dtype))
        self.model.input_hidden_states_bias = nn.Parameter(torch.zeros(D, dtype=dtype))
        self.model.embed_tokens.__class__ = _ZayaEmbedding
        self.model.embed_tokens.__dict__["_stack"] = self.model
        self.lm_head.__class__ = _CastingLMHead
        if bias:
            self.lm_head.bias = nn.Parameter(torch.zeros(config.vocab_size, dtype=dtype))

    def build_norm(self, cfg: ModelConfig, dim: int, dtype) -> RMSNorm:
        return _CastingRMSNorm(dim, cfg.rms_norm_eps, dtype=dtype)

    def build_rotary(self, cfg: ModelConfig) -> RotaryByLayerType:
        return RotaryByLayerType({kind: RotaryEmbedding(r, int(cfg.head_dim * r.partial_rotary_factor),
                                                        cfg.max_position_embeddings)
                                  for kind, r in cfg.rope_by_layer_type})

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryByLayerType, dtype) -> ZayaDecoderLayer:
        D, kind, raw = cfg.hidden_size, cfg.layer_types[i], cfg.raw
        attn = CCAttention(D, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, i, rotary[kind],
                           raw.get("cca_time0"), raw.get("cca_time1"), bias=cfg.attention_bias,
                           sliding_window=cfg.layer_sliding_window(i), checks_position=i == 0, dtype=dtype)
        mlp = ZayaMoE(cfg, i, self._carry, dtype)
        return ZayaDecoderLayer(attn, mlp, self.build_norm(cfg, D, dtype), self.build_norm(cfg, D, dtype), D, dtype)

    def moe_layers(self) -> list:
        return []   # (ZAYA's MoE layers are its own: no SparseMoeBlock, no routing statistics)

