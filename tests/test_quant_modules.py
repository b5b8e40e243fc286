"""Packed-weight matmuls and modules: equal to dequantize-then-matmul, per-expert dequantization
only, state dicts, FP8 activation quantization."""
import copy

import pytest
import torch
import torch.nn.functional as F

from dynamoe import quant
from dynamoe.moe import ExpertConfig, GateConfig, MoEConfig, MoELayer
from dynamoe.ops import grouped_mm_reference
from dynamoe.quant import QuantizedExperts, QuantizedLinear, QuantizedWeight

FORMATS = ["fp8_block", "mxfp4", "nvfp4", "int4"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_linear_equals_dequantize_then_matmul(fmt):
    lin = torch.nn.Linear(64, 48)
    q = QuantizedLinear.from_linear(lin, fmt)
    x = torch.randn(5, 7, 64)
    torch.testing.assert_close(q(x), F.linear(x, q.qweight.dequantize(torch.float32), lin.bias))
    assert q.qweight.nbytes < lin.weight.numel() * 4


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_grouped_mm_forward_and_gradients(fmt):
    w = quant.quantize(torch.randn(3, 32, 64), fmt)
    dense = w.dequantize(torch.float64)
    counts = [4, 0, 5]
    x = torch.randn(9, 64, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 32, dtype=torch.float64, requires_grad=True)
    s = torch.rand(9, dtype=torch.float64, requires_grad=True)
    y = quant.quantized_grouped_mm(x, w, counts, b, row_scale=s)
    g = torch.randn_like(y)
    (y * g).sum().backward()
    got = [x.grad, b.grad, s.grad]
    for t in (x, b, s):
        t.grad = None
    y_ref = grouped_mm_reference(x, dense, counts, b, trans_w=True, row_scale=s)
    (y_ref * g).sum().backward()
    torch.testing.assert_close(y, y_ref)
    for a, c in zip(got, [x.grad, b.grad, s.grad]):
        torch.testing.assert_close(a, c)
    with torch.no_grad():  # the inference path writes in place
        out = torch.empty(9, 32, dtype=torch.float64)
        assert quant.quantized_grouped_mm(x, w, counts, b, row_scale=s, out=out).data_ptr() == out.data_ptr()
        torch.testing.assert_close(out, y_ref)


def dense_twin(layer: MoELayer, qexperts: QuantizedExperts) -> MoELayer:
    """The same layer with the dequantized weights as ordinary dense experts."""
    twin = copy.deepcopy(layer)
    ex = twin.experts
    with torch.no_grad():
        if qexperts.kind == "ffn":
            ex.batched_fc1_w.copy_(qexperts.w1.dequantize(torch.float32))
            ex.batched_fc2_w.copy_(qexperts.w2.dequantize(torch.float32).transpose(1, 2))
        else:
            ex.gate_up_proj.copy_(qexperts.w1.dequantize(torch.float32))
            ex.down_proj.copy_(qexperts.w2.dequantize(torch.float32))
    return twin


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind,extra", [("ffn", {}), ("glu", {}), ("glu", {"glu_activation": "gpt_oss", "glu_bias": True})])
@pytest.mark.parametrize("layout", ["ragged", "padded"])
def test_packed_experts_equal_dequantize_then_matmul(fmt, kind, extra, layout):
    layer = MoELayer(MoEConfig(model_dim=64, gates=[GateConfig(k=2, capacity_factor=0.0)],
                               experts=ExpertConfig(type=kind, num_experts_per_device=4, hidden_size_per_expert=32, **extra)))
    twin_src = copy.deepcopy(layer)
    assert quant.quantize_experts_(layer, fmt) == 1
    twin = dense_twin(twin_src, layer.experts)
    x = torch.randn(3, 10, 64)
    with torch.no_grad():
        torch.testing.assert_close(layer(x, layout=layout), twin(x, layout=layout), atol=1e-5, rtol=1e-5)
    # with autograd (gradient to the input and the router through packed weights)
    xg = x.clone().requires_grad_()
    y = layer(xg, layout=layout)
    y.sum().backward()
    xt = x.clone().requires_grad_()
    twin(xt, layout=layout).sum().backward()
    torch.testing.assert_close(xg.grad, xt.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernels", [False, True])
def test_dequantization_is_per_expert_never_whole_layer(monkeypatch, kernels):
    from dynamoe.ops import cpu_kernels

    if not kernels:
        monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    elif cpu_kernels.load() is None:
        pytest.skip("the packed-weight CPU kernels could not be built on this machine (see the log warning)")
    layer = MoELayer(MoEConfig(model_dim=64, gates=[GateConfig(k=2, capacity_factor=0.0)],
                               experts=ExpertConfig(type="glu", num_experts_per_device=8, hidden_size_per_expert=32)))
    quant.quantize_experts_(layer, "nvfp4")
    shapes = []
    original = quant.NVFP4Weight.dequantize

    def spy(self, dtype=torch.bfloat16):
        shapes.append(tuple(self.shape))
        return original(self, dtype)

    monkeypatch.setattr(quant.NVFP4Weight, "dequantize", spy)
    with torch.no_grad():
        y = layer(torch.randn(3, 64))
    active = int((y.routing_stats.kept > 0).sum())
    if kernels:  # decode-sized: the kernels read the packed bytes, nothing is dequantized
        assert shapes == []
    else:
        assert shapes and all(len(s) == 2 for s in shapes)  # one expert's [out, in] at a time
        assert len(shapes) == 2 * active                       # only experts that got rows, each weight once


@pytest.mark.parametrize("fmt", FORMATS)
def test_state_dict_round_trip_and_device_moves(fmt):
    def build(seed):
        torch.manual_seed(seed)
        m = MoELayer(MoEConfig(model_dim=32, gates=[GateConfig(k=2, capacity_factor=0)],
                               experts=ExpertConfig(type="glu", num_experts_per_device=4, hidden_size_per_expert=32)))
        quant.quantize_experts_(m, fmt)
        return m

    a, b = build(1), build(2)
    x = torch.randn(7, 32)
    b.load_state_dict(a.state_dict())
    torch.testing.assert_close(a(x), b(x))
    c = copy.deepcopy(a).to(torch.device("cpu"))
    torch.testing.assert_close(c(x), a(x))
    assert isinstance(c.experts.w1, QuantizedWeight)


def test_fp8_activation_quantization_error_bound():
    x = torch.randn(5, 300) * torch.rand(5, 300) * 20
    q = quant.fp8_activation_quant(x, group=128)
    pad = torch.nn.functional.pad(x, (0, 84)).view(5, -1, 128)
    scale = (pad.abs().amax(-1) / 448).repeat_interleave(128, -1)[:, :300]
    assert ((q - x).abs() <= x.abs() * 2 ** -4 + scale * 2 ** -10).all()
    lin = torch.nn.Linear(300, 16)
    a = QuantizedLinear.from_linear(lin, "fp8_block", act_quant="fp8")
    b = QuantizedLinear.from_linear(lin, "fp8_block")
    torch.testing.assert_close(a(x), b(q))
    with pytest.raises(ValueError, match="act_quant"):
        QuantizedLinear.from_linear(lin, "fp8_block", act_quant="int4")  # not an activation quantization


def test_quantize_linears_with_exclusions():
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    x = torch.randn(4, 32)
    ref = model(x)
    assert quant.quantize_linears_(model, "fp8_block", exclude=lambda name: name == "2") == 1
    assert isinstance(model[0], QuantizedLinear) and isinstance(model[2], torch.nn.Linear)
    assert ((model(x) - ref).norm() / ref.norm()) < 0.05


def test_bad_quantized_module_arguments():
    w = quant.quantize(torch.randn(2, 32, 64), "mxfp4")
    with pytest.raises(ValueError, match="single"):
        QuantizedLinear(w)
    with pytest.raises(ValueError, match="hidden features"):
        QuantizedExperts(w, w, "ffn")
    with pytest.raises(ValueError, match="format"):
        QuantizedExperts.from_experts(torch.nn.Linear(2, 2), "fp4")
    with pytest.raises(ValueError, match="FFN or GLU"):
        QuantizedExperts.from_experts(torch.nn.Linear(2, 2), "nvfp4")
