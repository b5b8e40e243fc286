"""Typed configuration of the MoE layer.

Tutel-style dicts (``gate_type={'type': 'top', 'k': 2}``, ``experts={'type': 'ffn', ...}``) are parsed
once, at the edge, by :func:`gate_config_from_dict` / :func:`expert_config_from_dict`; everything
inside the layer reads these dataclasses. Unknown keys and bad values raise ``ValueError`` naming
the key and what is allowed. The configs are frozen: a change builds a new one
(``dataclasses.replace``) and hands it to the layer (e.g. ``MoELayer.set_aux_loss``), so a config
shared by several layers never changes under one of them.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch

from ..ops.activations import GLU_KINDS as GLU_ACTIVATIONS
from ..ops.routing import GROUP_RANKS

__all__ = [
    "GateConfig",
    "ExpertConfig",
    "MoEConfig",
    "gate_config_from_dict",
    "expert_config_from_dict",
    "GATE_TYPES",
    "EXPERT_TYPES",
    "AUX_LOSSES",
    "GROUP_RANKS",
]

GATE_TYPES = ("top", "cosine_top", "sigmoid", "sparsemixer", "custom")
EXPERT_TYPES = ("ffn", "glu", "llama_ffn", "custom")
AUX_LOSSES = ("gshard", "switch", "load_importance", "deepseek", "none")


def _check_choice(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _check_float(name: str, value: Any, positive: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")


def _check_bool(name: str, value: Any, optional: bool = False) -> None:
    if not (isinstance(value, bool) or (optional and value is None)):
        raise ValueError(f"{name} must be True or False{' or None' if optional else ''}, got {value!r}")


def _check_dict(name: str, value: Any) -> None:
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict, got {type(value).__name__}")


# |capacity_factor| above this only pads with empty slots (C > T can never fill); 0 means dropless.
MAX_CAPACITY_FACTOR = 1024.0
MAX_OVERLAP_DEGREE = 1024


def check_capacity_factor(value: Any) -> float:
    _check_float("capacity_factor", value)
    if abs(value) > MAX_CAPACITY_FACTOR:
        raise ValueError(f"capacity_factor must be in [-{MAX_CAPACITY_FACTOR:g}, {MAX_CAPACITY_FACTOR:g}] (0 = dropless), got {value!r}")
    return float(value)


def check_overlap_degree(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_OVERLAP_DEGREE:
        raise ValueError(f"a2a_ffn_overlap_degree must be an int in [1, {MAX_OVERLAP_DEGREE}], got {value!r}")
    return value


@dataclass(frozen=True)
class GateConfig:
    """One gate (router).

    type: "top" (linear logits, softmax top-k: Switch k=1, GShard k>=2), "cosine_top" (cosine
        router), "sigmoid" (DeepSeek-V3: sigmoid scores, selection bias, group-limited top-k,
        route scale), "sparsemixer" (Phi-3.5-MoE at inference: exactly 2 experts, each weighted by a softmax
        over the experts within a relative margin ``2 * jitter_eps`` of it; dynamoe.ops.routing.sparsemixer_top2)
        or "custom" (``module`` returns logits [T, E]). "top" with ``n_group`` > 1 is
        DeepSeek-V2's group-limited greedy (groups ranked by their best probability).
    group_rank: how a 'top' gate with groups ranks them: "max" (a group's best probability, DeepSeek-V2)
        or "top2_sum" (the sum of its two best probabilities, Mistral-4). Sigmoid gates keep DeepSeek-V3's
        rule (top-2 sum of the biased scores, the max without a bias).
    k: experts per token. capacity_factor: see dynamoe.ops.slots (0 = dropless).
    fp32_gate: compute logits in fp32 (without changing the parameters' dtype).
    gate_noise: std of training-time logit noise (Tutel: noise * randn / E).
    normalize: renormalise the top-k weights; None = the layer's ``normalize_gate`` for softmax
        gates (only when k > 1, as Switch keeps the raw probability), True for sigmoid gates.
    bias_on_logits: a sigmoid gate's selection bias is added to the logits, not to the sigmoid scores, to choose
        the experts (Kolibri-1); the weights are the chosen logits' sigmoids either way.
    """

    type: str = "top"
    k: Optional[int] = 2  # None only for 'custom': then the module's own top_k (Tutel), else 2
    capacity_factor: float = 1.0
    fp32_gate: bool = False
    gate_noise: float = 0.0
    normalize: Optional[bool] = None
    # 'top' only: a selection-only bias on the softmax probabilities (ERNIE-4.5's e_score_correction_bias;
    # sigmoid gates always have theirs)
    selection_bias: bool = False
    # sigmoid (DeepSeek) routing
    n_group: int = 1
    topk_group: int = 1
    group_rank: str = "max"  # 'top' only: see the docstring
    route_scale: float = 1.0  # (also 'top': DeepSeek-V2's routed_scaling_factor)
    bias_on_logits: bool = False  # 'sigmoid' only: see the docstring
    # sparsemixer routing: the relative margin of the experts that share an expert's softmax (Phi-3.5-MoE's
    # router_jitter_noise)
    jitter_eps: float = 0.01
    # cosine router
    proj_dim: int = 256
    init_t: float = 0.5
    # custom: an nn.Module instance, or a class called as
    # module(model_dim=..., num_global_experts=..., **module_kwargs) (Tutel's protocol)
    module: Any = None
    module_kwargs: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_choice("gate type", self.type, GATE_TYPES)
        if not (self.k is None and self.type == "custom"):
            _check_int("gate k", self.k, 1)
        object.__setattr__(self, "capacity_factor", check_capacity_factor(self.capacity_factor))
        _check_bool("fp32_gate", self.fp32_gate)
        _check_float("gate_noise", self.gate_noise)
        if self.gate_noise < 0:
            raise ValueError(f"gate_noise must be >= 0, got {self.gate_noise}")
        _check_bool("normalize", self.normalize, optional=True)
        _check_bool("selection_bias", self.selection_bias)
        if self.selection_bias and self.type != "top":
            raise ValueError(f"selection_bias is for gate type 'top' (sigmoid gates always have one), got type {self.type!r}")
        _check_int("n_group", self.n_group, 1)
        _check_int("topk_group", self.topk_group, 1)
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group must be <= n_group={self.n_group}, got {self.topk_group}")
        if self.type not in ("sigmoid", "top") and (self.n_group, self.topk_group) != (1, 1):
            raise ValueError(f"n_group/topk_group (group-limited routing) need gate type 'sigmoid' or 'top', "
                             f"got type {self.type!r}")
        _check_choice("group_rank", self.group_rank, GROUP_RANKS)
        if self.group_rank != "max" and self.type != "top":
            raise ValueError(f"group_rank={self.group_rank!r} is for gate type 'top' (sigmoid gates rank groups by "
                             f"DeepSeek-V3's rule), got type {self.type!r}; allowed there: 'max'")
        _check_float("route_scale", self.route_scale, positive=True)
        _check_bool("bias_on_logits", self.bias_on_logits)
        if self.bias_on_logits and self.type != "sigmoid":
            raise ValueError(f"bias_on_logits is for gate type 'sigmoid' (where the selection bias goes), got type "
                             f"{self.type!r}")
        _check_float("jitter_eps", self.jitter_eps)
        if self.jitter_eps < 0:
            raise ValueError(f"jitter_eps must be >= 0, got {self.jitter_eps}")
        if self.type == "sparsemixer" and (self.k != 2 or self.route_scale != 1.0 or self.normalize
                                           or self.selection_bias or self.gate_noise):
            raise ValueError(f"gate type 'sparsemixer' picks exactly k=2 experts, unscaled, unnormalised, without "
                             f"selection bias or noise; got k={self.k!r}, route_scale={self.route_scale!r}, "
                             f"normalize={self.normalize!r}, selection_bias={self.selection_bias!r}, "
                             f"gate_noise={self.gate_noise!r}")
        _check_int("proj_dim", self.proj_dim, 1)
        _check_float("init_t", self.init_t, positive=True)
        _check_dict("gate module_kwargs", self.module_kwargs)
        if self.type == "custom" and self.module is None:
            raise ValueError("gate type 'custom' needs 'module': an nn.Module (or class) returning logits [T, E]")
        if self.type != "custom" and self.module is not None:
            raise ValueError(f"gate 'module' is only allowed with type 'custom', got type {self.type!r}")


@dataclass(frozen=True)
class ExpertConfig:
    """The routed experts (and optional shared experts).

    type: "ffn" (fc1 -> activation -> fc2, Tutel's layout and names), "glu" (gate/up/down:
        SwiGLU, GeGLU, GPT-OSS clamped SwiGLU), "llama_ffn" (Tutel's: act(x W1) * (x W2) -> W3, flat
        ``W_fc1/2/3``, no biases, ``activation_fn`` default silu) or "custom" (``module``; see
        dynamoe.moe.experts).
    num_experts_per_device: local experts L (E = L * world size); a negative -n shards each expert
        over n ranks along its hidden dim (E = world size / n; see dynamoe.moe.sharding).
    hidden_size_per_expert: F.
    activation_fn: ffn activation, a callable or "relu"/"gelu"/"silu"/"relu2" (squared ReLU); glu_activation for
        "glu".
    num_shared_experts / shared_hidden_size: always-on experts added to the routed output.
    shared_gate: scale the shared experts' output by sigmoid(x w) per token, w [D] (Qwen1.5/2-MoE's
        ``shared_expert_gate``); needs shared experts.
    shared_fused_gate_up: the shared GLU's gate and up projections as one ``gate_up_proj`` linear
        [2S, D] (gate rows, then up rows: GraniteMoE-Shared's ``input_linear``) instead of two.
    gpt_oss_limit: the clamp of the 'gpt_oss' and 'silu_clamp' GLU activations.
    shared_glu_activation / shared_glu_limit: the shared GLU's own activation and clamp (Step-3.5 clamps its
        shared expert at another bound than its routed ones); None = the routed experts'.
    shared_glu_bias: biases on the shared GLU's projections (HY-V3's ``mlp_bias`` shared MLP beside bias-free routed
        experts); None = ``glu_bias``.
    """

    type: str = "ffn"
    num_experts_per_device: int = 1
    hidden_size_per_expert: int = 0
    activation_fn: Union[str, Callable, None] = None  # ffn (None = relu) and llama_ffn (None = silu)
    has_fc1_bias: bool = True
    has_fc2_bias: bool = True
    output_dim: Optional[int] = None
    glu_activation: Optional[str] = None  # glu only; None = silu
    glu_bias: bool = False
    gpt_oss_alpha: float = 1.702
    gpt_oss_limit: float = 7.0
    num_shared_experts: int = 0
    shared_hidden_size: Optional[int] = None
    shared_gate: bool = False
    shared_fused_gate_up: bool = False
    shared_glu_activation: Optional[str] = None
    shared_glu_limit: Optional[float] = None
    shared_glu_bias: Optional[bool] = None
    module: Any = None
    module_kwargs: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_choice("experts type", self.type, EXPERT_TYPES)
        n = self.num_experts_per_device
        if isinstance(n, bool) or not isinstance(n, int) or n == 0:
            raise ValueError(f"num_experts_per_device must be a non-zero int (L > 0 experts per rank, or -n: n ranks "
                             f"share one expert, split along its hidden dim), got {n!r}")
        if self.type != "custom":
            _check_int("hidden_size_per_expert", self.hidden_size_per_expert, 1)
        if self.type == "glu":
            if self.activation_fn is not None:
                raise ValueError(f"glu experts take glu_activation ({', '.join(map(repr, GLU_ACTIVATIONS))}), not activation_fn")
            object.__setattr__(self, "glu_activation", self.glu_activation or "silu")
            _check_choice("glu_activation", self.glu_activation, GLU_ACTIVATIONS)
        elif self.glu_activation is not None:
            raise ValueError(f"glu_activation is for experts type 'glu', got type {self.type!r}")
        if self.shared_glu_activation is not None or self.shared_glu_limit is not None:
            if self.type != "glu" or not self.num_shared_experts:
                raise ValueError("shared_glu_activation / shared_glu_limit set the shared GLU's activation: they need "
                                 f"glu experts and num_shared_experts >= 1, got type {self.type!r} and "
                                 f"num_shared_experts={self.num_shared_experts!r}")
            if self.shared_glu_activation is not None:
                _check_choice("shared_glu_activation", self.shared_glu_activation, GLU_ACTIVATIONS)
            if self.shared_glu_limit is not None:
                _check_float("shared_glu_limit", self.shared_glu_limit, positive=True)
        for name in ("has_fc1_bias", "has_fc2_bias", "glu_bias", "shared_gate", "shared_fused_gate_up"):
            _check_bool(name, getattr(self, name))
        if self.shared_glu_bias is not None:
            _check_bool("shared_glu_bias", self.shared_glu_bias)
            if self.type != "glu" or not self.num_shared_experts:
                raise ValueError("shared_glu_bias sets the shared GLU's biases: it needs glu experts and "
                                 f"num_shared_experts >= 1, got type {self.type!r} and "
                                 f"num_shared_experts={self.num_shared_experts!r}")
        _check_float("gpt_oss_alpha", self.gpt_oss_alpha, positive=True)
        _check_float("gpt_oss_limit", self.gpt_oss_limit, positive=True)
        if self.shared_hidden_size is not None:
            _check_int("shared_hidden_size", self.shared_hidden_size, 1)
        _check_dict("experts module_kwargs", self.module_kwargs)
        if isinstance(self.activation_fn, str):
            _check_choice("activation_fn", self.activation_fn, ("relu", "gelu", "silu", "relu2"))
        elif self.activation_fn is not None and not callable(self.activation_fn):
            raise ValueError(f"activation_fn must be a callable or one of ['relu', 'gelu', 'silu', 'relu2'], got "
                             f"{self.activation_fn!r}")
        if self.output_dim is not None:
            _check_int("output_dim", self.output_dim, 1)
        _check_int("num_shared_experts", self.num_shared_experts, 0)
        if self.shared_gate and not self.num_shared_experts:
            raise ValueError("shared_gate gates the shared experts' output: it needs num_shared_experts >= 1")
        if self.shared_fused_gate_up and (not self.num_shared_experts or self.type != "glu"):
            raise ValueError("shared_fused_gate_up fuses the shared GLU's gate and up: it needs glu experts and "
                             "num_shared_experts >= 1")
        if self.type == "custom" and self.module is None:
            raise ValueError("experts type 'custom' needs 'module': an nn.Module (or class) following dynamoe.moe.experts.ExpertsProtocol")
        if self.type == "llama_ffn" and (self.output_dim not in (None, 0) or self.num_shared_experts):
            raise ValueError("llama_ffn experts (Tutel's) have output_dim = model_dim and no shared experts")
        if self.type == "custom" and self.num_shared_experts:
            raise ValueError("shared experts go with 'ffn' or 'glu' experts; add them inside a custom module instead")


@dataclass(frozen=True)
class MoEConfig:
    """Everything the layer needs, validated once."""

    model_dim: int
    gates: tuple = (GateConfig(),)  # a GateConfig or a list of them is accepted and kept as a tuple
    experts: ExpertConfig = field(default_factory=ExpertConfig)
    is_postscore: bool = True
    batch_prioritized_routing: bool = False
    normalize_gate: bool = True
    aux_loss: str = "gshard"
    z_loss_coef: float = 0.0
    # DeepSeek device-level balance loss over this many equal groups of experts (0 = off), added
    # to l_aux with weight device_loss_coef
    device_loss_groups: int = 0
    device_loss_coef: float = 1.0
    a2a_ffn_overlap_degree: int = 1
    parallel_type: str = "adaptive:1"
    use_2dh: bool = False
    # reject NaN/Inf inputs with a clear error (costs one host sync per forward; a serving model that
    # validates its inputs at the edge turns it off)
    check_finite: bool = True
    dtype: Optional[torch.dtype] = None
    device: Any = None

    def __post_init__(self) -> None:
        _check_int("model_dim", self.model_dim, 1)
        for name in ("is_postscore", "batch_prioritized_routing", "normalize_gate", "use_2dh", "check_finite"):
            _check_bool(name, getattr(self, name))
        if self.dtype is not None and not (isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point):
            raise ValueError(f"dtype must be a floating torch.dtype (e.g. torch.bfloat16) or None, got {self.dtype!r}")
        gates = (self.gates,) if isinstance(self.gates, GateConfig) else self.gates
        if not isinstance(gates, (list, tuple)) or not gates or not all(isinstance(g, GateConfig) for g in gates):
            raise ValueError("gates must be a GateConfig or a non-empty list of GateConfig")
        object.__setattr__(self, "gates", tuple(gates))
        if not isinstance(self.experts, ExpertConfig):
            raise ValueError(f"experts must be an ExpertConfig, got {type(self.experts).__name__}")
        _check_choice("aux_loss", self.aux_loss, AUX_LOSSES)
        _check_float("z_loss_coef", self.z_loss_coef)
        _check_int("device_loss_groups", self.device_loss_groups, 0)
        _check_float("device_loss_coef", self.device_loss_coef)
        check_overlap_degree(self.a2a_ffn_overlap_degree)
        parse_parallel_type(self.parallel_type)
        # checks against the expert count happen in MoELayer: with expert parallelism the global
        # count is num_experts_per_device * world size, which the config does not know

    @property
    def num_experts(self) -> int:
        return self.experts.num_experts_per_device


def parse_parallel_type(parallel_type: str, sharded_count: int = 1) -> int:
    """'data' | 'model' | 'auto' | 'adaptive:R' -> the adaptive degree R (Tutel's meaning: 'data' = 1,
    'model' = ``sharded_count``, 'auto' = 1, 'adaptive:R' = R >= 0)."""
    if parallel_type in ("data", "auto"):
        return 1
    if parallel_type == "model":
        return sharded_count
    if isinstance(parallel_type, str) and parallel_type.startswith("adaptive:"):
        try:
            r = int(parallel_type.split(":", 1)[1])
        except ValueError:
            r = -1
        if r >= 0:
            return r
    raise ValueError(f"parallel_type must be 'data', 'model', 'auto' or 'adaptive:R' (R >= 0), got {parallel_type!r}")


_GATE_ALIASES = {"top_k": "k"}
_EXPERT_ALIASES = {"count_per_node": "num_experts_per_device", "num_local_experts": "num_experts_per_device"}


def _from_dict(cls, d: dict, what: str, aliases: dict):
    """Map a Tutel dict onto ``cls``. For type 'custom', unknown keys are options of the user's
    module class (Tutel passes them to its constructor); elsewhere they are errors."""
    names = {f.name for f in dataclasses.fields(cls)} - {"module_kwargs"}
    kwargs: dict = {}
    extra: dict = dict(d.get("module_kwargs", {}))
    custom = d.get("type") == "custom"
    for key, value in d.items():
        if key == "module_kwargs":
            continue
        if custom and key == "top_k":  # Tutel hands top_k to custom gates too
            extra[key] = value
        key = aliases.get(key, key)
        if key in names:
            kwargs[key] = value
        elif custom:
            extra[key] = value
        else:
            raise ValueError(f"unknown {what} key {key!r}; allowed: {sorted(names | set(aliases))}")
    if extra:
        kwargs["module_kwargs"] = extra
    if custom and cls is GateConfig and "k" not in kwargs:
        kwargs["k"] = None  # the custom module's own top_k decides (Tutel)
    return cls(**kwargs)


def gate_config_from_dict(d: dict) -> GateConfig:
    """Parse a Tutel gate dict, e.g. ``{'type': 'top', 'k': 2, 'capacity_factor': 0, 'fp32_gate': True}``."""
    _check_dict("gate_type", d)
    return _from_dict(GateConfig, dict(d), "gate_type", _GATE_ALIASES)


def expert_config_from_dict(d: dict) -> ExpertConfig:
    """Parse a Tutel experts dict, e.g. ``{'type': 'ffn', 'num_experts_per_device': 2, 'hidden_size_per_expert': 1024}``."""
    _check_dict("experts", d)
    return _from_dict(ExpertConfig, dict(d), "experts", _EXPERT_ALIASES)
