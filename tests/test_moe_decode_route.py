"""The decode step's router kernel (dynamoe.ops.moe_decode.route_decode) against the routing functions
of dynamoe.ops.routing, and the MoE layer's decode fast path (router kernel + experts kernel) against its
general path: same output, same statistics, and only where it is the same computation."""
import pytest
import torch
import torch.nn.functional as F

from dynamoe.models.moe_block import BiasedRouter
from dynamoe.moe import ExpertConfig, GateConfig, MoEConfig, MoELayer
from dynamoe.ops import cpu_kernels, moe_decode
from dynamoe.ops.routing import sigmoid_group_topk, softmax_topk
from spying import record_calls

kernels = cpu_kernels.load()
pytestmark = pytest.mark.skipif(kernels is None, reason="the CPU kernels could not be built here")


class _Linear(torch.nn.Module):
    def __init__(self, w, b=None):
        super().__init__()
        self.w, self.b = w, b

    def fp32_linear(self):
        return self.w, self.b


class _LowPrecision(torch.nn.Module):
    def fp32_linear(self):
        return None  # logits computed in bf16: not what the kernel computes


def _check(got, want_w, want_ids):
    ids, w = got
    assert ids.dtype == torch.long and w.dtype == torch.float32
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(w, want_w.float(), atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (3, 64, 8), (16, 20, 1), (2, 17, 17)])
@pytest.mark.parametrize("renorm", [True, False])
@pytest.mark.parametrize("xdt,wdt", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                     (torch.bfloat16, torch.float32)])
def test_softmax_router_matches_reference(T, E, k, renorm, xdt, wdt):
    g = torch.Generator().manual_seed(T * 100 + E)
    D = 72  # a 16-lane tail
    x = torch.randn(T, D, generator=g).to(xdt)
    w = torch.randn(E, D, generator=g).to(wdt)
    b = torch.randn(E, generator=g) if k % 2 == 0 else None
    logits = F.linear(x.float(), w.float(), b)
    want_w, want_ids, _ = softmax_topk(logits, k, renorm, need_probs=False)
    with torch.inference_mode():
        got = moe_decode.route_decode(x, _Linear(w, b), "top", k, renorm, 2.5)
    _check(got, want_w * 2.5, want_ids)


@pytest.mark.parametrize("E,groups,keep,k", [(16, 1, 1, 4), (32, 4, 2, 6), (64, 8, 3, 8), (12, 4, 4, 3), (8, 8, 2, 2)])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("renorm", [True, False])
def test_sigmoid_group_router_matches_reference(E, groups, keep, k, with_bias, renorm):
    g = torch.Generator().manual_seed(E + groups)
    x = torch.randn(5, 48, generator=g).bfloat16()
    w = torch.randn(E, 48, generator=g).bfloat16() * 0.3
    gate = _Linear(w)
    gate.e_score_correction_bias = torch.randn(E, generator=g) * 0.5 if with_bias else None
    logits = F.linear(x.float(), w.float())
    want_w, want_ids, _ = sigmoid_group_topk(logits, k, gate.e_score_correction_bias, groups, keep, renorm, 1.5)
    with torch.inference_mode():
        got = moe_decode.route_decode(x, gate, "sigmoid", k, renorm, 1.5, groups, keep)
    _check(got, want_w, want_ids)


def test_router_ties_go_to_the_lower_expert():
    x = torch.ones(1, 16)
    w = torch.zeros(6, 16)
    w[[1, 3, 4]] = 1.0  # three equal logits for two places
    with torch.inference_mode():
        ids, weights = moe_decode.route_decode(x, _Linear(w), "top", 2, True)
    assert ids.tolist() == [[1, 3]]
    torch.testing.assert_close(weights, torch.tensor([[0.5, 0.5]]))


def test_router_declines_what_it_does_not_compute():
    x = torch.randn(2, 16)
    gate = _Linear(torch.randn(4, 16))
    with torch.inference_mode():
        assert moe_decode.route_decode(torch.randn(17, 16), gate, "top", 2, True) is None  # not a decode batch
        assert moe_decode.route_decode(x.half(), _Linear(torch.randn(4, 16).half()), "top", 2, True) is None
        assert moe_decode.route_decode(x, torch.nn.Linear(16, 4), "top", 2, True) is None  # no fp32_linear()
        assert moe_decode.route_decode(x, _LowPrecision(), "top", 2, True) is None
        assert moe_decode.route_decode(x, gate, "top", 5, True) is None  # k > E: the general path's error
        assert moe_decode.route_decode(x, gate, "sigmoid", 3, True, 1.0, 2, 1) is None  # 1 group of 2 < k
        # Mistral-4's group ranking (sum of the two best) limiting the groups: no kernel; with every group kept
        # the ranking does not matter and the kernel routes
        assert moe_decode.route_decode(x, gate, "top", 2, True, 1.0, 2, 1, group_rank="top2_sum") is None
        assert moe_decode.route_decode(x, gate, "top", 2, True, 1.0, 2, 2, group_rank="top2_sum") is not None
    assert moe_decode.route_decode(x, gate, "top", 2, True) is None  # autograd on


# ------------------------------------------------------------------------------------ the layer
def _layer(gate: GateConfig, E=8, D=64, Fh=32, shared=0, dtype=torch.bfloat16, **cfg):
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(model_dim=D, gates=[gate], dtype=dtype, **{"aux_loss": "none", **cfg},
                               experts=ExpertConfig(type="glu", num_experts_per_device=E, hidden_size_per_expert=Fh,
                                                    num_shared_experts=shared))).eval()
    bias = getattr(layer.gates[0], "e_score_correction_bias", None)
    if bias is not None:
        bias.copy_(torch.randn(E) * 0.3)
    return layer


def _spy(monkeypatch):
    """Calls of the layer's own decode path (router + experts in one kernel call)."""
    return record_calls(monkeypatch, moe_decode, "moe_decode_with")


def _general(monkeypatch, layer, x):
    """Routing in torch (the experts still through their decode kernel after it)."""
    with monkeypatch.context() as m:
        m.setattr(MoELayer, "_decode_step", lambda *a, **kw: None)
        with torch.inference_mode():
            return layer(x)


GATES = {
    "softmax": GateConfig(type="top", k=2, capacity_factor=0.0, fp32_gate=True),
    "softmax-k1-scaled": GateConfig(type="top", k=1, capacity_factor=0.0, fp32_gate=True, route_scale=2.0),
    "sigmoid-groups": GateConfig(type="sigmoid", k=3, capacity_factor=0.0, fp32_gate=True, n_group=4, topk_group=2,
                                 route_scale=2.5),
    "gpt-oss-router": GateConfig(type="custom", k=2, capacity_factor=0.0, module=BiasedRouter(64, 8)),
}


@pytest.mark.parametrize("name", list(GATES))
@pytest.mark.parametrize("shape", [(1, 1, 64), (3, 64), (2, 8, 64)])
def test_layer_fast_path_equals_general_path(monkeypatch, name, shape):
    gate = GATES[name]
    if name == "gpt-oss-router":
        torch.nn.init.normal_(gate.module.weight)
        torch.nn.init.normal_(gate.module.bias)
    layer = _layer(gate, shared=1 if name == "sigmoid-groups" else 0)
    # "custom" gates are treated as softmax top-k over their logits, as the general path does
    x = torch.randn(*shape).bfloat16()
    used = _spy(monkeypatch)
    with torch.inference_mode():
        fast = layer(x)
    assert used == [True] and layer.l_aux is fast.l_aux
    general = _general(monkeypatch, layer, x)
    assert fast.shape == general.shape and fast.dtype == general.dtype
    torch.testing.assert_close(fast.float(), general.float(), atol=1e-2 * general.abs().max().item(), rtol=1e-2)
    a, b = fast.routing_stats, general.routing_stats
    assert torch.equal(a.load, b.load) and torch.equal(a.kept, b.kept)
    assert (a.dropped, a.capacity, a.top_k, a.capacity_factor, a.layout) == (b.dropped, b.capacity, b.top_k, 0.0, b.layout)
    assert float(fast.l_aux) == 0.0


@pytest.mark.parametrize("fmt", ["fp8_block", "mxfp4", "nvfp4"])
def test_layer_fast_path_with_packed_experts(monkeypatch, fmt):
    """Packed experts (no float parameters without biases) take the fast path too, with the general
    path's output and statistics."""
    from dynamoe import quant

    layer = _layer(GATES["softmax"], D=64, Fh=64)
    quant.quantize_experts_(layer, fmt)
    x = torch.randn(3, 64).bfloat16()
    used = _spy(monkeypatch)
    with torch.inference_mode():
        fast = layer(x)
    assert used == [True]
    general = _general(monkeypatch, layer, x)
    torch.testing.assert_close(fast.float(), general.float(), atol=1e-2 * general.abs().max().item(), rtol=1e-2)
    assert torch.equal(fast.routing_stats.load, general.routing_stats.load)


def test_layer_fast_path_only_where_it_is_the_same_computation(monkeypatch):
    used = _spy(monkeypatch)
    x = torch.randn(2, 64).bfloat16()
    layer = _layer(GATES["softmax"])
    layer(x)  # autograd on
    with torch.inference_mode():
        layer(x, top_k=1)  # a per-call switch: the general path
        _layer(GATES["softmax"], aux_loss="switch")(x)  # a loss wanted
        _layer(GateConfig(type="top", k=2, capacity_factor=1.0, fp32_gate=True))(x)  # may drop
        _layer(GateConfig(type="top", k=2, capacity_factor=0.0, fp32_gate=False))(x)  # bf16 logits
        grouped = _layer(GateConfig(type="top", k=2, capacity_factor=0.0, fp32_gate=True, n_group=4, topk_group=2,
                                    group_rank="top2_sum"))  # Mistral-4's group ranking: no router kernel
        grouped(x)
        assert "group_rank='top2_sum'" in grouped.decode_fused(x).extra
        layer(torch.randn(17, 64).bfloat16())  # not a decode batch
        layer(x.float())  # input in another dtype than the experts: the general path casts it
        layer(x)
    assert used == [True]  # only the last call is fast


def test_layer_fast_path_keeps_result_func_and_non_finite_errors(monkeypatch):
    layer = _layer(GATES["softmax"], check_finite=True)
    layer.result_func = lambda y: y * 2
    x = torch.randn(2, 64).bfloat16()
    with torch.inference_mode():
        fast = layer(x)
    torch.testing.assert_close(fast, _general(monkeypatch, layer, x))
    x[0, 3] = float("nan")
    with torch.inference_mode(), pytest.raises(ValueError, match="non-finite"):
        layer(x)
