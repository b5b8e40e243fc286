"""The Tutel-compatible surface: constructor dicts, names, state dicts, custom modules."""
import pytest
import torch
import torch.nn.functional as F

from dynamoe.moe import moe_layer

EXPERTS = {"type": "ffn", "num_experts_per_device": 4, "hidden_size_per_expert": 12, "activation_fn": lambda x: F.relu(x)}


def make(**kw):
    args = dict(gate_type={"type": "top", "k": 2}, model_dim=8, experts=dict(EXPERTS))
    args.update(kw)
    return moe_layer(**args)


def test_tutel_parameter_names_and_shapes():
    m = make()
    shapes = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    assert shapes == {
        "_num_global_experts": (), "gates.0.wg.weight": (4, 8),
        "experts.batched_fc1_w": (4, 12, 8), "experts.batched_fc2_w": (4, 12, 8),
        "experts.batched_fc1_bias": (4, 12), "experts.batched_fc2_bias": (4, 8),
    }


def test_state_dict_round_trip():
    a, b = make(seeds=(1, 2, 3)), make(seeds=(4, 5, 6))
    x = torch.randn(10, 8)
    assert not torch.allclose(a(x), b(x))
    b.load_state_dict(a.state_dict())
    torch.testing.assert_close(a(x), b(x))
    bigger = make(experts={**EXPERTS, "num_experts_per_device": 8})
    with pytest.raises(ValueError, match="experts"):
        bigger.load_state_dict(a.state_dict())


def test_seeds_make_construction_reproducible():
    a, b = make(seeds=(1, 2, 3)), make(seeds=(1, 2, 3))
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n


def test_no_bias_options_and_count_per_node_alias():
    m = make(experts={"type": "ffn", "count_per_node": 2, "hidden_size_per_expert": 4, "has_fc1_bias": False, "has_fc2_bias": False})
    assert m.num_global_experts == 2
    assert m.experts.batched_fc1_bias is None and m.experts.batched_fc2_bias is None
    assert m(torch.randn(3, 8)).shape == (3, 8)


def test_scan_expert_func_and_parameter_iterators():
    seen = []
    m = make(scan_expert_func=lambda name, p: (seen.append(name), setattr(p, "skip_allreduce", True)))
    assert sorted(seen) == sorted(n for n, _ in m.experts.named_parameters())
    assert all(getattr(p, "skip_allreduce", False) for _, p in m.get_parameter_iterator("local_experts"))
    assert [n for n, _ in m.get_parameter_iterator("gate")] == ["0.wg.weight"]
    assert moe_layer.global_expert_count(4) == 4


def test_fp32_gate_does_not_mutate_parameters():
    m = make(gate_type={"type": "top", "k": 2, "fp32_gate": True}).to(torch.bfloat16)
    assert m.gates[0].wg.weight.dtype == torch.bfloat16
    x = torch.randn(6, 8, dtype=torch.bfloat16)
    y = m(x)
    assert y.dtype == torch.bfloat16 and m.gates[0].wg.weight.dtype == torch.bfloat16
    logits = m.gates[0](x)
    assert logits.dtype == torch.float32


def test_deprecated_spellings():
    with pytest.warns(DeprecationWarning):
        m = make(gate_type="Top1Gate")
    assert m.top_k == 1
    m = make(fp32_gate=True)
    assert m.config.gates[0].fp32_gate


def test_multiple_gates_and_gate_index():
    m = make(gate_type=[{"type": "top", "k": 1}, {"type": "cosine_top", "k": 2, "proj_dim": 4}])
    x = torch.randn(5, 8)
    assert m(x, gate_index=0).routing_stats.top_k == 1
    assert m(x, gate_index=1).routing_stats.top_k == 2


class CustomGate(torch.nn.Module):
    def __init__(self, model_dim, num_global_experts, top_k, scale=1.0):
        super().__init__()
        self.my_wg = torch.nn.Linear(model_dim, num_global_experts, bias=False)
        self.scale = scale

    def forward(self, x):
        return self.my_wg(x) * self.scale


class CustomExpert(torch.nn.Module):
    def __init__(self, model_dim, num_experts_per_device, sharded_count, my_activ_type):
        super().__init__()
        self.W = torch.nn.Parameter(torch.randn(num_experts_per_device, model_dim, model_dim) * 0.1)
        self.act = torch.relu if my_activ_type == "relu" else (lambda v: v)

    def forward(self, x, ctx):
        assert ctx.sharded_count == 1
        return self.act(torch.matmul(x, self.W))


def test_custom_gate_and_expert_classes_get_their_options():
    m = moe_layer(gate_type={"type": "custom", "module": CustomGate, "top_k": 2, "scale": 2.0, "capacity_factor": 0}, model_dim=8,
                  experts={"type": "custom", "module": CustomExpert, "num_experts_per_device": 3, "my_activ_type": "relu"})
    assert m.gates[0].scale == 2.0 and m.top_k == 2
    x = torch.randn(9, 8, requires_grad=True)
    y = m(x)  # no forward_ragged: runs the padded layout
    assert y.routing_stats.layout == "padded"
    with pytest.raises(ValueError, match="forward_ragged"):
        m(x, layout="ragged")
    # against a direct computation
    logits = m.gates[0](x)
    w, ids = torch.softmax(logits, -1).topk(2)
    w = w / w.sum(-1, keepdim=True)
    want = torch.stack([sum(w[t, j] * torch.relu(x[t] @ m.experts.W[ids[t, j]]) for j in range(2)) for t in range(9)])
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)
    y.sum().backward()
    assert m.experts.W.grad is not None and m.gates[0].my_wg.weight.grad is not None


def test_custom_module_instances_and_ragged_protocol():
    class RaggedExpert(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.arange(1.0, 4.0))

        def forward(self, x, ctx):
            return x * self.scale.view(-1, 1, 1)

        def forward_ragged(self, x, counts):
            return x * torch.repeat_interleave(self.scale, torch.tensor(counts)).unsqueeze(1)

    m = moe_layer(gate_type={"type": "top", "k": 1}, model_dim=4,
                  experts={"type": "custom", "module": RaggedExpert(), "num_experts_per_device": 3})
    x = torch.randn(12, 4)
    torch.testing.assert_close(m(x, layout="ragged"), m(x, layout="padded"))
    assert m(x, capacity_factor=0).routing_stats.layout == "ragged"


def test_deepcopy_and_pickle_after_a_forward():
    import copy
    import pickle

    m = make(experts={**EXPERTS, "activation_fn": "relu"})  # a lambda could not be pickled (Python)
    x = torch.randn(6, 8)
    y = m(x)
    y.sum().backward()
    for clone in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        torch.testing.assert_close(clone(x), m(x))
        assert clone.l_aux is not None  # set again by its own forward


def test_gate_attributes_switch_routing_without_changing_a_shared_config():
    """Tutel's ``gates[i].top_k`` / ``capacity_factor`` / ``gate_noise`` assignments switch that layer's
    routing; the GateConfig the caller built (here shared by two layers) never changes."""
    import dataclasses

    from dynamoe.moe import ExpertConfig, GateConfig, MoEConfig, MoELayer

    gate = GateConfig(type="top", k=2, capacity_factor=0.0)
    cfg = MoEConfig(model_dim=8, gates=[gate], experts=ExpertConfig(type="ffn", num_experts_per_device=4,
                                                                   hidden_size_per_expert=12))
    a, b = MoELayer(cfg), MoELayer(cfg)
    x = torch.randn(6, 8)
    a.gates[0].top_k = 1
    a.gates[0].capacity_factor = 1.5
    assert a(x).routing_stats.top_k == 1 and a.top_k == 1 and a.config.gates[0].capacity_factor == 1.5
    assert b(x).routing_stats.top_k == 2 and b.config.gates[0] is gate
    assert gate.k == 2 and gate.capacity_factor == 0.0 and cfg.gates == (gate,)
    with pytest.raises(dataclasses.FrozenInstanceError):
        gate.k = 1
    with pytest.raises(ValueError, match="top_k must be an int >= 1"):
        a.gates[0].top_k = 0
    a.config = dataclasses.replace(a.config, gates=(dataclasses.replace(a.config.gates[0], k=3),))
    assert a.gates[0].top_k == 3 and a(x).routing_stats.top_k == 3
    with pytest.raises(ValueError, match="config has 2 gates; this layer was built with 1"):
        a.config = dataclasses.replace(a.config, gates=(gate, gate))
