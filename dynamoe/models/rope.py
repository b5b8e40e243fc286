"""Rotary position embeddings: inverse frequencies for each RoPE type (computed as transformers does),
and their application to half-split or interleaved head dims, over all or part of each head.

Legend: B batch, T tokens, H heads, R rotary dims (R/2 frequencies), d head dim.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..ops import cpu_kernels
from .config import RopeConfig

__all__ = ["rope_frequencies", "rotary_dims", "yarn_mscale", "RotaryEmbedding", "apply_rope"]


def rotary_dims(rope: RopeConfig, head_dim: int) -> int:
    """The dims of a head the rotary tables cover: its ``partial_rotary_factor`` share, or the whole head for
    'proportional' RoPE (whose still pairs have frequency 0: cos 1, sin 0)."""
    return head_dim if rope.rope_type == "proportional" else int(head_dim * rope.partial_rotary_factor)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(scale) + 1 (1 when scale <= 1). DeepSeek's MLA
    multiplies its softmax scale by yarn_mscale(factor, mscale_all_dim) ** 2."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _base_inv_freq(theta: float, dim: int) -> Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def rope_frequencies(rope: RopeConfig, dim: int, max_position_embeddings: int,
                     seq_len: int | None = None) -> tuple[Tensor, float]:
    """(inv_freq fp32 [dim/2], attention scaling applied to cos and sin) for ``dim`` rotary dims.

    ``seq_len`` only matters for 'dynamic' (NTK scaling grows the base past max_position_embeddings).
    """
    kind, theta = rope.rope_type, rope.theta
    if kind == "default":
        return _base_inv_freq(theta, dim), 1.0
    if kind == "linear":
        return _base_inv_freq(theta, dim) / rope.factor, 1.0
    if kind == "dynamic":
        seq_len = max(seq_len or 0, max_position_embeddings)
        base = theta * ((rope.factor * seq_len / max_position_embeddings) - (rope.factor - 1)) ** (dim / (dim - 2))
        return _base_inv_freq(base, dim), 1.0
    if kind == "llama3":
        inv_freq = _base_inv_freq(theta, dim)
        old_len, low, high = rope.original_max_position_embeddings, rope.low_freq_factor, rope.high_freq_factor
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn(rope, dim)
    if kind == "proportional":  # dim is the whole head (rotary_dims): its first share of pairs rotate
        angles = int(rope.partial_rotary_factor * dim // 2)
        inv_freq = torch.zeros(dim // 2)
        inv_freq[:angles] = 1.0 / (theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / dim))
        return inv_freq / rope.factor, 1.0
    if kind == "longrope":
        return _longrope(rope, dim, seq_len)
    raise ValueError(f"rope_type must be one of 'default', 'linear', 'dynamic', 'yarn', 'llama3', 'longrope', "
                     f"'proportional', got {kind!r}")


def _longrope(rope: RopeConfig, dim: int, seq_len: int | None) -> tuple[Tensor, float]:
    """transformers' longrope: the base frequencies divided by ``long_factor`` when ``seq_len`` passes
    original_max_position_embeddings, else by ``short_factor``; the attention factor as parsed (see
    dynamoe.models.config.parse_rope)."""
    orig = rope.original_max_position_embeddings
    ext = rope.long_factor if seq_len and seq_len > orig else rope.short_factor
    if len(ext) != dim // 2:
        raise ValueError(f"rope long_factor / short_factor must have {dim // 2} entries (one per rotary frequency), "
                         f"got {len(ext)}")
    attention = 1.0 if rope.attention_factor is None else rope.attention_factor
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (torch.tensor(ext, dtype=torch.float32) * rope.theta ** exponents)
    return inv_freq, float(attention)


def _yarn(rope: RopeConfig, dim: int) -> tuple[Tensor, float]:
    factor, theta, orig = rope.factor, rope.theta, rope.original_max_position_embeddings
    if rope.attention_factor is not None:
        attention = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        attention = yarn_mscale(factor, rope.mscale) / yarn_mscale(factor, rope.mscale_all_dim)
    else:
        attention = yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:  # the dim whose wavelength makes `rotations` turns in orig
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp  # 1: keep the original frequency; 0: interpolate (divide by factor)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


class RotaryEmbedding(nn.Module):
    """cos/sin [B, T, R/2] for positions [B, T] (already times the YaRN attention scaling).

    One instance serves all layers: the last positions' tables are kept, so the layers of one
    forward share them.
    """

    #: extension point: a subclass that implements 'longrope' (whose tables switch with the sequence length)
    handles_longrope = False

    def __init__(self, rope: RopeConfig, dim: int, max_position_embeddings: int):
        super().__init__()
        if dim % 2:
            raise ValueError(f"rotary dim must be even, got {dim}")
        if rope.rope_type == "longrope" and not self.handles_longrope:
            raise ValueError("rope_type 'longrope' switches with the sequence length in a family's own way (Phi-3.5-MoE: "
                             "dynamoe.models.phimoe); this family's rotary embedding does not implement it")
        self.rope, self.dim, self.max_position_embeddings = rope, dim, max_position_embeddings
        inv_freq, self.attention_scaling = rope_frequencies(rope, dim, max_position_embeddings)
        # not part of the checkpoint; a model built on the meta device recomputes it (materialize_buffers)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._last: tuple | None = None
        self._last_rows: tuple | None = None
        #: the prompt lengths [B] of the rows of the forward in flight (set by the model around its layers), which
        #: dynamic NTK reads: None takes each row's last position + 1 (a forward without a cache: the whole sequence)
        self.prompt_lengths: Tensor | None = None

    def materialize_buffers(self, device) -> None:
        inv_freq, _ = rope_frequencies(self.rope, self.dim, self.max_position_embeddings)
        self.inv_freq = inv_freq.to(device)

    def forward(self, positions_BT: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        last = self._last
        prompt = self.prompt_lengths
        if last is not None and last[0] is positions_BT and last[1] == dtype and last[4] is prompt:
            return last[2], last[3]
        inv_freq = self.inv_freq.float()
        if self.rope.rope_type == "dynamic":
            inv_freq = self._dynamic_inv_freq(positions_BT, inv_freq, prompt)
        freqs = positions_BT[..., None].float() * inv_freq
        cos = (freqs.cos() * self.attention_scaling).to(dtype)
        sin = (freqs.sin() * self.attention_scaling).to(dtype)
        self._last = (positions_BT, dtype, cos, sin, prompt)
        return cos, sin

    def _dynamic_inv_freq(self, positions_BT: Tensor, inv_freq: Tensor, prompt_B: Tensor | None) -> Tensor:
        """Dynamic NTK (the base grows with the sequence length past max_position_embeddings), per position as
        transformers computes it for that sequence alone, whatever shares the batch or how the prompt is chunked:
        a prompt position with the prompt's length (transformers prefills the prompt in one forward), a later one
        with its own position + 1 (one decode step each). Without prompt lengths (no cache), every position of a
        row with the row's last position + 1: one forward over the whole sequence. [B, T, R/2]."""
        if not positions_BT.numel():
            return inv_freq
        if prompt_B is None or prompt_B.numel() != positions_BT.size(0):
            prompt_B = positions_BT[:, -1] + 1
        seq_BT = torch.maximum(positions_BT + 1, prompt_B.to(positions_BT.device)[:, None])
        if int(seq_BT.max()) <= self.max_position_embeddings:
            return inv_freq
        lengths, which = torch.unique(seq_BT, return_inverse=True)
        tables = torch.stack([inv_freq if n <= self.max_position_embeddings else
                              rope_frequencies(self.rope, self.dim, self.max_position_embeddings, n)[0].to(inv_freq.device).float()
                              for n in lengths.tolist()])
        return tables[which]

    def decode_rows(self, positions_BT: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
        """(cos [B, R/2], sin [B, R/2] contiguous, positions [B] int64 contiguous) of a decode step
        (T = 1), for the fused attention kernel; kept for the step's positions tensor (every layer
        asks for the same)."""
        last = self._last_rows
        if last is not None and last[0] is positions_BT and last[1] == dtype:
            return last[2]
        cos, sin = self(positions_BT, dtype)
        B = positions_BT.size(0)
        rows = (cos.reshape(B, -1).contiguous(), sin.reshape(B, -1).contiguous(),
                positions_BT.reshape(B).to(torch.long).contiguous())
        self._last_rows = (positions_BT, dtype, rows)
        return rows

    def extra_repr(self) -> str:
        return f"type={self.rope.rope_type}, dim={self.dim}, theta={self.rope.theta:g}"


def apply_rope(x_BHTd: Tensor, cos_BTR: Tensor, sin_BTR: Tensor, interleaved: bool = False) -> Tensor:
    """Rotate the first R = 2 * cos.size(-1) dims of each head; the rest pass through (partial RoPE).

    Half-split (Llama/Qwen/GPT-OSS/GLM): pairs are (i, i + R/2). Interleaved (DeepSeek's
    ``rope_interleave``): pairs are (2i, 2i + 1), and the rotated dims come out half-split ordered
    (as transformers does: q and k get the same permutation, so q.k is unchanged).
    """
    if (not torch.is_grad_enabled() and x_BHTd.device.type == "cpu" and x_BHTd.dtype in (torch.bfloat16, torch.float32)
            and x_BHTd.stride(-1) == 1 and cos_BTR.dtype == x_BHTd.dtype and x_BHTd.numel()):
        k = cpu_kernels.load()
        if k is not None:  # inference on CPU: one kernel call, the same roundings
            out = torch.empty(x_BHTd.shape, dtype=x_BHTd.dtype)
            k.rope_out(x_BHTd, cos_BTR.contiguous(), sin_BTR.contiguous(), interleaved, out)
            return out
    half = cos_BTR.size(-1)
    R = 2 * half
    cos, sin = cos_BTR.unsqueeze(1), sin_BTR.unsqueeze(1)  # [B, 1, T, R/2]
    rot = x_BHTd[..., :R]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    if R == x_BHTd.size(-1):
        return out
    return torch.cat((out, x_BHTd[..., R:]), dim=-1)
