"""Continuous batching over the paged KV cache, with prefix caching and chunked prefill beside decode.

A :class:`GenerationEngine` owns one :class:`~dynamoe.models.cache.KVCache`: ``max_batch`` slots (the
sequences running at once) over a pool of blocks (``kv_cache_blocks``; by default enough for every slot to
fill ``max_seq_len``, usually far fewer). Requests wait in a FIFO queue. Each :meth:`~GenerationEngine.step`

1. admits waiting requests into free slots; each starts on the cached blocks of the longest prefix of its
   tokens that any request computed before -- running ones included (:mod:`dynamoe.engine.prefix`);
2. runs one decode step for every decoding request at once (``model(ids[B, 1], cache, slots)``, each row
   at its own position);
3. spends a prefill budget on chunks of the others, oldest first (equal chunk lengths batched): as many
   tokens as take about ``stall_ratio`` times a decode step (measured as the engine runs: the budget follows
   the hardware, the model and the context lengths), or a fixed ``token_budget``; so a long prompt arriving
   holds the running streams' next token back by a small factor, never by its whole prefill. With nothing
   decoding, prompts prefill in chunks of up to ``prefill_chunk``. Where the model's decode plan runs every
   layer natively (``model.rows_plan(cache)``), a prompt whose remaining tokens fit the row limit beside the
   decode rows (a short prompt, a chat turn past its cached prefix, a long prompt's last chunk) rides in step
   2's forward as more rows instead (``model.forward_rows``: one native call, one pass over the weights) --
   unless that step is expected to take more than ``stall_ratio`` decode steps beyond its own (a long context).

When the pool runs out of blocks the request that arrived last is preempted: its blocks go back (its full
ones stay cached) and it waits first in line, then recomputes what it had and goes on -- never a crash or
a truncated output. Every produced token becomes a :class:`TokenEvent` on its request's queue; a request
that finishes (stop token, stop string, ``max_tokens``) or is cancelled frees its slot and blocks at once.

Threading: one thread drives :meth:`step` (or :meth:`run_forever`); other threads may call
:meth:`add_request` and :meth:`cancel` and read events with :meth:`Request.get` /
:meth:`Request.events` (or receive them through ``on_event``, called on the stepping thread).
The model contract: ``model.new_cache(num_slots, max_seq_len, dtype=None, device=None, block_size=...,
num_blocks=...)`` and ``model(input_ids_BT, cache=cache, slots=slots_B) -> logits [B, T, V]`` advancing
``cache.lengths``; a model with ``recurrent_state = True`` (per-sequence state that cannot be cut back to a
prefix) gets no prefix caching, and speculative decoding only when it also says ``recurrent_rollback = True``:
its recurrent layers record their state after every token of a verification forward (run between
``cache.begin_history()`` and ``cache.end_history()``), so that cutting rejected drafts off with
``cache.truncate`` puts the state back where the accepted tokens leave it. A model whose keys and values depend
on where the prompt ended (``positions_independent_of_prompt``: Unlimited-OCR past the prompt, dynamic NTK RoPE
past max_position_embeddings) shares those blocks only with requests whose prompt ended at the same position
(:mod:`dynamoe.engine.prefix`). Each admitted request's prompt length is declared to the cache
(``cache.declare_prompt``, where the cache has it).
"""
from __future__ import annotations

import collections
import inspect
import itertools
import logging
import queue
import threading
import time
from typing import Callable, Iterator, Sequence

import torch
from torch import Tensor

from ..models.cache import DEFAULT_BLOCK_SIZE, OutOfBlocks
from .budget import ChunkCost
from .chunks import ChunkedPrefill, _LayerRun
from .detokenizer import IncrementalDecoder, StopStrings, decode_keeping, special_token_ids
from .drafts import SpeculativeSteps, speculates
from .prefix import PrefixCache
from .prompts import encode_prompt, token_list
from .request import FINISHED, RUNNING, WAITING, Request, RequestStats, TokenEvent
from .sampling import SamplingParams, TokenLogprob, sample

__all__ = ["GenerationEngine", "Request", "TokenEvent", "RequestStats", "encode_prompt", "DRAFT_SOURCES"]

log = logging.getLogger(__name__)

#: where speculative drafts come from: n-gram lookup in the request's context, or the model's MTP head
DRAFT_SOURCES = ("ngram", "mtp")


def _model_device(model) -> torch.device:
    for p in itertools.chain(model.parameters(), model.buffers()):
        return p.device
    return torch.device("cpu")


def _average(old: float | None, new: float, weight: float = 0.25) -> float:
    """Exponential moving average (the first value as it is)."""
    return new if old is None else old + weight * (new - old)


def _check_int(name: str, v, low: int = 1, none: bool = False) -> None:
    if none and v is None:
        return
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ValueError(f"{name} must be {'None or ' if none else ''}an int >= {low}, got {v!r}")


class GenerationEngine(SpeculativeSteps, ChunkedPrefill):
    """Continuous batching of generation requests for one model (see the module docstring).

    model: a module honouring the cache contract. tokenizer: a :class:`~dynamoe.engine.Tokenizer`
    (optional: without it there is no text, only token ids, and no stop strings). max_seq_len: positions
    per sequence (prompt + output); default ``min(config.max_position_embeddings, 4096)``. max_batch:
    cache slots = requests running together. kv_cache_blocks: blocks in the KV cache's pool (None: enough
    for every slot to reach ``max_seq_len``); block_size: positions per block. token_budget: tokens per step
    while requests decode (their rows plus prefill chunks of the others); None: the prefill share is what
    takes ``stall_ratio`` decode steps at the measured speeds (at most ``default_token_budget``). prefill_chunk: the longest
    prefill chunk of one request (bounds a forward's activations); None = a whole prompt when nothing
    decodes. eos_token_ids: stop tokens of every request; default the tokenizer's and the model config's.
    prefix_caching: share the blocks of equal prefixes across requests (a chat's next turn, a common
    system prompt, concurrent requests with one context). speculative_tokens: k > 0 drafts up to k tokens per
    greedy request and step and verifies them in one forward (the same tokens as without). draft: where drafts
    come from -- 'ngram' (default): lookup in the request's own context (:mod:`dynamoe.engine.speculative`);
    'mtp': the model's multi-token-prediction head (:mod:`dynamoe.models.mtp`: DeepSeek-V3 / R1, Kimi-K2,
    GLM-4.5, DeepSeek-V4, Step-3.5, Hy3, Hy4, dots3_note, Ling-3 checkpoints that ship it; :mod:`dynamoe.models.mtp_prefixed`:
    Qwen3-Next / Qwen3.5, MiMo-V2-Flash, K-EXAONE, MiniMax-M3), run after each forward over the positions just
    computed (keeping its own cache entries in step) to draft the next k tokens; a request that drafts with it reuses only cached prefix
    blocks whose head entries were written for its own continuation (:mod:`dynamoe.engine.prefix`).
    """

    #: the most tokens per step while requests decode (their rows plus prefill chunks of new prompts) when the
    #: budget follows the measured speeds
    default_token_budget = 512
    #: while requests decode, a step's prefill chunks take about this many decode steps' time
    stall_ratio = 2.0
    #: the most bytes a verification forward of a model with recurrent state may keep of its rows' states after every
    #: token (what rolls them back past rejected drafts): fewer drafts a step where rows x (drafts + 1) x a row's
    #: state would exceed it (a Qwen3-Next-sized model keeps ~72 MiB a row and token)
    history_memory = 2 << 30

    def __init__(self, model, tokenizer=None, max_seq_len: int | None = None, max_batch: int = 8, *,
                 cache_dtype: torch.dtype | None = None, device=None, prefill_chunk: int | None = None,
                 eos_token_ids: Sequence[int] | None = None, prefix_caching: bool = True,
                 kv_cache_blocks: int | None = None, block_size: int = DEFAULT_BLOCK_SIZE,
                 token_budget: int | None = None, speculative_tokens: int = 0, draft: str = "ngram"):
        config = getattr(model, "config", None)
        if max_seq_len is None:
            mpe = getattr(config, "max_position_embeddings", None)
            max_seq_len = min(int(mpe), 4096) if mpe else 4096
        _check_int("max_seq_len", max_seq_len)
        _check_int("max_batch", max_batch)
        _check_int("prefill_chunk", prefill_chunk, none=True)
        _check_int("kv_cache_blocks", kv_cache_blocks, none=True)
        _check_int("block_size", block_size)
        _check_int("token_budget", token_budget, none=True)
        _check_int("speculative_tokens", speculative_tokens, low=0)
        if draft not in DRAFT_SOURCES:
            raise ValueError(f"draft must be one of {list(DRAFT_SOURCES)}, got {draft!r}")
        if draft == "mtp" and not (getattr(model, "has_mtp", False) and callable(getattr(model, "mtp_fill", None))):
            raise ValueError(f"draft='mtp' needs a model with multi-token-prediction heads, and "
                             f"{type(model).__name__} has none (its checkpoint has no MTP layers, or its family "
                             f"does not run them); use draft='ngram'")
        if draft == "mtp" and not speculative_tokens:
            raise ValueError("draft='mtp' drafts nothing with speculative_tokens=0: pass speculative_tokens >= 1")
        self.model = model
        # models that can skip the lm_head over all but the last prompt position (dynamoe's do)
        try:
            self._keeps_last = "logits_to_keep" in inspect.signature(model.forward).parameters
        except (TypeError, ValueError):
            self._keeps_last = False
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.adaptive_budget = token_budget is None
        self.token_budget = token_budget if token_budget is not None else self.default_token_budget
        self.speculative_tokens = speculative_tokens
        self.draft = draft
        self._decode_s: float | None = None      # moving average: seconds of a decode step
        self._chunk_cost = ChunkCost()           # prefill chunk seconds = a + b * tokens, while requests decode
        self._rows_cost = ChunkCost()            # what a prompt's last rows add to a decode step = a + b * its length
        # beside decoding requests, a chunk's forward a few layers a step (the model runs its layers in steps)
        self._in_steps = self.adaptive_budget and bool(getattr(model, "runs_in_steps", False))
        self._layer_run: _LayerRun | None = None
        self.device = torch.device(device) if device is not None else _model_device(model)
        self.vocab_size = getattr(config, "vocab_size", None)
        if eos_token_ids is None:
            ids = list(getattr(tokenizer, "eos_token_ids", None) or [])
            cfg_eos = getattr(config, "eos_token_id", None)
            ids += cfg_eos if isinstance(cfg_eos, (list, tuple)) else ([cfg_eos] if cfg_eos is not None else [])
            eos_token_ids = ids
        self.eos_token_ids = frozenset(int(i) for i in eos_token_ids)
        self._special_ids: frozenset[int] | None = None   # the tokenizer's, on first use
        self.cache = model.new_cache(max_batch, max_seq_len, dtype=cache_dtype, device=self.device,
                                     block_size=block_size, num_blocks=kv_cache_blocks)
        #: positions one sequence can hold: max_seq_len, or fewer when the whole pool is smaller
        pool_tokens = self.cache.num_blocks * self.cache.block_size
        window, bs = getattr(self.cache, "window", None), self.cache.block_size
        self._chunk_cap = None
        if window is not None and pool_tokens >= window + 3 * bs:
            # a sequence holds its window's blocks and one chunk's: any length fits, in chunks the pool holds
            self.capacity = max_seq_len
            self._chunk_cap = pool_tokens - window - 2 * bs
        else:
            self.capacity = min(max_seq_len, pool_tokens)
        recurrent = bool(getattr(model, "recurrent_state", False))
        if recurrent and prefix_caching:
            log.info("prefix caching is off: the model keeps per-sequence recurrent state, which cannot be "
                     "shared by prefix")
        self.prefix_caching = bool(prefix_caching) and not recurrent
        #: verification forwards keep the recurrent state after every token (cut back past rejected drafts)
        self._rollback = recurrent and bool(getattr(model, "recurrent_rollback", False))
        if recurrent and speculative_tokens and not self._rollback:
            log.info("speculative decoding is off: the model's recurrent state cannot be rolled back past "
                     "rejected drafts")
            self.speculative_tokens = 0
        self._mtp = draft == "mtp" and self.speculative_tokens > 0
        self._prefix = PrefixCache(self.cache, self.prefix_caching,
                                   prompt_scope=getattr(model, "positions_independent_of_prompt", None))

        # waiting queue, free slots, request states, cancel flags; re-entrant so that an on_event callback
        # (run under it, on the stepping thread) may call cancel()
        self._lock = threading.RLock()
        self._work = threading.Condition(self._lock)
        self._step_lock = threading.Lock()     # one step at a time
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: list[Request] = []      # in admission order
        self._free_slots = list(range(max_batch))
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self._stepping = False
        self._loop_thread: threading.Thread | None = None
        self.totals = {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "prefill_tokens": 0,
                       "output_tokens": 0, "steps": 0, "preempted": 0, "prefill_s": 0.0, "decode_s": 0.0,
                       "spec_drafted": 0, "spec_accepted": 0, **{f"spec_{what}_{src}": 0 for src in DRAFT_SOURCES
                                                                  for what in ("drafted", "accepted")}}

    def cache_stats(self) -> dict:
        """The KV cache's pool now: blocks (total, in use, cached = free but holding a prefix, free),
        block size and bytes, positions held by running requests, prefix-cache lookups and hits (blocks)."""
        pool, cache = self.cache.pool, self.cache
        with self._lock:
            tokens = sum(r._computed for r in self._running)
        return {"block_size": cache.block_size, "blocks_total": pool.num_blocks, "blocks_used": pool.num_used,
                "blocks_cached": pool.num_cached, "blocks_free": pool.num_free, "bytes_per_block": cache.bytes_per_block,
                "tokens_in_use": tokens, "prefix_queries": pool.queries, "prefix_hits": pool.hits}

    # --- requests -----------------------------------------------------------------------------------

    def add_request(self, prompt: str | Sequence[int] | Tensor, params: SamplingParams | None = None,
                    max_tokens: int | None = None, stop: Sequence[str] | str = (), stop_token_ids: Sequence[int] = (),
                    *, clip_max_tokens: bool = False, ignore_eos: bool = False, request_id: str | None = None,
                    on_event: Callable[[TokenEvent], None] | None = None,
                    keep_special_ids: Sequence[int] = ()) -> Request:
        """Queue a request and return its handle.

        prompt: token ids (or text, encoded with the tokenizer's special tokens). max_tokens: tokens to
        generate at most; None = as many as fit in ``max_seq_len``. A prompt plus ``max_tokens`` over
        ``max_seq_len`` raises ValueError, unless ``clip_max_tokens`` lowers ``max_tokens`` to what fits.
        A request that then fills ``max_seq_len`` finishes with 'context', not 'length' (its own limit
        was not reached: APIs report the two differently).
        stop: strings that end the output (not included in it). stop_token_ids: tokens that end it, in
        addition to EOS (unless ``ignore_eos``). on_event: called with each event on the stepping thread,
        under the engine's lock: keep it short (e.g. ``loop.call_soon_threadsafe(queue.put_nowait, ev)``).
        keep_special_ids: special tokens whose text stays in the output text (markers an output parser
        reads, e.g. GPT-OSS's ``<|channel|>``); the others are skipped as usual.
        """
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids or give the engine a tokenizer")
            prompt_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, Tensor):
            if prompt.dim() != 1 or prompt.dtype not in (torch.long, torch.int32, torch.int64):
                raise ValueError(f"prompt tensor must be 1-D integer token ids, "
                                 f"got {tuple(prompt.shape)} {prompt.dtype}")
            prompt_ids = prompt.tolist()
        else:
            prompt_ids = token_list(prompt, "prompt")
        if not prompt_ids:
            raise ValueError("prompt must hold at least one token")
        if self.vocab_size is not None and (min(prompt_ids) < 0 or max(prompt_ids) >= self.vocab_size):
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size}), got min {min(prompt_ids)} "
                             f"max {max(prompt_ids)}")
        room = self.capacity - len(prompt_ids)
        limit = (f"max_seq_len={self.max_seq_len}" if self.capacity == self.max_seq_len else
                 f"the KV cache's {self.capacity} positions (kv_cache_blocks={self.cache.num_blocks} x "
                 f"block_size={self.cache.block_size})")
        if room < 1:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room in {limit}")
        context_limited = max_tokens is None or (isinstance(max_tokens, int) and max_tokens > room)
        if max_tokens is None:
            max_tokens = room
        elif isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be None or an int >= 1, got {max_tokens!r}")
        elif max_tokens > room:
            if not clip_max_tokens:
                raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds "
                                 f"{limit}; lower max_tokens to at most {room} "
                                 f"(or pass clip_max_tokens=True)")
            max_tokens = room
        stops = StopStrings(stop)
        if stops.stops and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        stop_ids = frozenset(token_list(stop_token_ids, "stop_token_ids"))
        if not ignore_eos:
            stop_ids |= self.eos_token_ids
        decoder = None
        if self.tokenizer is not None:
            keep = token_list(keep_special_ids, "keep_special_ids")
            if keep and self._special_ids is None:
                self._special_ids = special_token_ids(self.tokenizer)
            decoder = IncrementalDecoder(decode_keeping(self.tokenizer, keep, self._special_ids), context=prompt_ids)
        with self._lock:
            rid = request_id if request_id is not None else f"req-{next(self._ids)}"
            req = Request(rid, prompt_ids, params, max_tokens, stop_ids, stops, decoder, on_event)
            req.context_limited = context_limited
            req._order = next(self._arrivals)
            self._waiting.append(req)
            self.totals["requests"] += 1
            self._work.notify_all()
        return req

    def cancel(self, request: Request) -> bool:
        """Stop ``request``: a waiting one leaves the queue, a running one frees its slot (at once, or right
        after the step in progress). Its last event has finish_reason 'cancelled'. False if already finished."""
        with self._lock:
            if request.state == FINISHED or request._cancel:
                return False
            request._cancel = True
            if request.state == WAITING:
                self._waiting.remove(request)
                self._finish(request, "cancelled")
            elif not self._stepping:
                self._finish(request, "cancelled")
            return True

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    # --- the step -----------------------------------------------------------------------------------

    def step(self) -> list[TokenEvent]:
        """One scheduling step: admit waiting requests into free slots, one decode step for every request
        that is decoding, then prefill chunks for the others with the rest of the token budget. Returns the
        events produced (they are also on the requests' queues)."""
        with self._step_lock:
            with self._lock:
                self._stepping = True
                self._admit()
            events: list[TokenEvent] = []
            try:
                decoded, beside = self._decode(events)
                self._prefill(events, decoded, beside)
            finally:
                with self._lock:
                    self._stepping = False
                    for req in [*self._running, *self._waiting]:
                        if req._cancel and req.state != FINISHED:
                            self._finish(req, "cancelled")
                self.totals["steps"] += 1
            return events

    def _admit(self) -> None:
        """Waiting requests into free slots, in queue order (caller holds ``_lock``); each starts on the cached
        blocks of the longest prefix of its tokens that some earlier request computed."""
        while self._waiting and self._free_slots:
            req = self._waiting.popleft()
            req.slot = self._free_slots.pop(0)
            req.state = RUNNING
            if req.stats.scheduled is None:
                req.stats.scheduled = time.perf_counter()
            if self._mtp and speculates(req.params):
                req._mtp_draft = []   # it runs the MTP head (and takes cached blocks only with head entries)
            cached = self._prefix.attach(req)
            declare = getattr(self.cache, "declare_prompt", None)
            if declare is not None:   # (after attach, which starts the slot afresh) its prompt ends where the
                declare(req.slot, len(req.prompt_ids))   # request's does, however its tokens are computed
            if not req._preempted:
                req.stats.cached_tokens = cached
            self._running.append(req)

    def _preempt(self, victim: Request) -> None:
        """Give ``victim``'s blocks back and queue it first again (caller holds ``_lock``): it recomputes its
        tokens so far when admitted again (its full blocks stay cached, so mostly from the prefix cache) and
        then goes on where it stopped."""
        log.info("KV cache full: preempting request %s (%d tokens; recomputed when blocks are free)", victim.id,
                 victim._computed)
        self._release(victim)
        self._running.remove(victim)
        victim.state, victim._preempted = WAITING, True
        victim._computed = victim._registered = 0
        victim._decoding = False
        victim._head_len = 0
        if victim._mtp_draft is not None:
            victim._mtp_draft = []
        self._waiting.appendleft(victim)
        self.totals["preempted"] += 1

    def _make_room(self, r: Request, length: int, victims_after: bool) -> bool:
        """Blocks for ``r``'s positions up to ``length``; when the pool runs out, preempt the running request
        that arrived last (only ones that arrived after ``r`` when ``victims_after``) until they fit. False
        when ``r`` itself was preempted, or nothing could be preempted (``r`` waits)."""
        while True:
            try:
                self.cache.reserve(r.slot, length)
                return True
            except OutOfBlocks:
                with self._lock:
                    others = [x for x in self._running if x is not r and (not victims_after or x._order > r._order)]
                    victim = max(others, key=lambda x: x._order, default=None)
                    if victim is None or (not victims_after and victim._order < r._order):
                        victim = None if victims_after else r
                    if victim is None:
                        return False
                    self._preempt(victim)
                    if victim is r:
                        return False

    def _decode(self, events: list[TokenEvent]) -> tuple[int, tuple[int, float] | None]:
        """One token for every decoding request -- or, with n-gram drafts, the last token and the drafts of
        every request in one forward and the drafts' verified prefix kept (:mod:`.speculative`); without drafts,
        a waiting prompt's last tokens may ride in the same forward (:meth:`_chunk_beside`). Returns how many
        requests decoded, and (tokens, seconds added) of the prompt rows that ran with them, if any (what the
        step's prefill budget has spent)."""
        with self._lock:
            batch = [r for r in self._running if r._decoding and not r._cancel]
        batch.sort(key=lambda r: r._order)
        drafts = self._drafts(batch)
        K = max((len(d) for d in drafts), default=0)
        ready = [r for r in batch if r.state == RUNNING and self._make_room(r, r._computed + 1 + K, victims_after=False)]
        ready = [r for r in ready if r.state == RUNNING]
        if not ready:
            return 0, None
        t0 = time.perf_counter()
        hidden = None
        chunk = self._chunk_beside(ready) if K == 0 else None
        beside = None
        if chunk is not None:   # one forward: these rows and a prompt's last ones (chunks.py)
            beside = self._rows_step(ready, *chunk, events)
        elif K == 0:
            starts = [r._computed for r in ready]
            logits = self._forward(ready, [[r.output_ids[-1]] for r in ready], with_hidden=self._mtp)
            if self._mtp:
                logits, hidden = logits
            for r in ready:
                r._computed += 1
            self._sample_and_emit(ready, logits[:, -1], events)
            if hidden is not None:   # the head at each row's position, with the token just chosen
                self._mtp_pass(ready, starts, [[r.output_ids[-1]] for r in ready], hidden, [0] * len(ready))
        else:
            rows = {id(r): d for r, d in zip(batch, drafts)}
            # every row K + 1 tokens: its draft padded with its last token (a pad the model agrees with is a
            # correct token like any other; the rest is cut off below)
            ids = [[r.output_ids[-1], *rows[id(r)], *[r.output_ids[-1]] * (K - len(rows[id(r)]))] for r in ready]
            if self._rollback:   # the recurrent layers' state after every fed token, until the cut in _verify
                self.cache.begin_history()
            try:
                logits = self._forward(ready, ids, keep=K + 1, with_hidden=self._mtp)
                if self._mtp:
                    logits, hidden = logits
                self._verify(ready, ids, logits, events, hidden)
            finally:
                if self._rollback:
                    self.cache.end_history()
        self._prefix.register(ready)
        self._trim(ready)
        if beside is None:
            dt = time.perf_counter() - t0
            self.totals["decode_s"] += dt
            self._decode_s = _average(self._decode_s, dt)
        return len(ready), beside

    def _guarded(self, reqs: list[Request], fn, *args):
        """``fn(*args)`` for a forward over ``reqs``; on an error they end with it (their slots' cache contents
        are undefined now) and the caller sees it."""
        try:
            return fn(*args)
        except Exception as err:
            self._layer_run = None
            with self._lock:
                for r in reqs:
                    if r.state != FINISHED:
                        self._finish(r, "error", error=f"{type(err).__name__}: {err}")
            raise

    def _trim(self, reqs: list[Request]) -> None:
        """Give back the blocks out of the window of every layer (sliding-window models)."""
        if getattr(self.cache, "window", None) is not None:
            for r in reqs:
                if r.slot is not None:
                    self.cache.trim(r.slot)

    def _release(self, r: Request) -> None:
        """Free ``r``'s slot and give its blocks back (caller holds ``_lock``); its full blocks stay cached
        under their prefix keys."""
        if self._layer_run is not None and r in self._layer_run.group:
            self._layer_run = None   # (its chunk starts again when it is admitted again)
        self.cache.free(r.slot)
        self._free_slots.append(r.slot)
        self._free_slots.sort()
        r.slot = None

    def _forward(self, reqs: list[Request], ids: list[list[int]], keep: int = 1, with_hidden: bool = False):
        """Logits of the last ``keep`` positions of each row (all, for a model without ``logits_to_keep``);
        ``with_hidden``: (logits, the final-normed hidden states of every position), for the MTP head."""
        ids_BT = torch.tensor(ids, dtype=torch.long, device=self.device)
        slots_B = torch.tensor([r.slot for r in reqs], dtype=torch.long, device=self.device)
        kw = {"logits_to_keep": keep} if self._keeps_last and ids_BT.size(1) > keep else {}
        if with_hidden:
            kw["return_hidden"] = True
        with torch.inference_mode():
            out = self._guarded(reqs, lambda: self.model(ids_BT, cache=self.cache, slots=slots_B, **kw))
        return out if with_hidden else getattr(out, "logits", out)

    def _penalty_state(self, reqs: list[Request], V: int, device) -> tuple[Tensor | None, Tensor | None]:
        seen = counts = None
        if any(r.params.uses_repetition_penalty for r in reqs):
            rows = []
            for r in reqs:
                if r._seen_V is None and r.params.uses_repetition_penalty:
                    r._seen_V = torch.zeros(V, dtype=torch.bool, device=device)
                    r._seen_V[torch.tensor(r.prompt_ids + r.output_ids, device=device)] = True
                rows.append(r._seen_V if r._seen_V is not None else torch.zeros(V, dtype=torch.bool, device=device))
            seen = torch.stack(rows)
        if any(r.params.uses_output_penalties for r in reqs):
            rows = []
            for r in reqs:
                if r._counts_V is None and r.params.uses_output_penalties:
                    r._counts_V = torch.zeros(V, dtype=torch.float32, device=device)
                    if r.output_ids:
                        r._counts_V.index_add_(0, torch.tensor(r.output_ids, device=device),
                                               torch.ones(len(r.output_ids), device=device))
                rows.append(r._counts_V if r._counts_V is not None else torch.zeros(V, device=device))
            counts = torch.stack(rows)
        return seen, counts

    def _sample_and_emit(self, reqs: list[Request], logits_BV: Tensor, events: list[TokenEvent]) -> None:
        seen, counts = self._penalty_state(reqs, logits_BV.shape[-1], logits_BV.device)
        tokens_B, lps = sample(logits_BV, [r.params for r in reqs], [r._generator for r in reqs], seen, counts)
        tokens = tokens_B.tolist()
        now = time.perf_counter()
        with self._lock:
            for r, tok, lp in zip(reqs, tokens, lps):
                self._emit(r, tok, lp, now, events)   # (cancelled while the forward ran: dropped)

    def _emit(self, r: Request, tok: int, lp: TokenLogprob | None, now: float, events: list[TokenEvent]) -> bool:
        """Give ``r`` its next token (caller holds ``_lock``): the event goes to its queue and ``events``, and a
        finished request is ended. False when it was cancelled or finished meanwhile (the token is dropped)."""
        if r.state == FINISHED or r._cancel:
            return False
        if r.stats.first_token is None:
            r.stats.first_token = now
        ev = r.accept(tok, lp)
        self.totals["output_tokens"] += 1
        events.append(ev)
        self._publish(r, ev)
        if ev.finish_reason is not None:
            self._finish(r, ev.finish_reason, publish=False)
        return True

    def _publish(self, r: Request, ev: TokenEvent) -> None:
        r._queue.put(ev)
        if r._on_event is not None:
            try:
                r._on_event(ev)
            except Exception:  # a consumer's bug must not stop the engine
                log.exception("on_event callback of request %s failed", r.id)

    def _finish(self, r: Request, reason: str, publish: bool = True, error: str | None = None) -> None:
        """Mark ``r`` finished and free its slot (caller holds ``_lock``)."""
        if r.state == FINISHED:
            return
        if r.slot is not None:
            self._release(r)
        if r in self._running:
            self._running.remove(r)
        r.state = FINISHED
        r.finish_reason = reason
        r.stats.finished = time.perf_counter()
        r._seen_V = r._counts_V = None
        if publish:
            self._publish(r, TokenEvent(r.id, None, "", reason, error=error))
        r._done.set()
        self._work.notify_all()

    # --- driving the loop ---------------------------------------------------------------------------

    def run_until_done(self, requests: Sequence[Request] | None = None) -> None:
        """Step until ``requests`` (default: all) have finished. Only when no other thread steps."""
        while (any(not r.finished for r in requests) if requests is not None else self.has_work()):
            self.step()

    def run_forever(self, stop_event: threading.Event | None = None, idle_timeout: float = 0.1) -> None:
        """Step while there is work, sleep while there is none, until ``stop_event`` is set (for a server's
        background thread). A failing step ends only the requests in that forward; the loop goes on."""
        stop_event = stop_event or threading.Event()
        self._loop_thread = threading.current_thread()
        try:
            while not stop_event.is_set():
                with self._lock:
                    if not (self._waiting or self._running):
                        self._work.wait(idle_timeout)
                        continue
                try:
                    self.step()
                except Exception:
                    log.exception("generation step failed")
        finally:
            self._loop_thread = None

    def start(self) -> threading.Event:
        """Run :meth:`run_forever` on a daemon thread; set the returned event to stop it."""
        if self._loop_thread is not None:
            raise RuntimeError("the engine loop is already running")
        stop_event = threading.Event()
        t = threading.Thread(target=self.run_forever, args=(stop_event,), name="dynamoe-engine", daemon=True)
        t.start()
        while self._loop_thread is None and t.is_alive():
            time.sleep(0.001)
        return stop_event

    # --- one request, synchronously -----------------------------------------------------------------

    def stream(self, prompt, max_tokens: int | None = 256, *, stop: Sequence[str] | str = (),
               stop_token_ids: Sequence[int] = (), chat: bool | None = None, system: str | None = None,
               thinking: bool | None = None, tools=None, params: SamplingParams | None = None,
               clip_max_tokens: bool = False, ignore_eos: bool = False, chat_template_kwargs: dict | None = None,
               **sampling) -> Iterator[TokenEvent]:
        """Generate for one prompt and yield its events as they come. ``prompt``: text, token ids, or a list
        of chat messages (``chat=True`` wraps text as one user message). ``sampling``: SamplingParams
        fields (temperature=..., top_p=..., seed=...), or pass ``params``. Steps the engine itself unless
        :meth:`run_forever` is running on another thread. Closing the iterator early cancels the request."""
        if params is None:
            params = SamplingParams(**sampling)
        elif sampling:
            raise ValueError(f"pass either params or sampling keywords, not both (got {sorted(sampling)})")
        ids = encode_prompt(self.tokenizer, prompt, chat=chat, system=system, thinking=thinking, tools=tools,
                            chat_template_kwargs=chat_template_kwargs)
        req = self.add_request(ids, params, max_tokens, stop, stop_token_ids, clip_max_tokens=clip_max_tokens,
                               ignore_eos=ignore_eos)
        try:
            while True:
                ev = req.get_nowait()
                if ev is None:
                    if self._loop_thread is None:
                        self.step()
                        continue
                    try:   # a background loop steps; re-check now and then that it still does
                        ev = req.get(timeout=0.1)
                    except queue.Empty:
                        continue
                yield ev
                if ev.finish_reason is not None:
                    return
        finally:
            if not req.finished:
                self.cancel(req)

    def generate(self, prompt, max_tokens: int | None = 256, **kwargs) -> str:
        """The whole text for one prompt (see :meth:`stream` for the arguments)."""
        return "".join(ev.text for ev in self.stream(prompt, max_tokens, **kwargs))
