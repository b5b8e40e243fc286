"""The MoE layer: gate -> dispatch plan -> experts -> combine.

Legend: T tokens, D model dim, O output dim, E experts, K experts per token, C capacity.

Every forward takes the run-time switches ``top_k``, ``capacity_factor``, ``a2a_ffn_overlap_degree``,
``adaptive_r`` and ``megablocks_size`` (or ``layout``). They apply to that call only -- nothing is
stored -- and none allocates parameters, so switching is free.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..ops import cpu_kernels, moe_decode
from ..ops.fused import MAX_ROWS, Fused, Holds, RMSNormSpec, Unfusable, slot
from ..ops.routing import check_top_k
from ..ops.scratch import scratch
from . import losses
from .config import MoEConfig, check_capacity_factor, check_overlap_degree, parse_parallel_type
from .exchange import LocalExchange, exchange_for
from .dispatch import (DispatchPlan, RoutingStats, build_plan, combine_padded, combine_ragged, dispatch_padded,
                       dispatch_ragged)
from .experts import FFNExperts, GLUExperts, SharedExperts, build_experts
from .gates import Routing, build_gate, gate_config, renormalizes, route, set_gate_config
from .sharding import FLAT, OUTPUT_BIAS, merge_shards, shard_spec_of

__all__ = ["MoELayer", "LAYOUTS"]

LAYOUTS = ("padded", "ragged")
# Below this many assignments per expert the ragged layout is chosen automatically (decode, small
# batches): padding would cost more than it saves.
_SMALL_BATCH_ROWS_PER_EXPERT = 4


class MoELayer(nn.Module):
    """Mixture-of-Experts layer over ``config`` (see :class:`dynamoe.moe.MoEConfig`).

    ``forward(x)`` takes [..., D] and returns [..., O] with two attributes: ``y.l_aux`` (the
    configured balance loss, plus ``z_loss_coef`` * router z-loss) and ``y.routing_stats``
    (:class:`RoutingStats`: per-expert load, kept and dropped counts, capacity, layout).
    """

    # Tutel's rule for k > E (moe_layer sets it): k becomes E, with one warning per layer; the typed
    # API rejects such a k instead
    _clamps_top_k = False

    def __init__(self, config: MoEConfig, scan_expert_func: Callable | None = None,
                 result_func: Callable | None = None, group=None, seeds=None, exchange=None):
        super().__init__()
        if not isinstance(config, MoEConfig):
            raise ValueError(f"config must be a MoEConfig, got {type(config).__name__}")
        self.config = config
        self.group = group
        # one process: LocalExchange; across ranks: dynamoe.parallel's all-to-all (see moe/exchange.py)
        self.exchange = exchange if exchange is not None else exchange_for(group)
        self.result_func = result_func
        self.model_dim = config.model_dim
        self.world_size = self.exchange.world_size
        L = config.num_experts
        # -n: n consecutive ranks share each expert, split along its hidden dim (dynamoe.moe.sharding)
        self.sharded_count = -L if L < 0 else 1
        self.num_local_experts = max(L, 1)
        E = self.global_expert_count(L, world=self.world_size)
        self._check_expert_count(E)
        self._num_experts = E
        # built collectively here (group creation), used by sharded forwards
        self._shard_groups = self.exchange.shard_groups(self.sharded_count) if self.sharded_count > 1 else None
        self.register_buffer("_num_global_experts", torch.tensor(E, device=config.device))
        kw = dict(dtype=config.dtype, device=config.device)
        if seeds is not None and (not isinstance(seeds, (tuple, list)) or len(seeds) > 3
                                  or not all(v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in seeds)):
            raise ValueError(f"seeds must be None or a tuple of up to 3 ints/None (gates, experts, after), got {seeds!r}")

        if seeds is not None and len(seeds) > 1 and seeds[1] is not None:
            torch.manual_seed(seeds[1])
        self.experts = build_experts(config.experts, config.model_dim, sharded_count=self.sharded_count, **kw)
        self.shared_experts = SharedExperts(config.experts, config.model_dim, **kw) if config.experts.num_shared_experts else None
        for n, p in self.experts.named_parameters():
            p._dynamoe_expert = True
            p._tutel_expert = True  # Tutel's tag, which its optimizers and scripts test for
            if scan_expert_func is not None:
                scan_expert_func(n, p)

        gates, gate_cfgs = [], []
        for gi, gcfg in enumerate(config.gates):
            if seeds is not None and seeds[0] is not None:
                torch.manual_seed(seeds[0] + gi)
            gate, gcfg = build_gate(gcfg, config.model_dim, E, **kw)
            gates.append(gate)
            gate_cfgs.append(gcfg)
        self.gates = nn.ModuleList(gates)
        if any(a is not b for a, b in zip(gate_cfgs, config.gates)):  # a custom gate's own top_k
            self.config = dataclasses.replace(config, gates=tuple(gate_cfgs))
        if seeds is not None and len(seeds) > 2 and seeds[2] is not None:
            torch.manual_seed(seeds[2])
        # Assignments per expert and gate since the last update_routing_bias() (training only).
        self.register_buffer("_load_since_update", torch.zeros(len(gates), E, dtype=torch.int64,
                                                               device=config.device), persistent=False)
        self.l_aux: Optional[Tensor] = None  # the last forward's loss, as Tutel exposes it
        # the parallel degree and overlap the last forward used (Tutel's attributes report them)
        self._last_r: Optional[int] = None
        self._last_overlap: Optional[int] = None
        self._k_clamp_warned = False

    def __getstate__(self):
        # the last forward's loss is part of an autograd graph: not something to copy or pickle;
        # a process group cannot travel either (a copy across processes is local)
        state = self.__dict__.copy()
        state["l_aux"] = None
        if self.world_size > 1:
            raise ValueError("an expert-parallel MoE layer cannot be copied or pickled; save its state_dict instead")
        return state

    @property
    def config(self) -> MoEConfig:
        """The layer's frozen configuration, its gates' current settings included: Tutel's gate
        attributes (``layer.gates[0].top_k = 1``) give a gate a new GateConfig, and this follows. To
        change anything else, assign a new one: ``layer.config = dataclasses.replace(layer.config, ...)``."""
        cfg = self.__dict__["_config"]
        gates = self._modules.get("gates")
        if gates is not None:
            now = tuple(gate_config(g, c) for g, c in zip(gates, cfg.gates))
            if any(a is not b for a, b in zip(now, cfg.gates)):
                cfg = self.__dict__["_config"] = dataclasses.replace(cfg, gates=now)
        return cfg

    @config.setter
    def config(self, cfg: MoEConfig) -> None:
        if not isinstance(cfg, MoEConfig):
            raise ValueError(f"config must be a MoEConfig, got {type(cfg).__name__}")
        gates = self._modules.get("gates")
        if gates is not None:
            if len(cfg.gates) != len(gates):
                raise ValueError(f"config has {len(cfg.gates)} gates; this layer was built with {len(gates)}")
            for g, c in zip(gates, cfg.gates):
                set_gate_config(g, c)
        self.__dict__["_config"] = cfg

    # ---- Tutel-compatible helpers -------------------------------------------------------------
    @staticmethod
    def global_expert_count(num_local_experts: int, group=None, world: int | None = None) -> int:
        """E for ``num_local_experts`` per rank of ``group`` (Tutel's: None = the default group when
        torch.distributed is initialised); a negative -n: n ranks share each expert."""
        world = _world_size(dist.group.WORLD if group is None and _initialized() else group) if world is None else world
        if num_local_experts == 0:
            raise ValueError("num_local_experts must be non-zero")
        if num_local_experts > 0:
            return num_local_experts * world
        if world % -num_local_experts:
            raise ValueError(f"{-num_local_experts} devices should share an expert, but the world has {world} "
                             f"(num_experts_per_device={num_local_experts})")
        return world // -num_local_experts

    @property
    def num_global_experts(self) -> int:
        return self._num_experts

    def _check_expert_count(self, E: int) -> None:
        """Checks that need the global expert count E (the config only knows the local one)."""
        cfg = self.config
        for g in cfg.gates:
            if g.k is not None and g.k > E and not self._clamps_top_k:
                raise ValueError(f"gate k={g.k} exceeds the number of experts ({E})")
            if g.type in ("sigmoid", "top"):
                if E % g.n_group:
                    raise ValueError(f"n_group={g.n_group} must divide the number of experts ({E})")
                if g.k > g.topk_group * (E // g.n_group):
                    raise ValueError(f"gate k={g.k} exceeds the experts in topk_group={g.topk_group} groups of {E // g.n_group}")
        if cfg.device_loss_groups and E % cfg.device_loss_groups:
            raise ValueError(f"device_loss_groups={cfg.device_loss_groups} must divide the number of experts ({E})")

    @property
    def top_k(self) -> int:
        return self.config.gates[0].k

    # Tutel's layer attributes. Per-call switches are not remembered as the new default (dynamoe's
    # rule); ``adaptive_degree`` and ``a2a_ffn_overlap_degree`` report what the last forward used (the
    # configured value before any), and assigning one sets the configured default.
    @property
    def valid_rs(self) -> list[int]:
        """The adaptive degrees a forward accepts: 0 (data parallel) and the divisors of sharded_count."""
        return [0] + [d for d in range(1, self.sharded_count + 1) if self.sharded_count % d == 0]

    @property
    def adaptive_degree(self) -> int:
        if self._last_r is not None:
            return self._last_r
        return min(parse_parallel_type(self.config.parallel_type, self.sharded_count), self.sharded_count)

    @adaptive_degree.setter
    def adaptive_degree(self, r: int) -> None:
        if r not in self.valid_rs:
            raise ValueError(f"adaptive_degree must be one of {self.valid_rs}, got {r!r}")
        self.config = dataclasses.replace(self.config, parallel_type=f"adaptive:{r}")
        self._last_r = None

    @property
    def a2a_ffn_overlap_degree(self) -> int:
        return self._last_overlap if self._last_overlap is not None else self.config.a2a_ffn_overlap_degree

    @a2a_ffn_overlap_degree.setter
    def a2a_ffn_overlap_degree(self, degree: int) -> None:
        self.config = dataclasses.replace(self.config, a2a_ffn_overlap_degree=check_overlap_degree(degree))
        self._last_overlap = None

    @property
    def is_postscore(self) -> bool:
        return self.config.is_postscore

    @property
    def batch_prioritized_routing(self) -> bool:
        return self.config.batch_prioritized_routing

    @property
    def normalize_gate(self) -> bool:
        return self.config.normalize_gate

    @property
    def is_gshard_loss(self) -> bool:
        return self.config.aux_loss == "gshard"

    @property
    def use_2dh(self) -> bool:
        return self.config.use_2dh

    auto_parallel = False       # Tutel's, never set there either
    use_model_parallel = True

    def get_parameter_iterator(self, param_type: str):
        if param_type == "gate":
            return self.gates.named_parameters()
        if param_type == "local_experts":
            return self.experts.named_parameters()
        raise ValueError(f"param_type must be 'gate' or 'local_experts', got {param_type!r}")

    def extra_repr(self) -> str:
        gates = [f"{g.type}(k={g.k}, capacity_factor={g.capacity_factor})" for g in self.config.gates]
        return (f"gates={gates}, num_experts={self.num_global_experts}, model_dim={self.model_dim}, "
                f"Total-Experts = {self.num_global_experts} [managed by {self.world_size} device(s)]")

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        key = prefix + "_num_global_experts"
        if key not in state_dict:  # older Tutel checkpoints lack it: accept, as Tutel does
            state_dict[key] = self._num_global_experts.clone()
        elif int(state_dict[key]) != self.num_global_experts:
            raise ValueError(f"checkpoint has {int(state_dict[key])} experts in {prefix or 'the layer'}, this layer has {self.num_global_experts}")
        for name, p in self.experts.named_parameters():  # Tutel: an expert tensor of the same size loads in this shape
            saved = state_dict.get(prefix + "experts." + name)
            if isinstance(saved, Tensor) and saved.shape != p.shape and saved.numel() == p.numel():
                state_dict[prefix + "experts." + name] = saved.reshape(p.shape)
        return super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    # ---- training hooks -----------------------------------------------------------------------
    @torch.no_grad()
    def update_routing_bias(self, rate: float = 1e-3) -> None:
        """Auxiliary-loss-free balancing step (DeepSeek-V3): nudge every sigmoid gate's selection
        bias by ``rate`` toward balance, using the load seen since the last call (summed over ranks
        under expert parallelism; every rank must call it). Call once per optimizer step."""
        if not math.isfinite(rate) or rate < 0:
            raise ValueError(f"rate must be a finite number >= 0, got {rate}")
        # across ranks the load is summed first, so every rank makes the same update
        load = self.exchange.sum_over_ranks(self._load_since_update) if self.world_size > 1 else self._load_since_update
        for gi, gate in enumerate(self.gates):
            bias = getattr(gate, "e_score_correction_bias", None)
            if bias is not None:
                losses.update_selection_bias(bias, load[gi], rate)
        self._load_since_update.zero_()

    # ---- forward ------------------------------------------------------------------------------
    def forward(self, input: Tensor, gate_index: int = 0, capacity_factor: float | None = None,
                top_k: int | None = None, a2a_ffn_overlap_degree: int | None = None, reserve_dims: int = 1,
                inequivalent_tokens: bool = False, adaptive_r: int | None = None,
                megablocks_size: int | None = None, layout: str | None = None, use_2dh: bool | None = None) -> Tensor:
        """Route ``input`` [..., D] through the experts.

        ``inequivalent_tokens`` is accepted for Tutel compatibility; it matters only when ranks hold
        different token counts (expert parallelism), where the capacity must agree across ranks.

        Per-call switches (None = the configured default; nothing is remembered):
            top_k: experts per token, 1..E. capacity_factor: >0 padded capacity, 0 dropless,
            <0 capped dropless. a2a_ffn_overlap_degree: chunks of the capacity dim (C is rounded up
            to a multiple of it). adaptive_r: parallel degree (0 or 1 on one process).
            megablocks_size: 0 forces the padded layout, >0 the ragged (dropless-style) layout.
            layout: "padded" | "ragged" (alternative to megablocks_size).
            use_2dh: two-level all-to-all across ranks (within nodes of LOCAL_SIZE ranks, then across).
        """
        if (gate_index == 0 and capacity_factor is None and top_k is None and reserve_dims == 1 and adaptive_r is None
                and megablocks_size is None and layout is None and a2a_ffn_overlap_degree is None and use_2dh is None
                and not self.training and not torch.is_grad_enabled()):
            y = self._decode_step(input)
            if y is not None:
                return y
        cfg = self.config
        x_TD, out_shape, orig_dtype = self._check_input(input, reserve_dims)
        use_2dh = cfg.use_2dh if use_2dh is None else use_2dh
        if not isinstance(use_2dh, bool):
            raise ValueError(f"use_2dh must be True, False or None, got {use_2dh!r}")
        if isinstance(gate_index, bool) or not isinstance(gate_index, int) or not 0 <= gate_index < len(self.gates):
            raise ValueError(f"gate_index must be an int in [0, {len(self.gates)}), got {gate_index!r}")
        gcfg = cfg.gates[gate_index]
        E = self.num_global_experts
        k = gcfg.k if top_k is None else top_k
        if self._clamps_top_k and isinstance(k, int) and not isinstance(k, bool) and k > E:
            k = self._clamp_top_k(k, E)
        k = check_top_k(k, E)
        cf = check_capacity_factor(gcfg.capacity_factor if capacity_factor is None else capacity_factor)
        overlap = check_overlap_degree(cfg.a2a_ffn_overlap_degree if a2a_ffn_overlap_degree is None else a2a_ffn_overlap_degree)
        valid_r = [0] + [d for d in range(1, self.sharded_count + 1) if self.sharded_count % d == 0]
        if adaptive_r is not None and (isinstance(adaptive_r, bool) or not isinstance(adaptive_r, int) or adaptive_r not in valid_r):
            raise ValueError(f"adaptive_r must be one of {valid_r} here (divisors of sharded_count={self.sharded_count}, or 0), got {adaptive_r!r}")
        r = adaptive_r if adaptive_r is not None else min(parse_parallel_type(cfg.parallel_type, self.sharded_count), self.sharded_count)
        self.__dict__["_last_r"], self.__dict__["_last_overlap"] = r, overlap
        data_parallel = r == 0 and self.world_size > 1
        chosen_layout = self._pick_layout(layout, megablocks_size, cf, x_TD.size(0) * k, E, local=data_parallel)
        # Tutel's capacity alignment: a multiple of the overlap chunks, rounded up to megablocks_size
        mega = max(megablocks_size or 0, 1)
        alignment = -(-self.sharded_count * overlap // mega) * mega
        if alignment > 256:
            alignment = -(-alignment // 128) * 128

        T = x_TD.size(0)
        if T == 0 and self.world_size == 1:  # (across ranks, an empty rank still joins the exchange)
            # an empty batch stays in the autograd graph, so backward() works as usual
            y_empty = x_TD.new_zeros(0, self._out_dim()) + x_TD.sum() * 0
            return self._finish(y_empty, out_shape, orig_dtype,
                                x_TD.new_zeros((), dtype=torch.float32), self._empty_stats(k, cf, chosen_layout))

        with torch.autocast(device_type=x_TD.device.type, enabled=False):
            routing = route(self.gates[gate_index], gcfg, x_TD, E, k, cfg.normalize_gate, self.training,
                            need_scores=cfg.aux_loss != "none" or cfg.batch_prioritized_routing or cfg.device_loss_groups > 0)
            fused = self._fused_decode(x_TD, routing, cf) if T <= MAX_ROWS else None
            if fused is None:
                priority = routing.scores_TE.max(dim=1).values if cfg.batch_prioritized_routing else None
                plan = build_plan(routing.ids_TK, routing.weights_TK, E, cf, priority, alignment=alignment,
                                  agree_max=self.exchange.agree_max if self.world_size > 1 else None)
            l_aux, loss_terms = self._losses(routing, gcfg)

        if fused is not None:  # a decode step's experts in one kernel call
            y_TO, load_E, max_load = fused
            if self.shared_experts is not None:
                y_TO = y_TO + self.shared_experts(x_TD)
            stats = RoutingStats(load=load_E, kept=load_E, dropped=0, capacity=max_load, top_k=k,
                                 capacity_factor=float(cf), layout=chosen_layout, losses=loss_terms)
            return self._finish(y_TO, out_shape, orig_dtype, l_aux, stats)

        if data_parallel:  # every expert on every rank for this call: no token exchange
            y_TO = self._data_parallel_experts(x_TD, plan, chosen_layout)
        elif self.sharded_count > 1:
            y_TO = self._sharded_experts(x_TD, plan, r, overlap, use_2dh)
        elif plan.order_N.numel() or self.world_size > 1:
            y_TO = self._experts_and_combine(x_TD, plan, chosen_layout, overlap, use_2dh)
        else:  # everything dropped (capacity 0): zeros, still in the autograd graph
            y_TO = x_TD.new_zeros(plan.num_tokens, self._out_dim()) + (x_TD.sum() + routing.weights_TK.sum()).to(x_TD.dtype) * 0
        if self.shared_experts is not None:
            y_TO = y_TO + self.shared_experts(x_TD)
        if self.training:
            self._load_since_update[gate_index] += plan.load_E.to(self._load_since_update.device)
        stats = plan.stats(capacity_factor=float(cf), layout=chosen_layout, losses=loss_terms)
        return self._finish(y_TO, out_shape, orig_dtype, l_aux, stats)

    def forward_routed(self, input: Tensor, ids_TK: Tensor, weights_TK: Tensor) -> Tensor:
        """Extension point: the experts (and shared experts) of ``input`` [..., D] for a routing the caller chose,
        ``ids_TK`` int64 [T, K] expert ids and ``weights_TK`` [T, K] their weights (T = the input's tokens) -- for
        routers no gate type expresses (DeepSeek-V4's expert choice by token id). Dropless, no auxiliary loss, the
        configured layout; ``routing_stats`` as :meth:`forward`'s. The gates are not run."""
        x_TD, out_shape, orig_dtype = self._check_input(input, 1)
        T, E = x_TD.size(0), self.num_global_experts
        if (not isinstance(ids_TK, Tensor) or ids_TK.dim() != 2 or ids_TK.size(0) != T or ids_TK.dtype != torch.long
                or not isinstance(weights_TK, Tensor) or weights_TK.shape != ids_TK.shape):
            got = [tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__ for t in (ids_TK, weights_TK)]
            raise ValueError(f"ids_TK must be int64 [tokens={T}, k] and weights_TK the same shape, got {got}")
        K = ids_TK.size(1)
        if self.sharded_count > 1:
            raise ValueError("forward_routed does not support experts sharded over several ranks (sharded_count > 1)")
        if T and (int(ids_TK.min()) < 0 or int(ids_TK.max()) >= E):
            raise ValueError(f"ids_TK must be expert ids in [0, {E}), got values in [{int(ids_TK.min())}, "
                             f"{int(ids_TK.max())}]")
        layout = self._pick_layout(None, None, 0.0, T * K, E)
        l_aux = x_TD.new_zeros((), dtype=torch.float32)
        if T == 0 and self.world_size == 1:
            return self._finish(x_TD.new_zeros(0, self._out_dim()), out_shape, orig_dtype, l_aux,
                                self._empty_stats(K, 0.0, layout))
        fused = None
        if T <= MAX_ROWS and not torch.is_grad_enabled():
            fused = self._fused_decode(x_TD, Routing(ids_TK, weights_TK, None, None, None), 0.0)
        if fused is not None:  # a decode step's experts in one kernel call
            y_TO, load_E, max_load = fused
            stats = RoutingStats(load=load_E, kept=load_E, dropped=0, capacity=max_load, top_k=K, capacity_factor=0.0,
                                 layout=layout, losses={})
        else:
            plan = build_plan(ids_TK, weights_TK, E, 0.0, None,
                              agree_max=self.exchange.agree_max if self.world_size > 1 else None)
            if plan.order_N.numel() or self.world_size > 1:
                y_TO = self._experts_and_combine(x_TD, plan, layout, 1, self.config.use_2dh)
            else:
                y_TO = x_TD.new_zeros(plan.num_tokens, self._out_dim())
            stats = plan.stats(capacity_factor=0.0, layout=layout, losses={})
        if self.shared_experts is not None:
            y_TO = y_TO + self.shared_experts(x_TD)
        return self._finish(y_TO, out_shape, orig_dtype, l_aux, stats)

    # ---- pieces of forward --------------------------------------------------------------------
    def _clamp_top_k(self, k: int, E: int) -> int:
        if not self._k_clamp_warned:
            self.__dict__["_k_clamp_warned"] = True
            warnings.warn(f"top_k={k} exceeds the {E} experts: using top_k={E} (Tutel's rule)", UserWarning, stacklevel=4)
        return E

    def _fused_decode(self, x_TD: Tensor, routing, cf: float):
        """A decode step's experts in one kernel call (dynamoe.ops.moe_decode), where that is the
        same computation: inference, dropless, built-in FFN/GLU experts or packed GLU experts whole
        on this process. None otherwise (the general path runs). The kernel scales the experts' outputs: where
        the weights scale their inputs instead (``is_postscore=False``), :meth:`_prescaled_decode`."""
        if self.training or cf != 0 or self.world_size > 1 or self.sharded_count > 1:
            return None
        if not self.config.is_postscore:
            return self._prescaled_decode(x_TD, routing.ids_TK, routing.weights_TK)
        return self._decode_experts(x_TD, routing.ids_TK, routing.weights_TK)

    def _prescaled_decode(self, x_TD: Tensor, ids_TK: Tensor, weights_TK: Tensor):
        """expert(w * x) summed over the choices (Llama-4) through the experts' kernel: each (token, choice) a row
        of its own, w * x rounded to x's dtype as the general path's prescaled dispatch does, weight 1; None where
        the T * K rows are more than a decode batch."""
        T, K = ids_TK.shape
        if T * K > MAX_ROWS:
            return None
        rows_ND = (x_TD.unsqueeze(1) * weights_TK.to(x_TD.dtype).unsqueeze(2)).reshape(T * K, -1)
        got = self._decode_experts(rows_ND, ids_TK.reshape(T * K, 1), weights_TK.new_ones(T * K, 1))
        if got is None:
            return None
        y_NO, load_E, max_load = got
        return y_NO.view(T, K, -1).sum(dim=1), load_E, max_load

    def _decode_experts(self, x_TD: Tensor, ids_TK: Tensor, weights_TK: Tensor):
        if type(self.experts) is GLUExperts:
            return moe_decode.glu_decode(x_TD, ids_TK, weights_TK, self.experts)
        if type(self.experts) is FFNExperts:
            return moe_decode.ffn_decode(x_TD, ids_TK, weights_TK, self.experts)
        if type(self.experts).__name__ == "QuantizedExperts":  # dynamoe.quant (imports this package)
            return moe_decode.packed_glu_decode(x_TD, ids_TK, weights_TK, self.experts)
        return None

    def _decode_ready(self, x_TD: Tensor) -> bool:
        """Whether a decode step of ``x_TD`` [T, D] may skip the general path as far as the input goes:
        1..MAX_ROWS rows on CPU, no autocast, inference (the configuration is :meth:`decode_fused`'s)."""
        return (x_TD.device.type == "cpu" and 1 <= x_TD.size(0) <= MAX_ROWS and not torch.is_grad_enabled()
                and not self.training and not torch.is_autocast_enabled("cpu"))

    def _decode_stats(self, load_E: Tensor, max_load: int) -> RoutingStats:
        e = self.experts  # (hasattr on the module itself would go through nn.Module.__getattr__ when absent)
        ragged = hasattr(type(e), "forward_ragged") or "forward_ragged" in e.__dict__
        return RoutingStats(load=load_E, kept=load_E, dropped=0, capacity=max_load, top_k=self.config.gates[0].k,
                            capacity_factor=0.0, layout="ragged" if ragged else "padded", losses={})

    def _decode_step(self, input) -> Tensor | None:
        """The whole layer for a decode step in one kernel call (router, routed and shared experts:
        csrc/moe_block_decode.cpp) with the weights of :meth:`decode_fused`, skipping the general path's
        per-call checks and plan. None where that does not apply."""
        if not isinstance(input, Tensor) or input.dim() < 2 or input.size(-1) != self.model_dim:
            return None
        x_TD = input.reshape(-1, self.model_dim)
        if not self._decode_ready(x_TD):
            return None
        cache = slot(self)
        fused = cache.get(x_TD.dtype) or cache.put(x_TD.dtype, self.decode_fused(x_TD))
        if fused.weights is None:
            return None
        cfg = self.config
        if cfg.check_finite and not bool(torch.isfinite(x_TD.sum())):
            return None  # the general path names the problem
        y_TO, load_E, max_load = moe_decode.moe_decode_with(fused.extra, fused.weights, x_TD.contiguous())
        if fused.after is not None:  # shared experts the kernel cannot read (not stacked: parameters that train)
            y_TO = y_TO + fused.after(x_TD)
        return self._finish(y_TO, list(input.shape[:-1]) + [y_TO.size(-1)], input.dtype, _no_aux_loss(),
                            self._decode_stats(load_E, max_load))

    def decode_fused(self, h_TD: Tensor, holds: Holds | None = None, norm: RMSNormSpec | None = None) -> Fused:
        """The fused decode kernel's weights (``kernels.MoEWeights``, dynamoe.ops.moe_decode.moe_weights) for
        steps like ``h_TD`` [T, D] in this layer's state -- with ``norm`` first and the residual added when
        given (a decoder layer's MoE sub-block: no ``result_func`` then) -- as a
        :class:`~dynamoe.ops.fused.Fused` holding what the decision read (``holds``, added to). Its
        ``weights`` is None and ``extra`` the reason where the kernel does not apply; else ``extra`` is the
        kernels module."""
        holds = Holds() if holds is None else holds
        try:
            kernels = cpu_kernels.load()
            if kernels is None:
                raise Unfusable("the CPU kernels are not available")
            weights, after = self._decode_weights(kernels, holds, h_TD, norm)
            return Fused(weights, holds, kernels, after)
        except Unfusable as exc:
            return Fused(None, holds, str(exc))

    def _decode_weights(self, kernels, holds: Holds, h_TD: Tensor, norm: RMSNormSpec | None):
        key = holds.value(self.decode_key)  # (the gates' configs by value: Tutel's gate attributes replace them)
        self.config  # noqa: B018 -- brings the stored config up to date with the gates'
        cfg = holds.attr(self, "_config")
        gcfg = cfg.gates[0]
        if self.world_size > 1 or self.sharded_count > 1:
            raise Unfusable("experts are spread over several processes")
        if key[-1]:
            raise Unfusable("training mode")
        if gcfg.capacity_factor != 0:
            raise Unfusable(f"capacity_factor={gcfg.capacity_factor:g} (the kernel is dropless: 0)")
        if gcfg.bias_on_logits:
            raise Unfusable("the selection bias is added to the router logits (bias_on_logits: Kolibri-1); the router "
                            "kernel adds it to the sigmoid scores")
        if not cfg.is_postscore:
            raise Unfusable("the routing weights scale the experts' inputs (is_postscore=False: Llama-4); the layer "
                            "kernel scales their outputs, which differs for a nonlinear expert")
        if cfg.aux_loss != "none" or cfg.z_loss_coef or cfg.device_loss_groups or cfg.batch_prioritized_routing:
            raise Unfusable("auxiliary losses or batch-prioritized routing are configured")
        experts = holds.module(self, "experts")
        kind = ("glu" if type(experts) is GLUExperts else "ffn" if type(experts) is FFNExperts
                else "packed" if type(experts).__name__ == "QuantizedExperts" else None)  # (dynamoe.quant imports this package)
        if kind is None:
            raise Unfusable(f"{type(experts).__name__} experts have no kernel")
        p = next((q for q in experts._parameters.values() if q is not None), None)
        if p is not None and p.is_floating_point() and p.dtype != h_TD.dtype:
            raise Unfusable(f"input {h_TD.dtype} differs from the experts' {p.dtype}")
        shared, after = holds.module(self, "shared_experts"), None
        if shared is not None and norm is None and (not holds.attr(shared, "is_glu") or holds.attr(shared, "_stacked") is None
                                                         or shared.stacked() is None):
            shared, after = None, shared  # the layer alone: added after the kernel by the module itself
        if shared is not None:
            if not holds.attr(shared, "is_glu"):
                raise Unfusable("FFN shared experts have no kernel")
            shared = moe_decode.glu_mlp_fields(kernels, holds, h_TD.dtype, shared.stacked_for(holds),
                                               holds.module(shared, "down_proj"), holds.attr(shared, "activation"),
                                               holds.attr(shared, "alpha"), holds.attr(shared, "limit"),
                                               holds.module(shared, "gate"))
        if norm is not None:
            if holds.attr(self, "result_func") is not None:
                raise Unfusable("a result_func is set")
            if cfg.check_finite:
                raise Unfusable("check_finite is on (a serving model turns it off)")
        gate = holds.module(self._modules["gates"], "0")
        k = gcfg.k
        return moe_decode.moe_weights(kernels, holds, h_TD, gate, gcfg.type, k, renormalizes(gcfg, k, cfg.normalize_gate),
                                      gcfg.route_scale, gcfg.n_group, gcfg.topk_group, kind, experts, norm, shared,
                                      gcfg.group_rank), after

    def decode_key(self) -> tuple:
        """The configuration :meth:`decode_fused` decides on, by value (a new config, or a gate's, makes a
        :class:`~dynamoe.ops.fused.Fused` of the old one stale); the training flag last."""
        cfg = self.config
        gates = tuple(tuple(getattr(g, f.name) for f in dataclasses.fields(g)) for g in cfg.gates)  # every field
        return (gates, cfg.normalize_gate, cfg.is_postscore, cfg.aux_loss, cfg.z_loss_coef, cfg.device_loss_groups,
                cfg.batch_prioritized_routing, cfg.check_finite, self.result_func is None,
                getattr(self._modules["gates"][0], "fp32_gate", None), self.training)

    def decode_done(self, load_E: Tensor, max_load: int) -> RoutingStats:
        """Record a fused decode step of this layer (no auxiliary loss) and return its statistics."""
        self.__dict__["l_aux"] = _no_aux_loss()  # a plain attribute (nn.Module.__setattr__ costs microseconds)
        return self._decode_stats(load_E, max_load)

    def _check_input(self, input: Tensor, reserve_dims: int):
        if not isinstance(input, Tensor):
            raise ValueError(f"input must be a torch.Tensor, got {type(input).__name__}")
        if not input.is_floating_point():
            raise ValueError(f"input must be a floating-point tensor, got {input.dtype}")
        if isinstance(reserve_dims, bool) or not isinstance(reserve_dims, int) or reserve_dims < 1:
            raise ValueError(f"reserve_dims must be an int >= 1, got {reserve_dims!r}")
        if input.dim() < reserve_dims + 1:
            raise ValueError(f"input must have at least {reserve_dims + 1} dims ([tokens..., model_dim]), got shape {tuple(input.shape)}")
        feature_shape = input.shape[-reserve_dims:]
        if math.prod(feature_shape) != self.model_dim:
            raise ValueError(f"input's last {reserve_dims} dim(s) {tuple(feature_shape)} must hold model_dim={self.model_dim} features")
        if reserve_dims > 1 and self._out_dim() != self.model_dim:
            raise ValueError("reserve_dims > 1 needs output_dim == model_dim")
        # NaN/Inf anywhere makes the sum non-finite; only then pay for the elementwise check (which
        # also keeps a finite input whose sum overflows, e.g. in fp16, from being rejected).
        if self.config.check_finite and input.numel() and not bool(torch.isfinite(input.sum())):
            if not bool(torch.isfinite(input).all()):
                raise ValueError("input contains non-finite values (NaN or Inf)")
        x = input.reshape(-1, self.model_dim)
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        else:
            p = next(self.experts.parameters(), None)
            if p is not None and p.is_floating_point():
                x = x.to(p.dtype)
        out_tail = list(feature_shape) if reserve_dims > 1 else [self._out_dim()]
        return x, list(input.shape[:-reserve_dims]) + out_tail, input.dtype

    def _out_dim(self) -> int:
        return getattr(self.experts, "output_dim", None) or self.model_dim

    def _data_parallel_experts(self, x_TD: Tensor, plan: DispatchPlan, layout: str) -> Tensor:
        """adaptive_r=0 across ranks (Tutel's data-parallel switch): gather every rank's experts for
        this call (differentiably: expert gradients sum over ranks, as with expert parallelism) and
        compute all tokens locally. Nothing is stored; the parameters stay where they are."""
        if not getattr(self.experts, "fuses_row_scale", False):
            raise ValueError("adaptive_r=0 across ranks needs the built-in ffn/glu experts (their parameters lead with the expert dim)")
        gathered = {n: self.exchange.gather_experts(p) for n, p in self.experts.named_parameters()}
        if self.sharded_count > 1:  # [W, ...] = [E, n shards, ...] -> whole experts [E, ...]
            spec, n = shard_spec_of(self.experts), self.sharded_count
            if FLAT in spec.values():
                raise ValueError("llama_ffn experts shared by several ranks run at adaptive_r=1 only")
            gathered = {k: merge_shards(t.view(-1, n, *t.shape[1:]).transpose(0, 1), spec[k], self._out_dim())
                        for k, t in gathered.items()}
        local = _LocalView(self)
        return torch.func.functional_call(local, {f"layer.experts.{n}": t for n, t in gathered.items()},
                                          (x_TD, plan, layout), strict=False)

    def _sharded_experts(self, x_TD: Tensor, plan: DispatchPlan, r: int, overlap: int, use_2dh: bool) -> Tensor:
        """Experts shared by n ranks, at degree r (see dynamoe.parallel.ShardGroups): the g = n/r
        ranks of a block gather their shards (differentiably), every expert's slot block goes to
        the r ranks computing its r hidden slices, and the r partial outputs are summed. The output
        bias, sharded over the n ranks, is gathered and added as 1/r per partial."""
        n, groups = self.sharded_count, self._shard_groups
        g = n // r
        experts = self.experts
        spec = getattr(experts, "shard_spec", None)
        if spec is None and r not in (1, n):
            raise ValueError(f"custom experts shared by {n} ranks run at adaptive_r=1 (they gather their own weights, "
                             f"Tutel's protocol) or adaptive_r={n}; gathering shards for adaptive_r={r} needs the "
                             f"built-in ffn/glu experts")
        params = {}
        for name, p in (experts.named_parameters() if spec is not None else ()):
            if spec[name] == FLAT:  # llama_ffn: whole only when gathered
                if r != 1:
                    raise ValueError(f"llama_ffn experts shared by {n} ranks run at adaptive_r=1 only (Tutel's layout "
                                     f"slices the flattened weights), got adaptive_r={r}")
                params[name] = groups.gather_shards(p, n).reshape(-1)[:math.prod(experts.full_shapes[name])]
            elif spec[name] == OUTPUT_BIAS:
                full = merge_shards(groups.gather_shards(p, n), OUTPUT_BIAS, self._out_dim())
                params[name] = full * (1.0 / r) if r > 1 else full
            elif g > 1:
                params[name] = merge_shards(groups.gather_shards(p, g), spec[name])
        exchange = groups.exchange(r, LocalExchange())
        # 2DH assumes groups of consecutive ranks; the stride-g exchanges (g > 1) run flat
        return self._experts_and_combine(x_TD, plan, "padded", overlap, use_2dh and g == 1, exchange=exchange,
                                         params=params, repeat=r)

    def _pick_layout(self, layout, megablocks_size, cf, rows, E, local: bool = False) -> str:
        if layout is not None and megablocks_size is not None:
            raise ValueError("pass either layout or megablocks_size, not both")
        if layout is not None and layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {list(LAYOUTS)} or None, got {layout!r}")
        if megablocks_size is not None:
            if isinstance(megablocks_size, bool) or not isinstance(megablocks_size, int) or megablocks_size < 0:
                raise ValueError(f"megablocks_size must be an int >= 0 (0 = padded, >0 = ragged), got {megablocks_size!r}")
            layout = "ragged" if megablocks_size > 0 else "padded"
        local = local or self.world_size == 1
        can_ragged = hasattr(self.experts, "forward_ragged") and local
        if layout == "ragged" and not local:
            raise ValueError("layout 'ragged' needs the experts on this process (one process, or adaptive_r=0); "
                             "expert parallelism exchanges equal padded blocks")
        if layout == "ragged" and not can_ragged:
            raise ValueError(f"layout 'ragged' needs experts with forward_ragged(); {type(self.experts).__name__} has none")
        if layout is None:
            small = rows <= _SMALL_BATCH_ROWS_PER_EXPERT * E
            layout = "ragged" if can_ragged and (cf == 0 or small or not self._padded_pays()) else "padded"
        return layout

    def _padded_pays(self) -> bool:
        # On CPU the padded layout only adds work (zero rows); it pays on accelerators, where one
        # batched matmul over fixed shapes beats a loop of small ones.
        p = next(self.experts.parameters(), None)
        return p is not None and p.device.type != "cpu"

    def _experts_and_combine(self, x_TD: Tensor, plan: DispatchPlan, layout: str, overlap: int = 1,
                             use_2dh: bool = False, exchange=None, params: dict | None = None, repeat: int = 1) -> Tensor:
        """``exchange``/``params``/``repeat``: sharded experts (see _sharded_experts) -- another
        exchange, gathered parameters in place of the module's, every slot block sent ``repeat``
        times (once per hidden slice) and the partial outputs summed."""
        post = self.config.is_postscore
        if layout == "padded":  # [E, C, D] -> (other ranks' slots for my experts) -> experts -> back
            x_ECD = dispatch_padded(x_TD, plan, prescale=not post)
            if repeat > 1:
                x_ECD = x_ECD.repeat_interleave(repeat, dim=0)        # [E*r, C, D]: block e*r+j -> slice j
            ex = self.exchange if exchange is None else exchange
            two = use_2dh
            if params:
                def experts(x):
                    return torch.func.functional_call(self.experts, params, (x, self), strict=False)
            else:
                def experts(x):
                    return self.experts(x, self)
            if (overlap == 1 and not two and ex.world_size > 1 and x_ECD.device.type == "cpu"
                    and getattr(self.experts, "fuses_row_scale", False)):
                y_ECO = self._exchange_in_place(x_ECD, ex, params)
            elif overlap > 1 and ex.world_size > 1:
                # all chunks' all-to-alls in flight first; experts on chunk i while i+1.. still move
                sent = [ex.start_dispatch(c, two) for c in x_ECD.chunk(overlap, dim=1)]
                back = [ex.start_combine(experts(ex.finish(h)), two) for h in sent]
                y_ECO = torch.cat([ex.finish(h) for h in back], dim=1)
            else:
                y_ECO = ex.combine(experts(ex.dispatch(x_ECD, two)), two)
            if repeat > 1:
                y_ECO = y_ECO.view(-1, repeat, *y_ECO.shape[1:]).sum(1)
            return combine_padded(y_ECO, plan, postscore=post)
        if not getattr(self.experts, "fuses_row_scale", False):  # custom experts
            y_NO = self.experts.forward_ragged(dispatch_ragged(x_TD, plan, prescale=not post), plan.counts)
            return combine_ragged(y_NO, plan, postscore=post)
        if post and params is None and repeat == 1 and exchange is None:
            # FFN experts on CPU in bf16: gather, experts and combine in one pass of kernels
            routed = getattr(self.experts, "forward_routed", None)
            y_TO = routed(x_TD, plan.token_N, plan.weight_N, plan.counts) if routed is not None else None
            if y_TO is not None:
                return y_TO
        # Built-in experts: the combine weight is folded into the last expert matmul. At CPU inference
        # the [N, D] temporaries come from reusable scratch (dynamoe.ops.scratch), and the dispatch
        # buffer, no longer needed after the first matmul, takes the output. The same single
        # condition governs scratch in the experts: grad mode off, so nothing saved for backward
        # can ever live in scratch.
        N, D, O = plan.order_N.numel(), self.model_dim, self._out_dim()
        reuse = D == O and not torch.is_grad_enabled() and x_TD.device.type == "cpu"
        x_ND = dispatch_ragged(x_TD, plan, prescale=not post,
                               out=scratch("moe_rows", N, D, x_TD.dtype, x_TD.device) if reuse else None)
        y_NO = self.experts.forward_ragged(x_ND, plan.counts, row_scale=plan.weight_N if post else None,
                                           out=x_ND if reuse else None)
        return combine_ragged(y_NO, plan, postscore=False)

    def _exchange_in_place(self, x_ECD: Tensor, ex, params: dict | None) -> Tensor:
        """The all-to-all without re-layout copies (CPU, built-in experts): the slot buffer [E, C, D]
        goes out as is (rank w's block: its L experts' slots), what arrives -- W source blocks of
        this rank's L experts -- is read in place by the grouped matmul (group g = expert g % L),
        and the [E, C, O] result goes back as is. On CPU the exchange itself is a memory copy, so a
        re-layout would double its cost."""
        E, C, D = x_ECD.shape
        recv = ex.exchange_blocks(x_ECD)
        counts = [C] * E
        if params:
            y = torch.func.functional_call(_RaggedCall(self.experts), {f"experts.{k}": v for k, v in params.items()},
                                           (recv.view(-1, D), counts), strict=False)
        else:
            y = self.experts.forward_ragged(recv.view(-1, D), counts)
        return ex.exchange_blocks(y.view(E, C, -1))

    def _losses(self, routing: Routing, gcfg) -> tuple[Tensor, dict]:
        kind = self.config.aux_loss
        terms: dict[str, Tensor] = {}
        s, ids = routing.scores_TE, routing.ids_TK
        if kind == "gshard":
            terms["gshard"] = losses.gshard_loss(s, ids)
        elif kind == "switch":
            terms["switch"] = losses.switch_loss(s, ids)
        elif kind == "deepseek":
            terms["deepseek_expert"] = losses.deepseek_expert_loss(s, ids)
        elif kind == "load_importance":  # Tutel: noise-free probabilities, noisy threshold
            clean = torch.softmax(routing.logits_TE.float(), dim=-1)
            terms["load_importance"] = losses.load_importance_loss(clean, routing.noisy_logits_TE, ids, gcfg.gate_noise)
        l_aux = sum(terms.values()) if terms else routing.weights_TK.new_zeros(())
        if self.config.device_loss_groups:
            terms["deepseek_device"] = losses.deepseek_device_loss(s, ids, self.config.device_loss_groups)
            l_aux = l_aux + self.config.device_loss_coef * terms["deepseek_device"]
        if self.config.z_loss_coef:
            terms["z_loss"] = losses.router_z_loss(routing.logits_TE)
            l_aux = l_aux + self.config.z_loss_coef * terms["z_loss"]
        return l_aux, terms

    def _empty_stats(self, k, cf, layout) -> RoutingStats:
        zeros = torch.zeros(self.num_global_experts, dtype=torch.int64)
        return RoutingStats(load=zeros, kept=zeros.clone(), dropped=0, capacity=0, top_k=k,
                            capacity_factor=float(cf), layout=layout)

    def _finish(self, y_TO: Tensor, out_shape, orig_dtype, l_aux: Tensor, stats: RoutingStats):
        y = y_TO.reshape(out_shape).to(orig_dtype)
        y.l_aux = l_aux
        y.routing_stats = stats
        self.l_aux = l_aux
        return self.result_func(y) if self.result_func is not None else y


def _no_aux_loss() -> Tensor:
    """The auxiliary loss of a fused decode step (no loss is configured there): a fresh zero, so that
    nothing a caller does to one step's ``l_aux`` reaches another's."""
    return torch.zeros(())


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _world_size(group) -> int:
    if group is None or not _initialized():
        return 1
    return dist.get_world_size(group)


class _LocalView(torch.nn.Module):
    """The layer's expert computation with a local exchange, for functional_call over gathered
    experts (data-parallel calls): same code path as one process with all E experts."""

    def __init__(self, layer: MoELayer):
        super().__init__()
        self.layer = layer

    def forward(self, x_TD: Tensor, plan: DispatchPlan, layout: str) -> Tensor:
        layer = self.layer
        exchange, layer.exchange = layer.exchange, LocalExchange()
        try:
            return layer._experts_and_combine(x_TD, plan, layout)
        finally:
            layer.exchange = exchange


class _RaggedCall(torch.nn.Module):
    """``experts.forward_ragged`` as a module's forward, for functional_call with gathered shards."""

    def __init__(self, experts: nn.Module):
        super().__init__()
        self.experts = experts

    def forward(self, x_ND: Tensor, counts) -> Tensor:
        return self.experts.forward_ragged(x_ND, counts)
