"""Continuous batching over a slotted KV cache.

A :class:`GenerationEngine` owns one :class:`~dynamoe.models.cache.KVCache` with ``max_batch`` slots.
Requests wait in a FIFO queue; each :meth:`~GenerationEngine.step` first prefills waiting requests
into free slots (prompts of equal length together, ``model(ids[B, T], cache, slots)``), then runs one
decode step for every running request at once (``model(ids[B, 1], cache, slots)``, each row at its own
position). Every produced token becomes a :class:`TokenEvent` on its request's queue; a request that
finishes (stop token, stop string, ``max_tokens``) or is cancelled frees its slot at once.

Threading: one thread drives :meth:`step` (or :meth:`run_forever`); other threads may call
:meth:`add_request` and :meth:`cancel` and read events with :meth:`Request.get` /
:meth:`Request.events` (or receive them through ``on_event``, called on the stepping thread).
The model contract: ``model.new_cache(num_slots, max_seq_len, dtype=None, device=None)`` and
``model(input_ids_BT, cache=cache, slots=slots_B) -> logits [B, T, V]`` advancing ``cache.lengths``.
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

from .detokenizer import IncrementalDecoder, StopStrings, decode_keeping, special_token_ids
from .prompts import encode_prompt, token_list
from .request import FINISHED, RUNNING, WAITING, Request, RequestStats, TokenEvent
from .sampling import SamplingParams, TokenLogprob, sample

__all__ = ["GenerationEngine", "Request", "TokenEvent", "RequestStats", "encode_prompt"]  # encode_prompt: .prompts

log = logging.getLogger(__name__)

def _model_device(model) -> torch.device:
    for p in itertools.chain(model.parameters(), model.buffers()):
        return p.device
    return torch.device("cpu")


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """Length of the common prefix of ``a`` and ``b``, at most ``limit``."""
    n = min(len(a), len(b), limit)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class GenerationEngine:
    """Continuous batching of generation requests for one model (see the module docstring).

    model: a module honouring the cache contract. tokenizer: a :class:`~dynamoe.engine.Tokenizer`
    (optional: without it there is no text, only token ids, and no stop strings). max_seq_len: cache
    positions per slot (prompt + output); default ``min(config.max_position_embeddings, 4096)``.
    max_batch: cache slots = requests decoded together. prefill_chunk: split longer prompts into
    chunks of this many tokens (bounds the [T, V] logits of a long prefill); None = whole prompt.
    eos_token_ids: stop tokens of every request; default the tokenizer's and the model config's.
    prefix_caching: a finished request leaves its keys/values in its slot; a new request goes to the
    free slot holding the longest prefix of its prompt (at least ``min_cached_prefix`` tokens) and
    prefills only the rest -- a chat's next turn re-reads none of the conversation so far.
    """

    #: the shortest shared prefix worth steering a request to a slot for (shorter: least recently
    #: used free slot, so that longer cached conversations survive)
    min_cached_prefix = 4

    def __init__(self, model, tokenizer=None, max_seq_len: int | None = None, max_batch: int = 8, *,
                 cache_dtype: torch.dtype | None = None, device=None, prefill_chunk: int | None = None,
                 eos_token_ids: Sequence[int] | None = None, prefix_caching: bool = True):
        config = getattr(model, "config", None)
        if max_seq_len is None:
            mpe = getattr(config, "max_position_embeddings", None)
            max_seq_len = min(int(mpe), 4096) if mpe else 4096
        for name, v in (("max_seq_len", max_seq_len), ("max_batch", max_batch)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int)
                                          or prefill_chunk < 1):
            raise ValueError(f"prefill_chunk must be None or an int >= 1, got {prefill_chunk!r}")
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
        self.device = torch.device(device) if device is not None else _model_device(model)
        self.vocab_size = getattr(config, "vocab_size", None)
        if eos_token_ids is None:
            ids = list(getattr(tokenizer, "eos_token_ids", None) or [])
            cfg_eos = getattr(config, "eos_token_id", None)
            ids += cfg_eos if isinstance(cfg_eos, (list, tuple)) else ([cfg_eos] if cfg_eos is not None else [])
            eos_token_ids = ids
        self.eos_token_ids = frozenset(int(i) for i in eos_token_ids)
        self._special_ids: frozenset[int] | None = None   # the tokenizer's, on first use
        self.cache = model.new_cache(max_batch, max_seq_len, dtype=cache_dtype, device=self.device)

        # waiting queue, free slots, request states, cancel flags; re-entrant so that an on_event callback
        # (run under it, on the stepping thread) may call cancel()
        self._lock = threading.RLock()
        self._work = threading.Condition(self._lock)
        self._step_lock = threading.Lock()     # one step at a time
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: list[Request] = []      # in slot-assignment order
        self._free_slots = list(range(max_batch))
        # prefix cache: the tokens whose keys/values each slot's buffers hold (positions 0..n-1), and
        # when each slot was freed (least recently used first when no slot shares a prefix)
        self.prefix_caching = bool(prefix_caching)
        self._slot_tokens: list[list[int]] = [[] for _ in range(max_batch)]
        self._slot_freed = [0] * max_batch
        self._frees = itertools.count(1)
        self._ids = itertools.count()
        self._stepping = False
        self._loop_thread: threading.Thread | None = None
        self.totals = {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "output_tokens": 0, "steps": 0,
                       "prefill_s": 0.0, "decode_s": 0.0}

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
        room = self.max_seq_len - len(prompt_ids)
        if room < 1:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room in max_seq_len={self.max_seq_len}")
        context_limited = max_tokens is None or (isinstance(max_tokens, int) and max_tokens > room)
        if max_tokens is None:
            max_tokens = room
        elif isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be None or an int >= 1, got {max_tokens!r}")
        elif max_tokens > room:
            if not clip_max_tokens:
                raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds "
                                 f"max_seq_len={self.max_seq_len}; lower max_tokens to at most {room} "
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
        """One scheduling step: prefill waiting requests into free slots, then one decode step for all
        running requests. Returns the events produced (they are also on the requests' queues)."""
        with self._step_lock:
            with self._lock:
                self._stepping = True
                admitted = []
                while self._waiting and self._free_slots:
                    req = self._waiting.popleft()
                    req.slot, req.stats.cached_tokens = self._take_slot(req.prompt_ids)
                    req.state = RUNNING
                    req.stats.scheduled = time.perf_counter()
                    self._running.append(req)
                    admitted.append(req)
            events: list[TokenEvent] = []
            try:
                # prompts with as many tokens left to prefill are prefilled together, in arrival order of
                # the first of each length
                groups: dict[int, list[Request]] = {}
                for req in admitted:
                    groups.setdefault(len(req.prompt_ids) - req.stats.cached_tokens, []).append(req)
                try:
                    for group in groups.values():
                        self._prefill(group, events)
                except Exception:
                    self._requeue([r for r in admitted if r.state == RUNNING and not r.output_ids])
                    raise
                decoding = [r for r in self._running if r.state == RUNNING and r.output_ids and not r._cancel]
                if decoding:
                    self._decode(decoding, events)
            finally:
                with self._lock:
                    self._stepping = False
                    for req in list(self._running):
                        if req._cancel and req.state != FINISHED:
                            self._finish(req, "cancelled")
                self.totals["steps"] += 1
            return events

    def _take_slot(self, prompt_ids: list[int]) -> tuple[int, int]:
        """(free slot, prompt tokens already in it) for a new request (caller holds ``_lock``): the slot
        with the longest shared prefix, else the least recently freed one. At least the prompt's last
        token is always prefilled (its logits start the output)."""
        best, reuse = None, 0
        if self.prefix_caching:
            for slot in self._free_slots:
                n = _common_prefix(self._slot_tokens[slot], prompt_ids, len(prompt_ids) - 1)
                if n > reuse:
                    best, reuse = slot, n
        if best is None or reuse < self.min_cached_prefix:
            best, reuse = min(self._free_slots, key=lambda s: self._slot_freed[s]), 0
        self._free_slots.remove(best)
        self.cache.lengths[best] = reuse
        self._slot_tokens[best] = []  # being overwritten from position reuse on: known again when freed
        return best, reuse

    def _release_slot(self, r: Request, valid: bool) -> None:
        """Free ``r``'s slot (caller holds ``_lock``), remembering which tokens its buffers hold when
        ``valid`` (not after a failed forward, whose writes are undefined)."""
        slot = r.slot
        n = int(self.cache.lengths[slot]) if valid and self.prefix_caching else 0
        self._slot_tokens[slot] = (r.prompt_ids + r.output_ids)[:n]
        self._slot_freed[slot] = next(self._frees)
        self.cache.free(slot)
        self._free_slots.append(slot)
        self._free_slots.sort()
        r.slot = None

    def _requeue(self, reqs: list[Request]) -> None:
        """Put admitted requests that were not prefilled back at the head of the queue."""
        with self._lock:
            for r in reversed(reqs):
                self._release_slot(r, valid=False)
                r.state, r.stats.scheduled, r.stats.cached_tokens = WAITING, None, 0
                self._running.remove(r)
                self._waiting.appendleft(r)

    def _forward(self, reqs: list[Request], ids: list[list[int]]) -> Tensor:
        ids_BT = torch.tensor(ids, dtype=torch.long, device=self.device)
        slots_B = torch.tensor([r.slot for r in reqs], dtype=torch.long, device=self.device)
        kw = {"logits_to_keep": 1} if self._keeps_last and ids_BT.size(1) > 1 else {}
        try:
            with torch.inference_mode():
                out = self.model(ids_BT, cache=self.cache, slots=slots_B, **kw)
        except Exception as err:
            # the slots' cache contents are undefined now: end these requests, let the caller see the error
            with self._lock:
                for r in reqs:
                    if r.state != FINISHED:
                        self._finish(r, "error", error=f"{type(err).__name__}: {err}")
            raise
        return getattr(out, "logits", out)

    def _prefill(self, reqs: list[Request], events: list[TokenEvent]) -> None:
        """Prefill the prompt tokens after each request's cached prefix (the same count for all)."""
        t0 = time.perf_counter()
        T = len(reqs[0].prompt_ids) - reqs[0].stats.cached_tokens
        chunk = self.prefill_chunk or T
        for start in range(0, T, chunk):
            logits = self._forward(reqs, [r.prompt_ids[r.stats.cached_tokens + start:][:chunk] for r in reqs])
        self._sample_and_emit(reqs, logits[:, -1], events, first=True)
        self.totals["prefill_s"] += time.perf_counter() - t0
        self.totals["prompt_tokens"] += sum(len(r.prompt_ids) for r in reqs)
        self.totals["cached_tokens"] += sum(r.stats.cached_tokens for r in reqs)

    def _decode(self, reqs: list[Request], events: list[TokenEvent]) -> None:
        t0 = time.perf_counter()
        logits = self._forward(reqs, [[r.output_ids[-1]] for r in reqs])
        self._sample_and_emit(reqs, logits[:, -1], events, first=False)
        self.totals["decode_s"] += time.perf_counter() - t0

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

    def _sample_and_emit(self, reqs: list[Request], logits_BV: Tensor, events: list[TokenEvent], first: bool) -> None:
        seen, counts = self._penalty_state(reqs, logits_BV.shape[-1], logits_BV.device)
        tokens_B, lps = sample(logits_BV, [r.params for r in reqs], [r._generator for r in reqs], seen, counts)
        tokens = tokens_B.tolist()
        now = time.perf_counter()
        with self._lock:
            for r, tok, lp in zip(reqs, tokens, lps):
                if r.state == FINISHED or r._cancel:
                    continue   # cancelled while the forward ran: drop the token
                if first:
                    r.stats.first_token = now
                ev = self._accept(r, tok, lp)
                events.append(ev)
                self._publish(r, ev)
                if ev.finish_reason is not None:
                    self._finish(r, ev.finish_reason, publish=False)

    def _accept(self, r: Request, tok: int, lp: TokenLogprob | None) -> TokenEvent:
        """Append token ``tok`` to ``r``; the event it makes (text delta, finish reason)."""
        r.output_ids.append(tok)
        r.stats.output_tokens += 1
        self.totals["output_tokens"] += 1
        if lp is not None:
            r.logprobs.append(lp)
        if r._seen_V is not None:
            r._seen_V[tok] = True
        if r._counts_V is not None:
            r._counts_V[tok] += 1
        finish = stop = None
        if tok in r.stop_token_ids:
            finish, stop = "stop", tok
            text = r._stop.push(r._decoder.flush())[0] + r._stop.flush() if r._decoder is not None else ""
        else:
            text = ""
            if r._decoder is not None:
                text, matched = r._stop.push(r._decoder.push(tok))
                if matched is not None:
                    finish, stop = "stop", matched
            if finish is None and len(r.output_ids) >= r.max_tokens:
                finish = "context" if r.context_limited else "length"
                if r._decoder is not None:
                    more, matched = r._stop.push(r._decoder.flush())
                    text += more
                    if matched is not None:
                        finish, stop = "stop", matched
                    else:
                        text += r._stop.flush()
        r.text += text
        if finish is not None:
            r.stop_reason = stop
        return TokenEvent(r.id, tok, text, finish, lp, stop)

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
            self._release_slot(r, valid=reason != "error")
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
