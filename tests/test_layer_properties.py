"""hypothesis properties of the layer, pinned with tiny stand-in experts."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamoe.moe import ExpertConfig, GateConfig, MoEConfig, MoELayer


class Constant(torch.nn.Module):
    """Every expert returns a row of ones: y[t] is then the sum of t's kept combine weights."""

    def forward(self, x, ctx):
        return torch.ones_like(x)

    def forward_ragged(self, x, counts):
        return torch.ones_like(x)


def layer(E, k, cf, gate="top", experts=None, **kw):
    gate_kw = dict(n_group=1) if gate == "sigmoid" else {}
    ex = ExpertConfig(type="custom", module=experts or Constant(), num_experts_per_device=E) if experts is not False else \
        ExpertConfig(num_experts_per_device=E, hidden_size_per_expert=6)
    return MoELayer(MoEConfig(model_dim=4, gates=[GateConfig(type=gate, k=k, capacity_factor=cf, **gate_kw)], experts=ex, **kw))


cases = st.integers(1, 6).flatmap(lambda E: st.tuples(st.just(E), st.integers(1, E), st.integers(1, 30),
                                                    st.sampled_from(["ragged", "padded"]), st.integers(0, 10**6)))


@settings(max_examples=40, deadline=None)
@given(cases, st.sampled_from([True, False]))
def test_combine_weights_sum_to_the_renormalised_value(case, normalize):
    E, k, T, layout, seed = case
    torch.manual_seed(seed)
    m = layer(E, k, 0.0, normalize_gate=normalize)
    x = torch.randn(T, 4)
    y = m(x, layout=layout)
    assert y.routing_stats.dropped == 0
    logits = m.gates[0](x)
    probs = torch.softmax(logits, -1).topk(k).values.sum(-1)
    want = torch.ones(T) if (normalize and k > 1) else probs
    torch.testing.assert_close(y[:, 0], want, atol=1e-5, rtol=1e-5)


@settings(max_examples=40, deadline=None)
@given(cases)
def test_sigmoid_weights_sum_to_route_scale(case):
    E, k, T, layout, seed = case
    torch.manual_seed(seed)
    m = MoELayer(MoEConfig(model_dim=4, gates=[GateConfig(type="sigmoid", k=k, capacity_factor=0.0, route_scale=2.5)],
                           experts=ExpertConfig(type="custom", module=Constant(), num_experts_per_device=E)))
    y = m(torch.randn(T, 4), layout=layout)
    torch.testing.assert_close(y[:, 0], torch.full((T,), 2.5), atol=1e-5, rtol=1e-5)


@settings(max_examples=40, deadline=None)
@given(cases, st.sampled_from([1.0, 0.5, -1.0]))
def test_capacity_pressure_drops_weight_and_counts_it(case, cf):
    E, k, T, layout, seed = case
    torch.manual_seed(seed)
    m = layer(E, k, cf)
    x = torch.randn(T, 4)
    y = m(x, layout=layout)
    stats = y.routing_stats
    assert (stats.kept <= stats.capacity).all()
    assert stats.dropped == int((stats.load - stats.kept).sum())
    probs = torch.softmax(m.gates[0](x), -1).topk(k).values
    full = torch.ones(T) if k > 1 else probs[:, 0]
    # tokens with a dropped assignment lose exactly that weight; nobody gains any
    deficit = full - y[:, 0]
    assert (deficit >= -1e-5).all()
    short = int((deficit > 1e-6).sum())
    assert short <= stats.dropped
    assert (short > 0) == (stats.dropped > 0)


@settings(max_examples=30, deadline=None)
@given(cases)
def test_permuting_tokens_permutes_outputs(case):
    E, k, T, layout, seed = case
    torch.manual_seed(seed)
    m = layer(E, k, 0.0, experts=False)  # real FFN experts, dropless: no capacity pressure
    x = torch.randn(T, 4)
    perm = torch.randperm(T)
    torch.testing.assert_close(m(x, layout=layout)[perm], m(x[perm], layout=layout), atol=1e-5, rtol=1e-5)
