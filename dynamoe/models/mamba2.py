"""Mamba-2 state-space layers (GraniteMoE-Hybrid, Nemotron-H): a causal depthwise conv over x, B and C, then
the SSD recurrence -- a scalar decay per head -- with a fixed-size state per sequence instead of a KV cache.

Legend: B batch rows, T new tokens, D model dim, I inner channels (H heads x P head dim), H heads, P head dim,
G groups (heads share B and C by group: H / G heads each), N state size, W conv window (kernel - 1 past
inputs), n chunks, L chunk length.

The SSD recurrence, per head with state S [P, N] (zero at a sequence's first token), for each token t:

    dt_t = clamp(softplus(dt_raw_t + dt_bias), time_step_limit)   (a step size per head)
    S = exp(dt_t A) S + dt_t x_t B_t^T                            (A = -exp(A_log) < 0, one per head)
    y_t = S C_t + D x_t

The layer's output is out_proj(gated_group_rmsnorm(y, z)): y * silu(z), RMS-normalised per group of I / G
channels, times the norm's weight.

:func:`ssd_recurrent` runs it token by token (decode, and the reference); :func:`ssd_chunked` computes the
same L tokens at a time (prefill): with g_t = dt_t A and Gc its cumulative sum inside a chunk, the chunk's
outputs are one masked matmul, y_t = sum_{s<=t} exp(Gc_t - Gc_s) (C_t . B_s) dt_s x_s + exp(Gc_t) S0 C_t,
and only the chunk-to-chunk state S_end = exp(Gc_L) S0 + sum_s exp(Gc_L - Gc_s) dt_s x_s B_s^T is
sequential (the decays are exponentials of differences, never quotients). Both are plain torch in fp32
(fp64 for fp64 inputs) and equal to rounding (tests/test_models_granitemoehybrid.py).

transformers' reference clamps dt to ``time_step_limit`` in its prefill path only (its one-token update
has no clamp); here both paths clamp, so decode continues the prefill's recurrence exactly (the default
limit (0, inf) clamps nothing).

With a :class:`~dynamoe.models.cache.KVCache`, each layer keeps per slot its conv window (``"conv_state"``
[I + 2 G N, W], the cache's dtype) and its state (``"recurrent_state"``, fp32 [H, P, N]), as
:mod:`dynamoe.models.mamba`'s Mamba-1 layers do (:func:`dynamoe.models.linear_attention.slot_states`), recording
both after every token of a speculative verification forward (:func:`ssd_recurrent`) so that rejected drafts can
be cut off.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .cache import KVCache
from .linear_attention import record_conv_windows, slot_states
from .mamba import ACTIVATIONS, conv_with_state

__all__ = ["Mamba2Mixer", "GroupGatedRMSNorm", "ssd", "ssd_recurrent", "ssd_chunked"]


def _compute_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _per_head(B_: Tensor, H: int) -> Tensor:
    """B or C [B, T, G, N] -> [B, H, T, N] (each group's to its H / G heads)."""
    return B_.repeat_interleave(H // B_.size(2), dim=2).transpose(1, 2)


def ssd_recurrent(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                  state: Tensor | None = None, every_state: bool = False) -> tuple[Tensor, Tensor]:
    """Token by token. x [B, T, H, P], dt [B, T, H] (after bias, softplus and clamp), A [H], B, C [B, T, G, N],
    state [B, H, P, N] (None: zeros). Returns (y [B, T, H, P] without the D skip, final state) in fp32 (fp64 for
    fp64 inputs); with ``every_state``, the state after each token [B, T, H, P, N] in place of the final one (what
    rolling back to any of them needs)."""
    ct = _compute_dtype(x)
    Bn, T, H, P = x.shape
    x, dt, A = x.to(ct).transpose(1, 2), dt.to(ct).transpose(1, 2), A.to(ct)   # [B, H, T, P], [B, H, T]
    Bh, Ch = _per_head(B.to(ct), H), _per_head(C.to(ct), H)                      # [B, H, T, N]
    S = x.new_zeros(Bn, H, P, B.size(-1)) if state is None else state.to(ct)
    ys, states = [], []
    for t in range(T):
        d = dt[:, :, t, None, None]                                             # [B, H, 1, 1]
        S = torch.exp(d * A[:, None, None]) * S + (d * x[:, :, t, :, None]) * Bh[:, :, t, None, :]
        ys.append(S @ Ch[:, :, t, :, None])                                     # [B, H, P, 1]
        if every_state:
            states.append(S)
    y = torch.cat(ys, dim=-1).permute(0, 3, 1, 2) if ys else x.new_zeros(Bn, 0, H, P)
    if every_state:
        return y, torch.stack(states, dim=1) if states else S.new_zeros(Bn, 0, *S.shape[1:])
    return y, S


def ssd_chunked(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, state: Tensor | None = None,
                chunk_size: int = 256) -> tuple[Tensor, Tensor]:
    """The same as :func:`ssd_recurrent`, ``chunk_size`` tokens at a time (see the module docstring)."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    ct = _compute_dtype(x)
    Bn, T, H, P = x.shape
    N, L = B.size(-1), chunk_size
    pad = (-T) % L
    x, dt = x.to(ct).transpose(1, 2), dt.to(ct).transpose(1, 2)                 # [B, H, T, P], [B, H, T]
    Bh, Ch = _per_head(B.to(ct), H), _per_head(C.to(ct), H)
    xdt = x * dt[..., None]
    g = dt * A.to(ct)[:, None]                                                  # log decay per token, [B, H, T]
    if pad:  # padded tokens: g = 0 (no decay) and no input, so the state passes through them
        xdt, Bh, Ch = (F.pad(t, (0, 0, 0, pad)) for t in (xdt, Bh, Ch))
        g = F.pad(g, (0, pad))
    n = (T + pad) // L
    xdt, Bh, Ch = (t.reshape(Bn, H, n, L, -1) for t in (xdt, Bh, Ch))
    Gc = g.reshape(Bn, H, n, L).cumsum(-1)                                      # [B, H, n, L]
    causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
    decay = (Gc[..., :, None] - Gc[..., None, :]).masked_fill(~causal, float("-inf")).exp()   # [.., t, s]
    y_in = ((Ch @ Bh.transpose(-1, -2)) * decay) @ xdt                          # within the chunk, [B, H, n, L, P]
    to_end = (Gc[..., -1:] - Gc).exp()[..., None]                               # [B, H, n, L, 1]
    S = x.new_zeros(Bn, H, P, N) if state is None else state.to(ct)
    ys = []
    for i in range(n):
        ys.append(y_in[:, :, i] + Gc[:, :, i, :, None].exp() * (Ch[:, :, i] @ S.transpose(-1, -2)))
        S = Gc[:, :, i, -1, None, None].exp() * S + (xdt[:, :, i] * to_end[:, :, i]).transpose(-1, -2) @ Bh[:, :, i]
    y = torch.cat(ys, dim=2)[:, :, :T] if ys else x.new_zeros(Bn, H, 0, P)
    return y.transpose(1, 2), S


def ssd(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, state: Tensor | None = None,
        chunk_size: int = 256) -> tuple[Tensor, Tensor]:
    """The recurrent form for one token (decode), the chunked one otherwise (same arguments)."""
    if x.size(1) == 1:
        return ssd_recurrent(x, dt, A, B, C, state)
    return ssd_chunked(x, dt, A, B, C, state, chunk_size)


class GroupGatedRMSNorm(nn.Module):
    """Mamba-2's output norm: h = x * silu(z) in fp32, RMS-normalised over each of ``groups`` groups of its
    channels, then ``weight`` * h in fp32, cast to x's dtype (the mixer passes its fp32 scan output).
    ``forward(x [..., I], z [..., I]) -> [..., I]``."""

    def __init__(self, dim: int, groups: int, eps: float = 1e-6, dtype=None):
        super().__init__()
        if dim % groups:
            raise ValueError(f"the norm's width {dim} must be a multiple of its groups ({groups})")
        self.groups, self.eps = groups, eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: Tensor, z: Tensor) -> Tensor:
        h = x.float() * F.silu(z.float())
        hg = h.view(*h.shape[:-1], self.groups, -1)
        hg = hg * torch.rsqrt(hg.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * hg.view(h.shape)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, groups={self.groups}, eps={self.eps}"


class Mamba2Mixer(nn.Module):
    """One Mamba-2 token mixer (Hugging Face's ``mamba`` / ``mixer``): ``in_proj`` [I + (I + 2 G N) + H, D] ->
    z | xBC | dt; causal conv (``conv1d``, optional bias) + activation over xBC -> x | B | C; the SSD recurrence
    with ``A_log``, ``dt_bias``, ``D`` (one each per head); ``norm`` (:class:`GroupGatedRMSNorm` with z);
    ``out_proj``.

    ``forward(x [B, T, D], positions [B, T], cache=None, slots=None, kv_len=None) -> [B, T, D]``: with a
    cache, row b continues slot ``slots[b]``'s state, or starts from zero where ``positions[b, 0] == 0``."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, state_size: int, n_groups: int,
                 conv_kernel: int, layer_idx: int, norm_eps: float = 1e-6, conv_bias: bool = True,
                 proj_bias: bool = False, activation: str = "silu", chunk_size: int = 256,
                 time_step_limit: tuple = (0.0, math.inf), checks_position: bool = False, dtype=None):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"config field 'hidden_act' must be one of {sorted(ACTIVATIONS)} for a Mamba-2 layer's "
                             f"conv, got {activation!r}")
        if num_heads % n_groups:
            raise ValueError(f"the Mamba heads ({num_heads}) must be a multiple of its groups (n_groups={n_groups})")
        H, P, N, G = num_heads, head_dim, state_size, n_groups
        I = H * P
        self.layer_idx, self.num_heads, self.head_dim, self.state_size, self.n_groups = layer_idx, H, P, N, G
        self.intermediate_size, self.conv_dim = I, I + 2 * G * N
        self.conv_kernel, self.activation, self.chunk_size = conv_kernel, activation, chunk_size
        self.time_step_limit, self.checks_position = tuple(time_step_limit), checks_position
        self.in_proj = nn.Linear(hidden_size, I + self.conv_dim + H, bias=proj_bias, dtype=dtype)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim,
                                padding=conv_kernel - 1, bias=conv_bias, dtype=dtype)
        self.dt_bias = nn.Parameter(torch.ones(H, dtype=dtype))
        self.A_log = nn.Parameter(torch.zeros(H, dtype=dtype))
        self.D = nn.Parameter(torch.ones(H, dtype=dtype))
        self.norm = GroupGatedRMSNorm(I, G, norm_eps, dtype=dtype)
        self.out_proj = nn.Linear(I, hidden_size, bias=proj_bias, dtype=dtype)

    def extra_repr(self) -> str:
        return (f"layer={self.layer_idx}, heads={self.num_heads}, head_dim={self.head_dim}, state={self.state_size}, "
                f"groups={self.n_groups}, conv={self.conv_kernel}, time_step_limit={self.time_step_limit}")

    def forward(self, x_BTD: Tensor, positions_BT: Tensor, cache: KVCache | None = None, slots: Tensor | None = None,
                kv_len: int | None = None) -> Tensor:
        Bn, T, _ = x_BTD.shape
        H, P, N, G, I = self.num_heads, self.head_dim, self.state_size, self.n_groups, self.intermediate_size
        z, xBC, dt = self.in_proj(x_BTD).split([I, self.conv_dim, H], dim=-1)
        conv_state = state = None
        if cache is not None:
            conv_buf, state_buf, conv_state, state = slot_states(
                cache, self.layer_idx, slots, positions_BT, T, (self.conv_dim, self.conv_kernel - 1), (H, P, N),
                self.checks_position)
        # speculative verification: the state after every token, so that rejected drafts can be cut off
        history = cache is not None and cache.keeps_history
        if history:
            record_conv_windows(cache, self.layer_idx, "conv_state", slots, conv_state,
                                xBC.transpose(1, 2).to(self.conv1d.weight.dtype))
        y, conv_state = conv_with_state(xBC.transpose(1, 2), self.conv1d, conv_state)
        xBC = ACTIVATIONS[self.activation](y).to(x_BTD.dtype).transpose(1, 2)    # [B, T, conv_dim]
        x, B_, C_ = xBC.split([I, G * N, G * N], dim=-1)
        lo, hi = self.time_step_limit
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(min=lo, max=hi)  # [B, T, H]
        A = -torch.exp(self.A_log.float())
        x = x.reshape(Bn, T, H, P)
        if history:   # (a few tokens: the recurrence, as decoding runs it)
            y, states = ssd_recurrent(x, dt, A, B_.reshape(Bn, T, G, N), C_.reshape(Bn, T, G, N), state,
                                      every_state=True)
            cache.record(self.layer_idx, "recurrent_state", slots, states)
            state = states[:, -1]
        else:
            y, state = ssd(x, dt, A, B_.reshape(Bn, T, G, N), C_.reshape(Bn, T, G, N), state, self.chunk_size)
        if cache is not None:
            conv_buf[slots] = conv_state.to(conv_buf.dtype)
            state_buf[slots] = state.float()
        y = y + x.to(y.dtype) * self.D.to(y.dtype)[:, None]                       # [B, T, H, P]
        return self.out_proj(self.norm(y.reshape(Bn, T, I), z).to(x_BTD.dtype))
