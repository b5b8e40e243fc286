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
from .activations import relu_squared
from .fused import MAX_ROWS, Holds, RMSNormSpec, Unfusable, struct
from .linear_decode import PACKED_FORMATS, int4_kernel_applies, packed_acts, packed_fields

__all__ = ["route_decode", "glu_decode", "ffn_decode", "packed_glu_decode", "moe_weights", "moe_decode_with",
           "glu_mlp_fields", "dense_mlp_weights"]

#: FFN activations (Tutel's experts hold the function) by their kernels.Activation name
_FFN_ACTS = {F.relu: "relu", F.gelu: "gelu", F.silu: "silu", relu_squared: "relu2"}


def _code(kernels, name: str) -> int:
    """The kernels' int code of activation ``name`` (csrc/decode_weights.h's Activation)."""
    return int(kernels.Activation.__members__[name])


DTYPES = (torch.bfloat16, torch.float32)


def _usable(t: Tensor | None, dtype: torch.dtype) -> bool:
    return t is None or (t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu")


def _router_args(x_TD: Tensor, gate, gate_type: str, top_k: int, n_group: int, topk_group: int):
    """(W, bias, selection bias, kind) of the router kernel, or None where it does not apply."""
    fp32_linear = getattr(gate, "fp32_linear", None)
    if gate_type not in ("top", "sigmoid", "custom"):  # the kernel's routers: softmax top-k (custom gates route so) and sigmoid
        return None
    if (fp32_linear is None or not 1 <= x_TD.size(0) <= MAX_ROWS
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
    return w, b, sel, gate_type == "sigmoid"


def _group_rank_refusal(n_group: int, topk_group: int, group_rank: str) -> str | None:
    """Why the router kernel cannot rank the expert groups by ``group_rank``, or None where it can: the
    kernel knows DeepSeek's group rules only (csrc/decode_weights.h), not Mistral-4's 'top2_sum' of softmax
    probabilities; without group limiting (topk_group >= n_group) the ranking does not matter."""
    if group_rank == "max" or not 1 < n_group or topk_group >= n_group:
        return None
    return (f"group_rank={group_rank!r} (experts' groups ranked by the sum of their two best probabilities: "
            f"Mistral-4) with n_group={n_group} > topk_group={topk_group} has no router kernel")


def _f32(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.float().contiguous()


def route_decode(x_TD: Tensor, gate, gate_type: str, top_k: int, renormalize: bool, scale: float = 1.0,
                 n_group: int = 1, topk_group: int = 1, group_rank: str = "max") -> tuple[Tensor, Tensor] | None:
    """(ids [T, K] int64, weights [T, K] fp32) of a decode step's router in one kernel call: logits
    x W^T (+ bias) in fp32, then :func:`dynamoe.ops.routing.softmax_topk` (``gate_type`` 'top' or
    'custom', as dynamoe.moe.gates.route) or :func:`~dynamoe.ops.routing.sigmoid_group_topk` ('sigmoid', with the gate's
    ``e_score_correction_bias``), weights times ``scale``. ``gate`` must offer ``fp32_linear()`` ->
    (W, bias) (LinearGate with fp32_gate, GPT-OSS's router). None where that does not apply: other
    gates, T outside 1..16, autograd, non-CPU, other dtypes, a ``group_rank`` other than 'max' that limits
    the groups (GateConfig.group_rank)."""
    if _group_rank_refusal(n_group, topk_group, group_rank) is not None:
        return None
    args = _router_args(x_TD, gate, gate_type, top_k, n_group, topk_group)
    k = None if args is None else cpu_kernels.load()
    if k is None:
        return None
    T = x_TD.size(0)
    ids = torch.empty(T, top_k, dtype=torch.long)
    weights = torch.empty(T, top_k, dtype=torch.float32)
    w, b, sel, sigmoid = args
    kind = k.RouterKind.sigmoid if sigmoid else k.RouterKind.softmax
    k.route_decode_out(x_TD.contiguous(), w, _f32(b), _f32(sel), int(kind), bool(renormalize), float(scale),
                       int(n_group), int(topk_group), ids, weights)
    return ids, weights


def _glu_args(kernels, x_TD: Tensor, experts):
    """(gate_up, down, gate_up bias, down bias, act, alpha, limit) of the GLU experts kernel, or None."""
    if (not 1 <= x_TD.size(0) <= MAX_ROWS or x_TD.device.type != "cpu" or x_TD.dtype not in DTYPES
            or torch.is_grad_enabled() or experts.activation not in kernels.Activation.__members__):
        return None
    ws = (experts.gate_up_proj, experts.down_proj, experts.gate_up_proj_bias, experts.down_proj_bias)
    if not all(_usable(t, x_TD.dtype) for t in ws):
        return None
    return (*ws, _code(kernels, experts.activation), float(experts.alpha), float(experts.limit))


def glu_decode(x_TD: Tensor, ids_TK: Tensor, weights_TK: Tensor, experts) -> tuple[Tensor, Tensor, int] | None:
    """(y [T, O] in x's dtype, load [E] int64, max load) for GLU ``experts`` (``gate_up_proj`` [E, 2F, D],
    ``down_proj`` [E, O, F], optional biases, ``activation``/``alpha``/``limit``), or None when the
    kernel does not apply (see the module docstring)."""
    k = cpu_kernels.load()
    args = None if k is None else _glu_args(k, x_TD, experts)
    if args is None:
        return None
    x = x_TD if x_TD.is_contiguous() else x_TD.contiguous()
    out = x.new_empty(x.size(0), args[1].size(1))
    load = torch.empty(args[0].size(0), dtype=torch.long)
    max_load = k.moe_glu_decode_out(x, ids_TK.to(torch.long).contiguous(), weights_TK.to(torch.float32).contiguous(),
                                    *args, out, load)
    return out, load, max_load


def _expert_fields(kernels, holds: Holds, h_TD: Tensor, kind: str, experts) -> dict:
    """The routed experts' part of a ``kernels.MoEWeights``: ``kind`` 'glu' / 'ffn' (dense GLUExperts /
    FFNExperts) or 'packed' (dynamoe.quant.QuantizedExperts of GLU kind)."""
    for d in (experts._parameters, experts._buffers):  # every tensor the experts hold: reassigning one is a change
        holds.refs.extend((d, k, v) for k, v in d.items())
    dt = h_TD.dtype
    if kind == "glu":
        act = holds.attr(experts, "activation")
        if act not in kernels.Activation.__members__:
            raise Unfusable(f"GLU activation {act!r} has no kernel")
        ws = [experts._parameters.get(n) for n in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")]
        if not all(_usable(t, dt) for t in ws):
            raise Unfusable(f"expert weights are not contiguous {dt} CPU tensors")
        return dict(kind=kernels.ExpertKind.glu, format=kernels.WeightFormat.dense, act=kernels.Activation.__members__[act],
                    alpha=float(holds.attr(experts, "alpha")), limit=float(holds.attr(experts, "limit")),
                    w1=ws[0], w2=ws[1], b1=ws[2], b2=ws[3])
    if kind == "ffn":
        act = _FFN_ACTS.get(holds.attr(experts, "activation_fn"))
        if act is None:
            raise Unfusable("FFN activation other than ReLU, GELU, SiLU or relu2")
        ws = [experts._parameters.get(n) for n in ("batched_fc1_w", "batched_fc2_w", "batched_fc1_bias", "batched_fc2_bias")]
        if not all(_usable(t, dt) for t in ws):
            raise Unfusable(f"expert weights are not contiguous {dt} CPU tensors")
        return dict(kind=kernels.ExpertKind.ffn, format=kernels.WeightFormat.dense, act=kernels.Activation.__members__[act],
                    w1=ws[0], w2=ws[1], b1=ws[2], b2=ws[3])
    reason = _packed_refusal(kernels, experts, h_TD)
    if reason:
        raise Unfusable(reason)
    for t in experts._buffers.values():  # the struct holds tensors derived from them (scales, views)
        holds.derived(t)
    w1, w2 = experts.w1, experts.w2
    a1, b1, c1, blk0, blk1 = packed_fields(w1)
    a2, b2, c2, _, _ = packed_fields(w2)
    return dict(kind=kernels.ExpertKind.glu, format=kernels.WeightFormat.__members__[w1.format],
                act=kernels.Activation.__members__[holds.attr(experts, "glu_kind")],
                alpha=float(holds.attr(experts, "alpha")), limit=float(holds.attr(experts, "limit")),
                w1=a1, w1b=b1, w1c=c1, w2=a2, w2b=b2, w2c=c2, blk0=int(blk0), blk1=int(blk1),
                b1=holds.fp32(experts.b1), b2=holds.fp32(experts.b2),
                bf16_acts=bool(dt == torch.bfloat16 and kernels.has_avx512_bf16()),
                acts=packed_acts(kernels, holds.attr(experts, "act_quant"), w1.format))


def glu_mlp_fields(kernels, holds: Holds, dtype: torch.dtype, gate_up: tuple, down, act: str, alpha: float = 1.702,
                   limit: float = 7.0, gate=None) -> dict:
    """The shared-experts part of a ``kernels.MoEWeights`` for a dense GLU MLP: ``gate_up`` the stacked (weight
    [2S, D], bias) of its gate and up projections (dynamoe.ops.stacked_linears), ``down`` its down linear,
    ``gate`` an optional [1, D] linear whose sigmoid scales the output per token (Qwen2-MoE)."""
    if act not in kernels.Activation.__members__:
        raise Unfusable(f"GLU activation {act!r} has no kernel")
    w1, b1 = gate_up
    w2, b2 = holds.param(down, "weight"), holds.param(down, "bias")
    g = None if gate is None else holds.param(gate, "weight")
    if gate is not None and holds.param(gate, "bias") is not None:
        raise Unfusable("the shared experts' gate has a bias")
    if not all(_usable(t, dtype) for t in (w1, b1, w2, b2, g)) or w2.size(1) * 2 != w1.size(0):
        raise Unfusable(f"the dense MLP's weights are not contiguous {dtype} CPU tensors of matching shapes")
    return dict(shared_w1=w1.unsqueeze(0), shared_w2=w2.unsqueeze(0), shared_b1=None if b1 is None else b1.unsqueeze(0),
                shared_b2=None if b2 is None else b2.unsqueeze(0), shared_gate=g,
                shared_act=kernels.Activation.__members__[act], shared_alpha=float(alpha), shared_limit=float(limit))


def dense_mlp_weights(kernels, holds: Holds, h_TD: Tensor, fields: dict, norm: RMSNormSpec):
    """A ``kernels.MoEWeights`` without a router for a dense layer's ``h + mlp(norm(h))`` (``fields`` from
    :func:`glu_mlp_fields`)."""
    _check_rows(h_TD)
    return struct(kernels.MoEWeights, holds, routed=False, **_norm_fields(h_TD, norm, fields["shared_w2"].size(1)),
                  **fields)


def _check_rows(h_TD: Tensor) -> None:
    if not 1 <= h_TD.size(0) <= MAX_ROWS or h_TD.device.type != "cpu" or h_TD.dtype not in DTYPES:
        raise Unfusable(f"{h_TD.size(0)} rows of {h_TD.dtype} on {h_TD.device.type} (the kernels take 1..{MAX_ROWS} "
                        "rows of bf16 or fp32 on the CPU)")


def _norm_fields(h_TD: Tensor, norm: RMSNormSpec, out_dim: int) -> dict:
    nw = norm.weight
    if nw.dtype != h_TD.dtype or not nw.is_contiguous() or nw.device.type != "cpu" or nw.numel() != h_TD.size(-1):
        raise Unfusable(f"the norm weight is not a contiguous {h_TD.dtype} [D] CPU tensor")
    if out_dim != h_TD.size(1):
        raise Unfusable(f"the experts' output dim {out_dim} is not the model dim (no residual)")
    return dict(norm_w=nw, norm_eps=float(norm.eps), norm_fp32=bool(norm.weight_in_fp32),
                norm_zero_centered=bool(norm.zero_centered), residual=True)


def moe_weights(kernels, holds: Holds, h_TD: Tensor, gate, gate_type: str, top_k: int, renormalize: bool,
                scale: float, n_group: int, topk_group: int, kind: str, experts, norm: RMSNormSpec | None = None,
                shared: dict | None = None, group_rank: str = "max"):
    """A ``kernels.MoEWeights`` for decode steps like ``h_TD`` [T, D] through the router ``gate`` (one that
    offers ``fp32_linear()``) and ``experts`` of ``kind`` ('glu', 'ffn', 'packed'), with ``norm`` first and
    the residual added when given (a decoder layer's MoE sub-block), and the shared experts' ``shared``
    fields (:func:`glu_mlp_fields`) added to the routed output; what it read goes into ``holds``.
    ``group_rank``: the gate's GateConfig.group_rank (the kernel has 'max' only, where groups are limited).
    Raises :class:`~dynamoe.ops.fused.Unfusable` with the reason where the kernel does not apply."""
    _check_rows(h_TD)
    reason = _group_rank_refusal(n_group, topk_group, group_rank)
    if reason is not None:
        raise Unfusable(reason)
    rargs = _router_args(h_TD, gate, gate_type, top_k, n_group, topk_group)
    if rargs is None:
        raise Unfusable(f"router ({gate_type}, {type(gate).__name__}) has no kernel: logits must be an fp32 "
                        "linear, softmax top-k without groups or selection bias, or DeepSeek's sigmoid routing "
                        "(not SparseMixer)")
    w, b, sel, router = rargs
    for m in (gate, *gate.children()):
        holds.refs.extend((m._parameters, k, v) for k, v in m._parameters.items())
        holds.refs.extend((m._buffers, k, v) for k, v in m._buffers.items())
    fields = _expert_fields(kernels, holds, h_TD, kind, experts)
    out_dim = fields["w2"].size(1) if kind != "ffn" else fields["w2"].size(2)
    if w.size(1) != h_TD.size(1):
        raise Unfusable(f"router input dim {w.size(1)} is not the model dim {h_TD.size(1)}")
    if shared is not None:
        if shared["shared_w2"].size(1) != out_dim:
            raise Unfusable(f"the shared experts' output dim {shared['shared_w2'].size(1)} is not the routed ones' {out_dim}")
        fields.update(shared)
    if norm is not None:
        fields.update(_norm_fields(h_TD, norm, out_dim))
    return struct(kernels.MoEWeights, holds, gate_w=w, gate_bias=holds.fp32(b), sel_bias=holds.fp32(sel),
                  router=kernels.RouterKind.sigmoid if router else kernels.RouterKind.softmax,
                  renormalize=bool(renormalize), route_scale=float(scale), n_group=int(n_group),
                  topk_group=int(topk_group), top_k=int(top_k), **fields)


def moe_decode_with(kernels, weights, h_TD: Tensor) -> tuple[Tensor, Tensor, int]:
    """(y [T, O] -- h + y with the norm and residual --, load [E] int64, max load): one call of the MoE
    kernel (csrc/moe_block_decode.cpp) with ``weights`` from :func:`moe_weights`, h [T, D] contiguous."""
    O = (h_TD.size(1) if weights.residual else weights.shared_w2.size(1) if not weights.routed
         else weights.w2.size(2) if weights.kind == kernels.ExpertKind.ffn else weights.w2.size(1))
    out = h_TD.new_empty(h_TD.size(0), O)
    load = torch.empty(weights.num_experts, dtype=torch.long)
    return out, load, kernels.moe_decode_out(h_TD, weights, out, load)


def ffn_decode(x_TD: Tensor, ids_TK: Tensor, weights_TK: Tensor, experts) -> tuple[Tensor, Tensor, int] | None:
    """:func:`glu_decode` for FFN experts in Tutel's layout (``batched_fc1_w`` [E, F, D], ``batched_fc2_w``
    [E, F, O], optional biases; ReLU, GELU, SiLU or relu2): fc1 as GEMVs, fc2 as row-scaled sums of its rows."""
    T = x_TD.size(0)
    act = _FFN_ACTS.get(experts.activation_fn)
    if (act is None or not 1 <= T <= MAX_ROWS or x_TD.device.type != "cpu" or x_TD.dtype not in DTYPES
            or torch.is_grad_enabled()):
        return None
    w1, w2, b1, b2 = experts.batched_fc1_w, experts.batched_fc2_w, experts.batched_fc1_bias, experts.batched_fc2_bias
    if not all(_usable(t, x_TD.dtype) for t in (w1, w2, b1, b2)):
        return None
    k = cpu_kernels.load()
    if k is None:
        return None
    act = _code(k, act)
    x = x_TD if x_TD.is_contiguous() else x_TD.contiguous()
    out = x.new_empty(T, w2.size(2))
    load = torch.empty(w1.size(0), dtype=torch.long)
    max_load = k.moe_ffn_decode_out(x, ids_TK.to(torch.long).contiguous(), weights_TK.to(torch.float32).contiguous(),
                                    w1, w2, b1, b2, act, out, load)
    return out, load, max_load


#: the packed formats the kernels decode (csrc/decode_weights.h's WeightFormat but dense)
def _packed_refusal(kernels, experts, x_TD: Tensor) -> str | None:
    """Why the packed GLU experts kernel does not apply to ``experts`` for steps like ``x_TD`` (None: it does)."""
    T = x_TD.size(0)
    if not 1 <= T <= MAX_ROWS or x_TD.device.type != "cpu" or not x_TD.is_floating_point() or x_TD.dtype == torch.float64:
        return f"{T} rows of {x_TD.dtype} on {x_TD.device.type}"
    if torch.is_grad_enabled():
        return "autograd is on"
    acts = kernels.Activation.__members__
    if getattr(experts, "kind", None) != "glu" or experts.glu_kind not in acts:
        return f"packed {getattr(experts, 'kind', None)} experts (the kernel takes GLU experts with {', '.join(acts)})"
    w1, w2 = experts.w1, experts.w2
    if packed_acts(kernels, getattr(experts, "act_quant", None), w1.format) is None:
        return f"activation quantization '{experts.act_quant.value}' with {w1.format} weights (simulated by the general path)"
    if w1.format not in PACKED_FORMATS or w2.format != w1.format or w1.device.type != "cpu":
        return f"packed formats {w1.format}/{w2.format} on {w1.device.type}"
    if w1.format == "fp8_block" and tuple(w1.block) != tuple(w2.block):
        return "FP8 block sizes differ between the projections"
    if w1.format == "int4" and (w1.group_size != w2.group_size or not all(int4_kernel_applies(w) for w in (w1, w2))):
        return "INT4 groups not whole multiples of 16 elements"
    return None


def packed_glu_decode(x_TD: Tensor, ids_TK: Tensor, weights_TK: Tensor, experts) -> tuple[Tensor, Tensor, int] | None:
    """:func:`glu_decode` for packed experts (dynamoe.quant.QuantizedExperts of kind 'glu' in blockwise
    FP8, MXFP4, NVFP4 or INT4, exact activations or act_quant 'int8'): the packed bytes are decoded in registers.
    bf16 activations (where the kernels have AVX512-BF16) stay bf16: the weights are decoded into bf16 and
    multiplied with bf16 dot products, fp32 accumulation, the GLU output rounded to bf16 before the down
    projection (as bf16 experts do); other activations run in fp32 inside the kernel. With act_quant 'int8'
    (4-bit formats) x and the GLU output (rounded to bf16 first for bf16 x) are quantized to int8 per 32
    features for VNNI dot products (csrc/packed_int8.h). The output comes back in x's dtype. None where it
    does not apply."""
    T = x_TD.size(0)
    k = cpu_kernels.load()
    if k is None or _packed_refusal(k, experts, x_TD) is not None:
        return None
    w1, w2 = experts.w1, experts.w2
    acts = packed_acts(k, getattr(experts, "act_quant", None), w1.format)
    a1, b1, c1, blk0, blk1 = packed_fields(w1)
    a2, b2, c2, _, _ = packed_fields(w2)
    bias1 = None if experts.b1 is None else experts.b1.float().contiguous()
    bias2 = None if experts.b2 is None else experts.b2.float().contiguous()
    bf16_acts = x_TD.dtype == torch.bfloat16 and k.has_avx512_bf16()
    x = x_TD.contiguous() if bf16_acts else x_TD.float().contiguous()
    out = torch.empty(T, w2.shape[1], dtype=torch.float32)
    load = torch.empty(w1.shape[0], dtype=torch.long)
    max_load = k.packed_moe_glu_decode_out(int(k.WeightFormat.__members__[w1.format]), x, ids_TK.to(torch.long).contiguous(),
                                           weights_TK.to(torch.float32).contiguous(), a1, b1, c1, a2, b2, c2, blk0,
                                           blk1, bias1, bias2, _code(k, experts.glu_kind), float(experts.alpha),
                                           float(experts.limit), out, load, bf16_acts, acts)
    return out.to(x_TD.dtype), load, max_load
