"""Grouped-query attention with the options our families need: q/k RMSNorm per head or over the
whole projection (before RoPE), q/k/v clamping (OLMoE's clip_qkv), q/k/v/o biases, learned per-head sinks (GPT-OSS), a sliding window per layer, partial or interleaved
RoPE, and the KV cache of :mod:`dynamoe.models.cache`.

Legend: B batch rows, T new tokens, L keys attended (cache: positions 0..L-1), H query heads,
K key/value heads (H = K * G), d head dim, D model dim.

Masks come from positions, not from indices: query at position p sees key positions j with
j <= p (causal) and j > p - W (window W), or, with chunked local attention (Llama-4's chunk C),
j // C == p // C (the keys of its own chunk: C positions from 0, C, 2C, ...). A window may keep a
reference prefix of each row in sight (``prefix_B``: key positions j < P_b are visible whatever the window:
Unlimited-OCR's prompt). With the cache, rows sit at
different positions (continuous batching); keys past a row's own length are never visible to it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops import cpu_kernels, linear
from ..ops.fused import MAX_ROWS, Fused, Holds, Unfusable, slot, struct
from ..ops.linear_decode import linear_weights
from ..ops.stacked_linears import stack_linears_, still_stacked
from .cache import KVCache
from .norms import RMSNorm
from .rope import RotaryEmbedding, apply_rope

_DECODE_DTYPES = (torch.bfloat16, torch.float32)

__all__ = ["Attention", "attention_mask", "attend", "write_kv", "cached_length", "decode_rows"]


def attention_mask(q_pos_BT: Tensor, k_pos_BL: Tensor, window: int | None, chunk: int | None = None,
                   prefix_B: Tensor | None = None) -> Tensor:
    """bool [B, 1, T, L]: True where the query at q_pos may see the key at k_pos (causal, within ``window``
    positions -- or, with ``prefix_B``, before row b's position P_b --, within the query's ``chunk`` of positions)."""
    q = q_pos_BT[:, None, :, None]
    k = k_pos_BL[:, None, None, :]
    allowed = k <= q
    if window is not None:
        inside = k > q - window
        if prefix_B is not None:
            inside = inside | (k < prefix_B.to(k.device)[:, None, None, None])
        allowed = allowed & inside
    if chunk is not None:
        allowed = allowed & (torch.div(k, chunk, rounding_mode="floor") == torch.div(q, chunk, rounding_mode="floor"))
    return allowed


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, causal: bool) -> Tensor:
    B, H, T, _ = q.shape
    K = k.size(1)
    if K != H and not causal and (mask is None or mask.size(1) == 1):
        # the G query heads of a key/value head as G*T rows over its keys: one pass over each head's keys
        # instead of G (4x faster for one query over an 11k-token cache at G=8, 1.2x for a 16-token chunk)
        G = H // K
        if mask is not None and T > 1:
            mask = mask.expand(B, 1, T, mask.size(-1)).repeat(1, 1, G, 1)
        out = F.scaled_dot_product_attention(q.reshape(B, K, G * T, q.size(-1)), k, v, attn_mask=mask, scale=scale)
        return out.view(B, H, T, v.size(-1))
    if K != H:
        try:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
        except TypeError:  # torch < 2.5: no enable_gqa
            G = q.size(1) // k.size(1)
            k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)


_FLASH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _attend_with_sinks(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, sinks_H: Tensor) -> Tensor:
    """softmax over [scores | sink] per head, the sink's column dropped (GPT-OSS). fp32 softmax.

    A sink only adds exp(sink) to the softmax's denominator, so the output is plain attention's times
    Z / (Z + exp(sink)) = sigmoid(lse - sink), lse = log Z the log-sum-exp of the visible scores: on the CPU,
    inference runs the flash kernel that returns lse (memory O(T d), not the [heads, T, L] scores: 1 GB per
    full-attention layer of gpt-oss-20b at a 2048-token prefill); elsewhere the scores are materialized."""
    B, H, T, d = q.shape
    K = k.size(1)
    G = H // K
    if (_FLASH_LSE is not None and q.device.type == "cpu" and v.size(-1) == d and q.dtype == k.dtype == v.dtype
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, sinks_H)))):
        # the G query heads of a key/value head as G*T rows over its keys (as _sdpa), an additive mask
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
        bias = bias.expand(B, 1, T, bias.size(-1)).repeat(1, 1, G, 1) if G > 1 else bias
        out, lse = _FLASH_LSE(q.reshape(B, K, G * T, d), k, v, 0.0, False, attn_mask=bias, scale=scale)
        sink = sinks_H.float().reshape(1, K, G, 1).expand(1, K, G, T).reshape(1, K, G * T)
        return (out.float() * torch.sigmoid(lse - sink).unsqueeze(-1)).to(q.dtype).view(B, H, T, d)
    q_BKGTd = q.reshape(B, K, G, T, d)
    scores = torch.matmul(q_BKGTd, k.unsqueeze(2).transpose(-1, -2)).float() * scale  # [B, K, G, T, L]
    scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
    sink = sinks_H.float().reshape(1, K, G, 1, 1).expand(B, K, G, T, 1)
    logits = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(logits - logits.amax(-1, keepdim=True), dim=-1)[..., :-1]
    out = torch.matmul(probs.to(v.dtype), v.unsqueeze(2))  # [B, K, G, T, dv] (values may be narrower: MiMo)
    return out.reshape(B, H, T, v.size(-1))


def attend(q_BHTd: Tensor, k_BKLd: Tensor, v_BKLd: Tensor, q_pos_BT: Tensor, k_pos_BL: Tensor | None,
           scale: float, window: int | None = None, sinks_H: Tensor | None = None, chunk: int | None = None,
           prefix_B: Tensor | None = None) -> Tensor:
    """Attention output [B, H, T, d]. ``k_pos_BL`` None means the keys are the T queries themselves at
    consecutive positions (plain causal attention: the fast path of SDPA). ``chunk``: chunked local
    attention (each query sees the keys of its own chunk of ``chunk`` positions only). ``prefix_B`` (with a
    ``window``): int [B], each row's key positions below it stay visible outside the window."""
    if prefix_B is not None and (window is None or chunk is not None):
        raise ValueError("attend: prefix_B (keys kept in sight outside a window) needs a window and no chunk")
    if chunk is not None:
        if window is not None:
            raise ValueError("attend: a sliding window and chunked attention at once are not supported")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk must be an int >= 1 or None, got {chunk!r}")
        if int(q_pos_BT.max()) < chunk:  # every position in the first chunk: plain causal attention
            chunk = None
    if k_pos_BL is None and window is None and sinks_H is None and chunk is None:
        return _sdpa(q_BHTd, k_BKLd, v_BKLd, None, scale, causal=q_BHTd.size(2) > 1)
    if (k_pos_BL is not None and sinks_H is None and chunk is None and q_BHTd.size(0) == 1 and q_BHTd.size(2) == 1
            and (window is None or k_BKLd.size(2) <= window) and q_pos_BT.device.type == "cpu"
            and int(q_pos_BT[0, 0]) == k_BKLd.size(2) - 1):
        # one sequence's decode step over exactly its keys 0..position: every key is visible, so
        # no mask (building one costs more than this step's attention)
        return _sdpa(q_BHTd, k_BKLd, v_BKLd, None, scale, causal=False)
    if window is None and sinks_H is None and chunk is None and _is_chunk_over_its_prefix(q_BHTd, k_BKLd, v_BKLd, q_pos_BT):
        return _prefix_then_causal(q_BHTd, k_BKLd, v_BKLd, scale)
    span = window or chunk
    if (span is not None and prefix_B is None and k_BKLd.size(2) > 2 * span
            and (q_BHTd.size(2) > 1 or chunk is not None)):
        spans = _window_spans(q_pos_BT, k_pos_BL, k_BKLd.size(2), window, chunk)
        if spans is not None:  # each block of queries over only the keys its window (chunk) can reach
            return torch.cat([_masked(q_BHTd[:, :, a:b], k_BKLd[:, :, lo:hi], v_BKLd[:, :, lo:hi], q_pos_BT[:, a:b],
                                      (q_pos_BT if k_pos_BL is None else k_pos_BL)[:, lo:hi], scale, window, sinks_H,
                                      chunk)
                              for a, b, lo, hi in spans], dim=2)
    return _masked(q_BHTd, k_BKLd, v_BKLd, q_pos_BT, q_pos_BT if k_pos_BL is None else k_pos_BL, scale, window, sinks_H,
                   chunk, prefix_B)


#: the shortest cached prefix worth splitting off (below it, the mask costs little and two kernel calls more)
_SPLIT_MIN_PREFIX = 256


def _is_chunk_over_its_prefix(q: Tensor, k: Tensor, v: Tensor, q_pos_BT: Tensor) -> bool:
    """One sequence's prefill chunk of T > 1 queries at the last T of its L keys 0..L-1, the first L - T of which
    (>= :data:`_SPLIT_MIN_PREFIX`) every query sees: what a chunked or prefix-cached prefill runs on the CPU."""
    B, _, T, d = q.shape
    L = k.size(2)
    if (B != 1 or T < 2 or L - T < max(T, _SPLIT_MIN_PREFIX) or _FLASH_LSE is None or q.device.type != "cpu"
            or v.size(-1) != d or not q.dtype == k.dtype == v.dtype
            or (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)))):
        return False
    pos = q_pos_BT[0]
    return int(pos[0]) == L - T and int(pos[-1]) == L - 1 and bool((pos[1:] - pos[:-1] == 1).all())


def _prefix_then_causal(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Attention of T queries at positions L-T..L-1 over keys 0..L-1 (see :func:`_is_chunk_over_its_prefix`):
    :func:`_runs_then_causal` with the cached prefix 0..L-T-1 as one run."""
    P = k.size(2) - q.size(2)
    return _runs_then_causal(q, [k[:, :, :P]], [v[:, :, :P]], k[:, :, P:], v[:, :, P:], scale)


def _runs_then_causal(q: Tensor, ks: list[Tensor], vs: list[Tensor], k_t: Tensor, v_t: Tensor, scale: float) -> Tensor:
    """Attention of T queries over a cached prefix, given as runs of keys ``ks`` / values ``vs`` [B, K, n_i, d]
    that every query sees, and then over their own T keys ``k_t`` / ``v_t`` causally: mask-free passes merged by
    their log-sum-exps (each run with the G query heads of a key/value head as G*T rows: one pass over its keys).
    The masked kernel builds and reads a [T, L] mask and takes a slower path: 1.3-1.7x the time at 11k keys."""
    B, H, T, d = q.shape
    K = k_t.size(1)
    G = H // K
    outs, lses = [], []
    for k_p, v_p in zip(ks, vs):
        out_p, lse_p = _FLASH_LSE(q.reshape(B, K, G * T, d), k_p, v_p, 0.0, False, scale=scale)[:2]
        outs.append(out_p.reshape(B, H, T, d))
        lses.append(lse_p.reshape(B, H, T, 1).float())
    if G > 1:
        k_t, v_t = k_t.repeat_interleave(G, dim=1), v_t.repeat_interleave(G, dim=1)
    out_t, lse_t = _FLASH_LSE(q, k_t, v_t, 0.0, True, scale=scale)[:2]
    outs.append(out_t)
    lses.append(lse_t.reshape(B, H, T, 1).float())
    top = lses[0]
    for lse in lses[1:]:
        top = torch.maximum(top, lse)
    ws = [torch.exp(lse - top) for lse in lses]
    num, den = outs[0].float() * ws[0], ws[0]
    for o, w in zip(outs[1:], ws[1:]):
        num, den = num + o.float() * w, den + w
    return (num / den).to(q.dtype)


#: the most runs of consecutive blocks a chunk's cached prefix is attended over run by run (more: gathered)
_MOST_PREFIX_RUNS = 8


def _chunk_over_runs(cache: KVCache, layer: int, q: Tensor, k: Tensor, v: Tensor, positions_BT: Tensor,
                     slots: Tensor, kv_len: int, scale: float) -> Tensor | None:
    """One sequence's prefill chunk over its cached prefix straight from the cache's blocks (the
    :func:`_is_chunk_over_its_prefix` case, run by run: :meth:`KVCache.spans`): its keys and values written,
    attention over each run of the prefix's blocks and causally over its own, merged -- no gathered copy of the
    prefix when its blocks are in a few runs (a prefix-cached prompt: its shared blocks, then its own; else one
    copy). None where that does not apply (nothing written: the caller writes and reads back as usual)."""
    B, H, T, d = q.shape
    P = kv_len - T
    if (B != 1 or T < 2 or P < max(T, _SPLIT_MIN_PREFIX) or _FLASH_LSE is None or q.device.type != "cpu"
            or slots.device.type != "cpu" or v.size(-1) != d or not q.dtype == k.dtype == v.dtype
            or (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)))):
        return None
    pos = positions_BT[0]
    if not (int(pos[0]) == P and int(pos[-1]) == kv_len - 1 and bool((pos[1:] - pos[:-1] == 1).all())):
        return None
    pools = cache.put(layer, slots, positions_BT, k=k, v=v)
    slot = int(slots[0])
    kv = (pools["k"], pools["v"])
    prefix = cache.spans(kv, slot, 0, P, _MOST_PREFIX_RUNS)
    if prefix is None:   # blocks all over the pool: one gathered copy
        k_all, v_all = (cache.rows(pool, slots, kv_len).to(q.dtype) for pool in kv)
        return _prefix_then_causal(q, k_all, v_all, scale)
    k_t, v_t = (torch.cat(views, dim=2).to(q.dtype) for views in cache.spans(kv, slot, P, kv_len, T + 1))
    ks, vs = ([t.to(q.dtype) for t in views] for views in prefix)
    return _runs_then_causal(q, ks, vs, k_t, v_t, scale)


def _masked(q: Tensor, k: Tensor, v: Tensor, q_pos_BT: Tensor, k_pos_BL: Tensor, scale: float,
            window: int | None, sinks_H: Tensor | None, chunk: int | None = None,
            prefix_B: Tensor | None = None) -> Tensor:
    mask = attention_mask(q_pos_BT, k_pos_BL, window, chunk, prefix_B)
    if sinks_H is not None:
        return _attend_with_sinks(q, k, v, mask, scale, sinks_H)
    return _sdpa(q, k, v, mask, scale, causal=False)


def _window_spans(q_pos_BT: Tensor, k_pos_BL: Tensor | None, L: int, window: int | None,
                  chunk: int | None = None) -> list | None:
    """Blocks ``(a, b, lo, hi)`` of ``window`` (or ``chunk``) queries a..b-1 with the key range lo..hi-1 outside
    of which no query of the block sees a key, so that sliding-window (chunked) attention costs O(T * window),
    not O(T * L). Keys are either the queries themselves (``k_pos_BL`` None) or a cache's positions 0..L-1. The
    ranges come from the positions, so they are exact only where positions grow by at least one per token
    (a plain sequence, chunked or cached); elsewhere (None) the caller attends over all keys. A query at
    position p sees back to p - window + 1 (window), or to its chunk's start C * (p // C) (chunk)."""
    T = q_pos_BT.size(1)
    step = window or chunk
    if k_pos_BL is None:
        if T > 1 and not bool((q_pos_BT[:, 1:] > q_pos_BT[:, :-1]).all()):
            return None
        if window is not None:
            # key index j < a - window + 1 has position <= pos[a] - window: invisible to queries a.. on
            return [(a, min(a + step, T), max(0, a - window + 1), min(a + step, T)) for a in range(0, T, step)]
        # key index j < a - (pos[a] - chunk start of pos[a]) has a position before that chunk start
        back_T = (q_pos_BT - torch.div(q_pos_BT, chunk, rounding_mode="floor") * chunk).amax(0)
        return [(a, min(a + step, T), max(0, a - int(back_T[a])), min(a + step, T)) for a in range(0, T, step)]
    if not torch.equal(k_pos_BL, torch.arange(L, device=k_pos_BL.device).expand_as(k_pos_BL)):
        return None
    lo_B, hi_B = q_pos_BT.amin(0), q_pos_BT.amax(0)  # per query index, over the rows
    spans = []
    for a in range(0, T, step):
        b = min(a + step, T)
        first = int(lo_B[a:b].min())
        lo = first - window + 1 if window is not None else first // chunk * chunk
        hi = int(hi_B[a:b].max()) + 1
        spans.append((a, b, max(0, lo), min(L, max(hi, 1))))
    return spans


def cached_length(positions_BT: Tensor, slots: Tensor | None, kv_len: int | None) -> int:
    """Keys each row of a cached forward may see (max position + 1), unless the caller knows it;
    a clear error when the slots are missing."""
    if slots is None:
        raise ValueError("attention with a cache needs slots (LongTensor [B])")
    return int(positions_BT[:, -1].max()) + 1 if kv_len is None else kv_len


def write_kv(cache: KVCache, layer: int, slots_B: Tensor, positions_BT: Tensor, kv_len: int,
             **new: Tensor) -> dict[str, Tensor]:
    """Write each new tensor [B, K, T, d] at its rows' positions in the cache's paged tensor of that name
    and return the batch's slots' first ``kv_len`` positions of each, [B, K, kv_len, d], in the new tensors'
    dtype (:meth:`KVCache.write`)."""
    return cache.write(layer, slots_B, positions_BT, kv_len, **new)


def decode_rows(rotary: RotaryEmbedding | None, positions_BT: Tensor, dtype: torch.dtype) -> tuple:
    """The fused kernel's (cos, sin, positions) rows of a decode step: ``rotary.decode_rows``, or without a rotary
    embedding (layers that are all NoPE) empty cos/sin [B, 0] that the kernel does not read."""
    if rotary is not None:
        return rotary.decode_rows(positions_BT, dtype)
    B = positions_BT.size(0)
    empty = torch.empty(B, 0, dtype=dtype)
    return empty, empty, positions_BT.reshape(B).to(torch.long).contiguous()


class Attention(nn.Module):
    """GQA self-attention of one decoder layer (parameter names as Hugging Face's: ``q_proj``,
    ``k_proj``, ``v_proj``, ``o_proj``, ``q_norm``, ``k_norm``, ``sinks``).

    ``forward(x [B, T, D], positions [B, T], cache=None, slots=None, kv_len=None) -> [B, T, D]``.
    Without a cache: causal attention over the T tokens. With one: the new k/v are written at the
    positions of each row's slot, and each query attends over its slot's keys 0..position.
    ``kv_len`` (max position + 1 over the rows) can be passed by the caller to save a host sync.

    ``qk_norm``: False, True / 'head' (RMSNorm over each head's d dims: Qwen3, GLM) or 'all' (one
    RMSNorm over the whole q [H*d] and k [K*d] projections: OLMoE, MiniMax-M2). ``clip_qkv``: clamp
    q, k and v to [-c, c] after the projections and q/k norms (OLMoE). ``qk_norm_after_rope``: the
    per-head q/k norms act on the rotated q and k (Hunyuan-A13B) instead of before RoPE. ``use_rope``
    False: no rotary embedding in this layer (NoPE: EXAONE's global layers).
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, layer_idx: int,
                 rotary: RotaryEmbedding, qkv_bias: bool = False, o_bias: bool = False, qk_norm: bool | str = False,
                 norm_eps: float = 1e-6, sinks: bool = False, sliding_window: int | None = None,
                 scale: float | None = None, rope_interleaved: bool = False, clip_qkv: float | None = None,
                 qk_norm_after_rope: bool = False, use_rope: bool = True, dtype=None):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        if qk_norm not in (False, True, "head", "all"):
            raise ValueError(f"qk_norm must be False, True / 'head' (per head) or 'all' (whole projection), got {qk_norm!r}")
        if clip_qkv is not None and not clip_qkv > 0:
            raise ValueError(f"clip_qkv must be > 0 or None, got {clip_qkv!r}")
        if qk_norm_after_rope and qk_norm not in (True, "head"):
            raise ValueError(f"qk_norm_after_rope needs per-head q/k norms (qk_norm=True), got qk_norm={qk_norm!r}")
        self.qk_norm_all, self.clip_qkv, self.qk_norm_after_rope = qk_norm == "all", clip_qkv, qk_norm_after_rope
        self.use_rope = use_rope
        self.layer_idx, self.num_heads, self.num_kv_heads, self.head_dim = layer_idx, num_heads, num_kv_heads, head_dim
        self.sliding_window, self.rope_interleaved = sliding_window, rope_interleaved
        self.scale = head_dim ** -0.5 if scale is None else scale
        kw = dict(dtype=dtype)
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=qkv_bias, **kw)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias, **kw)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias, **kw)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=o_bias, **kw)
        q_dim, k_dim = (num_heads * head_dim, num_kv_heads * head_dim) if self.qk_norm_all else (head_dim, head_dim)
        self.q_norm = RMSNorm(q_dim, norm_eps, dtype=dtype) if qk_norm else None
        self.k_norm = RMSNorm(k_dim, norm_eps, dtype=dtype) if qk_norm else None
        self.sinks = nn.Parameter(torch.zeros(num_heads, **kw)) if sinks else None
        # shared by all layers and owned (registered) by the model: a plain reference here
        object.__setattr__(self, "rotary", rotary)
        object.__setattr__(self, "_qkv", None)  # (weight, bias) that q/k/v_proj are views of, see fuse_qkv_

    def fuse_qkv_(self) -> bool:
        """Store q_proj, k_proj and v_proj's weights (and biases) in one [(H + 2K) d, D] buffer, each
        parameter a view of its rows, so that inference runs one matmul (one GEMV at decode) instead
        of three. Names, shapes and the state dict are unchanged. Only for plain linears whose
        parameters need no gradient (a loaded model); True when fused."""
        qkv = stack_linears_([self.q_proj, self.k_proj, self.v_proj])
        if qkv is None:
            return False
        object.__setattr__(self, "_qkv", qkv)
        return True

    def _apply(self, fn, recurse=True):
        # .to(), .float(), ...: the parameters get new data one by one; fused before, fused after
        fused = self._qkv is not None and self._still_fused(self._qkv)
        super()._apply(fn, recurse)
        if fused:
            object.__setattr__(self, "_qkv", None)
            self.fuse_qkv_()
        return self

    def __setstate__(self, state):
        super().__setstate__(state)
        qkv = self.__dict__.get("_qkv")
        if qkv is not None and not self._still_fused(qkv):  # a deep copy or unpickled one: parameters copied apart
            object.__setattr__(self, "_qkv", None)
            self.fuse_qkv_()

    def _project_qkv(self, x_BTD: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v projections: one matmul over the fused buffer while the parameters are still its
        views (a parameter replaced since falls back to three), else three."""
        qkv = self._qkv
        if qkv is not None and not self._still_fused(qkv):  # e.g. moved by .to(): free the old buffer
            qkv = None
            object.__setattr__(self, "_qkv", None)
        if qkv is not None and not torch.is_grad_enabled():
            out = linear(x_BTD, qkv[0], qkv[1])
            nq, nk = self.q_proj.weight.size(0), self.k_proj.weight.size(0)
            return out[..., :nq], out[..., nq:nq + nk], out[..., nq + nk:]
        return self.q_proj(x_BTD), self.k_proj(x_BTD), self.v_proj(x_BTD)

    def _still_fused(self, qkv) -> bool:
        m = self._modules
        return still_stacked((m["q_proj"], m["k_proj"], m["v_proj"]), qkv)

    def attend_cached(self, q_BHTd: Tensor, k_BKTd: Tensor, v_BKTd: Tensor, positions_BT: Tensor,
                      cache: KVCache | None, slots: Tensor | None, kv_len: int | None, window: int | None = None,
                      sinks_H: Tensor | None = None, chunk: int | None = None,
                      prefix_B: Tensor | None = None) -> Tensor:
        """:func:`attend` of the queries over the new keys and values -- with a cache, written into it first and
        read back with every earlier position of the rows' slots. [B, H, T, dv]."""
        k_pos = None
        if cache is not None:
            kv_len = cached_length(positions_BT, slots, kv_len)
            if window is None and sinks_H is None and chunk is None and prefix_B is None:
                out = _chunk_over_runs(cache, self.layer_idx, q_BHTd, k_BKTd, v_BKTd, positions_BT, slots, kv_len,
                                       self.scale)
                if out is not None:
                    return out
            kv = write_kv(cache, self.layer_idx, slots, positions_BT, kv_len, k=k_BKTd, v=v_BKTd)
            k_BKTd, v_BKTd = kv["k"], kv["v"]
            k_pos = torch.arange(kv_len, device=q_BHTd.device).expand(q_BHTd.size(0), kv_len)
        return attend(q_BHTd, k_BKTd, v_BKTd, positions_BT, k_pos, self.scale, window, sinks_H, chunk, prefix_B)

    def extra_repr(self) -> str:
        return (f"layer={self.layer_idx}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"sliding_window={self.sliding_window}, sinks={self.sinks is not None}"
                + (", qk_norm=all" if self.qk_norm_all else "") + (f", clip_qkv={self.clip_qkv}" if self.clip_qkv else ""))

    def decode_fused(self, norm: nn.Module, dtype: torch.dtype) -> Fused:
        """The fused decode kernel's weights (``kernels.AttentionWeights``: ``norm``'s weight, eps and fp32
        flag, the fused q/k/v weight and bias, q/k norm weights and eps, RoPE interleaving, sliding window,
        fp32 sinks, scale, o_proj weight and bias) for steps of ``dtype`` in this module's state, as a
        :class:`~dynamoe.ops.fused.Fused` (cached while current): ``weights`` None and ``extra`` the reason
        where the kernel does not apply, else ``extra`` is the kernels module."""
        cache = slot(self)
        fused = cache.get((norm, dtype))
        if fused is not None:
            return fused
        holds = Holds()
        try:
            kernels = cpu_kernels.load()
            if kernels is None:
                raise Unfusable("the CPU kernels are not available")
            fused = Fused(self._decode_weights(kernels, holds, norm, dtype), holds, kernels)
        except Unfusable as exc:
            fused = Fused(None, holds, str(exc))
        return cache.put((norm, dtype), fused)

    def _decode_weights(self, kernels, holds: Holds, norm: nn.Module, dtype: torch.dtype):
        """The kernel's ``AttentionWeights``; raises Unfusable with the reason where it does not apply.
        (The kernel norms q/k per head before RoPE, rotates unless NoPE, does not clamp, and scales the norms by
        their weight or, zero-centred, by 1 + weight.) Families whose attention differs override this to say so."""
        if type(norm) is not RMSNorm:
            raise Unfusable(f"the input norm is a {type(norm).__name__} (the kernel takes RMSNorm)")
        for name, why in (("qk_norm_all", "q/k norms over all heads"), ("clip_qkv", "q/k/v clipping"),
                          ("qk_norm_after_rope", "q/k norms after RoPE")):
            if holds.attr(self, name):
                raise Unfusable(why)
        rope = bool(holds.attr(self, "use_rope"))
        if rope and holds.attr(self, "rotary") is None:
            raise Unfusable("use_rope without a rotary embedding")
        if dtype not in _DECODE_DTYPES:
            raise Unfusable(f"steps of {dtype} (the kernel takes bf16 or fp32)")
        qkv = self._decode_qkv(kernels, holds, dtype)
        o, qn, kn = holds.module(self, "o_proj"), holds.module(self, "q_norm"), holds.module(self, "k_norm")
        if qn is not None and (type(qn) is not RMSNorm or type(kn) is not RMSNorm
                               or qn.zero_centered != kn.zero_centered or qn.weight_in_fp32 != kn.weight_in_fp32):
            raise Unfusable("the q and k norms are not RMSNorms of one kind")
        sinks = holds.param(self, "sinks")
        norm_w = holds.param(norm, "weight")
        qn_w = None if qn is None else holds.param(qn, "weight")
        kn_w = None if kn is None else holds.param(kn, "weight")
        if norm_w.dtype != dtype or (qn_w is not None and qn_w.dtype != dtype) or norm_w.device.type != "cpu":
            raise Unfusable(f"the norm and q/k norm weights are not CPU {dtype}")
        gate_kind, gate_per_head, gate = self._decode_gate(kernels, holds, dtype)
        w = struct(kernels.AttentionWeights, holds, norm_w=norm_w, norm_eps=float(holds.attr(norm, "eps")),
                   norm_fp32=bool(holds.attr(norm, "weight_in_fp32")),
                   norm_zero_centered=bool(holds.attr(norm, "zero_centered")), qkv=qkv, q_norm=qn_w,
                   k_norm=kn_w, qk_eps=1e-6 if qn is None else float(holds.attr(qn, "eps")),
                   qk_fp32=qn is not None and bool(holds.attr(qn, "weight_in_fp32")),
                   qk_zero_centered=qn is not None and bool(holds.attr(qn, "zero_centered")), rope=rope,
                   interleaved=bool(holds.attr(self, "rope_interleaved")),
                   window=int(holds.attr(self, "sliding_window") or 0), sinks=holds.fp32(sinks),
                   scale=float(holds.attr(self, "scale")), gate_kind=gate_kind, gate_per_head=gate_per_head,
                   o=linear_weights(kernels, holds, o, dtype, "o_proj"))
        if gate is not None:
            w.gate = gate
        return w

    def _decode_gate(self, kernels, holds: Holds, dtype: torch.dtype) -> tuple:
        """The output gate as the kernel reads it: ``(kernels.GateKind, per_head, LinearWeights or None)`` -- the
        attention output times act(gate(x)) before o_proj, x the block's normed input, one gate per head ([H, D])
        or per channel ([H d, D]). None here; gated families override it (:meth:`_gate_weights`)."""
        return kernels.GateKind.none, False, None

    def _gate_weights(self, kernels, holds: Holds, dtype: torch.dtype, name: str, act: str) -> tuple:
        """:meth:`_decode_gate` for the Linear ``name`` with activation ``act`` ('sigmoid' or 'softplus'), per head
        or per channel from its output features (H or H d)."""
        proj = holds.module(self, name)
        H, d = self.num_heads, self.head_dim
        out = proj.out_features if isinstance(proj, nn.Linear) else holds.attr(proj, "out_features")
        if out not in (H, H * d):
            raise Unfusable(f"{name} gives {out} gates (the kernel takes one per head, {H}, or per channel, {H * d})")
        return (kernels.GateKind.__members__[act], out == H and d > 1,
                linear_weights(kernels, holds, proj, dtype, name))

    def _decode_qkv(self, kernels, holds: Holds, dtype: torch.dtype) -> list:
        """The q/k/v projections as the kernel reads them: the one fused dense buffer (:meth:`fuse_qkv_`), or
        q, k and v apart where they are packed (dynamoe.quant.QuantizedLinear)."""
        qkv = holds.attr(self, "_qkv")
        mods = [holds.module(self, name) for name in ("q_proj", "k_proj", "v_proj")]
        dense = any(isinstance(m, nn.Linear) for m in mods)
        if qkv is not None and not self._still_fused(qkv):
            if dense:
                raise Unfusable("q/k/v parameters no longer view the fused buffer")
            qkv = None  # (the projections were replaced by packed ones since)
        if qkv is None:
            if dense:
                raise Unfusable("q/k/v projections are not fused into one buffer (Attention.fuse_qkv_)")
            return [linear_weights(kernels, holds, m, dtype, name) for m, name in zip(mods, ("q_proj", "k_proj", "v_proj"))]
        for m in mods:  # views of the fused buffer: p.data = ... moves them
            for t in (holds.param(m, "weight"), holds.param(m, "bias")):
                if t is not None:
                    holds.pointer(t)
        w, b = qkv
        if w.dtype != dtype or w.device.type != "cpu":
            raise Unfusable(f"weights of {w.dtype} on {w.device.type} for steps of {dtype} (the kernel takes one of "
                            "bf16/fp32 on the CPU)")
        return [struct(kernels.LinearWeights, holds, format=kernels.WeightFormat.dense, w=w, bias=b)]

    def decode_with(self, fused: Fused, h_BD: Tensor, rows: tuple, cache: KVCache, slots: Tensor) -> Tensor:
        """The kernel call of :meth:`decode_step` with ``fused`` from :meth:`decode_fused` (h [B, D]
        contiguous of its dtype, ``rows`` = the rotary embedding's ``decode_rows``, slots int64)."""
        K, d = self.num_kv_heads, self.head_dim
        out = torch.empty_like(h_BD)
        fused.extra.attn_decode_out(h_BD, fused.weights, rows[0], rows[1], cache.kv_pool(self.layer_idx, "k", K, d),
                                    cache.kv_pool(self.layer_idx, "v", K, d), cache.block_tables, slots, rows[2], out)
        return out

    def decode_step(self, h_BTD: Tensor, norm: nn.Module, positions_BT: Tensor, cache: KVCache, slots: Tensor,
                    kv_len: int | None = None) -> Tensor | None:
        """``h + self(norm(h), ...)`` for a decode step (T = 1 new token for each of B <= MAX_ROWS sequences
        in distinct slots) in one kernel call (csrc/attn_decode.cpp: norm, fused q/k/v GEMV, q/k norms,
        RoPE, cache write, attention over each row's keys 0..position with window and sinks, o_proj,
        residual); None where it does not apply (autograd, not CPU, see :meth:`decode_fused`) and the
        caller runs the op-by-op path. ``kv_len`` is not needed: each row sees exactly its keys
        0..position, as the op-by-op path's mask allows."""
        if slots is None or torch.is_grad_enabled():
            return None
        B, dt = h_BTD.size(0), h_BTD.dtype
        if (h_BTD.device.type != "cpu" or h_BTD.size(1) != 1 or not 1 <= B <= MAX_ROWS or slots.numel() != B
                or slots.device.type != "cpu" or positions_BT.device.type != "cpu" or cache.dtype != dt):
            return None
        fused = self.decode_fused(norm, dt)
        if fused.weights is None:
            return None
        h = h_BTD.view(B, -1) if h_BTD.is_contiguous() else h_BTD.reshape(B, -1).contiguous()
        slots = slots if slots.dtype == torch.long and slots.is_contiguous() else slots.to(torch.long).contiguous()
        return self.decode_with(fused, h, decode_rows(self.rotary, positions_BT, dt), cache, slots).view(h_BTD.shape)

    def forward(self, x_BTD: Tensor, positions_BT: Tensor, cache: KVCache | None = None, slots: Tensor | None = None,
                kv_len: int | None = None) -> Tensor:
        B, T, _ = x_BTD.shape
        q, k, v = self.heads(x_BTD, positions_BT)
        out = self.attend_cached(q, k, v, positions_BT, cache, slots, kv_len, self.sliding_window, self.sinks)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))

    def heads(self, x_BTD: Tensor, positions_BT: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The queries [B, H, T, d], keys and values [B, K, T, d] of ``x`` at ``positions``: projected, clamped,
        q/k-normed and rotated as this layer's options say (extension point: families that change what happens
        after this -- gates, other masks -- call it and go on from there)."""
        B, T, _ = x_BTD.shape
        H, K, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self._project_qkv(x_BTD)
        if self.qk_norm_all:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            c = self.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        q, k, v = q.reshape(B, T, H, d), k.reshape(B, T, K, d), v.reshape(B, T, K, d).transpose(1, 2)
        per_head = self.q_norm is not None and not self.qk_norm_all
        if per_head and not self.qk_norm_after_rope:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)                            # [B, H, T, d], [B, K, T, d]
        if self.use_rope:
            cos, sin = self.rotary(positions_BT, q.dtype)
            q, k = apply_rope(q, cos, sin, self.rope_interleaved), apply_rope(k, cos, sin, self.rope_interleaved)
        if per_head and self.qk_norm_after_rope:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v
