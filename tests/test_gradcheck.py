"""Analytic gradients of the whole layer (both layouts) and of grouped_mm, in float64."""
import pytest
import torch
from torch.func import functional_call

from dynamoe.moe import ExpertConfig, GateConfig, MoEConfig, MoELayer
from dynamoe.ops import grouped_mm


@pytest.mark.parametrize("layout", ["ragged", "padded"])
@pytest.mark.parametrize("experts,gate,cf", [("ffn", "top", 0.0), ("glu", "sigmoid", 0.0), ("ffn", "top", 0.6)])
def test_layer_gradcheck(layout, experts, gate, cf):
    m = MoELayer(MoEConfig(model_dim=6, gates=[GateConfig(type=gate, k=2, capacity_factor=cf)],
                           experts=ExpertConfig(type=experts, num_experts_per_device=3, hidden_size_per_expert=5,
                                                num_shared_experts=1,
                                                **({"activation_fn": "gelu"} if experts == "ffn" else {"glu_activation": "gelu"})))).double()
    names = [n for n, _ in m.named_parameters()]
    values = [p.detach().clone().requires_grad_() for _, p in m.named_parameters()]
    x = torch.randn(7, 6, dtype=torch.float64, requires_grad=True)

    def f(x, *ps):
        return functional_call(m, dict(zip(names, ps)), (x,), {"layout": layout})

    # x, the gate (through the routing weights), routed and shared expert weights and biases
    assert torch.autograd.gradcheck(f, (x, *values), eps=1e-6, atol=1e-6)


def test_grouped_mm_gradcheck():
    counts = [2, 0, 3]
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 4, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, b: grouped_mm(x, w, counts, b), (x, w, b))
    wt = torch.randn(3, 3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, b: grouped_mm(x, w, counts, b, trans_w=True), (x, wt, b))
