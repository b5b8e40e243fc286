"""MiniMax-M3's language model (``model_type: minimax_m3_vl_text``): GQA layers of two kinds (``layer_types``) --
'full_attention' and 'minimax_m3_sparse', block-sparse attention whose keys are chosen by a lightning indexer
(:class:`BlockIndexer`) -- with Gemma-style (1 + w) RMSNorms everywhere (per head on q and k), RoPE (base 5e6; on the whole head unless
``rope_parameters`` has a partial_rotary_factor: transformers 5.24 does not read ``rotary_dim``); dense MLPs where ``mlp_layer_types`` says 'dense' (width
``dense_intermediate_size``) and MoE elsewhere: sigmoid scores, top-k on scores + a selection-only
``e_score_correction_bias``, the chosen scores renormalised, the routed output times ``routed_scaling_factor``, plus a
shared expert of ``shared_intermediate_size``; every MLP is SwiGLU-OAI (GPT-OSS's clamped GLU: gate clamped above
and up to +-``swiglu_limit``, (up + 1) * gate * sigmoid(``swiglu_alpha`` gate)), gate and up in one projection.

The indexer of a sparse layer scores every (query, key) pair with ``index_n_heads`` (= the KV heads) small heads --
q from ``q_proj`` per head, one shared k from ``k_proj``, both Gemma-normed and rotated --, max-pools the scores
into blocks of ``index_block_size`` keys (by absolute position) and keeps per query and KV group the
``index_topk_blocks`` best blocks, the ``index_local_blocks`` blocks ending at the query's own always among them;
the layer's attention then sees, per KV group, only the causal keys of its chosen blocks. Its keys are cached like
the attention's (a paged ``idx_k`` [1, position, index_head_dim]).

Checkpoint (transformers' names): ``self_attn.{q,k,v,o}_proj, q_norm, k_norm``, ``self_attn.indexer.{q_proj,
k_proj, q_norm, k_norm}``; ``mlp.gate.weight``, ``mlp.gate.e_score_correction_bias``, ``mlp.experts.gate_up_proj``
[E, 2F, D] (gate rows, then up rows), ``mlp.experts.down_proj`` [E, D, F], ``mlp.shared_experts.{gate_up,down}_proj``
(or a dense ``mlp.{gate_up,down}_proj``). The multimodal
checkpoint (``minimax_m3_vl``, the text model in its ``text_config``) keeps these under ``language_model.model.`` and
``language_model.lm_head``; its vision tower, patch-merge MLP and projector are not loaded (text only: see
:mod:`dynamoe.models.wrapped`). The hub's layout -- also what transformers saves for the wrapper -- is read too
(:meth:`MiniMaxM3ForCausalLM.adapt_to_checkpoint`): ``block_sparse_moe.{gate.weight, e_score_correction_bias,
experts.{e}.{w1,w3,w2}, shared_experts.{gate,up,down}_proj}``, ``self_attn.index_{q,k}_{proj,norm}``, dense
``mlp.{gate,up,down}_proj``.

Multi-token prediction: the hub's ``model.mtp.layers.{j}.`` (``language_model.model.mtp.layers.{j}.`` in the
multimodal checkpoint) -- ``enorm``, ``hnorm`` (Gemma norms), ``eh_proj`` [D, 2 D], a block-sparse MoE decoder layer
(``input_layernorm``, ``self_attn.*`` with its indexer, ``post_attention_layernorm``, the MoE), ``final_layernorm`` --
load into ``mtp``, an :class:`~dynamoe.models.mtp_prefixed.EhPredictor` that the engine drafts with (``draft="mtp"``),
as vLLM's MiniMaxM3MTP runs it (vllm/models/minimax_m3: the embedding zeroed at position 0, the layer's output fed
back, the final norm before the model's lm_head only); ``num_mtp_modules`` in the config must agree. Top-level
``mtp.*`` tensors (a layout no public implementation reads) are left unread and named.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops.activations import glu_activation
from ..ops.fused import Unfusable
from .attention import Attention, _sdpa, attend, cached_length, write_kv
from .base import CausalLM, DecoderLayer
from .cache import KVCache
from .config import ModelConfig
from .moe_block import SparseMoeBlock
from .norms import RMSNorm
from .rope import RotaryEmbedding, apply_rope
from .weights import PerExpert, Stacked
from .mtp_prefixed import EhPredictor, PrefixedMTPHeads, mtp_depths
from .wrapped import TextOfWrapper, WrapperLayout

__all__ = ["MiniMaxM3ForCausalLM", "BlockIndexer", "M3Attention", "GateUpMLP"]


class GateUpMLP(nn.Module):
    """down_proj(glu(gate, up)) (MiniMax-M3's dense MLP and shared expert), ``glu`` a GLU kind of
    dynamoe.ops.activations with its ``alpha`` and ``limit``; [gate | up] = gate_up_proj(x), one projection for
    both (transformers' layout), or ``split``: ``gate_proj`` and ``up_proj`` (the hub's)."""

    def __init__(self, hidden_size: int, intermediate_size: int, glu: str, alpha: float, limit: float,
                 split: bool = False, dtype=None, device=None):
        super().__init__()
        self.glu, self.alpha, self.limit, self.split = glu, alpha, limit, split
        kw = dict(bias=False, dtype=dtype, device=device)
        if split:
            self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)
            self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        else:
            self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)

    def split_(self) -> None:
        """The same MLP with gate_proj and up_proj apart (on the same device, uninitialised: before loading)."""
        if self.split:
            return
        w = self.gate_up_proj.weight
        F_, D = w.size(0) // 2, w.size(1)
        del self.gate_up_proj
        self.gate_proj = nn.Linear(D, F_, bias=False, dtype=w.dtype, device=w.device)
        self.up_proj = nn.Linear(D, F_, bias=False, dtype=w.dtype, device=w.device)
        self.split = True

    def forward(self, x: Tensor) -> Tensor:
        if self.split:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(glu_activation(gate, up, self.glu, alpha=self.alpha, limit=self.limit))


class BlockIndexer(nn.Module):
    """MiniMax-M3's lightning indexer (see the module docstring). ``forward(x, positions, rotary rows, cache, slots,
    kv_len) -> allowed`` bool [B, G, T, L] (G = index heads = KV groups): the keys each query of each group may see."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, block_size: int, topk_blocks: int,
                 local_blocks: int, layer_idx: int, norm_eps: float = 1e-6, dtype=None):
        super().__init__()
        for name, v, low in (("index_block_size", block_size, 1), ("index_topk_blocks", topk_blocks, 1),
                             ("index_local_blocks", local_blocks, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"config field {name!r} must be an int >= {low}, got {v!r}")
        self.layer_idx, self.num_heads, self.head_dim = layer_idx, num_heads, head_dim
        self.block_size, self.topk_blocks, self.local_blocks = block_size, topk_blocks, local_blocks
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False, dtype=dtype)
        self.k_proj = nn.Linear(hidden_size, head_dim, bias=False, dtype=dtype)
        self.q_norm = RMSNorm(head_dim, norm_eps, zero_centered=True, dtype=dtype)
        self.k_norm = RMSNorm(head_dim, norm_eps, zero_centered=True, dtype=dtype)

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, head_dim={self.head_dim}, block={self.block_size}, "
                f"topk_blocks={self.topk_blocks}, local_blocks={self.local_blocks}")

    def forward(self, x_BTD: Tensor, positions_BT: Tensor, cos: Tensor, sin: Tensor, cache: KVCache | None,
                slots: Tensor | None, kv_len: int | None) -> Tensor:
        B, T, _ = x_BTD.shape
        Hi, Di, bs = self.num_heads, self.head_dim, self.block_size
        q = apply_rope(self.q_norm(self.q_proj(x_BTD).view(B, T, Hi, Di)).transpose(1, 2), cos, sin)  # [B, Hi, T, Di]
        k = apply_rope(self.k_norm(self.k_proj(x_BTD).view(B, T, 1, Di)).transpose(1, 2), cos, sin)   # [B, 1, T, Di]
        if cache is None:
            k_pos = positions_BT
        else:
            kv_len = cached_length(positions_BT, slots, kv_len)
            k = write_kv(cache, self.layer_idx, slots, positions_BT, kv_len, idx_k=k)["idx_k"]        # [B, 1, L, Di]
            k_pos = torch.arange(kv_len, device=x_BTD.device).expand(B, kv_len)
        L = k.size(2)
        visible = k_pos[:, None, None, :] <= positions_BT[:, None, :, None]                          # [B, 1, T, L]
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)).masked_fill(~visible, float("-inf"))
        # blocks by absolute key position (the cached keys are positions 0..L-1; uncached, the T keys are too)
        n = -(-L // bs)
        scores = F.pad(scores, (0, n * bs - L), value=float("-inf")).view(B, Hi, T, n, bs).amax(-1)  # [B, Hi, T, n]
        if self.local_blocks:  # the blocks ending at the query's own always win
            own = torch.div(positions_BT, bs, rounding_mode="floor")
            local = (own[..., None] - torch.arange(self.local_blocks, device=x_BTD.device)).clamp(min=0)
            scores = scores.scatter(-1, local[:, None].expand(B, Hi, T, self.local_blocks), float("inf"))
        top, idx = scores.topk(min(self.topk_blocks, n), dim=-1)                                     # [B, Hi, T, k]
        chosen = torch.zeros(B, Hi, T, n, dtype=torch.bool, device=x_BTD.device)
        chosen.scatter_(-1, idx, top > float("-inf"))   # (a block with no visible key is never chosen)
        return chosen.repeat_interleave(bs, dim=-1)[..., :L] & visible                               # [B, Hi, T, L]


class M3Attention(Attention):
    """GQA with Gemma-style (1 + w) per-head q/k norms before a partial RoPE; with ``indexer`` (a 'minimax_m3_sparse'
    layer) each KV group's queries see only the keys its :class:`BlockIndexer` chose."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, layer_idx: int,
                 rotary: RotaryEmbedding, norm_eps: float = 1e-6, indexer: BlockIndexer | None = None, dtype=None):
        super().__init__(hidden_size, num_heads, num_kv_heads, head_dim, layer_idx, rotary, dtype=dtype)
        self.q_norm = RMSNorm(head_dim, norm_eps, zero_centered=True, dtype=dtype)
        self.k_norm = RMSNorm(head_dim, norm_eps, zero_centered=True, dtype=dtype)
        if indexer is not None and indexer.num_heads != num_kv_heads:
            raise ValueError(f"config field 'index_n_heads' ({indexer.num_heads}) must equal num_key_value_heads "
                             f"({num_kv_heads}): one block selection per KV group")
        self.indexer = indexer

    def _decode_weights(self, kernels, holds, norm, dtype):
        if holds.module(self, "indexer") is not None:
            raise Unfusable("the indexer's block selection (a sparse layer): the fused kernel attends over every key")
        return super()._decode_weights(kernels, holds, norm, dtype)  # (the (1 + w) q/k norms are a kernel option)

    def forward(self, x_BTD: Tensor, positions_BT: Tensor, cache: KVCache | None = None, slots: Tensor | None = None,
                kv_len: int | None = None) -> Tensor:
        B, T, _ = x_BTD.shape
        H, K, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self._project_qkv(x_BTD)
        q = self.q_norm(q.reshape(B, T, H, d)).transpose(1, 2)
        k = self.k_norm(k.reshape(B, T, K, d)).transpose(1, 2)
        v = v.reshape(B, T, K, d).transpose(1, 2)
        cos, sin = self.rotary(positions_BT, q.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        allowed = None if self.indexer is None else self.indexer(x_BTD, positions_BT, cos, sin, cache, slots, kv_len)
        k_pos = None
        if cache is not None:
            kv_len = cached_length(positions_BT, slots, kv_len)
            kv = write_kv(cache, self.layer_idx, slots, positions_BT, kv_len, k=k, v=v)
            k, v = kv["k"], kv["v"]
            k_pos = torch.arange(kv_len, device=x_BTD.device).expand(B, kv_len)
        if allowed is None:
            out = attend(q, k, v, positions_BT, k_pos, self.scale)
        else:  # the group's mask for each of its H / K query heads
            out = _sdpa(q, k, v, allowed.repeat_interleave(H // K, dim=1), self.scale, causal=False)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, H * d))


class _SharedExpertMoe(SparseMoeBlock):
    """Routed experts plus ``shared_experts`` (a :class:`GateUpMLP`): moe(x) + shared_experts(x)."""

    def __init__(self, cfg: ModelConfig, shared: GateUpMLP, dtype=None):
        super().__init__(cfg, "sigmoid", normalize=True, glu="gpt_oss", router_groups=False,
                         route_scale=cfg.routed_scaling_factor, glu_limit=cfg.swiglu_limit, dtype=dtype)
        self.shared_experts = shared

    def forward(self, x_BTD: Tensor) -> Tensor:
        return super().forward(x_BTD) + self.shared_experts(x_BTD)

    decode_refusal = "a shared GateUpMLP beside the routed experts (the fused kernel knows no separate shared MLP)"


class MiniMaxM3ForCausalLM(TextOfWrapper, PrefixedMTPHeads, CausalLM):
    """MiniMax-M3's language model (see the module docstring), alone or in its multimodal wrapper."""

    checkpoint_renames = ((".mlp.moe.gates.0.wg.", ".mlp.gate."), (".mlp.moe.gates.0.", ".mlp.gate."),
                          (".mlp.moe.", ".mlp."))
    expert_layout = Stacked("gate_up_proj", "down_proj", suffix="")
    #: the hub's layout (what transformers saves for the multimodal wrapper, and reads through its conversion
    #: mapping): the MoE under block_sparse_moe. with per-expert w1 / w3 / w2, the indexer's tensors as
    #: self_attn.index_*, the dense MLPs' and shared experts' gate_proj and up_proj apart (see adapt_to_checkpoint)
    hub_renames = ((".mlp.moe.gates.0.wg.", ".block_sparse_moe.gate."),
                   (".mlp.moe.gates.0.e_score_correction_bias", ".block_sparse_moe.e_score_correction_bias"),
                   (".mlp.moe.", ".block_sparse_moe."), (".mlp.shared_experts.", ".block_sparse_moe.shared_experts."),
                   (".self_attn.indexer.", ".self_attn.index_"))
    hub_expert_layout = PerExpert("w1", "w3", "w2")
    wrapper_layouts = {"minimax_m3_vl": WrapperLayout("language_model.model.", "language_model.",
                                                      unused=("vision_tower.", "patch_merge_mlp.",
                                                              "multi_modal_projector.", "mtp."))}

    @property
    def unused_checkpoint_prefixes(self) -> tuple:
        layout = self.wrapper_layout()
        return ("mtp.",) if layout is None else layout.unused

    mtp_checkpoint_prefix = "model.mtp."

    def adapt_to_checkpoint(self, names) -> None:
        """Called by the loader with the checkpoint's tensor names before it reads them: builds the MTP head ``mtp``
        for the ``model.mtp.layers.{j}`` there; a checkpoint in the hub's layout (``block_sparse_moe.``,
        ``index_*``, split gate / up projections) is read as such -- the renames and expert layout switch, and the
        dense MLPs and shared experts take gate_proj and up_proj apart."""
        layout = self.wrapper_layout()
        prefix = ("model." if layout is None else layout.stack) + "mtp."
        count = mtp_depths(names, prefix)
        if count:
            cfg, dtype, D = self.config, self.dtype, self.config.hidden_size
            want = cfg.raw.get("num_mtp_modules")
            if want is not None and want != count:
                raise ValueError(f"the checkpoint has {count} {prefix}layers but config field 'num_mtp_modules' "
                                 f"says {want}")
            blocks = [self.build_layer(cfg, cfg.num_hidden_layers + j, self.model.rotary_emb, dtype,
                                       kind="minimax_m3_sparse", moe=True) for j in range(count)]
            self.mtp = EhPredictor(blocks, D, lambda: self.build_norm(cfg, D, dtype), self.model.embed_tokens,
                                   self.lm_head, dtype=dtype, zero_first=True, feeds_normed=False)
        if not any(".block_sparse_moe." in n or ".self_attn.index_" in n for n in names):
            return
        self.checkpoint_renames, self.expert_layout = self.hub_renames, self.hub_expert_layout
        blocks = [*self.model.layers, *(d.block for d in self.mtp.layers)] if self.has_mtp else self.model.layers
        for layer in blocks:
            mlp = layer.mlp
            (mlp.shared_experts if isinstance(mlp, _SharedExpertMoe) else mlp).split_()

    def checkpoint_name(self, name: str) -> str:
        if not name.startswith("mtp.layers."):
            return super().checkpoint_name(name)
        j, rest = name[len("mtp.layers."):].split(".", 1)
        if rest.startswith("block."):   # the decoder layer: the family's names for a layer, under mtp.layers.{j}
            inner = super().checkpoint_name("model.layers.0." + rest[len("block."):])
            return inner.replace("layers.0.", f"mtp.layers.{j}.", 1)
        return super().checkpoint_name(f"model.mtp.layers.{j}.{rest}")

    def build_norm(self, cfg: ModelConfig, dim: int, dtype) -> nn.Module:
        return RMSNorm(dim, cfg.rms_norm_eps, zero_centered=True, dtype=dtype)

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype, kind: str | None = None,
                    moe: bool | None = None) -> DecoderLayer:
        """Layer i of ``cfg.layer_types`` (``kind`` and ``moe`` override the config: MTP layers)."""
        D, eps, raw = cfg.hidden_size, cfg.rms_norm_eps, cfg.raw
        kind = kind or cfg.layer_types[i]
        indexer = None
        if kind == "minimax_m3_sparse":
            if cfg.index_head_dim < int(cfg.head_dim * cfg.rope.partial_rotary_factor):
                raise ValueError(f"config field 'index_head_dim' ({cfg.index_head_dim}) must be at least the rotated "
                                 "dims of a head: the indexer's q and k are rotated like the attention's")
            indexer = BlockIndexer(D, cfg.index_n_heads, cfg.index_head_dim, raw["index_block_size"],
                                   raw["index_topk_blocks"], raw["index_local_blocks"], i, eps, dtype=dtype)
        elif kind != "full_attention":
            raise ValueError(f"config field 'layer_types' entry {i} must be 'full_attention' or 'minimax_m3_sparse' "
                             f"for minimax_m3_vl_text, got {kind!r}")
        attn = M3Attention(D, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, i, rotary, eps, indexer,
                           dtype=dtype)
        alpha, limit = cfg.swiglu_alpha, cfg.swiglu_limit or 7.0
        if cfg.is_moe_layer(i) if moe is None else moe:
            shared = GateUpMLP(D, cfg.shared_expert_intermediate_size, "gpt_oss", alpha, limit, dtype=dtype)
            mlp: nn.Module = _SharedExpertMoe(cfg, shared, dtype=dtype)
        else:
            mlp = GateUpMLP(D, raw["dense_intermediate_size"], "gpt_oss", alpha, limit, dtype=dtype)
        return DecoderLayer(attn, mlp, self.build_norm(cfg, D, dtype), self.build_norm(cfg, D, dtype))
