"""Bad input gets a ValueError naming the argument and what is allowed."""
import pytest
import torch

from dynamoe.moe import ExpertConfig, GateConfig, MoEConfig, MoELayer, moe_layer


def layer(**gate):
    return MoELayer(MoEConfig(model_dim=8, gates=[GateConfig(**gate)],
                              experts=ExpertConfig(num_experts_per_device=4, hidden_size_per_expert=8)))


@pytest.mark.parametrize("call,match", [
    (dict(top_k=0), "top_k"), (dict(top_k=5), "top_k"), (dict(top_k=1.5), "top_k"),
    (dict(capacity_factor=float("inf")), "capacity_factor"), (dict(capacity_factor="1"), "capacity_factor"),
    (dict(a2a_ffn_overlap_degree=0), "a2a_ffn_overlap_degree"), (dict(adaptive_r=3), "adaptive_r"),
    (dict(megablocks_size=-1), "megablocks_size"), (dict(layout="dense"), "layout"),
    (dict(layout="ragged", megablocks_size=0), "layout or megablocks_size"), (dict(gate_index=1), "gate_index"),
])
def test_bad_forward_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        layer()(torch.randn(4, 8), **call)


@pytest.mark.parametrize("x,match", [
    (torch.randn(4, 7), "model_dim=8"), (torch.randn(8), "at least 2 dims"),
    (torch.ones(4, 8, dtype=torch.long), "floating-point"), ([[0.0] * 8], "torch.Tensor"),
    (torch.full((2, 8), float("nan")), "non-finite"), (torch.tensor([[float("inf")] * 8]), "non-finite"),
])
def test_bad_input(x, match):
    with pytest.raises(ValueError, match=match):
        layer()(x)


def test_empty_batch_returns_empty_output():
    m = layer()
    for shape in [(0, 8), (2, 0, 8)]:
        x = torch.randn(*shape, requires_grad=True)
        y = m(x)
        assert y.shape == shape and y.routing_stats.dropped == 0 and float(y.l_aux) == 0.0
        y.sum().backward()


@pytest.mark.parametrize("gate,experts,match", [
    (dict(type="top", k=5), dict(), "exceeds the number of experts"),
    (dict(type="nope"), dict(), "gate type"),
    (dict(k=0), dict(), "gate k"),
    (dict(gate_noise=-1.0), dict(), "gate_noise"),
    (dict(type="sigmoid", n_group=3), dict(), "n_group"),
    (dict(type="sigmoid", n_group=2, topk_group=3), dict(), "topk_group"),
    (dict(type="custom"), dict(), "module"),
    (dict(type="top", n_group=2, group_rank="mean"), dict(), r"group_rank must be one of \['max', 'top2_sum'\]"),
    (dict(type="sigmoid", n_group=2, group_rank="top2_sum"), dict(), "group_rank='top2_sum' is for gate type 'top'"),
    (dict(), dict(type="moe"), "experts type"),
    (dict(), dict(hidden_size_per_expert=0), "hidden_size_per_expert"),
    (dict(), dict(type="glu", glu_activation="tanh"), "glu_activation"),
    (dict(), dict(activation_fn="swish"), "activation_fn"),
    (dict(), dict(type="glu", shared_glu_activation="silu_clamp"), "need glu experts and num_shared_experts >= 1"),
    (dict(), dict(type="glu", num_shared_experts=1, shared_glu_activation="tanh"), "shared_glu_activation"),
    (dict(), dict(type="glu", num_shared_experts=1, shared_glu_limit=-1.0), "shared_glu_limit"),
])
def test_bad_config(gate, experts, match):
    with pytest.raises(ValueError, match=match):  # from the config, or from the layer for expert counts
        MoELayer(MoEConfig(model_dim=8, gates=[GateConfig(**gate)],
                           experts=ExpertConfig(**{"num_experts_per_device": 4, "hidden_size_per_expert": 8, **experts})))


@pytest.mark.parametrize("kwargs,match", [
    (dict(gate_type={"type": "top", "kk": 2}), "unknown gate_type key 'kk'"),
    (dict(experts={"type": "ffn", "num_experts_per_device": 2, "hidden_size_per_expert": 8, "bias": True}), "unknown experts key 'bias'"),
    (dict(parallel_type="pipeline"), "parallel_type"),
    (dict(gate_type="Top2"), "Top2Gate"),
    (dict(colour="red"), "unknown moe_layer argument 'colour'"),
])
def test_bad_tutel_arguments(kwargs, match):
    args = dict(gate_type={"type": "top", "k": 2}, model_dim=8,
                experts={"type": "ffn", "num_experts_per_device": 2, "hidden_size_per_expert": 8})
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        moe_layer(**args)


def test_custom_gate_with_wrong_logits_shape():
    class Bad(torch.nn.Module):
        def forward(self, x):
            return x[:, :3]

    m = MoELayer(MoEConfig(model_dim=8, gates=[GateConfig(type="custom", module=Bad(), k=1)],
                           experts=ExpertConfig(num_experts_per_device=4, hidden_size_per_expert=8)))
    with pytest.raises(ValueError, match="logits"):
        m(torch.randn(2, 8))


def test_finite_check_can_be_turned_off():
    m = MoELayer(MoEConfig(model_dim=8, gates=[GateConfig(k=2)], check_finite=False,
                           experts=ExpertConfig(num_experts_per_device=4, hidden_size_per_expert=8)))
    assert not torch.isfinite(m(torch.full((2, 8), float("nan")))).all()  # no check: NaN flows through
    with pytest.raises(ValueError, match="check_finite"):
        MoEConfig(model_dim=8, check_finite=1, experts=ExpertConfig(num_experts_per_device=4, hidden_size_per_expert=8))
