"""int8 activations (act_quant='int8'): the VNNI kernels (csrc/packed_int8.h) against the plain Python emulation
(dynamoe.quant.act_quant) and the error of both against the exact float result."""

import copy

import pytest
import torch

from dynamoe import quant
from dynamoe.moe import ExpertConfig, GateConfig, MoEConfig, MoELayer
from dynamoe.ops import cpu_kernels, moe_decode
from dynamoe.quant import ActQuant, int8_activation_quant, int8_quantize
from dynamoe.quant.matmul import packed_gemv

kernels = cpu_kernels.load()
needs_kernels = pytest.mark.skipif(kernels is None, reason="the packed-weight CPU kernels could not be built here (see log)")

INT8_FORMATS = [("mxfp4", {}), ("nvfp4", {}), ("int4", {}), ("int4", {"group_size": 16}),
                ("int4", {"group_size": 128, "scale_dtype": torch.float32})]


def emulation(x, w):
    """What the int8 kernels compute, in float64: int8-rounded activations times the exact weight."""
    return int8_activation_quant(x).double() @ w.dequantize(torch.float64).t()


def test_int8_quantize_rounds_half_to_even_and_bounds_error():
    x = torch.tensor([[127.0, 0.5, 1.5, -2.5, -127.0] + [0.0] * 27 + [0.0] * 32])
    q, d = int8_quantize(x)
    assert q.dtype == torch.int8 and d.shape == (1, 2)
    assert q[0, :5].tolist() == [127, 0, 2, -2, -127]  # ties to even
    assert d[0, 0] == 1.0 and d[0, 1] == 0.0 and not q[0, 32:].any()  # an all-zero block: scale 0, codes 0
    x = torch.randn(3, 100) * torch.logspace(-3, 3, 100)
    q, d = int8_quantize(x)
    assert q.abs().max() <= 127
    err = (int8_activation_quant(x) - x).abs()
    half_step = d.repeat_interleave(32, -1)[:, :100] / 2
    assert (err <= half_step * (1 + 1e-6)).all()
    bad = torch.randn(1, 64)
    bad[0, 40] = float("inf")
    y = int8_activation_quant(bad)
    assert torch.isnan(y[0, 32:]).all() and not torch.isnan(y[0, :32]).any()  # a block with Inf/NaN is NaN


def test_act_quant_is_a_named_switch():
    assert quant.QuantizedLinear.from_linear(torch.nn.Linear(64, 8), "mxfp4", act_quant="int8").act_quant is ActQuant.INT8
    assert quant.QuantizedLinear.from_linear(torch.nn.Linear(64, 8), "mxfp4").act_quant is None
    with pytest.raises(ValueError, match="act_quant must be one of"):
        quant.QuantizedLinear.from_linear(torch.nn.Linear(64, 8), "mxfp4", act_quant="int4")


# every format with every shape its groups allow (MXFP4 takes whole groups of 32: not 48 features)
SHAPES = [(40, 256), (17, 96), (9, 48), (5, 1056)]  # tails of 8..56 bytes after whole steps
INT8_CASES = [(fmt, options, shape) for fmt, options in INT8_FORMATS for shape in SHAPES
              if not (fmt == "mxfp4" and shape[1] % 32)]


@needs_kernels
@pytest.mark.parametrize("fmt,options,shape", INT8_CASES)
@pytest.mark.parametrize("T", [1, 3, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_gemv_equals_emulation_and_bounds_error(fmt, options, shape, T, dtype):
    torch.manual_seed(shape[0] * T)
    w = quant.quantize(torch.randn(*shape) * 3, fmt, **options)
    x = torch.randn(T, shape[1]).to(dtype)
    y = packed_gemv(x, w, act_quant="int8")
    assert y is not None and y.shape == (T, shape[0]) and y.dtype == torch.float32
    # the same integer sums and scales as the emulation: only the fp32 summation order differs
    scale = (int8_activation_quant(x).abs().double() @ w.dequantize(torch.float64).abs().t())
    assert ((y.double() - emulation(x, w)).abs() <= 1e-5 * scale + 1e-30).all()
    # against the exact activations: the error of int8 activations (at most half a step of 1/127 per element)
    exact = x.double() @ w.dequantize(torch.float64).t()
    assert ((y.double() - exact).abs() <= scale / 254 * 1.01 + 1e-6).all()


@needs_kernels
def test_int8_acts_kernels_reject_fp8_and_bad_values():
    w = quant.quantize(torch.randn(8, 256), "fp8_block")
    assert packed_gemv(torch.randn(1, 256), w, act_quant="int8") is None  # FP8 weights: the emulation runs instead
    with pytest.raises(RuntimeError, match="4-bit formats"):
        kernels.fp8_block_gemv(torch.randn(1, 256), w.weight.view(torch.uint8), w.scales().contiguous(), 128, 128,
                               kernels.PackedActs.int8)


@needs_kernels
@pytest.mark.parametrize("fmt", ["fp8_block", "mxfp4", "nvfp4", "int4"])
def test_quantized_linear_int8_kernel_and_emulation_agree(fmt, monkeypatch):
    torch.manual_seed(0)
    lin = torch.nn.Linear(128, 64)
    q = quant.QuantizedLinear.from_linear(lin, fmt, act_quant="int8")
    x = torch.randn(3, 128)
    with torch.no_grad():
        fast = q(x)
        monkeypatch.setattr(cpu_kernels, "load", lambda: None)  # the dequantize path: the emulation
        slow = q(x)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)
    exact = quant.QuantizedLinear.from_linear(lin, fmt)(x).detach()
    assert (fast - exact).abs().max() < 0.02 * exact.abs().max()


def _layers(fmt, dtype):
    torch.manual_seed(0)
    base = MoELayer(MoEConfig(model_dim=128, gates=[GateConfig(k=4, capacity_factor=0.0)], aux_loss="none",
                              experts=ExpertConfig(type="glu", num_experts_per_device=8, hidden_size_per_expert=96)))
    base = base.to(dtype)
    exact, int8 = copy.deepcopy(base).eval(), copy.deepcopy(base).eval()
    quant.quantize_experts_(exact, fmt)
    quant.quantize_experts_(int8, fmt, act_quant="int8")
    return exact, int8


@needs_kernels
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "int4"])
@pytest.mark.parametrize("T", [1, 5, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_decode_int8_equals_general_path_emulation(fmt, T, dtype, monkeypatch):
    exact, int8 = _layers(fmt, dtype)
    x = torch.randn(T, 128).to(dtype)
    ids = torch.rand(T, 8).topk(4).indices
    wts = torch.rand(T, 4).softmax(-1)
    with torch.no_grad():
        fused = moe_decode.packed_glu_decode(x, ids, wts, int8.experts)
        assert fused is not None
        y_fused, load, _ = fused
        y_exact = moe_decode.packed_glu_decode(x, ids, wts, exact.experts)[0]
        # the general path (per expert, no fused kernel) with the kernels off: the Python emulation
        monkeypatch.setattr(cpu_kernels, "load", lambda: None)
        y_emul = _general(int8.experts, x, ids, wts)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(y_fused.float(), y_emul.float(), atol=tol, rtol=tol)
    assert (y_fused.float() - y_exact.float()).abs().max() < 0.05 * y_exact.float().abs().max()


def _general(experts, x, ids, wts):
    """The routed experts' output through QuantizedExperts.forward_ragged (rows sorted by expert)."""
    T, K = ids.shape
    order = ids.reshape(-1).argsort(stable=True)
    tok = order // K
    counts = torch.bincount(ids.reshape(-1), minlength=experts.num_local_experts).tolist()
    y = experts.forward_ragged(x[tok], counts, row_scale=wts.reshape(-1)[order])
    return torch.zeros(T, y.size(1), dtype=y.dtype).index_add_(0, tok, y)
