"""Multi-token-prediction (MTP) heads that a checkpoint keeps under a prefix of their own, not as extra
``model.layers.{N + j}`` (those are :mod:`dynamoe.models.mtp`'s DeepSeek-style heads): Qwen3-Next / Qwen3.5 (``mtp.``)
and K-EXAONE (``mtp.``) in the ``fc`` layout (:class:`FcPredictor`), MiMo-V2-Flash and MiniMax-M3
(``model.mtp.layers.{j}.``) in the per-depth ``eh_proj`` layout (:class:`EhPredictor`). They draft for the engine's ``draft="mtp"`` through the same
interface as the DeepSeek-style heads (:class:`PrefixedMTPHeads`: ``has_mtp``, ``mtp_fill``, ``mtp_drafts``, a
cache layer per depth), so the engine needs nothing per family.

At position p, depth j reads the main model's final-normed hidden state h_p and the *next* token x_{p+1}:

    g_p = out_norm(layer_j(proj([norm_e(embed(x_{p+1})) ; norm_h(h_p)])))     (RoPE position p)
    logits of x_{p+2} = lm_head(g_p)

with the model's own embedding and lm_head (the checkpoints store no copies), ``layer_j`` a decoder layer of the
family attending over the depth's own KV cache entries (cache layer N + j: the same slots, blocks and positions as
the main layers). Unlike DeepSeek's heads, the embedding is not zeroed at p = 0, and g is the *normed* output (what a
further draft feeds back as its hidden state), as in vLLM's Qwen3NextMTP / Qwen3_5MTP / ExaoneMoeMTP / MiMoV2MTP
(vllm/model_executor/models/{qwen3_next_mtp, qwen3_5_mtp, exaone_moe_mtp, mimo_v2_mtp}.py); MiniMax-M3's (vLLM's
MiniMaxM3MTP, vllm/models/minimax_m3) zeroes the embedding at p = 0 and feeds back the layer's output before the
final norm, which only the logits read (DeepSeek's convention). Every draft of a step comes from the first depth, as
there (deeper ones are loaded -- no tensor dropped unseen -- but not run).
"""
from __future__ import annotations

import re
from typing import Callable

import torch
from torch import Tensor, nn

from .mtp import MTPHeads

__all__ = ["FcPredictor", "EhPredictor", "PrefixedMTPHeads", "mtp_depths"]


class FcPredictor(nn.Module):
    """The ``fc`` layout (Qwen3-Next, Qwen3.5, K-EXAONE): one ``fc`` [D, 2 D] over [``pre_fc_norm_embedding``(embed) ;
    ``pre_fc_norm_hidden``(hidden)] shared by the depths, the decoder layers ``layers`` (one per depth), one final
    ``norm``. ``forward(next_ids [B, T], hidden [B, T, D], positions [B, T], cache, slots, kv_len, depth=0) -> g
    [B, T, D]`` (normed); ``logits(g) -> [..., V]``. ``embed_tokens`` / ``lm_head``: the model's modules (shared)."""

    def __init__(self, layers: list, hidden_size: int, norm: Callable[[], nn.Module], embed_tokens: nn.Module,
                 lm_head: nn.Module, dtype=None):
        super().__init__()
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=False, dtype=dtype)
        self.pre_fc_norm_embedding = norm()
        self.pre_fc_norm_hidden = norm()
        self.layers = nn.ModuleList(layers)
        self.norm = norm()
        self.embed_tokens, self.lm_head = embed_tokens, lm_head

    def __len__(self) -> int:
        return len(self.layers)

    def forward(self, next_ids_BT: Tensor, hidden_BTD: Tensor, positions_BT: Tensor, cache=None, slots=None,
                kv_len: int | None = None, depth: int = 0) -> Tensor:
        e = self.pre_fc_norm_embedding(self.embed_tokens(next_ids_BT))
        x = self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden_BTD.to(e.dtype))], dim=-1))
        return self.norm(self.layers[depth](x, positions_BT, cache, slots, kv_len))

    def logits(self, g: Tensor) -> Tensor:
        return self.lm_head(g)


class EhPredictor(nn.Module):
    """The per-depth layout (MiMo-V2-Flash, MiniMax-M3): every depth j holds its own ``enorm``, ``hnorm``, ``eh_proj``
    [D, 2 D] over [enorm(embed) ; hnorm(hidden)], a decoder layer (``block``) and ``final_layernorm``. Same interface
    as :class:`FcPredictor`. ``zero_first``: the embedding is zeroed at position 0 (MiniMax-M3, as DeepSeek's heads);
    ``feeds_normed``: g is the final-normed output (MiMo); else g is the layer's output and the logits read
    final_layernorm(g) (MiniMax-M3, as DeepSeek's)."""

    def __init__(self, blocks: list, hidden_size: int, norm: Callable[[], nn.Module], embed_tokens: nn.Module,
                 lm_head: nn.Module, dtype=None, *, zero_first: bool = False, feeds_normed: bool = True):
        super().__init__()
        self.layers = nn.ModuleList(_EhDepth(b, hidden_size, norm, dtype) for b in blocks)
        self.embed_tokens, self.lm_head = embed_tokens, lm_head
        self.zero_first, self.feeds_normed = zero_first, feeds_normed

    def __len__(self) -> int:
        return len(self.layers)

    def forward(self, next_ids_BT: Tensor, hidden_BTD: Tensor, positions_BT: Tensor, cache=None, slots=None,
                kv_len: int | None = None, depth: int = 0) -> Tensor:
        d = self.layers[depth]
        e = self.embed_tokens(next_ids_BT)
        if self.zero_first:
            e = e.masked_fill((positions_BT == 0).unsqueeze(-1), 0.0)
        x = d.eh_proj(torch.cat([d.enorm(e), d.hnorm(hidden_BTD.to(e.dtype))], dim=-1))
        g = d.block(x, positions_BT, cache, slots, kv_len)
        return d.final_layernorm(g) if self.feeds_normed else g

    def logits(self, g: Tensor) -> Tensor:
        return self.lm_head(g if self.feeds_normed else self.layers[0].final_layernorm(g))


class _EhDepth(nn.Module):
    def __init__(self, block: nn.Module, hidden_size: int, norm: Callable[[], nn.Module], dtype=None):
        super().__init__()
        self.enorm, self.hnorm = norm(), norm()
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False, dtype=dtype)
        self.block = block
        self.final_layernorm = norm()


class PrefixedMTPHeads:
    """Mixin before :class:`~dynamoe.models.base.CausalLM` for a family whose checkpoint keeps its MTP head under
    :attr:`mtp_checkpoint_prefix`: the family's ``adapt_to_checkpoint`` builds ``mtp`` (an :class:`FcPredictor` or
    :class:`EhPredictor`, decoder layers at layer indices N + j) when the checkpoint has the tensors; this gives the
    cache a layer per depth and runs the first depth for the engine -- :meth:`MTPHeads.mtp_fill` and
    :meth:`MTPHeads.mtp_drafts`, the same code as the DeepSeek-style heads."""

    #: where the checkpoint keeps the head's tensors (for messages)
    mtp_checkpoint_prefix = "mtp."

    has_mtp = MTPHeads.has_mtp
    mtp_fill = MTPHeads.mtp_fill
    mtp_drafts = MTPHeads.mtp_drafts

    def _first_head(self) -> nn.Module:
        if not self.has_mtp:
            raise ValueError(f"{type(self).__name__} has no multi-token-prediction head (its checkpoint has no "
                             f"{self.mtp_checkpoint_prefix}* tensors)")
        return self.mtp

    def new_cache(self, *args, **kwargs):
        """The family's cache plus one layer per MTP depth (layer N + j; allocated on first use)."""
        cache = super().new_cache(*args, **kwargs)
        if self.has_mtp:
            cache.layers.extend({} for _ in range(len(self.mtp)))
        return cache


def mtp_depths(names, prefix: str, layer_key: str = "layers") -> int:
    """How many depths ``{prefix}{layer_key}.{j}.`` the checkpoint names hold (0 for none); a gap is a ValueError."""
    pat = re.compile(re.escape(prefix + layer_key) + r"\.(\d+)\.")
    found = sorted({int(m.group(1)) for m in map(pat.match, names) if m})
    if found != list(range(len(found))):
        raise ValueError(f"the checkpoint's multi-token-prediction layers are {prefix}{layer_key}.{found}: they must "
                         f"be numbered 0, 1, ... without a gap")
    return len(found)
