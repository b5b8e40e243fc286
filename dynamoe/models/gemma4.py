"""Gemma 4's language model (``model_type: gemma4_text``; the text model of the ``gemma4`` multimodal wrapper,
``Gemma4ForConditionalGeneration``).

Legend: B batch rows, T tokens, D model dim, H query heads, K key/value heads, d head dim, L layers, P per-layer
input dim, E experts, k experts per token.

* Embeddings times sqrt(D) (the factor rounded to the weights' dtype, as transformers does).
* Layers of two kinds (``layer_types``: by default every 6th full attention, the others sliding over
  ``sliding_window`` keys; the last is always full), each with its RoPE (sliding: plain over the whole head; full:
  'proportional', a quarter of the head's frequency pairs turning) and its own head size / KV heads
  (``per_layer_config``, else ``global_head_dim`` / ``num_global_key_value_heads``:
  :func:`~dynamoe.models.family_fields.gemma4_attention_layers`). Attention: q/k RMSNorms per head before RoPE, values
  RMS-normed without a weight, softmax scale 1; with ``attention_k_eq_v`` the full layers have no ``v_proj`` (the
  values are the key projection, normed apart). The last ``num_kv_shared_layers`` layers have no k/v projections:
  they attend over the keys and values of the last earlier layer of their kind (in the cache: that layer's).
* Sandwich norms around the attention and the feed-forward: h += post_norm(attn(norm(h))); then a GeGLU MLP (twice
  as wide on the KV-shared layers with ``use_double_wide_mlp``), and with ``enable_moe_block`` an MoE beside it: its
  router reads the un-normed h (RMS-normed without weight, times ``router.scale`` and D^-1/2, a softmax over E, top-k
  renormalised, each weight times ``router.per_expert_scale`` of its expert), its experts (GeGLU, ``experts.gate_up_proj``
  [E, 2F, D], ``experts.down_proj`` [E, D, F]) pre_feedforward_layernorm_2(h); the sum of both, each post-normed,
  post-normed again, added to h.
* Per-layer embeddings (``hidden_size_per_layer_input`` P > 0): each token's ``embed_tokens_per_layer`` row (times
  sqrt(P)) plus the RMS-normed projection of its embedding (``per_layer_model_projection`` times D^-1/2), times
  2^-1/2, gives layer i a vector of P; after the feed-forward h += norm(proj(act(gate(h)) * that vector)).
* Every layer's output times its ``layer_scalar``; final norm; logits tanh-softcapped at ``final_logit_softcapping``.
All RMSNorms compute in fp32 and multiply by their weight there.

The wrapper keeps the text model under ``model.language_model.`` (lm_head at the top, tied by default); its vision
and audio towers and their embedders are not loaded (the server refuses images). No fused decode kernels: the layers
have their own forward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops.fused import Fused, Holds, Unfusable
from .attention import Attention, attend
from .base import CausalLM
from .beam import _SoftcappedLMHead
from .cache import KVCache
from .config import ModelConfig
from .family_fields import gemma4_attention_layers
from .mimo_v2_flash import RotaryByLayerType
from .moe_block import GatedMLP, SparseMoeBlock, glu_kind
from .norms import RMSNorm
from .rope import RotaryEmbedding, apply_rope
from .weights import Stacked
from .wrapped import TextOfWrapper, WrapperLayout

__all__ = ["Gemma4ForCausalLM", "Gemma4Attention", "Gemma4MoE", "Gemma4DecoderLayer"]

_ACT = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


def rms(x: Tensor, eps: float) -> Tensor:
    """x / sqrt(mean(x^2) + eps) in fp32, cast back (Gemma 4's RMSNorm without a weight: values, the router)."""
    h = x.float()
    return (h * torch.pow(h.pow(2).mean(-1, keepdim=True) + eps, -0.5)).to(x.dtype)


class _ForwardState:
    """What one forward's layers share beyond the hidden states (set by the model's forward, cleared after): the
    per-layer inputs [B, T, L, P], and without a cache the keys and values of the layers whose are shared."""

    def __init__(self):
        self.per_layer: Tensor | None = None
        self.kv: dict[int, tuple[Tensor, Tensor]] = {}


class Gemma4Embedding(nn.Embedding):
    """nn.Embedding times ``scale`` rounded to the weight's dtype (same parameter and name)."""

    scale = 1.0

    def forward(self, ids: Tensor) -> Tensor:
        return super().forward(ids) * torch.tensor(self.scale, dtype=self.weight.dtype)


class Gemma4Attention(Attention):
    """Gemma 4's attention of one layer (see the module docstring); ``kv_source`` != ``layer_idx``: a KV-shared layer
    (no k/v projections); ``k_eq_v``: no ``v_proj``, the values are the key projection."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, layer_idx: int,
                 rotary: RotaryEmbedding, *, kv_source: int, state: _ForwardState, bias: bool = False,
                 norm_eps: float = 1e-6, sliding_window: int | None = None, k_eq_v: bool = False, dtype=None):
        super().__init__(hidden_size, num_heads, num_kv_heads, head_dim, layer_idx, rotary, qkv_bias=bias, o_bias=bias,
                         qk_norm=True, norm_eps=norm_eps, sliding_window=sliding_window, scale=1.0, dtype=dtype)
        self.eps, self.kv_source, self.stores_kv = norm_eps, kv_source, False
        self.q_norm = RMSNorm(head_dim, norm_eps, weight_in_fp32=True, dtype=dtype)
        if kv_source != layer_idx:
            self.k_proj = self.v_proj = self.k_norm = None
        else:
            self.k_norm = RMSNorm(head_dim, norm_eps, weight_in_fp32=True, dtype=dtype)
            if k_eq_v:
                self.v_proj = None
        object.__setattr__(self, "state", state)

    def _decode_weights(self, kernels, holds, norm, dtype):
        raise Unfusable("Gemma 4's attention (value norm, shared keys and values) has no fused kernel")

    def forward(self, x_BTD: Tensor, positions_BT: Tensor, cache: KVCache | None = None, slots: Tensor | None = None,
                kv_len: int | None = None) -> Tensor:
        B, T, _ = x_BTD.shape
        H, K, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.k_proj is not None and self.v_proj is not None:
            q, k, v = self._project_qkv(x_BTD)
        else:
            q = self.q_proj(x_BTD)
            k = v = None if self.k_proj is None else self.k_proj(x_BTD)
        q = self.q_norm(q.view(B, T, H, d)).transpose(1, 2)                              # [B, H, T, d]
        cos, sin = self.rotary(positions_BT, q.dtype)
        q = apply_rope(q, cos, sin)
        if k is None:  # a KV-shared layer: the source layer's keys and values (written before, in this forward)
            if cache is None:
                k, v = self.state.kv[self.kv_source]
                k_pos = None
            else:
                kv_len = int(positions_BT[:, -1].max()) + 1 if kv_len is None else kv_len
                k = cache.rows(cache.kv_pool(self.kv_source, "k", K, d), slots, kv_len).to(q.dtype)
                v = cache.rows(cache.kv_pool(self.kv_source, "v", K, d), slots, kv_len).to(q.dtype)
                k_pos = torch.arange(kv_len, device=q.device).expand(B, kv_len)
            out = attend(q, k, v, positions_BT, k_pos, self.scale, self.sliding_window)
        else:
            k = apply_rope(self.k_norm(k.view(B, T, K, d)).transpose(1, 2), cos, sin)      # [B, K, T, d]
            v = rms(v.view(B, T, K, d), self.eps).transpose(1, 2)
            if self.stores_kv and cache is None:
                self.state.kv[self.layer_idx] = (k, v)
            out = self.attend_cached(q, k, v, positions_BT, cache, slots, kv_len, self.sliding_window)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, H * d))


class _RouterScales(nn.Module):
    """The router's ``scale`` [D] (of its normed input) and ``per_expert_scale`` [E] (of the routing weights)."""

    def __init__(self, hidden_size: int, num_experts: int, dtype=None):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts, dtype=dtype))


class Gemma4MoE(SparseMoeBlock):
    """Gemma 4's MoE (see the module docstring): ``forward(x [B, T, D] the experts' input, h [B, T, D] the router's)``;
    the logits by the MoE layer's gate, the experts through :meth:`MoELayer.forward_routed`."""

    def __init__(self, cfg: ModelConfig, dtype=None):
        super().__init__(cfg, "softmax", normalize=True, glu=glu_kind(cfg.hidden_act), dtype=dtype)
        self.router = _RouterScales(cfg.hidden_size, cfg.num_experts, dtype=dtype)
        self.eps, self.k = cfg.rms_norm_eps, cfg.num_experts_per_tok

    def forward(self, x_BTD: Tensor, h_BTD: Tensor) -> Tensor:
        D = self.hidden_size
        r = rms(h_BTD.reshape(-1, D), self.eps) * self.router.scale * D ** -0.5
        probs = torch.softmax(self.moe.gates[0](r).float(), dim=-1)                       # fp32 [T, E]
        w_TK, ids_TK = probs.topk(self.k, dim=-1)
        w_TK = w_TK / w_TK.sum(dim=-1, keepdim=True) * self.router.per_expert_scale[ids_TK]
        y = self.moe.forward_routed(x_BTD, ids_TK, w_TK)
        self.last_stats = y.routing_stats
        return y

    def decode_fused(self, h_TD: Tensor, norm: nn.Module) -> Fused:
        return Fused(None, Holds(), "Gemma 4's router (normed input, per-expert scales) has no kernel; its experts run "
                                    "through the experts' kernel in forward")


class Gemma4DecoderLayer(nn.Module):
    """One Gemma 4 layer (see the module docstring); ``moe_block`` None: no MoE; ``per_layer_input_gate`` None: no
    per-layer input."""

    def __init__(self, cfg: ModelConfig, i: int, self_attn: Gemma4Attention, mlp: GatedMLP, moe_block: Gemma4MoE | None,
                 state: _ForwardState, dtype=None):
        super().__init__()
        D, eps = cfg.hidden_size, cfg.rms_norm_eps

        def norm(dim=D):
            return RMSNorm(dim, eps, weight_in_fp32=True, dtype=dtype)

        self.layer_idx = i
        self.self_attn, self.mlp, self.moe_block = self_attn, mlp, moe_block
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        if moe_block is not None:
            self.pre_feedforward_layernorm_2 = norm()
            self.post_feedforward_layernorm_1, self.post_feedforward_layernorm_2 = norm(), norm()
        P = cfg.raw.get("hidden_size_per_layer_input") or 0
        self.per_layer_input_gate = nn.Linear(D, P, bias=False, dtype=dtype) if P else None
        if P:
            self.per_layer_projection = nn.Linear(P, D, bias=False, dtype=dtype)
            self.post_per_layer_input_norm = norm()
            self.act = _ACT[glu_kind(cfg.hidden_act)]
        self.register_buffer("layer_scalar", torch.ones(1, dtype=dtype))
        object.__setattr__(self, "state", state)

    def forward(self, h_BTD: Tensor, positions_BT: Tensor, cache=None, slots=None, kv_len=None) -> Tensor:
        a = self.self_attn(self.input_layernorm(h_BTD), positions_BT, cache, slots, kv_len)
        h_BTD = h_BTD + self.post_attention_layernorm(a)
        m = self.mlp(self.pre_feedforward_layernorm(h_BTD))
        if self.moe_block is not None:
            e = self.moe_block(self.pre_feedforward_layernorm_2(h_BTD), h_BTD)
            m = self.post_feedforward_layernorm_1(m) + self.post_feedforward_layernorm_2(e)
        h_BTD = h_BTD + self.post_feedforward_layernorm(m)
        if self.per_layer_input_gate is not None:
            g = self.act(self.per_layer_input_gate(h_BTD)) * self.state.per_layer[:, :, self.layer_idx]
            h_BTD = h_BTD + self.post_per_layer_input_norm(self.per_layer_projection(g))
        return h_BTD * self.layer_scalar


class Gemma4ForCausalLM(TextOfWrapper, CausalLM):
    """Gemma 4's language model (see the module docstring); from a ``gemma4`` checkpoint, text only."""

    checkpoint_renames = ((".moe_block.moe.gates.0.wg.", ".router.proj."), (".moe_block.router.", ".router."),
                          (".moe_block.moe.experts", ".experts"))
    expert_layout = Stacked("gate_up_proj", "down_proj", suffix="")
    wrapper_layouts = {"gemma4": WrapperLayout("model.language_model.", "",
                                               unused=("model.vision_tower.", "model.audio_tower.",
                                                       "model.embed_vision.", "model.embed_audio."))}
    text_only_reason = "its vision and audio towers are not loaded (dynamoe serves the Gemma 4 text model only)"
    use_decode_plan = False   # (the layers are this module's own: no fused kernels to lay out)

    def __init__(self, config: ModelConfig, dtype=None):
        raw = config.raw
        cap = raw.get("final_logit_softcapping")
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0):
            raise ValueError(f"config field 'final_logit_softcapping' must be a number > 0 or null, got {cap!r}")
        P = raw.get("hidden_size_per_layer_input") or 0
        V_ple = raw.get("vocab_size_per_layer_input")
        for name, v, low in (("hidden_size_per_layer_input", P, 0), ("vocab_size_per_layer_input", V_ple, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"config field {name!r} must be an int >= {low}, got {v!r}")
        for name in ("attention_k_eq_v", "use_double_wide_mlp"):
            if not isinstance(raw.get(name), bool):
                raise ValueError(f"config field {name!r} must be true or false, got {raw.get(name)!r}")
        if config.intermediate_size is None:
            raise ValueError("config field 'intermediate_size' (the dense MLPs' width) is required for gemma4_text")
        object.__setattr__(self, "layout", gemma4_attention_layers(config))
        object.__setattr__(self, "state", _ForwardState())
        super().__init__(config, dtype)
        emb = self.model.embed_tokens
        emb.__class__, emb.scale = Gemma4Embedding, config.hidden_size ** 0.5
        for i, g in enumerate(self.layout):
            if g.kv_source != i:
                self.model.layers[g.kv_source].self_attn.stores_kv = True
        self.ple_dim = P
        if P:
            L, D = config.num_hidden_layers, config.hidden_size
            self.model.embed_tokens_per_layer = Gemma4Embedding(V_ple, L * P, dtype=dtype)
            self.model.embed_tokens_per_layer.scale = P ** 0.5
            self.model.per_layer_model_projection = nn.Linear(D, L * P, bias=False, dtype=dtype)
            self.model.per_layer_projection_norm = RMSNorm(P, config.rms_norm_eps, weight_in_fp32=True, dtype=dtype)
        if cap is not None:  # (the same parameter and name: loading and tying are unchanged)
            self.lm_head.__class__ = _SoftcappedLMHead
            self.lm_head.softcap = float(cap)

    def build_norm(self, cfg: ModelConfig, dim: int, dtype) -> RMSNorm:
        return RMSNorm(dim, cfg.rms_norm_eps, weight_in_fp32=True, dtype=dtype)

    def build_rotary(self, cfg: ModelConfig) -> RotaryByLayerType:
        tables = {}
        for kind, r in cfg.rope_by_layer_type:
            if kind not in cfg.layer_types:
                continue
            d = self.layout[cfg.layer_types.index(kind)].head_dim
            if r.rope_type == "default":   # (transformers' Gemma 4 rotates the whole head whatever the factor says)
                dim = d
            elif r.rope_type == "proportional" or r.partial_rotary_factor == 1.0:
                dim = d
            else:
                raise ValueError(f"config field 'rope_parameters.{kind}': rope_type {r.rope_type!r} with "
                                 f"partial_rotary_factor {r.partial_rotary_factor} is not supported for Gemma 4 "
                                 "(transformers' Gemma 4 cannot run it either); allowed: a factor of 1, or 'default' / "
                                 "'proportional'")
            tables[kind] = RotaryEmbedding(r, dim, cfg.max_position_embeddings)
        return RotaryByLayerType(tables)

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryByLayerType, dtype) -> Gemma4DecoderLayer:
        D, kind, g = cfg.hidden_size, cfg.layer_types[i], self.layout[i]
        if kind not in ("full_attention", "sliding_attention"):
            raise ValueError(f"config field 'layer_types' entry {i} must be 'full_attention' or 'sliding_attention' "
                             f"for gemma4_text, got {kind!r}")
        attn = Gemma4Attention(D, cfg.num_attention_heads, g.num_key_value_heads, g.head_dim, i, rotary[kind],
                               kv_source=g.kv_source, state=self.state, bias=cfg.attention_bias, norm_eps=cfg.rms_norm_eps,
                               sliding_window=cfg.layer_sliding_window(i),
                               k_eq_v=cfg.raw["attention_k_eq_v"] and kind == "full_attention", dtype=dtype)
        wide = 2 if cfg.raw["use_double_wide_mlp"] and g.kv_source != i else 1
        mlp = GatedMLP(D, cfg.intermediate_size * wide, glu_kind(cfg.hidden_act), dtype=dtype)
        moe = Gemma4MoE(cfg, dtype=dtype) if cfg.is_moe_layer(i) else None
        return Gemma4DecoderLayer(cfg, i, attn, mlp, moe, self.state, dtype=dtype)

    def moe_layers(self) -> list[tuple[int, SparseMoeBlock]]:
        return [(i, layer.moe_block) for i, layer in enumerate(self.model.layers) if layer.moe_block is not None]

    def per_layer_inputs(self, input_ids: Tensor) -> Tensor:
        """[B, T, L, P]: each layer's per-layer input of each token (see the module docstring)."""
        m, B, T = self.model, *input_ids.shape
        L, P = self.config.num_hidden_layers, self.ple_dim
        ple = m.embed_tokens_per_layer(input_ids).view(B, T, L, P)
        emb = m.embed_tokens(input_ids)
        proj = m.per_layer_model_projection(emb) * self.config.hidden_size ** -0.5
        proj = m.per_layer_projection_norm(proj.view(B, T, L, P))
        return (proj + ple) * 2.0 ** -0.5

    def forward(self, input_ids: Tensor, cache: KVCache | None = None, slots: Tensor | None = None,
                logits_to_keep: int = 0, return_hidden: bool = False):
        st = self.state
        if self.ple_dim and isinstance(input_ids, Tensor) and input_ids.dim() == 2:
            st.per_layer = self.per_layer_inputs(input_ids)
        try:
            return super().forward(input_ids, cache, slots, logits_to_keep, return_hidden)
        finally:
            st.per_layer, st.kv = None, {}

