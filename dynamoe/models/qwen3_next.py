"""Qwen3-Next (``model_type: qwen3_next``) and Qwen3.5-MoE's text model (``qwen3_5_moe`` with a
``text_config``, or ``qwen3_5_moe_text``): hybrid decoders whose ``layer_types`` mix

* ``linear_attention`` -- Gated DeltaNet (:class:`~dynamoe.models.linear_attention.GatedDeltaNet`):
  conv + delta-rule recurrent state per sequence, no KV cache;
* ``full_attention`` -- gated GQA (:class:`GatedAttention`): q_proj yields each head's query and an
  output gate, out = attention * sigmoid(gate); zero-centred q/k RMSNorm; RoPE on the first
  ``partial_rotary_factor`` (0.25) of each head, half-split;

with zero-centred RMSNorms (scale 1 + w) around every block, and MoE blocks of softmax top-k routed
experts plus one shared expert scaled by sigmoid(``shared_expert_gate``(x)) (:class:`SharedExpertMoeBlock`).
Qwen3-Next: ``mlp_only_layers`` / ``decoder_sparse_step`` pick dense layers, ``norm_topk_prob`` the
renormalisation, ``in_proj_qkvz`` / ``in_proj_ba`` the linear-attention projections (grouped per key
head). Qwen3.5-MoE: every layer MoE, always renormalised, ``in_proj_qkv`` / ``in_proj_z`` /
``in_proj_b`` / ``in_proj_a``; its multimodal checkpoints keep the text model under
``model.language_model.`` and the vision tower under ``model.visual.`` (text only here: the vision
tensors are left unread and named as such, see :mod:`dynamoe.models.wrapped`).
For text, Qwen3.5's multimodal RoPE (``mrope_section``) is plain RoPE: its three position grids are equal.

Checkpoint: ``model.layers.{i}.linear_attn.{conv1d.weight [C, 1, K], in_proj_*, dt_bias, A_log,
norm.weight, out_proj}`` or ``self_attn.{q_proj [2 H d, D], k_proj, v_proj, o_proj, q_norm, k_norm}``;
``mlp.gate.weight``, ``mlp.experts.{e}.{gate,up,down}_proj``, ``mlp.shared_expert.*``,
``mlp.shared_expert_gate.weight [1, D]`` (or a dense ``mlp.*_proj``).

Multi-token prediction: a checkpoint's ``mtp.*`` tensors (``mtp.fc``, ``mtp.pre_fc_norm_embedding``,
``mtp.pre_fc_norm_hidden``, ``mtp.layers.{j}`` -- full-attention MoE decoder layers at layer index N + j --,
``mtp.norm``; the model's embedding and lm_head are shared) load into ``model.mtp``, an
:class:`~dynamoe.models.mtp_prefixed.FcPredictor` that plain decoding does not run and the engine drafts with
(``draft="mtp"``, :mod:`dynamoe.models.mtp_prefixed`); a checkpoint without them builds no ``mtp``. Speculative
decoding rolls the Gated DeltaNet state back past rejected drafts (``recurrent_rollback``: the verification forward
records the state after every token, :mod:`dynamoe.models.linear_attention`).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ..ops.fused import Unfusable
from .attention import Attention
from .base import CausalLM
from .cache import KVCache
from .config import ModelConfig
from .linear_attention import GatedDeltaNet
from .moe_block import GatedMLP, SparseMoeBlock, glu_kind
from .mtp_prefixed import FcPredictor, PrefixedMTPHeads, mtp_depths
from .norms import RMSNorm
from .rope import RotaryEmbedding, apply_rope
from .weights import PerExpert
from .wrapped import TextOfWrapper, WrapperLayout

__all__ = ["Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM", "GatedAttention", "SharedExpertMoeBlock",
           "HybridDecoderLayer"]


class GatedAttention(Attention):
    """GQA whose ``q_proj`` [2 H d, D] gives per head [query (d) | gate (d)]; the attention output is
    multiplied by sigmoid(gate) before ``o_proj``. q/k norms are zero-centred RMSNorms over d. No fused
    decode kernel (its gate is read from a projection of its own, not from q_proj's rows): the op-by-op path runs."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, layer_idx: int,
                 rotary: RotaryEmbedding, bias: bool = False, norm_eps: float = 1e-6, dtype=None):
        super().__init__(hidden_size, num_heads, num_kv_heads, head_dim, layer_idx, rotary, qkv_bias=bias,
                         o_bias=bias, dtype=dtype)
        self.q_proj = nn.Linear(hidden_size, 2 * num_heads * head_dim, bias=bias, dtype=dtype)
        self.q_norm = RMSNorm(head_dim, norm_eps, zero_centered=True, dtype=dtype)
        self.k_norm = RMSNorm(head_dim, norm_eps, zero_centered=True, dtype=dtype)

    def _decode_weights(self, kernels, holds, norm, dtype):
        raise Unfusable("the output gate interleaved with the queries in q_proj (per head [query | gate]): the "
                        "fused kernel reads a gate projection of its own")

    def gated_heads(self, x_BTD: Tensor, positions_BT: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """q [B, H, T, d] and k [B, K, T, d] normed and rotated, v [B, K, T, d], and the output gate [B, T, H, d]
        (q_proj gives each head's query and gate side by side)."""
        B, T, _ = x_BTD.shape
        H, K, d = self.num_heads, self.num_kv_heads, self.head_dim
        qg, k, v = self._project_qkv(x_BTD)
        q, gate = qg.reshape(B, T, H, 2 * d).split([d, d], dim=-1)
        q, k = self.q_norm(q), self.k_norm(k.reshape(B, T, K, d))
        v = v.reshape(B, T, K, d).transpose(1, 2)
        cos, sin = self.rotary(positions_BT, q.dtype)
        return apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin), v, gate

    def forward(self, x_BTD: Tensor, positions_BT: Tensor, cache: KVCache | None = None, slots: Tensor | None = None,
                kv_len: int | None = None) -> Tensor:
        B, T, _ = x_BTD.shape
        q, k, v, gate = self.gated_heads(x_BTD, positions_BT)
        out = self.attend_cached(q, k, v, positions_BT, cache, slots, kv_len).transpose(1, 2).reshape(B, T, -1)
        return self.o_proj(out * torch.sigmoid(gate.reshape(B, T, -1)))


class SharedExpertMoeBlock(SparseMoeBlock):
    """Routed experts plus one shared expert: y = moe(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)
    (``shared_expert``: a GatedMLP of ``shared_expert_intermediate_size``; ``shared_expert_gate``: [1, D])."""

    def __init__(self, cfg: ModelConfig, normalize: bool, dtype=None):
        super().__init__(cfg, "softmax", normalize=normalize, glu=glu_kind(cfg.hidden_act), dtype=dtype)
        if cfg.shared_expert_intermediate_size is None:
            raise ValueError("config field 'shared_expert_intermediate_size' is required (an int >= 1) but missing")
        D = cfg.hidden_size
        self.shared_expert = GatedMLP(D, cfg.shared_expert_intermediate_size, glu_kind(cfg.hidden_act), dtype=dtype)
        self.shared_expert_gate = nn.Linear(D, 1, bias=False, dtype=dtype)

    def forward(self, x_BTD: Tensor) -> Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(x_BTD)) * self.shared_expert(x_BTD)
        return super().forward(x_BTD) + shared

    decode_refusal = "a shared expert gated outside the MoE layer (shared_expert_gate on the block)"


class HybridDecoderLayer(nn.Module):
    """h += mixer(input_layernorm(h)); h += mlp(post_attention_layernorm(h)); the mixer is ``linear_attn``
    (a GatedDeltaNet) or ``self_attn`` (a GatedAttention), as Hugging Face names them."""

    def __init__(self, mixer: nn.Module, mlp: nn.Module, input_layernorm: nn.Module,
                 post_attention_layernorm: nn.Module):
        super().__init__()
        if isinstance(mixer, GatedDeltaNet):
            self.linear_attn = mixer
        else:
            self.self_attn = mixer
        self.mlp, self.input_layernorm, self.post_attention_layernorm = mlp, input_layernorm, post_attention_layernorm

    @property
    def mixer(self) -> nn.Module:
        mixer = self._modules.get("linear_attn")
        return self._modules["self_attn"] if mixer is None else mixer

    def forward(self, h_BTD: Tensor, positions_BT: Tensor, cache: KVCache | None = None, slots: Tensor | None = None,
                kv_len: int | None = None) -> Tensor:
        h_BTD = h_BTD + self.mixer(self.input_layernorm(h_BTD), positions_BT, cache, slots, kv_len)
        return h_BTD + self.mlp(self.post_attention_layernorm(h_BTD))


class Qwen3NextForCausalLM(PrefixedMTPHeads, CausalLM):
    """Qwen3-Next (see the module docstring)."""

    #: the model keeps per-sequence recurrent state (the linear-attention layers' conv window and delta-rule
    #: state), so a cache slot cannot be truncated back to a shorter prefix: the engine must not reuse
    #: prefixes for it (``KVCache.truncate`` would leave a state that summarises the longer sequence;
    #: continuing such a slot raises a ValueError, see dynamoe.models.linear_attention)
    recurrent_state = True
    #: ... except past a speculative verification forward: GatedDeltaNet records its state after every token then,
    #: and the engine's cut of rejected drafts puts it back (dynamoe.models.cache.KVCache.begin_history)
    recurrent_rollback = True
    checkpoint_renames = ((".mlp.moe.gates.0.wg.", ".mlp.gate."), (".mlp.moe.", ".mlp."))
    expert_layout = PerExpert("gate_proj", "up_proj", "down_proj")
    #: linear-attention projections on disk (dynamoe.models.linear_attention.PROJECTIONS)
    linear_projection = "qkvz"
    #: chunk length of the prefill's delta rule (any value gives the same result up to rounding)
    chunk_size = 64

    def build_norm(self, cfg: ModelConfig, dim: int, dtype) -> nn.Module:
        return RMSNorm(dim, cfg.rms_norm_eps, zero_centered=True, dtype=dtype)

    def normalize_topk(self, cfg: ModelConfig) -> bool:
        return cfg.norm_topk_prob

    def build_mlp(self, cfg: ModelConfig, i: int, dtype, moe: bool | None = None) -> nn.Module:
        if cfg.is_moe_layer(i) if moe is None else moe:
            return SharedExpertMoeBlock(cfg, self.normalize_topk(cfg), dtype=dtype)
        if cfg.intermediate_size is None:
            raise ValueError(f"config field 'intermediate_size' is required: layer {i} has a dense MLP")
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, glu_kind(cfg.hidden_act), dtype=dtype)

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype, kind: str | None = None,
                    moe: bool | None = None) -> HybridDecoderLayer:
        """Layer i of ``cfg.layer_types`` (``kind`` and ``moe`` override the config: MTP layers)."""
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        kind = kind or cfg.layer_types[i]
        if kind == "linear_attention":
            mixer = GatedDeltaNet(D, cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                  cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim, i, eps,
                                  projection=self.linear_projection, activation=cfg.hidden_act,
                                  chunk_size=self.chunk_size, checks_position=i == cfg.layer_types.index(kind),
                                  dtype=dtype)
        elif kind == "full_attention":
            mixer = GatedAttention(D, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, i, rotary,
                                   bias=cfg.attention_bias, norm_eps=eps, dtype=dtype)
        else:
            raise ValueError(f"config field 'layer_types' entry {i} must be 'linear_attention' or 'full_attention' "
                             f"for {cfg.model_type}, got {kind!r}")
        return HybridDecoderLayer(mixer, self.build_mlp(cfg, i, dtype, moe), self.build_norm(cfg, D, dtype),
                                  self.build_norm(cfg, D, dtype))

    def adapt_to_checkpoint(self, names) -> None:
        """Called by the loader with the checkpoint's tensor names before it reads them: builds the MTP head
        ``mtp`` (:class:`~dynamoe.models.mtp_prefixed.FcPredictor`) with as many full-attention MoE layers as the
        ``mtp.layers.{j}`` there."""
        if not any(n.startswith("mtp.") for n in names):
            return
        count = mtp_depths(names, "mtp.")
        if not count:
            raise ValueError("the checkpoint has mtp.* tensors but no mtp.layers.{j} (the head's decoder layers)")
        want = self.config.raw.get("mtp_num_hidden_layers", self.config.raw.get("num_nextn_predict_layers"))
        if want is not None and want != count:
            raise ValueError(f"the checkpoint has {count} mtp.layers but config field 'mtp_num_hidden_layers' "
                             f"says {want}")
        cfg, dtype = self.config, self.dtype
        layers = [self.build_layer(cfg, cfg.num_hidden_layers + j, self.model.rotary_emb, dtype, kind="full_attention",
                                   moe=True)
                  for j in range(count)]
        self.mtp = FcPredictor(layers, cfg.hidden_size, lambda: self.build_norm(cfg, cfg.hidden_size, dtype),
                               self.model.embed_tokens, self.lm_head, dtype=dtype)


class Qwen3_5MoeForCausalLM(TextOfWrapper, Qwen3NextForCausalLM):
    """Qwen3.5-MoE's text model (see the module docstring): split linear-attention projections, every
    layer MoE with renormalised top-k; a multimodal checkpoint's names carry ``model.language_model.``."""

    linear_projection = "split"
    wrapper_layouts = {"qwen3_5_moe": WrapperLayout("model.language_model.", unused=("model.visual.",))}

    def normalize_topk(self, cfg: ModelConfig) -> bool:
        return True
