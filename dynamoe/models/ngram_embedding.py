"""Qwen4-Exp's per-layer embeddings (PLE): hashed n-gram embeddings injected into the residual streams of a few
linear-attention layers, each through its own gate and dilated short convolution.

Legend: B batch rows, T new tokens, N residual streams, D model dim, n ``ngram_size``, G n-gram heads ((n - 1) *
``heads_per_ngram``), E ``ple_embed_dim`` (G heads of E / G), K ``ple_conv_kernel_size``.

As transformers' Qwen4ExpTextNGramEmbedding / Qwen4ExpTextPLELayer compute it:

* the s-th previous token of each position (s = 0..n-1), or ``eos`` when an ``eos`` lies among the last s tokens (an
  n-gram never reaches back over a document end) or before the sequence start;
* per order m = 2..n and head: (tok_0 m_0 XOR ... XOR tok_(m-1) m_(m-1)) mod the head's prime vocabulary size, plus
  the head's offset, looked up in one table (``ngram_embedding``; its multipliers m_j are splitmix64 values of
  ``seed`` and the layer's PLE index, its prime sizes the next ones from ``ngram_vocab_size_base``) -> emb [B, T, E];
* gate_n = <norm_key(key_proj(emb))_n, norm_query(h)_n> / sqrt(D), signed square root; v = sigmoid(gate_n)
  value_proj(emb) on each stream n; out = v + silu(conv(norm_conv(v))), a depthwise causal conv of dilation n over the
  streams' N D channels.

With a :class:`~dynamoe.models.cache.KVCache` each PLE layer keeps per slot the last n - 1 token ids
(``"ngram_context"``, int64) and the conv's last (K - 1) n inputs (``"ple_conv_state"``); both read as a sequence
start (eos / zeros) for a row whose first position is 0, and both recorded after every token of a speculative
verification forward (the cache keeping a history), so that rejected drafts can be cut off.

Checkpoint: transformers saves the table in ``split_ngram_parts`` row chunks, ``ngram_embedding.shard_{k}.weight``
(torch.chunk's: rows ceil(V / parts) each, the last fewer), which this module keeps as they are (looked up shard by
shard, never concatenated: the released tables are tens of GB); its ``layer_multipliers``, ``ngram_heads_vocab_sizes``
and ``ngram_heads_offsets`` buffers are derived from the config and not read.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .cache import KVCache
from .hyper_connections import StreamRMSNorm

__all__ = ["NGramEmbedding", "PerLayerEmbedding", "layer_multipliers", "head_vocab_sizes", "DERIVED_BUFFERS"]

#: the checkpoint's buffers that are functions of the config (not read)
DERIVED_BUFFERS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")

_MASK64 = (1 << 64) - 1
_GAMMA, _M1, _M2, _PRIME_1 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 10007


def _splitmix64(value: int) -> int:
    value = (value + _GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * _M1) & _MASK64
    value = ((value ^ (value >> 27)) * _M2) & _MASK64
    return (value ^ (value >> 31)) & _MASK64


def layer_multipliers(vocab_size: int, ngram_size: int, ple_index: int, seed: int) -> list[int]:
    """The odd hash multipliers of the ``ple_index``-th PLE layer, one per n-gram position (each < 2^63 / vocab, so
    token * multiplier never overflows int64)."""
    half = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    base = seed + _PRIME_1 * ple_index
    return [2 * (_splitmix64((base + _GAMMA * (j + 1)) & _MASK64) % half) + 1 for j in range(ngram_size)]


def _is_prime(v: int) -> bool:
    if v < 2:
        return False
    if v % 2 == 0:
        return v == 2
    return all(v % q for q in range(3, math.isqrt(v) + 1, 2))


_PRIMES: dict[int, list[int]] = {}   # base -> the primes >= base found so far, in order (every layer extends them)


def _primes_from(base: int, count: int) -> list[int]:
    """The first ``count`` primes >= ``base``."""
    out = _PRIMES.setdefault(base, [])
    v = out[-1] + 1 if out else base
    while len(out) < count:
        if _is_prime(v):
            out.append(v)
        v += 1
    return out[:count]


def head_vocab_sizes(base: int, heads: int, ple_index: int) -> list[int]:
    """The prime vocabulary sizes of the ``ple_index``-th PLE layer's heads: the (ple_index * heads + h + 1)-th primes
    >= ``base`` (every head of the model its own)."""
    return list(_primes_from(base, (ple_index + 1) * heads)[ple_index * heads:])


class NGramEmbedding(nn.Module):
    """The hashed n-gram lookup of one PLE layer (``ngram_embedding.shard_{k}``: nn.Embedding row chunks of one table
    [V, E / G], see the module docstring). ``forward(prev [B, T, n] previous tokens, s = 0..n-1) -> [B, T, E]``."""

    def __init__(self, vocab_size: int, embed_dim: int, ngram_size: int, heads_per_ngram: int, ngram_vocab_base: int,
                 divisible_by: int, parts: int, ple_index: int, seed: int, dtype=None):
        super().__init__()
        G = (ngram_size - 1) * heads_per_ngram
        self.ngram_size, self.heads_per_ngram = ngram_size, heads_per_ngram
        self.multipliers = layer_multipliers(vocab_size, ngram_size, ple_index, seed)
        self.sizes = head_vocab_sizes(ngram_vocab_base, G, ple_index)
        self.offsets = [sum(self.sizes[:h]) for h in range(G)]
        rows = -(-sum(self.sizes) // divisible_by) * divisible_by
        self.chunk = -(-rows // parts)                     # torch.chunk's: ceil(rows / parts) rows, the last fewer
        self.ngram_embedding = nn.Module()
        for k, start in enumerate(range(0, rows, self.chunk)):
            self.ngram_embedding.add_module(f"shard_{k}", nn.Embedding(min(self.chunk, rows - start), embed_dim // G,
                                                                       dtype=dtype))

    def extra_repr(self) -> str:
        return f"ngram_size={self.ngram_size}, heads={len(self.sizes)}, rows={sum(self.sizes)}, chunk={self.chunk}"

    def ids(self, prev_BTn: Tensor) -> Tensor:
        """The table rows [B, T, G] of each position's n-gram heads."""
        dev = prev_BTn.device
        mult = torch.tensor(self.multipliers, dtype=torch.long, device=dev)
        sizes = torch.tensor(self.sizes, dtype=torch.long, device=dev).view(-1, self.heads_per_ngram)
        offsets = torch.tensor(self.offsets, dtype=torch.long, device=dev).view(-1, self.heads_per_ngram)
        terms = prev_BTn.long() * mult
        mixed, out = terms[..., 0], []
        for m in range(2, self.ngram_size + 1):
            mixed = torch.bitwise_xor(mixed, terms[..., m - 1])
            out.append(torch.remainder(mixed.unsqueeze(-1), sizes[m - 2]) + offsets[m - 2])
        return torch.cat(out, dim=-1)

    def forward(self, prev_BTn: Tensor) -> Tensor:
        rows = self.ids(prev_BTn)
        shards = list(self.ngram_embedding.children())
        weight = shards[0].weight
        out = torch.empty(*rows.shape, weight.size(1), dtype=weight.dtype, device=weight.device)
        which = torch.div(rows, self.chunk, rounding_mode="floor")
        for k in torch.unique(which).tolist():   # only the shards some row falls in (the table stays where it is)
            hit = which == k
            out[hit] = F.embedding(rows[hit] - k * self.chunk, shards[k].weight)
        return out.flatten(-2)


def previous_tokens(history_BH: Tensor, n: int, eos: int) -> Tensor:
    """[B, H - n + 1, n]: for each position of ``history`` past its first n - 1 (the context), its s-th previous token
    (s = 0..n-1), or ``eos`` when an eos lies among the s tokens before it (transformers' _shift_right_ignore_eos over
    that window)."""
    T = history_BH.size(1) - (n - 1)
    cols = []
    for s in range(n):
        tok = history_BH[:, n - 1 - s:n - 1 - s + T]
        if s:
            between = torch.stack([history_BH[:, n - 1 - j:n - 1 - j + T] for j in range(1, s + 1)], dim=-1)
            tok = torch.where((between == eos).any(-1), torch.full_like(tok, eos), tok)
        cols.append(tok)
    return torch.stack(cols, dim=-1)


class PerLayerEmbedding(nn.Module):
    """One layer's PLE (transformers' ``ple``: ``ple_embedding`` (:class:`NGramEmbedding`), ``key_proj`` [N D, E],
    ``value_proj`` [D, E], ``norm_key`` / ``norm_query`` / ``norm_conv`` (:class:`StreamRMSNorm`), ``conv1d``
    [N D, 1, K] of dilation n). ``forward(h [B, T, N, D], ids [B, T], positions [B, T], cache, slots) -> [B, T, N, D]``,
    what the layer adds to its streams."""

    def __init__(self, hidden_size: int, streams: int, embed_dim: int, kernel: int, eos: int, layer_idx: int,
                 embedding: NGramEmbedding, eps: float, dtype=None):
        super().__init__()
        N, D, n = streams, hidden_size, embedding.ngram_size
        self.layer_idx, self.streams, self.eos, self.dilation = layer_idx, N, eos, n
        self.window = (kernel - 1) * n
        self.ple_embedding = embedding
        self.key_proj = nn.Linear(embed_dim, N * D, bias=False, dtype=dtype)
        self.value_proj = nn.Linear(embed_dim, D, bias=False, dtype=dtype)
        self.norm_key, self.norm_query, self.norm_conv = (StreamRMSNorm(N, D, eps, dtype=dtype) for _ in range(3))
        self.conv1d = nn.Conv1d(N * D, N * D, kernel, groups=N * D, dilation=n, bias=False, dtype=dtype)

    def extra_repr(self) -> str:
        return f"layer={self.layer_idx}, streams={self.streams}, eos={self.eos}, dilation={self.dilation}"

    def _state(self, cache: KVCache | None, slots: Tensor | None, positions_BT: Tensor, ids_BT: Tensor, name: str,
               shape: tuple, fill, dtype) -> tuple[Tensor | None, Tensor]:
        """(the slot buffer or None, the rows' state): ``fill`` for rows that start a sequence (or without a cache)."""
        B = ids_BT.size(0)
        if cache is None:
            return None, torch.full((B, *shape), fill, dtype=dtype, device=ids_BT.device)
        if slots is None:
            raise ValueError("per-layer embeddings with a cache need slots (LongTensor [B])")
        buf = cache.buffer(self.layer_idx, name, *shape, dtype=dtype)
        fresh = (positions_BT[:, 0] == 0).view(B, *([1] * len(shape)))
        return buf, buf[slots].masked_fill(fresh, fill)

    def forward(self, h_BTND: Tensor, ids_BT: Tensor, positions_BT: Tensor, cache: KVCache | None = None,
                slots: Tensor | None = None) -> Tensor:
        B, T, N, D = h_BTND.shape
        n = self.dilation
        ctx_buf, ctx = self._state(cache, slots, positions_BT, ids_BT, "ngram_context", (n - 1,), self.eos, torch.long)
        history = torch.cat([ctx, ids_BT.long()], dim=1)                                  # [B, n - 1 + T]
        if ctx_buf is not None:
            ctx_buf[slots] = history[:, -(n - 1):]
            if cache.keeps_history:   # speculative verification: the context after every token
                cache.record_windows(self.layer_idx, "ngram_context", slots, history, n - 1)
        emb = self.ple_embedding(previous_tokens(history, n, self.eos))                   # [B, T, E]
        key = self.norm_key(self.key_proj(emb).view(B, T, N, D))
        query = self.norm_query(h_BTND)
        gate = (key * query).sum(dim=-1, keepdim=True) / math.sqrt(D)                    # [B, T, N, 1]
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
        value = torch.sigmoid(gate) * self.value_proj(emb).unsqueeze(-2)                  # [B, T, N, D]
        x = self.norm_conv(value).reshape(B, T, N * D).transpose(1, 2)                    # [B, N D, T]
        conv_buf, window = self._state(cache, slots, positions_BT, ids_BT, "ple_conv_state", (N * D, self.window), 0.0,
                                       cache.dtype if cache is not None else x.dtype)
        xs = torch.cat([window.to(x.dtype), x], dim=-1)                                   # [B, N D, W + T]
        if conv_buf is not None:
            conv_buf[slots] = xs[..., xs.size(-1) - self.window:].to(conv_buf.dtype)
            if cache.keeps_history:
                cache.record_windows(self.layer_idx, "ple_conv_state", slots, xs, self.window)
        y = F.silu(F.conv1d(xs, self.conv1d.weight, groups=N * D, dilation=n))            # [B, N D, T]
        return value + y.transpose(1, 2).reshape(B, T, N, D)
