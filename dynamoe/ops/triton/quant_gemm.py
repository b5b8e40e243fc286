"""Grouped matmul over packed weights (weight-only quantization): every weight tile is decoded in
registers right before its ``tl.dot``; the packed bytes are never expanded in memory.

Legend: N rows, G groups (group g uses expert g % E), E experts, I input features, O output features (2F with ``swiglu``).

Weights use the nn.Linear layout [E, O, I] (y = x @ W_e^T), as dynamoe.quant stores them:

* FP8 blockwise: ``q`` float8_e4m3fn (or its uint8 bytes) [E, O, I]; ``scale`` [E, ceil(O/b0),
  ceil(I/b1)] fp32, or e8m0 bytes (``scale_e8m0``); W = q * scale[o // b0, i // b1] (edge blocks
  partial).
* MXFP4: ``packed`` uint8 [E, O, I/2] (GPT-OSS's ``*_blocks`` [E, O, I/32, 16] viewed flat), the even
  element in the low nibble; ``scales`` e8m0 uint8 [E, O, I/32]; W = e2m1 * 2**(s - 127).
* NVFP4: ``packed`` uint8 [E, O, I/2]; ``scales`` float8_e4m3fn [E, O, I/16]; ``scale_2`` fp32 [E];
  W = e2m1 * (e4m3(s) * scale_2).

A decoded tile is rounded to the activation dtype before the dot -- the same numbers the reference
(``QuantizedWeight.dequantize(x.dtype)`` then a matmul; dynamoe.quant.matmul) multiplies. FP4 tiles
hold the even and the odd input features separately (low and high nibbles), so the activation tile
is split into its even and odd columns (``tl.split``): two dots per step, no weight interleaving. Layout of x,
offsets, bias, row_scale, gather, swiglu and out: as in grouped_gemm. Forward only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import fix_interpreter, interpreted, next_pow2
from .grouped_gemm import _dot, _epilogue, _tile_rows, pick_config

fix_interpreter()

__all__ = ["fp8_block_gemm", "mxfp4_gemm", "nvfp4_gemm"]

_FP8, _MXFP4, _NVFP4 = 0, 1, 2


@triton.jit
def _e2m1(c):
    """e2m1 codes (int32 0..15) -> fp32, by building the float's bits: magnitude codes 0..7 are
    0, .5, 1, 1.5, 2, 3, 4, 6; bit 3 is the sign."""
    mag = c & 7
    e = mag >> 1
    m = mag & 1
    bits = tl.where(e == 0, m * (126 << 23), ((e + 126) << 23) | (m << 22))
    return (bits | ((c & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _e8m0(c):
    """e8m0 bytes (int32 0..255) -> 2**(c - 127) in fp32; 0 is 2**-127 (subnormal), 255 is NaN."""
    bits = tl.where(c == 0, 0x00400000, c << 23)
    bits = tl.where(c == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _fp8_tile(q_ptr, s_ptr, e, n, nmask, k0, ks, I, s_qe, s_qn, s_se, s_sn, s_sk, B0, B1,
              E8M0: tl.constexpr, SCALE_ROW: tl.constexpr):
    """Decoded [BK, BN] tile W^T[k0:k0+BK, n] of expert e (fp32)."""
    k = k0 + ks
    m = (k < I)[:, None] & nmask[None, :]
    q = tl.load(q_ptr + e * s_qe + n.to(tl.int64)[None, :] * s_qn + k[:, None], mask=m, other=0)
    if SCALE_ROW:  # the tile lies inside one block column: one scale per output row
        sc = tl.load(s_ptr + e * s_se + (n // B0) * s_sn + (k0 // B1) * s_sk, mask=nmask, other=0)[None, :]
    else:
        sc = tl.load(s_ptr + e * s_se + (n // B0)[None, :] * s_sn + (k // B1)[:, None] * s_sk, mask=m, other=0)
    if E8M0:
        sc = _e8m0(sc.to(tl.int32))
    return q.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc.to(tl.float32)


@triton.jit
def _fp4_tiles(p_ptr, s_ptr, s2, e, n, nmask, j0, js, IH, s_pe, s_pn, s_se, s_sn,
               GROUP_H: tl.constexpr, NV: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr):
    """Decoded even-feature and odd-feature [BK/2, BN] tiles (fp32) for packed bytes j0 .. j0 + BK/2."""
    j = j0 + js
    m = (j < IH)[:, None] & nmask[None, :]
    nn = n.to(tl.int64)[None, :]
    p = tl.load(p_ptr + e * s_pe + nn * s_pn + j[:, None], mask=m, other=0).to(tl.int32)
    # one scale per GROUP_H bytes: load the NS distinct ones, then broadcast them over their bytes
    NS: tl.constexpr = BH // GROUP_H
    si = j0 // GROUP_H + tl.arange(0, NS)
    sraw = tl.load(s_ptr + e * s_se + nn * s_sn + si[:, None], mask=(si < IH // GROUP_H)[:, None] & nmask[None, :], other=0)
    if NV:
        sc = sraw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * s2
    else:
        sc = _e8m0(sraw.to(tl.int32))
    sc = tl.reshape(tl.broadcast_to(sc[:, None, :], (NS, GROUP_H, BN)), (BH, BN))
    return _e2m1(p & 15) * sc, _e2m1(p >> 4) * sc


@triton.jit
def _quant_gemm_kernel(x_ptr, q_ptr, s_ptr, s2_ptr, bias_ptr, scale_ptr, gather_ptr, offsets_ptr, out_ptr,
                       G, E_W, O, I, IH, F_UP, num_m, B0, B1,
                       stride_xm, stride_xk, s_qe, s_qn, s_se, s_sn, s_sk, stride_be, stride_om,
                       FORMAT: tl.constexpr, E8M0: tl.constexpr, SCALE_ROW: tl.constexpr, GROUP_H: tl.constexpr,
                       HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, GATHER: tl.constexpr,
                       SWIGLU: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_G: tl.constexpr, GROUP_M: tl.constexpr):
    pid_n, e, rows, rmask, src, valid = _tile_rows(tl.program_id(0), num_m, tl.cdiv(O, BLOCK_N), offsets_ptr,
                                                   gather_ptr, G, E_W, GATHER, BLOCK_M, BLOCK_G, GROUP_M)
    if valid:
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < O
        s2 = 1.0
        if FORMAT == 2:
            s2 = tl.load(s2_ptr + e)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if FORMAT == 0:
            ks = tl.arange(0, BLOCK_K)
            for k0 in range(0, I, BLOCK_K):
                kmask = (k0 + ks) < I
                a = tl.load(x_ptr + src[:, None] * stride_xm + (k0 + ks)[None, :] * stride_xk,
                            mask=rmask[:, None] & kmask[None, :], other=0.0)
                b = _fp8_tile(q_ptr, s_ptr, e, n, nmask, k0, ks, I, s_qe, s_qn, s_se, s_sn, s_sk, B0, B1,
                              E8M0, SCALE_ROW).to(x_ptr.dtype.element_ty)  # the reference's rounding
                if UPCAST:  # the interpreter's half-precision dot is wrong: fp32 tiles there
                    a = a.to(tl.float32)
                    b = b.to(tl.float32)
                acc = _dot(a, b, acc, IEEE)
                if SWIGLU:
                    b = _fp8_tile(q_ptr, s_ptr, e, n + F_UP, nmask, k0, ks, I, s_qe, s_qn, s_se, s_sn, s_sk, B0, B1,
                                  E8M0, SCALE_ROW).to(x_ptr.dtype.element_ty)
                    if UPCAST:
                        b = b.to(tl.float32)
                    acc_up = _dot(a, b, acc_up, IEEE)
        else:
            js = tl.arange(0, BLOCK_K // 2)
            ks = tl.arange(0, BLOCK_K)
            for j0 in range(0, IH, BLOCK_K // 2):
                k = 2 * j0 + ks
                a = tl.load(x_ptr + src[:, None] * stride_xm + k[None, :] * stride_xk,
                            mask=rmask[:, None] & (k < I)[None, :], other=0.0)
                a_even, a_odd = tl.split(tl.reshape(a, (BLOCK_M, BLOCK_K // 2, 2)))  # features 2j, 2j + 1
                lo, hi = _fp4_tiles(q_ptr, s_ptr, s2, e, n, nmask, j0, js, IH, s_qe, s_qn, s_se, s_sn,
                                    GROUP_H, FORMAT == 2, BLOCK_K // 2, BLOCK_N)
                lo = lo.to(x_ptr.dtype.element_ty)
                hi = hi.to(x_ptr.dtype.element_ty)
                if UPCAST:
                    a_even = a_even.to(tl.float32)
                    a_odd = a_odd.to(tl.float32)
                    lo = lo.to(tl.float32)
                    hi = hi.to(tl.float32)
                acc = _dot(a_even, lo, acc, IEEE)
                acc = _dot(a_odd, hi, acc, IEEE)
                if SWIGLU:
                    lo, hi = _fp4_tiles(q_ptr, s_ptr, s2, e, n + F_UP, nmask, j0, js, IH, s_qe, s_qn, s_se, s_sn,
                                        GROUP_H, FORMAT == 2, BLOCK_K // 2, BLOCK_N)
                    lo = lo.to(x_ptr.dtype.element_ty)
                    hi = hi.to(x_ptr.dtype.element_ty)
                    if UPCAST:
                        lo = lo.to(tl.float32)
                        hi = hi.to(tl.float32)
                    acc_up = _dot(a_even, lo, acc_up, IEEE)
                    acc_up = _dot(a_odd, hi, acc_up, IEEE)
        _epilogue(acc, acc_up, e, rows, rmask, n, nmask, bias_ptr, stride_be, F_UP, scale_ptr, out_ptr, stride_om,
                  HAS_BIAS, HAS_SCALE, SWIGLU)


def _launch(fmt: int, x: Tensor, q: Tensor, s: Tensor, s2: Tensor | None, shape: tuple, offsets_G1: Tensor,
            bias, row_scale, gather, swiglu, out, num_rows, config, block=(1, 1), e8m0=False) -> Tensor:
    E, O_w, I = shape
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be bf16, fp16 or fp32, got {x.dtype}")
    if x.size(1) != I:
        raise ValueError(f"x has {x.size(1)} features but the weight {tuple(shape)} expects {I}")
    if swiglu and O_w % 2:
        raise ValueError(f"swiglu needs an even number of weight rows (gate then up), got {O_w}")
    G = offsets_G1.numel() - 1
    if G < 1 or G % E:
        raise ValueError(f"offsets must describe E={E} groups (or a multiple of E, group g using expert g % E), got {G}")
    O = O_w // 2 if swiglu else O_w
    N = gather.numel() if gather is not None else (x.size(0) if num_rows is None else num_rows)
    if out is None:
        out = torch.empty(N, O, dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (N, O) or out.stride(1) != 1:
        raise ValueError(f"out must be a [{N}, {O}] tensor with unit column stride, got {tuple(out.shape)}")
    if N == 0 or O == 0:
        return out
    interp = interpreted(_quant_gemm_kernel)
    cfg = dict(config or pick_config(N / max(G, 1), O, swiglu, interp))
    if fmt != _FP8:
        cfg["BLOCK_K"] = max(cfg["BLOCK_K"], 32)        # two dots of BLOCK_K / 2 >= 16 features
    b0, b1 = block
    scale_row = fmt == _FP8 and b1 % cfg["BLOCK_K"] == 0
    BM, BN = cfg["BLOCK_M"], cfg["BLOCK_N"]
    num_m = triton.cdiv(N, BM) + min(G, N)
    dummy = out
    _quant_gemm_kernel[(num_m * triton.cdiv(O, BN),)](
        x, q, s, s2 if s2 is not None else dummy, bias if bias is not None else dummy,
        row_scale if row_scale is not None else dummy, gather if gather is not None else dummy, offsets_G1, out,
        G, E, O, I, I // 2, O, num_m, b0, b1,
        x.stride(0), x.stride(1), q.stride(0), q.stride(1), s.stride(0), s.stride(1), s.stride(2) if s.dim() == 3 else 1,
        bias.stride(0) if bias is not None else 0, out.stride(0),
        FORMAT=fmt, E8M0=e8m0, SCALE_ROW=scale_row, GROUP_H=16 if fmt == _MXFP4 else 8, HAS_BIAS=bias is not None, HAS_SCALE=row_scale is not None,
        GATHER=gather is not None, SWIGLU=swiglu, UPCAST=interp and x.dtype != torch.float32,
        IEEE=x.dtype == torch.float32,
        BLOCK_G=max(next_pow2(G), 16), **cfg)
    return out


def _bytes(t: Tensor) -> Tensor:
    t = t.view(torch.uint8) if t.dtype != torch.uint8 else t
    return t if t.stride(-1) == 1 else t.contiguous()


def fp8_block_gemm(x: Tensor, q: Tensor, scale: Tensor, offsets_G1: Tensor, block=(128, 128), scale_e8m0: bool = False,
                   bias: Tensor | None = None, row_scale: Tensor | None = None, gather: Tensor | None = None,
                   swiglu: bool = False, out: Tensor | None = None, num_rows: int | None = None,
                   config: dict | None = None) -> Tensor:
    """Grouped x @ W_e^T for blockwise-FP8 W (see the module docstring); [N, O] in x's dtype."""
    if q.dim() != 3:
        raise ValueError(f"q must be [E, O, I], got shape {tuple(q.shape)}")
    s = _bytes(scale) if scale_e8m0 else scale.float()
    return _launch(_FP8, x, _bytes(q), s, None, tuple(q.shape), offsets_G1, bias, row_scale, gather, swiglu, out,
                   num_rows, config, block=tuple(int(b) for b in block), e8m0=scale_e8m0)


def mxfp4_gemm(x: Tensor, packed: Tensor, scales: Tensor, offsets_G1: Tensor, bias: Tensor | None = None,
               row_scale: Tensor | None = None, gather: Tensor | None = None, swiglu: bool = False,
               out: Tensor | None = None, num_rows: int | None = None, config: dict | None = None) -> Tensor:
    """Grouped x @ W_e^T for MXFP4 W; ``packed`` [E, O, I/2] (or [E, O, I/32, 16]); [N, O] in x's dtype."""
    E, O = packed.shape[:2]
    p = _bytes(packed.reshape(E, O, -1))
    return _launch(_MXFP4, x, p, _bytes(scales), None, (E, O, 2 * p.size(2)), offsets_G1, bias, row_scale, gather,
                   swiglu, out, num_rows, config)


def nvfp4_gemm(x: Tensor, packed: Tensor, scales: Tensor, scale_2: Tensor, offsets_G1: Tensor,
               bias: Tensor | None = None, row_scale: Tensor | None = None, gather: Tensor | None = None,
               swiglu: bool = False, out: Tensor | None = None, num_rows: int | None = None,
               config: dict | None = None) -> Tensor:
    """Grouped x @ W_e^T for NVFP4 W; ``packed`` [E, O, I/2], ``scales`` e4m3 [E, O, I/16], ``scale_2``
    fp32 [E]; [N, O] in x's dtype."""
    E, O, IH = packed.shape
    return _launch(_NVFP4, x, _bytes(packed), _bytes(scales), scale_2.float().reshape(E).contiguous(), (E, O, 2 * IH),
                   offsets_G1, bias, row_scale, gather, swiglu, out, num_rows, config)
