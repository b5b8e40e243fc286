"""Phi-3.5-MoE (``model_type: phimoe``): GQA with half-split RoPE (a sliding window on every layer when
``sliding_window`` is set), LayerNorms with biases (eps ``rms_norm_eps``), SwiGLU experts in every layer behind
Phi's SparseMixer router, and an lm_head with an optional bias (``lm_head_bias``).

Router (transformers' ``sparsemixer`` at inference; dynamoe.ops.routing.sparsemixer_top2): the best expert,
weighted by its softmax over only the experts whose logit is within a relative margin 2 * ``router_jitter_noise``
of it; then the best of the others, weighted likewise over the others. Exactly two experts, not renormalised.

RoPE ``longrope`` as transformers 5 computes it for this family: the base frequencies divided by ``short_factor``
(its rotary embedding recomputes them without the sequence length, so ``long_factor`` is never used), and cos/sin
scaled by ``long_mscale`` when the forward's longest position + 1 passes ``original_max_position_embeddings``,
else by ``short_mscale``. transformers takes that longest position over the whole batch; dynamoe over each row
(the same for rows at equal positions, and a row's result does not depend on the rows batched with it). Keys
cached before a sequence passes the original length carry the short scale, so when it does, transformers'
``generate`` drops the cache and recomputes the whole sequence (``prepare_inputs_for_generation``); dynamoe does
the same in :meth:`PhimoeForCausalLM.forward` for each row that crosses, from the token ids it keeps in the cache
(``cache.buffer(0, "token_ids")``). Such a model says ``recurrent_state = True``, so that the engine shares no
prefix blocks: a block's keys depend on whether its sequence has crossed. (The hub's Phi-3.5-MoE has equal
short and long mscales: nothing switches, and none of this applies.)

Checkpoint (the hub's names, which transformers 5 also saves): ``block_sparse_moe.gate.weight`` [E, D],
``block_sparse_moe.experts.{e}.w1`` (gate), ``w3`` (up), ``w2`` (down); ``input_layernorm`` /
``post_attention_layernorm`` / ``model.norm`` weight and bias; ``lm_head.bias`` when ``lm_head_bias``.

No fused decode kernels: they take RMSNorm (these are LayerNorms) and have no SparseMixer router; a decode step
routes in torch and runs its two experts through the experts' decode kernel (MoELayer's ``_fused_decode``).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .attention import Attention
from .base import CausalLM, DecoderLayer
from .config import ModelConfig
from .moe_block import SparseMoeBlock, glu_kind
from .rope import RotaryEmbedding
from .weights import PerExpert

__all__ = ["PhimoeForCausalLM", "PhimoeRotaryEmbedding"]


class PhimoeRotaryEmbedding(RotaryEmbedding):
    """cos/sin [B, T, R/2] of Phi-3.5-MoE (see the module docstring): short-factor frequencies, each row scaled by
    ``long_mscale`` when its longest position + 1 passes original_max_position_embeddings, else ``short_mscale``
    ('default' RoPE: unscaled)."""

    handles_longrope = True

    def __init__(self, rope, dim: int, max_position_embeddings: int):
        if rope.rope_type not in ("default", "longrope"):
            raise ValueError(f"rope_type must be 'default' or 'longrope' for phimoe, got {rope.rope_type!r}")
        if rope.rope_type == "longrope" and (rope.short_mscale is None or rope.long_mscale is None):
            raise ValueError("config fields 'short_mscale' and 'long_mscale' (numbers, in rope_parameters) are "
                             "required for phimoe's longrope")
        super().__init__(rope, dim, max_position_embeddings)

    def forward(self, positions_BT: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        last = self._last
        if last is not None and last[0] is positions_BT and last[1] == dtype:
            return last[2], last[3]
        freqs = positions_BT[..., None].float() * self.inv_freq.float()         # [B, T, R/2]
        if self.rope.rope_type == "longrope":
            longer = positions_BT.amax(dim=1) + 1 > self.rope.original_max_position_embeddings   # [B]
            scale = torch.where(longer, self.rope.long_mscale, self.rope.short_mscale)[:, None, None].float()
        else:
            scale = self.attention_scaling
        cos, sin = (freqs.cos() * scale).to(dtype), (freqs.sin() * scale).to(dtype)
        self._last = (positions_BT, dtype, cos, sin)
        return cos, sin


class PhimoeForCausalLM(CausalLM):
    """Phi-3.5-MoE (see the module docstring)."""

    checkpoint_renames = ((".mlp.moe.gates.0.wg.", ".block_sparse_moe.gate."), (".mlp.moe.", ".block_sparse_moe."))
    expert_layout = PerExpert("w1", "w3", "w2")

    def __init__(self, config: ModelConfig, dtype=None):
        super().__init__(config, dtype)
        if config.lm_head_bias:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=True, dtype=dtype)
            self.tie_weights()

    @property
    def switches_scale(self) -> bool:
        """Whether the RoPE scale changes when a sequence passes original_max_position_embeddings."""
        r = self.config.rope
        return r.rope_type == "longrope" and r.short_mscale != r.long_mscale

    @property
    def recurrent_state(self) -> bool:
        """True when the scale switches: a cached block's keys depend on whether its sequence has passed the
        original length, so blocks must not be shared by prefix (the engine reads this flag)."""
        return self.switches_scale

    def forward(self, input_ids: Tensor, cache=None, slots: Tensor | None = None, logits_to_keep: int = 0) -> Tensor:
        """:meth:`CausalLM.forward`; with a cache, a row whose sequence passes original_max_position_embeddings in
        this forward (cached length <= original < new length) is recomputed from position 0 with the long scale,
        as transformers' generate does (see the module docstring)."""
        if (cache is None or not self.switches_scale or not isinstance(input_ids, Tensor) or input_ids.dim() != 2
                or isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int) or logits_to_keep < 0):
            return super().forward(input_ids, cache, slots, logits_to_keep)
        B, T = input_ids.shape
        if slots is None:
            slots = torch.arange(B, device=cache.lengths.device)
        elif not isinstance(slots, Tensor):
            slots = torch.tensor(slots, dtype=torch.long, device=cache.lengths.device)
        starts = cache.lengths[slots.to(cache.lengths.device)].tolist() if slots.dim() == 1 else None
        if starts is None or len(starts) != B or (B and max(starts) + T > cache.max_seq_len):
            return super().forward(input_ids, cache, slots, logits_to_keep)  # (which names the problem)
        tokens = cache.buffer(0, "token_ids", cache.max_seq_len, dtype=torch.long)   # [slots, positions]
        known = cache.buffer(0, "token_ids_known", dtype=torch.long)                 # [slots]: tokens 0..known-1
        orig = self.config.rope.original_max_position_embeddings
        crossing = []
        for b, (s, start) in enumerate(zip(slots.tolist(), starts)):
            had = int(known[s]) if start else 0
            tokens[s, start:start + T] = input_ids[b].to(tokens.device)
            known[s] = start + T if had >= start else had
            if 0 < start <= orig < start + T:
                if had < start:
                    raise ValueError(f"phimoe: slot {s} passes original_max_position_embeddings={orig} and its cached "
                                     f"keys must be recomputed with the long RoPE scale, but the tokens of its first "
                                     f"{start} positions were not seen by this model (a prefix attached from elsewhere)")
                if cache._dropped[s]:
                    raise ValueError(f"phimoe: slot {s} cannot recompute its keys: positions out of the sliding "
                                     f"window were already given back")
                crossing.append(b)
        if not crossing:
            return super().forward(input_ids, cache, slots, logits_to_keep)
        keep = T if logits_to_keep == 0 or logits_to_keep >= T else logits_to_keep
        out = [None] * B
        rest = [b for b in range(B) if b not in crossing]
        if rest:
            idx = torch.tensor(rest, device=input_ids.device)
            part = super().forward(input_ids[idx], cache, slots[idx.to(slots.device)], keep)
            for j, b in enumerate(rest):
                out[b] = part[j]
        for b in crossing:
            s, end = int(slots[b]), starts[b] + T
            cache.lengths[s] = 0   # rewritten in place: the same blocks (none shared: recurrent_state), all positions
            out[b] = super().forward(tokens[s, :end][None].to(input_ids.device), cache, slots[b:b + 1], keep)[0]
        return torch.stack(out)

    def build_rotary(self, cfg: ModelConfig) -> PhimoeRotaryEmbedding:
        return PhimoeRotaryEmbedding(cfg.rope, int(cfg.head_dim * cfg.rope.partial_rotary_factor),
                                     cfg.max_position_embeddings)

    def build_norm(self, cfg: ModelConfig, dim: int, dtype) -> nn.LayerNorm:
        return nn.LayerNorm(dim, eps=cfg.rms_norm_eps, dtype=dtype)

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> DecoderLayer:
        D = cfg.hidden_size
        attn = Attention(D, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, i, rotary,
                         qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias,
                         sliding_window=cfg.layer_sliding_window(i), dtype=dtype)
        mlp = SparseMoeBlock(cfg, "sparsemixer", glu=glu_kind(cfg.hidden_act), dtype=dtype)
        return DecoderLayer(attn, mlp, self.build_norm(cfg, D, dtype), self.build_norm(cfg, D, dtype))
