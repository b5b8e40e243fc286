"""Gates: a module that turns tokens into logits, and the scoring policy that turns logits into a
:class:`Routing` (ids, weights, scores).

Legend: T tokens, D model dim, E experts, K experts per token, P cosine projection dim.

Parameter names follow Tutel (``wg``, ``cosine_projector``, ``sim_matrix``, ``temperature``) so
state dicts carry over; the DeepSeek selection bias is HF's ``e_score_correction_bias``.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops.routing import sigmoid_group_topk, softmax_group_topk, softmax_topk, sparsemixer_top2
from .config import GateConfig, check_capacity_factor

__all__ = ["Routing", "LinearGate", "CosineGate", "build_gate", "gate_config", "set_gate_config", "route", "renormalizes"]


@dataclass
class Routing:
    """The gate's decision, as plain data.

    ids_TK: int64 chosen experts, best first. weights_TK: fp32 combine weights.
    scores_TE: fp32 softmax probabilities (or sigmoid scores) of the logits routing used (with
        training noise if any), for the balance losses; None at inference when no loss needs them.
    logits_TE: the gate's raw output (z-loss); noisy_logits_TE: what routing chose from (the same
        tensor when there is no noise).
    """

    ids_TK: Tensor
    weights_TK: Tensor
    scores_TE: Optional[Tensor]
    logits_TE: Tensor
    noisy_logits_TE: Tensor


class _TutelGateAttributes:
    """Tutel's gate attributes ``top_k``, ``capacity_factor`` and ``gate_noise``, read from the gate's own
    frozen config (``routing_config``, set by :func:`build_gate` and by its layer). Assigning one gives
    the gate a new config (never a change to one the caller or another layer holds); the layer's
    ``config`` follows its gates, so the assignment changes routing as in Tutel."""

    routing_config: Optional[GateConfig] = None

    def _cfg(self) -> GateConfig:
        if self.routing_config is None:
            raise ValueError(f"{type(self).__name__} was built outside an MoE layer: it has no routing config")
        return self.routing_config

    @property
    def top_k(self) -> int:
        return self._cfg().k

    @top_k.setter
    def top_k(self, k: int) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"top_k must be an int >= 1, got {k!r}")
        self.routing_config = dataclasses.replace(self._cfg(), k=k)

    @property
    def capacity_factor(self) -> float:
        return self._cfg().capacity_factor

    @capacity_factor.setter
    def capacity_factor(self, value: float) -> None:
        self.routing_config = dataclasses.replace(self._cfg(), capacity_factor=check_capacity_factor(value))

    @property
    def gate_noise(self) -> float:
        return self._cfg().gate_noise

    @gate_noise.setter
    def gate_noise(self, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"gate_noise must be a finite number >= 0, got {value!r}")
        self.routing_config = dataclasses.replace(self._cfg(), gate_noise=float(value))


def gate_config(gate: nn.Module, default: GateConfig) -> GateConfig:
    """The config ``gate`` routes by: its own (a built-in gate's, changed by Tutel's attributes), or
    ``default`` for a custom gate module."""
    cfg = gate.routing_config if isinstance(gate, _TutelGateAttributes) else None
    return default if cfg is None else cfg


def set_gate_config(gate: nn.Module, cfg: GateConfig) -> None:
    """Give a built-in gate ``cfg`` (a custom gate module keeps what it has)."""
    if isinstance(gate, _TutelGateAttributes):
        gate.routing_config = cfg


class LinearGate(_TutelGateAttributes, nn.Module):
    """logits = x @ wg^T. With ``fp32_gate`` the product is computed in fp32 from fp32 copies, so
    the parameter keeps whatever dtype the model has (Tutel's ``wg.float()`` mutates it)."""

    def __init__(self, model_dim: int, num_experts: int, fp32_gate: bool = False, selection_bias: bool = False,
                 dtype: torch.dtype | None = None, device=None):
        super().__init__()
        self.fp32_gate = fp32_gate
        self.wg = nn.Linear(model_dim, num_experts, bias=False, dtype=torch.float32 if fp32_gate else dtype, device=device)
        if selection_bias:
            # DeepSeek-V3: added to the scores only to choose experts; updated by the aux-loss-free
            # rule in steps (~1e-3) that bf16 cannot hold, so it stays fp32 whatever .to() says.
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32, device=device))
        else:
            self.e_score_correction_bias = None

    def _apply(self, fn, recurse=True):
        bias = self.e_score_correction_bias
        super()._apply(fn, recurse)
        if bias is not None and self.e_score_correction_bias.dtype != torch.float32:
            self.e_score_correction_bias = bias.to(device=self.e_score_correction_bias.device, dtype=torch.float32)
        return self

    def forward(self, x_TD: Tensor) -> Tensor:
        w = self.wg.weight
        if self.fp32_gate:
            return F.linear(x_TD.float(), w.float())
        return F.linear(x_TD.to(w.dtype), w)

    def fp32_linear(self) -> tuple[Tensor, Tensor | None] | None:
        """(W, bias) when the logits are x W^T (+ bias) computed in fp32 (fused kernels may compute
        them so); None when they are computed in a lower precision."""
        w = self.wg.weight
        return (w, None) if self.fp32_gate or w.dtype == torch.float32 else None


class CosineGate(_TutelGateAttributes, nn.Module):
    """Cosine router (Tutel's ``cosine_top``): logits = cos(proj(x), sim_e) / temperature, with the
    learned temperature clamped to at least 0.01."""

    def __init__(self, model_dim: int, num_experts: int, fp32_gate: bool = False, proj_dim: int = 256,
                 init_t: float = 0.5, dtype: torch.dtype | None = None, device=None):
        super().__init__()
        self.fp32_gate = fp32_gate
        self.temperature = nn.Parameter(torch.log(torch.full([1], 1.0 / init_t, device=device)))
        self.cosine_projector = nn.Linear(model_dim, proj_dim, dtype=dtype, device=device)
        # drawn twice, as Tutel does (randn, then normal(0, 0.01)): the same seeds give Tutel's values
        self.sim_matrix = nn.Parameter(torch.randn(proj_dim, num_experts, dtype=dtype, device=device))
        nn.init.normal_(self.sim_matrix, 0, 0.01)
        self.clamp_max = math.log(1.0 / 0.01)

    def forward(self, x_TD: Tensor) -> Tensor:
        proj, sim = self.cosine_projector, self.sim_matrix
        if self.fp32_gate:
            x_TP = F.linear(x_TD.float(), proj.weight.float(), proj.bias.float())
            sim = sim.float()
        else:
            x_TP = proj(x_TD.to(proj.weight.dtype))
        logits_TE = F.normalize(x_TP, dim=1) @ F.normalize(sim, dim=0)
        return logits_TE * torch.clamp(self.temperature, max=self.clamp_max).exp().to(logits_TE.dtype)


def build_gate(cfg: GateConfig, model_dim: int, num_experts: int, dtype=None,
               device=None) -> tuple[nn.Module, GateConfig]:
    """The logits module for one gate config, and the config it routes by: ``cfg`` itself, or for a
    custom gate with ``k=None`` a new one with the module's own ``top_k`` (Tutel's protocol; 2 when
    it has none). ``cfg`` is never changed."""
    if cfg.type in ("top", "sigmoid", "sparsemixer"):
        gate = LinearGate(model_dim, num_experts, cfg.fp32_gate, cfg.type == "sigmoid" or cfg.selection_bias, dtype, device)
        gate.routing_config = cfg
        return gate, cfg
    if cfg.type == "cosine_top":
        gate = CosineGate(model_dim, num_experts, cfg.fp32_gate, cfg.proj_dim, cfg.init_t, dtype, device)
        gate.routing_config = cfg
        return gate, cfg
    module = cfg.module
    if isinstance(module, type):
        module = module(model_dim=model_dim, num_global_experts=num_experts, **cfg.module_kwargs)
    if not isinstance(module, nn.Module):
        raise ValueError(f"custom gate 'module' must be an nn.Module or a class building one, got {type(module).__name__}")
    if cfg.k is None:  # Tutel reads k from a custom gate's own top_k
        k = getattr(module, "top_k", 2)
        cfg = dataclasses.replace(cfg, k=k if isinstance(k, int) and not isinstance(k, bool) else 2)
    for name in ("gate_noise", "capacity_factor"):  # Tutel gives a custom gate these when it lacks them
        if not hasattr(module, name):
            setattr(module, name, getattr(cfg, name))
    module = module.to(dtype=dtype, device=device) if (dtype is not None or device is not None) else module
    return module, cfg


def renormalizes(cfg: GateConfig, top_k: int, normalize_gate: bool) -> bool:
    """Whether ``cfg``'s gate renormalizes the K chosen weights to sum to 1 (``cfg.normalize``, or by
    default: always for sigmoid gates, for softmax gates when the layer's ``normalize_gate`` is on
    and K > 1)."""
    if cfg.normalize is not None:
        return cfg.normalize
    return True if cfg.type == "sigmoid" else (normalize_gate and top_k > 1)


def route(gate: nn.Module, cfg: GateConfig, x_TD: Tensor, num_experts: int, top_k: int, normalize_gate: bool,
          training: bool, need_scores: bool) -> Routing:
    """Run ``gate`` on ``x_TD`` and apply ``cfg``'s scoring policy with ``top_k`` experts per token."""
    logits_TE = gate(x_TD)
    T, E = x_TD.size(0), num_experts
    if not isinstance(logits_TE, Tensor) or tuple(logits_TE.shape) != (T, E):
        got = tuple(logits_TE.shape) if isinstance(logits_TE, Tensor) else type(logits_TE).__name__
        raise ValueError(f"gate must return logits [tokens={T}, experts={E}], got {got}")
    noisy_TE = logits_TE
    if training and cfg.gate_noise > 0:
        noisy_TE = logits_TE + cfg.gate_noise * torch.randn_like(logits_TE) / E
    if cfg.type == "sigmoid":
        bias = getattr(gate, "e_score_correction_bias", None)
        renorm = renormalizes(cfg, top_k, normalize_gate)
        weights_TK, ids_TK, scores_TE = sigmoid_group_topk(
            noisy_TE, top_k, bias, cfg.n_group, cfg.topk_group, renorm, cfg.route_scale, cfg.bias_on_logits
        )
    elif cfg.type == "sparsemixer":  # Phi-3.5-MoE: exactly two experts
        if top_k != 2:
            raise ValueError(f"top_k must be 2 for gate type 'sparsemixer' (it picks exactly two experts), got {top_k}")
        if training:
            raise ValueError("gate type 'sparsemixer' routes at inference only (training samples the experts and "
                             "needs SparseMixer's gradient estimator, which dynamoe does not implement): call .eval()")
        weights_TK, ids_TK, scores_TE = sparsemixer_top2(noisy_TE, cfg.jitter_eps)
    elif (cfg.n_group > 1 and cfg.topk_group < cfg.n_group) or cfg.selection_bias:  # DeepSeek-V2, ERNIE-4.5
        renorm = renormalizes(cfg, top_k, normalize_gate)
        weights_TK, ids_TK, scores_TE = softmax_group_topk(noisy_TE, top_k, cfg.n_group, cfg.topk_group, renorm,
                                                           cfg.route_scale, getattr(gate, "e_score_correction_bias", None),
                                                           cfg.group_rank)
    else:
        renorm = renormalizes(cfg, top_k, normalize_gate)
        weights_TK, ids_TK, scores_TE = softmax_topk(noisy_TE, top_k, renorm, need_probs=need_scores)
        if cfg.route_scale != 1.0:
            weights_TK = weights_TK * cfg.route_scale
    return Routing(ids_TK, weights_TK, scores_TE, logits_TE, noisy_TE)
