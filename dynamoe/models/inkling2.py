"""Inkling-2's language model (``model_type: inkling2_text``; the text model of the ``inkling2`` wrapper).

Legend: B batch rows, T new tokens, L keys, D model dim, H query heads, K key/value heads, d head dim, N residual
blocks so far, W conv taps, R relative-bias extent.

* Block attention residuals: the layers are grouped in blocks of ``n_layers_per_attn_res_block``; a layer's inputs
  are attention, per position, of a learned query over the RMS-normed (unweighted) states of the finished blocks
  and the running partial sum of the current one (scale D^-1/2, fp32): ``attention_input`` (one query; three on
  full layers: their queries, keys and values each get their own input and RMSNorm) and ``mlp_input``; the last
  layer's output through ``final_input`` before the final norm. A block boundary layer starts a new partial sum
  (its input joins the finished blocks). So the state between layers is the finished blocks and the partial sum,
  carried as one tensor [B, T, N + 1, D] (the embeddings' [B, T, D] before layer 0).
* Attention of two kinds (``layer_types`` 'hybrid' full / 'hybrid_sliding' over ``sliding_window_size`` keys, the
  sliding layers with their own ``swa_*`` heads and head size), no RoPE: queries scaled per head and channel, then
  L2-clipped to ``qk_l2_clip_threshold``; keys short-convolved then clipped; values short-convolved then RMS-normed
  (no weight); a relative position bias from per-token relative states (``r_proj``, scaled and clipped to
  ``rel_l2_clip_threshold``) mixing the learned bias-vs-distance profiles ``rel_logits_proj.proj`` [d_rel, R]
  (R the window, or ``rel_extent`` on full layers); a per-token, per-head sink logit (``sink_proj``) with a zero
  value; softmax scale d^-1/2; the output gated by sigmoid(``gate_proj``(x)) before ``o_proj``. Full layers also
  scale their queries and relative states by 1 + alpha ln(max((p + 1) / ``log_scaling_n_floor``, 1)) and convolve
  keys and values with per-token taps: static ``static_weight`` [W, C] plus ``weight_proj``(x) per KV head
  (:class:`Inkling2DynamicConv`).
* Short convolutions (fp32): (x + causal depthwise conv(x)) / sqrt(W + 1) on the sliding layers' keys and values
  and on both sublayer outputs; the dynamic ones divide by sqrt(2 W + 1).
* MoE on every layer: sigmoid scores, top-k by score plus a selection bias, the chosen scores renormalised times
  ``route_scale``; experts a softcapped SwiGLU (GLU kind 'silu_softcap': ``mlp_gate_softcap`` on the gate's linear
  factor, ``mlp_up_softcap`` on up), which the expert kernels do not compute: the torch expert path.
* Embeddings RMS-normed; logits cut to ``unpadded_vocab_size`` and softcapped at ``final_logit_softcapping`` (fp32).

Checkpoints: the hub's layout, which transformers saves (``model.llm.*``, ``attn.wq_du``..., interleaved ``w13``
expert rows, the block queries under ``attn_res``, ``model.llm.unembed`` padded to ``vocab_size`` rows). The conv
windows (four per layer) live per sequence in the cache beside the keys and values: no prefix reuse.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .attention import cached_length, write_kv
from .base import CausalLM
from .cache import KVCache
from .config import ModelConfig
from .family_fields import inkling_attention_sizes
from .inkling import InklingShortConv, _NormedEmbedding, _RelativeLogits
from .linear_attention import slot_states
from .moe_block import SparseMoeBlock
from .norms import RMSNorm
from .weights import Stacked
from .wrapped import TextOfWrapper, WrapperLayout

__all__ = ["Inkling2ForCausalLM", "Inkling2Attention", "Inkling2DynamicConv", "Inkling2MoE", "Inkling2DecoderLayer",
           "BlockAttentionResidual"]

#: scores of at most this many elements per attention call: longer prefills run in chunks of queries
_SCORE_BUDGET = 1 << 26


@dataclass(frozen=True)
class Inkling2Params:
    """The config fields of Inkling-2 beyond ModelConfig's (validated once)."""

    d_rel: int
    rel_extent: int
    log_scaling_n_floor: float
    log_scaling_alpha: float
    qk_clip: float
    rel_clip: float
    block_size: int
    gate_softcap: float
    up_softcap: float
    logit_softcap: float
    conv_kernel: int
    route_scale: float

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> "Inkling2Params":
        raw = cfg.raw

        def num(name: str, integer: bool = False, minimum: float = 0.0, strict: bool = True):
            v = raw.get(name)
            ok = not isinstance(v, bool) and isinstance(v, int if integer else (int, float))
            if not ok or (v <= minimum if strict else v < minimum):
                kind = "an int" if integer else "a number"
                raise ValueError(f"config field {name!r} must be {kind} {'>' if strict else '>='} {minimum:g}, "
                                 f"got {v!r}")
            return v

        if raw.get("scoring_func", "sigmoid") != "sigmoid":
            raise ValueError(f"config field 'scoring_func' must be 'sigmoid' for {cfg.family_type} (its router's "
                             f"only score), got {raw.get('scoring_func')!r}")
        if cfg.tie_word_embeddings:
            raise ValueError(f"config field 'tie_word_embeddings' must be false for {cfg.family_type} (its "
                             "checkpoints keep the embeddings and the unembedding apart)")
        return cls(d_rel=num("d_rel", True), rel_extent=num("rel_extent", True),
                   log_scaling_n_floor=float(num("log_scaling_n_floor")),
                   log_scaling_alpha=float(num("log_scaling_alpha", minimum=0.0, strict=False)),
                   qk_clip=float(num("qk_l2_clip_threshold")), rel_clip=float(num("rel_l2_clip_threshold")),
                   block_size=num("n_layers_per_attn_res_block", True), gate_softcap=float(num("mlp_gate_softcap")),
                   up_softcap=float(num("mlp_up_softcap")), logit_softcap=float(num("final_logit_softcapping")),
                   conv_kernel=num("conv_kernel_size", True), route_scale=float(num("route_scale")))


def _l2_clip(x: Tensor, threshold: float) -> Tensor:
    """x (fp32) scaled down to L2 norm ``threshold`` over the last dim where longer (shorter vectors unchanged)."""
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    return x * (threshold / (norm + 1e-6)).clamp(max=1.0)


def _unit_rms(x: Tensor, eps: float) -> Tensor:
    """x / rms(x) over the last dim in fp32 (an RMSNorm without a weight)."""
    x = x.float()
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


def block_attention(blocks_BTND: Tensor, partial_BTD: Tensor, q_QD: Tensor) -> Tensor:
    """Attention of the Q queries ``q_QD`` over the unit-RMS states of the finished blocks and the partial sum, per
    position (scale D^-1/2; keys and values the normed states): [B, T, Q, D] in fp32."""
    states = _unit_rms(torch.cat([blocks_BTND, partial_BTD.unsqueeze(-2).to(blocks_BTND.dtype)], dim=-2), 1e-6)
    probs = torch.softmax(states @ q_QD.float().t() * states.size(-1) ** -0.5, dim=-2)   # [B, T, N + 1, Q]
    return probs.transpose(-1, -2) @ states


class BlockAttentionResidual(nn.Module):
    """:func:`block_attention` of ``query`` ([D], or [Q, D] for Q inputs at once; fp32): ``forward(blocks [B, T, N, D],
    partial [B, T, D]) -> [B, T, Q, D]`` (fp32)."""

    def __init__(self, hidden_size: int, num_queries: int = 1):
        super().__init__()
        shape = (hidden_size,) if num_queries == 1 else (num_queries, hidden_size)
        self.query = nn.Parameter(torch.zeros(*shape, dtype=torch.float32))

    def forward(self, blocks_BTND: Tensor, partial_BTD: Tensor) -> Tensor:
        return block_attention(blocks_BTND, partial_BTD, self.query.view(-1, blocks_BTND.size(-1)))


class Inkling2DynamicConv(nn.Module):
    """(x + y) / sqrt(2 W + 1), y[t] = sum over lag 0..W-1 of x[t - lag] * (``static_weight``[lag] +
    ``weight_proj``(u[t])[head, lag]) -- the taps per token, from the layer's input u, shared by the channels of a
    key/value head (fp32). With a cache the last W - 1 inputs of each sequence in ``cache.buffer(layer,
    "conv_<name>", C, W - 1)`` (fp32), zero where a row starts at 0."""

    def __init__(self, channels: int, input_size: int, heads: int, kernel: int, layer_idx: int, name: str, *,
                 checks_position: bool = False, dtype=None):
        super().__init__()
        if kernel < 1:
            raise ValueError(f"config field 'conv_kernel_size' must be an int >= 1, got {kernel}")
        self.layer_idx, self.name, self.kernel, self.heads = layer_idx, name, kernel, heads
        self.checks_position = checks_position
        self.static_weight = nn.Parameter(torch.zeros(kernel, channels, dtype=dtype))
        self.weight_proj = nn.Linear(input_size, heads * kernel, bias=False, dtype=dtype)

    def extra_repr(self) -> str:
        return f"layer={self.layer_idx}, name={self.name}, kernel={self.kernel}, heads={self.heads}"

    def forward(self, x_BTC: Tensor, u_BTD: Tensor, positions_BT: Tensor, cache: KVCache | None,
                slots: Tensor | None) -> Tensor:
        B, T, C = x_BTC.shape
        W, Kh = self.kernel, self.heads
        taps = self.weight_proj(u_BTD).float().view(B, T, Kh, 1, W) + self.static_weight.float().t().reshape(Kh, -1, W)
        x = x_BTC.float()
        if cache is not None:
            slot_states(cache, self.layer_idx, slots, positions_BT, T, None, None, self.checks_position)
            buf = cache.buffer(self.layer_idx, f"conv_{self.name}", C, W - 1, dtype=torch.float32)
            window = buf[slots].masked_fill((positions_BT[:, 0] == 0).view(-1, 1, 1), 0)
        else:
            window = x.new_zeros(B, C, W - 1)
        context = torch.cat([window, x.transpose(1, 2)], dim=-1)                   # [B, C, W - 1 + T]
        if cache is not None:
            buf[slots] = context[..., context.size(-1) - (W - 1):]
        lagged = context.unfold(-1, W, 1).flip(-1).transpose(1, 2)                 # [B, T, C, W]: [..., lag]
        y = (lagged.reshape(B, T, Kh, -1, W) * taps).sum(-1).reshape(B, T, C)
        return ((y + x) / math.sqrt(2 * W + 1)).to(x_BTC.dtype)


class Inkling2Attention(nn.Module):
    """Inkling-2's attention of one layer (see the module docstring). ``forward(x_q, x_k, x_v [B, T, D], positions,
    cache, slots, kv_len) -> [B, T, D]`` (the three inputs the same tensor on sliding layers)."""

    def __init__(self, cfg: ModelConfig, p: Inkling2Params, i: int, heads: int, kv_heads: int, head_dim: int,
                 dtype=None):
        super().__init__()
        D = cfg.hidden_size
        self.layer_idx, self.num_heads, self.num_kv_heads, self.head_dim = i, heads, kv_heads, head_dim
        self.sliding_window = cfg.layer_sliding_window(i)
        self.full = self.sliding_window is None
        self.qk_clip, self.rel_clip, self.eps = p.qk_clip, p.rel_clip, cfg.rms_norm_eps
        self.log_floor, self.log_alpha = p.log_scaling_n_floor, p.log_scaling_alpha
        self.scale = head_dim ** -0.5
        kw = dict(bias=False, dtype=dtype)
        self.q_proj = nn.Linear(D, heads * head_dim, **kw)
        self.k_proj = nn.Linear(D, kv_heads * head_dim, **kw)
        self.v_proj = nn.Linear(D, kv_heads * head_dim, **kw)
        self.r_proj = nn.Linear(D, heads * p.d_rel, **kw)
        self.gate_proj = nn.Linear(D, heads * head_dim, **kw)
        self.o_proj = nn.Linear(heads * head_dim, D, **kw)
        self.sink_proj = nn.Linear(D, heads, **kw)
        self.q_scale = nn.Parameter(torch.ones(heads, head_dim, dtype=dtype))
        self.r_scale = nn.Parameter(torch.ones(heads, p.d_rel, dtype=dtype))
        self.rel_logits_proj = _RelativeLogits(p.d_rel, self.sliding_window or p.rel_extent, dtype=dtype)
        C, W = kv_heads * head_dim, p.conv_kernel
        if self.full:
            self.k_sconv = Inkling2DynamicConv(C, D, kv_heads, W, i, "k", checks_position=i == 0, dtype=dtype)
            self.v_sconv = Inkling2DynamicConv(C, D, kv_heads, W, i, "v", dtype=dtype)
        else:
            self.k_sconv = InklingShortConv(C, W, i, "k", checks_position=i == 0, divisor=math.sqrt(W + 1))
            self.v_sconv = InklingShortConv(C, W, i, "v", divisor=math.sqrt(W + 1))

    def extra_repr(self) -> str:
        return (f"layer={self.layer_idx}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, sliding_window={self.sliding_window}")

    def _log_scale(self, x: Tensor, positions_BT: Tensor) -> Tensor:
        """x [B, T, heads, n] times 1 + alpha ln(max((p + 1) / floor, 1)) (fp32, back to x's dtype)."""
        tau = 1.0 + self.log_alpha * torch.log(((positions_BT + 1).float() / self.log_floor).clamp(min=1.0))
        return (x.float() * tau[..., None, None]).to(x.dtype)

    def _clipped(self, x: Tensor, scale: Tensor, threshold: float, positions_BT: Tensor) -> Tensor:
        out = _l2_clip(x.float() * scale.float(), threshold).to(x.dtype)
        return self._log_scale(out, positions_BT) if self.full else out

    def _conv(self, conv: nn.Module, x: Tensor, u: Tensor, positions_BT: Tensor, cache, slots) -> Tensor:
        if self.full:
            return conv(x, u, positions_BT, cache, slots)
        return conv(x, positions_BT, cache, slots)

    def forward(self, xq_BTD: Tensor, xk_BTD: Tensor, xv_BTD: Tensor, positions_BT: Tensor,
                cache: KVCache | None = None, slots: Tensor | None = None, kv_len: int | None = None) -> Tensor:
        B, T, _ = xq_BTD.shape
        H, K, d = self.num_heads, self.num_kv_heads, self.head_dim
        dt = xq_BTD.dtype
        q = self._clipped(self.q_proj(xq_BTD).view(B, T, H, d), self.q_scale, self.qk_clip, positions_BT)
        k = self._conv(self.k_sconv, self.k_proj(xk_BTD), xk_BTD, positions_BT, cache, slots).view(B, T, K, d)
        v = self._conv(self.v_sconv, self.v_proj(xv_BTD), xv_BTD, positions_BT, cache, slots).view(B, T, K, d)
        k = _l2_clip(k.float(), self.qk_clip).to(dt).transpose(1, 2)                          # [B, K, T, d]
        v = _unit_rms(v, self.eps).to(dt).transpose(1, 2)
        if cache is not None:
            kv_len = cached_length(positions_BT, slots, kv_len)
            kv = write_kv(cache, self.layer_idx, slots, positions_BT, kv_len, k=k, v=v)
            k, v = kv["k"], kv["v"]
        r = self._clipped(self.r_proj(xq_BTD).view(B, T, H, -1), self.r_scale, self.rel_clip, positions_BT)
        rel_BHTR = (r @ self.rel_logits_proj.proj).transpose(1, 2)
        sink_BHT = self.sink_proj(xq_BTD).transpose(1, 2)
        out = self._attend(q.transpose(1, 2), k, v, rel_BHTR, sink_BHT, positions_BT)      # [B, T, H * d]
        gate = torch.sigmoid(self.gate_proj(xq_BTD).float())
        return self.o_proj((out.float() * gate).to(dt))

    def _attend(self, q_BHTd: Tensor, k_BKLd: Tensor, v_BKLd: Tensor, rel_BHTR: Tensor, sink_BHT: Tensor,
                positions_BT: Tensor) -> Tensor:
        """softmax over [scores + relative bias | sink] (fp32), the sink's column dropped; key j sits at position j
        (a cache's slot, or the T tokens of an uncached forward). Queries in chunks whose scores fit the budget,
        each over the keys its window can reach."""
        B, H, T, d = q_BHTd.shape
        K, L = k_BKLd.size(1), k_BKLd.size(2)
        G, R = H // K, rel_BHTR.size(-1)
        step = max(1, min(T, _SCORE_BUDGET // max(1, B * H * L)))
        # one chunk over keys a window does not cut much: every key, without reading the positions on the host
        whole = step == T and (self.full or L <= 2 * self.sliding_window)
        outs = []
        for a in range(0, T, step):
            b = min(a + step, T)
            pos = positions_BT[:, a:b]
            if whole:
                lo, hi = 0, L
            else:
                hi = min(L, int(pos.max()) + 1)
                lo = 0 if self.full else max(0, int(pos.min()) - self.sliding_window + 1)
            k_pos = torch.arange(lo, hi, device=pos.device)
            dist_B1TL = (pos[:, :, None] - k_pos).unsqueeze(1)
            rel = rel_BHTR[:, :, a:b]
            bias = rel.gather(-1, dist_B1TL.clamp(0, R - 1).expand(B, H, b - a, hi - lo))
            bias = bias.masked_fill((dist_B1TL < 0) | (dist_B1TL >= R), 0.0)
            allowed = dist_B1TL >= 0
            if self.sliding_window is not None:
                allowed = allowed & (dist_B1TL < self.sliding_window)
            q = q_BHTd[:, :, a:b].reshape(B, K, G, b - a, d)
            k, v = k_BKLd[:, :, lo:hi].unsqueeze(2), v_BKLd[:, :, lo:hi].unsqueeze(2)
            scores = (q @ k.transpose(-1, -2)) * self.scale + bias.view(B, K, G, b - a, hi - lo)
            scores = scores.masked_fill(~allowed.unsqueeze(1), float("-inf"))
            sink = sink_BHT[:, :, a:b].reshape(B, K, G, b - a, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1).float(), dim=-1)[..., :-1]
            outs.append((probs.to(v.dtype) @ v).reshape(B, H, b - a, d))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        return out.transpose(1, 2).reshape(B, T, H * d)


class Inkling2MoE(SparseMoeBlock):
    """Inkling-2's MoE (see the module docstring): the sigmoid router of a dynamoe MoELayer without groups, its
    experts of GLU kind 'silu_softcap'."""

    decode_refusal = ("Inkling-2's experts are a softcapped SwiGLU (tanh caps on the gate's linear factor and on up), "
                      "which the expert kernels do not compute: they run the torch expert path")

    def __init__(self, cfg: ModelConfig, p: Inkling2Params, dtype=None):
        super().__init__(cfg, "sigmoid", normalize=True, glu="silu_softcap", router_groups=False,
                         route_scale=p.route_scale, glu_alpha=p.gate_softcap, glu_limit=p.up_softcap, dtype=dtype)


class Inkling2DecoderLayer(nn.Module):
    """One layer over the state [B, T, N + 1, D] (finished blocks, then the partial sum; [B, T, D] before the first
    layer) -> the next state (see the module docstring). ``messages`` [B, T, 4, D] (Inkling-2-Loop's later passes
    through its loop layers, which then hold ``{q,k,v,mlp}_message_gate``): the query, key, value and MLP inputs
    each mixed with its message before its norm."""

    def __init__(self, cfg: ModelConfig, p: Inkling2Params, i: int, self_attn: Inkling2Attention,
                 mlp: Inkling2MoE, dtype=None):
        super().__init__()
        D, eps, W = cfg.hidden_size, cfg.rms_norm_eps, p.conv_kernel
        self.layer_idx, self.boundary = i, i % p.block_size == 0
        full = self_attn.full
        self.attention_input = BlockAttentionResidual(D, 3 if full else 1) if i > 0 else None
        self.mlp_input = BlockAttentionResidual(D)
        self.self_attn, self.mlp = self_attn, mlp
        norm = lambda: RMSNorm(D, eps, weight_in_fp32=True, dtype=dtype)  # noqa: E731
        if full:
            self.q_input_layernorm, self.k_input_layernorm, self.v_input_layernorm = norm(), norm(), norm()
        else:
            self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.attn_sconv = InklingShortConv(D, W, i, "attn", divisor=math.sqrt(W + 1))
        self.mlp_sconv = InklingShortConv(D, W, i, "mlp", divisor=math.sqrt(W + 1))

    def extra_repr(self) -> str:
        return f"layer={self.layer_idx}, block_boundary={self.boundary}"

    def forward(self, state: Tensor, positions_BT: Tensor, cache=None, slots=None, kv_len=None,
                messages: Tensor | None = None) -> Tensor:
        if state.dim() == 3:   # the embeddings: no finished block yet
            blocks, partial = state.unsqueeze(-2)[:, :, :0], state
        else:
            blocks, partial = state[:, :, :-1], state[:, :, -1]
        dt = partial.dtype
        if self.attention_input is None:
            inputs = (partial,) * 3
        else:
            inputs = self.attention_input(blocks, partial).unbind(-2)
            inputs = inputs * 3 if len(inputs) == 1 else inputs
        if messages is not None:
            m_q, m_k, m_v, m_mlp = messages.unbind(-2)
            inputs = (self.q_message_gate(inputs[0], m_q), self.k_message_gate(inputs[1], m_k),
                      self.v_message_gate(inputs[2], m_v))
        if self.self_attn.full:
            norms = (self.q_input_layernorm, self.k_input_layernorm, self.v_input_layernorm)
            xq, xk, xv = (n(x).to(dt) for n, x in zip(norms, inputs))
        elif messages is None:
            xq = xk = xv = self.input_layernorm(inputs[0]).to(dt)
        else:
            xq, xk, xv = (self.input_layernorm(x).to(dt) for x in inputs)
        a = self.self_attn(xq, xk, xv, positions_BT, cache, slots, kv_len)
        a = self.attn_sconv(a, positions_BT, cache, slots).float()
        if self.boundary:   # the layer's input closes a block; the new partial sum starts here
            blocks, residual = torch.cat([blocks, partial.unsqueeze(-2)], dim=-2), a
        else:
            residual = partial.float() + a
        m_in = self.mlp_input(blocks, residual)[:, :, 0]
        if messages is not None:
            m_in = self.mlp_message_gate(m_in, m_mlp)
        m = self.mlp(self.post_attention_layernorm(m_in).to(dt))
        out = (residual + self.mlp_sconv(m, positions_BT, cache, slots).float()).to(dt)
        return torch.cat([blocks, out.unsqueeze(-2)], dim=-2)


class _FinalNorm(RMSNorm):
    """The final norm over ``final_input``'s mix of the last state [B, T, N + 1, D] (the model's ``model.norm``)."""

    def __init__(self, hidden_size: int, eps: float, dtype=None):
        super().__init__(hidden_size, eps, weight_in_fp32=True, dtype=dtype)
        self.final_input = BlockAttentionResidual(hidden_size)

    def forward(self, state: Tensor) -> Tensor:
        if state.dim() == 3:   # (a model of no layers)
            state = state.unsqueeze(-2)
        mixed = self.final_input(state[:, :, :-1], state[:, :, -1])[:, :, 0]
        return super().forward(mixed).to(state.dtype)


class _Inkling2Head(nn.Linear):
    """nn.Linear whose logits are cut to the first ``keep`` (None: all) and softcapped at ``cap`` (in fp32, returned
    in the weight's dtype as every family's)."""

    keep, cap = None, 30.0

    def forward(self, h: Tensor) -> Tensor:
        logits = super().forward(h)
        if self.keep is not None:
            logits = logits[..., :self.keep]
        return (torch.tanh(logits.float() / self.cap) * self.cap).to(logits.dtype)


#: our names -> the hub's (what transformers saves), after ``model.`` -> ``model.llm.``; first match wins
_HUB_RENAMES = ((".self_attn.q_proj.", ".attn.wq_du."), (".self_attn.k_proj.", ".attn.wk_dv."),
                (".self_attn.v_proj.", ".attn.wv_dv."), (".self_attn.r_proj.", ".attn.wr_du."),
                (".self_attn.o_proj.", ".attn.wo_ud."), (".self_attn.gate_proj.", ".attn.gate_attn."),
                (".self_attn.sink_proj.", ".attn.attn_sink_proj."), (".self_attn.q_scale", ".attn.q_l2_clip.scale"),
                (".self_attn.r_scale", ".attn.rel_l2_clip.scale"),
                (".self_attn.k_sconv.conv1d.weight", ".attn.k_sconv.weight"),
                (".self_attn.v_sconv.conv1d.weight", ".attn.v_sconv.weight"),
                (".self_attn.k_sconv.static_weight", ".attn.k_sconv.static_w"),
                (".self_attn.v_sconv.static_weight", ".attn.v_sconv.static_w"),
                (".self_attn.k_sconv.weight_proj.weight", ".attn.k_sconv.weight_proj"),
                (".self_attn.v_sconv.weight_proj.weight", ".attn.v_sconv.weight_proj"),
                (".self_attn.", ".attn."), (".attn_sconv.conv1d.", ".attn_sconv."),
                (".mlp_sconv.conv1d.", ".mlp_sconv."), (".input_layernorm.", ".attn_norm."),
                (".post_attention_layernorm.", ".mlp_norm."), (".q_input_layernorm.", ".q_input_norm."),
                (".k_input_layernorm.", ".k_input_norm."), (".v_input_layernorm.", ".v_input_norm."),
                (".mlp.moe.gates.0.wg.", ".mlp.gate."), (".mlp.moe.gates.0.e_score_correction_bias", ".mlp.gate.bias"),
                (".mlp.moe.", ".mlp."), ("model.embed_tokens.embed_norm.", "model.embed_norm."),
                ("model.embed_tokens.", "model.embed."), ("model.norm.final_input.query", "model.attn_res.output_query"))
_BLOCK_QUERY = re.compile(r"model\.layers\.(\d+)\.(attention|mlp)_input\.query$")


class Inkling2ForCausalLM(TextOfWrapper, CausalLM):
    """Inkling-2's language model (see the module docstring); from an ``inkling2`` checkpoint, text only."""

    wrapper_layouts = {"inkling2": WrapperLayout("model.llm.", "", unused=("model.visual.",))}
    text_only_reason = "its vision tower is not loaded (dynamoe serves the Inkling-2 text model only)"
    #: where the hub's layout keeps the text model, wrapped or not
    stack = "model.llm."

    #: per-sequence state beside the KV cache (the short convolutions' windows): no prefix reuse
    recurrent_state = True
    expert_layout = Stacked("w13_weight", "w2_weight", suffix="", interleaved=True)
    use_decode_plan = False   # (the layers are this module's own: no fused kernels to lay out)

    def __init__(self, config: ModelConfig, dtype=None):
        p = Inkling2Params.from_config(config)
        keep = config.raw.get("unpadded_vocab_size")
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int)
                                 or not 1 <= keep <= config.vocab_size):
            raise ValueError(f"config field 'unpadded_vocab_size' must be an int in [1, vocab_size="
                             f"{config.vocab_size}] or null, got {keep!r}")
        object.__setattr__(self, "params", p)
        object.__setattr__(self, "sizes", inkling_attention_sizes(config))
        super().__init__(config, dtype)
        emb = self.model.embed_tokens
        emb.__class__ = _NormedEmbedding
        emb.embed_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, weight_in_fp32=True, dtype=dtype)
        self.lm_head.__class__ = _Inkling2Head
        self.lm_head.keep = keep if keep is not None and keep < config.vocab_size else None
        self.lm_head.cap = p.logit_softcap

    def build_norm(self, cfg: ModelConfig, dim: int, dtype) -> nn.Module:
        return _FinalNorm(dim, cfg.rms_norm_eps, dtype=dtype)

    def build_layer(self, cfg: ModelConfig, i: int, rotary, dtype) -> Inkling2DecoderLayer:
        kind = cfg.layer_types[i]
        if kind not in ("full_attention", "sliding_attention"):
            raise ValueError(f"config field 'layer_types' entry {i} must be 'hybrid' or 'hybrid_sliding' for "
                             f"{cfg.family_type}, got {kind!r}")
        heads, kv_heads, d = self.sizes[i]
        attn = Inkling2Attention(cfg, self.params, i, heads, kv_heads, d, dtype=dtype)
        return Inkling2DecoderLayer(cfg, self.params, i, attn, Inkling2MoE(cfg, self.params, dtype=dtype), dtype=dtype)

    def adapt_to_checkpoint(self, names) -> None:
        """Refuse the released checkpoints' block-quantized experts by name (their MXFP8 / NVFP4 ``w13_weight`` with
        ``_scale`` tensors beside: a format dynamoe's loader does not read), before any tensor is read."""
        scales = sorted(n for n in names if re.search(r"\.mlp\.experts\.w(13|2)_weight_(scale|amax)", n))
        if scales:
            raise ValueError(f"{self.config.family_type}: the checkpoint's experts are block-quantized (MXFP8 / NVFP4: "
                             f"{scales[0]} and {len(scales) - 1} more scale tensors), a format dynamoe does not read (it reads "
                             "the experts unquantized: bf16 / fp32 w13_weight and w2_weight)")

    def checkpoint_name(self, name: str) -> str:
        if name == "lm_head.weight":
            return self.stack + "unembed.weight"
        m = _BLOCK_QUERY.match(name)
        if m:
            i, kind = int(m.group(1)), m.group(2)
            # (the hub numbers the attention inputs from layer 1: layer 0 has none)
            if kind == "attention":
                return f"{self.stack}attn_res.attn_queries.{i - 1}"
            return f"{self.stack}attn_res.mlp_queries.{i}"
        for ours, theirs in _HUB_RENAMES:
            if ours in name:
                name = name.replace(ours, theirs, 1)
                break
        return self.stack + name.removeprefix("model.")
