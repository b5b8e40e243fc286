"""Behaviour pinned after review: Tutel's loss inputs, gate noise, scratch safety, zero capacity,
bias precision, capacity alignment, per-gate bias updates, custom-gate top_k, legacy checkpoints."""

import pytest
import torch

from dynamoe.moe import ExpertConfig, GateConfig, MoEConfig, MoELayer, moe_layer
from dynamoe.moe.gates import route


def layer(E=4, gate=None, experts=None, **kw):
    return MoELayer(MoEConfig(model_dim=8, gates=[gate or GateConfig(k=2)],
                              experts=experts or ExpertConfig(num_experts_per_device=E, hidden_size_per_expert=8), **kw))


def test_load_importance_loss_matches_tutels_formula():
    torch.manual_seed(0)
    m = layer(gate=GateConfig(k=2, gate_noise=1.0), aux_loss="load_importance").train()
    x = torch.randn(32, 8)
    torch.manual_seed(5)
    y = m(x)
    # Tutel: noise * randn / E on the logits; loss on softmax(clean logits) and the noisy top-k logits
    logits = m.gates[0](x).float()
    torch.manual_seed(5)
    noisy = logits + 1.0 * torch.randn_like(logits) / 4
    ids = torch.softmax(noisy, -1).topk(2).indices
    clean = torch.softmax(logits, -1)
    normal = torch.distributions.Normal(torch.tensor([0.0]), torch.tensor([1.0 / 4]))
    threshold = noisy.gather(1, ids)[:, -1].view(-1, 1)
    load = normal.cdf(clean - threshold).sum(0)
    imp = clean.sum(0)
    want = (imp.var() / (imp.mean() ** 2 + 1e-10) + load.var() / (load.mean() ** 2 + 1e-10)) / 2
    assert float(y.l_aux.detach()) == pytest.approx(float(want.detach()), rel=1e-5)


def test_gate_noise_is_training_only_and_scaled_by_experts():
    m = layer(E=4, gate=GateConfig(k=1, gate_noise=2.0))
    x = torch.randn(16, 8)
    g = m.gates[0]
    m.eval()
    r = route(g, m.config.gates[0], x, 4, 1, True, training=False, need_scores=True)
    assert r.noisy_logits_TE is r.logits_TE
    torch.manual_seed(3)
    r = route(g, m.config.gates[0], x, 4, 1, True, training=True, need_scores=True)
    torch.manual_seed(3)
    want = r.logits_TE + 2.0 * torch.randn_like(r.logits_TE) / 4
    torch.testing.assert_close(r.noisy_logits_TE, want)
    torch.testing.assert_close(r.scores_TE, torch.softmax(want, -1))


def test_scratch_after_inference_mode_then_no_grad():
    from dynamoe.ops import release_scratch
    release_scratch()
    m = layer()
    x = torch.randn(20, 8)
    with torch.inference_mode():
        a = m(x)
    with torch.no_grad():
        b = m(x)
    torch.testing.assert_close(a, b)


def test_frozen_experts_trainable_router_two_forwards_before_backward():
    for experts in ("ffn", "glu"):
        m = layer(experts=ExpertConfig(type=experts, num_experts_per_device=4, hidden_size_per_expert=8), gate=GateConfig(k=2, capacity_factor=0))
        for p in m.experts.parameters():
            p.requires_grad_(False)
        x1, x2 = torch.randn(16, 8), torch.randn(16, 8)
        y1, y2 = m(x1), m(x2)
        (y1.sum() + y2.sum()).backward()  # nothing saved for backward was overwritten
        assert m.gates[0].wg.weight.grad is not None


def test_output_dim_differs_from_model_dim_at_inference():
    m = layer(experts=ExpertConfig(num_experts_per_device=4, hidden_size_per_expert=8, output_dim=5), gate=GateConfig(k=2, capacity_factor=0))
    x = torch.randn(12, 8)
    with torch.no_grad():
        a = m(x)
    torch.testing.assert_close(a, m(x))
    assert a.shape == (12, 5)


@pytest.mark.parametrize("layout", ["ragged", "padded"])
def test_all_assignments_dropped_still_backprops(layout):
    m = layer(E=8, gate=GateConfig(k=1, capacity_factor=0.1))
    x = torch.randn(4, 8, requires_grad=True)
    y = m(x, layout=layout)
    assert y.routing_stats.capacity == 0 and y.routing_stats.dropped == 4
    assert torch.equal(y, torch.zeros_like(y))
    y.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x))


def test_selection_bias_stays_fp32_under_low_precision_casts():
    m = layer(gate=GateConfig(type="sigmoid", k=1)).to(torch.bfloat16)
    b = m.gates[0].e_score_correction_bias
    assert b.dtype == torch.float32 and m.gates[0].wg.weight.dtype == torch.bfloat16
    with torch.no_grad():
        b.fill_(0.5)
    m._load_since_update[0] = torch.tensor([10, 0, 0, 0])
    m.update_routing_bias(1e-3)
    torch.testing.assert_close(b, torch.tensor([0.499, 0.501, 0.501, 0.501]))
    m.double()
    assert m.gates[0].e_score_correction_bias.dtype == torch.float32


@pytest.mark.parametrize("cf,overlap,mega,want", [
    (0.3, 1, None, 6), (0.3, 4, None, 8), (0.3, 1, 4, 8), (0.3, 3, 4, 8), (0.0, 4, None, None),
])
def test_capacity_alignment_follows_tutel(cf, overlap, mega, want):
    m = layer(E=4, gate=GateConfig(k=2, capacity_factor=cf))
    x = torch.randn(40, 8)  # ceil(40/4) = 10: C = 2 * int(0.3 * 10) = 6 before alignment
    y = m(x, a2a_ffn_overlap_degree=overlap, megablocks_size=mega)
    C = y.routing_stats.capacity
    if want is None:  # dropless: the max load, rounded up to the overlap chunks
        assert C % overlap == 0 and C - max(y.routing_stats.load.tolist()) < overlap
    else:
        assert C == want
    assert y.routing_stats.layout == ("ragged" if mega else y.routing_stats.layout)


def test_bias_update_uses_each_gates_own_load():
    m = MoELayer(MoEConfig(model_dim=8, aux_loss="none",
                           gates=[GateConfig(type="sigmoid", k=1), GateConfig(type="sigmoid", k=1)],
                           experts=ExpertConfig(num_experts_per_device=4, hidden_size_per_expert=8))).train()
    with torch.no_grad():
        m.gates[0].wg.weight.zero_()
        m.gates[0].wg.weight[0] += 1.0
        m.gates[1].wg.weight.zero_()
        m.gates[1].wg.weight[3] += 1.0
    m(torch.rand(8, 8), gate_index=0)
    m(torch.rand(8, 8), gate_index=1)
    m.update_routing_bias(0.1)
    assert m.gates[0].e_score_correction_bias.argmin() == 0
    assert m.gates[1].e_score_correction_bias.argmin() == 3


def test_custom_gate_top_k_and_seeds_per_gate():
    class G(torch.nn.Module):
        def __init__(self, model_dim, num_global_experts):
            super().__init__()
            self.top_k = 3
            self.wg = torch.nn.Linear(model_dim, num_global_experts, bias=False)

        def forward(self, x):
            return self.wg(x)

    m = moe_layer(gate_type={"type": "custom", "module": G}, model_dim=8,
                  experts={"type": "ffn", "num_experts_per_device": 4, "hidden_size_per_expert": 8})
    assert m(torch.randn(5, 8)).routing_stats.top_k == 3
    two = moe_layer(gate_type=[{"type": "top", "k": 1}, {"type": "top", "k": 1}], model_dim=8, seeds=(7, 1, 1),
                    experts={"type": "ffn", "num_experts_per_device": 4, "hidden_size_per_expert": 8})
    torch.manual_seed(8)
    want = torch.nn.Linear(8, 4, bias=False).weight
    torch.testing.assert_close(two.gates[1].wg.weight, want)  # gate i is seeded with seeds[0] + i


def test_legacy_tutel_checkpoint_without_expert_count_loads():
    a, b = layer(), layer()
    sd = a.state_dict()
    del sd["_num_global_experts"]
    b.load_state_dict(sd)
    x = torch.randn(6, 8)
    torch.testing.assert_close(a(x), b(x))


def test_cosine_router_formula():
    m = layer(gate=GateConfig(type="cosine_top", k=2, proj_dim=6, init_t=0.25))
    g = m.gates[0]
    x = torch.randn(5, 8)
    proj = x @ g.cosine_projector.weight.t() + g.cosine_projector.bias
    cos = torch.stack([torch.stack([torch.dot(p, s) / (p.norm() * s.norm()) for s in g.sim_matrix.t()]) for p in proj])
    torch.testing.assert_close(g(x), cos / 0.25, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("make,match", [
    (lambda: GateConfig(type="cosine_top", init_t=0), "init_t"),
    (lambda: GateConfig(type="cosine_top", init_t=-1.0), "init_t"),
    (lambda: GateConfig(fp32_gate="false"), "fp32_gate"),
    (lambda: GateConfig(capacity_factor=1e30), "capacity_factor"),
    (lambda: GateConfig(type="cosine_top", n_group=2), "sigmoid"),
    (lambda: GateConfig(route_scale=0), "route_scale"),
    (lambda: GateConfig(module_kwargs=5), "module_kwargs"),
    (lambda: ExpertConfig(hidden_size_per_expert=4, shared_hidden_size=-3), "shared_hidden_size"),
    (lambda: ExpertConfig(type="glu", hidden_size_per_expert=4, activation_fn="relu"), "glu_activation"),
    (lambda: ExpertConfig(hidden_size_per_expert=4, glu_activation="silu"), "glu_activation"),
    (lambda: ExpertConfig(type="glu", hidden_size_per_expert=4, gpt_oss_limit=-1.0), "gpt_oss_limit"),
    (lambda: ExpertConfig(hidden_size_per_expert=4, has_fc1_bias="yes"), "has_fc1_bias"),
    (lambda: MoEConfig(model_dim=8, is_postscore="no", experts=ExpertConfig(hidden_size_per_expert=4)), "is_postscore"),
    (lambda: MoEConfig(model_dim=8, dtype="float32", experts=ExpertConfig(hidden_size_per_expert=4)), "dtype"),
    (lambda: MoEConfig(model_dim=8, a2a_ffn_overlap_degree=10**12, experts=ExpertConfig(hidden_size_per_expert=4)), "a2a_ffn_overlap_degree"),
    (lambda: MoELayer(MoEConfig(model_dim=8, gates=[GateConfig(type="sigmoid", k=3, n_group=4, topk_group=1)],
                                experts=ExpertConfig(num_experts_per_device=8, hidden_size_per_expert=4))), "topk_group"),
    (lambda: MoELayer(MoEConfig(model_dim=8, experts=ExpertConfig(num_experts_per_device=2, hidden_size_per_expert=4)), seeds=3), "seeds"),
    (lambda: moe_layer(gate_type=[5], model_dim=8, experts={"type": "ffn", "num_experts_per_device": 2, "hidden_size_per_expert": 4}), "gate_type"),
    (lambda: layer()(torch.randn(3, 8), adaptive_r=1.0), "adaptive_r"),
    (lambda: layer()(torch.randn(3, 8), gate_index=False), "gate_index"),
    (lambda: layer()(torch.randn(3, 8), capacity_factor=1e30), "capacity_factor"),
])
def test_more_bad_values(make, match):
    with pytest.raises(ValueError, match=match):
        make()
