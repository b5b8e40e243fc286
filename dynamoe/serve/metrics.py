"""Prometheus text exposition (format 0.0.4) of the server's counters, written by hand.

What is counted: HTTP requests by route and status, prompt and generated tokens, finished generations
by finish reason, request latency and time to first token (histograms), queue depth and running
sequences (gauges read from the engine at scrape time), and -- per MoE layer -- the tokens routed to
each expert and the dropped assignments, accumulated after every forward of the model
(:class:`ExpertLoad`, from ``model.moe_stats()``).

Legend: E experts of a layer.
"""
from __future__ import annotations

import bisect
import gc
import logging
import math
import threading
from collections import defaultdict

import torch

__all__ = ["Histogram", "Metrics", "ExpertLoad"]

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def _label_value(v) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(**kw) -> str:
    return "{" + ",".join(f'{k}="{_label_value(v)}"' for k, v in kw.items()) + "}" if kw else ""


def _num(v) -> str:
    if isinstance(v, float):
        if math.isinf(v):
            return "+Inf" if v > 0 else "-Inf"
        return repr(v)
    return str(v)


class Histogram:
    """Cumulative-bucket histogram (seconds)."""

    def __init__(self, buckets):
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)   # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, acc = [], 0
        for le, c in zip((*self.buckets, math.inf), self.counts):
            acc += c
            out.append(f"{name}_bucket{_labels(le=_num(float(le)))} {acc}")
        out += [f"{name}_sum {_num(self.sum)}", f"{name}_count {self.count}"]
        return out


class ExpertLoad:
    """Cumulative tokens routed per expert and dropped assignments per MoE layer of ``model``.

    A forward hook on the model adds each forward's ``model.moe_stats()`` to running sums kept on the
    model's device (no host sync on the engine thread); :meth:`snapshot` copies them out. Models
    without ``moe_stats`` have no layers here.
    """

    def __init__(self, model):
        self._lock = threading.Lock()
        self._load: dict[int, object] = {}          # layer -> int64 [E] tensor
        self._dropped: dict[int, int] = defaultdict(int)
        self._handle = None
        self._failed = False
        if callable(getattr(model, "moe_stats", None)):
            self._handle = model.register_forward_hook(self._hook)

    def _hook(self, module, args, output) -> None:
        try:
            # inference tensors throughout: valid whether or not the forward ran under inference_mode
            with torch.inference_mode(), self._lock:
                for s in module.moe_stats():
                    acc = self._load.get(s.layer)
                    self._load[s.layer] = s.load.detach().clone() if acc is None else acc.add_(s.load)
                    self._dropped[s.layer] += int(s.dropped)
        except Exception:   # counting must never break a forward
            if not self._failed:
                log.exception("expert-load metrics: moe_stats() failed; expert load is no longer counted")
            self._failed = True

    def snapshot(self) -> dict[int, tuple[list[int], int]]:
        """``{layer: (tokens per expert [E], dropped)}`` so far."""
        with self._lock:
            return {layer: (load.tolist(), self._dropped[layer]) for layer, load in sorted(self._load.items())}

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


class Metrics:
    """Counters of one server process. Methods are called on the asyncio thread; the lock makes them
    safe from elsewhere too."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests = defaultdict(int)              # (route, status) -> count
        self.finished = defaultdict(int)              # finish_reason -> count
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.latency = Histogram(LATENCY_BUCKETS)
        self.ttft = Histogram(TTFT_BUCKETS)

    def http_request(self, route: str, status: int) -> None:
        with self._lock:
            self.requests[(route, status)] += 1

    def generation_done(self, prompt_tokens: int, output_tokens: int, finish_reason: str | None,
                        latency_s: float | None, ttft_s: float | None) -> None:
        """One engine request finished (or was abandoned): its tokens and times."""
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += output_tokens
            self.finished[finish_reason or "unknown"] += 1
            if latency_s is not None:
                self.latency.observe(latency_s)
            if ttft_s is not None:
                self.ttft.observe(ttft_s)

    def render(self, *, model_name: str, waiting: int, running: int, max_num_seqs: int,
               expert_load: dict[int, tuple[list[int], int]], engine_totals: dict | None = None,
               kv_cache: dict | None = None) -> str:
        L: list[str] = []

        def head(name, kind, help_):
            L.append(f"# HELP {name} {help_}")
            L.append(f"# TYPE {name} {kind}")

        with self._lock:
            head("dynamoe_http_requests_total", "counter", "HTTP requests by route and status code.")
            for (route, status), n in sorted(self.requests.items()):
                L.append(f"dynamoe_http_requests_total{_labels(route=route, status=status)} {n}")
            head("dynamoe_prompt_tokens_total", "counter", "Prompt tokens of finished generations.")
            L.append(f"dynamoe_prompt_tokens_total {self.prompt_tokens}")
            head("dynamoe_generation_tokens_total", "counter", "Generated tokens of finished generations.")
            L.append(f"dynamoe_generation_tokens_total {self.generation_tokens}")
            head("dynamoe_generations_finished_total", "counter", "Finished generations by finish reason.")
            for reason, n in sorted(self.finished.items()):
                L.append(f"dynamoe_generations_finished_total{_labels(finish_reason=reason)} {n}")
            head("dynamoe_request_latency_seconds", "histogram", "Generation time from arrival to last token.")
            L.extend(self.latency.lines("dynamoe_request_latency_seconds"))
            head("dynamoe_time_to_first_token_seconds", "histogram", "Time from arrival to the first token.")
            L.extend(self.ttft.lines("dynamoe_time_to_first_token_seconds"))
        head("dynamoe_queue_depth", "gauge", "Requests waiting for a batch slot.")
        L.append(f"dynamoe_queue_depth {waiting}")
        head("dynamoe_running_sequences", "gauge", "Sequences in the running batch.")
        L.append(f"dynamoe_running_sequences {running}")
        head("dynamoe_max_num_seqs", "gauge", "Batch slots (--max-num-seqs).")
        L.append(f"dynamoe_max_num_seqs {max_num_seqs}")
        if engine_totals:
            head("dynamoe_engine_steps_total", "counter", "Engine scheduling steps (prefill and/or one decode step).")
            L.append(f"dynamoe_engine_steps_total {engine_totals.get('steps', 0)}")
            head("dynamoe_engine_seconds_total", "counter", "Engine time in model forwards, by phase.")
            for phase in ("prefill", "decode"):
                seconds = float(engine_totals.get(phase + "_s", 0.0))
                L.append(f"dynamoe_engine_seconds_total{_labels(phase=phase)} {_num(seconds)}")
            head("dynamoe_prefill_tokens_total", "counter", "Positions prefilled (prompt tokens not read from the "
                 "prefix cache, and tokens recomputed after a preemption).")
            L.append(f"dynamoe_prefill_tokens_total {engine_totals.get('prefill_tokens', 0)}")
            head("dynamoe_prompt_cached_tokens_total", "counter", "Prompt tokens read from the prefix cache.")
            L.append(f"dynamoe_prompt_cached_tokens_total {engine_totals.get('cached_tokens', 0)}")
            head("dynamoe_preemptions_total", "counter", "Requests preempted (recomputed later) when the KV cache was full.")
            L.append(f"dynamoe_preemptions_total {engine_totals.get('preempted', 0)}")
            head("dynamoe_spec_draft_tokens_total", "counter", "Speculative draft tokens verified, by where the "
                 "drafts came from (ngram: prompt lookup; mtp: the model's multi-token-prediction head).")
            for src in ("ngram", "mtp"):
                L.append(f"dynamoe_spec_draft_tokens_total{_labels(source=src)} "
                         f"{engine_totals.get('spec_drafted_' + src, 0)}")
            head("dynamoe_spec_accepted_tokens_total", "counter", "Speculative draft tokens accepted, by source.")
            for src in ("ngram", "mtp"):
                L.append(f"dynamoe_spec_accepted_tokens_total{_labels(source=src)} "
                         f"{engine_totals.get('spec_accepted_' + src, 0)}")
        if kv_cache:
            head("dynamoe_kv_cache_blocks", "gauge", "KV cache blocks by state: used (held by running requests), "
                 "cached (free, holding a shared prefix) and free (uncached).")
            free = kv_cache["blocks_free"] - kv_cache["blocks_cached"]
            for state_, n in (("used", kv_cache["blocks_used"]), ("cached", kv_cache["blocks_cached"]), ("free", free)):
                L.append(f"dynamoe_kv_cache_blocks{_labels(state=state_)} {n}")
            head("dynamoe_kv_cache_block_size", "gauge", "Positions per KV cache block.")
            L.append(f"dynamoe_kv_cache_block_size {kv_cache['block_size']}")
            head("dynamoe_kv_cache_usage_ratio", "gauge", "Share of the KV cache's blocks held by running requests.")
            L.append(f"dynamoe_kv_cache_usage_ratio {_num(kv_cache['blocks_used'] / max(1, kv_cache['blocks_total']))}")
            head("dynamoe_kv_cache_bytes", "gauge", "Bytes of the KV cache by state (as the blocks).")
            per = kv_cache["bytes_per_block"]
            for state_, n in (("used", kv_cache["blocks_used"]), ("total", kv_cache["blocks_total"])):
                L.append(f"dynamoe_kv_cache_bytes{_labels(state=state_)} {n * per}")
            head("dynamoe_prefix_cache_queries_total", "counter", "Full prompt blocks looked up in the prefix cache.")
            L.append(f"dynamoe_prefix_cache_queries_total {kv_cache['prefix_queries']}")
            head("dynamoe_prefix_cache_hits_total", "counter", "Full prompt blocks found in the prefix cache.")
            L.append(f"dynamoe_prefix_cache_hits_total {kv_cache['prefix_hits']}")
        _gc_lines(head, L)
        head("dynamoe_model_info", "gauge", "The served model.")
        L.append(f"dynamoe_model_info{_labels(model=model_name)} 1")
        head("dynamoe_moe_expert_tokens_total", "counter",
             "Tokens routed to each expert of each MoE layer (top-k assignments, cumulative).")
        for layer, (load_E, _) in expert_load.items():
            for e, n in enumerate(load_E):
                L.append(f"dynamoe_moe_expert_tokens_total{_labels(layer=layer, expert=e)} {n}")
        head("dynamoe_moe_dropped_tokens_total", "counter", "Assignments over expert capacity, per MoE layer.")
        for layer, (_, dropped) in expert_load.items():
            L.append(f"dynamoe_moe_dropped_tokens_total{_labels(layer=layer)} {dropped}")
        return "\n".join(L) + "\n"


def _gc_lines(head, L: list[str]) -> None:
    """The cyclic garbage collector's counts (a full collection stops every stream while it holds the GIL), under
    the names of the Prometheus Python client's collector, and the objects ``dynamoe serve`` froze out of its reach
    at startup (:func:`dynamoe.serve.cli.freeze_startup_heap`)."""
    stats = gc.get_stats()
    head("python_gc_collections_total", "counter", "Collections by the cyclic garbage collector, by generation.")
    for g, st in enumerate(stats):
        L.append(f"python_gc_collections_total{_labels(generation=g)} {st['collections']}")
    head("python_gc_objects_collected_total", "counter", "Objects the cyclic garbage collector freed, by generation.")
    for g, st in enumerate(stats):
        L.append(f"python_gc_objects_collected_total{_labels(generation=g)} {st['collected']}")
    head("dynamoe_gc_frozen_objects", "gauge", "Objects built at startup (model, tokenizer, libraries) that garbage "
         "collections do not scan (gc.freeze).")
    L.append(f"dynamoe_gc_frozen_objects {gc.get_freeze_count()}")
