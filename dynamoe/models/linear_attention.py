"""Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5): a causal depthwise conv over q/k/v, L2-normed
q and k, and the gated delta rule -- a fixed-size recurrent state per sequence instead of a KV cache.

Legend: B batch rows, T new tokens, C conv channels (q, k, v dims together), W conv state (kernel - 1
past inputs), Hk key heads, H value heads (each key head serves H / Hk consecutive value heads), k key
head dim, v value head dim, D model dim, n chunks, N chunk length.

The gated delta rule, per head, with state S [k, v] (zero at a sequence's first token):

    S = exp(g_t) * S                      (decay, g_t <= 0)
    u = beta_t * (v_t - S^T k_t)          (the part of v_t the state does not predict yet)
    S = S + k_t u^T                       (delta-rule write)
    o_t = S^T q_t

:func:`gated_delta_rule_recurrent` runs it token by token (decode, and the reference);
:func:`gated_delta_rule_chunked` computes the same in chunks of N tokens (prefill): inside a chunk the
writes are a unit lower-triangular system solved at once, only the chunk-to-chunk state is sequential.
Both are plain torch in fp32 and equal to rounding (tests/test_models_qwen3_next.py).

With a :class:`~dynamoe.models.cache.KVCache`, each layer keeps per slot its conv window
(``cache.buffer(layer, "conv_state", C, W)``) and its recurrent state (``"recurrent_state"``, fp32
[H, k, v]); both are read as zero for a row whose first position is 0 (a new sequence: the buffers
are never assumed zeroed) and continue exactly across chunked prefill and decode. A slot's state
summarises its whole prefix, so it cannot be truncated back to a shorter one (no prefix reuse): a layer
built with ``checks_position`` (the model's first linear-attention layer) also keeps the position each
slot's state has reached (``"state_position"``) and raises a ValueError when a row continues a slot
from any other position. The one exception is speculative decoding's verification forward: while the cache
keeps a history (:meth:`~dynamoe.models.cache.KVCache.begin_history`), :class:`GatedDeltaNet` runs the
recurrence token by token and records its conv window (:func:`record_conv_windows`), its state and the position
after every token, so that cutting off rejected drafts (``cache.truncate``) puts them back where the kept tokens
leave them. The other layers that keep per-slot state through :func:`slot_states` (Kimi Delta Attention, Mamba-1
and -2, lightning attention, short convolutions, ...) do the same; plain decoding and prefill record nothing.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .cache import KVCache
from .norms import GatedRMSNorm

__all__ = ["GatedDeltaNet", "causal_conv1d", "l2norm", "gated_delta_rule", "gated_delta_rule_recurrent",
           "gated_delta_rule_chunked", "slot_states", "record_conv_windows", "PROJECTIONS"]

#: how the input projections are laid out on disk: 'qkvz' (Qwen3-Next: ``in_proj_qkvz`` and ``in_proj_ba``,
#: grouped per key head) or 'split' (Qwen3.5: ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``)
PROJECTIONS = ("qkvz", "split")
_ACTIVATIONS = {"silu": F.silu, "swish": F.silu}


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def causal_conv1d(x_BCT: Tensor, weight_CK: Tensor, state_BCW: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Depthwise causal convolution of each channel: y[:, c, t] = sum_j w[c, j] * [state | x][:, c, t + j].
    ``state_BCW``: the W = K - 1 inputs before x (None: zeros, a sequence's start). Returns (y [B, C, T],
    the last W inputs of [state | x], the next call's state). No bias, no activation."""
    B, C, T = x_BCT.shape
    W = weight_CK.size(-1) - 1
    if state_BCW is None:
        state_BCW = x_BCT.new_zeros(B, C, W)
    xs = torch.cat([state_BCW.to(x_BCT.dtype), x_BCT], dim=-1)  # [B, C, W + T]
    y = F.conv1d(xs, weight_CK.unsqueeze(1), groups=C)
    return y, xs[..., xs.size(-1) - W:]


def _compute_dtype(t: Tensor) -> torch.dtype:
    """fp32, or fp64 for fp64 inputs (the exactness tests)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def gated_delta_rule_recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                               state: Tensor | None = None, every_state: bool = False) -> tuple[Tensor, Tensor]:
    """Token by token. q, k [B, H, T, k] (already normalised and scaled), v [B, H, T, v], g (log decay)
    and beta [B, H, T], state [B, H, k, v] (None: zeros). Returns (o [B, H, T, v], final state) in fp32
    (fp64 for fp64 inputs); with ``every_state``, the state after each token [B, T, H, k, v] in place of the
    final one (what rolling back to any of them needs)."""
    dt = _compute_dtype(q)
    q, k, v, g, beta = (t.to(dt) for t in (q, k, v, g, beta))
    B, H, T, dk = k.shape
    S = q.new_zeros(B, H, dk, v.size(-1)) if state is None else state.to(dt)
    out, states = [], []
    for t in range(T):
        S = S * g[:, :, t].exp()[..., None, None]
        u = beta[:, :, t, None] * (v[:, :, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, :, t]))
        S = S + k[:, :, t, :, None] * u[:, :, None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", S, q[:, :, t]))
        if every_state:
            states.append(S)
    return torch.stack(out, dim=2), (torch.stack(states, dim=1) if every_state else S)


def gated_delta_rule_chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None = None,
                             chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    """The same as :func:`gated_delta_rule_recurrent`, N = ``chunk_size`` tokens at a time.

    In a chunk starting from state S0, with gamma_t = exp(G_t), G the cumulative sum of g inside the
    chunk, the writes u solve (I + A) u = beta * v - beta * gamma * k S0 with A[t, s] = beta_t
    (gamma_t / gamma_s) k_t.k_s for s < t; then o_t = gamma_t q_t S0 + sum_{s<=t} (gamma_t / gamma_s)
    q_t.k_s u_s and the chunk's end state is gamma_N S0 + sum_s (gamma_N / gamma_s) k_s u_s^T. The
    ratios are exponentials of differences of G (never a quotient of two exponentials, which underflow)."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    dt = _compute_dtype(q)
    q, k, v, g, beta = (t.to(dt) for t in (q, k, v, g, beta))
    B, H, T, dk = k.shape
    dv = v.size(-1)
    N = chunk_size
    pad = (-T) % N
    if pad:  # padded tokens have beta = 0 (no write) and g = 0 (no decay): the state passes through them
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    n = (T + pad) // N
    q, k, v = (t.reshape(B, H, n, N, -1) for t in (q, k, v))
    g, beta = g.reshape(B, H, n, N), beta.reshape(B, H, n, N)
    G = g.cumsum(-1)                                                          # [B, H, n, N]
    causal = torch.ones(N, N, dtype=torch.bool, device=q.device).tril()
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [.., t, s]
    kb = k * beta[..., None]
    lower = torch.eye(N, dtype=dt, device=q.device) + ((kb @ k.transpose(-1, -2)) * decay).tril(-1)
    u0 = torch.linalg.solve_triangular(lower, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(lower, kb * G.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay                                   # [B, H, n, N, N], s <= t
    q_decayed = q * G.exp()[..., None]
    k_to_end = k * (G[..., -1:] - G).exp()[..., None]
    end_decay = G[..., -1].exp()[..., None, None]                             # [B, H, n, 1, 1]
    S = q.new_zeros(B, H, dk, dv) if state is None else state.to(dt)
    out = []
    for i in range(n):
        u = u0[:, :, i] - w[:, :, i] @ S
        out.append(q_decayed[:, :, i] @ S + attn[:, :, i] @ u)
        S = S * end_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ u
    return torch.cat(out, dim=2)[:, :, :T], S


def gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None = None,
                     chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    """The recurrent form for one token (decode), the chunked one otherwise (same arguments)."""
    if q.size(2) == 1:
        return gated_delta_rule_recurrent(q, k, v, g, beta, state)
    return gated_delta_rule_chunked(q, k, v, g, beta, state, chunk_size)


def _check_position(cache: KVCache, layer_idx: int, slots: Tensor, start_B: Tensor, fresh_B: Tensor, T: int) -> None:
    """A row that does not start a sequence must continue its slot's state where it stopped (one
    host sync per forward, in one layer)."""
    reached = cache.buffer(layer_idx, "state_position", dtype=torch.long)
    at_B = reached[slots]
    bad = ~fresh_B & (at_B != start_B)
    if bool(bad.any()):
        b = int(bad.nonzero()[0, 0])
        raise ValueError(f"slot {int(slots[b])} holds a recurrent state that has reached position {int(at_B[b])}, "
                         f"but its row starts at position {int(start_B[b])}: a model with recurrent state cannot "
                         "continue a truncated slot (no prefix reuse); start the sequence again at position 0")
    reached[slots] = start_B + T
    if cache.keeps_history:
        cache.record(layer_idx, "state_position", slots, start_B[:, None] + torch.arange(1, T + 1, device=start_B.device))


def record_conv_windows(cache: KVCache, layer_idx: int, name: str, slots: Tensor, window_BCW: Tensor,
                        x_BCT: Tensor) -> None:
    """Record (:meth:`~dynamoe.models.cache.KVCache.record_windows`, while the cache keeps a history) a causal
    conv's window buffer ``name`` after each of the T inputs x, from the rows' window before them (``window_BCW``,
    as :func:`slot_states` gives it)."""
    cache.record_windows(layer_idx, name, slots, torch.cat([window_BCW.to(x_BCT.dtype), x_BCT], dim=-1),
                         window_BCW.size(-1))


def slot_states(cache: KVCache, layer_idx: int, slots: Tensor | None, positions_BT: Tensor, T: int,
                conv_shape: tuple | None, state_shape: tuple | None, checks_position: bool
                ) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """A linear-attention layer's per-slot buffers and the rows' states: (conv buffer [slots, *conv_shape]
    in the cache's dtype, state buffer [slots, *state_shape] fp32, the rows' conv windows, the rows'
    states), both read as zero for a row whose first position is 0 (a new sequence: whatever the slot
    held before is not its state). ``conv_shape`` / ``state_shape`` None: a layer without that part (LFM2's
    short convolutions have no recurrent state, MiniMax's lightning attention no conv): None for its buffer
    and its rows. ``checks_position`` (the model's first such layer) also checks that every other row
    continues its slot where it stopped (see the module docstring)."""
    if slots is None:
        raise ValueError("linear attention with a cache needs slots (LongTensor [B])")
    fresh_B = positions_BT[:, 0] == 0
    if checks_position:
        _check_position(cache, layer_idx, slots, positions_BT[:, 0], fresh_B, T)
    conv_buf = conv = None
    if conv_shape is not None:
        conv_buf = cache.buffer(layer_idx, "conv_state", *conv_shape)
        conv = conv_buf[slots].masked_fill(fresh_B.view(-1, *([1] * len(conv_shape))), 0)
    if state_shape is None:
        return conv_buf, None, conv, None
    state_buf = cache.buffer(layer_idx, "recurrent_state", *state_shape, dtype=torch.float32)
    state = state_buf[slots].masked_fill(fresh_B.view(-1, *([1] * len(state_shape))), 0)
    return conv_buf, state_buf, conv, state


class GatedDeltaNet(nn.Module):
    """One linear-attention token mixer (Hugging Face's ``linear_attn``): projections, causal conv +
    SiLU over q/k/v (``conv1d``), L2-normed q/k (q also scaled by k^-1/2), beta = sigmoid(b), decay
    g = -exp(A_log) * softplus(a + dt_bias), the gated delta rule, ``norm`` (gated RMSNorm with z; its weight in fp32
    with ``norm_weight_in_fp32``; z through ``gate_activation``, silu or sigmoid), ``out_proj``.

    ``forward(x [B, T, D], positions [B, T], cache=None, slots=None, kv_len=None) -> [B, T, D]``: with a
    cache, row b continues slot ``slots[b]``'s state, or starts from zero where ``positions[b, 0] == 0``.
    """

    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_kernel: int, layer_idx: int, norm_eps: float = 1e-6, projection: str = "qkvz",
                 activation: str = "silu", chunk_size: int = 64, checks_position: bool = False, dtype=None, *,
                 norm_weight_in_fp32: bool = False, gate_activation: str = "silu"):
        super().__init__()
        if projection not in PROJECTIONS:
            raise ValueError(f"projection must be one of {list(PROJECTIONS)}, got {projection!r}")
        if activation not in _ACTIVATIONS:
            raise ValueError(f"config field 'hidden_act' must be one of {sorted(_ACTIVATIONS)} for linear attention, "
                             f"got {activation!r}")
        if num_v_heads % num_k_heads:
            raise ValueError(f"config field 'linear_num_value_heads' ({num_v_heads}) must be a multiple of "
                             f"'linear_num_key_heads' ({num_k_heads})")
        if conv_kernel < 1:
            raise ValueError(f"config field 'linear_conv_kernel_dim' must be >= 1, got {conv_kernel}")
        self.layer_idx, self.projection, self.chunk_size = layer_idx, projection, chunk_size
        self.checks_position = checks_position
        self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim = num_k_heads, num_v_heads, head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel, self.activation = conv_kernel, activation
        kw = dict(bias=False, dtype=dtype)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim,
                                padding=conv_kernel - 1, **kw)
        if projection == "qkvz":
            self.in_proj_qkvz = nn.Linear(hidden_size, 2 * self.key_dim + 2 * self.value_dim, **kw)
            self.in_proj_ba = nn.Linear(hidden_size, 2 * num_v_heads, **kw)
        else:
            self.in_proj_qkv = nn.Linear(hidden_size, self.conv_dim, **kw)
            self.in_proj_z = nn.Linear(hidden_size, self.value_dim, **kw)
            self.in_proj_b = nn.Linear(hidden_size, num_v_heads, **kw)
            self.in_proj_a = nn.Linear(hidden_size, num_v_heads, **kw)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads, dtype=dtype))
        self.A_log = nn.Parameter(torch.zeros(num_v_heads, dtype=dtype))
        self.norm = GatedRMSNorm(head_v_dim, norm_eps, dtype=dtype, weight_in_fp32=norm_weight_in_fp32,
                                 activation=gate_activation)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, **kw)

    def extra_repr(self) -> str:
        return (f"layer={self.layer_idx}, key_heads={self.num_k_heads}, value_heads={self.num_v_heads}, "
                f"head_k_dim={self.head_k_dim}, head_v_dim={self.head_v_dim}, conv={self.conv_kernel}, "
                f"projection={self.projection!r}")

    def _project(self, x_BTD: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(q|k|v [B, T, C] in conv channel order, z [B, T, H, v], b [B, T, H], a [B, T, H])."""
        B, T, _ = x_BTD.shape
        Hk, H, dk, dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        if self.projection == "split":
            return (self.in_proj_qkv(x_BTD), self.in_proj_z(x_BTD).view(B, T, H, dv), self.in_proj_b(x_BTD),
                    self.in_proj_a(x_BTD))
        r = H // Hk  # per key head on disk: [q (k) | k (k) | v (r * v) | z (r * v)], and [b (r) | a (r)]
        qkvz = self.in_proj_qkvz(x_BTD).view(B, T, Hk, 2 * dk + 2 * r * dv)
        q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=-1)
        b, a = self.in_proj_ba(x_BTD).view(B, T, Hk, 2 * r).split([r, r], dim=-1)
        qkv = torch.cat([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], dim=-1)
        return qkv, z.reshape(B, T, H, dv), b.reshape(B, T, H), a.reshape(B, T, H)

    def forward(self, x_BTD: Tensor, positions_BT: Tensor, cache: KVCache | None = None, slots: Tensor | None = None,
                kv_len: int | None = None) -> Tensor:
        B, T, _ = x_BTD.shape
        Hk, H, dk, dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        qkv, z, b, a = self._project(x_BTD)
        conv_state = state = None
        if cache is not None:
            conv_buf, state_buf, conv_state, state = slot_states(
                cache, self.layer_idx, slots, positions_BT, T, (self.conv_dim, self.conv_kernel - 1), (H, dk, dv),
                self.checks_position)
        # speculative verification: the state after every token, so that rejected drafts can be cut off
        history = cache is not None and cache.keeps_history
        weight = self.conv1d.weight.squeeze(1)
        x_BCT = qkv.transpose(1, 2).to(weight.dtype)
        if history:
            record_conv_windows(cache, self.layer_idx, "conv_state", slots, conv_state, x_BCT)
        y, conv_state = causal_conv1d(x_BCT, weight, conv_state)
        qkv = _ACTIVATIONS[self.activation](y).to(x_BTD.dtype).transpose(1, 2)  # [B, T, C]
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = l2norm(q.reshape(B, T, Hk, dk).float()) * dk ** -0.5
        k = l2norm(k.reshape(B, T, Hk, dk).float())
        if H != Hk:
            q, k = q.repeat_interleave(H // Hk, dim=2), k.repeat_interleave(H // Hk, dim=2)
        v = v.reshape(B, T, H, dv)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        if history:   # (a few tokens: the recurrence, as decoding runs it)
            o, states = gated_delta_rule_recurrent(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                   g.transpose(1, 2), beta.transpose(1, 2), state, every_state=True)
            cache.record(self.layer_idx, "recurrent_state", slots, states)
            state = states[:, -1]
        else:
            o, state = gated_delta_rule(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), g.transpose(1, 2),
                                        beta.transpose(1, 2), state, self.chunk_size)
        if cache is not None:
            conv_buf[slots] = conv_state.to(conv_buf.dtype)
            state_buf[slots] = state
        o = self.norm(o.transpose(1, 2).to(x_BTD.dtype), z)  # [B, T, H, v]
        return self.out_proj(o.reshape(B, T, H * dv))
