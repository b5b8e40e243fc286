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
* :class:`FusedGateUp` -- Qwen3-VL-MoE: ``experts.gate_up_proj`` (gate columns, then up columns) and
  ``experts.down_proj``, no ``.weight``: the released checkpoints store them in->out ([E, D, 2F] and
  [E, F, D]), transformers 5's ``save_pretrained`` out->in ([E, 2F, D] and [E, D, F]); both load, and
  where the shapes cannot tell (2F = D, or F = D) out->in is meant, as transformers reads it; dense only.
* :class:`RowStacked` -- DBRX: ``experts.mlp.w1`` (gate), ``v1`` (up), ``w2`` (down, stored in->out), each
  [E*F, D], expert e's rows e*F..(e+1)*F-1; dense only.
* :class:`Stacked` -- our own layout on disk, one 3D tensor per projection (GraniteMoE:
  ``block_sparse_moe.input_linear.weight`` [E, 2F, D] gate rows then up rows,
  ``block_sparse_moe.output_linear.weight`` [E, D, F]); dense only.
* :class:`SplitStacked` -- Step-3.5: one 3D tensor per projection, gate and up apart
  (``moe.gate_proj.weight`` [E, F, D], ``moe.up_proj.weight`` [E, F, D], ``moe.down_proj.weight`` [E, D, F]);
  dense only.
* :class:`PerExpertFFN` -- non-gated experts (Nemotron-H: ``experts.{e}.up_proj|down_proj.weight``), read by
  :func:`read_ffn_experts` into ``w1`` = up [E, F, D] and ``w2`` = down [E, D, F]; packed tensors are dequantized
  (dynamoe's packed expert kernels are GLU).
* :class:`StackedFFN` -- non-gated experts stacked by expert and stored in->out (NeMo's Nemotron-H export inside
  Nemotron-3.5-Transcribe: ``experts.gate_and_up_projs`` [E, D, F], ``experts.down_projs`` [E, F, D]), read by
  :func:`read_ffn_experts` as well; dense only.

Readers stream: the dense result is allocated once in the target dtype and filled one expert (or
one tensor) at a time; packed weights stay packed (:mod:`dynamoe.quant.checkpoint`).

Expert parallelism reads a contiguous range of experts (``local``): per-expert tensors of the other
experts are not read at all; stacked tensors (leading dim E) are read row range only, through
safetensors' lazy slices when the mapping offers ``get_slice`` (:class:`ExpertRows`).
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
from torch import Tensor

from ..quant.base import QuantizedWeight
from ..quant.dequantize import dense
from ..quant.checkpoint import QuantConfig, concat_out, deinterleave_gate_up, read_weight, stack_experts

__all__ = ["PerExpert", "PerExpertFFN", "StackedFFN", "FusedInterleaved", "FusedGateUp", "Stacked", "SplitStacked", "RowStacked",
           "ExpertWeights", "ExpertRows", "read_experts", "read_ffn_experts", "check_shape"]

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
class PerExpertFFN:
    """Non-gated experts: ``{prefix}.{e}.{up}.weight`` [F, D] and ``.{down}.weight`` [D, F] for e in 0..E-1."""

    up: str = "up_proj"
    down: str = "down_proj"


@dataclass(frozen=True)
class StackedFFN:
    """Non-gated experts stacked by expert, stored in->out: ``{prefix}.{up}`` [E, D, F] and ``{prefix}.{down}``
    [E, F, D] (no ``.weight``; NeMo's names by default)."""

    up: str = "gate_and_up_projs"
    down: str = "down_projs"


@dataclass(frozen=True)
class FusedInterleaved:
    """GPT-OSS's fused experts (see the module docstring)."""


@dataclass(frozen=True)
class Stacked:
    """``{prefix}.{gate_up}.weight`` [E, 2F, D] (gate rows, then up rows) and ``{prefix}.{down}.weight``
    [E, D, F]: our layout, stored as is (see the module docstring)."""

    gate_up: str = "input_linear"
    down: str = "output_linear"
    #: after the names: ".weight" (GraniteMoE), or "" (transformers' fused experts as it saves them:
    #: ``experts.gate_up_proj`` [E, 2F, D], ``experts.down_proj`` [E, D, F] -- Mistral-4)
    suffix: str = ".weight"
    #: the gate / up rows interleaved on disk (gate rows 0::2, up rows 1::2 of the 2F: Inkling's hub ``w13_weight``)
    interleaved: bool = field(default=False, kw_only=True)


@dataclass(frozen=True)
class SplitStacked:
    """``{prefix}.{gate}{suffix}`` and ``{prefix}.{up}{suffix}`` [E, F, D], ``{prefix}.{down}{suffix}`` [E, D, F]
    (Step-3.5's ``moe.gate_proj.weight`` / ``up_proj`` / ``down_proj``)."""

    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    suffix: str = ".weight"


@dataclass(frozen=True)
class FusedGateUp:
    """``{prefix}.{gate_up}`` and ``{prefix}.{down}`` (no ``.weight``), stacked by expert, in->out or
    out->in (see the module docstring); ``in_out``: in->out only, whatever the shapes (Llama-4, whose
    transformers module holds them so: no ambiguity when 2F = D or F = D)."""

    gate_up: str = "gate_up_proj"
    down: str = "down_proj"
    in_out: bool = False


@dataclass(frozen=True)
class RowStacked:
    """``{prefix}.{gate}``, ``{prefix}.{up}``, ``{prefix}.{down}`` (no ``.weight``), each [E*F, D]; gate and
    up out->in, down in->out (DBRX's ``w1``, ``v1``, ``w2``)."""

    gate: str = "w1"
    up: str = "v1"
    down: str = "w2"


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


class ExpertRows(Mapping):
    """The checkpoint as seen by the experts ``local`` (a contiguous range of the ``num_experts``):
    a stacked expert tensor -- leading dim ``num_experts`` -- comes back as rows ``local`` only, read
    from disk alone where the mapping has safetensors' lazy ``get_slice``; a 0-d tensor (one value
    for every expert) whole. Any other shape cannot be split by expert: ValueError naming it."""

    def __init__(self, tensors: Mapping, local: range, num_experts: int):
        self.tensors, self.local, self.num_experts = tensors, local, num_experts

    def __getitem__(self, name: str) -> Tensor:
        a, b = self.local.start, self.local.stop
        get_slice = getattr(self.tensors, "get_slice", None)
        if get_slice is not None:
            lazy = get_slice(name)
            shape = tuple(lazy.get_shape())
            if shape and shape[0] == self.num_experts:
                return lazy[a:b]
        else:
            t = self.tensors[name]
            shape = tuple(t.shape)
            if shape and shape[0] == self.num_experts:
                return t[a:b].clone()   # not a view: the parameter must not keep every expert alive
        if not shape:
            return self.tensors[name]
        raise ValueError(f"tensor {name!r} of shape {shape} cannot be split by expert for expert parallelism: "
                         f"a stacked expert tensor needs num_experts={self.num_experts} along dim 0")

    def __contains__(self, name) -> bool:
        return name in self.tensors

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


def _dense(w: Weight, dtype) -> Tensor:
    return dense(w, dtype) if isinstance(w, QuantizedWeight) else w.to(dtype)


def _read_per_expert(tensors: Mapping, qcfg, prefix: str, layout: PerExpert, local: range, F_: int, D: int,
                     dtype, device) -> ExpertWeights:
    E = len(local)
    names = [(f"{prefix}.{e}.{layout.gate}.weight", f"{prefix}.{e}.{layout.up}.weight", f"{prefix}.{e}.{layout.down}.weight")
             for e in local]
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


def _read_stacked(tensors: Mapping, qcfg, prefix: str, layout: Stacked, E: int, F_: int, D: int, dtype,
                  device) -> ExpertWeights:
    out = []
    for name, want in ((f"{prefix}.{layout.gate_up}{layout.suffix}", (E, 2 * F_, D)),
                       (f"{prefix}.{layout.down}{layout.suffix}", (E, D, F_))):
        t = read_weight(tensors, name, qcfg)
        if isinstance(t, QuantizedWeight):
            raise ValueError(f"tensor {name!r} is quantized: stacked (GraniteMoE-style) experts load dense only")
        check_shape(name, t.shape, want)
        if layout.interleaved and not out:   # gate / up rows interleaved: gate rows, then up rows
            t = t.view(E, F_, 2, D).transpose(1, 2)
        out.append(t.to(dtype=dtype, device=device).reshape(want).contiguous())
    return ExpertWeights(*out)


def _read_split_stacked(tensors: Mapping, qcfg, prefix: str, layout: SplitStacked, E: int, F_: int, D: int, dtype,
                        device) -> ExpertWeights:
    out = []
    for proj, want in ((layout.gate, (E, F_, D)), (layout.up, (E, F_, D)), (layout.down, (E, D, F_))):
        name = f"{prefix}.{proj}{layout.suffix}"
        t = read_weight(tensors, name, qcfg)
        if isinstance(t, QuantizedWeight):
            raise ValueError(f"tensor {name!r} is quantized: split stacked (Step-3.5-style) experts load dense only")
        check_shape(name, t.shape, want)
        out.append(t.to(dtype=dtype, device=device))
    gate, up, down = out
    return ExpertWeights(torch.cat([gate, up], dim=1).contiguous(), down.contiguous())


def _read_fused_gate_up(tensors: Mapping, qcfg, prefix: str, layout: FusedGateUp, E: int, F_: int, D: int, dtype,
                        device) -> ExpertWeights:
    out = []
    for name, ours in ((f"{prefix}.{layout.gate_up}", (E, 2 * F_, D)), (f"{prefix}.{layout.down}", (E, D, F_))):
        t = read_weight(tensors, name, qcfg)
        if isinstance(t, QuantizedWeight):
            raise ValueError(f"tensor {name!r} is quantized: fused (Qwen3-VL-MoE-style) experts load dense only")
        if layout.in_out:
            check_shape(name, t.shape, (E, ours[2], ours[1]))
            t = t.transpose(1, 2)
        elif tuple(t.shape) != ours:  # in->out, as released: [E, D, 2F] / [E, F, D]
            if tuple(t.shape) != (E, ours[2], ours[1]):
                raise ValueError(f"tensor {name!r}: expected shape {ours} (out->in) or {(E, ours[2], ours[1])} "
                                 f"(in->out), found {tuple(t.shape)}")
            t = t.transpose(1, 2)
        out.append(t.to(dtype=dtype, device=device).contiguous())
    return ExpertWeights(*out)


def _read_row_stacked(tensors: Mapping, qcfg, prefix: str, layout: RowStacked, E: int, local: range, F_: int, D: int,
                      dtype, device) -> ExpertWeights:
    rows = slice(local.start * F_, local.stop * F_)
    L = len(local)
    parts = []
    for name in (f"{prefix}.{layout.gate}", f"{prefix}.{layout.up}", f"{prefix}.{layout.down}"):
        get_slice = getattr(tensors, "get_slice", None)
        if get_slice is not None and qcfg is None:  # expert parallelism reads its rows only
            lazy = get_slice(name)
            check_shape(name, lazy.get_shape(), (E * F_, D))
            t = lazy[rows]
        else:
            t = read_weight(tensors, name, qcfg)
            if isinstance(t, QuantizedWeight):
                raise ValueError(f"tensor {name!r} is quantized: row-stacked (DBRX-style) experts load dense only")
            check_shape(name, t.shape, (E * F_, D))
            t = t[rows]
        parts.append(t.to(dtype=dtype, device=device).reshape(L, F_, D))
    gate, up, down = parts
    return ExpertWeights(torch.cat([gate, up], dim=1).contiguous(), down.transpose(1, 2).contiguous())


def _read_stacked_ffn(tensors: Mapping, qcfg, prefix: str, layout: StackedFFN, E: int, F_: int, D: int, dtype,
                      device) -> ExpertWeights:
    out = []
    for name, want in ((f"{prefix}.{layout.up}", (E, D, F_)), (f"{prefix}.{layout.down}", (E, F_, D))):
        t = read_weight(tensors, name, qcfg)
        if isinstance(t, QuantizedWeight):
            raise ValueError(f"tensor {name!r} is quantized: stacked non-gated (NeMo-style) experts load dense only")
        check_shape(name, t.shape, want)
        out.append(t.to(dtype=dtype, device=device).transpose(1, 2).contiguous())   # in->out -> out->in
    return ExpertWeights(*out)


def read_ffn_experts(tensors: Mapping, qcfg: Optional[QuantConfig], prefix: str, layout: Union[PerExpertFFN, StackedFFN],
                     num_experts: int, hidden_size: int, model_dim: int, dtype: torch.dtype, device,
                     local: Optional[range] = None) -> ExpertWeights:
    """Non-gated experts under ``prefix`` (``layout``: :class:`PerExpertFFN` or :class:`StackedFFN`) as dense ``w1`` =
    up [L, F, D] and ``w2`` = down [L, D, F] in ``dtype`` (``local``: the contiguous range of the E experts to read, as
    :func:`read_experts`); a packed per-expert tensor is dequantized, logged once per prefix."""
    if not isinstance(layout, (PerExpertFFN, StackedFFN)):
        raise ValueError(f"non-gated experts are read from a PerExpertFFN or StackedFFN layout, got {layout!r}")
    E, F_, D = num_experts, hidden_size, model_dim
    local = range(E) if local is None else local
    if local.step != 1 or not 0 <= local.start < local.stop <= E:
        raise ValueError(f"local must be a non-empty contiguous range within [0, {E}), got {local!r}")
    if isinstance(layout, StackedFFN):
        return _read_stacked_ffn(ExpertRows(tensors, local, E) if len(local) != E else tensors, qcfg, prefix, layout,
                                 len(local), F_, D, dtype, device)
    w1 = torch.empty(len(local), F_, D, dtype=dtype, device=device)
    w2 = torch.empty(len(local), D, F_, dtype=dtype, device=device)
    packed = False
    for i, e in enumerate(local):
        for name, out, want in ((f"{prefix}.{e}.{layout.up}.weight", w1, (F_, D)),
                                (f"{prefix}.{e}.{layout.down}.weight", w2, (D, F_))):
            t = read_weight(tensors, name, qcfg)
            check_shape(name, t.shape, want)
            packed = packed or isinstance(t, QuantizedWeight)
            out[i].copy_(_dense(t, dtype))
    if packed:
        log.warning("%s: packed non-gated experts are dequantized to %s (the packed expert kernels are GLU)",
                    prefix, dtype)
    return ExpertWeights(w1, w2)


def read_experts(tensors: Mapping, qcfg: Optional[QuantConfig], prefix: str, layout, num_experts: int,
                 hidden_size: int, model_dim: int, dtype: torch.dtype, device, bias: bool = False,
                 local: Optional[range] = None) -> ExpertWeights:
    """The routed experts under checkpoint prefix ``prefix`` (e.g. ``model.layers.3.mlp.experts``), in
    our layout: dense in ``dtype`` on ``device``, or packed QuantizedWeights (moved to ``device``).
    ``num_experts``: E in the checkpoint; ``local``: the contiguous range of them to read (default all;
    expert parallelism reads its rank's share), which sets the leading dim L of the result."""
    E, F_, D = num_experts, hidden_size, model_dim
    local = range(E) if local is None else local
    if local.step != 1 or not 0 <= local.start < local.stop <= E:
        raise ValueError(f"local must be a non-empty contiguous range within [0, {E}), got {local!r}")
    if isinstance(layout, PerExpert):
        if bias:
            raise ValueError("per-expert checkpoints with expert biases are not supported")
        return _read_per_expert(tensors, qcfg, prefix, layout, local, F_, D, dtype, device)
    if isinstance(layout, FusedInterleaved):
        if len(local) != E:
            tensors = ExpertRows(tensors, local, E)
        return _read_fused_interleaved(tensors, qcfg, prefix, len(local), F_, D, dtype, device, bias)
    if isinstance(layout, RowStacked):
        if bias:
            raise ValueError("row-stacked expert checkpoints with expert biases are not supported")
        return _read_row_stacked(tensors, qcfg, prefix, layout, E, local, F_, D, dtype, device)
    if isinstance(layout, Stacked):
        if bias:
            raise ValueError("stacked expert checkpoints with expert biases are not supported")
        if len(local) != E:
            tensors = ExpertRows(tensors, local, E)
        return _read_stacked(tensors, qcfg, prefix, layout, len(local), F_, D, dtype, device)
    if isinstance(layout, SplitStacked):
        if bias:
            raise ValueError("split stacked expert checkpoints with expert biases are not supported")
        if len(local) != E:
            tensors = ExpertRows(tensors, local, E)
        return _read_split_stacked(tensors, qcfg, prefix, layout, len(local), F_, D, dtype, device)
    if isinstance(layout, FusedGateUp):
        if bias:
            raise ValueError("fused gate_up expert checkpoints with expert biases are not supported")
        if len(local) != E:
            tensors = ExpertRows(tensors, local, E)
        return _read_fused_gate_up(tensors, qcfg, prefix, layout, len(local), F_, D, dtype, device)
    raise ValueError(f"unknown expert layout {layout!r}; expected PerExpert, FusedInterleaved, FusedGateUp, Stacked, "
                     "SplitStacked or RowStacked")
