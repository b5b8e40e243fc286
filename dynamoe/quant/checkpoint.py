"""Quantized checkpoints on disk: parse the quantization config, read a weight back from its companion
tensors, and write the on-disk names of each format.

Everything here works on a plain ``name -> Tensor`` mapping, one logical weight at a time, so a model
loader can stream a checkpoint tensor by tensor (:class:`CheckpointTensors` is such a mapping over a
Hugging Face folder, opening the safetensors files lazily).

On-disk names, by format (``X`` = a Linear's module name, ``N`` = a logical weight name):

=====================  =========================================================================
blockwise FP8          ``X.weight`` float8_e4m3fn [out, in] + ``X.weight_scale_inv`` fp32 (or
                       float8_e8m0fnu with ``scale_fmt: ue8m0``) [ceil(out/b0), ceil(in/b1)];
                       the block size comes from ``weight_block_size`` in the config.
MXFP4                  ``N_blocks`` uint8 [..., out, in/32, 16] + ``N_scales`` uint8 [..., out, in/32].
                       GPT-OSS: ``...mlp.experts.gate_up_proj_blocks`` (the dense tensor is stored
                       in->out [E, H, 2I]; the quantized one out->in [E, 2I, H], gate/up rows still
                       interleaved). **Our convention** for the per-expert 2D experts of the other
                       families (Qwen3, DeepSeek, Mixtral), for which no public MXFP4 layout exists:
                       ``...experts.{e}.gate_proj.weight_blocks`` / ``.weight_scales``.
NVFP4 (ModelOpt)       ``X.weight`` packed uint8 [out, in/2] + ``X.weight_scale`` float8_e4m3fn
                       [out, in/16] + ``X.weight_scale_2`` fp32 scalar (+ ``X.input_scale``).
NVFP4 (compressed-     ``X.weight_packed`` + ``X.weight_scale`` + ``X.weight_global_scale`` fp32 [1],
tensors)               which is **1 / weight_scale_2** (on every weight, MoE experts included).
=====================  =========================================================================

The writers (:func:`write_quantized`, used by ``dynamoe quantize``) produce weight-only NVFP4: the
activation ``input_scale`` needs calibration data, which a weight conversion does not have, so none is
invented. Fused groups (an attention's q/k/v, an MLP's or an expert's gate/up) share one NVFP4 global
scale, as ModelOpt and llm-compressor export them; pass the group's amax via ``global_amax``.

Layering: this module uses torch and safetensors only (never ``dynamoe.moe``).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from .base import QuantizedWeight
from .fp8_block import BlockFP8Weight
from .mxfp4 import MX_GROUP, MXFP4Weight
from .nvfp4 import NV_GROUP, NVFP4Weight

__all__ = [
    "QuantConfig", "quant_config_from_dir", "parse_quant_config", "read_weight", "stack_experts", "concat_out",
    "deinterleave_gate_up", "FORMATS", "DEFAULT_FP8_BLOCK", "is_quant_target", "fusion_group", "write_quantized",
    "quant_config_entries", "CheckpointTensors", "SafetensorsWriter", "WEIGHT_ONLY_NOTE",
]

#: ``dynamoe quantize --format`` choices
FORMATS = ("fp8", "fp8-ue8m0", "mxfp4", "nvfp4-modelopt", "nvfp4-ct")
DEFAULT_FP8_BLOCK = (128, 128)
CT_NVFP4_FORMAT = "nvfp4-pack-quantized"
WEIGHT_ONLY_NOTE = ("weight-only NVFP4 export (dynamoe quantize): no input_scale is stored, because activation "
                    "scales need calibration data")
_SUPPORTED_METHODS = ("fp8 (blockwise, weight_block_size)", "mxfp4", f"compressed-tensors ({CT_NVFP4_FORMAT})",
                      "modelopt (quant_algo NVFP4)")
_E8M0 = getattr(torch, "float8_e8m0fnu", None)


# ============================================================================ config
@dataclass(frozen=True)
class QuantConfig:
    """A checkpoint's quantization, parsed once.

    ``kind`` names the on-disk layout: 'fp8', 'mxfp4', 'nvfp4-modelopt' or 'nvfp4-ct'.
    ``exclude`` is what the config says stays dense (``modules_to_not_convert`` / ``ignore`` /
    ``exclude_modules``; names or patterns, informational: :func:`read_weight` goes by the tensors
    actually present).
    """

    kind: str
    quant_method: str
    block: Optional[tuple] = None          # FP8 weight_block_size
    scale_fmt: str = "fp32"                # FP8: 'fp32' or 'ue8m0' (what the config announces)
    activation_scheme: Optional[str] = None
    group_size: Optional[int] = None       # 32 for MXFP4, 16 for NVFP4
    exclude: tuple = ()
    raw: dict = field(default_factory=dict, compare=False, repr=False)


def _unsupported(what: str, value) -> ValueError:
    return ValueError(f"unsupported {what} {value!r}; supported quantization: {', '.join(_SUPPORTED_METHODS)}")


def _parse_modelopt(q: Mapping, raw: dict) -> QuantConfig:
    algo = q.get("quant_algo")
    if algo != "NVFP4":
        raise _unsupported("ModelOpt quant_algo", algo)
    group = int(q.get("group_size", NV_GROUP) or NV_GROUP)
    if group != NV_GROUP:
        raise ValueError(f"ModelOpt NVFP4 group_size must be {NV_GROUP}, got {group}")
    exclude = tuple(q.get("exclude_modules") or q.get("ignore") or ())
    return QuantConfig("nvfp4-modelopt", "modelopt", group_size=group, exclude=exclude, raw=raw)


def parse_quant_config(quantization_config: Optional[Mapping], hf_quant_config: Optional[Mapping] = None
                       ) -> Optional[QuantConfig]:
    """:class:`QuantConfig` from config.json's ``quantization_config`` and/or the ModelOpt
    ``hf_quant_config.json`` contents; None when neither is given (a dense checkpoint)."""
    qc = dict(quantization_config or {})
    if not qc and not hf_quant_config:
        return None
    method = qc.get("quant_method")
    if hf_quant_config is not None and method in (None, "modelopt"):
        q = hf_quant_config.get("quantization", hf_quant_config)
        return _parse_modelopt(q, {"quantization_config": qc, "hf_quant_config": dict(hf_quant_config)})
    if method == "modelopt":
        q = qc.get("quantization", qc)
        return _parse_modelopt(q, qc)
    if method == "fp8":
        block = qc.get("weight_block_size")
        if block is None:
            raise ValueError("quant_method 'fp8' without weight_block_size (per-tensor FP8) is not supported; "
                             "supported: blockwise FP8 with weight_block_size [b0, b1]")
        block = tuple(int(b) for b in block)
        if len(block) != 2 or min(block) < 1:
            raise ValueError(f"weight_block_size must be two positive ints, got {qc.get('weight_block_size')!r}")
        fmt = qc.get("fmt", "e4m3")
        if fmt not in ("e4m3", "float8_e4m3fn"):
            raise ValueError(f"fp8 fmt {fmt!r} is not supported; supported: 'e4m3'")
        scale_fmt = qc.get("scale_fmt") or "fp32"
        if scale_fmt not in ("fp32", "ue8m0"):
            raise ValueError(f"fp8 scale_fmt {scale_fmt!r} is not supported; supported: 'ue8m0' (or none)")
        return QuantConfig("fp8", "fp8", block=block, scale_fmt=scale_fmt, activation_scheme=qc.get("activation_scheme"),
                           exclude=tuple(qc.get("modules_to_not_convert") or ()), raw=qc)
    if method == "mxfp4":
        return QuantConfig("mxfp4", "mxfp4", group_size=MX_GROUP, exclude=tuple(qc.get("modules_to_not_convert") or ()),
                           raw=qc)
    if method == "compressed-tensors":
        formats = {qc["format"]} if qc.get("format") else set()
        for group in (qc.get("config_groups") or {}).values():
            if group.get("format"):
                formats.add(group["format"])
            weights = group.get("weights") or {}
            if weights and (weights.get("num_bits") != 4 or weights.get("type") != "float"
                            or int(weights.get("group_size") or NV_GROUP) != NV_GROUP):
                raise ValueError(f"compressed-tensors weights scheme {weights!r} is not NVFP4 "
                                 f"(num_bits 4, type float, group_size {NV_GROUP})")
        if formats != {CT_NVFP4_FORMAT}:
            raise _unsupported("compressed-tensors format", sorted(formats) if len(formats) != 1 else formats.pop())
        return QuantConfig("nvfp4-ct", "compressed-tensors", group_size=NV_GROUP, exclude=tuple(qc.get("ignore") or ()),
                           raw=qc)
    raise _unsupported("quant_method", method)


def quant_config_from_dir(path) -> Optional[QuantConfig]:
    """Parse a Hugging Face folder's ``config.json`` (``quantization_config``) and ModelOpt's
    ``hf_quant_config.json``. None for a dense (bf16/fp32) checkpoint; ValueError for a method we
    cannot load, naming it and the supported ones."""
    path = os.fspath(path)
    cfg_path = os.path.join(path, "config.json")
    config = {}
    if os.path.exists(cfg_path):
        with open(cfg_path) as f:
            config = json.load(f)
    hf_path = os.path.join(path, "hf_quant_config.json")
    hf = None
    if os.path.exists(hf_path):
        with open(hf_path) as f:
            hf = json.load(f)
    return parse_quant_config(config.get("quantization_config"), hf)


# ============================================================================ reading
def _shape(t: Tensor) -> tuple:
    return tuple(t.shape)


def _need(tensors: Mapping, name: str, for_name: str) -> Tensor:
    if name not in tensors:
        raise ValueError(f"missing tensor {name!r} (companion of {for_name!r})")
    return tensors[name]


def _check_shape(name: str, t: Tensor, want: tuple, what: str = "") -> None:
    if _shape(t) != tuple(want):
        raise ValueError(f"tensor {name!r}{what}: expected shape {tuple(want)}, found {_shape(t)}")


def _check_dtype(name: str, t: Tensor, allowed: tuple) -> None:
    if t.dtype not in allowed:
        raise ValueError(f"tensor {name!r}: expected dtype {' or '.join(str(d) for d in allowed)}, found {t.dtype}")


def _not_found(tensors: Mapping, name: str, qcfg) -> ValueError:
    hint = ""
    if qcfg is None and any(name + s in tensors for s in ("_blocks", "_scale_inv", "_packed", "_scale")):
        hint = " (quantized companions are present: pass the checkpoint's QuantConfig)"
    return ValueError(f"tensor {name!r} not found in the checkpoint{hint}")


def _read_fp8(tensors: Mapping, name: str, qcfg: QuantConfig):
    scale_name = name + "_scale_inv"
    if name not in tensors:
        if scale_name in tensors:
            raise ValueError(f"missing tensor {name!r} (its scale {scale_name!r} is present)")
        raise _not_found(tensors, name, qcfg)
    w = tensors[name]
    if scale_name not in tensors:
        if w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"missing tensor {scale_name!r} (companion of the {w.dtype} weight {name!r})")
        return w
    _check_dtype(name, w, (torch.float8_e4m3fn,))
    s = tensors[scale_name]
    block = tuple(qcfg.block or DEFAULT_FP8_BLOCK)
    if w.dim() < 2:
        raise ValueError(f"tensor {name!r}: an FP8 weight needs [..., out, in], found shape {_shape(w)}")
    *lead, rows, cols = w.shape
    grid = (*lead, -(-rows // block[0]), -(-cols // block[1]))
    _check_shape(scale_name, s, grid, f" (scale grid of the {_shape(w)} weight {name!r} with {list(block)} blocks)")
    if _E8M0 is not None and s.dtype == _E8M0 or s.dtype == torch.uint8:
        # e8m0 codes: the storage decides, whatever the config announces (DeepSeek-V3.1 announces
        # ue8m0 and stores fp32 powers of two)
        return BlockFP8Weight(w, s.view(torch.uint8), _shape(w), block, "ue8m0")
    _check_dtype(scale_name, s, (torch.float32, torch.bfloat16, torch.float16))
    return BlockFP8Weight(w, s.float(), _shape(w), block, "fp32")


def _read_mxfp4(tensors: Mapping, name: str, qcfg):
    bn, sn = name + "_blocks", name + "_scales"
    if bn not in tensors and sn not in tensors:
        if name in tensors:
            return tensors[name]
        raise _not_found(tensors, name, qcfg)
    blocks = _need(tensors, bn, name)
    scales = _need(tensors, sn, name)
    _check_dtype(bn, blocks, (torch.uint8,))
    _check_dtype(sn, scales, (torch.uint8,))
    if blocks.dim() < 3 or blocks.shape[-1] != MX_GROUP // 2:
        raise ValueError(f"tensor {bn!r}: expected shape [..., out, in/{MX_GROUP}, {MX_GROUP // 2}], found {_shape(blocks)}")
    _check_shape(sn, scales, _shape(blocks)[:-1], f" (scales of {bn!r})")
    shape = (*blocks.shape[:-2], blocks.shape[-2] * MX_GROUP)
    return MXFP4Weight(blocks, scales, shape)


def _nvfp4_shapes(name: str, packed: Tensor, scale_name: str, scale: Tensor) -> tuple:
    _check_dtype(name, packed, (torch.uint8,))
    if packed.dim() < 2:
        raise ValueError(f"tensor {name!r}: an NVFP4 weight needs [..., out, in/2], found shape {_shape(packed)}")
    *lead, rows, half = packed.shape
    shape = (*lead, rows, 2 * half)
    if shape[-1] % NV_GROUP:
        raise ValueError(f"tensor {name!r}: in_features {shape[-1]} is not a multiple of {NV_GROUP}")
    _check_shape(scale_name, scale, (*lead, rows, shape[-1] // NV_GROUP), f" (group scales of the {shape} weight)")
    _check_dtype(scale_name, scale, (torch.float8_e4m3fn, torch.uint8))
    return shape


def _per_weight_scalar(name: str, t: Tensor, lead: tuple) -> Tensor:
    t = t.float()
    if not lead and t.numel() == 1:
        return t.reshape(())
    if _shape(t) != tuple(lead) and not (t.numel() == math.prod(lead) and t.dim() == len(lead) + 1 and t.shape[-1] == 1):
        raise ValueError(f"tensor {name!r}: expected shape {tuple(lead) or '() or (1,)'} (one per weight), found {_shape(t)}")
    return t.reshape(lead)


def _read_nvfp4_modelopt(tensors: Mapping, name: str, qcfg):
    scale_name, scale2_name = name + "_scale", name + "_scale_2"
    if name not in tensors:
        raise _not_found(tensors, name, qcfg)
    w = tensors[name]
    if w.dtype != torch.uint8:
        if scale_name in tensors:
            raise ValueError(f"tensor {name!r}: expected packed uint8 NVFP4 data next to {scale_name!r}, found {w.dtype}")
        return w
    scale = _need(tensors, scale_name, name)
    scale2 = _need(tensors, scale2_name, name)
    shape = _nvfp4_shapes(name, w, scale_name, scale)
    lead = tuple(shape[:-2])
    base = name[: -len(".weight")] if name.endswith(".weight") else name
    input_name = base + ".input_scale"
    input_scale = _per_weight_scalar(input_name, tensors[input_name], lead) if input_name in tensors else None
    return NVFP4Weight(w, scale.view(torch.float8_e4m3fn), _per_weight_scalar(scale2_name, scale2, lead), shape,
                       input_scale)


def _read_nvfp4_ct(tensors: Mapping, name: str, qcfg):
    packed_name, scale_name, global_name = name + "_packed", name + "_scale", name + "_global_scale"
    if packed_name not in tensors:
        if name in tensors:
            return tensors[name]
        if scale_name in tensors or global_name in tensors:
            raise ValueError(f"missing tensor {packed_name!r} (companion of {name!r})")
        raise _not_found(tensors, name, qcfg)
    packed = tensors[packed_name]
    scale = _need(tensors, scale_name, name)
    glob = _need(tensors, global_name, name)
    shape = _nvfp4_shapes(packed_name, packed, scale_name, scale)
    shape_name = name[: -len(".weight")] + ".weight_shape" if name.endswith(".weight") else name + "_shape"
    if shape_name in tensors:  # some compressed-tensors exports record the logical shape
        stored = tuple(int(v) for v in tensors[shape_name].reshape(-1).tolist())
        if stored != tuple(shape):
            raise ValueError(f"tensor {shape_name!r}: expected shape {tuple(shape)} (from {packed_name!r}), found {stored}")
    lead = tuple(shape[:-2])
    glob = _per_weight_scalar(global_name, glob, lead)
    base = name[: -len(".weight")] if name.endswith(".weight") else name
    input_name = base + ".input_global_scale"
    input_scale = 1.0 / _per_weight_scalar(input_name, tensors[input_name], lead) if input_name in tensors else None
    # weight_global_scale is the reciprocal of ModelOpt's weight_scale_2 -- on every weight, experts included
    return NVFP4Weight(packed, scale.view(torch.float8_e4m3fn), 1.0 / glob, shape, input_scale)


_READERS = {"fp8": _read_fp8, "mxfp4": _read_mxfp4, "nvfp4-modelopt": _read_nvfp4_modelopt, "nvfp4-ct": _read_nvfp4_ct}


def read_weight(tensors: Mapping[str, Tensor], name: str, qcfg: Optional[QuantConfig]) -> "Tensor | QuantizedWeight":
    """The logical weight ``name`` (e.g. ``model.layers.0.mlp.experts.3.gate_proj.weight``, or GPT-OSS's
    fused ``model.layers.0.mlp.experts.gate_up_proj``): the stored tensor if it is dense, else the
    :class:`QuantizedWeight` built from its companion tensors (see the module docstring).

    Raises ValueError naming the tensor, the expected and the found shape (or dtype) when a companion
    is missing or mis-shaped. GPT-OSS's dense fused experts come back as stored (in->out); their MXFP4
    form is out->in, as that format stores it.
    """
    if qcfg is None:
        if name not in tensors:
            raise _not_found(tensors, name, qcfg)
        return tensors[name]
    reader = _READERS.get(qcfg.kind)
    if reader is None:
        raise ValueError(f"QuantConfig.kind must be one of {list(_READERS)}, got {qcfg.kind!r}")
    try:
        return reader(tensors, name, qcfg)
    except ValueError as err:
        if name in str(err) or (name + "_") in str(err):
            raise
        raise ValueError(f"{name!r}: {err}") from err


# ============================================================================ stacking / fusing
def _same_kind(weights, what: str) -> tuple:
    weights = list(weights)
    if not weights:
        raise ValueError(f"{what} needs at least one weight")
    first = weights[0]
    if not isinstance(first, QuantizedWeight):
        raise ValueError(f"{what} takes QuantizedWeight objects, got {type(first).__name__}")
    statics = {f.name for f in dataclasses.fields(first)} - set(first._tensor_fields()) - {"shape", "input_scale"}
    for i, w in enumerate(weights[1:], 1):
        if type(w) is not type(first):
            raise ValueError(f"{what}: weight {i} is {type(w).__name__}, weight 0 is {type(first).__name__}")
        for s in statics:
            if getattr(w, s) != getattr(first, s):
                raise ValueError(f"{what}: weight {i} has {s}={getattr(w, s)!r}, weight 0 has {getattr(first, s)!r}")
    return weights, first


def _combined_input_scale(weights, combine, what: str):
    have = [w.input_scale is not None for w in weights] if isinstance(weights[0], NVFP4Weight) else [False]
    if not any(have):
        return None
    if not all(have):
        raise ValueError(f"{what}: some NVFP4 weights carry an input_scale and some do not")
    return combine([w.input_scale for w in weights])


def stack_experts(weights: Iterable[QuantizedWeight]) -> QuantizedWeight:
    """Stack same-format, same-shape weights (one per expert) into one with a leading expert dim:
    E x [out, in] -> [E, out, in]. Every tensor field is stacked, so per-expert scales (NVFP4's
    weight_scale_2, FP8's scale grid) stay per expert."""
    weights, first = _same_kind(weights, "stack_experts")
    for i, w in enumerate(weights):
        if tuple(w.shape) != tuple(first.shape):
            raise ValueError(f"stack_experts: weight {i} has shape {tuple(w.shape)}, weight 0 has {tuple(first.shape)}")
    fields = {n: torch.stack([getattr(w, n) for w in weights]) for n in first._tensor_fields() if n != "input_scale"}
    extra = {}
    if isinstance(first, NVFP4Weight):
        extra["input_scale"] = _combined_input_scale(weights, torch.stack, "stack_experts")
    return dataclasses.replace(first, shape=(len(weights), *first.shape), **fields, **extra)


def concat_out(weights: Iterable[QuantizedWeight]) -> QuantizedWeight:
    """Concatenate weights along ``out`` (e.g. an expert's gate then up -> [2I, H]), without
    requantizing:

    * FP8: every part but the last must have ``out`` divisible by the block's rows (the scale grid
      starts a block at row 0); otherwise ValueError.
    * MXFP4: per-row scales, always exact.
    * NVFP4: the parts must share ``weight_scale_2`` (and ``input_scale``), as ModelOpt / llm-compressor
      export fused gate/up and q/k/v; if they differ this raises ValueError rather than requantizing
      (requantizing would re-round every group scale). Quantize such groups with a shared global scale
      (``write_quantized(..., global_amax=...)``) instead.
    """
    weights, first = _same_kind(weights, "concat_out")
    lead, cols = tuple(first.shape[:-2]), first.shape[-1]
    for i, w in enumerate(weights):
        if tuple(w.shape[:-2]) != lead or w.shape[-1] != cols:
            raise ValueError(f"concat_out: weight {i} has shape {tuple(w.shape)}, incompatible with weight 0's "
                             f"{tuple(first.shape)} (only out may differ)")
    rows = sum(w.shape[-2] for w in weights)
    shape = (*lead, rows, cols)
    if isinstance(first, BlockFP8Weight):
        b0 = first.block[0]
        for i, w in enumerate(weights[:-1]):
            if w.shape[-2] % b0:
                raise ValueError(f"concat_out: FP8 weight {i} has {w.shape[-2]} rows, not a multiple of the block's "
                                 f"{b0}: its last scale block would straddle the next weight (requantize the fused "
                                 f"dense weight instead)")
        return dataclasses.replace(first, shape=shape, weight=torch.cat([w.weight for w in weights], -2),
                                   weight_scale_inv=torch.cat([w.weight_scale_inv for w in weights], -2))
    if isinstance(first, MXFP4Weight):
        return dataclasses.replace(first, shape=shape, blocks=torch.cat([w.blocks for w in weights], -3),
                                   scales=torch.cat([w.scales for w in weights], -2))
    if isinstance(first, NVFP4Weight):
        for i, w in enumerate(weights[1:], 1):
            if not torch.equal(w.weight_scale_2, first.weight_scale_2):
                raise ValueError(f"concat_out: NVFP4 weight {i} has weight_scale_2 {w.weight_scale_2.tolist()}, weight 0 "
                                 f"has {first.weight_scale_2.tolist()}; fused parts must share their global scale "
                                 f"(not requantized here)")

        def same(scales):
            if any(not torch.equal(s, scales[0]) for s in scales[1:]):
                raise ValueError("concat_out: NVFP4 weights have different input_scale values")
            return scales[0]

        return dataclasses.replace(first, shape=shape, weight=torch.cat([w.weight for w in weights], -2),
                                   weight_scale=torch.cat([w.weight_scale for w in weights], -2),
                                   input_scale=_combined_input_scale(weights, same, "concat_out"))
    raise ValueError(f"concat_out does not know the format {type(first).__name__}")


def deinterleave_gate_up(w: QuantizedWeight) -> QuantizedWeight:
    """GPT-OSS's interleaved gate/up rows (gate = rows 0::2, up = rows 1::2 of the out->in weight)
    reordered to gate-then-up. Exact for MXFP4 and NVFP4 (per-row scales); FP8 blocks span rows, so
    FP8 raises ValueError."""
    rows = w.shape[-2]
    if rows % 2:
        raise ValueError(f"deinterleave_gate_up needs an even number of rows, got shape {tuple(w.shape)}")
    order = torch.cat([torch.arange(0, rows, 2), torch.arange(1, rows, 2)]).to(w.device)
    if isinstance(w, MXFP4Weight):
        return dataclasses.replace(w, blocks=w.blocks.index_select(-3, order), scales=w.scales.index_select(-2, order))
    if isinstance(w, NVFP4Weight):
        return dataclasses.replace(w, weight=w.weight.index_select(-2, order),
                                   weight_scale=w.weight_scale.view(torch.uint8).index_select(-2, order).view(torch.float8_e4m3fn))
    raise ValueError(f"deinterleave_gate_up: rows of a {type(w).__name__} cannot be reordered without requantizing")


# ============================================================================ writing
_LAYER = re.compile(r"(^|\.)layers\.\d+\.")
_ROUTED_FUSED = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")          # GPT-OSS, in->out [E, in, out]
_ROUTED_2D = re.compile(r"\.experts\.\d+\.[^.]+\.weight$")                   # Qwen3 / DeepSeek / Mixtral
_FUSION = (re.compile(r"^(.*\.)(q_proj|k_proj|v_proj)\.weight$"), re.compile(r"^(.*\.)(gate_proj|up_proj)\.weight$"),
           re.compile(r"^(.*\.)(w1|w3)\.weight$"))


def _module(name: str) -> str:
    return name[: -len(".weight")] if name.endswith(".weight") else name


def _is_router_norm_or_embedding(name: str) -> bool:
    last = _module(name).rsplit(".", 1)[-1]
    return last in ("gate", "router") or last.endswith("expert_gate") or "norm" in last or "embed" in last


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {list(FORMATS)}, got {fmt!r}")


def is_quant_target(name: str, tensor: Tensor, fmt: str, exclude: Iterable = ()) -> bool:
    """Whether ``dynamoe quantize --format fmt`` quantizes this tensor (what the loaded checkpoints do):

    * FP8 / NVFP4: every 2D Linear ``*.weight`` inside the decoder layers except routers
      (``mlp.gate``, ``mlp.router``, ``shared_expert_gate``), norms and embeddings; lm_head and
      the embeddings are outside the layers. GPT-OSS's fused 3D experts stay dense (no public FP8 /
      NVFP4 layout for them: use mxfp4).
    * MXFP4: only the routed experts (GPT-OSS fused ``experts.gate_up_proj`` / ``down_proj``, other
      families' ``experts.{e}.*.weight``).

    ``exclude`` holds regexes searched in the tensor name. Shapes the format cannot take (MXFP4 needs
    in % 32, NVFP4 in % 16) stay dense.
    """
    _check_format(fmt)
    if not isinstance(tensor, Tensor) or not tensor.is_floating_point() or not _LAYER.search(name):
        return False
    if any(re.search(p, name) for p in exclude):
        return False
    if fmt == "mxfp4":
        if tensor.dim() == 3 and _ROUTED_FUSED.search(name):
            in_features = tensor.shape[-2]          # stored in->out
        elif tensor.dim() == 2 and _ROUTED_2D.search(name):
            in_features = tensor.shape[-1]
        else:
            return False
        return in_features % MX_GROUP == 0
    if tensor.dim() != 2 or not name.endswith(".weight") or _is_router_norm_or_embedding(name):
        return False
    return fmt.startswith("fp8") or tensor.shape[-1] % NV_GROUP == 0


def fusion_group(name: str) -> Optional[str]:
    """The fused group an NVFP4 weight shares its global scale with: an attention's q/k/v
    (``...self_attn.qkv``), an MLP's or an expert's gate/up (``...experts.3.gate_up``); None otherwise."""
    for i, pat in enumerate(_FUSION):
        m = pat.match(name)
        if m:
            return m.group(1) + ("qkv", "gate_up", "gate_up")[i]
    return None


def _quantize_one(name: str, t: Tensor, fmt: str, block: tuple, global_amax) -> dict:
    if fmt in ("fp8", "fp8-ue8m0"):
        q = BlockFP8Weight.quantize(t, block=block, scale_fmt="ue8m0" if fmt == "fp8-ue8m0" else "fp32")
        scale = q.weight_scale_inv
        if fmt == "fp8-ue8m0" and _E8M0 is not None:
            scale = scale.view(_E8M0)
        return {name: q.weight, name + "_scale_inv": scale}
    if fmt == "mxfp4":
        fused = t.dim() == 3
        q = MXFP4Weight.quantize(t.transpose(-1, -2) if fused else t)   # GPT-OSS stores in->out
        return {name + "_blocks": q.blocks, name + "_scales": q.scales}
    amax = None if global_amax is None else global_amax.get(name)
    q = NVFP4Weight.quantize(t, global_amax=amax)
    if fmt == "nvfp4-modelopt":
        return {name: q.weight, name + "_scale": q.weight_scale, name + "_scale_2": q.weight_scale_2.reshape(())}
    return {name + "_packed": q.weight, name + "_scale": q.weight_scale,
            name + "_global_scale": q.weight_global_scale.reshape(1)}


def write_quantized(tensors: Mapping[str, Tensor], fmt: str, *, exclude: Iterable = (), block: tuple = DEFAULT_FP8_BLOCK,
                    global_amax: Optional[Mapping[str, float]] = None) -> dict:
    """The on-disk tensors of ``fmt`` for ``tensors`` (dense, logical names): quantization targets
    (:func:`is_quant_target`) become their companion tensors, everything else passes through as is.

    ``global_amax`` (NVFP4): name -> the amax of the weight's fused group (:func:`fusion_group`), so
    that q/k/v and gate/up share ``weight_scale_2``; without it each weight gets its own.
    Call it with one tensor at a time to keep memory at about one tensor.
    """
    _check_format(fmt)
    exclude = tuple(exclude)
    out: dict = {}
    for name, t in tensors.items():
        parts = _quantize_one(name, t, fmt, tuple(block), global_amax) if is_quant_target(name, t, fmt, exclude) \
            else {name: t}
        for k, v in parts.items():
            if k in out:
                raise ValueError(f"write_quantized: two tensors map to the on-disk name {k!r}")
            out[k] = v
    return out


def quant_config_entries(fmt: str, not_converted: Iterable[str] = (), block: tuple = DEFAULT_FP8_BLOCK,
                         producer_version: str = "") -> tuple:
    """(``quantization_config`` for config.json, ``hf_quant_config.json`` contents or None) for ``fmt``;
    ``not_converted`` lists the Linear-like modules left dense (routers, lm_head, excluded ones)."""
    _check_format(fmt)
    skip = sorted(set(not_converted))
    if fmt in ("fp8", "fp8-ue8m0"):
        qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
        if fmt == "fp8-ue8m0":
            qc["scale_fmt"] = "ue8m0"
        if skip:
            qc["modules_to_not_convert"] = skip
        return qc, None
    if fmt == "mxfp4":
        return {"quant_method": "mxfp4", "modules_to_not_convert": skip}, None
    if fmt == "nvfp4-modelopt":
        quant = {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": NV_GROUP, "exclude_modules": skip,
                 "comment": WEIGHT_ONLY_NOTE}
        hf = {"producer": {"name": "dynamoe", "version": producer_version}, "quantization": quant}
        return {"quant_method": "modelopt", **quant}, hf
    scheme = {"targets": ["Linear"], "format": CT_NVFP4_FORMAT, "input_activations": None, "output_activations": None,
              "weights": {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group",
                          "group_size": NV_GROUP, "dynamic": False, "actorder": None, "observer": "minmax"}}
    return {"quant_method": "compressed-tensors", "format": CT_NVFP4_FORMAT, "quantization_status": "compressed",
            "config_groups": {"group_0": scheme}, "ignore": skip, "kv_cache_scheme": None}, None


# ============================================================================ files
class CheckpointTensors(Mapping):
    """A lazy ``name -> Tensor`` mapping over a Hugging Face folder (``model.safetensors``, or shards
    listed by ``model.safetensors.index.json``): files are memory-mapped, tensors read on access."""

    def __init__(self, path):
        from safetensors import safe_open

        self._open = safe_open
        self.path = os.fspath(path)
        index = os.path.join(self.path, "model.safetensors.index.json")
        single = os.path.join(self.path, "model.safetensors")
        self.where: dict = {}
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f).get("weight_map") or {}
            for file in dict.fromkeys(weight_map.values()):
                if not os.path.exists(os.path.join(self.path, file)):
                    raise ValueError(f"{index} lists {file!r}, which is not in {self.path}")
            self.files = list(dict.fromkeys(weight_map.values()))
            for file in self.files:  # the files' own key lists, in file order (the index may be unordered)
                for k in self._handle(file).keys():
                    self.where.setdefault(k, file)
            missing = [k for k in weight_map if k not in self.where]
            if missing:
                raise ValueError(f"{index} lists tensors missing from the shards, e.g. {missing[0]!r}")
        elif os.path.exists(single):
            self.files = ["model.safetensors"]
            self.where = {k: "model.safetensors" for k in self._handle("model.safetensors").keys()}
        else:
            raise ValueError(f"no model.safetensors or model.safetensors.index.json in {self.path}")

    _handles: dict

    def _handle(self, file: str):
        handles = self.__dict__.setdefault("_handles", {})
        if file not in handles:
            handles[file] = self._open(os.path.join(self.path, file), framework="pt")
        return handles[file]

    def names_in(self, file: str) -> list:
        return [k for k, f in self.where.items() if f == file]

    def __getitem__(self, name: str) -> Tensor:
        if name not in self.where:
            raise KeyError(name)
        return self._handle(self.where[name]).get_tensor(name)

    def __contains__(self, name) -> bool:
        return name in self.where

    def __iter__(self):
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)

    def close(self) -> None:
        self.__dict__.get("_handles", {}).clear()


_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
for _name, _code in (("float8_e8m0fnu", "F8_E8M0"), ("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        _ST_DTYPES[getattr(torch, _name)] = _code


class SafetensorsWriter:
    """Writes a safetensors file one tensor at a time (memory: one tensor): data goes to a side file
    as it comes, the header is written on :meth:`close`."""

    def __init__(self, path):
        self.path = os.fspath(path)
        self._data_path = self.path + ".data.tmp"
        self._data = open(self._data_path, "wb")
        self.entries: dict = {}
        self.nbytes = 0

    def add(self, name: str, t: Tensor) -> None:
        if name in self.entries:
            raise ValueError(f"tensor {name!r} written twice to {self.path}")
        if t.dtype not in _ST_DTYPES:
            raise ValueError(f"tensor {name!r}: dtype {t.dtype} has no safetensors encoding")
        t = t.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy()
        self._data.write(raw.data)
        self.entries[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape),
                              "data_offsets": [self.nbytes, self.nbytes + raw.size]}
        self.nbytes += raw.size

    def close(self) -> None:
        self._data.close()
        header = json.dumps({"__metadata__": {"format": "pt"}, **self.entries}, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)
        with open(self.path, "wb") as out, open(self._data_path, "rb") as data:
            out.write(len(header).to_bytes(8, "little"))
            out.write(header)
            shutil.copyfileobj(data, out, 16 << 20)
        os.remove(self._data_path)

    def abort(self) -> None:
        self._data.close()
        if os.path.exists(self._data_path):
            os.remove(self._data_path)
