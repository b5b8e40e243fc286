"""Expert activations shared by the dense and the quantized experts."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["ACTIVATIONS", "activation", "glu_activation", "GLU_KINDS", "relu_squared"]


def relu_squared(x: Tensor) -> Tensor:
    """relu(x)^2 (Primer's squared ReLU: Nemotron-H's MLPs and experts)."""
    return F.relu(x).square()


ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu,
                                                      "relu2": relu_squared}
GLU_KINDS = ("silu", "gelu", "gelu_tanh", "relu", "gpt_oss", "silu_clamp", "silu_clamp_in", "silu_softcap")


def activation(fn) -> Callable[[Tensor], Tensor]:
    """A callable for ``fn``: None -> ReLU, a name in ACTIVATIONS, or the callable itself."""
    if fn is None:
        return F.relu
    return ACTIVATIONS[fn] if isinstance(fn, str) else fn


def glu_activation(gate: Tensor, up: Tensor, kind: str, alpha: float = 1.702, limit: float = 7.0) -> Tensor:
    """act(gate) * up (SwiGLU, GeGLU, ReGLU). ``gpt_oss``: clamp gate above at ``limit`` and up to
    +-limit, then (up + 1) * gate * sigmoid(alpha * gate). ``silu_clamp`` (Step-3.5): silu(gate) clamped
    above at ``limit`` times up clamped to +-limit (the clamp after the activation, unlike GPT-OSS's).
    ``silu_clamp_in`` (DeepSeek-V4): silu(gate clamped above at ``limit``) times up clamped to +-limit (the clamp
    before the activation, as GPT-OSS's). ``silu_softcap`` (Inkling-2): softcap(gate, alpha) * sigmoid(gate) *
    softcap(up, limit) in fp32, softcap(x, c) = c tanh(x / c) -- the sigmoid sees the raw gate, the caps bound its
    linear factor and up."""
    if kind == "silu":
        return F.silu(gate) * up
    if kind == "gelu":
        return F.gelu(gate) * up
    if kind == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    if kind == "relu":  # ReGLU
        return F.relu(gate) * up
    if kind == "gpt_oss":
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    if kind == "silu_clamp":
        return F.silu(gate).clamp(max=limit) * up.clamp(min=-limit, max=limit)
    if kind == "silu_clamp_in":
        return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
    if kind == "silu_softcap":
        g, u = gate.float(), up.float()
        out = torch.tanh(g / alpha) * alpha * torch.sigmoid(g) * (torch.tanh(u / limit) * limit)
        return out.to(gate.dtype)
    raise ValueError(f"glu activation must be one of {list(GLU_KINDS)}, got {kind!r}")
