"""Quantized checkpoints on disk: parse the quantization config, read a weight back from its companion
tensors, and write the on-disk names of each format.

Everything here works on a plain ``name -> Tensor`` mapping, one logical weight at a time, so a model
loader can stream a checkpoint tensor by tensor (``checkpoint_files.CheckpointTensors`` is such a
mapping over a Hugging Face folder, opening the safetensors files lazily).

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
INT4 (compressed-      ``X.weight_packed`` int32 [out, ceil(in/8)] (8 values per word, q + 8, first
tensors                element lowest) + ``X.weight_scale`` bf16/fp16 [out, ceil(in/group)] +
``pack-quantized``)    ``X.weight_shape`` [2]; symmetric only (Kimi-K2.5 / K2-Thinking experts, group
                       32; see :mod:`dynamoe.quant.int4`).
=====================  =========================================================================

The writers (``checkpoint_writer.write_quantized``, used by ``dynamoe quantize``) produce weight-only NVFP4: the
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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from .base import QuantizedWeight
from .fp8_block import BlockFP8Weight
from .int4 import SCALE_DTYPES as INT4_SCALE_DTYPES, INT4Weight
from .mxfp4 import MX_GROUP, MXFP4Weight
from .nvfp4 import NV_GROUP, NVFP4Weight

__all__ = [
    "QuantConfig", "quant_config_from_dir", "parse_quant_config", "read_weight", "stack_experts", "concat_out",
    "deinterleave_gate_up", "FORMATS", "DEFAULT_FP8_BLOCK", "WEIGHT_ONLY_NOTE",
]

#: ``dynamoe quantize --format`` choices
FORMATS = ("fp8", "fp8-ue8m0", "mxfp4", "nvfp4-modelopt", "nvfp4-ct", "int4-ct")
DEFAULT_FP8_BLOCK = (128, 128)
CT_NVFP4_FORMAT = "nvfp4-pack-quantized"
CT_INT_PACKED_FORMAT = "pack-quantized"
WEIGHT_ONLY_NOTE = ("weight-only NVFP4 export (dynamoe quantize): no input_scale is stored, because activation "
                    "scales need calibration data")
_SUPPORTED_METHODS = ("fp8 (blockwise, weight_block_size)", "mxfp4",
                      f"compressed-tensors ({CT_NVFP4_FORMAT}; {CT_INT_PACKED_FORMAT} with symmetric 4-bit int weights)",
                      "modelopt (quant_algo NVFP4)")
_E8M0 = getattr(torch, "float8_e8m0fnu", None)


# ============================================================================ config
@dataclass(frozen=True)
class QuantConfig:
    """A checkpoint's quantization, parsed once.

    ``kind`` names the on-disk layout: 'fp8', 'mxfp4', 'nvfp4-modelopt', 'nvfp4-ct' or 'int4-ct'.
    ``exclude`` is what the config says stays dense (``modules_to_not_convert`` / ``ignore`` /
    ``exclude_modules``; names or patterns, informational: :func:`read_weight` goes by the tensors
    actually present).
    """

    kind: str
    quant_method: str
    block: Optional[tuple] = None          # FP8 weight_block_size
    scale_fmt: str = "fp32"                # FP8: 'fp32' or 'ue8m0' (what the config announces)
    activation_scheme: Optional[str] = None
    group_size: Optional[int] = None       # 32 for MXFP4, 16 for NVFP4; INT4: the scheme's (None: per channel)
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
        groups = qc.get("config_groups") or {}
        formats = {qc["format"]} if qc.get("format") else set()
        for group in groups.values():
            if group.get("format"):
                formats.add(group["format"])
        if formats == {CT_INT_PACKED_FORMAT}:
            return _parse_ct_int4(groups, qc)
        for group in groups.values():
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


def _parse_ct_int4(groups: Mapping, qc: dict) -> QuantConfig:
    """compressed-tensors ``pack-quantized``: every config group's weights must be symmetric 4-bit ints with
    a ``group`` (group_size) or ``channel`` strategy, and no activation quantization (W4A16); all groups
    share one group size."""
    sizes = set()
    where = "compressed-tensors pack-quantized"
    for gname, group in groups.items():
        weights = group.get("weights")
        at = f"quantization_config.config_groups.{gname}.weights"
        if not weights:
            raise ValueError(f"{where}: {at} is missing (the scheme of the packed weights)")
        if weights.get("num_bits") != 4:
            raise ValueError(f"{where}: {at}.num_bits is {weights.get('num_bits')!r}; supported: 4 (INT4 W4A16)")
        if weights.get("type", "int") != "int":
            raise ValueError(f"{where}: {at}.type is {weights.get('type')!r}; supported: 'int'")
        if weights.get("symmetric", True) is not True:
            raise ValueError(f"{where}: {at}.symmetric is {weights.get('symmetric')!r}: asymmetric INT4 (weight_zero_point "
                             f"tensors) is not supported; supported: symmetric: true")
        if weights.get("actorder") not in (None, False):
            raise ValueError(f"{where}: {at}.actorder is {weights.get('actorder')!r}: activation reordering "
                             f"(weight_g_idx) is not supported; supported: actorder null")
        if weights.get("dynamic") not in (None, False):
            raise ValueError(f"{where}: {at}.dynamic is {weights.get('dynamic')!r}; supported: false (static weight scales)")
        strategy = weights.get("strategy", "group")
        if strategy == "group":
            size = weights.get("group_size")
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"{where}: {at}.group_size is {size!r}; the group strategy needs a positive int")
            sizes.add(size)
        elif strategy == "channel":
            sizes.add(None)
        else:
            raise ValueError(f"{where}: {at}.strategy is {strategy!r}; supported: 'group', 'channel'")
        if group.get("input_activations"):
            raise ValueError(f"{where}: quantization_config.config_groups.{gname}.input_activations is set: activation "
                             f"quantization is not supported; supported: W4A16 (input_activations null)")
    if not sizes:
        raise ValueError(f"{where}: quantization_config.config_groups is empty (no weights scheme)")
    if len(sizes) > 1:
        raise ValueError(f"{where}: config groups with different group sizes {sorted(sizes, key=str)} are not supported")
    return QuantConfig("int4-ct", "compressed-tensors", group_size=sizes.pop(), exclude=tuple(qc.get("ignore") or ()),
                       raw=qc)


def quant_config_from_dir(path) -> Optional[QuantConfig]:
    """Parse a Hugging Face folder's ``config.json`` (``quantization_config``, at the top or, in a
    vision-language wrapper such as Kimi-K2.5's, under ``text_config``) and ModelOpt's
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
    qc = config.get("quantization_config")
    text = config.get("text_config")
    if isinstance(text, dict) and text.get("quantization_config") is not None:
        if qc is not None and qc != text["quantization_config"]:
            raise ValueError(f"{cfg_path}: 'quantization_config' and 'text_config.quantization_config' are both given "
                             f"and differ: which one describes the tensors is ambiguous")
        qc = text["quantization_config"]
    return parse_quant_config(qc, hf)


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


def _read_int4_ct(tensors: Mapping, name: str, qcfg):
    packed_name, scale_name = name + "_packed", name + "_scale"
    base = name[: -len(".weight")] if name.endswith(".weight") else name
    shape_name = base + ".weight_shape" if name.endswith(".weight") else name + "_shape"
    zp_name, gidx_name = name + "_zero_point", name + "_g_idx"
    if packed_name not in tensors:
        if name in tensors:
            return tensors[name]
        if scale_name in tensors:
            raise ValueError(f"missing tensor {packed_name!r} (companion of {scale_name!r})")
        raise _not_found(tensors, name, qcfg)
    for extra, what in ((zp_name, "asymmetric INT4 (zero points)"), (gidx_name, "activation reordering (g_idx)")):
        if extra in tensors:
            raise ValueError(f"tensor {extra!r}: {what} is not supported; supported: symmetric INT4 without g_idx")
    packed = tensors[packed_name]
    scale = _need(tensors, scale_name, name)
    stored = _need(tensors, shape_name, name)
    _check_dtype(packed_name, packed, (torch.int32,))
    _check_dtype(scale_name, scale, INT4_SCALE_DTYPES)
    if packed.dim() < 2:
        raise ValueError(f"tensor {packed_name!r}: an INT4 weight needs [..., out, ceil(in/8)], found shape {_shape(packed)}")
    dims = tuple(int(v) for v in stored.reshape(-1).tolist())
    if len(dims) != 2 or dims[0] != packed.shape[-2] or -(-dims[1] // 8) != packed.shape[-1]:
        raise ValueError(f"tensor {shape_name!r}: expected (out={packed.shape[-2]}, in) with ceil(in/8)="
                         f"{packed.shape[-1]} (from {packed_name!r} {_shape(packed)}), found {dims}")
    shape = (*packed.shape[:-2], *dims)
    group = qcfg.group_size or dims[1]   # None: the channel strategy, one group per row
    _check_shape(scale_name, scale, (*shape[:-1], -(-dims[1] // group)),
                 f" (scales of the {shape} weight, group_size {group})")
    return INT4Weight(packed, scale, shape, group)


_READERS = {"fp8": _read_fp8, "mxfp4": _read_mxfp4, "nvfp4-modelopt": _read_nvfp4_modelopt, "nvfp4-ct": _read_nvfp4_ct,
            "int4-ct": _read_int4_ct}


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
    * MXFP4, INT4: per-row scales, always exact.
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
    if isinstance(first, INT4Weight):  # per-row scales: always exact
        return dataclasses.replace(first, shape=shape, weight_packed=torch.cat([w.weight_packed for w in weights], -2),
                                   weight_scale=torch.cat([w.weight_scale for w in weights], -2))
    raise ValueError(f"concat_out does not know the format {type(first).__name__}")


def deinterleave_gate_up(w: QuantizedWeight) -> QuantizedWeight:
    """GPT-OSS's interleaved gate/up rows (gate = rows 0::2, up = rows 1::2 of the out->in weight)
    reordered to gate-then-up. Exact for MXFP4, NVFP4 and INT4 (per-row scales); FP8 blocks span rows, so
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
    if isinstance(w, INT4Weight):
        return dataclasses.replace(w, weight_packed=w.weight_packed.index_select(-2, order),
                                   weight_scale=w.weight_scale.index_select(-2, order))
    raise ValueError(f"deinterleave_gate_up: rows of a {type(w).__name__} cannot be reordered without requantizing")
