"""A generation request as the engine's clients see it: :class:`Request` (prompt, output so far, state,
a thread-safe event queue), the :class:`TokenEvent` each step produces and the request's
:class:`RequestStats` (timings, token counts). :class:`~dynamoe.engine.GenerationEngine` makes and
drives them."""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator

from torch import Tensor

from .detokenizer import IncrementalDecoder, StopStrings
from .sampling import SamplingParams, TokenLogprob

__all__ = ["Request", "TokenEvent", "RequestStats", "WAITING", "RUNNING", "FINISHED"]

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass
class TokenEvent:
    """One step of one request. ``token_id`` is None only on a final event without a token (cancelled,
    error). ``text`` is the new text (may be "" while a character or a possible stop string is held
    back). ``finish_reason``: None while running, then 'stop' (stop token or string), 'length'
    (max_tokens), 'context' (max_seq_len full before the request's max_tokens, or max_tokens None),
    'cancelled' or 'error' (``error`` holds the message)."""
    request_id: str
    token_id: int | None
    text: str
    finish_reason: str | None = None
    logprob: TokenLogprob | None = None
    stop: str | int | None = None   # the stop string or stop token that ended the request
    error: str | None = None


@dataclass
class RequestStats:
    """Wall-clock times (``time.perf_counter`` seconds) and counts of one request."""
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0             # prompt tokens whose keys/values were reused from the slot (prefix cache)
    arrival: float = 0.0
    scheduled: float | None = None     # prefill started
    first_token: float | None = None   # prefill done, first token sampled
    finished: float | None = None

    @property
    def queue_s(self) -> float | None:
        return None if self.scheduled is None else self.scheduled - self.arrival

    @property
    def prefill_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.scheduled

    @property
    def time_to_first_token_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def prefill_tokens_per_s(self) -> float | None:
        s = self.prefill_s
        return None if not s else (self.prompt_tokens - self.cached_tokens) / s

    @property
    def decode_ms_per_token(self) -> float | None:
        if self.finished is None or self.first_token is None or self.output_tokens < 2:
            return None
        return 1000.0 * (self.finished - self.first_token) / (self.output_tokens - 1)

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
                "cached_tokens": self.cached_tokens, "queue_s": self.queue_s,
                "prefill_s": self.prefill_s, "time_to_first_token_s": self.time_to_first_token_s,
                "prefill_tokens_per_s": self.prefill_tokens_per_s, "decode_ms_per_token": self.decode_ms_per_token}


class Request:
    """A handle on one generation: its prompt, output so far, state and event queue (thread-safe to read)."""

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, max_tokens: int,
                 stop_token_ids: frozenset[int], stop: StopStrings, decoder: IncrementalDecoder | None,
                 on_event: Callable[[TokenEvent], None] | None):
        self.id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.max_tokens = max_tokens
        self.context_limited = False   # max_tokens is what fits in max_seq_len, not what was asked
        self.stop_token_ids = stop_token_ids
        self.output_ids: list[int] = []
        self.text = ""
        self.logprobs: list[TokenLogprob] = []
        self.state = WAITING
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.slot: int | None = None
        self.stats = RequestStats(prompt_tokens=len(prompt_ids), arrival=time.perf_counter())
        self._stop = stop
        self._decoder = decoder
        self._on_event = on_event
        self._queue: queue.SimpleQueue[TokenEvent] = queue.SimpleQueue()
        self._done = threading.Event()
        self._generator = params.make_generator() if not params.greedy else None
        self._seen_V: Tensor | None = None     # bool, prompt + output (repetition penalty)
        self._counts_V: Tensor | None = None   # output counts (presence / frequency penalty)
        self._cancel = False
        # the scheduler's view (dynamoe.engine.engine / .prefix): arrival order (preemption takes the latest),
        # positions whose keys/values are in the cache, whether it is decoding (else prefilling its tokens),
        # whether it was preempted, the prefix keys of its full blocks and how many of its blocks are registered
        self._order = 0
        self._computed = 0
        self._decoding = False
        self._preempted = False
        self._keys: list[bytes] = []
        self._registered = 0
        self._ngram = None   # its n-gram index, once it drafts (dynamoe.engine.speculative)
        # with MTP drafts (draft="mtp"): its drafts for the next step (None: it does not run the head), and the
        # positions whose head cache entries are written (dynamoe.models.mtp)
        self._mtp_draft: list[int] | None = None
        self._head_len = 0

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens so far."""
        return len(self.prompt_ids) + len(self.output_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens ``start..end-1`` of prompt + output."""
        P = len(self.prompt_ids)
        if end <= P:
            return self.prompt_ids[start:end]
        if start >= P:
            return self.output_ids[start - P:end - P]
        return self.prompt_ids[start:] + self.output_ids[:end - P]

    def accept(self, tok: int, lp: TokenLogprob | None) -> TokenEvent:
        """Append token ``tok`` (the engine calls this under its lock); the event it makes: the text delta
        (after stop strings and held-back characters) and the finish reason, if it ends the request."""
        self.output_ids.append(tok)
        self.stats.output_tokens += 1
        if lp is not None:
            self.logprobs.append(lp)
        if self._seen_V is not None:
            self._seen_V[tok] = True
        if self._counts_V is not None:
            self._counts_V[tok] += 1
        finish = stop = None
        if tok in self.stop_token_ids:
            finish, stop = "stop", tok
            text = self._stop.push(self._decoder.flush())[0] + self._stop.flush() if self._decoder is not None else ""
        else:
            text = ""
            if self._decoder is not None:
                text, matched = self._stop.push(self._decoder.push(tok))
                if matched is not None:
                    finish, stop = "stop", matched
            if finish is None and len(self.output_ids) >= self.max_tokens:
                finish = "context" if self.context_limited else "length"
                if self._decoder is not None:
                    more, matched = self._stop.push(self._decoder.flush())
                    text += more
                    if matched is not None:
                        finish, stop = "stop", matched
                    else:
                        text += self._stop.flush()
        self.text += text
        if finish is not None:
            self.stop_reason = stop
        return TokenEvent(self.id, tok, text, finish, lp, stop)

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the request has finished; False on timeout."""
        return self._done.wait(timeout)

    def get(self, timeout: float | None = None) -> TokenEvent:
        """The next event (blocks; raises ``queue.Empty`` on timeout)."""
        return self._queue.get(timeout=timeout)

    def get_nowait(self) -> TokenEvent | None:
        try:
            return self._queue.get_nowait()
        except queue.Empty:
            return None

    def events(self, timeout: float | None = None) -> Iterator[TokenEvent]:
        """Events until the final one (another thread must be stepping the engine)."""
        while True:
            ev = self.get(timeout=timeout)
            yield ev
            if ev.finish_reason is not None:
                return

    def __repr__(self) -> str:
        return (f"Request({self.id!r}, state={self.state}, prompt={len(self.prompt_ids)} tokens, "
                f"output={len(self.output_ids)} tokens, finish_reason={self.finish_reason!r})")
