"""A decode step's routed GLU experts in one CPU kernel call (``csrc/moe_decode.cpp``).

At decode (a few tokens, k experts each) the MoE layer's general path -- slot plan, gather, grouped
matmuls, activation, weighted scatter -- costs more in per-op overhead than reading the experts'
weights. :func:`glu_decode` does all of it in one call from the router's choice (``ids`` [T, K],
``weights`` [T, K]): every chosen expert's weights are read once for all its tokens, gate_up and down
run as GEMVs (AVX512-BF16 dot products for bf16 weights, AVX-512 FMAs for fp32; fp32 accumulation),
the activation and the weighted sum per token in fp32.

It applies only where it is exact in meaning: inference (no autograd), CPU, bf16 or fp32 weights with
activations of the same dtype, 1..16 tokens, built-in GLU experts held whole on this process;
:func:`glu_decode` returns None otherwise and the caller runs the general path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import cpu_kernels

__all__ = ["route_decode", "glu_decode", "glu_block_decode", "glu_block_args", "glu_block_with", "ffn_decode",
           "packed_glu_decode", "MAX_TOKENS", "ACT_CODES"]

MAX_TOKENS = 16  # decode batches; a group of more than 8 tokens runs as row chunks of 8
ACT_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "relu": 3, "gpt_oss": 4}


DTYPES = (torch.bfloat16, torch.float32)


def _usable(t: Tensor | None, dtype: torch.dtype) -> bool:
    return t is None or (t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu")


def _router_args(x_TD: Tensor, gate, gate_type: str, top_k: int, n_group: int, topk_group: int):
    """(W, bias, selection bias, kind) of the router kernel, or None where it does not apply."""
    fp32_linear = getattr(gate, "fp32_linear", None)
    if (fp32_linear is None or not 1 <= x_TD.size(0) <= MAX_TOKENS
            or x_TD.device.type != "cpu" or x_TD.dtype not in DTYPES or torch.is_grad_enabled()):
        return None
    lin = fp32_linear()
    if lin is None:
        return None
    w, b = lin
    E = w.size(0)
    if w.device.type != "cpu" or w.dtype not in DTYPES or not w.is_contiguous() or not 1 <= top_k <= E:
        return None
    if gate_type == "sigmoid" and 1 < n_group and topk_group < n_group and (
            E % n_group or not 1 <= topk_group or topk_group * (E // n_group) < top_k):
        return None  # the general path raises the clear error
    if gate_type != "sigmoid" and ((1 < n_group and topk_group < n_group)
                                   or getattr(gate, "e_score_correction_bias", None) is not None):
        return None  # group-limited or biased softmax (DeepSeek-V2, ERNIE-4.5): the kernel's softmax router has neither
    sel = getattr(gate, "e_score_correction_bias", None) if gate_type == "sigmoid" else None
    return (w, None if b is None else b.float().contiguous(), None if sel is None else sel.float().contiguous(),
            1 if gate_type == "sigmoid" else 0)


def route_decode(x_TD: Tensor, gate, gate_type: str, top_k: int, renormalize: bool, scale: float = 1.0,
                 n_group: int = 1, topk_group: int = 1) -> tuple[Tensor, Tensor] | None:
    """(ids [T, K] int64, weights [T, K] fp32) of a decode step's router in one kernel call: logits
    x W^T (+ bias) in fp32, then :func:`dynamoe.ops.routing.softmax_topk` (``gate_type`` 'top' or
    'custom', as dynamoe.moe.gates.route) or :func:`~dynamoe.ops.routing.sigmoid_group_topk` ('sigmoid', with the gate's
    ``e_score_correction_bias``), weights times ``scale``. ``gate`` must offer ``fp32_linear()`` ->
    (W, bias) (LinearGate with fp32_gate, GPT-OSS's router). None where that does not apply: other
    gates, T outside 1..16, autograd, non-CPU, other dtypes."""
    args = _router_args(x_TD, gate, gate_type, top_k, n_group, topk_group)
    k = None if args is None else cpu_kernels.load()
    if k is None:
        return None
    T = x_TD.size(0)
    ids = torch.empty(T, top_k, dtype=torch.long)
    weights = torch.empty(T, top_k, dtype=torch.float32)
    k.route_decode_out(x_TD.contiguous(), *args, bool(renormalize), float(scale), int(n_group), int(topk_group),
                       ids, weights)
    return ids, weights


def _glu_args(x_TD: Tensor, experts):
    """(gate_up, down, gate_up bias, down bias, act, alpha, limit) of the GLU experts kernel, or None."""
    if (not 1 <= x_TD.size(0) <= MAX_TOKENS or x_TD.device.type != "cpu" or x_TD.dtype not in DTYPES
            or torch.is_grad_enabled() or experts.activation not in ACT_CODES):
        return None
    ws = (experts.gate_up_proj, experts.down_proj, experts.gate_up_proj_bias, experts.down_proj_bias)
    if not all(_usable(t, x_TD.dtype) for t in ws):
        return None
    return (*ws, ACT_CODES[experts.activation], float(experts.alpha), float(experts.limit))


def glu_decode(x_TD: Tensor, ids_TK: Tensor, weights_TK: Tensor, experts) -> tuple[Tensor, Tensor, int] | None:
    """(y [T, O] in x's dtype, load [E] int64, max load) for GLU ``experts`` (``gate_up_proj`` [E, 2F, D],
    ``down_proj`` [E, O, F], optional biases, ``activation``/``alpha``/``limit``), or None when the
    kernel does not apply (see the module docstring)."""
    args = _glu_args(x_TD, experts)
    k = None if args is None else cpu_kernels.load()
    if k is None:
        return None
    x = x_TD if x_TD.is_contiguous() else x_TD.contiguous()
    out = x.new_empty(x.size(0), args[1].size(1))
    load = torch.empty(args[0].size(0), dtype=torch.long)
    max_load = k.moe_glu_decode_out(x, ids_TK.to(torch.long).contiguous(), weights_TK.to(torch.float32).contiguous(),
                                    *args, out, load)
    return out, load, max_load


def glu_block_args(h_TD: Tensor, norm_weight: Tensor, norm_eps: float, norm_weight_in_fp32: bool, gate,
                   gate_type: str, top_k: int, renormalize: bool, scale: float, n_group: int, topk_group: int,
                   experts) -> tuple | None:
    """Everything :func:`glu_block_decode`'s kernel call reads besides h, out and load, in its order
    (the router's bias and selection bias as fp32 copies where they are not fp32 already), for steps
    like ``h_TD``; None where it does not apply."""
    if (norm_weight.dtype != h_TD.dtype or not norm_weight.is_contiguous() or norm_weight.device.type != "cpu"
            or norm_weight.numel() != h_TD.size(-1)):
        return None
    rargs = _router_args(h_TD, gate, gate_type, top_k, n_group, topk_group)
    gargs = None if rargs is None else _glu_args(h_TD, experts)
    if gargs is None or gargs[1].size(1) != h_TD.size(1) or rargs[0].size(1) != h_TD.size(1):
        return None
    return (norm_weight, float(norm_eps), bool(norm_weight_in_fp32), *rargs, bool(renormalize), float(scale),
            int(n_group), int(topk_group), int(top_k), *gargs)


def glu_block_with(kernels, args: tuple, h_TD: Tensor) -> tuple[Tensor, Tensor, int]:
    """The kernel call of :func:`glu_block_decode` with ``args`` from :func:`glu_block_args` (h [T, D]
    contiguous): (h + y, load [E] int64, max load)."""
    out = torch.empty_like(h_TD)
    load = torch.empty(args[12].size(0), dtype=torch.long)
    return out, load, kernels.moe_block_glu_decode_out(h_TD, *args, out, load)


def glu_block_decode(h_TD: Tensor, norm_weight: Tensor, norm_eps: float, norm_weight_in_fp32: bool, gate,
                     gate_type: str, top_k: int, renormalize: bool, scale: float, n_group: int, topk_group: int,
                     experts) -> tuple[Tensor, Tensor, int] | None:
    """(h + y [T, D], load [E] int64, max load): a decode step's whole MoE sub-block in one kernel call
    (csrc/moe_block_decode.cpp) -- RMSNorm of the residual stream ``h`` (see dynamoe.models.norms),
    :func:`route_decode`, :func:`glu_decode`, and the residual added, with the same roundings as those
    calls one after another. None where one of them would not apply, or the experts' output is not
    [T, D], or the norm weight is not contiguous of h's dtype."""
    if not h_TD.is_contiguous():
        return None
    args = glu_block_args(h_TD, norm_weight, norm_eps, norm_weight_in_fp32, gate, gate_type, top_k, renormalize, scale,
                          n_group, topk_group, experts)
    k = None if args is None else cpu_kernels.load()
    return None if k is None else glu_block_with(k, args, h_TD)


def ffn_decode(x_TD: Tensor, ids_TK: Tensor, weights_TK: Tensor, experts) -> tuple[Tensor, Tensor, int] | None:
    """:func:`glu_decode` for FFN experts in Tutel's layout (``batched_fc1_w`` [E, F, D], ``batched_fc2_w``
    [E, F, O], optional biases; ReLU, GELU or SiLU): fc1 as GEMVs, fc2 as row-scaled sums of its rows."""
    T = x_TD.size(0)
    act = {F.relu: 3, F.gelu: 1, F.silu: 0}.get(experts.activation_fn)
    if (act is None or not 1 <= T <= MAX_TOKENS or x_TD.device.type != "cpu" or x_TD.dtype not in DTYPES
            or torch.is_grad_enabled()):
        return None
    w1, w2, b1, b2 = experts.batched_fc1_w, experts.batched_fc2_w, experts.batched_fc1_bias, experts.batched_fc2_bias
    if not all(_usable(t, x_TD.dtype) for t in (w1, w2, b1, b2)):
        return None
    k = cpu_kernels.load()
    if k is None:
        return None
    x = x_TD if x_TD.is_contiguous() else x_TD.contiguous()
    out = x.new_empty(T, w2.size(2))
    load = torch.empty(w1.size(0), dtype=torch.long)
    max_load = k.moe_ffn_decode_out(x, ids_TK.to(torch.long).contiguous(), weights_TK.to(torch.float32).contiguous(),
                                    w1, w2, b1, b2, act, out, load)
    return out, load, max_load


PACKED_FORMATS = {"fp8_block": 0, "mxfp4": 1, "nvfp4": 2, "int4": 3}  # keep in sync with csrc/moe_decode_packed.cpp


def _packed_fields(w) -> tuple[Tensor, Tensor, Tensor, int, int]:
    """(a, b, c, block0, block1) of a stacked packed weight, as csrc/moe_decode_packed.cpp takes them."""
    fmt = w.format
    if fmt == "fp8_block":
        return w.weight.view(torch.uint8), w.scales().contiguous(), torch.empty(0), w.block[0], w.block[1]
    if fmt == "mxfp4":
        return w.blocks, w.scales, torch.empty(0), 1, 1
    if fmt == "int4":  # the int32 words as their bytes (the FP4 nibble order); block0 = the group size
        return w.weight_packed.view(torch.uint8), w.weight_scale, torch.empty(0), w.group_size, 1
    return (w.weight, w.weight_scale.view(torch.uint8), w.weight_scale_2.float().reshape(-1).contiguous(), 1, 1)


def packed_glu_decode(x_TD: Tensor, ids_TK: Tensor, weights_TK: Tensor, experts) -> tuple[Tensor, Tensor, int] | None:
    """:func:`glu_decode` for packed experts (dynamoe.quant.QuantizedExperts of kind 'glu' in blockwise
    FP8, MXFP4, NVFP4 or INT4, no activation quantization): the packed bytes are decoded in registers. bf16
    activations (where the kernels have AVX512-BF16) stay bf16: the weights are decoded into bf16 and
    multiplied with bf16 dot products, fp32 accumulation, the GLU output rounded to bf16 before the down
    projection (as bf16 experts do); other activations run in fp32 inside the kernel. The output comes
    back in x's dtype. None where it does not apply."""
    T = x_TD.size(0)
    if (not 1 <= T <= MAX_TOKENS or x_TD.device.type != "cpu" or not x_TD.is_floating_point()
            or x_TD.dtype == torch.float64 or torch.is_grad_enabled() or getattr(experts, "kind", None) != "glu"
            or getattr(experts, "act_quant", None) is not None or experts.glu_kind not in ACT_CODES):
        return None
    w1, w2 = experts.w1, experts.w2
    if w1.format not in PACKED_FORMATS or w2.format != w1.format or w1.device.type != "cpu":
        return None
    if w1.format == "fp8_block" and tuple(w1.block) != tuple(w2.block):
        return None
    if w1.format == "int4" and (w1.group_size != w2.group_size or not all(
            w.shape[-1] % 16 == 0 and w.group_size % 16 == 0 and w.weight_packed.is_contiguous()
            and w.weight_scale.is_contiguous() for w in (w1, w2))):
        return None  # the kernel's INT4 rows take whole groups of 16 elements (dynamoe.quant.matmul.int4_kernel_applies)
    k = cpu_kernels.load()
    if k is None:
        return None
    a1, b1, c1, blk0, blk1 = _packed_fields(w1)
    a2, b2, c2, _, _ = _packed_fields(w2)
    bias1 = None if experts.b1 is None else experts.b1.float().contiguous()
    bias2 = None if experts.b2 is None else experts.b2.float().contiguous()
    bf16_acts = x_TD.dtype == torch.bfloat16 and k.has_avx512_bf16()
    x = x_TD.contiguous() if bf16_acts else x_TD.float().contiguous()
    out = torch.empty(T, w2.shape[1], dtype=torch.float32)
    load = torch.empty(w1.shape[0], dtype=torch.long)
    max_load = k.packed_moe_glu_decode_out(PACKED_FORMATS[w1.format], x, ids_TK.to(torch.long).contiguous(),
                                           weights_TK.to(torch.float32).contiguous(), a1, b1, c1, a2, b2, c2, blk0,
                                           blk1, bias1, bias2, ACT_CODES[experts.glu_kind], float(experts.alpha),
                                           float(experts.limit), out, load, bf16_acts)
    return out.to(x_TD.dtype), load, max_load
