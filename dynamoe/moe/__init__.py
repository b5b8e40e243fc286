"""The MoE layer: gate -> dispatch plan -> experts -> combine.

Typed API: ``MoELayer(MoEConfig(...))``. Tutel-compatible API: ``moe_layer(gate_type=..., model_dim=...,
experts=...)``.
"""
from .config import ExpertConfig, GateConfig, MoEConfig, expert_config_from_dict, gate_config_from_dict
from .dispatch import (DispatchPlan, RoutingStats, build_plan, combine_padded, combine_ragged, dispatch_padded,
                       dispatch_ragged)
from .experts import ExpertsProtocol, FFNExperts, GLUExperts, SharedExperts
from .gates import CosineGate, LinearGate, Routing
from .layer import MoELayer
from .losses import (deepseek_device_loss, deepseek_expert_loss, gshard_loss, load_importance_loss, router_z_loss,
                     switch_loss, update_selection_bias)
from .tutel_compat import moe_layer
from .fast_dispatch import (extract_critical, fast_cumsum_sub_one, fast_decode, fast_dispatcher, fast_encode,
                            top_k_routing)

__all__ = [
    "MoELayer", "moe_layer", "MoEConfig", "GateConfig", "ExpertConfig", "gate_config_from_dict",
    "expert_config_from_dict", "Routing", "RoutingStats", "DispatchPlan", "build_plan", "dispatch_ragged", "dispatch_padded",
    "combine_ragged", "combine_padded", "LinearGate",
    "CosineGate", "FFNExperts", "GLUExperts", "SharedExperts", "ExpertsProtocol", "gshard_loss", "switch_loss",
    "load_importance_loss", "deepseek_expert_loss", "deepseek_device_loss", "router_z_loss",
    "update_selection_bias", "top_k_routing", "extract_critical", "fast_encode", "fast_decode", "fast_dispatcher",
    "fast_cumsum_sub_one",
]
