"""MiniMax's lightning attention (the ``linear_attention`` layers of ``minimax``): linear attention with a fixed decay
per head -- a [d, d] state per head and sequence instead of a KV cache.

Legend: B batch rows, T new tokens, D model dim, H heads, d head dim.

Per head h with state S [d_k, d_v] (zero at a sequence's first token), for each token t:

    S = exp(-slope_h) S + k_t^T v_t
    o_t = q_t S

with [q | k | v] = silu(qkv_proj(x)) per head (no normalisation, no scale) and slope_h = base^(h+1) x
(1 - layer / (layers - 1 + 1e-5) + 1e-5), base = 2^(-8/H) (ALiBi's slopes, shallower in deeper layers). The
output is out_proj(sigmoid(output_gate(x)) * RMSNorm(o)) (the norm over all H d channels, eps 1e-6).

This is Mamba-2's SSD recurrence (:mod:`dynamoe.models.mamba2`) with x = v, B = k, C = q, dt = 1 and A = -slope
(its state is S transposed, [d_v, d_k]), so the same two forms serve: token by token for decode, in chunks of
``block_size`` for prefill (one masked matmul per chunk, the chunk-to-chunk state sequential), equal to rounding.

With a :class:`~dynamoe.models.cache.KVCache` each layer keeps per slot its fp32 state (``"recurrent_state"``
[H, d, d]), read as zero for a row whose first position is 0 and continued exactly across chunked prefill and
decode; the model's first such layer checks that every row continues its slot where it stopped
(:func:`dynamoe.models.linear_attention.slot_states`, no conv window). A speculative verification forward (the cache
keeping a history) runs token by token and records the state after every token, so that rejected drafts can be cut
off.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .cache import KVCache
from .linear_attention import slot_states
from .mamba import ACTIVATIONS
from .mamba2 import ssd, ssd_recurrent
from .norms import RMSNorm

__all__ = ["LightningAttention", "lightning_slopes"]


def lightning_slopes(num_heads: int, layer_idx: int, num_layers: int) -> Tensor:
    """The per-head decay rates slope_h > 0 of layer ``layer_idx`` of ``num_layers`` (fp32 [H]), as MiniMax defines
    them (see the module docstring)."""
    base = 1 / (2 ** (8 / num_heads))
    factor = 1 - layer_idx / (num_layers - 1 + 1e-5) + 1e-5
    return base ** (torch.arange(num_heads, dtype=torch.float32) + 1) * factor


class LightningAttention(nn.Module):
    """One lightning-attention token mixer (Hugging Face's ``self_attn`` of a linear layer: ``qkv_proj`` [3 H d, D],
    per head [q | k | v]; ``output_gate`` [H d, D]; ``norm``; ``out_proj``). ``forward(x [B, T, D], positions [B, T],
    cache=None, slots=None, kv_len=None) -> [B, T, D]``."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, layer_idx: int, num_layers: int,
                 activation: str = "silu", block_size: int = 256, checks_position: bool = False, dtype=None):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"config field 'hidden_act' must be one of {sorted(ACTIVATIONS)} for lightning attention, "
                             f"got {activation!r}")
        H, d = num_heads, head_dim
        self.layer_idx, self.num_layers, self.num_heads, self.head_dim = layer_idx, num_layers, H, d
        self.activation = activation
        self.block_size, self.checks_position = block_size, checks_position
        self.qkv_proj = nn.Linear(hidden_size, 3 * H * d, bias=False, dtype=dtype)
        self.output_gate = nn.Linear(hidden_size, H * d, bias=False, dtype=dtype)
        self.norm = RMSNorm(H * d, 1e-6, dtype=dtype)
        self.out_proj = nn.Linear(H * d, hidden_size, bias=False, dtype=dtype)
        # derived from the layer's place (the checkpoint's slope_rate / *_decay buffers are not read)
        self.register_buffer("slope", lightning_slopes(H, layer_idx, num_layers), persistent=False)

    def materialize_buffers(self, device) -> None:
        """The slopes when the model was built on the meta device (the loader calls this)."""
        self.slope = lightning_slopes(self.num_heads, self.layer_idx, self.num_layers).to(device)

    def extra_repr(self) -> str:
        return f"layer={self.layer_idx}, heads={self.num_heads}, head_dim={self.head_dim}, block={self.block_size}"

    def forward(self, x_BTD: Tensor, positions_BT: Tensor, cache: KVCache | None = None, slots: Tensor | None = None,
                kv_len: int | None = None) -> Tensor:
        Bn, T, _ = x_BTD.shape
        H, d = self.num_heads, self.head_dim
        qkv = ACTIVATIONS[self.activation](self.qkv_proj(x_BTD)).view(Bn, T, H, 3 * d)
        q, k, v = qkv.split(d, dim=-1)                                            # each [B, T, H, d]
        state = None
        if cache is not None:
            _, state_buf, _, state = slot_states(cache, self.layer_idx, slots, positions_BT, T, None, (H, d, d),
                                                 self.checks_position)
        ones = torch.ones(Bn, T, H, dtype=torch.float32, device=x_BTD.device)
        if cache is not None and cache.keeps_history:   # speculative verification: the state after every token
            o, states = ssd_recurrent(v, ones, -self.slope.float(), k, q, state, every_state=True)
            cache.record(self.layer_idx, "recurrent_state", slots, states)
            state = states[:, -1]
        else:
            o, state = ssd(v, ones, -self.slope.float(), k, q, state, self.block_size)  # (x, dt, A, B, C)
        if cache is not None:
            state_buf[slots] = state
        o = self.norm(o.reshape(Bn, T, H * d).to(x_BTD.dtype))
        return self.out_proj(torch.sigmoid(self.output_gate(x_BTD)) * o)
