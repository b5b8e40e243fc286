"""Balance losses against hand-written formulas; the aux-loss-free bias update."""
import math

import pytest
import torch

from dynamoe.moe import (ExpertConfig, GateConfig, MoEConfig, MoELayer, deepseek_device_loss, deepseek_expert_loss,
                         gshard_loss, load_importance_loss, router_z_loss, switch_loss, update_selection_bias)


def loops_fraction(ids, E, first_only):
    T, K = ids.shape
    counts = [0] * E
    for t in range(T):
        for j in range(1 if first_only else K):
            counts[int(ids[t, j])] += 1
    return counts


def test_gshard_and_switch_losses():
    T, E, K = 50, 6, 2
    probs = torch.softmax(torch.randn(T, E), -1)
    ids = probs.topk(K).indices
    me = [sum(float(probs[t, e]) for t in range(T)) / T for e in range(E)]
    first = loops_fraction(ids, E, True)
    every = loops_fraction(ids, E, False)
    assert float(gshard_loss(probs, ids)) == pytest.approx(E * sum(me[e] * first[e] / T for e in range(E)), rel=1e-5)
    assert float(switch_loss(probs, ids)) == pytest.approx(E * sum(me[e] * every[e] / T for e in range(E)), rel=1e-5)


def test_balanced_router_gives_one():
    E = 4
    probs = torch.full((8, E), 1.0 / E)
    ids = torch.arange(8).remainder(E).unsqueeze(1)
    assert float(gshard_loss(probs, ids)) == pytest.approx(1.0)
    assert float(deepseek_expert_loss(probs, ids)) == pytest.approx(1.0)
    assert float(deepseek_device_loss(probs, ids, 2)) == pytest.approx(1.0)


def test_deepseek_losses_formula():
    T, E, K, D = 40, 8, 2, 4
    scores = torch.sigmoid(torch.randn(T, E))
    ids = scores.topk(K).indices
    norm = scores / scores.sum(-1, keepdim=True)
    P = norm.mean(0).tolist()
    counts = loops_fraction(ids, E, False)
    f = [E / (K * T) * c for c in counts]
    assert float(deepseek_expert_loss(scores, ids)) == pytest.approx(sum(a * b for a, b in zip(f, P)), rel=1e-5)
    g = E // D
    dev = sum((sum(f[d * g:(d + 1) * g]) / g) * sum(P[d * g:(d + 1) * g]) for d in range(D))
    assert float(deepseek_device_loss(scores, ids, D)) == pytest.approx(dev, rel=1e-5)
    with pytest.raises(ValueError, match="num_devices"):
        deepseek_device_loss(scores, ids, 3)


def test_z_loss_and_load_importance():
    logits = torch.randn(10, 5)
    want = sum(math.log(sum(math.exp(float(v)) for v in row)) ** 2 for row in logits) / 10
    assert float(router_z_loss(logits)) == pytest.approx(want, rel=1e-5)
    probs = torch.softmax(logits, -1)
    ids = logits.topk(2).indices
    assert torch.isfinite(load_importance_loss(probs, logits, ids, gate_noise=1.0))
    with pytest.raises(ValueError, match="gate_noise"):
        load_importance_loss(probs, logits, ids, gate_noise=0.0)


@pytest.mark.parametrize("aux_loss,key", [("gshard", "gshard"), ("switch", "switch"), ("deepseek", "deepseek_expert")])
def test_layer_reports_losses(aux_loss, key):
    m = MoELayer(MoEConfig(model_dim=8, aux_loss=aux_loss, z_loss_coef=0.1, gates=[GateConfig(k=2)],
                           experts=ExpertConfig(num_experts_per_device=4, hidden_size_per_expert=8)))
    x = torch.randn(16, 8)
    y = m(x)
    terms = y.routing_stats.losses
    assert set(terms) == {key, "z_loss"}
    torch.testing.assert_close(y.l_aux, terms[key] + 0.1 * terms["z_loss"])
    y.l_aux.backward()
    assert m.gates[0].wg.weight.grad.abs().sum() > 0
    assert m.l_aux is y.l_aux


def test_result_func_and_tutel_load_importance():
    from dynamoe.moe import moe_layer
    m = moe_layer(gate_type={"type": "top", "k": 2, "gate_noise": 1.0}, model_dim=8, is_gshard_loss=False,
                  experts={"type": "ffn", "num_experts_per_device": 4, "hidden_size_per_expert": 8},
                  result_func=lambda y: (y, y.l_aux))
    y, l_aux = m(torch.randn(16, 8))
    assert "load_importance" in y.routing_stats.losses and torch.isfinite(l_aux)


def test_aux_loss_free_bias_update():
    bias = torch.zeros(4)
    update_selection_bias(bias, torch.tensor([10, 0, 5, 5]), rate=0.1)
    torch.testing.assert_close(bias, torch.tensor([-0.1, 0.1, 0.0, 0.0]))
    m = MoELayer(MoEConfig(model_dim=8, gates=[GateConfig(type="sigmoid", k=1)], aux_loss="none",
                           experts=ExpertConfig(num_experts_per_device=4, hidden_size_per_expert=8)))
    with torch.no_grad():
        m.gates[0].wg.weight.normal_(0, 0.3)
        m.gates[0].wg.weight[0] += 1.0  # expert 0 wins everything at first
    x = torch.rand(32, 8)
    m.train()
    load0 = m(x).routing_stats.load.tolist()
    assert load0[0] == 32
    m.update_routing_bias(rate=0.5)
    b = m.gates[0].e_score_correction_bias
    assert b[0] < 0 and (b[1:] > 0).all()
    assert m._load_since_update.sum() == 0
    for _ in range(40):  # repeated updates spread the load
        m(x)
        m.update_routing_bias(rate=0.05)
    assert max(m(x).routing_stats.load.tolist()) <= 16


def test_layer_device_level_loss():
    m = MoELayer(MoEConfig(model_dim=8, aux_loss="deepseek", device_loss_groups=2, device_loss_coef=0.5,
                           gates=[GateConfig(type="sigmoid", k=2)],
                           experts=ExpertConfig(num_experts_per_device=4, hidden_size_per_expert=8)))
    y = m(torch.randn(16, 8))
    t = y.routing_stats.losses
    assert set(t) == {"deepseek_expert", "deepseek_device"}
    torch.testing.assert_close(y.l_aux, t["deepseek_expert"] + 0.5 * t["deepseek_device"])
    with pytest.raises(ValueError, match="device_loss_groups"):
        MoELayer(MoEConfig(model_dim=8, device_loss_groups=3, experts=ExpertConfig(num_experts_per_device=4, hidden_size_per_expert=8)))
