"""Mamba-1 state-space layers (Jamba): a causal depthwise conv over the inner stream, then the selective
scan -- a fixed-size recurrent state per sequence instead of a KV cache.

Legend: B batch rows, T new tokens, D model dim, I inner channels (expand x D), N state size per channel,
R the time step's rank, W conv window (kernel - 1 past inputs), L scan chunk length.

The selective scan, per channel i with state h [N] (zero at a sequence's first token), for each token t:

    dt_t = softplus(dt_proj(dt_low_t))                    (dt [I]: the step size, per channel)
    h = exp(dt_t[i] * A[i]) * h + dt_t[i] * B_t * x_t[i]  (A [I, N] = -exp(A_log): a decay per state entry)
    y_t[i] = C_t . h + D[i] * x_t[i]

with B_t, C_t [N] shared by the channels (Jamba RMS-normalises dt_low, B and C first). The layer's output is
out_proj(y * silu(z)), z the gate half of in_proj.

:func:`selective_scan_recurrent` runs it token by token (decode, and the reference);
:func:`selective_scan_chunked` computes the same for a prefill, L tokens at a time: the chunk's decays
a_t = exp(dt_t A) and inputs b_t = dt_t x_t B_t at once, then the linear recurrence h_t = a_t h_{t-1} + b_t
either as an associative scan (``parallel``: log2 L doubling steps over the whole chunk, each composing every
prefix with the one 2^k before it -- what an accelerator wants) or as one fused multiply-add per token (on the
CPU, where that is the least work: on 2 threads, I = 256-4096, N = 16, T = 256-2048, best of 3, it took 0.5-0.85x
the token-by-token form's time and 0.4-0.65x the doubling steps'), then the outputs C_t . h_t of the chunk in one
contraction. All are plain torch in fp32
(fp64 for fp64 inputs) and equal to rounding (tests/test_models_jamba.py). Each chunk materialises [B, I, L, N]
decays: ``chunk_size`` bounds the memory.

With a :class:`~dynamoe.models.cache.KVCache`, each layer keeps per slot its conv window
(``cache.buffer(layer, "conv_state", I, W)``, the cache's dtype) and its state (``"recurrent_state"``,
fp32 [I, N]), read as zero for a row whose first position is 0 and continued exactly across chunked
prefill and decode; the model's first Mamba layer checks that every row continues its slot where the state
stopped (see :func:`dynamoe.models.linear_attention.slot_states`). While the cache keeps a history (speculative
decoding's verification forward), the layer runs :func:`selective_scan_recurrent` and records its conv window and
state after every token, so that cutting rejected drafts off rolls them back.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .cache import KVCache
from .linear_attention import causal_conv1d, record_conv_windows, slot_states
from .norms import RMSNorm

__all__ = ["MambaMixer", "MixerDecoderLayer", "selective_scan", "selective_scan_recurrent", "selective_scan_chunked",
           "conv_with_state", "ACTIVATIONS"]

#: the conv's activation (config ``hidden_act`` / ``mamba_hidden_act``)
ACTIVATIONS = {"silu": F.silu, "swish": F.silu}


def _compute_dtype(t: Tensor) -> torch.dtype:
    """fp32, or fp64 for fp64 inputs (the exactness tests)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def selective_scan_recurrent(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                             state: Tensor | None = None, every_state: bool = False) -> tuple[Tensor, Tensor]:
    """Token by token. x, dt [B, I, T] (dt already through its bias and softplus), A [I, N], B, C [B, T, N],
    state [B, I, N] (None: zeros). Returns (y [B, I, T] without the D skip, final state) in fp32 (fp64 for
    fp64 inputs); with ``every_state``, the state after each token [B, T, I, N] in place of the final one (what
    rolling back to any of them needs)."""
    ct = _compute_dtype(x)
    x, dt, A, B, C = (t.to(ct) for t in (x, dt, A, B, C))
    h = x.new_zeros(x.size(0), x.size(1), A.size(-1)) if state is None else state.to(ct)
    ys, states = [], []
    for t in range(x.size(-1)):
        d = dt[:, :, t, None]                                               # [B, I, 1]
        h = torch.exp(d * A) * h + (d * x[:, :, t, None]) * B[:, None, t]
        ys.append(torch.einsum("bin,bn->bi", h, C[:, t]))
        if every_state:
            states.append(h)
    return torch.stack(ys, dim=-1), (torch.stack(states, dim=1) if every_state else h)


def selective_scan_chunked(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, state: Tensor | None = None,
                           chunk_size: int = 64, parallel: bool | None = None) -> tuple[Tensor, Tensor]:
    """The same as :func:`selective_scan_recurrent`, ``chunk_size`` tokens at a time (see the module
    docstring). ``parallel``: the doubling scan inside a chunk (after it a_t holds the product of the decays
    since the chunk's start and b_t the state reached from zero, so h_t = a_t h_0 + b_t), else a sweep of one
    multiply-add per token; None: the doubling scan off the CPU only."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    ct = _compute_dtype(x)
    x, dt, A, B, C = (t.to(ct) for t in (x, dt, A, B, C))
    Bn, I, T = x.shape
    if parallel is None:
        parallel = x.device.type != "cpu"
    h = x.new_zeros(Bn, I, A.size(-1)) if state is None else state.to(ct)
    ys = []
    for s in range(0, T, chunk_size):
        e = min(s + chunk_size, T)
        d = dt[:, :, s:e, None]                                             # [B, I, L, 1]
        a = torch.exp(d * A[:, None])                                       # [B, I, L, N]
        b = d * x[:, :, s:e, None] * B[:, None, s:e]
        if parallel:
            step = 1
            while step < e - s:  # Hillis-Steele: compose each prefix with the one `step` tokens before it
                b = torch.cat([b[:, :, :step], a[:, :, step:] * b[:, :, :-step] + b[:, :, step:]], dim=2)
                a = torch.cat([a[:, :, :step], a[:, :, step:] * a[:, :, :-step]], dim=2)
                step *= 2
            hs = a * h[:, :, None] + b                                      # the state after each token
        else:
            hs = torch.empty_like(a)
            for t in range(e - s):
                h = torch.addcmul(b[:, :, t], a[:, :, t], h)
                hs[:, :, t] = h
        ys.append(torch.einsum("bitn,btn->bit", hs, C[:, s:e]))
        h = hs[:, :, -1]
    y = torch.cat(ys, dim=-1) if ys else x.new_zeros(Bn, I, 0)
    return y, h


def selective_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, state: Tensor | None = None,
                   chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    """The recurrent form for one token (decode), the chunked one otherwise (same arguments)."""
    if x.size(-1) == 1:
        return selective_scan_recurrent(x, dt, A, B, C, state)
    return selective_scan_chunked(x, dt, A, B, C, state, chunk_size)


def conv_with_state(x_BCT: Tensor, conv: nn.Conv1d, state_BCW: Tensor | None) -> tuple[Tensor, Tensor]:
    """The layer's causal depthwise conv (weight [C, 1, K], optional bias) over x continuing from ``state``
    (the W = K - 1 inputs before x; None: zeros). Returns (y [B, C, T] in the conv weight's dtype, next state)."""
    weight = conv.weight.squeeze(1)
    y, state = causal_conv1d(x_BCT.to(weight.dtype), weight, state_BCW)
    if conv.bias is not None:
        y = y + conv.bias[:, None]
    return y, state


class MambaMixer(nn.Module):
    """One Mamba-1 token mixer (Hugging Face's ``mamba``): ``in_proj`` [2 I, D] -> x | z; causal conv
    (``conv1d``, bias) + activation over x; ``x_proj`` [R + 2 N, I] -> dt_low | B | C (Jamba: each through its
    RMSNorm, ``dt_layernorm`` / ``b_layernorm`` / ``c_layernorm``); dt = softplus(``dt_proj``(dt_low));
    the selective scan with A = -exp(``A_log``) and the skip ``D``; out_proj(y * silu(z)).

    ``forward(x [B, T, D], positions [B, T], cache=None, slots=None, kv_len=None) -> [B, T, D]``: with a
    cache, row b continues slot ``slots[b]``'s state, or starts from zero where ``positions[b, 0] == 0``."""

    def __init__(self, hidden_size: int, intermediate_size: int, state_size: int, conv_kernel: int, dt_rank: int,
                 layer_idx: int, conv_bias: bool = True, proj_bias: bool = False, activation: str = "silu",
                 bcdt_norm_eps: float | None = None, chunk_size: int = 64, checks_position: bool = False, dtype=None):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"config field 'hidden_act' must be one of {sorted(ACTIVATIONS)} for a Mamba layer, "
                             f"got {activation!r}")
        I, N = intermediate_size, state_size
        self.layer_idx, self.intermediate_size, self.state_size, self.dt_rank = layer_idx, I, N, dt_rank
        self.conv_kernel, self.activation, self.chunk_size = conv_kernel, activation, chunk_size
        self.checks_position = checks_position
        self.in_proj = nn.Linear(hidden_size, 2 * I, bias=proj_bias, dtype=dtype)
        self.conv1d = nn.Conv1d(I, I, conv_kernel, groups=I, padding=conv_kernel - 1, bias=conv_bias, dtype=dtype)
        self.x_proj = nn.Linear(I, dt_rank + 2 * N, bias=False, dtype=dtype)
        self.dt_proj = nn.Linear(dt_rank, I, bias=True, dtype=dtype)
        self.A_log = nn.Parameter(torch.zeros(I, N, dtype=dtype))
        self.D = nn.Parameter(torch.ones(I, dtype=dtype))
        self.out_proj = nn.Linear(I, hidden_size, bias=proj_bias, dtype=dtype)
        if bcdt_norm_eps is not None:
            self.dt_layernorm = RMSNorm(dt_rank, bcdt_norm_eps, dtype=dtype)
            self.b_layernorm = RMSNorm(N, bcdt_norm_eps, dtype=dtype)
            self.c_layernorm = RMSNorm(N, bcdt_norm_eps, dtype=dtype)
        else:
            self.dt_layernorm = self.b_layernorm = self.c_layernorm = None

    def extra_repr(self) -> str:
        return (f"layer={self.layer_idx}, inner={self.intermediate_size}, state={self.state_size}, "
                f"dt_rank={self.dt_rank}, conv={self.conv_kernel}, bcdt_norms={self.dt_layernorm is not None}")

    def forward(self, x_BTD: Tensor, positions_BT: Tensor, cache: KVCache | None = None, slots: Tensor | None = None,
                kv_len: int | None = None) -> Tensor:
        B, T, _ = x_BTD.shape
        I, N, R = self.intermediate_size, self.state_size, self.dt_rank
        x_BIT, z_BIT = self.in_proj(x_BTD).transpose(1, 2).chunk(2, dim=1)
        conv_state = state = None
        if cache is not None:
            conv_buf, state_buf, conv_state, state = slot_states(
                cache, self.layer_idx, slots, positions_BT, T, (I, self.conv_kernel - 1), (I, N), self.checks_position)
        # speculative verification: the state after every token, so that rejected drafts can be cut off
        history = cache is not None and cache.keeps_history
        if history:
            record_conv_windows(cache, self.layer_idx, "conv_state", slots, conv_state,
                                x_BIT.to(self.conv1d.weight.dtype))
        y, conv_state = conv_with_state(x_BIT, self.conv1d, conv_state)
        x_BIT = ACTIVATIONS[self.activation](y).to(x_BTD.dtype)
        dt_low, B_BTN, C_BTN = self.x_proj(x_BIT.transpose(1, 2)).split([R, N, N], dim=-1)
        if self.dt_layernorm is not None:
            dt_low, B_BTN, C_BTN = self.dt_layernorm(dt_low), self.b_layernorm(B_BTN), self.c_layernorm(C_BTN)
        # dt_proj's weight and bias apart, the bias added in fp32 before the softplus (as the reference kernels)
        dt_BIT = F.softplus((dt_low @ self.dt_proj.weight.t()).transpose(1, 2).float()
                            + self.dt_proj.bias.float()[:, None])
        A = -torch.exp(self.A_log.float())
        if history:   # (a few tokens: the recurrence, as decoding runs it)
            y, states = selective_scan_recurrent(x_BIT, dt_BIT, A, B_BTN, C_BTN, state, every_state=True)
            cache.record(self.layer_idx, "recurrent_state", slots, states)
            state = states[:, -1]
        else:
            y, state = selective_scan(x_BIT, dt_BIT, A, B_BTN, C_BTN, state, self.chunk_size)
        if cache is not None:
            conv_buf[slots] = conv_state.to(conv_buf.dtype)
            state_buf[slots] = state.float()
        y = y + x_BIT.to(y.dtype) * self.D.to(y.dtype)[:, None]
        y = y * F.silu(z_BIT.to(y.dtype))
        return self.out_proj(y.to(x_BTD.dtype).transpose(1, 2))


class MixerDecoderLayer(nn.Module):
    """h += m * mixer(input_layernorm(h)); h += m * mlp(post_attention_layernorm(h)), m =
    ``residual_multiplier`` (1: plain pre-norm residuals); the mixer is registered under ``mixer_name``, as
    Hugging Face names it (``mamba``, ``conv``, ``self_attn``)."""

    def __init__(self, mixer: nn.Module, mlp: nn.Module, input_layernorm: nn.Module,
                 post_attention_layernorm: nn.Module, mixer_name: str = "self_attn", residual_multiplier: float = 1.0):
        super().__init__()
        if mixer_name in ("mlp", "input_layernorm", "post_attention_layernorm", "mixer"):
            raise ValueError(f"mixer_name must not be one of the layer's other names, got {mixer_name!r}")
        self.mixer_name = mixer_name
        self.add_module(mixer_name, mixer)
        self.mlp, self.input_layernorm, self.post_attention_layernorm = mlp, input_layernorm, post_attention_layernorm
        self.residual_multiplier = residual_multiplier

    @property
    def mixer(self) -> nn.Module:
        return self._modules[self.mixer_name]

    def forward(self, h_BTD: Tensor, positions_BT: Tensor, cache: KVCache | None = None, slots: Tensor | None = None,
                kv_len: int | None = None) -> Tensor:
        m = self.residual_multiplier
        h_BTD = h_BTD + m * self.mixer(self.input_layernorm(h_BTD), positions_BT, cache, slots, kv_len)
        return h_BTD + m * self.mlp(self.post_attention_layernorm(h_BTD))
