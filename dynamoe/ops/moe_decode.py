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
from torch import Tensor

from . import cpu_kernels

__all__ = ["glu_decode", "MAX_TOKENS", "ACT_CODES"]

MAX_TOKENS = 16  # decode batches; a group of more than 8 tokens runs as row chunks of 8
ACT_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "relu": 3, "gpt_oss": 4}


DTYPES = (torch.bfloat16, torch.float32)


def _usable(t: Tensor | None, dtype: torch.dtype) -> bool:
    return t is None or (t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu")


def glu_decode(x_TD: Tensor, ids_TK: Tensor, weights_TK: Tensor, experts) -> tuple[Tensor, Tensor, int] | None:
    """(y [T, O] in x's dtype, load [E] int64, max load) for GLU ``experts`` (``gate_up_proj`` [E, 2F, D],
    ``down_proj`` [E, O, F], optional biases, ``activation``/``alpha``/``limit``), or None when the
    kernel does not apply (see the module docstring)."""
    T = x_TD.size(0)
    if (not 1 <= T <= MAX_TOKENS or x_TD.device.type != "cpu" or x_TD.dtype not in DTYPES
            or torch.is_grad_enabled() or experts.activation not in ACT_CODES):
        return None
    wgu, wd = experts.gate_up_proj, experts.down_proj
    bgu, bd = experts.gate_up_proj_bias, experts.down_proj_bias
    if not all(_usable(t, x_TD.dtype) for t in (wgu, wd, bgu, bd)):
        return None
    k = cpu_kernels.load()
    if k is None:
        return None
    x = x_TD if x_TD.is_contiguous() else x_TD.contiguous()
    ids = ids_TK.to(torch.long).contiguous()
    w = weights_TK.to(torch.float32).contiguous()
    out = x.new_empty(T, wd.size(1))
    load = torch.empty(wgu.size(0), dtype=torch.long)
    max_load = k.moe_glu_decode_out(x, ids, w, wgu, wd, bgu, bd, ACT_CODES[experts.activation],
                                    float(experts.alpha), float(experts.limit), out, load)
    return out, load, max_load
