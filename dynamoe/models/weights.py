"""Routed experts on disk -> the MoE layer's layout, dense or packed.

Legend: E experts, F expert hidden dim, D model dim.

Our layout (dynamoe GLUExperts / QuantizedExperts): ``w1`` = gate_up [E, 2F, D] (gate rows, then up
rows), ``w2`` = down [E, D, F], optional biases b1 [E, 2F], b2 [E, D]. On disk:

* :class:`PerExpert` -- one 2D Linear per expert and projection (Qwen3-MoE / DeepSeek / GLM:
  ``experts.{e}.gate_proj|up_proj|down_proj.weight``; Mixtral: ``experts.{e}.w1|w3|w2.weight``).
* :class:`FusedInterleaved` -- GPT-OSS: ``experts.gate_up_proj`` [E, D, 2F] stored in->out with
  gate/up columns interleaved, ``experts.down_proj`` [E, F, D], biases ``gate_up_proj_bias`` [E, 2F]
  (interleaved), ``down_proj_bias`` [E, D]; MXFP4 checkpoints store the two weights out->in
  (``*_blocks`` / ``*_scales``).

Readers stream: the dense result is allocated once in the target dtype and filled one expert (or
one tensor) at a time; packed weights stay packed (:mod:`dynamoe.quant.checkpoint`).
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import Tensor

from ..quant.base import QuantizedWeight
from ..quant.checkpoint import QuantConfig, concat_out, deinterleave_gate_up, read_weight, stack_experts

__all__ = ["PerExpert", "FusedInterleaved", "ExpertWeights", "read_experts", "check_shape"]

log = logging.getLogger(__name__)
Weight = Union[Tensor, QuantizedWeight]


def check_shape(name: str, found, expected) -> None:
    found, expected = tuple(found), tuple(expected)
    if found != expected:
        raise ValueError(f"tensor {name!r}: expected shape {expected}, found {found}")


@dataclass(frozen=True)
class PerExpert:
    """``{prefix}.{e}.{gate}.weight``, ``.{up}.weight``, ``.{down}.weight`` for e in 0..E-1."""

    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"


@dataclass(frozen=True)
class FusedInterleaved:
    """GPT-OSS's fused experts (see the module docstring)."""


@dataclass
class ExpertWeights:
    w1: Weight                 # [E, 2F, D]
    w2: Weight                 # [E, D, F]
    b1: Optional[Tensor] = None
    b2: Optional[Tensor] = None

    @property
    def quantized(self) -> bool:
        return isinstance(self.w1, QuantizedWeight)


def _gate_then_up(t: Tensor, dim: int) -> Tensor:
    """Interleaved gate/up (gate = 0::2, up = 1::2 along ``dim``) -> gate block then up block."""
    even, odd = [slice(None)] * t.dim(), [slice(None)] * t.dim()
    even[dim], odd[dim] = slice(0, None, 2), slice(1, None, 2)
    return torch.cat([t[tuple(even)], t[tuple(odd)]], dim=dim)


def _dense(w: Weight, dtype) -> Tensor:
    return w.dequantize(dtype) if isinstance(w, QuantizedWeight) else w.to(dtype)


def _read_per_expert(tensors: Mapping, qcfg, prefix: str, layout: PerExpert, E: int, F_: int, D: int,
                     dtype, device) -> ExpertWeights:
    names = [(f"{prefix}.{e}.{layout.gate}.weight", f"{prefix}.{e}.{layout.up}.weight", f"{prefix}.{e}.{layout.down}.weight")
             for e in range(E)]
    first = read_weight(tensors, names[0][0], qcfg)
    if isinstance(first, QuantizedWeight):
        parts = [[read_weight(tensors, n, qcfg) for n in trio] for trio in names]
        for trio, ws in zip(names, parts):
            for n, w, want in zip(trio, ws, ((F_, D), (F_, D), (D, F_))):
                check_shape(n, w.shape, want)
        if all(isinstance(w, QuantizedWeight) for ws in parts for w in ws):
            gate = stack_experts([ws[0] for ws in parts])
            up = stack_experts([ws[1] for ws in parts])
            down = stack_experts([ws[2] for ws in parts])
            try:
                return ExpertWeights(concat_out([gate, up]).to(device), down.to(device))
            except ValueError as err:  # e.g. FP8 with F not a multiple of the block rows
                log.warning("%s: gate/up cannot be fused packed (%s); using dequantized %s experts", prefix, err, dtype)
        else:
            log.warning("%s: some expert weights are packed and some dense; using dequantized %s experts", prefix, dtype)
        w1 = torch.empty(E, 2 * F_, D, dtype=dtype, device=device)
        w2 = torch.empty(E, D, F_, dtype=dtype, device=device)
        for e, (g, u, d) in enumerate(parts):
            w1[e, :F_].copy_(_dense(g, dtype))
            w1[e, F_:].copy_(_dense(u, dtype))
            w2[e].copy_(_dense(d, dtype))
        return ExpertWeights(w1, w2)
    w1 = torch.empty(E, 2 * F_, D, dtype=dtype, device=device)
    w2 = torch.empty(E, D, F_, dtype=dtype, device=device)
    for e, (gn, un, dn) in enumerate(names):
        for n, rows, want in ((gn, slice(0, F_), (F_, D)), (un, slice(F_, 2 * F_), (F_, D))):
            t = first if n == names[0][0] else read_weight(tensors, n, qcfg)
            if isinstance(t, QuantizedWeight):
                raise ValueError(f"tensor {n!r} is quantized but {names[0][0]!r} is dense: mixed expert formats")
            check_shape(n, t.shape, want)
            w1[e, rows].copy_(t)
        t = read_weight(tensors, dn, qcfg)
        if isinstance(t, QuantizedWeight):
            raise ValueError(f"tensor {dn!r} is quantized but {names[0][0]!r} is dense: mixed expert formats")
        check_shape(dn, t.shape, (D, F_))
        w2[e].copy_(t)
    return ExpertWeights(w1, w2)


def _read_fused_interleaved(tensors: Mapping, qcfg, prefix: str, E: int, F_: int, D: int, dtype, device,
                            bias: bool) -> ExpertWeights:
    gu_name, down_name = f"{prefix}.gate_up_proj", f"{prefix}.down_proj"
    gu = read_weight(tensors, gu_name, qcfg)
    down = read_weight(tensors, down_name, qcfg)
    if isinstance(gu, QuantizedWeight):  # stored out->in, gate/up rows interleaved
        check_shape(gu_name, gu.shape, (E, 2 * F_, D))
        w1 = deinterleave_gate_up(gu).to(device)
    else:
        check_shape(gu_name, gu.shape, (E, D, 2 * F_))
        w1 = _gate_then_up(gu.transpose(1, 2), 1).to(dtype=dtype, device=device).contiguous()
    if isinstance(down, QuantizedWeight):
        check_shape(down_name, down.shape, (E, D, F_))
        w2 = down.to(device)
    else:
        check_shape(down_name, down.shape, (E, F_, D))
        w2 = down.transpose(1, 2).to(dtype=dtype, device=device).contiguous()
    if isinstance(w1, QuantizedWeight) != isinstance(w2, QuantizedWeight):
        log.warning("%s: one expert weight is packed and the other dense; using dequantized %s experts", prefix, dtype)
        w1, w2 = _dense(w1, dtype).to(device), _dense(w2, dtype).to(device)
    b1 = b2 = None
    if bias:
        b1_name, b2_name = f"{prefix}.gate_up_proj_bias", f"{prefix}.down_proj_bias"
        b1, b2 = read_weight(tensors, b1_name, None), read_weight(tensors, b2_name, None)
        check_shape(b1_name, b1.shape, (E, 2 * F_))
        check_shape(b2_name, b2.shape, (E, D))
        b1 = _gate_then_up(b1, 1).to(dtype=dtype, device=device).contiguous()
        b2 = b2.to(dtype=dtype, device=device)
    return ExpertWeights(w1, w2, b1, b2)


def read_experts(tensors: Mapping, qcfg: Optional[QuantConfig], prefix: str, layout, num_experts: int,
                 hidden_size: int, model_dim: int, dtype: torch.dtype, device, bias: bool = False) -> ExpertWeights:
    """The routed experts under checkpoint prefix ``prefix`` (e.g. ``model.layers.3.mlp.experts``), in
    our layout: dense in ``dtype`` on ``device``, or packed QuantizedWeights (moved to ``device``)."""
    E, F_, D = num_experts, hidden_size, model_dim
    if isinstance(layout, PerExpert):
        if bias:
            raise ValueError("per-expert checkpoints with expert biases are not supported")
        return _read_per_expert(tensors, qcfg, prefix, layout, E, F_, D, dtype, device)
    if isinstance(layout, FusedInterleaved):
        return _read_fused_interleaved(tensors, qcfg, prefix, E, F_, D, dtype, device, bias)
    raise ValueError(f"unknown expert layout {layout!r}; expected PerExpert or FusedInterleaved")
