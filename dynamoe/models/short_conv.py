"""LFM2's gated short convolution (``conv`` layers of ``lfm2_moe``): a causal depthwise conv of a few taps between
two elementwise gates -- a fixed-size window per sequence instead of a KV cache.

Legend: B batch rows, T new tokens, D model dim (the conv's channels), W conv window (kernel - 1 past inputs).

    [b | c | x] = in_proj(h)        (each [B, T, D])
    y = c * conv(b * x)             (the causal depthwise conv of ``conv``, optional bias, no activation)
    out = out_proj(y)

With a :class:`~dynamoe.models.cache.KVCache` the layer keeps per slot the last W inputs of its conv (b * x),
``cache.buffer(layer, "conv_state", D, W)`` in the cache's dtype, read as zero for a row whose first position
is 0 and continued exactly across chunked prefill and decode; the model's first such layer checks that every
row continues its slot where it stopped (:func:`dynamoe.models.linear_attention.slot_states`, no state
buffer). A speculative verification forward (the cache keeping a history) records the window after every token, so
that rejected drafts can be cut off.
"""
from __future__ import annotations

from torch import Tensor, nn

from .cache import KVCache
from .linear_attention import record_conv_windows, slot_states
from .mamba import conv_with_state

__all__ = ["ShortConv"]


class ShortConv(nn.Module):
    """One gated short convolution (Hugging Face's ``conv``: ``in_proj`` [3 D, D], ``conv`` [D, 1, K], ``out_proj``;
    ``bias`` on all three or none). ``forward(x [B, T, D], positions [B, T], cache=None, slots=None, kv_len=None)
    -> [B, T, D]``."""

    def __init__(self, hidden_size: int, kernel: int, layer_idx: int, bias: bool = False,
                 checks_position: bool = False, dtype=None):
        super().__init__()
        if kernel < 1:
            raise ValueError(f"config field 'conv_L_cache' (the short conv's kernel) must be >= 1, got {kernel}")
        D = hidden_size
        self.layer_idx, self.kernel, self.checks_position = layer_idx, kernel, checks_position
        self.in_proj = nn.Linear(D, 3 * D, bias=bias, dtype=dtype)
        self.conv = nn.Conv1d(D, D, kernel, groups=D, padding=kernel - 1, bias=bias, dtype=dtype)
        self.out_proj = nn.Linear(D, D, bias=bias, dtype=dtype)

    def extra_repr(self) -> str:
        return f"layer={self.layer_idx}, kernel={self.kernel}"

    def forward(self, x_BTD: Tensor, positions_BT: Tensor, cache: KVCache | None = None, slots: Tensor | None = None,
                kv_len: int | None = None) -> Tensor:
        T, D = x_BTD.size(1), x_BTD.size(2)
        b, c, x = self.in_proj(x_BTD).transpose(1, 2).chunk(3, dim=1)          # each [B, D, T]
        window = None
        if cache is not None:
            conv_buf, _, window, _ = slot_states(cache, self.layer_idx, slots, positions_BT, T, (D, self.kernel - 1),
                                                 None, self.checks_position)
        bx = b * x
        if cache is not None and cache.keeps_history:   # speculative verification: the window after every token
            record_conv_windows(cache, self.layer_idx, "conv_state", slots, window, bx.to(self.conv.weight.dtype))
        y, window = conv_with_state(bx, self.conv, window)
        if cache is not None:
            conv_buf[slots] = window.to(conv_buf.dtype)
        return self.out_proj((c * y.to(c.dtype)).transpose(1, 2))
