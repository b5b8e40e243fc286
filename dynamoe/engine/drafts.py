"""Speculative steps of :class:`~dynamoe.engine.engine.GenerationEngine` (a mixin of it): each decoding request's
draft (n-gram lookup, :mod:`dynamoe.engine.speculative`, or the model's multi-token-prediction head), the
verification of every row's draft in one forward, and the MTP head's passes over the positions computed. What is
emitted is always the main model's choice: drafts only save forwards.
"""
from __future__ import annotations

import logging
import time

import torch
from torch import Tensor

from ..models.cache import OutOfBlocks
from .request import RUNNING, Request, TokenEvent
from .sampling import SamplingParams, sample
from .speculative import NgramIndex

log = logging.getLogger(__name__)

__all__ = ["SpeculativeSteps", "speculates"]


def speculates(p: SamplingParams) -> bool:
    """Whether requests with these parameters speculate: greedy ones without penalties (whose next choice
    depends on nothing but the logits)."""
    return p.greedy and not p.uses_repetition_penalty and not p.uses_output_penalties


class SpeculativeSteps:
    """The engine's drafting and verification (state: ``speculative_tokens``, ``_mtp``, ``_rollback``,
    ``history_memory``; see :class:`~dynamoe.engine.engine.GenerationEngine`)."""

    def _drafts(self, reqs: list[Request]) -> list[list[int]]:
        """Each request's n-gram draft ([] for requests that do not speculate: sampled ones and those with
        penalties, whose next choice depends on the previous one beyond the logits), all cut to what every
        row has room for."""
        k = self.speculative_tokens
        if not k:
            return [[] for _ in reqs]
        out = []
        room = min((self.capacity - r.num_tokens for r in reqs), default=0)
        k = min(k, room)
        if self._rollback:   # the verification forward keeps every row's recurrent state after each of its tokens
            per_token = len(reqs) * self.cache.slot_state_bytes
            if per_token:
                k = min(k, self.history_memory // per_token - 1)
        for r in reqs:
            d = []
            if k > 0 and speculates(r.params):
                left = r.max_tokens - len(r.output_ids) - 1   # tokens it may add after the next one
                if left > 0 and self._mtp:
                    d = (r._mtp_draft or [])[:min(k, left)]   # made by the head after the last forward
                elif left > 0:
                    if r._ngram is None:
                        r._ngram = NgramIndex()
                    d = r._ngram.draft(r.prompt_ids + r.output_ids, min(k, left))
            out.append(d)
        return out if any(out) else [[] for _ in reqs]

    def _verify(self, reqs: list[Request], ids: list[list[int]], logits: Tensor, events: list[TokenEvent],
                hidden: Tensor | None = None) -> None:
        """Emit, per row, the model's choices after each of its fed tokens as long as they equal the next fed
        token (the accepted draft), then its choice after the last accepted one; run the MTP head over the
        accepted positions (``hidden``: the main model's states, with draft='mtp'); cut the cache back to the
        tokens fed and accepted."""
        K = len(ids[0]) - 1
        spec = [i for i, r in enumerate(reqs)
                if (r._ngram is not None or r._mtp_draft is not None) and r.params.greedy]
        speculating = set(spec)
        plain = [i for i in range(len(reqs)) if i not in speculating]
        if plain:
            self._sample_and_emit([reqs[i] for i in plain], logits[plain, 0], events)
        accepted = [0] * len(reqs)
        if spec:
            flat = logits[spec].reshape(len(spec) * (K + 1), -1)
            params = [reqs[i].params for i in spec for _ in range(K + 1)]
            toks, lps = sample(flat, params, [None] * len(params), None, None)
            toks = toks.view(len(spec), K + 1).tolist()
            now = time.perf_counter()
            with self._lock:
                for j, i in enumerate(spec):
                    r, row = reqs[i], toks[j]
                    a = 0
                    while a < K and row[a] == ids[i][a + 1]:
                        a += 1
                    accepted[i] = a
                    src = "mtp" if r._mtp_draft is not None else "ngram"
                    for key in ("spec_drafted", f"spec_drafted_{src}"):
                        self.totals[key] += K
                    for key in ("spec_accepted", f"spec_accepted_{src}"):
                        self.totals[key] += a
                    for t in range(a + 1):
                        if not self._emit(r, row[t], lps[j * (K + 1) + t], now, events):
                            break
        starts = [r._computed for r in reqs]
        with self._lock:
            for i, r in enumerate(reqs):
                r._computed += 1 + accepted[i]
        if hidden is not None:
            # the head over every fed position (after the last accepted one: filler, overwritten next time); next
            # tokens are the accepted drafts and the model's choice after them
            nxt = [[*ids[i][1:accepted[i] + 1], r.output_ids[-1], *ids[i][accepted[i] + 1:]]
                   for i, r in enumerate(reqs)]
            self._mtp_pass(reqs, starts, nxt, hidden, accepted)
        with self._lock:
            for r in reqs:
                if r.slot is not None:
                    self.cache.truncate(r.slot, r._computed)

    def _mtp_pass(self, reqs: list[Request], starts: list[int], next_ids: list[list[int]], hidden_BTD: Tensor,
                  last: list[int | None]) -> None:
        """Run the MTP head after a forward, for the rows of ``reqs`` that use it: over the positions
        ``starts[i]``.. that the forward computed (``hidden_BTD``: its final-normed states; ``next_ids``: the
        token after each position), writing the head's cache entries there; then, for rows whose
        ``last[i]`` is not None (the index of their last real position), draft their next step's tokens from
        there (as many as ``speculative_tokens``, the row's ``max_tokens`` and the context allow)."""
        rows = [i for i, r in enumerate(reqs)
                if r._mtp_draft is not None and r.slot is not None and r.state == RUNNING and not r._cancel]
        for i in list(rows):
            r = reqs[i]
            r._mtp_draft = []
            if r._head_len != starts[i]:   # (never expected: the head ran over every earlier position)
                log.warning("request %s: its MTP head entries end at %d, not %d: it drafts no more", r.id,
                            r._head_len, starts[i])
                r._mtp_draft = None
                rows.remove(i)
        if not rows:
            return
        try:
            self._mtp_run(reqs, rows, starts, next_ids, hidden_BTD, last)
        except Exception:   # drafts only propose: a failing head stops them for these requests, not the requests
            log.exception("the MTP head failed; requests %s draft no more", [reqs[i].id for i in rows])
            for i in rows:
                reqs[i]._mtp_draft = None

    def _mtp_run(self, reqs: list[Request], rows: list[int], starts: list[int], next_ids: list[list[int]],
                 hidden_BTD: Tensor, last: list[int | None]) -> None:
        """:meth:`_mtp_pass` for the rows of ``reqs`` listed in ``rows``."""
        dev = hidden_BTD.device
        T = hidden_BTD.size(1)
        sel = torch.tensor(rows, device=dev)
        slots = torch.tensor([reqs[i].slot for i in rows], dtype=torch.long, device=self.device)
        positions = torch.tensor([starts[i] for i in rows], device=dev)[:, None] + torch.arange(T, device=dev)
        nxt = torch.tensor([next_ids[i] for i in rows], dtype=torch.long, device=dev)
        g = self.model.mtp_fill(nxt, hidden_BTD[sel], positions, self.cache, slots)
        draft_rows, ks = [], []
        bs = self.cache.block_size
        for j, i in enumerate(rows):
            r = reqs[i]
            r._head_len = r._computed
            if last[i] is None:
                continue
            C = r._computed   # the next step feeds position C (its last token) and the drafts after it
            k = min(self.speculative_tokens, r.max_tokens - len(r.output_ids) - 1, self.capacity - C - 1)
            if k > 1:   # drafts 2..k write head entries at positions C..C+k-2
                try:
                    self.cache.reserve(r.slot, C + k - 1)
                except OutOfBlocks:
                    k = min(k, len(self.cache.blocks(r.slot)) * bs - C + 1)
            if k >= 1:
                draft_rows.append(j)
                ks.append(k)
        if not draft_rows:
            return
        idx = torch.tensor(draft_rows, device=dev)
        at = torch.tensor([last[rows[j]] for j in draft_rows], device=dev)
        drafts = self.model.mtp_drafts(g[idx, at], positions[idx, at], self.cache, slots[idx.to(slots.device)], ks)
        for j, d in zip(draft_rows, drafts):
            reqs[rows[j]]._mtp_draft = d
