"""Expert networks. Each acts on both layouts of a dispatch plan:

* ``forward(x_LCD, ctx)`` -- padded: [L local experts, C slots, D] -> [L, C, O] (Tutel's protocol);
* ``forward_ragged(x_ND, counts)`` -- rows sorted by expert, ``counts[l]`` rows for expert l -> [N, O].

Legend: L local experts, C capacity, N routed rows, D model dim, F expert hidden dim, O output dim.

Custom experts (extension point): any ``nn.Module`` with ``forward(x_LCD, ctx)`` works; one that also
defines ``forward_ragged(x_ND, counts)`` is run dropless without padding. ``ctx`` is the MoE layer
(``ctx.model_dim``, ``ctx.num_local_experts``, ``ctx.num_global_experts``, ``ctx.sharded_count``).
"""
from __future__ import annotations

import inspect
import math
import warnings
from typing import Callable, Protocol, Sequence, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops.activations import activation, glu_activation
from ..ops.stacked_linears import StackedLinears
from ..ops.grouped_matmul import grouped_mm
from ..ops.routed_ffn import routed_ffn, routed_ffn_kernels
from ..ops.scratch import scratch
from .config import ExpertConfig
from .sharding import FFN_SHARD_SPEC, GLU_SHARD_SPEC, LLAMA_SHARD_SPEC

__all__ = ["ExpertsProtocol", "FFNExperts", "GLUExperts", "LlamaFFNExperts", "SharedExperts", "build_experts",
           "glu_activation"]


@runtime_checkable
class ExpertsProtocol(Protocol):
    def forward(self, x_LCD: Tensor, ctx) -> Tensor: ...


def _needs_grad(*ts: Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


def _hidden_out(x_ND: Tensor, cols: int) -> Tensor | None:
    """Scratch for the [N, cols] hidden activations at CPU inference (see dynamoe.ops.scratch).
    Only with grad mode off: then nothing can save the buffer for a backward that a later call
    would overwrite (frozen experts under a trainable router would otherwise qualify)."""
    if x_ND.device.type != "cpu" or torch.is_grad_enabled():
        return None
    return scratch("moe_hidden", x_ND.size(0), cols, x_ND.dtype, x_ND.device)


def _activate_(h: Tensor, fn: Callable[[Tensor], Tensor]) -> Tensor:
    """Apply a built-in activation in place where autograd allows it (a fresh [N, F] buffer costs
    more than the activation itself on CPU): ReLU always (its backward uses its output), SiLU and
    GELU only without autograd. Other callables run as given."""
    if fn is F.relu:
        return F.relu(h, inplace=True)
    if not _needs_grad(h):
        if fn is F.silu:
            return F.silu(h, inplace=True)
    return fn(h)


def _uniform_(t: Tensor, fan_in: int) -> None:
    # nn.Linear's default init, per expert: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    with torch.no_grad():
        t.uniform_(-bound, bound)


def _bmm(x_LCI: Tensor, w: Tensor, bias_LO: Tensor | None, trans_w: bool) -> Tensor:
    w = w.transpose(1, 2) if trans_w else w
    if bias_LO is None:
        return torch.bmm(x_LCI, w)
    return torch.baddbmm(bias_LO.unsqueeze(1), x_LCI, w)


class FFNExperts(nn.Module):
    """fc1 -> activation -> fc2 per expert, with Tutel's parameter names and shapes:
    ``batched_fc1_w`` [L, F, D], ``batched_fc1_bias`` [L, F], ``batched_fc2_w`` [L, F, O],
    ``batched_fc2_bias`` [L, O]. Biases are fused into the matmuls (addmm / baddbmm).

    ``sharded_count`` n > 1: this rank holds 1/n of one expert (see dynamoe.moe.sharding): F/n hidden
    columns and ceil(O/n) entries of the output bias; ``hidden_size`` stays the whole F."""

    fuses_row_scale = True  # forward_ragged takes row_scale= and out=
    shard_spec = FFN_SHARD_SPEC

    def __init__(self, model_dim: int, hidden_size: int, num_local_experts: int, activation_fn=None,
                 has_fc1_bias: bool = True, has_fc2_bias: bool = True, output_dim: int | None = None,
                 dtype=None, device=None, sharded_count: int = 1):
        super().__init__()
        L, D, F_, O = num_local_experts, model_dim, hidden_size, output_dim or model_dim
        Fs, Ob = _shard_sizes(F_, O, sharded_count)
        kw = dict(dtype=dtype, device=device)
        self.model_dim, self.hidden_size, self.output_dim, self.num_local_experts = D, F_, O, L
        self.sharded_count = sharded_count
        self.activation_fn = activation(activation_fn)
        self.batched_fc1_w = nn.Parameter(torch.empty(L, Fs, D, **kw))
        self.batched_fc2_w = nn.Parameter(torch.empty(L, Fs, O, **kw))
        self.batched_fc1_bias = nn.Parameter(torch.empty(L, Fs, **kw)) if has_fc1_bias else None
        self.batched_fc2_bias = nn.Parameter(torch.empty(L, Ob, **kw)) if has_fc2_bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Tutel's initialisation, expert by expert: expert i's fc1 and fc2 are what
        ``nn.Linear(D, F_shard)`` and ``nn.Linear(F_shard, O)`` draw (weight, then bias, fc1 first),
        in that order from the CPU generator, so the same seeds give Tutel's weights bit for bit
        (F_shard = F / sharded_count: a shard's fc2 fan-in is its own hidden size, as in Tutel)."""
        if self.batched_fc1_w.is_meta:
            return  # built for a later load: nothing to draw
        Fs, O = self.batched_fc1_w.size(1), self.output_dim
        b1, b2 = self.batched_fc1_bias is not None, self.batched_fc2_bias is not None
        kw = dict(dtype=self.batched_fc1_w.dtype, device="cpu")
        with torch.no_grad():
            for i in range(self.batched_fc1_w.size(0)):
                fc1 = nn.Linear(self.model_dim, Fs, bias=b1, **kw)
                fc2 = nn.Linear(Fs, O, bias=b2, **kw)
                self.batched_fc1_w[i].copy_(fc1.weight)
                self.batched_fc2_w[i].copy_(fc2.weight.t())
                if b1:
                    self.batched_fc1_bias[i].copy_(fc1.bias)
                if b2:
                    self.batched_fc2_bias[i].copy_(fc2.bias[:self.batched_fc2_bias.size(-1)])

    def extra_repr(self) -> str:
        return (f"model_dim={self.model_dim}, hidden_size={self.hidden_size}, output_dim={self.output_dim}, "
                f"local_experts={self.num_local_experts}, bias={self.batched_fc1_bias is not None}/{self.batched_fc2_bias is not None}")

    def forward(self, x_LCD: Tensor, ctx=None) -> Tensor:
        h_LCF = self.activation_fn(_bmm(x_LCD, self.batched_fc1_w, self.batched_fc1_bias, trans_w=True))
        return _bmm(h_LCF, self.batched_fc2_w, self.batched_fc2_bias, trans_w=False)

    def forward_ragged(self, x_ND: Tensor, counts: Sequence[int], row_scale: Tensor | None = None,
                       out: Tensor | None = None) -> Tensor:
        """Rows sorted by expert -> [N, O]. ``row_scale`` [N] multiplies each output row (the
        combine weight, fused into fc2); ``out`` is an optional inference-only output buffer."""
        h_out = _hidden_out(x_ND, self.batched_fc1_w.size(1))
        h_NF = grouped_mm(x_ND, self.batched_fc1_w, counts, self.batched_fc1_bias, trans_w=True, out=h_out)
        h_NF = _activate_(h_NF, self.activation_fn)
        return grouped_mm(h_NF, self.batched_fc2_w, counts, self.batched_fc2_bias, trans_w=False,
                          row_scale=row_scale, out=out)


    def forward_routed(self, x_TD: Tensor, token_N: Tensor, weight_N: Tensor, counts: Sequence[int]) -> Tensor | None:
        """[T, O]: each token's sum of weight_N x its rows' expert outputs, gather and combine fused into
        the expert GEMMs (dynamoe.ops.routed_ffn) where those kernels apply (CPU, bf16, ReLU, one
        group per expert, enough rows); None otherwise -- the caller then dispatches, runs
        forward_ragged and combines. ``token_N`` [N]: each row's token, rows sorted by expert."""
        w1, w2, b1, b2 = self.batched_fc1_w, self.batched_fc2_w, self.batched_fc1_bias, self.batched_fc2_bias
        if self.sharded_count != 1:
            return None
        kernels = routed_ffn_kernels(x_TD, w1, w2, (b1, b2), self.activation_fn, counts)
        if kernels is None:
            return None
        return routed_ffn(x_TD, token_N, weight_N, counts, w1, b1, w2, b2, kernels=kernels)


class GLUExperts(nn.Module):
    """Gated experts: y = down(act(gate(x)) * up(x)). Layout as transformers' fused MoE experts:
    ``gate_up_proj`` [L, 2F, D] (gate rows first, then up rows), ``down_proj`` [L, O, F], optional
    ``gate_up_proj_bias`` [L, 2F] and ``down_proj_bias`` [L, O] (GPT-OSS). GPT-OSS checkpoints store
    gate/up *interleaved* in [L, D, 2F] (gate = [..., ::2], up = [..., 1::2]); a loader converts them
    to this layout once (transpose, then de-interleave). ``sharded_count`` as in FFNExperts (the
    gate and the up rows are sharded separately)."""

    fuses_row_scale = True
    shard_spec = GLU_SHARD_SPEC

    def __init__(self, model_dim: int, hidden_size: int, num_local_experts: int, activation: str | None = "silu",
                 bias: bool = False, alpha: float = 1.702, limit: float = 7.0, output_dim: int | None = None,
                 dtype=None, device=None, sharded_count: int = 1):
        super().__init__()
        L, D, F_, O = num_local_experts, model_dim, hidden_size, output_dim or model_dim
        Fs, Ob = _shard_sizes(F_, O, sharded_count)
        kw = dict(dtype=dtype, device=device)
        self.model_dim, self.hidden_size, self.output_dim, self.num_local_experts = D, F_, O, L
        self.sharded_count = sharded_count
        self.activation, self.alpha, self.limit = activation or "silu", alpha, limit
        glu_activation(torch.zeros(1), torch.zeros(1), self.activation)  # validate early
        self.gate_up_proj = nn.Parameter(torch.empty(L, 2 * Fs, D, **kw))
        self.down_proj = nn.Parameter(torch.empty(L, O, Fs, **kw))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(L, 2 * Fs, **kw)) if bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(L, Ob, **kw)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _uniform_(self.gate_up_proj, self.model_dim)
        _uniform_(self.down_proj, self.hidden_size)
        if self.gate_up_proj_bias is not None:
            _uniform_(self.gate_up_proj_bias, self.model_dim)
            _uniform_(self.down_proj_bias, self.hidden_size)

    def extra_repr(self) -> str:
        return (f"model_dim={self.model_dim}, hidden_size={self.hidden_size}, local_experts={self.num_local_experts}, "
                f"activation={self.activation}, bias={self.gate_up_proj_bias is not None}")

    def _act(self, gu: Tensor) -> Tensor:
        gate, up = gu.chunk(2, dim=-1)  # (the hidden size of the weights in use: a shard or whole)
        return glu_activation(gate, up, self.activation, self.alpha, self.limit)

    def forward(self, x_LCD: Tensor, ctx=None) -> Tensor:
        h_LCF = self._act(_bmm(x_LCD, self.gate_up_proj, self.gate_up_proj_bias, trans_w=True))
        return _bmm(h_LCF, self.down_proj, self.down_proj_bias, trans_w=True)

    def forward_ragged(self, x_ND: Tensor, counts: Sequence[int], row_scale: Tensor | None = None,
                       out: Tensor | None = None) -> Tensor:
        """Rows sorted by expert -> [N, O]; ``row_scale`` and ``out`` as in FFNExperts."""
        h_out = _hidden_out(x_ND, self.gate_up_proj.size(1))
        gu_N2F = grouped_mm(x_ND, self.gate_up_proj, counts, self.gate_up_proj_bias, trans_w=True, out=h_out)
        if not _needs_grad(gu_N2F) and self.activation == "silu":
            gate, up = gu_N2F.chunk(2, dim=-1)
            h_NF = F.silu(gate, inplace=True).mul_(up)  # stays a strided view: BLAS reads it as is
        else:
            h_NF = self._act(gu_N2F)
        return grouped_mm(h_NF, self.down_proj, counts, self.down_proj_bias, trans_w=True,
                          row_scale=row_scale, out=out)


class LlamaFFNExperts(nn.Module):
    """Tutel's ``llama_ffn`` experts: y = (act(x W1) * (x W2)) W3 with W1, W2 [L, D, F] and W3
    [L, F, D], no biases, ``act`` silu unless ``activation_fn`` is given. Stored as Tutel stores them:
    flat parameters ``W_fc1``, ``W_fc2``, ``W_fc3`` of ceil(numel / sharded_count) elements (this rank's
    slice of the flattened weight when ``sharded_count`` ranks share an expert; the layer gathers
    them), initialised with normal(0, 0.01) in that order, as Tutel does."""

    fuses_row_scale = True
    shard_spec = LLAMA_SHARD_SPEC

    def __init__(self, model_dim: int, hidden_size: int, num_local_experts: int, activation_fn=None,
                 dtype=None, device=None, sharded_count: int = 1):
        super().__init__()
        if isinstance(sharded_count, bool) or not isinstance(sharded_count, int) or sharded_count < 1:
            raise ValueError(f"sharded_count must be an int >= 1, got {sharded_count!r}")
        L, D, F_ = num_local_experts, model_dim, hidden_size
        self.model_dim, self.hidden_size, self.output_dim, self.num_local_experts = D, F_, D, L
        self.sharded_count = sharded_count
        self.activation_fn = F.silu if activation_fn is None else activation(activation_fn)
        kw = dict(dtype=dtype, device=device)
        self.full_shapes = {"W_fc1": (L, D, F_), "W_fc2": (L, D, F_), "W_fc3": (L, F_, D)}
        for name, shape in self.full_shapes.items():
            setattr(self, name, nn.Parameter(torch.empty(-(-math.prod(shape) // sharded_count), **kw)))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for name in self.full_shapes:
                getattr(self, name).normal_(0, 0.01)

    def extra_repr(self) -> str:
        return (f"model_dim={self.model_dim}, hidden_size={self.hidden_size}, local_experts={self.num_local_experts}, "
                f"sharded_count={self.sharded_count}")

    def _weights(self) -> tuple[Tensor, Tensor, Tensor]:
        # whole experts: this module's own (sharded_count 1) or gathered ones the layer passes in
        D, F_ = self.model_dim, self.hidden_size
        w1, w2, w3 = self.W_fc1, self.W_fc2, self.W_fc3
        if w1.numel() < math.prod(self.full_shapes["W_fc1"]):  # this rank's slice only
            raise ValueError("llama_ffn experts shared by several ranks compute with gathered weights: run them at "
                             "adaptive_r=1 (Tutel's default parallel_type 'adaptive:1')")
        return w1.view(-1, D, F_), w2.view(-1, D, F_), w3.view(-1, F_, D)

    def forward(self, x_LCD: Tensor, ctx=None) -> Tensor:
        w1, w2, w3 = self._weights()
        return torch.matmul(self.activation_fn(torch.matmul(x_LCD, w1)) * torch.matmul(x_LCD, w2), w3)

    def forward_ragged(self, x_ND: Tensor, counts: Sequence[int], row_scale: Tensor | None = None,
                       out: Tensor | None = None) -> Tensor:
        """Rows sorted by expert -> [N, D]; ``row_scale`` and ``out`` as in FFNExperts."""
        w1, w2, w3 = self._weights()
        h_NF = self.activation_fn(grouped_mm(x_ND, w1, counts, None, trans_w=False)) * grouped_mm(x_ND, w2, counts, None, trans_w=False)
        return grouped_mm(h_NF, w3, counts, None, trans_w=False, row_scale=row_scale, out=out)


class SharedExperts(StackedLinears, nn.Module):
    """Always-on dense expert(s) added to the routed output (DeepSeek's ``shared_experts``): one
    MLP whose hidden size is ``num_shared * F`` unless given. GLU uses HF's names
    (``gate_proj``, ``up_proj``, ``down_proj``); FFN uses ``fc1``/``fc2``. With ``shared_gate`` the
    output is scaled per token by sigmoid(``gate``(x)), ``gate`` a [1, D] linear (Qwen1.5/2-MoE). With
    ``shared_fused_gate_up`` the gate and up projections are one ``gate_up_proj`` [2S, D] (GraniteMoE-Shared)."""

    def __init__(self, cfg: ExpertConfig, model_dim: int, dtype=None, device=None):
        super().__init__()
        hidden = cfg.shared_hidden_size or cfg.num_shared_experts * cfg.hidden_size_per_expert
        out = cfg.output_dim or model_dim
        kw = dict(dtype=dtype, device=device)
        self.is_glu = cfg.type == "glu"
        if self.is_glu:
            self.activation = cfg.shared_glu_activation or cfg.glu_activation or "silu"
            self.alpha = cfg.gpt_oss_alpha
            self.limit = cfg.gpt_oss_limit if cfg.shared_glu_limit is None else cfg.shared_glu_limit
            bias = cfg.glu_bias if cfg.shared_glu_bias is None else cfg.shared_glu_bias
            if cfg.shared_fused_gate_up:
                self.gate_up_proj = nn.Linear(model_dim, 2 * hidden, bias=bias, **kw)
            else:
                self.gate_proj = nn.Linear(model_dim, hidden, bias=bias, **kw)
                self.up_proj = nn.Linear(model_dim, hidden, bias=bias, **kw)
            self.down_proj = nn.Linear(hidden, out, bias=bias, **kw)
            self.fused_gate_up = cfg.shared_fused_gate_up
        else:
            self.activation_fn = activation(cfg.activation_fn)
            self.fc1 = nn.Linear(model_dim, hidden, bias=cfg.has_fc1_bias, **kw)
            self.fc2 = nn.Linear(hidden, out, bias=cfg.has_fc2_bias, **kw)
        self.gate = nn.Linear(model_dim, 1, bias=False, **kw) if cfg.shared_gate else None
        # the decode kernel reads the gate and up projections as one [2S, D] weight (stack_linears_)
        self.stacked_names = (("gate_up_proj",) if cfg.shared_fused_gate_up else ("gate_proj", "up_proj")) if self.is_glu else ()

    def forward(self, x_TD: Tensor) -> Tensor:
        if self.is_glu:
            if self.fused_gate_up:
                gate, up = self.gate_up_proj(x_TD).chunk(2, dim=-1)
            else:
                gate, up = self.gate_proj(x_TD), self.up_proj(x_TD)
            y = self.down_proj(glu_activation(gate, up, self.activation, self.alpha, self.limit))
        else:
            y = self.fc2(self.activation_fn(self.fc1(x_TD)))
        if self.gate is not None:
            y = torch.sigmoid(self.gate(x_TD)) * y
        return y


def _shard_sizes(hidden: int, out: int, n: int) -> tuple[int, int]:
    """(hidden columns, output-bias entries) one rank holds when n ranks share an expert."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"sharded_count must be an int >= 1, got {n!r}")
    if hidden % n:
        raise ValueError(f"hidden_size_per_expert={hidden} must be divisible by the {n} ranks sharing each expert")
    return hidden // n, -(-out // n)


def build_experts(cfg: ExpertConfig, model_dim: int, dtype=None, device=None, sharded_count: int = 1) -> nn.Module:
    """The routed experts; ``sharded_count`` n > 1: this rank's 1/n of one expert."""
    L = max(cfg.num_experts_per_device, 1)
    if cfg.type == "ffn":
        return FFNExperts(model_dim, cfg.hidden_size_per_expert, L, cfg.activation_fn, cfg.has_fc1_bias,
                          cfg.has_fc2_bias, cfg.output_dim, dtype, device, sharded_count)
    if cfg.type == "glu":
        return GLUExperts(model_dim, cfg.hidden_size_per_expert, L, cfg.glu_activation, cfg.glu_bias,
                          cfg.gpt_oss_alpha, cfg.gpt_oss_limit, cfg.output_dim, dtype, device, sharded_count)
    if cfg.type == "llama_ffn":
        return LlamaFFNExperts(model_dim, cfg.hidden_size_per_expert, L, cfg.activation_fn, dtype, device, sharded_count)
    module = cfg.module
    if isinstance(module, type):
        module = module(**_custom_expert_kwargs(module, dict(model_dim=model_dim, num_experts_per_device=L,
                                                             sharded_count=sharded_count, **cfg.module_kwargs)))
    if not isinstance(module, nn.Module) or not callable(getattr(module, "forward", None)):
        raise ValueError(f"custom experts 'module' must be an nn.Module (or a class building one) with forward(x_LCD, ctx), got {type(module).__name__}")
    return module.to(dtype=dtype, device=device) if (dtype is not None or device is not None) else module


def _custom_expert_kwargs(cls: type, kwargs: dict) -> dict:
    """Tutel's fallback for expert classes written for its older protocol: a constructor that takes
    ``local_experts`` (and neither ``num_experts_per_device`` nor ``**kwargs``) gets the local expert
    count under that name, with a deprecation warning."""
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):  # no inspectable signature: pass Tutel's current names
        return kwargs
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if "num_experts_per_device" in params or takes_any or "local_experts" not in params:
        return kwargs
    warnings.warn(f"{cls.__name__}.__init__(.., local_experts, ..) is Tutel's deprecated name: rename `local_experts` "
                  f"to `num_experts_per_device`", DeprecationWarning, stacklevel=4)
    kwargs = dict(kwargs)
    kwargs["local_experts"] = kwargs.pop("num_experts_per_device")
    return kwargs
