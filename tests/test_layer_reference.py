"""The layer against the per-token reference: outputs and gradients, across gates, k, capacity
modes, layouts, expert types and dtypes."""
import pytest
import torch

from dynamoe.moe import ExpertConfig, GateConfig, MoEConfig, MoELayer
from reference import reference_moe


def make_layer(gate="top", k=2, cf=1.0, experts="ffn", E=4, D=16, F=24, dtype=torch.float32, **kw):
    gate_kw = {}
    if gate == "sigmoid":
        gate_kw = dict(n_group=2, topk_group=1, route_scale=2.5)
    expert_kw = {}
    if experts == "gpt_oss":
        experts, expert_kw = "glu", dict(glu_activation="gpt_oss", glu_bias=True, gpt_oss_limit=0.5)
    elif experts == "reglu":
        experts, expert_kw = "glu", dict(glu_activation="relu")
    shared = kw.pop("shared", 0)
    cfg = MoEConfig(
        model_dim=D,
        gates=[GateConfig(type=gate, k=k, capacity_factor=cf, **gate_kw)],
        experts=ExpertConfig(type=experts, num_experts_per_device=E, hidden_size_per_expert=F,
                             num_shared_experts=shared, **expert_kw),
        **kw,
    )
    layer = MoELayer(cfg).to(dtype)
    if gate == "sigmoid":
        with torch.no_grad():
            layer.gates[0].e_score_correction_bias.uniform_(-0.1, 0.1)
    return layer


def grads(layer, x):
    return [x.grad] + [p.grad for p in layer.parameters()]


def check_against_reference(layer, x, atol, **call):
    x1 = x.clone().requires_grad_()
    y = layer(x1, **call)
    g_out = torch.randn_like(y)
    (y * g_out).sum().backward()
    got = grads(layer, x1)
    layer.zero_grad()
    x2 = x.clone().requires_grad_()
    y_ref, dropped, loads = reference_moe(layer, x2, call.get("top_k"), call.get("capacity_factor"))
    (y_ref * g_out).sum().backward()
    want = grads(layer, x2)
    layer.zero_grad()
    torch.testing.assert_close(y, y_ref, atol=atol, rtol=atol)
    assert y.routing_stats.dropped == dropped
    assert y.routing_stats.load.tolist() == loads
    for a, b in zip(got, want):
        if b is None:
            assert a is None or float(a.abs().max()) == 0
        else:
            torch.testing.assert_close(a, b, atol=atol, rtol=atol)


@pytest.mark.parametrize("layout", ["ragged", "padded"])
@pytest.mark.parametrize("gate,k", [("top", 1), ("top", 2), ("top", 3), ("sigmoid", 2), ("cosine_top", 2)])
@pytest.mark.parametrize("cf", [1.0, 0.0, -0.5, 0.5, 2.0])
def test_matches_reference(gate, k, cf, layout):
    layer = make_layer(gate=gate, k=k, cf=cf)
    x = torch.randn(3, 7, 16)
    check_against_reference(layer, x, atol=1e-5, layout=layout)


@pytest.mark.parametrize("layout", ["ragged", "padded"])
@pytest.mark.parametrize("experts", ["ffn", "glu", "gpt_oss", "reglu"])
@pytest.mark.parametrize("options", [
    {}, {"is_postscore": False}, {"batch_prioritized_routing": True}, {"normalize_gate": False}, {"shared": 1},
])
def test_expert_types_and_options(experts, options, layout):
    layer = make_layer(experts=experts, cf=0.5, **options)
    x = torch.randn(2, 9, 16)
    check_against_reference(layer, x, atol=1e-5, layout=layout)


@pytest.mark.parametrize("k,cf", [(1, 0.0), (2, 1.0), (4, 0.0)])
def test_per_call_switches_match_reference(k, cf):
    layer = make_layer(k=2, cf=1.0, E=6)
    x = torch.randn(20, 16)
    check_against_reference(layer, x, atol=1e-5, top_k=k, capacity_factor=cf)


@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-10), (torch.bfloat16, 3e-2), (torch.float16, 3e-3)])
@pytest.mark.parametrize("layout", ["ragged", "padded"])
def test_dtypes(dtype, atol, layout):
    layer = make_layer(dtype=dtype, cf=0.0)
    x = torch.randn(4, 5, 16, dtype=dtype)
    y = layer(x, layout=layout)
    assert y.dtype == dtype
    y_ref, _, _ = reference_moe(layer, x)
    torch.testing.assert_close(y.float(), y_ref.float(), atol=atol, rtol=atol)


def test_layouts_agree_exactly_and_output_dim():
    layer = MoELayer(MoEConfig(model_dim=16, gates=[GateConfig(k=2, capacity_factor=0.7)],
                               experts=ExpertConfig(num_experts_per_device=5, hidden_size_per_expert=8, output_dim=11)))
    x = torch.randn(33, 16)
    a, b = layer(x, layout="ragged"), layer(x, layout="padded")
    assert a.shape == (33, 11)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    check_against_reference(layer, x, atol=1e-5)


@pytest.mark.parametrize("experts", ["ffn", "glu"])
@pytest.mark.parametrize("act", ["relu", "silu", "gelu"])
def test_inference_path_equals_autograd_path(experts, act):
    """no_grad takes scratch buffers, in-place activations and the out= reuse; results must not move."""
    from dynamoe.ops import release_scratch, scratch_bytes

    layer = MoELayer(MoEConfig(model_dim=16, gates=[GateConfig(k=2, capacity_factor=0.0)],
                               experts=ExpertConfig(type=experts, num_experts_per_device=4, hidden_size_per_expert=24,
                                                    **({"activation_fn": act} if experts == "ffn" else {"glu_activation": act}))))
    x = torch.randn(30, 16)
    y_grad = layer(x)
    with torch.no_grad():
        y1 = layer(x)
        y2 = layer(x[:7])  # smaller batch reuses the same scratch
        y3 = layer(x)
    torch.testing.assert_close(y1, y_grad)
    torch.testing.assert_close(y3, y_grad)
    torch.testing.assert_close(y2, y_grad[:7])
    assert y1.data_ptr() != y3.data_ptr()  # outputs are never scratch
    assert scratch_bytes() > 0
    release_scratch()
    assert scratch_bytes() == 0


@pytest.mark.parametrize("layout", ["ragged", "padded"])
def test_autocast_with_fp32_weights(layout):
    layer = make_layer(cf=0.0)
    x = torch.randn(12, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x, layout=layout)
    assert y.dtype == torch.float32
    y.sum().backward()
    assert layer.experts.batched_fc1_w.grad.dtype == torch.float32
    y_ref, _, _ = reference_moe(layer, x.detach())
    torch.testing.assert_close(y, y_ref, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("T", [3, 40])   # (a decode batch through the experts' kernel, a prefill through the plan)
def test_forward_routed_equals_forward_with_the_same_routing(T):
    """MoELayer.forward_routed (a routing the caller chose: DeepSeek-V4's hash routing) gives forward's output for
    forward's own routing -- routed and shared experts -- and checks its arguments."""
    from dynamoe.moe.gates import route

    layer = make_layer("sigmoid", k=2, cf=0.0, experts="glu", shared=1).eval()
    x = torch.randn(T, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        r = route(layer.gates[0], layer.config.gates[0], x, 4, 2, layer.config.normalize_gate, False, False)
        want = layer(x)
        got = layer.forward_routed(x, r.ids_TK, r.weights_TK)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert got.routing_stats.load.sum() == 2 * T
    with pytest.raises(ValueError, match="ids_TK"):
        layer.forward_routed(x, r.ids_TK.int(), r.weights_TK)
    with pytest.raises(ValueError, match="expert ids"):
        layer.forward_routed(x, r.ids_TK + 4, r.weights_TK)
