"""Multi-token-prediction (MTP) heads: draft tokens for speculative decoding (:mod:`dynamoe.engine.engine`,
``draft="mtp"``) from the layers checkpoints ship beside the decoder's. Families: DeepSeek-V3 / R1 / V3.2, Kimi-K2,
the GLM-4.5 family and GLM-5 (:mod:`~dynamoe.models.deepseek_v3`, :mod:`~dynamoe.models.glm4_moe`), DeepSeek-V4,
Step-3.5, Hy3, Hy4, dots3_note and Ling-3 (``bailing_hybrid``: its recurrent KDA state rolls back past rejected
drafts, ``recurrent_rollback``). Families whose MTP
architecture no public source gives keep theirs unread and say so (Sarvam: ``mtp_unsupported``; Mellum).

Checkpoint: MTP depth j lives under ``model.layers.{N + j}.`` (N = ``num_hidden_layers``, j <
``num_nextn_predict_layers``): ``enorm``, ``hnorm``, ``eh_proj`` [D, 2 D], ``embed_tokens``, ``shared_head.norm``,
``shared_head.head`` and a whole decoder layer of the family (``self_attn.*``, ``mlp.*`` -- an MoE layer --,
``input_layernorm``, ``post_attention_layernorm``). transformers does not run these layers (it drops them on
load); vLLM and SGLang draft with them, and so does dynamoe. A checkpoint without them builds no head (many
conversions drop them); one whose depth has no ``embed_tokens`` / ``shared_head.head`` of its own uses the
model's embeddings / lm_head there.

A family whose heads differ says so through :class:`MTPHeads`' hooks and :class:`NextTokenPredictor`'s options:

* where depth j is and what marks it: :meth:`~MTPHeads.mtp_prefix` / :meth:`~MTPHeads.mtp_depth_of` /
  ``mtp_marker`` (DeepSeek-V4: ``mtp.{j}.``, ``e_proj``; Hy4: ``model.mtp_layers.{j}.``), ``mtp_renames`` (the
  head's own tensors: Step-3.5's ``transformer.shared_head.{norm,output}``, Hy3's / Ling-3's / Hy4's
  ``final_layernorm``), ``mtp_own_copies`` / ``mtp_ignored`` (Hy3: always the model's embedding and lm_head);
* its decoder layer: :meth:`~MTPHeads.build_mtp_layer` (the layer's kind from the config's per-layer lists past
  N -- ``mtp_layer_entries`` -- or its tensors; None where neither says, logged);
* its arithmetic: :meth:`~MTPHeads.new_mtp_head` with ``split_proj`` (V4's ``e_proj`` / ``h_proj``, the embedding
  broadcast over residual streams), ``head_norm`` (V4's ``hc_head`` collapse), ``norm`` (Step-3.5's zero-centred
  norms), ``mask_first`` (whether position 0's embedding is zeroed), ``norm_output`` (the head's output is
  ``shared_head.norm``'d -- what a further draft reads -- as Hy3's, Hy4's, Ling-3's and dots3_note's heads do);
  ``CausalLM.hidden_before_norm`` (V4's head reads the main model's streams before their collapse).

At position p, a head reads the main model's final-normed hidden state h_p and the *next* token x_{p+1}:
``g_p = layer(eh_proj([enorm(embed(x_{p+1})) ; hnorm(h_p)]))`` at RoPE position p, attending over the head's own
KV cache entries (cache layer N + j: the same slots, block tables and positions as the main layers), and
``shared_head.head(shared_head.norm(g_p))`` are the logits of x_{p+2}. The embedding is zeroed where p = 0. A
further draft feeds the drafted token and g_p back in at p + 1 (the head's own output as its "hidden state").
As in vLLM's DeepSeekMTP and its proposer (vllm/model_executor/models/deepseek_mtp.py,
vllm/v1/spec_decode/eagle.py), every draft of a step comes from the first depth; deeper ones are loaded (no
tensor dropped unseen) but not run. (Newer vLLM heads for DeepSeek-V3.2 feed the *normed* output back --
``norm_output`` --, citing better acceptance; DeepSeek-V3 / GLM here keep the pre-norm feedback above.)

The head's cache entry at p depends on x_{p+1}, one token past p: the engine runs the head over a sequence's
positions once the token after each is known (:meth:`MTPHeads.mtp_fill`), and its prefix cache keeps track of
which blocks hold such entries (:mod:`dynamoe.engine.prefix`). Drafts only propose: the engine verifies them
with the main model, so what is emitted is the main model's choice whatever the head says.
"""
from __future__ import annotations

import logging
import re
from typing import Callable

import torch
from torch import Tensor, nn

from .hyper_connections import StreamEmbedding
from .norms import RMSNorm

log = logging.getLogger(__name__)

__all__ = ["NextTokenPredictor", "MTPHeads"]

_OURS = re.compile(r"mtp\.(\d+)\.")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class _SharedHead(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, eps: float, dtype=None):
        super().__init__()
        self.norm: nn.Module = RMSNorm(hidden_size, eps, dtype=dtype)
        self.head = nn.Linear(hidden_size, vocab_size, bias=False, dtype=dtype)


class NextTokenPredictor(nn.Module):
    """One MTP depth (see the module docstring): ``forward(next_ids [B, T], hidden [B, T, ...D], positions [B, T],
    cache, slots, kv_len) -> g`` (the decoder layer's output, before ``shared_head.norm``; shaped as ``hidden``)
    and ``logits(g) -> [..., V]``.

    ``split_proj``: the input projection as two matrices (DeepSeek-V4's ``e_proj`` / ``h_proj`` [D, D]) whose sum
    is ``eh_proj`` on the concatenation; the embedding's term then broadcasts over any stream dims of ``hidden``
    (V4's residual streams [B, T, N, D]). ``norm``: makes ``enorm``, ``hnorm`` and ``shared_head.norm`` (default
    an RMSNorm; Step-3.5: its zero-centred one); ``head_norm``: the module in place of ``shared_head.norm`` (V4: its
    hyper-connection head collapsing the streams, then the norm). ``mask_first``: the embedding zeroed at position
    0 (DeepSeek's heads in vLLM; Step-3.5's are not). ``norm_output``: ``g`` is ``shared_head.norm`` of the layer's
    output -- what a further draft reads and the logits project without another norm (Hy3's ``final_layernorm``).
    Subclasses may override :meth:`embed` (a family whose
    embedding module does more than look up rows)."""

    def __init__(self, block: nn.Module, hidden_size: int, vocab_size: int, eps: float, dtype=None, *,
                 split_proj: bool = False, head_norm: nn.Module | None = None,
                 norm: Callable[[], nn.Module] | None = None, mask_first: bool = True, norm_output: bool = False):
        super().__init__()
        norm = norm or (lambda: RMSNorm(hidden_size, eps, dtype=dtype))
        self.enorm, self.hnorm = norm(), norm()
        self.mask_first, self.norm_output = mask_first, norm_output
        if split_proj:
            self.e_proj = nn.Linear(hidden_size, hidden_size, bias=False, dtype=dtype)
            self.h_proj = nn.Linear(hidden_size, hidden_size, bias=False, dtype=dtype)
        else:
            self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False, dtype=dtype)
        self.split_proj = split_proj
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size, dtype=dtype)
        self.shared_head = _SharedHead(hidden_size, vocab_size, eps, dtype=dtype)
        self.shared_head.norm = norm() if head_norm is None else head_norm
        self.block = block

    def embed(self, ids: Tensor) -> Tensor:
        """The token embeddings [B, T, D] the head reads (rows only where the model's embedding copies them onto
        residual streams: DeepSeek-V4's, Hy4's StreamEmbedding)."""
        if isinstance(self.embed_tokens, StreamEmbedding):
            return nn.Embedding.forward(self.embed_tokens, ids)
        return self.embed_tokens(ids)

    def forward(self, next_ids_BT: Tensor, hidden_BTD: Tensor, positions_BT: Tensor, cache=None, slots=None,
                kv_len: int | None = None) -> Tensor:
        e = self.embed(next_ids_BT)
        if self.mask_first:   # (as vLLM's DeepSeek heads: position 0 has no "next" input)
            e = e.masked_fill((positions_BT == 0).unsqueeze(-1), 0.0)
        h = self.hnorm(hidden_BTD.to(e.dtype))
        if self.split_proj:
            pe = self.e_proj(self.enorm(e))
            pe = pe.view(*pe.shape[:2], *[1] * (h.dim() - 3), pe.size(-1))   # over hidden's stream dims, if any
            x = pe + self.h_proj(h)
        else:
            x = self.eh_proj(torch.cat([self.enorm(e), h], dim=-1))
        g = self.block(x, positions_BT, cache, slots, kv_len)
        return self.shared_head.norm(g) if self.norm_output else g

    def logits(self, g: Tensor) -> Tensor:
        return self.shared_head.head(g if self.norm_output else self.shared_head.norm(g))


class MTPHeads:
    """Mixin for a :class:`~dynamoe.models.base.CausalLM` family whose checkpoints may carry DeepSeek-style MTP
    layers (put it before CausalLM in the bases): builds ``mtp`` (an ``nn.ModuleList`` of
    :class:`NextTokenPredictor`) when the checkpoint has them, maps their names, gives the cache a layer per
    depth and runs the first depth for the engine (:meth:`mtp_fill`, :meth:`mtp_drafts`).

    Where a family's heads differ (DeepSeek-V4: ``mtp.{j}.`` names, split projections, residual streams), it
    overrides the hooks: :meth:`mtp_prefix` / ``mtp_marker`` (where depth j's tensors are and which one says it
    is there), ``mtp_renames`` (the checkpoint's names of the head's own tensors), :meth:`build_mtp_layer`,
    :meth:`new_mtp_head`."""

    #: the tensor (under :meth:`mtp_prefix`) whose presence makes a depth: a layer without it builds no head
    mtp_marker: str = "eh_proj.weight"
    #: (ours, theirs) substring renames of a head's own tensors (not its decoder layer's), first match wins
    mtp_renames: tuple = ()
    #: whether a depth's own ``embed_tokens`` / ``shared_head.head`` copies are read when the checkpoint has them
    #: (False: the heads always use the model's, as vLLM's Hy3 MTP does)
    mtp_own_copies: bool = True
    #: names under a depth's prefix the family knowingly does not read (Hy3: its ``shared_head.`` and
    #: ``embed_tokens.``); logged once when a head is built
    mtp_ignored: tuple = ()
    #: why a family (a subclass of an MTP family) builds no heads: its MTP architecture has no public source; the
    #: loader then logs the layers' tensors as unloaded, and this reason once
    mtp_unsupported: str | None = None

    def mtp_prefix(self, j: int) -> str:
        """The checkpoint name prefix of MTP depth j: ``model.layers.{N + j}.`` (under ``checkpoint_prefix``)."""
        return f"{self.checkpoint_prefix}model.layers.{self.config.num_hidden_layers + j}."

    def build_mtp_layer(self, cfg, i: int, rotary, dtype, names: set) -> nn.Module | None:
        """The decoder layer of the MTP depth at layer index ``i`` >= num_hidden_layers: the family's layer i
        (``names``: the checkpoint's tensor names without ``checkpoint_prefix``, for a family whose MTP layer may
        lack optional parts). None: this depth and those after it build no head (the family logs why)."""
        return self.build_layer(cfg, i, rotary, dtype)

    def new_mtp_head(self, cfg, block: nn.Module, dtype) -> NextTokenPredictor:
        """Depth's head around its decoder layer ``block`` (a family with other projections / norms overrides)."""
        return NextTokenPredictor(block, cfg.hidden_size, cfg.vocab_size, cfg.rms_norm_eps, dtype=dtype)

    def mtp_depth_of(self, name: str) -> int | None:
        """The MTP depth j a checkpoint tensor ``name`` would belong to (None: none), for telling a gap from a
        missing depth: ``...layers.{i}.`` with i >= num_hidden_layers is depth i - N."""
        m = _LAYER.search(name)
        N = self.config.num_hidden_layers
        return int(m.group(1)) - N if m and int(m.group(1)) >= N else None

    def mtp_checkpoint_name(self, j: int, rest: str) -> str:
        """The checkpoint's name of our ``mtp.{j}.{rest}`` through every renaming the model applies (a wrapper's
        stack included): what the loader reads for it."""
        return self.checkpoint_name(f"mtp.{j}.{rest}")

    def _mtp_depths(self, names: set) -> list[int]:
        """The depths j whose ``mtp_marker`` is in ``names``: 0..n-1 or a ValueError."""
        depths = sorted({j for n in names if n.endswith(self.mtp_marker) and (j := self.mtp_depth_of(n)) is not None
                         and n == self.mtp_checkpoint_name(j, self.mtp_marker)})
        if depths != list(range(len(depths))):
            found = [self.mtp_checkpoint_name(j, self.mtp_marker) for j in depths]
            raise ValueError(f"the checkpoint's multi-token-prediction layers are {found}: they must be depths 0, 1, "
                             f"... ({self.mtp_checkpoint_name(0, self.mtp_marker)}, ...; config field "
                             f"'num_hidden_layers' = {self.config.num_hidden_layers}) without a gap")
        return depths

    def adapt_to_checkpoint(self, names) -> None:
        """Build the heads for the depths the checkpoint has (their ``mtp_marker``; called by the loader on the
        meta-device model, before any tensor is read)."""
        parent = getattr(super(), "adapt_to_checkpoint", None)
        if parent is not None:
            parent(names)
        cfg, prefix = self.config, self.checkpoint_prefix
        names = set(names)
        depths = self._mtp_depths(names)
        if not depths:
            return
        if self.mtp_unsupported:
            log.info("%s: no multi-token-prediction head is built: %s", cfg.model_type, self.mtp_unsupported)
            return
        want = cfg.num_nextn_predict_layers
        if want and want != len(depths):
            raise ValueError(f"the checkpoint has {len(depths)} multi-token-prediction layers but config field "
                             f"'num_nextn_predict_layers' says {want}")
        present = {n[len(prefix):] for n in names if n.startswith(prefix)}
        dtype, heads, N = self.dtype, [], cfg.num_hidden_layers
        for j in depths:
            block = self.build_mtp_layer(cfg, N + j, self.model.rotary_emb, dtype, present)
            if block is None:   # (the family said why)
                break
            head = self.new_mtp_head(cfg, block, dtype)
            own = self.mtp_own_copies
            if not own or self.mtp_checkpoint_name(j, "embed_tokens.weight") not in names:   # one copy kept
                head.embed_tokens = self.model.embed_tokens
            if not own or self.mtp_checkpoint_name(j, "shared_head.head.weight") not in names:
                head.shared_head.head = self.lm_head
            heads.append(head)
        if heads:
            self.mtp = nn.ModuleList(heads)
        skipped = {n for j in range(len(heads)) for n in names
                   if any(n.startswith(self.mtp_checkpoint_name(j, "") + x) for x in self.mtp_ignored)}
        object.__setattr__(self, "_mtp_skipped", {n[len(prefix):] for n in skipped if n.startswith(prefix)})
        if skipped:
            log.info("%s: not reading %d tensors of the multi-token-prediction layers (%s): the heads use the "
                     "model's embedding and lm_head", cfg.model_type, len(skipped),
                     ", ".join(sorted({x for x in self.mtp_ignored for n in skipped if x in n})))

    def ignores_checkpoint_tensor(self, name: str) -> bool:
        return name in getattr(self, "_mtp_skipped", ()) or super().ignores_checkpoint_tensor(name)

    def _mtp_name(self, j: int, rest: str) -> str:
        """Our ``mtp.{j}.{rest}`` (a head's tensor, or its layer's: ``block.``...) under :meth:`mtp_prefix`, before
        the renamings that follow MTPHeads in the bases (a wrapper's)."""
        if rest.startswith("block."):   # the decoder layer: the family's renames, as for layer 0
            inner = super().checkpoint_name("model.layers.0." + rest[len("block."):])
            return self.mtp_prefix(j) + inner.split("layers.0.", 1)[1]
        for ours, theirs in self.mtp_renames:
            if ours in rest:
                rest = rest.replace(ours, theirs, 1)
                break
        return self.mtp_prefix(j) + rest

    def checkpoint_name(self, name: str) -> str:
        m = _OURS.match(name)   # (only heads have parameters named mtp.*)
        if m is None:
            return super().checkpoint_name(name)
        return self._mtp_name(int(m.group(1)), name[m.end():])

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
                if mod is main or not isinstance(main, type(mod)) or type(mod) not in (nn.Linear, nn.Embedding):
                    continue   # (the model's may be a subclass: V4's StreamEmbedding, same weight)
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
