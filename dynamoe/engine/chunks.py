"""Prefill chunks of :class:`~dynamoe.engine.engine.GenerationEngine` (a mixin of it): how many prompt tokens a step
takes beside decoding requests (:mod:`dynamoe.engine.budget`), chunks of equal length batched, and -- for a model
whose forward runs a few layers at a time -- one request's chunk taken through the layers over several steps; where
the model's decode plan runs every layer natively, a prompt's last few tokens as rows of the decoding requests' own
forward (one pass over the weights, one native call).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..models.cache import OutOfBlocks
from ..ops.fused import MAX_ROWS
from .request import RUNNING, Request, TokenEvent

__all__ = ["ChunkedPrefill"]


@dataclass
class _LayerRun:
    """A chunk's forward part way through the model's layers (:meth:`GenerationEngine._layer_steps`)."""

    group: list
    n: int
    starts: list
    head: bool
    run: object
    seconds: float = 0.0


class ChunkedPrefill:
    """The engine's prefill steps (state: ``token_budget``, ``adaptive_budget``, ``stall_ratio``, ``_chunk_cost``,
    ``_in_steps``, ``_layer_run``; see :class:`~dynamoe.engine.engine.GenerationEngine`)."""

    def _prefill_budget(self, decoded: int, beside: tuple[int, float] | None = None) -> int:
        """Prefill tokens for a step that decoded ``decoded`` rows (and ``beside``: (tokens, seconds) a prompt's rows
        took in that forward): ``token_budget`` - decoded - those tokens when it is fixed, else what takes
        ``stall_ratio`` decode steps less those seconds at the measured speeds (:mod:`.budget`), at least a block, at
        most ``default_token_budget`` - decoded; 0 when the rows took it all."""
        tokens, spent = beside or (0, 0.0)
        top = self.token_budget - decoded - tokens
        if not self.adaptive_budget:
            return max(1, top) if not tokens else max(0, top)
        top = max(1, top)
        seconds = None if self._decode_s is None else self.stall_ratio * self._decode_s - spent
        if seconds is not None and seconds <= 0:
            return 0
        # (the fit is of whatever a step runs of a chunk at once: the whole forward, or one layer where the forward
        # runs in steps -- _layer_steps)
        n = None if seconds is None else self._chunk_cost.tokens_within(seconds, top, self.cache.block_size)
        # at least a block: where a forward's fixed part alone is over the target (a long context on a slow
        # machine), smaller chunks would not shorten the stall, only the progress
        return min(top, max(self.cache.block_size, n or 0))

    def _chunk_beside(self, ready: list[Request]) -> tuple[Request, int] | None:
        """The oldest waiting prompt's remaining tokens as rows of ``ready``'s decode forward, (request, tokens) --
        when they all fit the row limit beside the decode rows (a short prompt, a chat turn past its cached prefix, a
        long prompt's last chunk: one pass over the weights instead of a forward of their own) --, or None: more
        tokens (they prefill in larger chunks first, :meth:`_prefill`: rows cost more per token than a chunk's
        matrix products), an MTP head, a chunk part way through the layers, a decode plan that does not run every
        layer natively (``rows_plan``), blocks not free now, or -- with the measured budget -- such a step expected
        to take more than ``stall_ratio`` decode steps beyond its own: it reads the prompt's keys and values of every
        layer at once (``_rows_cost``: a fit of that extra time against the prompt's length)."""
        room = MAX_ROWS - len(ready)
        if room < 1 or self._mtp or self._layer_run is not None:
            return None
        with self._lock:
            todo = [r for r in self._running if not r._decoding and not r._cancel and r.state == RUNNING]
        if not todo:
            return None
        r = min(todo, key=lambda x: x._order)
        n = r.num_tokens - r._computed
        if n > min(room, self.prefill_chunk or room, self._chunk_cap or room):
            return None
        if not self.adaptive_budget and n > self.token_budget - len(ready):
            return None
        if self.adaptive_budget:
            if self._decode_s is None:   # (the budget compares with a plain decode step: one runs first)
                return None
            ab = self._rows_cost.fit()
            if ab is not None and ab[0] + ab[1] * (r._computed + n) > self.stall_ratio * self._decode_s:
                return None
        rows_plan = getattr(self.model, "rows_plan", None)
        if rows_plan is None or rows_plan(self.cache, torch.tensor([q.slot for q in (*ready, r)])) is None:
            return None
        try:
            self.cache.reserve(r.slot, r._computed + n)
        except OutOfBlocks:
            return None
        return r, n

    def _rows_step(self, ready: list[Request], r: Request, n: int, events: list[TokenEvent]) -> tuple[int, float]:
        """One forward of ``ready``'s decode rows (their last tokens) and ``r``'s next ``n`` prompt tokens
        (:meth:`CausalLM.forward_rows`): the decode rows' tokens sampled, the chunk done as any chunk. Returns the
        tokens and what they added to the decode step (seconds: the step's prefill budget spent)."""
        start = r._computed
        ids = [q.output_ids[-1] for q in ready] + r.tokens(start, start + n)
        B = len(ready)
        t0 = time.perf_counter()
        with torch.inference_mode():
            logits = self._guarded([*ready, r], self.model.forward_rows, torch.tensor(ids, dtype=torch.long),
                                   self.cache, torch.tensor([q.slot for q in ready] + [r.slot] * n, dtype=torch.long),
                                   list(range(B)) + [B + n - 1])
        dt = time.perf_counter() - t0
        extra = max(0.0, dt - (self._decode_s or 0.0))   # what the chunk's rows added to a decode step
        if self._decode_s is not None:   # (against its prompt's length)
            self._rows_cost.observe(start + n, extra)
        for q in ready:
            q._computed += 1
        self._sample_and_emit(ready, logits[:B], events)
        share = dt * n / (B + n)   # (the step's time, split by rows between decode and prefill in the totals)
        self.totals["decode_s"] += dt - share
        self._chunk_done([r], n, [start], logits[B:, None], False, share, events, observe=False)
        return n, extra

    def _prefill(self, events: list[TokenEvent], decoded: int, beside: tuple[int, float] | None = None) -> None:
        """Prefill chunks, oldest request first, within the step's token budget: ``token_budget`` minus the
        rows just decoded while others decode (so that a long prompt never stalls them), else up to
        ``prefill_chunk`` tokens per request; a chunk shrinks (to a block at the least) to the blocks free
        before it preempts a later request. Chunks of equal length run as one batch. Beside decoding requests,
        a model whose forward runs a few layers at a time (``runs_in_steps``) takes one request's chunk through
        as many layers as fit the step's time and goes on in the next steps (:meth:`_layer_steps`): a chunk
        may then cost up to a layer count's worth of steps, each step only its share."""
        if self._layer_run is not None:   # a chunk part way through the layers: its next layers, nothing else
            self._layer_steps(events)
            return
        stepped = bool(decoded) and self._in_steps
        limit = min(self.prefill_chunk or self.max_seq_len, self._chunk_cap or self.max_seq_len)
        budget = self._prefill_budget(decoded, beside) if decoded else None
        with self._lock:
            todo = sorted((r for r in self._running if not r._decoding and not r._cancel), key=lambda r: r._order)
        chunks: dict[int, list[Request]] = {}
        for r in todo:
            if budget is not None and budget <= 0:
                break
            if r.state != RUNNING:
                continue
            n = min(r.num_tokens - r._computed, limit, budget if budget is not None else limit)
            # a shorter chunk in the free blocks rather than preempting a later request for a longer one
            n = max(min(n, self.cache.block_size), min(n, self.cache.room(r.slot) - r._computed))
            if not self._make_room(r, r._computed + n, victims_after=True):
                break   # the pool is full of older requests' blocks: wait for them
            chunks.setdefault(n, []).append(r)
            if budget is not None:
                budget -= n
            if stepped:
                # one request's chunk, through the layers over the next steps -- if the decoding requests keep
                # room for the blocks they may take meanwhile (else the chunk runs whole: its blocks are held
                # until it is done, and a window's old blocks go back only then)
                layers = len(self.model.model.layers)
                stepped = self.cache.pool.num_free >= decoded * (-(-layers // self.cache.block_size) + 1)
                break
        for n, group in chunks.items():
            group = [r for r in group if r.state == RUNNING]
            if not group:
                continue
            head = any(r._mtp_draft is not None for r in group)
            starts = [r._computed for r in group]
            ids = [r.tokens(r._computed, r._computed + n) for r in group]
            if stepped:
                self._layer_run = _LayerRun(group, n, starts, head, self._begin(group, ids, head))
                self._layer_steps(events)
                return
            t0 = time.perf_counter()
            out = self._forward(group, ids, with_hidden=head)
            self._chunk_done(group, n, starts, out, head, time.perf_counter() - t0, events, observe=bool(decoded))

    def _begin(self, reqs: list[Request], ids: list[list[int]], with_hidden: bool):
        """:meth:`CausalLM.begin_forward` for a chunk (the arguments :meth:`_forward` gives)."""
        ids_BT = torch.tensor(ids, dtype=torch.long, device=self.device)
        slots_B = torch.tensor([r.slot for r in reqs], dtype=torch.long, device=self.device)
        keep = 1 if self._keeps_last and ids_BT.size(1) > 1 else 0
        with torch.inference_mode():
            return self._guarded(reqs, self.model.begin_forward, ids_BT, self.cache, slots_B, keep, with_hidden)

    def _layer_steps(self, events: list[TokenEvent]) -> None:
        """The pending chunk's next layers: at least one, another while the last one's time still fits the step's
        target (``stall_ratio`` decode steps); each layer's time goes into the chunk-size fit (one layer is what
        a step cannot split). Once through every layer, its logits as any chunk's."""
        lr = self._layer_run
        target = self.stall_ratio * (self._decode_s or 0.0)
        t0 = time.perf_counter()
        with torch.inference_mode():
            while True:
                t1 = time.perf_counter()
                done = self._guarded(lr.group, self.model.run_some_layers, lr.run, 1)
                t2 = time.perf_counter()
                self._chunk_cost.observe(lr.n * len(lr.group), t2 - t1)
                if done or (t2 - t0) + (t2 - t1) > target:
                    break
            out = self._guarded(lr.group, self.model.end_forward, lr.run) if done else None
        dt = time.perf_counter() - t0
        lr.seconds += dt
        if not done:
            self.totals["prefill_s"] += dt
            return
        self._layer_run = None
        self.totals["prefill_s"] -= lr.seconds - dt   # (_chunk_done counts the whole chunk)
        self._chunk_done(lr.group, lr.n, lr.starts, out, lr.head, lr.seconds, events, observe=False)

    def _chunk_done(self, group: list[Request], n: int, starts: list[int], out, head: bool, seconds: float,
                    events: list[TokenEvent], observe: bool) -> None:
        """After a chunk's forward (``out``: its logits, or (logits, hidden) with the MTP head): the positions
        computed, the first token of the requests whose prompt it completed, the head's pass, the prefix blocks."""
        logits, hidden = out if head else (out, None)
        t0 = time.perf_counter()
        done = []
        for r in group:
            r._computed += n
            if r._computed == r.num_tokens:
                r._decoding = True
                done.append(r)
        if done:
            rows = torch.tensor([group.index(r) for r in done], device=logits.device)
            self._sample_and_emit(done, logits[rows, -1], events)
        if head:   # the head over the chunk (the token after its last position: the prompt's, or the one chosen)
            self._mtp_pass(group, starts, [r.tokens(s + 1, s + n + 1) if r.num_tokens > s + n else [0] * n
                                           for r, s in zip(group, starts)],
                           hidden, [n - 1 if r in done else None for r in group])
        self._prefix.register(group)
        self._trim(group)
        dt = seconds + time.perf_counter() - t0
        self.totals["prefill_s"] += dt
        if observe:
            self._chunk_cost.observe(n * len(group), dt)
        self.totals["prefill_tokens"] += n * len(group)
        for r in done:
            if not r._preempted:
                self.totals["prompt_tokens"] += len(r.prompt_ids)
                self.totals["cached_tokens"] += r.stats.cached_tokens
