"""Multi-token-prediction (MTP) heads of DeepSeek-V3 / R1, Kimi-K2 and the GLM-4.5 family: draft tokens for
speculative decoding (:mod:`dynamoe.engine.engine`, ``draft="mtp"``).

Checkpoint: MTP depth j lives under ``model.layers.{N + j}.`` (N = ``num_hidden_layers``, j <
``num_nextn_predict_layers``): ``enorm``, ``hnorm``, ``eh_proj`` [D, 2 D], ``embed_tokens``, ``shared_head.norm``,
``shared_head.head`` and a whole decoder layer of the family (``self_attn.*``, ``mlp.*`` -- an MoE layer --,
``input_layernorm``, ``post_attention_layernorm``). transformers does not run these layers (it drops them on
load); vLLM and SGLang draft with them, and so does dynamoe. A checkpoint without them builds no head (many
conversions drop them); one whose depth has no ``embed_tokens`` / ``shared_head.head`` of its own uses the
model's embeddings / lm_head there.

At position p, a head reads the main model's final-normed hidden state h_p and the *next* token x_{p+1}:
``g_p = layer(eh_proj([enorm(embed(x_{p+1})) ; hnorm(h_p)]))`` at RoPE position p, attending over the head's own
KV cache entries (cache layer N + j: the same slots, block tables and positions as the main layers), and
``shared_head.head(shared_head.norm(g_p))`` are the logits of x_{p+2}. The embedding is zeroed where p = 0. A
further draft feeds the drafted token and g_p back in at p + 1 (the head's own output as its "hidden state").
As in vLLM's DeepSeekMTP and its proposer (vllm/model_executor/models/deepseek_mtp.py,
vllm/v1/spec_decode/eagle.py), every draft of a step comes from the first depth; deeper ones are loaded (no
tensor dropped unseen) but not run.

The head's cache entry at p depends on x_{p+1}, one token past p: the engine runs the head over a sequence's
positions once the token after each is known (:meth:`MTPHeads.mtp_fill`), and its prefix cache keeps track of
which blocks hold such entries (:mod:`dynamoe.engine.prefix`). Drafts only propose: the engine verifies them
with the main model, so what is emitted is the main model's choice whatever the head says.
"""
from __future__ import annotations

import logging
import re

import torch
from torch import Tensor, nn

from .norms import RMSNorm

log = logging.getLogger(__name__)

__all__ = ["NextTokenPredictor", "MTPHeads"]

_MTP_LAYER = re.compile(r"model\.layers\.(\d+)\.eh_proj\.weight$")
_OURS = re.compile(r"mtp\.(\d+)\.")


class _SharedHead(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, eps: float, dtype=None):
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps, dtype=dtype)
        self.head = nn.Linear(hidden_size, vocab_size, bias=False, dtype=dtype)


class NextTokenPredictor(nn.Module):
    """One MTP depth (see the module docstring): ``forward(next_ids [B, T], hidden [B, T, D], positions [B, T],
    cache, slots, kv_len) -> g [B, T, D]`` (the decoder layer's output, before ``shared_head.norm``) and
    ``logits(g) -> [..., V]``."""

    def __init__(self, block: nn.Module, hidden_size: int, vocab_size: int, eps: float, dtype=None):
        super().__init__()
        self.enorm = RMSNorm(hidden_size, eps, dtype=dtype)
        self.hnorm = RMSNorm(hidden_size, eps, dtype=dtype)
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False, dtype=dtype)
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size, dtype=dtype)
        self.shared_head = _SharedHead(hidden_size, vocab_size, eps, dtype=dtype)
        self.block = block

    def forward(self, next_ids_BT: Tensor, hidden_BTD: Tensor, positions_BT: Tensor, cache=None, slots=None,
                kv_len: int | None = None) -> Tensor:
        e = self.embed_tokens(next_ids_BT)
        e = e.masked_fill((positions_BT == 0).unsqueeze(-1), 0.0)   # (as vLLM: position 0 has no "next" input)
        h = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(hidden_BTD.to(e.dtype))], dim=-1))
        return self.block(h, positions_BT, cache, slots, kv_len)

    def logits(self, g: Tensor) -> Tensor:
        return self.shared_head.head(self.shared_head.norm(g))


class MTPHeads:
    """Mixin for a :class:`~dynamoe.models.base.CausalLM` family whose checkpoints may carry DeepSeek-style MTP
    layers (put it before CausalLM in the bases): builds ``mtp`` (an ``nn.ModuleList`` of
    :class:`NextTokenPredictor`) when the checkpoint has them, maps their names, gives the cache a layer per
    depth and runs the first depth for the engine (:meth:`mtp_fill`, :meth:`mtp_drafts`)."""

    def build_mtp_layer(self, cfg, i: int, rotary, dtype, names: set) -> nn.Module:
        """The decoder layer of the MTP depth at layer index ``i`` >= num_hidden_layers: the family's layer i
        (``names``: the checkpoint's tensor names, for a family whose MTP layer may lack optional parts)."""
        return self.build_layer(cfg, i, rotary, dtype)

    def adapt_to_checkpoint(self, names) -> None:
        """Build the heads for the ``model.layers.{N + j}.eh_proj`` the checkpoint has (called by the loader on
        the meta-device model, before any tensor is read)."""
        parent = getattr(super(), "adapt_to_checkpoint", None)
        if parent is not None:
            parent(names)
        cfg, prefix = self.config, self.checkpoint_prefix
        N = cfg.num_hidden_layers
        present = {n[len(prefix):] for n in names if n.startswith(prefix)}
        layers = sorted(int(m.group(1)) for m in map(_MTP_LAYER.match, present) if m and int(m.group(1)) >= N)
        if not layers:
            return
        if layers != list(range(N, N + len(layers))):
            raise ValueError(f"the checkpoint's multi-token-prediction layers are model.layers.{layers}: they must "
                             f"follow the {N} decoder layers (config field 'num_hidden_layers') without a gap")
        want = cfg.num_nextn_predict_layers
        if want and want != len(layers):
            raise ValueError(f"the checkpoint has {len(layers)} multi-token-prediction layers but config field "
                             f"'num_nextn_predict_layers' says {want}")
        dtype, heads = self.dtype, []
        for i in layers:
            head = NextTokenPredictor(self.build_mtp_layer(cfg, i, self.model.rotary_emb, dtype, present), cfg.hidden_size,
                                      cfg.vocab_size, cfg.rms_norm_eps, dtype=dtype)
            if f"model.layers.{i}.embed_tokens.weight" not in present:   # a conversion that keeps one copy
                head.embed_tokens = self.model.embed_tokens
            if f"model.layers.{i}.shared_head.head.weight" not in present:
                head.shared_head.head = self.lm_head
            heads.append(head)
        self.mtp = nn.ModuleList(heads)

    def checkpoint_name(self, name: str) -> str:
        m = _OURS.match(name)
        if m is None or getattr(self, "mtp", None) is None:
            return super().checkpoint_name(name)
        layer = f"model.layers.{self.config.num_hidden_layers + int(m.group(1))}."
        rest = name[m.end():]
        if rest.startswith("block."):   # the decoder layer: the family's renames, as for layer 0
            inner = super().checkpoint_name("model.layers.0." + rest[len("block."):])
            return inner.replace("model.layers.0.", layer, 1)
        return self.checkpoint_prefix + layer + rest

    def new_cache(self, *args, **kwargs):
        """The family's cache plus one layer per MTP depth (layer N + j; its tensors are allocated on first use,
        so depths that never run take no memory)."""
        cache = super().new_cache(*args, **kwargs)
        heads = getattr(self, "mtp", None)
        if heads is not None:
            cache.layers.extend({} for _ in heads)
        return cache

    def share_mtp_tensors_(self) -> int:
        """Let each head's ``embed_tokens`` / ``shared_head.head`` be the model's own where they hold the same
        numbers (DeepSeek-V3's checkpoints store copies): the memory of two vocab-sized matrices per head comes
        back. Returns how many were shared (the loader calls it)."""
        shared = 0
        for head in getattr(self, "mtp", None) or ():
            for parent, attr, main in ((head, "embed_tokens", self.model.embed_tokens),
                                       (head.shared_head, "head", self.lm_head)):
                mod = getattr(parent, attr)
                if mod is main or type(mod) is not type(main) or not isinstance(mod, (nn.Linear, nn.Embedding)):
                    continue
                w, m = mod.weight, main.weight
                if w.shape == m.shape and w.dtype == m.dtype and w.device == m.device and torch.equal(w, m):
                    setattr(parent, attr, main)
                    shared += 1
        return shared

    @property
    def has_mtp(self) -> bool:
        return getattr(self, "mtp", None) is not None

    def _first_head(self) -> NextTokenPredictor:
        if not self.has_mtp:
            raise ValueError(f"{type(self).__name__} has no multi-token-prediction head (its checkpoint has no "
                             f"model.layers.{self.config.num_hidden_layers}.eh_proj and the rest of an MTP layer)")
        return self.mtp[0]

    @torch.inference_mode()
    def mtp_fill(self, next_ids_BT: Tensor, hidden_BTD: Tensor, positions_BT: Tensor, cache, slots_B: Tensor) -> Tensor:
        """Run the first head over positions the main model has just run: ``hidden_BTD`` its final-normed states
        there (``forward(..., return_hidden=True)``), ``next_ids_BT`` the token after each position. Writes the
        head's cache entries at those positions and returns g [B, T, D] (draft from a row's last real
        position with :meth:`mtp_drafts`)."""
        head = self._first_head()
        return head(next_ids_BT, hidden_BTD, positions_BT, cache, slots_B, int(positions_BT.max()) + 1)

    @torch.inference_mode()
    def mtp_drafts(self, g_BD: Tensor, positions_B: Tensor, cache, slots_B: Tensor, k_B: list[int]) -> list[list[int]]:
        """Greedy drafts: row b's ``k_B[b]`` >= 1 tokens after the head's output ``g_BD`` at position
        ``positions_B[b]`` -- the first from g's logits, each further one by feeding the head its last draft and
        its last output at the next position (writing head cache entries there, which the next
        :meth:`mtp_fill` overwrites: the slots must hold blocks up to position + k - 1)."""
        head = self._first_head()
        tok = head.logits(g_BD).argmax(-1)                                           # [B]
        out = [[int(t)] for t in tok.tolist()]
        alive = list(range(len(k_B)))
        g, pos = g_BD, positions_B
        for j in range(1, max(k_B, default=0)):
            keep = [i for i, b in enumerate(alive) if k_B[b] > j]
            if len(keep) < len(alive):   # rows out of drafts leave the batch
                sel = torch.tensor(keep, device=g.device)
                g, pos, tok = g[sel], pos[sel], tok[sel]
                alive = [alive[i] for i in keep]
            pos = pos + 1
            slots = slots_B[torch.tensor(alive, device=slots_B.device)]
            g = head(tok[:, None], g[:, None], pos[:, None], cache, slots, int(pos.max()) + 1)[:, 0]
            tok = head.logits(g).argmax(-1)
            for b, t in zip(alive, tok.tolist()):
                out[b].append(int(t))
        return out
