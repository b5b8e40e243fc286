"""Run-time switching is free: per-call, never sticky, no parameter allocation."""
import pytest
import torch

from dynamoe.moe import ExpertConfig, GateConfig, MoEConfig, MoELayer, moe_layer


def storage(layer):
    return {n: (p.data_ptr(), tuple(p.shape)) for n, p in layer.named_parameters()}


def fresh_like(layer, overlap=1, **gate_overrides):
    cfg = layer.config
    g = cfg.gates[0]
    new_gate = GateConfig(**{**{f: getattr(g, f) for f in ("type", "k", "capacity_factor", "fp32_gate")}, **gate_overrides})
    fresh = MoELayer(MoEConfig(model_dim=cfg.model_dim, gates=[new_gate], experts=cfg.experts, a2a_ffn_overlap_degree=overlap))
    fresh.load_state_dict(layer.state_dict())
    return fresh


@pytest.mark.parametrize("switch", [
    dict(top_k=1), dict(top_k=3), dict(capacity_factor=0.0), dict(capacity_factor=-1.0), dict(capacity_factor=0.5),
    dict(top_k=4, capacity_factor=0.0), dict(a2a_ffn_overlap_degree=3), dict(megablocks_size=0),
    dict(megablocks_size=1), dict(adaptive_r=0),
])
def test_switch_equals_fresh_layer_and_allocates_nothing(switch):
    layer = MoELayer(MoEConfig(model_dim=16, gates=[GateConfig(k=2, capacity_factor=1.0)],
                               experts=ExpertConfig(num_experts_per_device=4, hidden_size_per_expert=32)))
    x = torch.randn(40, 16)
    before = storage(layer)
    y_default = layer(x)
    y_switched = layer(x, **switch)
    assert storage(layer) == before
    # not sticky: the next plain call is the default again
    torch.testing.assert_close(layer(x), y_default)
    overrides = {}
    if "top_k" in switch:
        overrides["k"] = switch["top_k"]
    if "capacity_factor" in switch:
        overrides["capacity_factor"] = switch["capacity_factor"]
    fresh = fresh_like(layer, switch.get("a2a_ffn_overlap_degree", 1), **overrides)
    torch.testing.assert_close(y_switched, fresh(x), atol=1e-6, rtol=1e-6)
    stats = y_switched.routing_stats
    assert stats.top_k == switch.get("top_k", 2)
    if "megablocks_size" in switch:
        assert stats.layout == ("ragged" if switch["megablocks_size"] else "padded")
    if "a2a_ffn_overlap_degree" in switch:
        assert stats.capacity % switch["a2a_ffn_overlap_degree"] == 0


def test_capacity_factor_zero_per_call_overrides_gate_default():
    # Tutel computes `capacity_factor or gate_default`, so 0 silently falls back. Not here.
    layer = moe_layer(gate_type={"type": "top", "k": 1, "capacity_factor": 0.25}, model_dim=8,
                      experts={"type": "ffn", "num_experts_per_device": 2, "hidden_size_per_expert": 8})
    x = torch.randn(64, 8)
    assert layer(x).routing_stats.dropped > 0
    y = layer(x, capacity_factor=0)
    assert y.routing_stats.dropped == 0 and y.routing_stats.capacity_factor == 0.0


def test_switching_in_training_keeps_gradients_flowing():
    layer = MoELayer(MoEConfig(model_dim=8, experts=ExpertConfig(num_experts_per_device=4, hidden_size_per_expert=8)))
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    x = torch.randn(32, 8)
    for k, cf in [(1, 1.0), (2, 0.0), (4, -1.0), (2, 2.0)]:
        opt.zero_grad()
        y = layer(x, top_k=k, capacity_factor=cf)
        (y.square().mean() + 0.01 * y.l_aux).backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in layer.parameters())
        opt.step()
