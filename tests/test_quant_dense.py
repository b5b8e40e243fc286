"""dynamoe.quant.dequantize.dense (csrc/dequantize.cpp): bit for bit the formats' torch dequantize(),
for every format, leading expert dims, widths off the group grid, bf16 and fp32; and the prefill
matmuls that use it."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamoe.ops import cpu_kernels
from dynamoe.quant import BlockFP8Weight, INT4Weight, MXFP4Weight, NVFP4Weight, quantized_grouped_mm, quantized_linear
from dynamoe.quant.dequantize import dense

K = cpu_kernels.load()
pytestmark = pytest.mark.skipif(K is None, reason="the CPU kernels are turned off (DYNAMOE_NO_CPU_KERNELS)")


def _weights(shape, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) * torch.rand(*shape[:-1], 1, generator=g) * 3
    return {
        "mxfp4": lambda: MXFP4Weight.quantize(w),
        "nvfp4": lambda: NVFP4Weight.quantize(w),
        "fp8_block": lambda: BlockFP8Weight.quantize(w, block=(16, 32)),
        "fp8_block_ue8m0": lambda: BlockFP8Weight.quantize(w, block=(128, 128), scale_fmt="ue8m0"),
        "int4_g32": lambda: INT4Weight.quantize(w, group_size=32),
        "int4_g128": lambda: INT4Weight.quantize(w, group_size=128),
    }


def _same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def _spy(monkeypatch):
    calls = []
    real = K.dequantize
    monkeypatch.setattr(K, "dequantize", lambda **kw: (calls.append(1), real(**kw))[1])
    return calls


@pytest.mark.parametrize("fmt", list(_weights((4, 32), 0)))
@pytest.mark.parametrize("shape", [(64, 256), (3, 48, 160), (2, 2, 16, 64), (33, 320)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_equals_torch_dequantize(fmt, shape, dtype, monkeypatch):
    w = _weights(shape, 1)[fmt]()  # (every width here is whole groups of every format)
    calls = _spy(monkeypatch)
    _same(dense(w, dtype), w.dequantize(dtype))
    assert calls, "the native dequantize did not run"


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 40), groups=st.integers(1, 9), tail=st.integers(0, 31), seed=st.integers(0, 999),
       fmt=st.sampled_from(["fp8_block", "int4_g32", "int4_g128", "mxfp4", "nvfp4"]))
def test_property_any_width(rows, groups, tail, seed, fmt):
    """Rows and columns off every grid the formats allow (INT4 and FP8 take any width)."""
    cols = 32 * groups + (tail if fmt.startswith(("int4", "fp8")) else 0)
    w = _weights((rows, cols), seed)[fmt]()
    _same(dense(w, torch.bfloat16), w.dequantize(torch.bfloat16))


def test_nan_scale_and_other_dtypes():
    w = MXFP4Weight.quantize(torch.randn(8, 64))
    w.scales[3, 1] = 255  # e8m0 NaN
    _same(dense(w), w.dequantize())
    assert dense(w)[3, 32:].isnan().all()
    _same(dense(w, torch.float16), w.dequantize(torch.float16))  # not a kernel dtype: the torch path


def test_kernel_refuses_bad_arguments_by_name():
    w = K.PackedCodes()
    w.codes, w.bits = torch.zeros(1, 4, 8, dtype=torch.uint8), 3
    w.lut, w.scales = torch.zeros(16), torch.zeros(1, 4, 1)
    out = torch.empty(1, 4, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="bits must be 4 or 8"):
        K.dequantize(w=w, out=out)
    w.bits, w.scales = 4, torch.zeros(1, 4, 3)
    with pytest.raises(RuntimeError, match="scales must be"):
        K.dequantize(w=w, out=out)
    w.scales = torch.zeros(1, 4, 1, dtype=torch.uint8)   # (scale codes without their table)
    with pytest.raises(RuntimeError, match="scale_lut"):
        K.dequantize(w=w, out=out)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "fp8_block", "int4_g32"])
def test_prefill_matmuls_use_it(fmt, monkeypatch):
    """Rows above the decode kernels' limit, fp32 activations: the matmuls go through dense() and equal
    x @ dequantize()^T (bf16 ones take the grouped GEMM's decoded panels where the build has it:
    test_quant_panels.py)."""
    w = _weights((3, 96, 128), 2)[fmt]()
    x = torch.randn(40, 128)
    calls = _spy(monkeypatch)
    y = quantized_grouped_mm(x, w, [17, 0, 23])
    assert len(calls) == 2  # the two experts that got rows, one dense copy each
    ref = torch.cat([x[:17] @ w[0].dequantize(x.dtype).t(), x[17:] @ w[2].dequantize(x.dtype).t()])
    _same(y, ref)
    _same(quantized_linear(x, w[1]), x @ w[1].dequantize(x.dtype).t())
