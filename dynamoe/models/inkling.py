"""Inkling's language model (``model_type: inkling_text``; the text model of the ``inkling_mm_model`` wrapper).

Legend: B batch rows, T new tokens, L keys, D model dim, H query heads, K key/value heads, d head dim, E routed
experts, S shared experts, k experts per token, R relative-bias extent.

* Embeddings RMS-normed (``embed_tokens.embed_norm``); logits of the final-normed state divided by
  ``logits_mup_width_multiplier``, cut to ``unpadded_vocab_size`` when the head is padded.
* Every layer: h += attn_sconv(attn(input_layernorm(h))); h += mlp_sconv(mlp(post_attention_layernorm(h))), where a
  short convolution is x + depthwise_causal_conv(x) in fp32 (``conv_kernel_size`` taps, fp32 weights).
* Attention of two kinds (``layer_types`` 'hybrid' full / 'hybrid_sliding' over ``sliding_window_size`` keys, the
  sliding layers with their own ``swa_*`` heads and head size): keys and values short-convolved after their
  projections, per-head q/k RMSNorms, softmax scale 1/d, no RoPE: a relative position bias instead -- ``r_proj`` gives
  each query d_rel mixing weights over the learned profiles ``rel_logits_proj.proj`` [d_rel, R], one bias per
  backward distance 0..R-1 (zero beyond; R the window on sliding layers, ``rel_extent`` on full ones); with
  ``log_scaling_n_floor`` the full layers' queries and biases are scaled by 1 + alpha ln(max((p + 1) / floor, 1)).
* MoE (``mlp_layer_types`` 'sparse'): fp32 logits of E routed and S shared experts (one ``gate.weight``); the top-k
  routed experts by sigmoid score plus a selection bias; the k chosen and the S shared experts weighted by their
  sigmoids normalised over those k + S (the shared experts act as a sink), times ``route_scale`` and
  ``gate.global_scale``; routed experts ``experts.gate_up_proj`` [E, 2F, D] / ``down_proj`` [E, D, F], shared ones
  stacked ``shared_experts.{gate,up,down}_proj`` [S, F, D] / [S, D, F]. Dense MLPs times ``global_scale``.

The conv windows (four per layer) live per sequence in the cache beside the keys and values, so the model keeps
per-sequence state: no prefix reuse (a speculative verification forward records them after every token, so that
rejected drafts can be cut off: ``recurrent_rollback``). Multi-token-prediction layers (``model.mtp.*``) are not loaded.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops.fused import Fused, Holds
from .attention import attention_mask, cached_length, write_kv
from .base import CausalLM
from .cache import KVCache
from .config import ModelConfig
from .family_fields import inkling_attention_sizes
from .linear_attention import record_conv_windows, slot_states
from .mamba import conv_with_state
from .moe_block import GatedMLP, SparseMoeBlock, glu_kind
from .norms import RMSNorm
from .weights import Stacked
from .wrapped import TextOfWrapper, WrapperLayout

__all__ = ["InklingForCausalLM", "InklingAttention", "InklingShortConv", "InklingMoE", "InklingDecoderLayer"]


class InklingShortConv(nn.Module):
    """x + causal depthwise conv(x) over time, in fp32 (``conv1d`` [C, 1, W + 1], fp32, no bias), divided by
    ``divisor`` (Inkling-2: sqrt(W + 2)); with a cache the last W inputs of each sequence in
    ``cache.buffer(layer, "conv_<name>", C, W)`` (fp32), zero where a row starts at 0."""

    def __init__(self, channels: int, kernel: int, layer_idx: int, name: str, *, checks_position: bool = False,
                 divisor: float = 1.0):
        super().__init__()
        if kernel < 1:
            raise ValueError(f"config field 'conv_kernel_size' must be an int >= 1, got {kernel}")
        self.layer_idx, self.name, self.kernel, self.checks_position = layer_idx, name, kernel, checks_position
        self.divisor = divisor
        self.conv1d = nn.Conv1d(channels, channels, kernel, groups=channels, padding=kernel - 1, bias=False,
                                dtype=torch.float32)

    def forward(self, x_BTC: Tensor, positions_BT: Tensor, cache: KVCache | None, slots: Tensor | None) -> Tensor:
        x = x_BTC.float()
        window = None
        if cache is not None:
            slot_states(cache, self.layer_idx, slots, positions_BT, x.size(1), None, None, self.checks_position)
            buf = cache.buffer(self.layer_idx, f"conv_{self.name}", x.size(-1), self.kernel - 1, dtype=torch.float32)
            window = buf[slots].masked_fill((positions_BT[:, 0] == 0).view(-1, 1, 1), 0)
            if cache.keeps_history:   # speculative verification: the window after every token
                record_conv_windows(cache, self.layer_idx, f"conv_{self.name}", slots, window, x.transpose(1, 2))
        y, window = conv_with_state(x.transpose(1, 2), self.conv1d, window)
        if cache is not None:
            buf[slots] = window
        y = y.transpose(1, 2) + x
        return (y if self.divisor == 1.0 else y / self.divisor).to(x_BTC.dtype)


class _RelativeLogits(nn.Module):
    """``proj`` [d_rel, R]: the learned bias-vs-distance profiles."""

    def __init__(self, d_rel: int, extent: int, dtype=None):
        super().__init__()
        self.proj = nn.Parameter(torch.zeros(d_rel, extent, dtype=dtype))


class InklingAttention(nn.Module):
    """Inkling's attention of one layer (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, i: int, heads: int, kv_heads: int, head_dim: int, dtype=None):
        super().__init__()
        raw, D = cfg.raw, cfg.hidden_size
        d_rel, kernel = raw.get("d_rel"), raw.get("conv_kernel_size")
        for name, v in (("d_rel", d_rel), ("conv_kernel_size", kernel)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"config field {name!r} must be an int >= 1, got {v!r}")
        self.layer_idx, self.num_heads, self.num_kv_heads, self.head_dim = i, heads, kv_heads, head_dim
        self.sliding_window = cfg.layer_sliding_window(i)
        extent = self.sliding_window or raw.get("rel_extent")
        if isinstance(extent, bool) or not isinstance(extent, int) or extent < 1:
            raise ValueError(f"config field 'rel_extent' must be an int >= 1, got {extent!r}")
        floor = None if self.sliding_window else raw.get("log_scaling_n_floor")
        if floor is not None and (isinstance(floor, bool) or not isinstance(floor, (int, float)) or floor <= 0):
            raise ValueError(f"config field 'log_scaling_n_floor' must be a number > 0 or null, got {floor!r}")
        self.log_floor, self.log_alpha = floor, float(raw.get("log_scaling_alpha", 0.1))
        self.scale = 1.0 / head_dim
        kw = dict(bias=False, dtype=dtype)
        self.q_proj = nn.Linear(D, heads * head_dim, **kw)
        self.k_proj = nn.Linear(D, kv_heads * head_dim, **kw)
        self.v_proj = nn.Linear(D, kv_heads * head_dim, **kw)
        self.r_proj = nn.Linear(D, heads * d_rel, **kw)
        self.o_proj = nn.Linear(heads * head_dim, D, **kw)
        self.k_sconv = InklingShortConv(kv_heads * head_dim, kernel, i, "k", checks_position=i == 0)
        self.v_sconv = InklingShortConv(kv_heads * head_dim, kernel, i, "v")
        self.q_norm = RMSNorm(head_dim, cfg.rms_norm_eps, dtype=dtype)
        self.k_norm = RMSNorm(head_dim, cfg.rms_norm_eps, dtype=dtype)
        self.rel_logits_proj = _RelativeLogits(d_rel, extent, dtype=dtype)

    def extra_repr(self) -> str:
        return (f"layer={self.layer_idx}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, sliding_window={self.sliding_window}, log_floor={self.log_floor}")

    def forward(self, x_BTD: Tensor, positions_BT: Tensor, cache: KVCache | None = None, slots: Tensor | None = None,
                kv_len: int | None = None) -> Tensor:
        B, T, _ = x_BTD.shape
        H, K, d = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_norm(self.q_proj(x_BTD).view(B, T, H, d)).transpose(1, 2)                       # [B, H, T, d]
        k = self.k_sconv(self.k_proj(x_BTD), positions_BT, cache, slots)
        v = self.v_sconv(self.v_proj(x_BTD), positions_BT, cache, slots)
        k = self.k_norm(k.view(B, T, K, d)).transpose(1, 2)                                        # [B, K, T, d]
        v = v.view(B, T, K, d).transpose(1, 2)
        k_pos = positions_BT
        if cache is not None:
            kv_len = cached_length(positions_BT, slots, kv_len)
            kv = write_kv(cache, self.layer_idx, slots, positions_BT, kv_len, k=k, v=v)
            k, v = kv["k"], kv["v"]
            k_pos = torch.arange(kv_len, device=x_BTD.device).expand(B, kv_len)
        proj = self.rel_logits_proj.proj
        R = proj.size(-1)
        rel_BHTR = (self.r_proj(x_BTD).view(B, T, H, -1) @ proj).transpose(1, 2)
        dist_B1TL = positions_BT[:, None, :, None] - k_pos[:, None, None, :]
        bias = rel_BHTR.gather(-1, dist_B1TL.clamp(0, R - 1).expand(B, H, T, k_pos.size(1)))
        bias = bias.masked_fill((dist_B1TL < 0) | (dist_B1TL >= R), 0.0)
        if self.log_floor is not None:  # (in fp32, as the original)
            tau = 1.0 + self.log_alpha * torch.log(((positions_BT + 1).float() / self.log_floor).clamp(min=1.0))
            tau = tau[:, None, :, None]
            q = (q.float() * tau).to(q.dtype)
            bias = (bias.float() * tau).to(bias.dtype)
        allowed = attention_mask(positions_BT, k_pos, self.sliding_window)                         # [B, 1, T, L]
        bias = bias.masked_fill(~allowed, float("-inf"))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=self.scale, enable_gqa=H != K)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, H * d))


class _SharedRouter(nn.Module):
    """The router's rows of the shared experts (``shared_weight`` [S, D], rows E.. of ``gate.weight``) and its
    ``global_scale`` [1] (fp32)."""

    def __init__(self, shared: int, hidden_size: int, dtype=None):
        super().__init__()
        self.shared_weight = nn.Parameter(torch.zeros(shared, hidden_size, dtype=dtype))
        self.global_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))


class _SharedExperts(nn.Module):
    """S SwiGLU experts stacked (``gate_proj`` / ``up_proj`` [S, F, D], ``down_proj`` [S, D, F]), each weighted per token."""

    def __init__(self, shared: int, hidden_size: int, width: int, glu: str, dtype=None):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.zeros(shared, width, hidden_size, dtype=dtype))
        self.up_proj = nn.Parameter(torch.zeros(shared, width, hidden_size, dtype=dtype))
        self.down_proj = nn.Parameter(torch.zeros(shared, hidden_size, width, dtype=dtype))
        self.act = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
                    "relu": F.relu}[glu]

    def forward(self, x_TD: Tensor, gammas_TS: Tensor) -> Tensor:
        x = x_TD.unsqueeze(0)                                                    # [1, T, D]
        g = x @ self.gate_proj.transpose(1, 2)                                   # [S, T, F]
        u = x @ self.up_proj.transpose(1, 2)
        h = self.act(g) * u * gammas_TS.t().unsqueeze(-1)
        return (h @ self.down_proj.transpose(1, 2)).float().sum(0).to(x_TD.dtype)


class InklingMoE(SparseMoeBlock):
    """Inkling's MoE (see the module docstring): the routed experts' logits by the MoE layer's gate (its selection
    bias too), the shared experts' by ``router``; the experts through :meth:`MoELayer.forward_routed`."""

    def __init__(self, cfg: ModelConfig, dtype=None):
        super().__init__(cfg, "sigmoid", normalize=False, glu=glu_kind(cfg.hidden_act), router_groups=False,
                         route_scale=1.0, dtype=dtype)
        S = cfg.n_shared_experts
        if S < 1:
            raise ValueError(f"config field 'n_shared_experts' must be >= 1 for inkling_text (the router's sink), got {S}")
        scale = cfg.raw.get("route_scale")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise ValueError(f"config field 'route_scale' must be a number, got {scale!r}")
        self.k, self.num_shared, self.route_scale = cfg.num_experts_per_tok, S, float(scale)
        self.router = _SharedRouter(S, cfg.hidden_size, dtype=dtype)
        self.shared_experts = _SharedExperts(S, cfg.hidden_size, cfg.expert_hidden_size, glu_kind(cfg.hidden_act),
                                             dtype=dtype)

    def forward(self, x_BTD: Tensor) -> Tensor:
        x_TD = x_BTD.reshape(-1, self.hidden_size)
        gate = self.moe.gates[0]
        logits = gate(x_TD)                                                       # fp32 [T, E]
        shared = F.linear(x_TD.float(), self.router.shared_weight.float())         # fp32 [T, S]
        ids_TK = (logits.sigmoid() + gate.e_score_correction_bias.float()).topk(self.k, dim=-1, sorted=False).indices
        lp = F.logsigmoid(torch.cat([logits.gather(-1, ids_TK), shared], dim=-1))
        w = torch.exp(lp - torch.logsumexp(lp, dim=-1, keepdim=True)) * self.route_scale
        w = (w * self.router.global_scale.float()).to(x_TD.dtype)
        y = self.moe.forward_routed(x_TD, ids_TK, w[:, :self.k])
        self.last_stats = y.routing_stats
        return (y + self.shared_experts(x_TD, w[:, self.k:])).view(x_BTD.shape)

    def decode_fused(self, h_TD: Tensor, norm: nn.Module) -> Fused:
        return Fused(None, Holds(), "Inkling's router (shared experts as a sink) has no kernel; its routed experts run "
                                    "through the experts' kernel in forward")


class InklingMLP(GatedMLP):
    """A dense SwiGLU MLP whose output is times ``global_scale`` [1]."""

    def __init__(self, hidden_size: int, intermediate_size: int, glu: str, dtype=None):
        super().__init__(hidden_size, intermediate_size, glu, dtype=dtype)
        self.global_scale = nn.Parameter(torch.ones(1, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) * self.global_scale

    def decode_fused(self, h_TD: Tensor, norm: nn.Module) -> Fused:
        return Fused(None, Holds(), "a dense MLP with an output scale (the kernel has none)")


class InklingDecoderLayer(nn.Module):
    """h += attn_sconv(attn(input_layernorm(h))); h += mlp_sconv(mlp(post_attention_layernorm(h)))."""

    def __init__(self, self_attn: InklingAttention, mlp: nn.Module, input_layernorm: nn.Module,
                 post_attention_layernorm: nn.Module, attn_sconv: InklingShortConv, mlp_sconv: InklingShortConv):
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm, self.post_attention_layernorm = input_layernorm, post_attention_layernorm
        self.attn_sconv, self.mlp_sconv = attn_sconv, mlp_sconv

    def forward(self, h_BTD: Tensor, positions_BT: Tensor, cache=None, slots=None, kv_len=None) -> Tensor:
        a = self.self_attn(self.input_layernorm(h_BTD), positions_BT, cache, slots, kv_len)
        h_BTD = h_BTD + self.attn_sconv(a, positions_BT, cache, slots)
        m = self.mlp(self.post_attention_layernorm(h_BTD))
        return h_BTD + self.mlp_sconv(m, positions_BT, cache, slots)


class _NormedEmbedding(nn.Embedding):
    """nn.Embedding followed by its RMSNorm ``embed_norm`` (set by the model)."""

    def forward(self, ids: Tensor) -> Tensor:
        return self.embed_norm(super().forward(ids))


class _InklingHead(nn.Linear):
    """nn.Linear over the hidden state divided by ``divisor``, its logits cut to the first ``keep`` (None: all)."""

    divisor, keep = 1.0, None

    def forward(self, h: Tensor) -> Tensor:
        logits = super().forward(h / self.divisor)
        return logits if self.keep is None else logits[..., :self.keep]


#: the hub's names (what transformers saves for the wrapper) for ours, after the wrapper's prefix
_HUB_RENAMES = ((".self_attn.q_proj.", ".attn.wq_du."), (".self_attn.k_proj.", ".attn.wk_dv."),
                (".self_attn.v_proj.", ".attn.wv_dv."), (".self_attn.r_proj.", ".attn.wr_du."),
                (".self_attn.o_proj.", ".attn.wo_ud."), (".self_attn.k_sconv.conv1d.", ".attn.k_sconv."),
                (".self_attn.v_sconv.conv1d.", ".attn.v_sconv."), (".self_attn.", ".attn."),
                (".attn_sconv.conv1d.", ".attn_sconv."), (".mlp_sconv.conv1d.", ".mlp_sconv."),
                (".input_layernorm.", ".attn_norm."), (".post_attention_layernorm.", ".mlp_norm."),
                (".mlp.gate_proj.weight", ".mlp.w13_dn.weight"), (".mlp.up_proj.weight", ".mlp.w13_dn.weight"),
                (".mlp.down_proj.weight", ".mlp.w2_md.weight"),
                (".mlp.gate.e_score_correction_bias", ".mlp.gate.bias"),
                (".mlp.shared_experts.gate_proj", ".mlp.shared_experts.shared_w13_weight"),
                (".mlp.shared_experts.up_proj", ".mlp.shared_experts.shared_w13_weight"),
                (".mlp.shared_experts.down_proj", ".mlp.shared_experts.shared_w2_weight"),
                (".embed_tokens.embed_norm.", ".embed_norm."), (".embed_tokens.", ".embed."))
#: our dense and shared experts' gate / up: interleaved rows of the hub's w13 (dim, slice)
_HUB_PARTS = {".mlp.gate_proj.weight": (0, slice(0, None, 2)), ".mlp.up_proj.weight": (0, slice(1, None, 2)),
              ".mlp.shared_experts.gate_proj": (1, slice(0, None, 2)),
              ".mlp.shared_experts.up_proj": (1, slice(1, None, 2))}


class InklingForCausalLM(TextOfWrapper, CausalLM):
    """Inkling's language model (see the module docstring); from an ``inkling_mm_model`` checkpoint, text only (the
    hub's layout, which transformers also saves for the wrapper: ``model.llm.*`` with its own tensor names --
    ``attn.wq_du``..., interleaved ``w13`` gate / up rows -- and ``model.llm.unembed``)."""

    wrapper_layouts = {"inkling_mm_model": WrapperLayout("model.llm.", "", unused=("model.visual.", "model.audio."))}
    text_only_reason = "its vision and audio towers are not loaded (dynamoe serves the Inkling text model only)"

    #: per-sequence state beside the KV cache (the short convolutions' windows): no prefix reuse
    recurrent_state = True
    #: ... but speculative decoding can cut it back past rejected drafts: its layers record their state after every
    #: token of a verification forward (dynamoe.models.cache.KVCache.begin_history)
    recurrent_rollback = True
    checkpoint_renames = ((".mlp.moe.gates.0.wg.", ".mlp.gate."),
                          (".mlp.moe.gates.0.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"),
                          (".mlp.router.shared_weight", ".mlp.gate.weight"),
                          (".mlp.router.global_scale", ".mlp.gate.global_scale"), (".mlp.moe.", ".mlp."))
    expert_layout = Stacked("gate_up_proj", "down_proj", suffix="")
    use_decode_plan = False   # (the layers are this module's own: no fused kernels to lay out)

    def __init__(self, config: ModelConfig, dtype=None):
        raw = config.raw
        mup, keep = raw.get("logits_mup_width_multiplier"), raw.get("unpadded_vocab_size")
        if isinstance(mup, bool) or not isinstance(mup, (int, float)) or not mup > 0:
            raise ValueError(f"config field 'logits_mup_width_multiplier' must be a number > 0, got {mup!r}")
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or not 1 <= keep):
            raise ValueError(f"config field 'unpadded_vocab_size' must be an int >= 1 or null, got {keep!r}")
        if config.tie_word_embeddings:
            raise ValueError("config field 'tie_word_embeddings' must be false for inkling_text (its checkpoints keep "
                             "the embeddings and the lm_head apart)")
        object.__setattr__(self, "sizes", inkling_attention_sizes(config))
        super().__init__(config, dtype)
        emb = self.model.embed_tokens
        emb.__class__ = _NormedEmbedding
        emb.embed_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.lm_head.__class__ = _InklingHead
        self.lm_head.divisor = float(mup)
        self.lm_head.keep = keep if keep is not None and keep < config.vocab_size else None
        E, S = config.num_experts, config.n_shared_experts
        object.__setattr__(self, "router_rows", {".mlp.moe.gates.0.wg.weight": (0, E, E + S),
                                                 ".mlp.router.shared_weight": (E, E + S, E + S)})

    @property
    def unused_checkpoint_prefixes(self) -> tuple:
        """The wrapper's towers, and the multi-token-prediction layers (not run by plain decoding)."""
        layout = self.wrapper_layout()
        return ("model.mtp.",) if layout is None else (*layout.unused, layout.stack + "mtp.")

    def build_layer(self, cfg: ModelConfig, i: int, rotary, dtype) -> InklingDecoderLayer:
        D, kind = cfg.hidden_size, cfg.layer_types[i]
        if kind not in ("full_attention", "sliding_attention"):
            raise ValueError(f"config field 'layer_types' entry {i} must be 'hybrid' or 'hybrid_sliding' for "
                             f"inkling_text, got {kind!r}")
        heads, kv_heads, d = self.sizes[i]
        attn = InklingAttention(cfg, i, heads, kv_heads, d, dtype=dtype)
        glu = glu_kind(cfg.hidden_act)
        if cfg.is_moe_layer(i):
            mlp = InklingMoE(cfg, dtype=dtype)
        else:
            if cfg.intermediate_size is None:
                raise ValueError(f"config field 'intermediate_size' is required: layer {i} has a dense MLP")
            mlp = InklingMLP(D, cfg.intermediate_size, glu, dtype=dtype)
        kernel = attn.k_sconv.kernel
        return InklingDecoderLayer(attn, mlp, RMSNorm(D, cfg.rms_norm_eps, dtype=dtype),
                                   RMSNorm(D, cfg.rms_norm_eps, dtype=dtype), InklingShortConv(D, kernel, i, "attn"),
                                   InklingShortConv(D, kernel, i, "mlp"))

    def checkpoint_rows(self, name: str):
        for suffix, rows in self.router_rows.items():
            if name.endswith(suffix):
                return rows
        return None

    # ---- the hub's layout (the wrapper's checkpoints) ---------------------------------------------------------------
    def adapt_to_checkpoint(self, names) -> None:
        hub = any(".attn.wq_du." in n for n in names)
        object.__setattr__(self, "hub_names", hub)
        if hub:
            object.__setattr__(self, "expert_layout", Stacked("w13_weight", "w2_weight", suffix="", interleaved=True))

    def checkpoint_name(self, name: str) -> str:
        out = super().checkpoint_name(name)
        if not self.__dict__.get("hub_names"):
            return out
        if name == "lm_head.weight":
            return (self.wrapper_layout().stack if self.wrapper_layout() else "") + "unembed.weight"
        for ours, theirs in _HUB_RENAMES:
            if ours in out:
                return out.replace(ours, theirs, 1)
        return out

    def checkpoint_slice(self, name: str):
        if not self.__dict__.get("hub_names"):
            return None
        for suffix, (dim, sl) in _HUB_PARTS.items():
            if name.endswith(suffix):
                module = self.get_submodule(name.rsplit(".", 1)[0]) if suffix.endswith(".weight") else None
                size = 2 * (module.out_features if module is not None else self.get_parameter(name).size(1))
                return dim, sl, size
        return None
