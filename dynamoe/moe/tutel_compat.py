"""``moe_layer``: Tutel's constructor signature over :class:`MoELayer`, so Tutel users switch by
changing the import. The dicts are converted once into typed configs here, with Tutel's rules:
``group=None`` is the default (world) process group when torch.distributed is initialised, a gate's k
above the number of experts becomes that number (one warning), and a fractional
``num_experts_per_device`` 1/n means n ranks per expert (= -n)."""
from __future__ import annotations

import copy
import re
import warnings

import torch.distributed as dist

from .config import MoEConfig, expert_config_from_dict, gate_config_from_dict
from .layer import MoELayer

__all__ = ["moe_layer"]

_EXTRA_KWARGS = ("aux_loss", "z_loss_coef", "device_loss_groups", "device_loss_coef", "dtype", "device")


class moe_layer(MoELayer):  # noqa: N801 -- Tutel's name
    """Tutel-compatible MoE layer.

    Args:
        gate_type: dict (or list of dicts, one per gate) such as ``{'type': 'top', 'k': 2,
            'capacity_factor': 1.0, 'fp32_gate': True, 'gate_noise': 0.0}``; types 'top', 'cosine_top',
            'sigmoid' (DeepSeek: 'n_group', 'topk_group', 'route_scale') and 'custom' ('module').
        model_dim: D.
        experts: dict such as ``{'type': 'ffn', 'num_experts_per_device': 2, 'hidden_size_per_expert':
            2048, 'activation_fn': lambda x: F.relu(x)}``; types 'ffn', 'llama_ffn' (Tutel's), 'glu', 'custom'.
        scan_expert_func: called as f(name, param) for every expert parameter.
        result_func: applied to the output (which carries ``.l_aux`` and ``.routing_stats``).
        is_postscore, batch_prioritized_routing, normalize_gate, is_gshard_loss, parallel_type,
        a2a_ffn_overlap_degree, use_2dh, group, seeds: as in Tutel (``group=None``: the default
        process group when torch.distributed is initialised, else this process; a group of one rank,
        e.g. ``net.create_standalone_group()``, keeps every expert local).
        aux_loss, z_loss_coef, device_loss_groups, device_loss_coef, dtype, device: dynamoe
            extensions (see MoEConfig).
    """

    _clamps_top_k = True

    def __init__(self, gate_type, model_dim: int, experts=None, scan_expert_func=None, result_func=None,
                 group=None, seeds=None, a2a_ffn_overlap_degree: int = 1, is_postscore: bool = True,
                 batch_prioritized_routing: bool = False, normalize_gate: bool = True,
                 is_gshard_loss: bool = True, parallel_type: str = "adaptive:1", use_2dh: bool = False,
                 **kwargs):
        extra = {}
        for key, value in kwargs.items():
            if key == "fp32_gate":  # Tutel's deprecated spelling: belongs in gate_type
                extra["fp32_gate"] = value
            elif key == "pad_samples":  # Tutel: deprecated, always False
                warnings.warn("moe_layer(pad_samples=...) is deprecated in Tutel and ignored", DeprecationWarning, stacklevel=2)
            elif key in _EXTRA_KWARGS:
                extra[key] = value
            else:
                raise ValueError(f"unknown moe_layer argument {key!r}; dynamoe extensions allowed: {list(_EXTRA_KWARGS)}")
        if isinstance(gate_type, str):
            m = re.fullmatch(r"Top(\d+)Gate", gate_type)
            if not m:
                raise ValueError(f"gate_type string must look like 'Top2Gate', got {gate_type!r}")
            warnings.warn(f"gate_type={gate_type!r} is deprecated; use {{'type': 'top', 'k': {m.group(1)}}}", DeprecationWarning, stacklevel=2)
            gate_type = {"type": "top", "k": int(m.group(1))}
        gate_dicts = [copy.copy(g) for g in (gate_type if isinstance(gate_type, (list, tuple)) else [gate_type])]
        if "fp32_gate" in extra:
            fp32 = extra.pop("fp32_gate")
            for g in gate_dicts:
                if isinstance(g, dict):
                    g.setdefault("fp32_gate", fp32)
        if experts is None:
            raise ValueError("experts must be a dict such as {'type': 'ffn', 'num_experts_per_device': 2, 'hidden_size_per_expert': 1024}")
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD  # Tutel: `group or dist.group.WORLD`
        experts = _tutel_local_count(experts)
        with_self = experts.pop("activation_fn_with_self", None) if isinstance(experts, dict) else None
        if with_self is not None and (experts.get("activation_fn") is not None or experts.get("type") != "ffn"):
            raise ValueError("activation_fn_with_self (Tutel's ffn option) replaces activation_fn: give one of them, with type 'ffn'")
        E = MoELayer.global_expert_count(experts.get("num_experts_per_device", experts.get("count_per_node", 1)), group)
        clamped = []
        for g in gate_dicts:
            k = g.get("k", g.get("top_k")) if isinstance(g, dict) and g.get("type") != "custom" else None
            if isinstance(k, int) and not isinstance(k, bool) and k > E:
                clamped.append(k)
                g.pop("top_k", None)
                g["k"] = E
        if clamped:
            warnings.warn(f"gate k={clamped[0]} exceeds the {E} experts: using k={E} (Tutel's rule)", UserWarning, stacklevel=2)
        aux_loss = extra.pop("aux_loss", "gshard" if is_gshard_loss else "load_importance")
        config = MoEConfig(
            model_dim=model_dim,
            gates=[gate_config_from_dict(g) for g in gate_dicts],
            experts=expert_config_from_dict(experts),
            is_postscore=is_postscore,
            batch_prioritized_routing=batch_prioritized_routing,
            normalize_gate=normalize_gate,
            aux_loss=aux_loss,
            a2a_ffn_overlap_degree=a2a_ffn_overlap_degree,
            parallel_type=parallel_type,
            use_2dh=use_2dh,
            **extra,
        )
        super().__init__(config, scan_expert_func=scan_expert_func, result_func=result_func, group=group, seeds=seeds)
        self._k_clamp_warned = bool(clamped)
        if with_self is not None:  # Tutel's activation_fn_with_self(x, experts_module)
            experts_module = self.experts
            self.experts.activation_fn = lambda x: with_self(x, experts_module)


def _tutel_local_count(experts: dict) -> dict:
    """Tutel's spellings of the local expert count: a fraction 1/n is -n (n ranks share an expert),
    and -1 is one expert per rank."""
    if not isinstance(experts, dict):
        return experts
    experts = dict(experts)
    for key in ("num_experts_per_device", "count_per_node"):
        n = experts.get(key)
        if isinstance(n, float) and 0 < n < 1:
            experts[key] = -int(1 / (n + 1e-5))
        elif n == -1 and not isinstance(n, bool):
            experts[key] = 1
    return experts
