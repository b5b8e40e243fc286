"""INT4 weights, symmetric, one scale per group of input elements (W4A16; compressed-tensors
``pack-quantized``: Kimi-K2.5 / K2.6 / K2-Thinking routed experts, group 32).

W[i, j] = q[i, j] * weight_scale[i, j // group_size], q an integer in -8..7. On disk, per Linear:

* ``weight_packed`` int32 [..., out, ceil(in / 8)]: word k of a row holds elements 8k..8k+7, element
  8k + i in bits 4i..4i+3 (the lowest nibble is the first element), each stored **unsigned as q + 8**;
  a row is zero-padded to whole words.
* ``weight_scale`` bf16 / fp16 / fp32 [..., out, ceil(in / group_size)] (strategy ``group``; strategy
  ``channel`` is one group spanning the row: [out, 1]).
* ``weight_shape`` int [2]: the logical (out, in).

Checked against the public sources (no code taken): compressed-tensors
``compressors/quantized_compressors/pack_quantized.py`` (``pack_to_int32``: ``value + (1 << (num_bits - 1))``
as uint8, ``packed |= value[:, i::8] << 4 * i`` for i in 0..7 over numpy uint32, viewed as int32;
``unpack_from_int32``: ``(value >> 4 * i) & 15`` then ``- 8``; ``compression_param_info``: packed
[out, ceil(in / 8)] int32, ``weight_shape`` [2]; a ``weight_zero_point`` [ceil(out / 8), groups] packed
along dim 0 only for asymmetric schemes), and vLLM's compressed-tensors WNA16 MoE methods
(``compressed_tensors_moe.py``), which register per expert ``w13/w2_weight_packed`` int32 (8 per word along
the input dim), ``w13/w2_weight_scale`` [E, out, groups] in the model dtype and ``w13/w2_weight_shape``
[E, 2], and name the stored type ``uint4b8`` (unsigned 4-bit, bias 8).

Because an int32 is stored little-endian, the packed words seen as bytes are exactly the nibble layout
of the FP4 formats (byte j = elements 2j in its low nibble, 2j + 1 in its high one): the CPU kernels
decode INT4 with the same 4-bit row kernels as MXFP4 / NVFP4, another table of 16 values
(``csrc/packed_rows.h``: ``Int4Codec``). Asymmetric schemes (zero points) and activation reordering
(``weight_g_idx``) are not supported: the checkpoint reader raises ValueError naming them.

Quantization (for tests and conversions): scale = group amax / 7.5 (as llm-compressor's symmetric
min-max observer for 4 bits), q = round(w / scale) clamped to -8..7; a group of zeros gets scale 1, a group
holding NaN or Inf dequantizes to NaN.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import Tensor

from .base import QuantizedWeight, check_float_weight
from .codecs import pack_nibbles, unpack_nibbles

__all__ = ["INT4Weight", "INT4_DEFAULT_GROUP", "INT4_OFFSET", "SCALE_DTYPES", "pack_int4", "unpack_int4"]

INT4_DEFAULT_GROUP = 32
INT4_OFFSET = 8               # stored nibble = q + 8
SCALE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_Q_MIN, _Q_MAX = -8, 7


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def pack_int4(q: Tensor) -> Tensor:
    """Integers q in -8..7 [..., n] -> int32 words [..., ceil(n / 8)] (compressed-tensors' layout, see
    the module docstring)."""
    if sys.byteorder != "little":  # the int32 <-> byte view below assumes it
        raise RuntimeError("INT4 packing assumes a little-endian machine")
    n = q.size(-1)
    codes = (q.to(torch.int16) + INT4_OFFSET).to(torch.uint8)
    pad = -n % 8
    if pad:
        codes = torch.cat([codes, codes.new_zeros(*codes.shape[:-1], pad)], -1)
    return pack_nibbles(codes).contiguous().view(torch.int32)


def unpack_int4(packed: Tensor, n: int) -> Tensor:
    """int32 words [..., ceil(n / 8)] -> int8 q [..., n] (the padding dropped)."""
    if sys.byteorder != "little":
        raise RuntimeError("INT4 unpacking assumes a little-endian machine")
    codes = unpack_nibbles(packed.contiguous().view(torch.uint8))
    return (codes[..., :n].to(torch.int8) - INT4_OFFSET)


@dataclass(repr=False)
class INT4Weight(QuantizedWeight):
    weight_packed: Tensor   # int32 [..., out, ceil(in/8)]
    weight_scale: Tensor    # bf16 / fp16 / fp32 [..., out, ceil(in/group_size)]
    shape: tuple
    group_size: int = INT4_DEFAULT_GROUP
    format = "int4"

    def __post_init__(self):
        if len(self.shape) < 2:
            raise ValueError(f"an INT4 weight needs a shape [..., out, in], got {tuple(self.shape)}")
        *lead, rows, cols = self.shape
        if not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"group_size must be a positive int, got {self.group_size!r}")
        want = (*lead, rows, _ceil_div(cols, 8))
        if tuple(self.weight_packed.shape) != want or self.weight_packed.dtype != torch.int32:
            raise ValueError(f"weight_packed must be int32 {want}, got {self.weight_packed.dtype} "
                             f"{tuple(self.weight_packed.shape)}")
        want = (*lead, rows, _ceil_div(cols, self.group_size))
        if tuple(self.weight_scale.shape) != want:
            raise ValueError(f"weight_scale must have shape {want} (group_size {self.group_size}), got "
                             f"{tuple(self.weight_scale.shape)}")
        if self.weight_scale.dtype not in SCALE_DTYPES:
            raise ValueError(f"weight_scale must be one of {[str(d) for d in SCALE_DTYPES]}, got {self.weight_scale.dtype}")

    @classmethod
    def quantize(cls, w: Tensor, group_size: int = INT4_DEFAULT_GROUP,
                 scale_dtype: torch.dtype = torch.bfloat16) -> "INT4Weight":
        """Symmetric INT4 of a float weight [..., out, in] with one ``scale_dtype`` scale per
        ``group_size`` input elements (a partial last group when in % group_size != 0)."""
        check_float_weight(w)
        if not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be a positive int, got {group_size!r}")
        if scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale_dtype must be one of {[str(d) for d in SCALE_DTYPES]}, got {scale_dtype}")
        *lead, rows, cols = w.shape
        G = _ceil_div(cols, group_size)
        wf = w.float()
        if G * group_size != cols:
            wf = torch.cat([wf, wf.new_zeros(*lead, rows, G * group_size - cols)], -1)
        g = wf.reshape(*lead, rows, G, group_size)
        amax = g.abs().amax(-1)
        scale = torch.where(amax > 0, amax / 7.5, torch.ones_like(amax))
        scale = torch.where(torch.isnan(amax), amax, scale).to(scale_dtype)   # a NaN group stays NaN
        q = torch.round(g / scale.float()[..., None]).nan_to_num(0.0).clamp(_Q_MIN, _Q_MAX)
        q = q.reshape(*lead, rows, G * group_size)[..., :cols].to(torch.int8)
        return cls(pack_int4(q), scale.contiguous(), tuple(w.shape), group_size)

    def codes(self) -> Tensor:
        """The integers q [..., out, in] (int8, -8..7)."""
        return unpack_int4(self.weight_packed, self.shape[-1])

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> Tensor:
        cols = self.shape[-1]
        scale = self.weight_scale.float().repeat_interleave(self.group_size, -1)[..., :cols]
        return (self.codes().float() * scale).to(dtype)
