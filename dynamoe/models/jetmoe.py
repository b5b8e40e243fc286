"""JetMoE (``model_type: jetmoe``): mixture-of-attention-heads (MoA) layers and SwiGLU MoE layers, both routed by
top-k of a linear router's logits weighted by a softmax over the k.

Legend: B batch, T tokens, N = B*T, E experts, k chosen per token, K key/value heads, d head dim (``kv_channels``),
D model dim.

Attention (MoA): one key/value projection ``kv_proj`` [2 K d, D] (keys, then values) shared by all heads; each token
picks k attention experts, and expert e's ``input_linear[e]`` [K d, D] projects the token's queries for K heads --
H = k K query heads per token, the heads of choice j reading the K key/value heads as they are (query head (j, g)
attends with key/value head g). RoPE (half-split) on queries and keys; each choice's attention output [K d] goes
through its expert's ``output_linear[e]`` [D, K d], weighted by the choice's gate, summed over the k, plus a bias
[D]. The MLP is the same routing over SwiGLU experts (``input_linear`` [E, 2F, D]: gate rows, then up rows;
``output_linear`` [E, D, F]) plus an output bias [D]. The layers' two RMSNorms have eps 1e-6 whatever the config
says (transformers builds them so); the final norm has ``rms_norm_eps``.

Checkpoint (transformers' names): ``self_attention.kv_proj.weight``, ``self_attention.experts.{input_linear,
output_linear}.weight``, ``self_attention.experts.router.layer.weight`` [E, D], ``self_attention.experts.bias``;
``mlp.{input_linear,output_linear}.weight``, ``mlp.router.layer.weight``, ``mlp.bias``.

No fused decode kernels: the attention kernel has one query and output projection per layer (not routed ones), and
the MoE kernel no output bias; both say so (``decode_fused``). The experts' kernel still runs inside the MoE layer.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ..ops.fused import Fused, Holds
from .attention import attend, cached_length, write_kv
from .base import CausalLM
from .config import ModelConfig
from .moe_block import SparseMoeBlock, glu_kind
from .norms import RMSNorm
from .rope import RotaryEmbedding, apply_rope
from .weights import Stacked

__all__ = ["JetMoeForCausalLM", "MixtureOfAttentionHeads", "BiasedMoeBlock", "JetMoeDecoderLayer"]

_LAYER_NORM_EPS = 1e-6  # (JetMoeDecoderLayer's norms take the RMSNorm default, not config.rms_norm_eps)


class _StackedWeight(nn.Module):
    """One ``weight`` [E, out, in] (an expert's linear per leading index), named as transformers' ParallelExperts."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, out_features, in_features, dtype=dtype))


class _Router(nn.Module):
    """``layer``: the router's linear [E, D] (transformers' ``router.layer``)."""

    def __init__(self, hidden_size: int, num_experts: int, dtype=None):
        super().__init__()
        self.layer = nn.Linear(hidden_size, num_experts, bias=False, dtype=dtype)


class _Bias(nn.Module):
    def __init__(self, dim: int, dtype=None):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(dim, dtype=dtype))


class AttentionExperts(nn.Module):
    """The routed query and output projections of a MoA layer (transformers' ``JetMoeMoA``)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, width: int, dtype=None):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        self.num_experts, self.top_k = num_experts, top_k
        self.input_linear = _StackedWeight(num_experts, hidden_size, width, dtype)
        self.output_linear = _StackedWeight(num_experts, width, hidden_size, dtype)
        self.router = _Router(hidden_size, num_experts, dtype)
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype))

    def route(self, x_ND: Tensor) -> tuple[Tensor, Tensor]:
        """(expert ids [N, k], gates [N, k] in x's dtype): top-k of the logits, softmax over the k in fp32."""
        logits = self.router.layer(x_ND).float()
        top, ids = logits.topk(self.top_k, dim=-1)
        return ids, torch.softmax(top, dim=-1).to(x_ND.dtype)

    def _per_expert(self, ids_NK: Tensor):
        """(expert e, the (token, choice) pairs routed to it) for each expert some token chose."""
        for e in torch.unique(ids_NK).tolist():
            n, j = (ids_NK == e).nonzero(as_tuple=True)
            yield e, n, j

    def map(self, x_ND: Tensor, ids_NK: Tensor) -> Tensor:
        """Each choice's queries: x @ input_linear[expert]^T, [N, k, K d]."""
        w = self.input_linear.weight
        q = x_ND.new_empty(x_ND.size(0), self.top_k, w.size(1))
        for e, n, j in self._per_expert(ids_NK):
            q[n, j] = x_ND[n] @ w[e].t()
        return q

    def reduce(self, o_NKW: Tensor, ids_NK: Tensor, gates_NK: Tensor) -> Tensor:
        """sum over the choices of gate * (o @ output_linear[expert]^T), plus the bias: [N, D]."""
        w = self.output_linear.weight
        y = o_NKW.new_zeros(o_NKW.size(0), w.size(1))
        for e, n, j in self._per_expert(ids_NK):
            y.index_add_(0, n, (o_NKW[n, j] @ w[e].t()) * gates_NK[n, j, None])
        return y + self.bias


class MixtureOfAttentionHeads(nn.Module):
    """JetMoE's attention (see the module docstring). ``forward(x [B, T, D], positions [B, T], cache=None, slots=None,
    kv_len=None) -> [B, T, D]``; the cache holds the K shared key/value heads per layer, as GQA's."""

    def __init__(self, hidden_size: int, num_kv_heads: int, head_dim: int, num_experts: int, top_k: int,
                 layer_idx: int, rotary: RotaryEmbedding, dtype=None):
        super().__init__()
        self.layer_idx, self.num_kv_heads, self.head_dim, self.top_k = layer_idx, num_kv_heads, head_dim, top_k
        self.num_heads = num_kv_heads * top_k
        self.scale = head_dim ** -0.5
        self.kv_proj = nn.Linear(hidden_size, 2 * num_kv_heads * head_dim, bias=False, dtype=dtype)
        self.experts = AttentionExperts(hidden_size, num_experts, top_k, num_kv_heads * head_dim, dtype)
        object.__setattr__(self, "rotary", rotary)  # (owned by the model)

    def decode_fused(self, norm: nn.Module, dtype: torch.dtype) -> Fused:
        return Fused(None, Holds(), "mixture of attention heads: routed query and output projections per token "
                                    "(the kernel has one q and o projection per layer)")

    def forward(self, x_BTD: Tensor, positions_BT: Tensor, cache=None, slots: Tensor | None = None,
                kv_len: int | None = None) -> Tensor:
        B, T, D = x_BTD.shape
        K, k, d = self.num_kv_heads, self.top_k, self.head_dim
        x_ND = x_BTD.reshape(B * T, D)
        ids, gates = self.experts.route(x_ND)
        q = self.experts.map(x_ND, ids).view(B, T, k, K, d)
        # head (g, j) = g * k + j: GQA's grouping gives query head h the key/value head h // k = g, as JetMoE pairs them
        q = q.permute(0, 3, 2, 1, 4).reshape(B, K * k, T, d)
        kv = self.kv_proj(x_BTD).view(B, T, 2, K, d)
        key, value = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)              # [B, K, T, d]
        cos, sin = self.rotary(positions_BT, q.dtype)
        q, key = apply_rope(q, cos, sin), apply_rope(key, cos, sin)
        k_pos = None
        if cache is not None:
            kv_len = cached_length(positions_BT, slots, kv_len)
            kv_cached = write_kv(cache, self.layer_idx, slots, positions_BT, kv_len, k=key, v=value)
            key, value = kv_cached["k"], kv_cached["v"]
            k_pos = torch.arange(kv_len, device=x_BTD.device).expand(B, kv_len)
        out = attend(q, key, value, positions_BT, k_pos, self.scale)                          # [B, K k, T, d]
        out = out.view(B, K, k, T, d).permute(0, 3, 2, 1, 4).reshape(B * T, k, K * d)        # [N, k, K d]
        return self.experts.reduce(out, ids, gates).view(B, T, D)

    def extra_repr(self) -> str:
        return (f"layer={self.layer_idx}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, top_k={self.top_k}, "
                f"experts={self.experts.num_experts}")


class BiasedMoeBlock(SparseMoeBlock):
    """A :class:`SparseMoeBlock` whose output gets a bias [D] after the experts (JetMoE's ``mlp.bias``, held by the
    ``out_bias`` child so that it loads by name)."""

    def __init__(self, cfg: ModelConfig, *args, dtype=None, **kwargs):
        super().__init__(cfg, *args, dtype=dtype, **kwargs)
        self.out_bias = _Bias(cfg.hidden_size, dtype)

    def forward(self, x_BTD: Tensor) -> Tensor:
        return super().forward(x_BTD) + self.out_bias.bias

    def decode_fused(self, h_TD: Tensor, norm: nn.Module) -> Fused:
        return Fused(None, Holds(), "an output bias after the experts (the MoE kernel has none)")


class JetMoeDecoderLayer(nn.Module):
    """h += attn(norm1(h)); h += mlp(norm2(h)), both sublayers routed (no fused kernels: see the module docstring)."""

    def __init__(self, self_attn: MixtureOfAttentionHeads, mlp: BiasedMoeBlock, input_layernorm: nn.Module,
                 post_attention_layernorm: nn.Module):
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm, self.post_attention_layernorm = input_layernorm, post_attention_layernorm

    def forward(self, h_BTD: Tensor, positions_BT: Tensor, cache=None, slots=None, kv_len=None) -> Tensor:
        h_BTD = h_BTD + self.self_attn(self.input_layernorm(h_BTD), positions_BT, cache, slots, kv_len)
        return h_BTD + self.mlp(self.post_attention_layernorm(h_BTD))


class JetMoeForCausalLM(CausalLM):
    """JetMoE (see the module docstring)."""

    checkpoint_renames = ((".self_attn.", ".self_attention."), (".mlp.moe.gates.0.wg.", ".mlp.router.layer."),
                          (".mlp.out_bias.", ".mlp."), (".mlp.moe.experts", ".mlp"))
    expert_layout = Stacked("input_linear", "output_linear")

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> JetMoeDecoderLayer:
        D, K, k = cfg.hidden_size, cfg.num_key_value_heads, cfg.num_experts_per_tok
        if cfg.num_attention_heads != K * k:
            raise ValueError(f"config field 'num_attention_heads' must be num_key_value_heads * num_experts_per_tok = "
                             f"{K * k} for jetmoe, got {cfg.num_attention_heads}")
        if cfg.intermediate_size is None:
            raise ValueError("config field 'intermediate_size' (the experts' width) is required for jetmoe")
        attn = MixtureOfAttentionHeads(D, K, cfg.head_dim, cfg.num_experts, k, i, rotary, dtype)
        # (softmax over the top-k logits = the softmax over all renormalised over the k)
        mlp = BiasedMoeBlock(cfg, "softmax", normalize=True, glu=glu_kind(cfg.hidden_act), dtype=dtype)
        return JetMoeDecoderLayer(attn, mlp, RMSNorm(D, _LAYER_NORM_EPS, dtype=dtype),
                                  RMSNorm(D, _LAYER_NORM_EPS, dtype=dtype))
