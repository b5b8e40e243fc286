"""Matmuls on packed weights. Decode-sized work (at most 16 rows per weight, no autograd, CPU) runs
the fused kernels of ``cpu_kernels`` that decode the weight in registers; larger bf16 inference products on CPU
(prefill) run the grouped bf16 GEMM over panels of 64 output features decoded on the fly into L2
(:func:`panel_gemm`, where the build has that GEMM); everything else dequantizes one Linear / one expert at a
time into the activation's dtype, uses it and drops it -- never a dequantized copy of the whole model or layer.

Legend: N rows, E experts, I input features, O output features.
"""
from __future__ import annotations

import itertools
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ..ops import cpu_kernels
from ..ops.linear_decode import int4_kernel_applies
from ..ops.triton import FLOAT_DTYPES, use_triton
from .act_quant import ACT_QUANT, ActQuant, act_quant_of, fp8_activation_quant, int8_activation_quant
from .base import QuantizedWeight
from .dequantize import dense, packed_codes
from .fp8_block import BlockFP8Weight
from .int4 import INT4Weight
from .mxfp4 import MXFP4Weight
from .nvfp4 import NVFP4Weight

__all__ = ["ACT_QUANT", "ActQuant", "fp8_activation_quant", "int8_activation_quant", "packed_gemv", "int4_kernel_applies",
           "quantized_linear", "quantized_grouped_mm", "panel_gemm"]

INT8_KERNEL_FORMATS = (MXFP4Weight, NVFP4Weight, INT4Weight)  # the formats with int8-activation kernels


def packed_gemv(x_TI: Tensor, w: QuantizedWeight, act_quant: ActQuant | str | None = None) -> Tensor | None:
    """y [T, O] = x [T, I] @ W^T in fp32 straight from the packed bytes (T <= 16, CPU), or None when
    no kernel applies here (other device, too many rows, kernels not built). bf16 x goes to the kernels
    as bf16 where they have AVX512-BF16 (bf16 dot products on the decoded weights, fp32 accumulation);
    other x in fp32. ``act_quant`` ActQuant.INT8: x quantized to int8 per 32 features inside the kernel
    (4-bit formats; None for others); other settings are the caller's (see quantized_linear)."""
    act_quant = act_quant_of(act_quant)
    if (x_TI.device.type != "cpu" or not 1 <= x_TI.size(0) <= cpu_kernels.MAX_ROWS or w.num_leading
            or x_TI.dtype == torch.float64):  # the kernels accumulate in fp32
        return None
    int8 = act_quant is ActQuant.INT8
    if int8 and not isinstance(w, INT8_KERNEL_FORMATS):
        return None
    k = cpu_kernels.load()
    if k is None:
        return None
    acts = k.PackedActs.int8 if int8 else k.PackedActs.exact
    x = x_TI.contiguous() if x_TI.dtype == torch.bfloat16 and k.has_avx512_bf16() else x_TI.float().contiguous()
    if isinstance(w, MXFP4Weight):
        return k.mxfp4_gemv(x, w.blocks, w.scales, acts)
    if isinstance(w, NVFP4Weight):
        return k.nvfp4_gemv(x, w.weight, w.weight_scale.view(torch.uint8), float(w.weight_scale_2), acts)
    if isinstance(w, BlockFP8Weight):
        return k.fp8_block_gemv(x, w.weight.view(torch.uint8), w.scales().contiguous(), w.block[0], w.block[1], acts)
    if isinstance(w, INT4Weight) and int4_kernel_applies(w):
        return k.int4_gemv(x, w.weight_packed.view(torch.uint8), w.weight_scale, w.group_size, acts)
    return None


def panel_gemm(x_NI: Tensor, w: QuantizedWeight, counts: Sequence[int], bias: Tensor | None = None,
               out: Tensor | None = None) -> Tensor | None:
    """Inference y [N, O] = rows sorted by group times each group's packed weight (group g uses expert g % E of a
    [E, O, I] weight; a [O, I] weight is E = 1), + bias [E, O] -- on CPU in bf16, through the grouped GEMM whose
    panels are decoded from the packed bytes as it goes (csrc/panel_decode.h: dense()'s values, each weight read
    once per call, nothing the size of a weight written). Groups whose count is at most ``cpu_kernels.MAX_ROWS``
    are left to the caller (their rows of ``out`` untouched: the decode kernels take them). None where it does
    not apply (no group above the limit, another dtype or device, autograd, a kernel build without the grouped bf16
    GEMM)."""
    counts = [int(c) for c in counts]
    big = [c if c > cpu_kernels.MAX_ROWS else 0 for c in counts]
    if not any(big) or x_NI.dtype != torch.bfloat16 or x_NI.device.type != "cpu" or not _no_grad(x_NI, bias):
        return None
    b = packed_codes(w)
    if b is None:
        return None
    k = cpu_kernels.load()
    O = w.shape[-2]
    if out is None:
        out = x_NI.new_empty(x_NI.size(0), O)
    args = k.RowsGemm()
    args.a, args.packed_b, args.cols, args.counts = x_NI.contiguous(), b, O, big
    if bias is not None:
        args.bias = bias.to(torch.bfloat16).reshape(-1, O).contiguous()
    if big == counts:   # (every group's rows)
        args.out = out
        k.grouped_rows_gemm(args=args)
        return out
    offsets = [0, *itertools.accumulate(counts)]
    rows = torch.cat([torch.arange(offsets[g], offsets[g + 1]) for g, c in enumerate(big) if c])
    args.a_index, args.out = rows, x_NI.new_empty(rows.numel(), O)
    k.grouped_rows_gemm(args=args)
    out.index_copy_(0, rows, args.out)
    return out


def _no_grad(*ts: Tensor | None) -> bool:
    return not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in ts)


def _check(x: Tensor, w: QuantizedWeight, act_quant) -> None:
    if not isinstance(w, QuantizedWeight):
        raise ValueError(f"w must be a QuantizedWeight, got {type(w).__name__}")
    if x.size(-1) != w.shape[-1]:
        raise ValueError(f"x has {x.size(-1)} features but the weight {tuple(w.shape)} expects {w.shape[-1]}")
    act_quant_of(act_quant)


def quantized_linear(x: Tensor, w: QuantizedWeight, bias: Tensor | None = None, act_quant: str | None = None) -> Tensor:
    """x [..., I] @ W^T (+ bias) for a packed W [O, I], with the activations quantized as ``act_quant``
    says (dynamoe.quant.act_quant; None: exact)."""
    _check(x, w, act_quant)
    act_quant = act_quant_of(act_quant)
    if act_quant is ActQuant.FP8:
        x = fp8_activation_quant(x)
    if _no_grad(x, bias):
        x2 = x.reshape(-1, x.size(-1))
        y = packed_gemv(x2, w, act_quant)
        if y is not None:
            y = y if bias is None else y + bias.float()
            return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])
        big = x2.size(0) > cpu_kernels.MAX_ROWS and act_quant is not ActQuant.INT8
        y = panel_gemm(x2, w, [x2.size(0)], bias) if big else None
        if y is not None:
            return y.reshape(*x.shape[:-1], w.shape[0])
    if act_quant is ActQuant.INT8:  # the emulation of the int8 kernels: int8-rounded activations, fp32 matmul
        y = F.linear(int8_activation_quant(x), dense(w, torch.float32), None if bias is None else bias.float())
        return y.to(x.dtype)
    return F.linear(x, dense(w, x.dtype), None if bias is None else bias.to(x.dtype))


def _triton_grouped_mm(x_NI: Tensor, w: QuantizedWeight, counts: list, bias, row_scale, out) -> Tensor | None:
    """dynamoe.ops.triton.quant_gemm: all experts in one launch, tiles decoded in registers; None for
    a format it does not know."""
    from ..ops.triton import quant_gemm
    from ..ops.triton.grouped_gemm import offsets_from_counts
    offsets = offsets_from_counts(counts, x_NI.device)
    kw = dict(bias=None if bias is None else bias.to(x_NI.dtype), row_scale=row_scale, out=out)
    if isinstance(w, BlockFP8Weight):
        return quant_gemm.fp8_block_gemm(x_NI, w.weight, w.weight_scale_inv, offsets, w.block, w.scale_fmt == "ue8m0", **kw)
    if isinstance(w, MXFP4Weight):
        return quant_gemm.mxfp4_gemm(x_NI, w.blocks, w.scales, offsets, **kw)
    if isinstance(w, NVFP4Weight):
        return quant_gemm.nvfp4_gemm(x_NI, w.weight, w.weight_scale, w.weight_scale_2, offsets, **kw)
    return None


def quantized_grouped_mm(x_NI: Tensor, w: QuantizedWeight, counts: Sequence[int], bias: Tensor | None = None,
                         row_scale: Tensor | None = None, out: Tensor | None = None,
                         act_quant: str | None = None) -> Tensor:
    """Rows sorted by expert times each expert's packed weight W_e [O, I] (the Linear layout):
    y_rows(e) = (x_rows(e) @ W_e^T + b_e) * s_rows. ``counts``: E row counts, or k*E with group g using
    expert g % E (as :func:`dynamoe.ops.grouped_mm`; the expert-parallel exchange delivers W source
    blocks of the L local experts); each expert's weight is dequantized at most once per call.
    Differentiable in x, bias and row_scale (the weights are constants); ``out`` is an inference-only
    output buffer."""
    _check(x_NI, w, act_quant)
    act_quant = act_quant_of(act_quant)
    counts = [int(c) for c in counts]
    E = w.shape[0] if w.num_leading == 1 else 0
    if not E or not counts or len(counts) % E or sum(counts) != x_NI.size(0):
        raise ValueError(f"need a [E, O, I] weight and E counts (or a multiple of E) summing to N={x_NI.size(0)}; got "
                         f"weight {tuple(w.shape)}, {len(counts)} counts summing to {sum(counts)}")
    if act_quant is ActQuant.FP8:
        x_NI = fp8_activation_quant(x_NI)
    int8 = act_quant is ActQuant.INT8
    O = w.shape[1]
    track = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x_NI, bias, row_scale))
    if out is not None and track:
        raise ValueError("out= is for inference only (no autograd)")
    if not track and not int8 and x_NI.dtype in FLOAT_DTYPES and use_triton(x_NI, getattr(w, w._tensor_fields()[0])):
        y = _triton_grouped_mm(x_NI, w, counts, bias, row_scale, out)  # --- Triton fast path (GPU inference) ---
        if y is not None:
            return y
    pieces: dict[int, Tensor] = {}
    if not track and out is None:
        out = x_NI.new_empty(x_NI.size(0), O)
    paneled = not track and not int8 and panel_gemm(x_NI, w, counts, bias, out) is not None
    offsets = [0, *itertools.accumulate(counts)]
    for e in range(E):
        w_e = None
        for g in range(e, len(counts), E):
            off, c = offsets[g], counts[g]
            if not c or (paneled and c > cpu_kernels.MAX_ROWS):   # (the panels' groups: done)
                continue
            x_e = x_NI.narrow(0, off, c)
            b_e = None if bias is None else bias[e].to(x_NI.dtype)
            y_e = None if track else packed_gemv(x_e, w[e], act_quant)
            if y_e is not None:  # decode-sized: straight from the packed bytes
                out.narrow(0, off, c).copy_(y_e if b_e is None else y_e + b_e)
                continue
            if int8:  # the int8 kernels' emulation: int8-rounded activations times the fp32 weight
                y_e = F.linear(int8_activation_quant(x_e), dense(w[e], torch.float32),
                               None if b_e is None else b_e.float()).to(x_NI.dtype)
                if track:
                    pieces[g] = y_e
                else:
                    out.narrow(0, off, c).copy_(y_e)
                continue
            if w_e is None:
                w_e = dense(w[e], x_NI.dtype)  # one expert's weight, dropped after its groups
            if track:
                pieces[g] = F.linear(x_e, w_e, b_e)
            elif b_e is None:
                torch.mm(x_e, w_e.t(), out=out.narrow(0, off, c))
            else:
                torch.addmm(b_e, x_e, w_e.t(), out=out.narrow(0, off, c))
    if track:
        y = torch.cat([pieces[g] for g in sorted(pieces)]) if pieces else x_NI.new_zeros(0, O)
        return y if row_scale is None else y * row_scale.to(y.dtype).unsqueeze(1)
    if row_scale is not None:
        out.mul_(row_scale.to(out.dtype).unsqueeze(1))
    return out
