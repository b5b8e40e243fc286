"""Element codecs of the quantized formats: e2m1 (FP4), e4m3 (FP8) and e8m0 (power-of-two scales).

Codes are uint8 tensors; decoding goes through 16- and 256-entry lookup tables (an index gather is
several times faster on CPU than a float8 cast). Rounding is to nearest, ties to even; values
beyond the largest finite magnitude saturate to it (e2m1: 6, e4m3: 448), which is what the OCP MX
and NVFP4 recipes do.
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "E2M1_VALUES", "E2M1_MAX", "E4M3_MAX",
    "e2m1_encode", "e2m1_decode", "pack_nibbles", "unpack_nibbles",
    "e4m3_encode", "e4m3_decode", "e8m0_encode_exponent", "e8m0_decode",
]

# e2m1 magnitude by code 0..7; code | 8 is the negative (8 is -0.0)
_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES = torch.tensor(_E2M1_MAGNITUDES + tuple(-v for v in _E2M1_MAGNITUDES), dtype=torch.float32)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# Midpoints between consecutive magnitudes: a value exactly on one is a tie.
_E2M1_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32)

_LUTS: dict = {}


def _lut(name: str, dtype: torch.dtype, device: torch.device) -> Tensor:
    key = (name, dtype, device)
    lut = _LUTS.get(key)
    if lut is None:
        if name == "e2m1":
            lut = E2M1_VALUES
        else:  # e4m3fn: every byte through torch's own decoder once
            lut = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        lut = _LUTS[key] = lut.to(device=device, dtype=dtype)
    return lut


def e2m1_encode(x: Tensor) -> Tensor:
    """Nearest e2m1 code (ties to the even code, |x| > 6 saturates to 6) as uint8 in 0..15.

    e2m1 has no NaN: NaN input is an error here (the block formats encode NaN in their scales).
    """
    if torch.isnan(x).any():
        raise ValueError("e2m1 has no NaN encoding: x contains NaN")
    ax = x.abs().float()
    code = torch.bucketize(ax, _E2M1_MIDPOINTS.to(ax.device), right=False)  # ties go to the lower code
    on_tie = (code < 7) & (ax == _E2M1_MIDPOINTS.to(ax.device)[code.clamp(max=6)])
    code = code + (on_tie & (code % 2 == 1)).long()  # ...unless the lower code is odd
    sign = torch.signbit(x).to(torch.uint8) << 3
    return code.to(torch.uint8) | sign


def e2m1_decode(codes: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Values of e2m1 codes (uint8 0..15)."""
    return _lut("e2m1", dtype, codes.device)[codes.long()]


def pack_nibbles(codes: Tensor) -> Tensor:
    """[..., 2n] codes (0..15) -> [..., n] bytes; the even element goes in the low nibble."""
    if codes.size(-1) % 2:
        raise ValueError(f"pack_nibbles needs an even last dimension, got {codes.size(-1)}")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(packed: Tensor) -> Tensor:
    """[..., n] bytes -> [..., 2n] codes (low nibble first)."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def e4m3_encode(x: Tensor) -> Tensor:
    """float8 e4m3fn bytes (uint8) of x: round to nearest even, saturate at +-448, NaN stays NaN."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def e4m3_decode(codes: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Values of e4m3fn bytes (uint8 or float8_e4m3fn)."""
    if codes.dtype == torch.float8_e4m3fn:
        codes = codes.view(torch.uint8)
    return _lut("e4m3", dtype, codes.device)[codes.long()]


def e8m0_encode_exponent(exponent: Tensor) -> Tensor:
    """e8m0 bytes for integer exponents (2**exponent), clamped to [-127, 127]; NaN -> 255."""
    nan = torch.isnan(exponent)
    code = (exponent.nan_to_num(0).clamp(-127, 127) + 127).to(torch.uint8)
    return torch.where(nan, torch.full_like(code, 255), code)


def e8m0_decode(codes: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """2**(code - 127); code 255 is NaN."""
    if codes.dtype != torch.uint8:
        codes = codes.view(torch.uint8)
    v = torch.exp2(codes.to(torch.float32) - 127.0)
    return torch.where(codes == 255, torch.full_like(v, float("nan")), v).to(dtype)
