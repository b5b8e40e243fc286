"""Kimi Delta Attention (KDA, Kimi-Linear's linear-attention layers): the gated delta rule of
:mod:`dynamoe.models.linear_attention` with a decay per key channel instead of one per head.

Legend: B batch rows, T tokens, H heads, k key head dim, v value head dim (k = v = ``linear_head_dim``),
C = H k channels of each of q, k, v, D model dim, n chunks, N chunk length.

Per head, with state S [k, v] (zero at a sequence's first token) and g_t [k] <= 0:

    S = diag(exp(g_t)) S                 (decay, one rate per key channel)
    u = beta_t * (v_t - S^T k_t)
    S = S + k_t u^T
    o_t = S^T q_t

:func:`kda_recurrent` runs it token by token (decode, and the reference); :func:`kda_chunked` computes
the same N tokens at a time (prefill). Within a chunk, with G the cumulative sum of g (per channel)
and r(t, s) = exp(G_t - G_s) [k] for s <= t, the writes solve (I + A) u = beta v - beta (k * exp(G)) S0,
A[t, s] = beta_t sum_c k_tc k_sc r(t, s)_c for s < t; o_t = (q_t * exp(G_t)) S0 + sum_{s<=t}
(sum_c q_tc k_sc r(t, s)_c) u_s; the end state is diag(exp(G_N)) S0 + sum_s diag(exp(G_N - G_s)) k_s u_s^T.
Only exponentials of differences that are <= 0 are taken (never a quotient), so nothing overflows;
the [N, N, k] ratios are built one chunk at a time (memory B H N^2 k per chunk, not per sequence).

The layer (:class:`KimiDeltaAttention`): q/k/v projections, a short causal conv + SiLU on each
(``q_conv1d``, ``k_conv1d``, ``v_conv1d``), L2-normed q and k (q also scaled by k^-1/2), beta =
sigmoid(``b_proj``(x)), g = -exp(``A_log``) * softplus(``f_b_proj``(``f_a_proj``(x)) + ``dt_bias``),
the rule above, then ``o_norm`` -- RMSNorm in fp32 times sigmoid(``g_b_proj``(``g_a_proj``(x))) -- and
``o_proj``. Its cache use (conv window and fp32 state per slot, read as zero where a row starts at
position 0, no prefix reuse) is :func:`~dynamoe.models.linear_attention.slot_states`'; while the cache keeps a
history (speculative decoding's verification forward), the layer runs :func:`kda_recurrent` and records its conv
window and state after every token, so that cutting rejected drafts off rolls them back.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .cache import KVCache
from .linear_attention import causal_conv1d, l2norm, record_conv_windows, slot_states

__all__ = ["KimiDeltaAttention", "SigmoidGatedRMSNorm", "kda", "kda_recurrent", "kda_chunked"]


def _compute_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def kda_recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                  state: Tensor | None = None, every_state: bool = False) -> tuple[Tensor, Tensor]:
    """Token by token. q, k [B, H, T, k] (already normalised and scaled), v [B, H, T, v], g (log decay)
    [B, H, T, k], beta [B, H, T], state [B, H, k, v] (None: zeros). Returns (o [B, H, T, v], final
    state) in fp32 (fp64 for fp64 inputs); with ``every_state``, the state after each token [B, T, H, k, v] in
    place of the final one (what rolling back to any of them needs)."""
    dt = _compute_dtype(q)
    q, k, v, g, beta = (t.to(dt) for t in (q, k, v, g, beta))
    B, H, T, dk = k.shape
    S = q.new_zeros(B, H, dk, v.size(-1)) if state is None else state.to(dt)
    out, states = [], []
    for t in range(T):
        S = S * g[:, :, t].exp()[..., None]
        u = beta[:, :, t, None] * (v[:, :, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, :, t]))
        S = S + k[:, :, t, :, None] * u[:, :, None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", S, q[:, :, t]))
        if every_state:
            states.append(S)
    return torch.stack(out, dim=2), (torch.stack(states, dim=1) if every_state else S)


def kda_chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None = None,
                chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    """The same as :func:`kda_recurrent`, N = ``chunk_size`` tokens at a time (see the module docstring)."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    dt = _compute_dtype(q)
    q, k, v, g, beta = (t.to(dt) for t in (q, k, v, g, beta))
    B, H, T, dk = k.shape
    dv = v.size(-1)
    N = chunk_size
    pad = (-T) % N
    if pad:  # padded tokens have beta = 0 (no write) and g = 0 (no decay): the state passes through them
        q, k, v, g = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    n = (T + pad) // N
    q, k, v, g = (t.reshape(B, H, n, N, -1) for t in (q, k, v, g))
    beta = beta.reshape(B, H, n, N)
    G = g.cumsum(-2)                                                           # [B, H, n, N, k]
    later = ~torch.ones(N, N, dtype=torch.bool, device=q.device).tril()       # s > t
    eye = torch.eye(N, dtype=dt, device=q.device)
    S = q.new_zeros(B, H, dk, dv) if state is None else state.to(dt)
    out = []
    for i in range(n):
        qi, ki, vi, Gi, bi = q[:, :, i], k[:, :, i], v[:, :, i], G[:, :, i], beta[:, :, i]
        ratio = (Gi[..., :, None, :] - Gi[..., None, :, :]).masked_fill(later[..., None], float("-inf")).exp()
        k_ts = ratio * ki[..., None, :, :]                                    # [B, H, t, s, k]: r(t, s) * k_s
        kb = ki * bi[..., None]
        lower = eye + torch.einsum("bhtc,bhtsc->bhts", kb, k_ts).tril(-1)
        rhs = vi * bi[..., None] - (kb * Gi.exp()) @ S
        u = torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)
        attn = torch.einsum("bhtc,bhtsc->bhts", qi, k_ts)                     # s <= t (ratio is 0 above)
        out.append((qi * Gi.exp()) @ S + attn @ u)
        S = S * Gi[:, :, -1].exp()[..., None] + (ki * (Gi[:, :, -1:] - Gi).exp()).transpose(-1, -2) @ u
    return torch.cat(out, dim=2)[:, :, :T], S


def kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None = None,
        chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    """The recurrent form for one token (decode), the chunked one otherwise (same arguments)."""
    if q.size(2) == 1:
        return kda_recurrent(q, k, v, g, beta, state)
    return kda_chunked(q, k, v, g, beta, state, chunk_size)


class SigmoidGatedRMSNorm(nn.Module):
    """y = weight * x / rms(x) * sigmoid(gate), all in fp32, cast to x's dtype (KDA's ``o_norm``; the
    weight is a plain scale). ``forward(x [..., d], gate [..., d]) -> [..., d]``."""

    def __init__(self, dim: int, eps: float = 1e-6, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h * torch.sigmoid(gate.float())).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class KimiDeltaAttention(nn.Module):
    """One KDA token mixer (see the module docstring), with the checkpoint's names.

    ``forward(x [B, T, D], positions [B, T], cache=None, slots=None, kv_len=None) -> [B, T, D]``: with a
    cache, row b continues slot ``slots[b]``'s state, or starts from zero where ``positions[b, 0] == 0``.

    ``gate_lower_bound`` b (GLM-5.3's "safe gate"): the decay is g = b * sigmoid(exp(A_log) * (f_b(f_a(x)) +
    dt_bias)), in (b, 0), instead of -exp(A_log) * softplus(...). ``a_log_shape``: how the checkpoint stores
    ``A_log`` (Kimi-Linear: [1, 1, H, 1]; GLM-5.3: [H]).
    """

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, conv_kernel: int, layer_idx: int,
                 norm_eps: float = 1e-6, activation: str = "silu", chunk_size: int = 64,
                 checks_position: bool = False, *, gate_lower_bound: float | None = None,
                 a_log_shape: tuple | None = None, dtype=None):
        super().__init__()
        if activation not in ("silu", "swish"):
            raise ValueError(f"config field 'hidden_act' must be 'silu' or 'swish' for Kimi Delta Attention, "
                             f"got {activation!r}")
        if conv_kernel < 1:
            raise ValueError(f"config field 'linear_conv_kernel_dim' must be >= 1, got {conv_kernel}")
        self.layer_idx, self.chunk_size, self.checks_position = layer_idx, chunk_size, checks_position
        self.num_heads, self.head_dim, self.conv_kernel = num_heads, head_dim, conv_kernel
        C = num_heads * head_dim
        self.channels = C
        kw = dict(bias=False, dtype=dtype)
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(hidden_size, C, **kw) for _ in range(3))
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (
            nn.Conv1d(C, C, conv_kernel, groups=C, padding=conv_kernel - 1, **kw) for _ in range(3))
        self.f_a_proj = nn.Linear(hidden_size, head_dim, **kw)
        self.f_b_proj = nn.Linear(head_dim, C, **kw)
        # fp32 whatever the model's dtype (as transformers keeps it): it sets the decay rates
        self.dt_bias = nn.Parameter(torch.zeros(C, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.zeros(*(a_log_shape or (1, 1, num_heads, 1)), dtype=dtype))
        if self.A_log.numel() != num_heads:
            raise ValueError(f"a_log_shape {a_log_shape} must hold one value per head ({num_heads})")
        self.gate_lower_bound = gate_lower_bound
        self.b_proj = nn.Linear(hidden_size, num_heads, **kw)
        self.g_a_proj = nn.Linear(hidden_size, head_dim, **kw)
        self.g_b_proj = nn.Linear(head_dim, C, **kw)
        self.o_norm = SigmoidGatedRMSNorm(head_dim, norm_eps, dtype=dtype)
        self.o_proj = nn.Linear(C, hidden_size, **kw)

    def extra_repr(self) -> str:
        return f"layer={self.layer_idx}, heads={self.num_heads}, head_dim={self.head_dim}, conv={self.conv_kernel}"

    def conv_weight(self) -> Tensor:
        """The q, k and v convs' weights as one [3 C, K] (the conv runs in their dtype)."""
        return torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight]).squeeze(1)

    def output_gate(self, x_BTD: Tensor) -> Tensor:
        """The o_norm's gate before its sigmoid, [B, T, C]: g_b(g_a(x))."""
        return self.g_b_proj(self.g_a_proj(x_BTD))

    def decay(self, x_BTD: Tensor) -> Tensor:
        """g = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias) (or the bounded form, see the class), fp32 [B, T, H, k]."""
        B, T, _ = x_BTD.shape
        f = (self.f_b_proj(self.f_a_proj(x_BTD)).float() + self.dt_bias.float()).view(B, T, self.num_heads, -1)
        rate = self.A_log.float().view(1, 1, self.num_heads, 1).exp()
        if self.gate_lower_bound is not None:
            return self.gate_lower_bound * torch.sigmoid(rate * f)
        return -rate * F.softplus(f)

    def forward(self, x_BTD: Tensor, positions_BT: Tensor, cache: KVCache | None = None, slots: Tensor | None = None,
                kv_len: int | None = None) -> Tensor:
        B, T, _ = x_BTD.shape
        H, d, C = self.num_heads, self.head_dim, self.channels
        qkv = torch.cat([self.q_proj(x_BTD), self.k_proj(x_BTD), self.v_proj(x_BTD)], dim=-1)  # [B, T, 3C]
        conv_state = state = None
        if cache is not None:
            conv_buf, state_buf, conv_state, state = slot_states(
                cache, self.layer_idx, slots, positions_BT, T, (3 * C, self.conv_kernel - 1), (H, d, d),
                self.checks_position)
        # speculative verification: the state after every token, so that rejected drafts can be cut off
        history = cache is not None and cache.keeps_history
        weight = self.conv_weight()
        x_BCT = qkv.transpose(1, 2).to(weight.dtype)
        if history:
            record_conv_windows(cache, self.layer_idx, "conv_state", slots, conv_state, x_BCT)
        y, conv_state = causal_conv1d(x_BCT, weight, conv_state)
        q, k, v = F.silu(y).to(x_BTD.dtype).transpose(1, 2).split([C, C, C], dim=-1)  # [B, T, C] each
        q = l2norm(q.reshape(B, T, H, d).float()) * d ** -0.5
        k = l2norm(k.reshape(B, T, H, d).float())
        v = v.reshape(B, T, H, d)
        beta = torch.sigmoid(self.b_proj(x_BTD))
        g = self.decay(x_BTD)
        q, k, v, g, beta = (t.transpose(1, 2) for t in (q, k, v, g, beta))
        if history:   # (a few tokens: the recurrence, as decoding runs it)
            o, states = kda_recurrent(q, k, v, g, beta, state, every_state=True)
            cache.record(self.layer_idx, "recurrent_state", slots, states)
            state = states[:, -1]
        else:
            o, state = kda(q, k, v, g, beta, state, self.chunk_size)
        if cache is not None:
            conv_buf[slots] = conv_state.to(conv_buf.dtype)
            state_buf[slots] = state
        gate = self.output_gate(x_BTD).view(B, T, H, d)
        o = self.o_norm(o.transpose(1, 2).to(x_BTD.dtype), gate)                  # [B, T, H, d]
        return self.o_proj(o.reshape(B, T, C))
