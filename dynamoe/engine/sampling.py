"""Choosing the next token, one row per request, vectorised over the batch.

Legend: B rows (requests), V vocabulary, K kept candidates (V, or the largest top_k of the batch).

Per row, in this order (the order of transformers' logits processors and warpers):
repetition penalty (HF: positive logits divided, negative multiplied, over tokens seen in prompt and
output) → presence / frequency penalty (OpenAI: over output tokens) → greedy argmax when
``temperature == 0`` → temperature → top-k → top-p → min-p → draw.

The draw is an inverse-CDF lookup with one uniform number per row from the request's own
``torch.Generator``, so a seeded request gets the same tokens whatever else is in the batch.
Log-probabilities (``logprobs``) are those of the model's distribution, before penalties and
temperature (what vLLM and OpenAI report).
"""
from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch
from torch import Tensor

__all__ = ["SamplingParams", "TokenLogprob", "sample", "apply_repetition_penalty", "apply_presence_frequency_penalty",
           "MAX_LOGPROBS"]

MAX_LOGPROBS = 20


def _number(name, v, lo, hi, lo_open=False, hi_open=False, integer=False, allowed=None):
    ok_type = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok_type or (not integer and not math.isfinite(v)) \
            or (v <= lo if lo_open else v < lo) or (v >= hi if hi_open else v > hi):
        if allowed is None:
            kind = "an int" if integer else "a number"
            allowed = f"{kind} in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
        raise ValueError(f"{name} must be {allowed}, got {v!r}")


@dataclass
class SamplingParams:
    """How one request picks its tokens.

    temperature: >= 0; 0 means greedy (argmax). top_p: (0, 1]. top_k: 0 (or -1) = off, else >= 1.
    min_p: [0, 1], drop tokens below ``min_p * p_max``. repetition_penalty: > 0, 1 = off (HF semantics).
    presence_penalty / frequency_penalty: [-2, 2] (OpenAI semantics, output tokens only).
    seed: None (a random one) or an int in [0, 2**64). logprobs: None = none, n >= 0 = the chosen
    token's log-probability and the n most likely (n <= 20).
    """
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logprobs: int | None = None

    def __post_init__(self):
        _number("temperature", self.temperature, 0, math.inf, hi_open=True, allowed="a finite number >= 0 (0: greedy)")
        _number("top_p", self.top_p, 0, 1, lo_open=True)
        if self.top_k == -1:
            self.top_k = 0
        _number("top_k", self.top_k, 0, 2**62, integer=True, allowed="an int >= 1, or 0 / -1 (off)")
        _number("min_p", self.min_p, 0, 1)
        _number("repetition_penalty", self.repetition_penalty, 0, math.inf, lo_open=True, hi_open=True,
                allowed="a finite number > 0 (1: off)")
        _number("presence_penalty", self.presence_penalty, -2, 2)
        _number("frequency_penalty", self.frequency_penalty, -2, 2)
        if self.seed is not None:
            _number("seed", self.seed, 0, 2**64, hi_open=True, integer=True, allowed="an int in [0, 2**64)")
        if self.logprobs is not None:
            _number("logprobs", self.logprobs, 0, MAX_LOGPROBS, integer=True)

    @classmethod
    def from_generation_config(cls, config: Mapping | None, **overrides) -> "SamplingParams":
        """Parameters from a checkpoint's ``generation_config.json`` (greedy unless ``do_sample``; only the
        fields it sets, as vLLM does), then ``overrides`` (None values are ignored)."""
        config = config or {}
        fields = {}
        if config.get("do_sample"):
            for name in ("temperature", "top_p", "top_k", "min_p"):
                if config.get(name) is not None:
                    fields[name] = config[name]
        else:
            fields["temperature"] = 0.0
        if config.get("repetition_penalty") is not None:
            fields["repetition_penalty"] = config["repetition_penalty"]
        fields.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**fields)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_repetition_penalty(self) -> bool:
        return self.repetition_penalty != 1.0

    @property
    def uses_output_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def make_generator(self) -> torch.Generator:
        """A CPU generator seeded with ``seed`` (or a random seed): one uniform number per sampled token."""
        g = torch.Generator()
        g.manual_seed(self.seed if self.seed is not None else secrets.randbits(63))
        return g


@dataclass
class TokenLogprob:
    """The chosen token's log-probability and the ``top`` most likely (token id, logprob) pairs."""
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def apply_repetition_penalty(logits_BV: Tensor, seen_BV: Tensor, penalty_B: Tensor) -> Tensor:
    """HF's RepetitionPenaltyLogitsProcessor: where ``seen_BV`` (bool), positive logits are divided by
    the row's penalty and negative ones multiplied."""
    p_B1 = penalty_B.to(logits_BV.dtype).unsqueeze(1)
    penalised = torch.where(logits_BV < 0, logits_BV * p_B1, logits_BV / p_B1)
    return torch.where(seen_BV, penalised, logits_BV)


def apply_presence_frequency_penalty(logits_BV: Tensor, counts_BV: Tensor, presence_B: Tensor,
                                     frequency_B: Tensor) -> Tensor:
    """OpenAI's penalties: ``logit -= frequency * count + presence * (count > 0)``."""
    counts = counts_BV.to(logits_BV.dtype)
    return (logits_BV - frequency_B.to(logits_BV.dtype).unsqueeze(1) * counts
            - presence_B.to(logits_BV.dtype).unsqueeze(1) * (counts > 0).to(logits_BV.dtype))


def sample(logits_BV: Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None] | None = None, seen_BV: Tensor | None = None,
           counts_BV: Tensor | None = None) -> tuple[Tensor, list[TokenLogprob | None]]:
    """Next token ids [B] (long, on the logits' device) and per-row :class:`TokenLogprob` (None for
    rows whose ``logprobs`` is None).

    ``generators[b]`` draws row b's uniform number (required for rows with temperature > 0; a CPU
    generator). ``seen_BV`` (bool: token in prompt or output) is needed when a row has a repetition
    penalty, ``counts_BV`` (output token counts) when a row has a presence/frequency penalty.
    """
    B, V = logits_BV.shape
    if len(params) != B:
        raise ValueError(f"params must have one entry per row ({B}), got {len(params)}")
    dev = logits_BV.device
    x_BV = logits_BV.float()

    want_lp = [p.logprobs for p in params]
    raw_lp_BV = torch.log_softmax(x_BV, dim=-1) if any(n is not None for n in want_lp) else None

    if any(p.uses_repetition_penalty for p in params):
        if seen_BV is None:
            raise ValueError("seen_BV is required when a row has a repetition_penalty")
        pen_B = torch.tensor([p.repetition_penalty for p in params], device=dev)
        x_BV = apply_repetition_penalty(x_BV, seen_BV, pen_B)
    if any(p.uses_output_penalties for p in params):
        if counts_BV is None:
            raise ValueError("counts_BV is required when a row has a presence or frequency penalty")
        x_BV = apply_presence_frequency_penalty(
            x_BV, counts_BV, torch.tensor([p.presence_penalty for p in params], device=dev),
            torch.tensor([p.frequency_penalty for p in params], device=dev))

    tokens_B = x_BV.argmax(dim=-1)
    rows = [b for b, p in enumerate(params) if not p.greedy]
    if rows:
        ps = [params[b] for b in rows]
        idx = torch.tensor(rows, device=dev)
        y = x_BV.index_select(0, idx) / torch.tensor([p.temperature for p in ps], device=dev).unsqueeze(1)
        # candidates in descending order: all V, or only the largest top_k when every row has one
        if all(p.top_k > 0 for p in ps) and max(p.top_k for p in ps) < V:
            sorted_y, sorted_idx = y.topk(max(p.top_k for p in ps), dim=-1)
        else:
            sorted_y, sorted_idx = y.sort(dim=-1, descending=True)
        K = sorted_y.shape[-1]
        pos_K = torch.arange(K, device=dev)
        k_R = torch.tensor([p.top_k if p.top_k > 0 else K for p in ps], device=dev)
        remove = pos_K >= k_R.unsqueeze(1)
        probs = torch.softmax(sorted_y.masked_fill(remove, -math.inf), dim=-1)
        top_p_R1 = torch.tensor([p.top_p for p in ps], device=dev).unsqueeze(1)
        remove |= (probs.cumsum(-1) - probs) >= top_p_R1  # the most likely token is always kept
        remove |= probs == 0
        min_p_R1 = torch.tensor([p.min_p for p in ps], device=dev).unsqueeze(1)
        remove |= probs < min_p_R1 * probs[:, :1]
        probs = probs.masked_fill(remove, 0.0)
        cdf = probs.cumsum(-1)
        if generators is None:
            raise ValueError("generators are required for rows with temperature > 0")
        u = []
        for b in rows:
            g = generators[b]
            if g is None:
                raise ValueError(f"row {b} has temperature > 0 but no generator")
            u.append(torch.rand((), generator=g))
        u_R1 = torch.stack(u).to(dev).unsqueeze(1) * cdf[:, -1:]
        # the kept candidates are a prefix (every cut above removes a tail); u * total may round up to total
        last_R1 = (~remove).sum(-1, keepdim=True) - 1
        choice = torch.minimum(torch.searchsorted(cdf, u_R1, right=True), last_R1)
        tokens_B = tokens_B.index_copy(0, idx, sorted_idx.gather(1, choice).squeeze(1))

    lps: list[TokenLogprob | None] = [None] * B
    if raw_lp_BV is not None:
        chosen = raw_lp_BV.gather(1, tokens_B.unsqueeze(1)).squeeze(1).tolist()
        n_max = max(n for n in want_lp if n is not None)
        top_vals, top_ids = raw_lp_BV.topk(min(n_max, V), dim=-1) if n_max > 0 else (None, None)
        top_vals = top_vals.tolist() if top_vals is not None else None
        top_ids = top_ids.tolist() if top_ids is not None else None
        tok = tokens_B.tolist()
        for b, n in enumerate(want_lp):
            if n is None:
                continue
            top = list(zip(top_ids[b][:n], top_vals[b][:n])) if n > 0 else []
            lps[b] = TokenLogprob(tok[b], chosen[b], top)
    return tokens_B, lps
