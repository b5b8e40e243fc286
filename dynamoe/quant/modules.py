"""Modules holding packed weights: ``QuantizedLinear`` and ``QuantizedExperts`` (a drop-in for the
MoE layer's FFN/GLU experts, padded and ragged layouts). The packed tensors are buffers named after
the format's on-disk tensors (``weight``/``weight_scale_inv``, ``*_blocks``/``*_scales``,
``weight``/``weight_scale``/``weight_scale_2``), so ``state_dict`` / ``load_state_dict`` and ``.to()``
work as usual; the :class:`QuantizedWeight` view is rebuilt from the buffers on use.

Legend: L local experts, C capacity, N rows, D model dim, F expert hidden dim, O output dim.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import torch
from torch import Tensor, nn

from ..ops.activations import activation, glu_activation
from ..ops.scratch import scratch
from . import FORMATS, quantize
from .base import QuantizedWeight
from .act_quant import act_quant_of
from .matmul import quantized_grouped_mm, quantized_linear

__all__ = ["QuantizedLinear", "QuantizedExperts", "quantize_experts_", "quantize_linears_"]


class _PackedWeights(nn.Module):
    """Registers a QuantizedWeight's tensors as buffers under ``prefix + field`` names."""

    def _register_packed(self, prefix: str, w: QuantizedWeight) -> None:
        names = w._tensor_fields()
        # the class and the non-tensor fields (shape, block size, ...): no references to the tensors,
        # which live on as buffers (and move with .to())
        static = {f.name: getattr(w, f.name) for f in dataclasses.fields(w) if f.name not in names}
        self._packed = getattr(self, "_packed", {})
        self._packed[prefix] = (type(w), static, names)
        for n in names:
            self.register_buffer(prefix + n, getattr(w, n))

    def _packed_weight(self, prefix: str) -> QuantizedWeight:
        cls, static, names = self._packed[prefix]
        return cls(**static, **{n: getattr(self, prefix + n) for n in names})


class QuantizedLinear(_PackedWeights):
    """``nn.Linear`` whose weight [O, I] stays packed; the bias stays dense."""

    def __init__(self, weight: QuantizedWeight, bias: Tensor | None = None, act_quant: str | None = None):
        super().__init__()
        if weight.num_leading != 0:
            raise ValueError(f"QuantizedLinear takes a single [out, in] weight, got {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        self.format, self.act_quant = weight.format, act_quant_of(act_quant)
        self._register_packed("", weight)
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False) if bias is not None else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, format: str, act_quant: str | None = None, **options) -> "QuantizedLinear":
        return cls(quantize(linear.weight.detach(), format, **options), linear.bias, act_quant)

    @property
    def qweight(self) -> QuantizedWeight:
        return self._packed_weight("")

    def forward(self, x: Tensor) -> Tensor:
        return quantized_linear(x, self.qweight, self.bias, self.act_quant)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}, act_quant={self.act_quant}"


class QuantizedExperts(_PackedWeights):
    """Routed experts with packed weights, following the MoE layer's experts protocol
    (``forward(x_LCD, ctx)``, ``forward_ragged(x_ND, counts, row_scale=, out=)``). Both weights use
    the Linear layout: ``w1`` [L, F1, D] (F1 = F, or 2F gate-then-up rows for GLU), ``w2`` [L, O, F].
    Each expert's weight is dequantized when its rows are multiplied, then dropped."""

    fuses_row_scale = True

    def __init__(self, w1: QuantizedWeight, w2: QuantizedWeight, kind: str, b1: Tensor | None = None,
                 b2: Tensor | None = None, activation_fn=None, glu_kind: str = "silu", alpha: float = 1.702,
                 limit: float = 7.0, act_quant: str | None = None, names: tuple[str, str] = ("w1_", "w2_")):
        super().__init__()
        if kind not in ("ffn", "glu"):
            raise ValueError(f"kind must be 'ffn' or 'glu', got {kind!r}")
        act_quant = act_quant_of(act_quant)
        if w1.num_leading != 1 or w2.num_leading != 1 or w1.shape[0] != w2.shape[0]:
            raise ValueError(f"w1 and w2 must be [L, out, in] with the same L, got {tuple(w1.shape)} and {tuple(w2.shape)}")
        L, F1, D = w1.shape
        F_ = F1 // 2 if kind == "glu" else F1
        if w2.shape[2] != F_:
            raise ValueError(f"w2 {tuple(w2.shape)} must take the {F_} hidden features w1 {tuple(w1.shape)} makes")
        self.kind, self.format, self.act_quant = kind, w1.format, act_quant
        self.num_local_experts, self.model_dim, self.hidden_size, self.output_dim = L, D, F_, w2.shape[1]
        self.activation_fn = activation(activation_fn)
        self.glu_kind, self.alpha, self.limit = glu_kind, alpha, limit
        self._names = names
        self._register_packed(names[0], w1)
        self._register_packed(names[1], w2)
        self.b1 = nn.Parameter(b1.detach().clone(), requires_grad=False) if b1 is not None else None
        self.b2 = nn.Parameter(b2.detach().clone(), requires_grad=False) if b2 is not None else None

    @classmethod
    def from_experts(cls, experts: nn.Module, format: str, act_quant: str | None = None, **options) -> "QuantizedExperts":
        """Quantize a built FFN experts module (Tutel's ``batched_fc1_w`` [L, F, D], ``batched_fc2_w``
        [L, F, O]) or GLU experts module (``gate_up_proj`` [L, 2F, D], ``down_proj`` [L, O, F])."""
        if format not in FORMATS:
            raise ValueError(f"format must be one of {list(FORMATS)}, got {format!r}")
        if hasattr(experts, "batched_fc1_w"):
            w1 = quantize(experts.batched_fc1_w.detach(), format, **options)
            w2 = quantize(experts.batched_fc2_w.detach().transpose(1, 2).contiguous(), format, **options)
            return cls(w1, w2, "ffn", experts.batched_fc1_bias, experts.batched_fc2_bias, experts.activation_fn,
                       act_quant=act_quant, names=("fc1_", "fc2_"))
        if hasattr(experts, "gate_up_proj"):
            w1 = quantize(experts.gate_up_proj.detach(), format, **options)
            w2 = quantize(experts.down_proj.detach(), format, **options)
            return cls(w1, w2, "glu", experts.gate_up_proj_bias, experts.down_proj_bias, glu_kind=experts.activation,
                       alpha=experts.alpha, limit=experts.limit, act_quant=act_quant, names=("gate_up_proj_", "down_proj_"))
        raise ValueError(f"don't know how to quantize {type(experts).__name__}: expected FFN or GLU experts")

    @property
    def w1(self) -> QuantizedWeight:
        return self._packed_weight(self._names[0])

    @property
    def w2(self) -> QuantizedWeight:
        return self._packed_weight(self._names[1])

    def _act(self, h: Tensor) -> Tensor:
        if self.kind == "glu":
            gate, up = h.split(self.hidden_size, dim=-1)
            return glu_activation(gate, up, self.glu_kind, self.alpha, self.limit)
        return self.activation_fn(h)

    def forward_ragged(self, x_ND: Tensor, counts: Sequence[int], row_scale: Tensor | None = None,
                       out: Tensor | None = None) -> Tensor:
        inference = not torch.is_grad_enabled() and x_ND.device.type == "cpu"
        h_out = scratch("qmoe_hidden", x_ND.size(0), self.w1.shape[1], x_ND.dtype, x_ND.device) if inference else None
        h = quantized_grouped_mm(x_ND, self.w1, counts, self.b1, out=h_out, act_quant=self.act_quant)
        h = self._act(h)
        return quantized_grouped_mm(h, self.w2, counts, self.b2, row_scale=row_scale, out=out, act_quant=self.act_quant)

    def forward(self, x_LCD: Tensor, ctx=None) -> Tensor:
        L, C, D = x_LCD.shape
        y = self.forward_ragged(x_LCD.reshape(L * C, D), [C] * L)
        return y.view(L, C, -1)

    def extra_repr(self) -> str:
        return (f"kind={self.kind}, format={self.format}, local_experts={self.num_local_experts}, model_dim={self.model_dim}, "
                f"hidden_size={self.hidden_size}, act_quant={self.act_quant}")


def quantize_experts_(model: nn.Module, format: str, act_quant: str | None = None, **options) -> int:
    """Replace, in place, every FFN/GLU experts module found as an ``experts`` child (the MoE layer's)
    with a QuantizedExperts. Returns how many were replaced."""
    n = 0
    for module in list(model.modules()):
        experts = module._modules.get("experts")
        if experts is not None and (hasattr(experts, "batched_fc1_w") or hasattr(experts, "gate_up_proj")):
            module.experts = QuantizedExperts.from_experts(experts, format, act_quant, **options)
            n += 1
    return n


def quantize_linears_(model: nn.Module, format: str, exclude: Callable[[str], bool] | None = None,
                      act_quant: str | None = None, **options) -> int:
    """Replace, in place, every ``nn.Linear`` whose qualified name is not excluded with a
    QuantizedLinear (routers and heads usually stay dense: exclude them). Returns the count."""
    n = 0
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if isinstance(child, nn.Linear) and not (exclude and exclude(full)):
                setattr(module, child_name, QuantizedLinear.from_linear(child, format, act_quant, **options))
                n += 1
    return n
