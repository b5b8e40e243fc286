"""Writing quantized checkpoints: which tensors a format quantizes, fused groups that share an NVFP4
global scale, the on-disk names of each format and the config entries (see ``checkpoint``)."""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Optional

import torch
from torch import Tensor

from .fp8_block import BlockFP8Weight
from .int4 import INT4_DEFAULT_GROUP, INT4Weight
from .mxfp4 import MX_GROUP, MXFP4Weight
from .nvfp4 import NV_GROUP, NVFP4Weight

from .checkpoint import CT_INT_PACKED_FORMAT, CT_NVFP4_FORMAT, DEFAULT_FP8_BLOCK, FORMATS, WEIGHT_ONLY_NOTE, _E8M0  # noqa: F401

__all__ = ["MODULE_KINDS", "default_modules", "module_kind", "is_quant_target", "fusion_group", "write_quantized",
           "quant_config_entries"]


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


#: what ``dynamoe quantize --modules`` can quantize: the routed experts, the attention projections, every other
#: Linear of the decoder layers (dense MLPs, shared experts), and the output head
MODULE_KINDS = ("experts", "attention", "mlp", "lm_head")


def default_modules(fmt: str) -> frozenset:
    """What ``fmt`` quantizes unless told otherwise: FP8 / NVFP4 every Linear of the decoder layers (as the
    published FP8 / NVFP4 checkpoints), MXFP4 / INT4 the routed experts (GPT-OSS, Kimi-K2.5)."""
    _check_format(fmt)
    return frozenset(("experts",) if fmt in ("mxfp4", "int4-ct") else ("experts", "attention", "mlp"))


def check_modules(modules: Iterable[str]) -> frozenset:
    """``modules`` as a frozenset of :data:`MODULE_KINDS`; ValueError naming the allowed values otherwise."""
    modules = frozenset(modules)
    bad = sorted(modules - set(MODULE_KINDS))
    if bad or not modules:
        raise ValueError(f"modules must be a non-empty selection of {list(MODULE_KINDS)}, got {sorted(modules)}")
    return modules


def module_kind(name: str, tensor: Tensor) -> Optional[str]:
    """Which of :data:`MODULE_KINDS` the weight ``name`` belongs to, or None (routers, norms, embeddings,
    biases and anything outside the decoder layers but the head)."""
    if not isinstance(tensor, Tensor) or not tensor.is_floating_point():
        return None
    if name == "lm_head.weight" or name.endswith(".lm_head.weight"):
        return "lm_head" if tensor.dim() == 2 else None
    if not _LAYER.search(name):
        return None
    if (tensor.dim() == 3 and _ROUTED_FUSED.search(name)) or (tensor.dim() == 2 and _ROUTED_2D.search(name)):
        return "experts"
    if tensor.dim() != 2 or not name.endswith(".weight") or _is_router_norm_or_embedding(name):
        return None
    return "attention" if ".self_attn." in name or ".attention." in name else "mlp"


def is_quant_target(name: str, tensor: Tensor, fmt: str, exclude: Iterable = (), modules: Optional[Iterable] = None) -> bool:
    """Whether ``dynamoe quantize --format fmt [--modules ...]`` quantizes this tensor: its
    :func:`module_kind` is among ``modules`` (None: :func:`default_modules`), no ``exclude`` regex is found
    in its name, and the format can take its shape:

    * FP8 (blockwise) / NVFP4: 2D weights (NVFP4: in % 16). GPT-OSS's fused 3D experts stay dense (no
      public FP8 / NVFP4 layout for them: use mxfp4).
    * MXFP4: 2D weights and GPT-OSS's fused 3D experts (stored in->out), in % 32.
    * INT4 (``int4-ct``, symmetric, group 32, bf16 scales): 2D weights (Kimi-K2.5's layout); GPT-OSS's fused
      3D experts stay dense (no public INT4 layout for them).

    Routers (``mlp.gate``, ``mlp.router``, ``shared_expert_gate``), norms and embeddings are never quantized.
    Shapes the format cannot take stay dense.
    """
    _check_format(fmt)
    modules = default_modules(fmt) if modules is None else check_modules(modules)
    kind = module_kind(name, tensor)
    if kind is None or kind not in modules or any(re.search(p, name) for p in exclude):
        return False
    if fmt == "mxfp4":
        in_features = tensor.shape[-2] if tensor.dim() == 3 else tensor.shape[-1]   # fused experts: in->out
        return in_features % MX_GROUP == 0
    if tensor.dim() != 2:
        return False
    if fmt == "int4-ct":
        return kind == "experts" or tensor.shape[-1] % INT4_DEFAULT_GROUP == 0
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
    if fmt == "int4-ct":
        q = INT4Weight.quantize(t, group_size=INT4_DEFAULT_GROUP)
        base = name[: -len(".weight")]
        return {base + ".weight_packed": q.weight_packed, base + ".weight_scale": q.weight_scale,
                base + ".weight_shape": torch.tensor(list(t.shape), dtype=torch.int32)}
    amax = None if global_amax is None else global_amax.get(name)
    q = NVFP4Weight.quantize(t, global_amax=amax)
    if fmt == "nvfp4-modelopt":
        return {name: q.weight, name + "_scale": q.weight_scale, name + "_scale_2": q.weight_scale_2.reshape(())}
    return {name + "_packed": q.weight, name + "_scale": q.weight_scale,
            name + "_global_scale": q.weight_global_scale.reshape(1)}


def write_quantized(tensors: Mapping[str, Tensor], fmt: str, *, exclude: Iterable = (), block: tuple = DEFAULT_FP8_BLOCK,
                    global_amax: Optional[Mapping[str, float]] = None, modules: Optional[Iterable] = None) -> dict:
    """The on-disk tensors of ``fmt`` for ``tensors`` (dense, logical names): quantization targets
    (:func:`is_quant_target` with ``modules``) become their companion tensors, everything else passes through as is.

    ``global_amax`` (NVFP4): name -> the amax of the weight's fused group (:func:`fusion_group`), so
    that q/k/v and gate/up share ``weight_scale_2``; without it each weight gets its own.
    Call it with one tensor at a time to keep memory at about one tensor.
    """
    _check_format(fmt)
    exclude = tuple(exclude)
    out: dict = {}
    for name, t in tensors.items():
        parts = _quantize_one(name, t, fmt, tuple(block), global_amax) if is_quant_target(name, t, fmt, exclude, modules) \
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
    if fmt == "int4-ct":
        scheme = {"targets": ["Linear"], "format": CT_INT_PACKED_FORMAT, "input_activations": None,
                  "output_activations": None,
                  "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                              "group_size": INT4_DEFAULT_GROUP, "dynamic": False, "actorder": None, "observer": "minmax"}}
        return {"quant_method": "compressed-tensors", "format": CT_INT_PACKED_FORMAT, "quantization_status": "compressed",
                "config_groups": {"group_0": scheme}, "ignore": skip, "kv_cache_scheme": None}, None
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
