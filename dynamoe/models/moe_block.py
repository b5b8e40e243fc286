"""The feed-forward blocks of a decoder layer: a dense gated MLP, and the sparse block that wraps a
dynamoe :class:`~dynamoe.moe.MoELayer` built from the :class:`ModelConfig`.

Legend: B batch, T tokens, D model dim, E experts, F expert hidden dim.

Routing policies (``router``):

* ``"softmax"`` -- Qwen3-MoE / Mixtral: fp32 softmax -> top-k -> renormalise if ``normalize``.
* ``"softmax_bias"`` -- GPT-OSS: logits = x W^T + b, top-k on the logits, softmax over the k
  (= softmax then renormalise). dynamoe's LinearGate has no logit bias, so this is a custom gate
  (:class:`BiasedRouter`, GateConfig type 'custom').
* ``"sigmoid"`` -- DeepSeek-V3 / Kimi-K2 / GLM-4.5: sigmoid scores, selection-only
  ``e_score_correction_bias``, group-limited top-k, renormalise, ``routed_scaling_factor``.

Inference must never drop a token: every gate is dropless (capacity_factor 0), and the last
forward's :class:`~dynamoe.moe.RoutingStats` is kept on ``last_stats``.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..moe import ExpertConfig, GateConfig, MoEConfig, MoELayer
from ..ops.activations import GLU_KINDS, glu_activation
from ..ops import cpu_kernels
from ..ops.fused import MAX_ROWS, Fused, Holds, RMSNormSpec, Unfusable, slot
from ..ops.stacked_linears import StackedLinears
from ..ops import moe_decode
from .config import ModelConfig
from .norms import RMSNorm

__all__ = ["GatedMLP", "BiasedRouter", "SparseMoeBlock", "ROUTERS", "glu_kind"]

ROUTERS = ("softmax", "softmax_bias", "sigmoid", "sparsemixer")
# config.json's hidden_act -> dynamoe's GLU kind
_HIDDEN_ACT = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
               "relu": "relu"}


def glu_kind(hidden_act: str) -> str:
    """The GLU kind (dynamoe.ops.activations) for a config's ``hidden_act``."""
    if hidden_act not in _HIDDEN_ACT:
        raise ValueError(f"config field 'hidden_act' must be one of {sorted(_HIDDEN_ACT)}, got {hidden_act!r}")
    return _HIDDEN_ACT[hidden_act]


def _rms_spec(holds: Holds, norm: nn.Module) -> RMSNormSpec:
    """The norm before a fused MLP kernel, recorded in ``holds``; Unfusable unless an RMSNorm (scale w, or 1 + w
    zero-centred)."""
    if type(norm) is not RMSNorm:
        raise Unfusable(f"the norm before the MLP is a {type(norm).__name__} (the kernel takes RMSNorm)")
    return RMSNormSpec(holds.param(norm, "weight"), holds.attr(norm, "eps"), holds.attr(norm, "weight_in_fp32"),
                       bool(holds.attr(norm, "zero_centered")))


class GatedMLP(StackedLinears, nn.Module):
    """down(act(gate(x)) * up(x)) with Hugging Face's names (``gate_proj``, ``up_proj``, ``down_proj``);
    ``glu`` is a GLU kind of dynamoe.ops.activations ('silu' = SwiGLU; ``limit``: the clamp of 'gpt_oss' and
    'silu_clamp'). At decode a dense layer's
    ``h + mlp(norm(h))`` is one kernel call (:meth:`decode_block`) over gate and up stacked into one weight."""

    stacked_names = ("gate_proj", "up_proj")

    def __init__(self, hidden_size: int, intermediate_size: int, glu: str = "silu", bias: bool = False,
                 limit: float = 7.0, dtype=None):
        super().__init__()
        if glu not in GLU_KINDS:
            raise ValueError(f"glu must be one of {list(GLU_KINDS)}, got {glu!r}")
        self.limit = limit
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, dtype=dtype)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, dtype=dtype)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias, dtype=dtype)
        self.glu = glu

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(glu_activation(self.gate_proj(x), self.up_proj(x), self.glu, limit=self.limit))

    def decode_fused(self, h_TD: Tensor, norm: nn.Module) -> Fused:
        """The fused kernel of ``h + self(norm(h))`` for decode steps like ``h_TD`` [T, D] (a
        ``kernels.MoEWeights`` without a router), cached while current; ``weights`` None and ``extra`` the
        reason where it does not apply."""
        cache = slot(self)
        fused = cache.get((norm, h_TD.dtype))
        if fused is not None:
            return fused
        holds = Holds()
        try:
            kernels = cpu_kernels.load()
            if kernels is None:
                raise Unfusable("the CPU kernels are not available")
            spec = _rms_spec(holds, norm)
            fields = moe_decode.glu_mlp_fields(kernels, holds, h_TD.dtype, self.stacked_for(holds),
                                               holds.module(self, "down_proj"), holds.attr(self, "glu"),
                                               limit=holds.attr(self, "limit"))
            fused = Fused(moe_decode.dense_mlp_weights(kernels, holds, h_TD, fields, spec), holds, kernels)
        except Unfusable as exc:
            fused = Fused(None, holds, str(exc))
        return cache.put((norm, h_TD.dtype), fused)

    def decode_block(self, h_BTD: Tensor, norm: nn.Module) -> Tensor | None:
        """``h + self(norm(h))`` for a decode step in one kernel call (:meth:`decode_fused`), or None."""
        h_TD = h_BTD.reshape(-1, h_BTD.size(-1))
        if (torch.is_grad_enabled() or h_TD.device.type != "cpu" or not 1 <= h_TD.size(0) <= MAX_ROWS
                or torch.is_autocast_enabled("cpu")):
            return None
        fused = self.decode_fused(h_TD, norm)
        if fused.weights is None:
            return None
        return moe_decode.moe_decode_with(fused.extra, fused.weights, h_TD.contiguous())[0].view(h_BTD.shape)


class BiasedRouter(nn.Module):
    """Router logits with a bias, x W^T + b, computed in fp32 (GPT-OSS's ``mlp.router``)."""

    def __init__(self, model_dim: int, num_global_experts: int, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_global_experts, model_dim, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(num_global_experts, dtype=dtype))

    def forward(self, x_TD: Tensor) -> Tensor:
        return F.linear(x_TD.float(), self.weight.float(), self.bias.float())

    def fp32_linear(self) -> tuple[Tensor, Tensor]:
        """(W, bias): the logits are x W^T + bias in fp32 (see dynamoe.moe.gates.LinearGate.fp32_linear)."""
        return self.weight, self.bias


class SparseMoeBlock(nn.Module):
    """Routed experts (a dynamoe MoELayer, ``self.moe``) for one decoder layer.

    The experts are GLU experts (``moe.experts.gate_up_proj`` [E, 2F, D] gate rows then up rows,
    ``moe.experts.down_proj`` [E, D, F], optional biases), or, for a quantized checkpoint, the
    loader's :class:`~dynamoe.quant.QuantizedExperts`. ``glu`` is 'silu' or 'gpt_oss' (clamped SwiGLU).
    Shared experts (``moe.shared_experts``): ``num_shared_experts`` of F each, or one MLP of
    ``shared_hidden_size``; ``shared_gate`` scales their output by a per-token sigmoid gate (Qwen2-MoE);
    ``shared_fused_gate_up`` keeps their gate and up projections in one linear (GraniteMoE-Shared).
    ``router_groups``: group-limited selection over ``cfg.n_group`` / ``cfg.topk_group``; None = the
    sigmoid router's default (DeepSeek-V3: yes) and the softmax router's (no). For 'softmax' this is
    DeepSeek-V2's 'group_limited_greedy' (groups ranked by their best expert; ``group_rank`` 'top2_sum': by the
    sum of their two best, Mistral-4; see GateConfig.group_rank). ``route_scale``: the
    routed weights' factor; None = ``cfg.routed_scaling_factor`` for 'sigmoid', 1 for the others.
    (MiniMax-M2's sigmoid router has neither groups nor a scale: it passes False and 1.)
    ``selection_bias``: the softmax router's selection-only ``e_score_correction_bias`` (ERNIE-4.5).
    ``router`` 'sparsemixer': Phi-3.5-MoE's SparseMixer at inference (two experts, ``cfg.router_jitter_noise``).
    ``prescale``: each routing weight scales its expert's input instead of its output (Llama-4: expert(w * x));
    the fused decode kernels scale outputs, so such a block runs the general path (MoELayer refuses the kernel).
    ``glu_limit``: the routed experts' clamp ('gpt_oss', 'silu_clamp'; None = ``cfg.swiglu_limit`` or 7), the up
    projection's softcap of 'silu_softcap'; ``glu_alpha``: the 'gpt_oss' sigmoid's slope (None = ``cfg.swiglu_alpha``),
    the gate's softcap of 'silu_softcap' (Inkling-2);
    ``shared_glu`` / ``shared_glu_limit``: the shared experts' own GLU kind and clamp (None = the routed ones').
    ``shared_bias``: biases on the shared experts' projections (None = as the routed experts: ``expert_bias``).
    ``bias_on_logits``: the sigmoid router's selection bias goes on the logits, not the scores (Kolibri-1).
    ``ffn_activation``: non-gated experts instead, down(act(up(x))) (``moe.experts.batched_fc1_w`` [E, F, D] = up,
    ``batched_fc2_w`` [E, F, D] = down transposed; an activation name of dynamoe.ops.activations, e.g. 'relu2':
    Nemotron-H), without shared experts (the family adds its own).
    """

    def __init__(self, cfg: ModelConfig, router: str = "softmax", normalize: bool = True, glu: str = "silu",
                 expert_bias: bool = False, num_shared_experts: int = 0, shared_hidden_size: int | None = None,
                 shared_gate: bool = False, shared_fused_gate_up: bool = False, router_groups: bool | None = None,
                 route_scale: float | None = None, selection_bias: bool = False, prescale: bool = False,
                 group_rank: str = "max", glu_limit: float | None = None, shared_glu: str | None = None,
                 shared_glu_limit: float | None = None, shared_bias: bool | None = None, bias_on_logits: bool = False,
                 ffn_activation: str | None = None, glu_alpha: float | None = None, dtype=None):
        super().__init__()
        if router not in ROUTERS:
            raise ValueError(f"router must be one of {list(ROUTERS)}, got {router!r}")
        E, K, D, F_ = cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.expert_hidden_size
        self.router_kind, self.num_experts, self.hidden_size = router, E, D
        if router == "softmax_bias" and (router_groups or route_scale not in (None, 1.0)):
            raise ValueError("router 'softmax_bias' (GPT-OSS) has no groups and no route scale")
        sigmoid = router == "sigmoid"
        groups = (cfg.n_group, cfg.topk_group) if (sigmoid if router_groups is None else router_groups) else (1, 1)
        scale = (cfg.routed_scaling_factor if sigmoid else 1.0) if route_scale is None else route_scale
        if selection_bias and router != "softmax":
            raise ValueError(f"selection_bias is an option of router 'softmax' (the sigmoid router always has one), "
                             f"got router {router!r}")
        if bias_on_logits and router != "sigmoid":
            raise ValueError(f"bias_on_logits is an option of router 'sigmoid' (its selection bias), got router {router!r}")
        if group_rank != "max" and router != "softmax":
            raise ValueError(f"group_rank is an option of router 'softmax' (the sigmoid router ranks groups by "
                             f"DeepSeek-V3's rule), got router {router!r} with group_rank={group_rank!r}")
        if router == "softmax":
            gate = GateConfig(type="top", k=K, capacity_factor=0.0, fp32_gate=True, normalize=normalize,
                              n_group=groups[0], topk_group=groups[1], route_scale=scale, selection_bias=selection_bias,
                              group_rank=group_rank)
        elif router == "sparsemixer":  # Phi-3.5-MoE: two experts, margins of cfg.router_jitter_noise
            if K != 2 or router_groups or route_scale not in (None, 1.0) or selection_bias:
                raise ValueError(f"router 'sparsemixer' picks exactly 2 experts (num_experts_per_tok={K}), without "
                                 "groups, route scale or selection bias")
            gate = GateConfig(type="sparsemixer", k=2, capacity_factor=0.0, fp32_gate=True,
                              jitter_eps=cfg.router_jitter_noise)
        elif router == "softmax_bias":
            gate = GateConfig(type="custom", k=K, capacity_factor=0.0, normalize=normalize,
                              module=BiasedRouter(D, E, dtype=dtype))
        else:
            gate = GateConfig(type="sigmoid", k=K, capacity_factor=0.0, fp32_gate=True, normalize=normalize,
                              n_group=groups[0], topk_group=groups[1], route_scale=scale, bias_on_logits=bias_on_logits)
        if ffn_activation is not None:
            if num_shared_experts or expert_bias or shared_bias:
                raise ValueError("non-gated experts (ffn_activation) take no shared experts and no expert biases here")
            experts = ExpertConfig(type="ffn", num_experts_per_device=E, hidden_size_per_expert=F_,
                                   activation_fn=ffn_activation, has_fc1_bias=False, has_fc2_bias=False)
        else:
            experts = ExpertConfig(
                type="glu", num_experts_per_device=E, hidden_size_per_expert=F_, glu_activation=glu,
                glu_bias=expert_bias,
                gpt_oss_alpha=cfg.swiglu_alpha if glu_alpha is None else glu_alpha,
                gpt_oss_limit=(cfg.swiglu_limit or 7.0) if glu_limit is None else glu_limit,
                num_shared_experts=num_shared_experts, shared_hidden_size=shared_hidden_size, shared_gate=shared_gate,
                shared_fused_gate_up=shared_fused_gate_up, shared_glu_activation=shared_glu,
                shared_glu_limit=shared_glu_limit, shared_glu_bias=shared_bias,
            )
        # check_finite off: the input is this model's own hidden state, and the check costs a host
        # sync per layer and step
        self.moe = MoELayer(MoEConfig(model_dim=D, gates=[gate], experts=experts, aux_loss="none", dtype=dtype,
                                      check_finite=False, is_postscore=not prescale))
        self.last_stats = None

    @property
    def local_experts(self) -> range:
        """The global ids of the routed experts this process holds (all E, unless expert parallel)."""
        L = self.moe.num_local_experts
        return range(self.moe.exchange.rank * L, (self.moe.exchange.rank + 1) * L)

    def expert_parallel_(self, group) -> None:
        """Keep only this rank's share of the routed experts: over ``group``'s W ranks, rank r holds
        global experts [r*E/W, (r+1)*E/W) (the MoE layer's all-to-all convention) and every forward
        exchanges tokens with the other ranks; the router and the shared experts stay whole. Every rank
        must then run the same forwards. Rebuilds ``self.moe`` with fresh parameters: the loader calls
        this on the meta device, before reading the weights."""
        from ..parallel import net   # importing dynamoe.parallel registers the all-to-all exchange

        world = net.get_world_size(group)
        if world == 1:
            return
        E = self.num_experts
        if E % world:
            raise ValueError(f"num_experts={E} is not divisible by the world size {world}: expert parallelism "
                             f"gives every rank num_experts / world size experts")
        cfg = self.moe.config
        local = dataclasses.replace(cfg.experts, num_experts_per_device=E // world)
        self.moe = MoELayer(dataclasses.replace(cfg, experts=local), group=group)

    def materialize_buffers(self, device) -> None:
        """Buffers of the MoE layer when the model was built on the meta device."""
        self.moe._num_global_experts = torch.tensor(self.moe.num_global_experts, device=device)
        self.moe._load_since_update = torch.zeros(len(self.moe.gates), self.num_experts, dtype=torch.int64,
                                                  device=device)

    #: under expert parallelism with the same tokens on every rank (multi-rank serving), batches of at
    #: least this many rows per rank are split: each rank routes 1/W of the rows and the outputs are
    #: gathered (one all-gather), instead of every rank sending every row to the experts' owners
    split_min_rows_per_rank = 16

    def forward(self, x_BTD: Tensor) -> Tensor:
        W = self.moe.world_size
        if (self.replicated_tokens and W > 1 and not torch.is_grad_enabled()
                and x_BTD.numel() // self.hidden_size >= W * self.split_min_rows_per_rank):
            return self._forward_split(x_BTD, W)
        y = self.moe(x_BTD)
        self.last_stats = y.routing_stats
        return y

    #: why the fused kernel cannot run this block (a subclass whose forward adds what the kernel lacks, e.g. a
    #: shared MLP of its own beside ``moe``), or None. Both :meth:`decode_block` and a DecodePlan read it through
    #: :meth:`decode_fused`.
    decode_refusal: str | None = None

    def decode_fused(self, h_TD: Tensor, norm: nn.Module) -> Fused:
        """The fused kernel of ``h + self(norm(h))`` for decode steps like ``h_TD`` [T, D]
        (MoELayer.decode_fused with the norm and the residual), cached while current; its ``weights`` is
        None (and ``extra`` the reason) where it does not apply."""
        if self.decode_refusal is not None:
            return Fused(None, Holds(), self.decode_refusal)
        cache = slot(self)
        fused = cache.get((norm, h_TD.dtype))
        if fused is not None:
            return fused
        holds = Holds()
        moe = holds.module(self, "moe")
        try:
            fused = moe.decode_fused(h_TD, holds, _rms_spec(holds, norm))
        except Unfusable as exc:
            fused = Fused(None, holds, str(exc))
        return cache.put((norm, h_TD.dtype), fused)

    def decode_block(self, h_BTD: Tensor, norm: nn.Module) -> Tensor | None:
        """``h + self(norm(h))`` for a decode step in one kernel call (:meth:`decode_fused`), or None where
        that does not apply (then the caller runs norm, block and residual one after another)."""
        h_TD = h_BTD.reshape(-1, self.hidden_size)
        moe = self._modules["moe"]
        if not moe._decode_ready(h_TD):
            return None
        fused = self.decode_fused(h_TD, norm)
        if fused.weights is None:
            return None
        out, load, max_load = moe_decode.moe_decode_with(fused.extra, fused.weights, h_TD.contiguous())
        self.__dict__["last_stats"] = moe.decode_done(load, max_load)  # a plain attribute, without nn.Module.__setattr__'s checks
        return out.view(h_BTD.shape)

    #: set by :meth:`replicated_tokens_`: every rank runs this block on the same tokens
    replicated_tokens = False

    def replicated_tokens_(self, on: bool = True) -> None:
        """Declare that every rank of the expert-parallel group calls this block with the same tokens
        (dynamoe.engine.distributed: rank 0 drives, the others repeat its forwards). Then large
        batches are split over the ranks (see :attr:`split_min_rows_per_rank`); the output and
        ``last_stats`` are the whole batch's either way. Wrong when ranks hold different tokens."""
        self.replicated_tokens = bool(on)

    def _forward_split(self, x_BTD: Tensor, W: int) -> Tensor:
        import torch.distributed as dist

        from ..moe.dispatch import RoutingStats

        x = x_BTD.reshape(-1, x_BTD.size(-1))
        N, rank, group = x.size(0), self.moe.exchange.rank, self.moe.group
        per = -(-N // W)
        lo, hi = min(rank * per, N), min((rank + 1) * per, N)
        y_local = self.moe(x[lo:hi])
        st = y_local.routing_stats
        mine = y_local.new_zeros(per, y_local.size(-1))   # equal blocks for the all-gather
        mine[:hi - lo] = y_local
        blocks = [torch.empty_like(mine) for _ in range(W)]
        dist.all_gather(blocks, mine, group=group)
        dropped = torch.tensor([st.dropped], dtype=st.load.dtype, device=st.load.device)
        counts = torch.cat([st.load, st.kept, dropped]).to(x.device)
        dist.all_reduce(counts, group=group)   # the whole batch's routing statistics on every rank
        E = st.load.numel()
        counts = counts.cpu()
        self.last_stats = RoutingStats(load=counts[:E], kept=counts[E:2 * E], dropped=int(counts[2 * E]),
                                       capacity=st.capacity, top_k=st.top_k, capacity_factor=st.capacity_factor,
                                       layout=st.layout, losses=st.losses)
        return torch.cat(blocks)[:N].view(*x_BTD.shape[:-1], y_local.size(-1))
